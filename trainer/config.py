"""Configuration: Detectron's key names, typed defaults, YAML files and `KEY VALUE` overrides.

Every key has a default here; its type is the default's type. Unknown keys are errors (with the
closest valid key suggested), values are coerced the way Detectron's YAML writes them
(`SCALES: (800,)`, `DATASETS: ('a', 'b')`), and `validate()` rejects values that cannot work.
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
from pathlib import Path

import yaml

from trainer.atomic_write import write_atomic
from trainer.config_checks import finite_float, int_text, validate
from trainer.config_detectron import Translation, is_detectron, translate
from trainer.config_yaml import Bool, Float, Int, literal, parse_override, plain, read_yaml
from trainer.errors import ConfigError, user_path
from trainer.redaction import REDACTED, is_secret_key, redact_typed_url, redact_urls, remember, remember_url_credentials

log = logging.getLogger(__name__)

# A new key: add it to job_identity._LATER_KEYS too (unless its _NOT_IN_JOB covers it: TRACKING, TEST,
# ...), or every existing job's hash changes and AUTO_RESUME no longer finds their runs.
_DEFAULTS: dict = {
    "NAME": "",  # the job's readable name; defaults to the config file's stem
    "MODEL": {
        "TYPE": "fasterrcnn_resnet50_fpn",
        "NUM_CLASSES": -1,  # including background; -1 = from the training dataset
        # Tiny-model keys (CPU tests, the demo). '' / -1 / [] keep torchvision's choice.
        "BACKBONE": "",  # resnet18/34/50/101, mobilenet_v3_large
        "BACKBONE_WIDTH": 1.0,  # mobilenet width multiplier
        "FPN_CHANNELS": 256,
        "TRAINABLE_BACKBONE_LAYERS": -1,
        "ANCHOR_SIZES": [],  # one size per feature level
        "REPRESENTATION_SIZE": 1024,  # R-CNN box head MLP width
        "RPN_PRE_NMS_TOP_N_TRAIN": 2000,
        "RPN_POST_NMS_TOP_N_TRAIN": 2000,
        "RPN_PRE_NMS_TOP_N_TEST": 1000,
        "RPN_POST_NMS_TOP_N_TEST": 1000,
        "RPN_BATCH_SIZE_PER_IMAGE": 256,
        "ROI_BATCH_SIZE_PER_IMAGE": 512,
        "DETECTIONS_PER_IMAGE": 100,
        # Detectron's architectures (docs/DETECTRON.md); all but PIXEL_* need MODEL.BACKBONE set.
        "FEATURES": "fpn",  # or "c4": res2-res4 for the RPN, res5 as the box head (R-CNN types)
        "STRIDE_IN_1X1": False,  # MSRA's ResNets (Detectron's weights) downsample in the 1x1 conv
        "BACKBONE_NORM": "",  # "" = BatchNorm (frozen with TRAIN.WEIGHTS), "GN" = GroupNorm(32)
        "FPN_NORM": "",  # "" or "GN"
        "HEAD_NORM": "",  # "" or "GN": the conv box head's and the mask head's convs
        "BOX_HEAD": "2fc",  # R-CNN box head: "2fc" (two REPRESENTATION_SIZE layers) or "4conv1fc"
        "P6_FROM_C5": False,  # single-stage types: P6 from C5 (Detectron's RetinaNet) instead of P5
        "BOX_POOL_SIZE": 7,  # RoIAlign output sizes (C4: 14) and sampling ratio (0 = adaptive)
        "MASK_POOL_SIZE": 14,
        "KEYPOINT_POOL_SIZE": 14,
        "POOL_SAMPLING_RATIO": 2,
        "ANCHOR_RATIOS": [],  # height/width; [] = 0.5, 1, 2
        "PIXEL_MEAN": [],  # RGB, 0-255; [] = torchvision's ImageNet mean and std
        "PIXEL_STD": [],
        "RPN_NMS_THRESH": 0.7,
        "RPN_FG_IOU": 0.7,
        "RPN_BG_IOU": 0.3,
        "RPN_POSITIVE_FRACTION": 0.5,
        # The detector head's matcher, sampling and test-time filter: -1 = torchvision's for the type.
        "FG_IOU": -1.0,
        "BG_IOU": -1.0,
        "POSITIVE_FRACTION": 0.25,  # R-CNN box sampling
        "NMS_THRESH": -1.0,
        "SCORE_THRESH": -1.0,
        "TOPK_CANDIDATES": -1,  # single-stage types: candidates per level before NMS
        "CLS_AGNOSTIC_MASK": False,  # one mask per box whatever its class (Detectron's CLS_SPECIFIC_MASK False)
    },
    "NUM_GPUS": 1,
    "RNG_SEED": 3,
    "OUTPUT_DIR": "output",
    "DATA_DIR": "datasets",
    "DATASET_CATALOG": {},  # open mapping: name -> {IM_DIR: ..., ANN_FN: ...}
    "LOG_PERIOD": 20,
    "DETERMINISTIC": False,
    # cuDNN times its algorithms for each new input shape (detectron2's key and default): detection
    # batches come in many shapes, so this costs more than it gains until the shapes repeat
    "CUDNN_BENCHMARK": False,
    "SOLVER": {
        "BASE_LR": 0.001,
        "LR_POLICY": "step",
        "GAMMA": 0.1,
        "STEP_SIZE": 30000,
        "STEPS": [],
        "LRS": [],
        "MAX_ITER": 40000,
        "MOMENTUM": 0.9,
        "WEIGHT_DECAY": 0.0005,
        "NO_DECAY_NORM_AND_BIAS": False,
        "BIAS_LR_FACTOR": 1.0,  # biases learn at this times the LR (Detectron: 2, its BIAS_DOUBLE_LR)
        "WARM_UP_ITERS": 500,
        "WARM_UP_FACTOR": 1.0 / 3.0,
        "WARM_UP_METHOD": "linear",
        "CLIP_GRAD_NORM": 0.0,  # 0 = no clipping
        "AMP": False,  # mixed precision, CUDA only
    },
    "TRAIN": {
        "DATASETS": [],
        "IMS_PER_BATCH": 2,  # per GPU, as in Detectron
        "SCALES": [600],
        "MAX_SIZE": 1000,
        "USE_FLIPPED": True,
        "ASPECT_GROUPING": True,
        "SNAPSHOT_ITERS": 20000,
        "CHECKPOINTS_KEEP": 3,
        "AUTO_RESUME": True,
        "WEIGHTS": "",
        "PREEMPT_GRACE_S": 25.0,
    },
    "TEST": {
        "DATASETS": [],
        "SCALE": 600,
        "MAX_SIZE": 1000,
        "IMS_PER_BATCH": 2,  # images loaded together; the network sees runs of one size (evaluation.py)
        "EVAL_PERIOD": 0,  # 0 = only after the final model
        "BEST_METRIC": "bbox/AP",  # which evaluated checkpoint is best (higher is better)
        "VIS_IMAGES": 4,  # validation images drawn with their detections at each evaluation
    },
    "DATA_LOADER": {"NUM_THREADS": 4},
    "TRACKING": {
        "ENABLED": True,
        "URI": "",
        "EXPERIMENT": "",
        "RUN_NAME": "",
        "REGISTERED_MODEL": "",
        "LOG_MODEL": True,
        "FLUSH_TIMEOUT_S": 300.0,  # how long a job that ended waits for its uploads (model_final, the model)
        "CHECKPOINTS_KEEP": 0,  # model_iter checkpoints kept in the run on the server: the newest N (0: all)
        "SYSTEM_METRICS": "auto",  # CPU/memory/GPU as system/ metrics: auto = on for GPU runs
    },
}

# Element types of list-valued keys (an empty default says nothing about them).
_ITEM_TYPES = {
    "MODEL.ANCHOR_SIZES": int,
    "MODEL.ANCHOR_RATIOS": float,
    "MODEL.PIXEL_MEAN": float,
    "MODEL.PIXEL_STD": float,
    "SOLVER.STEPS": int,
    "SOLVER.LRS": float,
    "TRAIN.DATASETS": str,
    "TRAIN.SCALES": int,
    "TEST.DATASETS": str,
}
_OPEN_KEYS = {"DATASET_CATALOG"}  # mappings whose contents are the user's own
MAX_INT = 2**53  # the largest integer a config takes (and JSON, MLflow's params, float64 hold exactly)


class Config(dict):
    """A nested dict with attribute access: cfg.SOLVER.BASE_LR."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        if name not in self:  # a typo must not silently become an attribute nobody reads
            raise AttributeError(f"unknown config key {name}")
        self[name] = value


def _wrap(d: dict) -> Config:
    return Config({k: _wrap(v) if isinstance(v, dict) else v for k, v in d.items()})


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in _OPEN_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


_FLAT_DEFAULTS = flatten(_DEFAULTS)
_ALL_KEYS = sorted(_FLAT_DEFAULTS)


def defaults() -> Config:
    return _wrap(copy.deepcopy(_DEFAULTS))


def _unknown(key: str) -> ConfigError:
    if not key.isprintable():  # a newline or a control character: show it escaped, on one line
        return ConfigError(f"unknown config key {key!r}")
    close = difflib.get_close_matches(key.upper(), _ALL_KEYS, n=1, cutoff=0.6)
    if not close:  # a misspelt leaf under the right section still deserves a suggestion
        leaf = key.rsplit(".", 1)[-1].upper()
        close = [k for k in _ALL_KEYS if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.8)][:1]
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown config key {key}{hint}")


def _coerce(key: str, value, default):
    """Return `value` as the type of `default`, or raise ConfigError naming the key."""
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return plain(value)
    if isinstance(default, bool):
        if isinstance(value, Bool):  # true, yes, off... as YAML 1.1 reads them
            return value.truth
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:  # past any count or size; Python's ints would overflow later, in C
                raise ConfigError(f"{key} is out of range: {int_text(value)} (at most {MAX_INT:,})")
            return int(value)
    elif isinstance(default, float):
        number = value
        if isinstance(value, str):  # PyYAML reads 1e-2 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return finite_float(key, number, value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return str(value)  # a Bool (yes, off) as written, as a plain str: a checkpoint holds only plain data
        if isinstance(value, (Int, Float)):  # as written, not as YAML 1.1 reads it
            return value.source
        if value is None:
            return ""
        if isinstance(value, bool):  # YAML reads `true` as a boolean
            return str(value).lower()
        if isinstance(value, (int, float)):  # a run name such as 2024
            return str(value)
    elif isinstance(default, list):
        if isinstance(value, str):
            value = literal(value)
            if isinstance(value, str):  # `a, b`, or a tuple of bare names: `(a, b)`
                inner = value.strip()
                inner = inner[1:-1] if inner[:1] + inner[-1:] in ("()", "[]") else inner
                value = [v.strip().strip("'\"") for v in inner.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        item_type = _ITEM_TYPES.get(key, type(default[0]) if default else str)
        item_default = item_type()
        return [_coerce(f"{key}[{i}]", v, item_default) for i, v in enumerate(value)]
    raise ConfigError(f"{key} must be {type(default).__name__}, got {value!r}")


def _set(cfg: Config, key: str, value) -> None:
    parts = key.split(".")
    if parts[0] in _OPEN_KEYS and len(parts) > 1:  # open mappings take any nested key
        node = cfg[parts[0]]
        for i, part in enumerate(parts[1:-1], start=2):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parts[:i])} is {node!r}, not a mapping; cannot set {key}")
        node[parts[-1]] = plain(value)
        return
    node, default = cfg, _DEFAULTS
    for part in parts[:-1]:
        if part not in default or not isinstance(default[part], dict):
            raise _unknown(key)
        node, default = node[part], default[part]
    leaf = parts[-1]
    if leaf not in default or (isinstance(default[leaf], dict) and leaf not in _OPEN_KEYS):
        raise _unknown(key)
    node[leaf] = _coerce(key, value, default[leaf])


def merge(cfg: Config, data: dict, prefix: str = "") -> None:
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in _OPEN_KEYS:
            if key not in _ALL_KEYS and not any(a.startswith(key + ".") for a in _ALL_KEYS):
                raise _unknown(key)
            merge(cfg, v, key + ".")
        else:
            _set(cfg, key, v)


def load_config(path: str | Path | None = None, opts: list[str] | tuple = ()) -> Config:
    """Defaults, then the YAML file, then `KEY VALUE` pairs; validated."""
    return load_config_explained(path, opts)[0]


def load_config_explained(path: str | Path | None = None, opts: list[str] | tuple = ()):
    """(the config, and for a Detectron file how its keys were translated, else None)."""
    cfg, translation = defaults(), None
    if path is not None:
        if not str(path).strip():  # Path("") is ".", which no user typed
            raise ConfigError("--config is empty: name a YAML config file (see configs/)")
        try:
            data = read_yaml(Path(path))
            if is_detectron(data):
                translation = _from_detectron(cfg, data, Path(path))
            else:
                merge(cfg, data)
        except RecursionError:  # YAML nested hundreds deep: no config is
            raise ConfigError(f"{path}: nested too deeply to be a config") from None
        cfg["NAME"] = cfg.NAME or Path(path).stem
    if flag := next((k for k in opts[0::2] if str(k).startswith("-")), None):  # `-- $(opts)` of MLproject
        raise ConfigError(f"{flag!r} among the KEY VALUE overrides: options go before them")
    if len(opts) % 2:
        raise ConfigError(f"overrides come in KEY VALUE pairs; {opts[-1]!r} has no value")
    for key, value in zip(opts[0::2], opts[1::2]):
        if is_secret_key(str(key)):
            remember(value)  # before anything can echo it
        remember_url_credentials(str(value))
        try:
            _set(cfg, key, parse_override(value, isinstance(_FLAT_DEFAULTS.get(key), str), key))
        except RecursionError:
            raise ConfigError(f"{key}: the value is nested too deeply to be a config value") from None
    if translation is not None and "OUTPUT_DIR" not in opts[0::2]:  # Detectron's path names the final datasets
        cfg["OUTPUT_DIR"] = translation.values["OUTPUT_DIR"] = translation.output_dir(cfg.TRAIN.DATASETS)
    cfg.TRACKING.SYSTEM_METRICS = cfg.TRACKING.SYSTEM_METRICS.lower()  # `True`, as YAML reads it in a file
    if cfg.OUTPUT_DIR.startswith("~"):  # as DATA_DIR and every path option: not a folder named ~ here
        cfg["OUTPUT_DIR"] = str(user_path(cfg.OUTPUT_DIR, "OUTPUT_DIR"))
    _remember_secrets(cfg)
    validate(cfg)
    return cfg, translation


def _from_detectron(cfg: Config, data: dict, path: Path) -> Translation:
    try:
        translation = translate(data)
        for key, value in translation.values.items():
            _set(cfg, key, value)
    except ConfigError as e:
        raise ConfigError(f"{path} (a Detectron config): {e}") from None
    if translation.ignored:
        log.warning("%s is a Detectron config; %d of its keys mean nothing here and are ignored: %s", path,
                    len(translation.ignored), ", ".join(translation.ignored))
    if translation.renamed:
        log.warning("%s uses keys Detectron renamed, read under their new names: %s", path,
                    ", ".join(translation.renamed))
    return translation


def config_from_dict(data: dict) -> Config:
    """A config saved in a checkpoint, read back as load_config reads a file (checked the same way)."""
    cfg = defaults()
    merge(cfg, data)
    validate(cfg)
    return cfg


def redacted(cfg: dict) -> dict:
    """A plain copy of the config safe to write anywhere (files, checkpoints, params): secret-named
    values and URL credentials replaced; everything else a re-run needs is kept."""
    def clean(key, value):
        if isinstance(value, dict):
            return {k: clean(k, v) for k, v in value.items()}
        if is_secret_key(str(key)):
            return REDACTED
        if isinstance(value, list):
            return [clean("", v) for v in value]
        if not isinstance(value, str):
            return value
        # A weights URL carries no credentials (downloads.py refuses them), so its `host:port/…@…` is
        # a path with an `@` (parent@v1.pth): it names the parent, and the job with it.
        return redact_urls(value if key == "WEIGHTS" else redact_typed_url(value))

    return clean("", json.loads(json.dumps(cfg)))


def _remember_secrets(node: dict) -> None:
    """Values of secret-named keys (DATASET_CATALOG's entries too), and URLs' credentials as typed, for
    redaction wherever they go."""
    for key, value in node.items():
        if isinstance(value, dict):
            _remember_secrets(value)
        elif is_secret_key(str(key)):
            remember(value)
        elif isinstance(value, str):
            remember_url_credentials(value)


def write_config(cfg: Config, path: Path) -> None:
    """config.yaml, redacted: it is uploaded to the run and read by anyone who can see it."""
    write_atomic(path, yaml.safe_dump(redacted(cfg), sort_keys=False))
