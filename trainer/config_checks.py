"""The config's meaning checks: every value in range and consistent with the others, before
anything is built (config.load_config calls `validate`). One (ok, message) pair per rule; the
learning-rate schedule is checked with lr_policy's formulas, the ones the solver trains with."""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path


from trainer.errors import ConfigError
from trainer.redaction import is_secret_key
from trainer.lr_policy import POLICIES, STEP_POLICIES, WARM_UP, check_schedule

LR_POLICIES, WARM_UP_METHODS = tuple(POLICIES), tuple(WARM_UP)  # lr_policy.py has each once


def dataset_dirname(name: str) -> str:
    """A catalog name as it is; a dataset folder by its last component; safe for paths and metrics."""
    if "/" in name or os.sep in name or name.startswith((".", "~")):
        try:
            name = Path(name).expanduser().resolve().name
        except (OSError, RuntimeError, ValueError):  # an unknown user's ~, a NUL: no folder, as found later
            name = Path(name).name
    return re.sub(r"[^\w.-]+", "_", name) or "dataset"


def _same_test_folders(datasets: list) -> str:
    """Evaluation writes eval/<dataset_dirname>/ and logs its metrics under that name: two test sets
    of one name (/x/a/val and /x/b/val) would overwrite each other's."""
    seen: dict = {}
    for name in datasets:
        tag = dataset_dirname(name)
        if len(tag.encode()) > 200:  # a folder name (255 bytes at most) and a metric key's prefix (250)
            return (f"TEST.DATASETS {name[:40]!r}...: a test set's name is its evaluation folder's and its metrics' "
                    f"prefix, {len(tag.encode())} bytes here; 200 at most")
        if tag in seen:
            return (f"TEST.DATASETS lists {name!r} twice" if seen[tag] == name else
                    f"TEST.DATASETS {seen[tag]!r} and {name!r} are both {tag!r} in evaluation (eval/{tag}/ and "
                    "its metrics would overwrite each other's): rename a folder or give it a DATASET_CATALOG name")
        seen[tag] = name
    return ""


def _catalog_problem(catalog: dict) -> str | None:
    """Every DATASET_CATALOG entry, used by this job or not, is {IM_DIR: folder, ANN_FN: json}, plus
    the entry's own credentials if it has any (secret-named keys, redacted wherever they would go):
    a misspelt key (ANN_FILE) or a number for a path is found now, not by a later job that names it."""
    for name, entry in catalog.items():
        if not isinstance(entry, dict):
            return f"DATASET_CATALOG.{name} must be a mapping with IM_DIR and ANN_FN, got {type(entry).__name__}"
        missing = [k for k in ("IM_DIR", "ANN_FN") if not isinstance(entry.get(k), str) or not entry[k].strip()]
        unknown = sorted(str(k) for k in entry if k not in ("IM_DIR", "ANN_FN") and not is_secret_key(str(k)))
        if missing or unknown:
            said = f"{' and '.join(missing)} missing or not a path" if missing else f"unknown key {', '.join(unknown)}"
            return (f"DATASET_CATALOG.{name} needs IM_DIR and ANN_FN (an image folder and a COCO json, each a path "
                    f"relative to DATA_DIR or absolute) and no other key but credentials: {said}")
    return None


def _best_metric_ok(cfg) -> bool:
    """`<iou type>/<stat>` of what evaluation logs for this model: the first test set's unprefixed,
    the others' as `<dataset>/<iou type>/<stat>`."""
    found = re.fullmatch(r"(?:([\w.-]+)/)?(bbox|segm|keypoints)/(AP|AP50|AP75|APs|APm|APl)", cfg.TEST.BEST_METRIC)
    if not found:
        return False
    prefix, kind, stat = found.groups()
    if prefix is not None and prefix not in {dataset_dirname(d) for d in cfg.TEST.DATASETS[1:]}:
        return False
    needs = {"bbox": "", "segm": "maskrcnn", "keypoints": "keypointrcnn"}[kind]
    return needs in cfg.MODEL.TYPE and not (kind == "keypoints" and stat == "APs")


def _model_name_ok(name: str) -> bool:
    """MLflow's registry rules, checked now rather than when the model is registered after training."""
    return not name or (bool(name.strip()) and not set("/:@#?") & set(name) and name.isprintable()
                        and name not in (".", "..") and len(name) <= 256)  # its SQL stores' column


def finite_float(key: str, number, written) -> float:
    """A number for a float key: an infinite LR or timeout is never what was meant."""
    try:
        value = float(number)
    except OverflowError:  # an integer past 1.8e308
        raise ConfigError(f"{key} is out of range: larger than a float holds ({sys.float_info.max:.2g})") from None
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {written!r}")
    return value


def int_text(n: int) -> str:
    """An integer for a message; a huge one by its size (Python refuses str() past 4,300 digits)."""
    return str(n) if n.bit_length() <= 128 else f"a number of about {int(n.bit_length() * math.log10(2)) + 1:,} digits"


# MLflow's limits on the names a job's run gets, checked now rather than once the store is made:
MAX_EXPERIMENT_NAME = 500  # mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH: create_experiment refuses more
MAX_RUN_NAME = 250  # the runs table's name is VARCHAR(250): PostgreSQL and MySQL stores refuse more
_RUN_NAME_TIME = "-YYYYmmdd-HHMMSS"  # what NAME gets as the run's name when TRACKING.RUN_NAME is empty


def _tracking_name_checks(cfg) -> list:
    t = cfg.TRACKING
    if not t.ENABLED:
        return []
    experiment = ("TRACKING.EXPERIMENT", t.EXPERIMENT) if t.EXPERIMENT else ("NAME, the experiment's name,", cfg.NAME)
    run = (("TRACKING.RUN_NAME", t.RUN_NAME) if t.RUN_NAME
           else (f"NAME, the run's name with {_RUN_NAME_TIME},", cfg.NAME + _RUN_NAME_TIME))
    return [(len(name) <= limit, f"{key} is {len(name):,} characters; MLflow takes {what} of at most {limit}")
            for (key, name), what, limit in ((experiment, "an experiment name", MAX_EXPERIMENT_NAME),
                                             (run, "a run name", MAX_RUN_NAME))]


DAY_S = 86_400  # the longest timeout or grace period (more overflows the clocks it is added to)
MAX_SIDE = 10_000  # pixels: an image side past this does not fit a batch in any GPU's memory
MAX_ITERS = 10**9  # a billion iterations is years of training; more overflows the ETA and the sampler
_POSITIVE_MODEL_KEYS = ("FPN_CHANNELS", "REPRESENTATION_SIZE", "RPN_PRE_NMS_TOP_N_TRAIN", "RPN_POST_NMS_TOP_N_TRAIN",
                        "RPN_PRE_NMS_TOP_N_TEST", "RPN_POST_NMS_TOP_N_TEST", "RPN_BATCH_SIZE_PER_IMAGE",
                        "ROI_BATCH_SIZE_PER_IMAGE", "DETECTIONS_PER_IMAGE")


def _model_and_size_checks(cfg) -> list:
    m, t = cfg.MODEL, cfg.TRAIN
    sides = {"TRAIN.SCALES": max(t.SCALES, default=0), "TRAIN.MAX_SIZE": t.MAX_SIZE,
             "TEST.SCALE": cfg.TEST.SCALE, "TEST.MAX_SIZE": cfg.TEST.MAX_SIZE}
    return [
        (m.NUM_CLASSES == -1 or m.NUM_CLASSES >= 2,
         f"MODEL.NUM_CLASSES must be -1 (from the dataset) or >= 2, got {m.NUM_CLASSES}"),
        (m.BACKBONE_WIDTH > 0, f"MODEL.BACKBONE_WIDTH must be > 0, got {m.BACKBONE_WIDTH}"),
        (-1 <= m.TRAINABLE_BACKBONE_LAYERS <= 5,
         f"MODEL.TRAINABLE_BACKBONE_LAYERS must be -1 (the default) or 0 to 5, got {m.TRAINABLE_BACKBONE_LAYERS}"),
        (all(a > 0 for a in m.ANCHOR_SIZES), f"MODEL.ANCHOR_SIZES must be positive, got {m.ANCHOR_SIZES}"),
        *((m[k] > 0, f"MODEL.{k} must be > 0, got {m[k]}") for k in _POSITIVE_MODEL_KEYS),
        *_architecture_checks(m),
        *((v <= MAX_SIDE, f"{k} must be at most {MAX_SIDE} pixels, got {v}") for k, v in sides.items()),
    ]


def validate(cfg) -> None:
    s, t = cfg.SOLVER, cfg.TRAIN
    checks = [
        (s.BASE_LR > 0, f"SOLVER.BASE_LR must be > 0, got {s.BASE_LR}"),
        (0 < s.MAX_ITER <= MAX_ITERS, f"SOLVER.MAX_ITER must be 1 to {MAX_ITERS:,}, got {s.MAX_ITER}"),
        (s.LR_POLICY in LR_POLICIES, f"SOLVER.LR_POLICY must be one of {', '.join(LR_POLICIES)}; got {s.LR_POLICY!r}"),
        (s.WARM_UP_METHOD in WARM_UP_METHODS,
         f"SOLVER.WARM_UP_METHOD must be one of {', '.join(WARM_UP_METHODS)}; got {s.WARM_UP_METHOD!r}"),
        (s.WARM_UP_ITERS >= 0, f"SOLVER.WARM_UP_ITERS must be >= 0, got {s.WARM_UP_ITERS}"),
        (s.GAMMA > 0, f"SOLVER.GAMMA must be > 0, got {s.GAMMA}"),
        (s.STEP_SIZE > 0, f"SOLVER.STEP_SIZE must be > 0, got {s.STEP_SIZE}"),
        (all(a < b for a, b in zip(s.STEPS, s.STEPS[1:])), f"SOLVER.STEPS must be increasing, got {s.STEPS}"),
        (all(x >= 0 for x in s.STEPS), f"SOLVER.STEPS must be >= 0, got {s.STEPS}"),
        (s.WEIGHT_DECAY >= 0 and s.MOMENTUM >= 0, "SOLVER.WEIGHT_DECAY and SOLVER.MOMENTUM must be >= 0"),
        (s.BIAS_LR_FACTOR > 0, f"SOLVER.BIAS_LR_FACTOR must be > 0, got {s.BIAS_LR_FACTOR}"),
        (s.CLIP_GRAD_NORM >= 0, f"SOLVER.CLIP_GRAD_NORM must be >= 0, got {s.CLIP_GRAD_NORM}"),
        (t.SNAPSHOT_ITERS > 0, f"TRAIN.SNAPSHOT_ITERS must be > 0, got {t.SNAPSHOT_ITERS}"),
        (t.IMS_PER_BATCH > 0, f"TRAIN.IMS_PER_BATCH must be > 0, got {t.IMS_PER_BATCH}"),
        (t.SCALES and all(x > 0 for x in t.SCALES), f"TRAIN.SCALES must be positive sizes, got {t.SCALES}"),
        (t.MAX_SIZE > 0, f"TRAIN.MAX_SIZE must be > 0, got {t.MAX_SIZE}"),
        (t.CHECKPOINTS_KEEP >= 1, f"TRAIN.CHECKPOINTS_KEEP must be >= 1, got {t.CHECKPOINTS_KEEP}"),
        (0 < t.PREEMPT_GRACE_S <= DAY_S, f"TRAIN.PREEMPT_GRACE_S must be > 0 and <= {DAY_S}, got {t.PREEMPT_GRACE_S}"),
        (0 <= cfg.RNG_SEED < 2**32, f"RNG_SEED must be in [0, 2**32), got {cfg.RNG_SEED}"),
        (cfg.NUM_GPUS >= 1, f"NUM_GPUS must be >= 1, got {cfg.NUM_GPUS}"),
        (1 <= cfg.LOG_PERIOD <= MAX_ITERS, f"LOG_PERIOD must be 1 to {MAX_ITERS:,}, got {cfg.LOG_PERIOD}"),
        (cfg.OUTPUT_DIR.strip() != "", "OUTPUT_DIR must name a folder, got an empty value (YAML reads a bare `~` or "
         "`null` as none: write the path, e.g. ~/runs/demo)"),
        (not re.match(r"[A-Za-z][\w+.-]*://", cfg.OUTPUT_DIR), f"OUTPUT_DIR must be a folder on this machine, not a URL "
         f"({cfg.OUTPUT_DIR.split('://')[0]}://...): checkpoints reach the tracking server's artifact store from there"),
        (cfg.OUTPUT_DIR.isprintable(), f"OUTPUT_DIR must be printable (no newline or control character), got {cfg.OUTPUT_DIR!r}"),
        (cfg.DATA_DIR.strip() != "", "DATA_DIR must name a folder, got an empty value (an unset variable? the "
         "default is datasets)"),
        (cfg.DATA_DIR.isprintable(), f"DATA_DIR must be printable (no newline or control character), got {cfg.DATA_DIR!r}"),
        (cfg.DATA_LOADER.NUM_THREADS >= 0, f"DATA_LOADER.NUM_THREADS must be >= 0, got {cfg.DATA_LOADER.NUM_THREADS}"),
        (cfg.TEST.EVAL_PERIOD >= 0, f"TEST.EVAL_PERIOD must be >= 0, got {cfg.TEST.EVAL_PERIOD}"),
        (cfg.TEST.IMS_PER_BATCH > 0, f"TEST.IMS_PER_BATCH must be > 0, got {cfg.TEST.IMS_PER_BATCH}"),
        (_best_metric_ok(cfg), f"TEST.BEST_METRIC {cfg.TEST.BEST_METRIC!r} is no metric this model's evaluation "
                               f"gives (e.g. bbox/AP, bbox/AP50{', segm/AP' if 'mask' in cfg.MODEL.TYPE else ''}; "
                               "<dataset>/bbox/AP for a test set after the first)"),
        (0 <= cfg.TEST.VIS_IMAGES <= 100, f"TEST.VIS_IMAGES must be 0 to 100, got {cfg.TEST.VIS_IMAGES}"),
        (cfg.TEST.SCALE > 0 and cfg.TEST.MAX_SIZE > 0,
         f"TEST.SCALE and TEST.MAX_SIZE must be > 0, got {cfg.TEST.SCALE} and {cfg.TEST.MAX_SIZE}"),
        (all(lr > 0 for lr in s.LRS), f"SOLVER.LRS must all be > 0, got {s.LRS}"),
        (s.WARM_UP_FACTOR >= 0, f"SOLVER.WARM_UP_FACTOR must be >= 0, got {s.WARM_UP_FACTOR}"),
        (0 <= cfg.TRACKING.FLUSH_TIMEOUT_S <= DAY_S,
         f"TRACKING.FLUSH_TIMEOUT_S must be 0 to {DAY_S} seconds, got {cfg.TRACKING.FLUSH_TIMEOUT_S}"),
        (cfg.TRACKING.CHECKPOINTS_KEEP >= 0,
         f"TRACKING.CHECKPOINTS_KEEP must be >= 0 (0 keeps every checkpoint), got {cfg.TRACKING.CHECKPOINTS_KEEP}"),
        (_model_name_ok(cfg.TRACKING.REGISTERED_MODEL),
         f"TRACKING.REGISTERED_MODEL {cfg.TRACKING.REGISTERED_MODEL!r} cannot name a registered model "
         "(1 to 256 characters, not blank, and no '/', ':', '@', '#' or '?', which models:/ URIs could not name)"),
        (not (cfg.CUDNN_BENCHMARK and cfg.DETERMINISTIC),
         "CUDNN_BENCHMARK true lets cuDNN pick its algorithms by timing them, so two runs may differ: it cannot go "
         "with DETERMINISTIC true"),
        (cfg.TRACKING.SYSTEM_METRICS in ("auto", "true", "false"),
         f"TRACKING.SYSTEM_METRICS must be auto, true or false; got {cfg.TRACKING.SYSTEM_METRICS!r}"),
    ] + _model_and_size_checks(cfg) + _tracking_name_checks(cfg)
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if problem := _catalog_problem(cfg.DATASET_CATALOG):
        raise ConfigError(problem)
    if clash := _same_test_folders(cfg.TEST.DATASETS):
        raise ConfigError(clash)
    if s.LR_POLICY == "steps_with_lrs" and len(s.LRS) != len(s.STEPS):
        raise ConfigError(f"SOLVER.LRS needs one rate per step: {len(s.STEPS)} STEPS, {len(s.LRS)} LRS")
    if s.LR_POLICY in STEP_POLICIES and (not s.STEPS or s.STEPS[0] != 0):
        raise ConfigError(f"SOLVER.LR_POLICY {s.LR_POLICY} needs SOLVER.STEPS starting at 0, got {s.STEPS}")
    check_schedule(s)


_FRACTIONS = ("RPN_NMS_THRESH", "RPN_FG_IOU", "RPN_BG_IOU", "RPN_POSITIVE_FRACTION", "POSITIVE_FRACTION")
_OR_DEFAULT = ("FG_IOU", "BG_IOU", "NMS_THRESH", "SCORE_THRESH")  # -1 = torchvision's for the type


# Sizes past these allocate more than any machine has (an allocator traceback, or the OOM killer).
MAX_CLASSES = 100_000  # a classifier's last layer past it takes gigabytes (the data's categories too)
_CEILINGS = {"BACKBONE_WIDTH": 8, "NUM_CLASSES": MAX_CLASSES, "FPN_CHANNELS": 4096, "REPRESENTATION_SIZE": 16_384,
             "BOX_POOL_SIZE": 64, "MASK_POOL_SIZE": 64, "KEYPOINT_POOL_SIZE": 64, "DETECTIONS_PER_IMAGE": 100_000}
MAX_BOX_HEAD_WEIGHTS = 1_000_000_000  # 4 GB of float32 in one layer; Detectron's is 12.8 M (256 x 7² x 1024)


def _box_head_weights(m) -> int:
    """Each size within its ceiling can still make a layer of a trillion weights. Only an FPN R-CNN has
    that layer: C4's box head is res5, and the single-stage models have none."""
    if m.FEATURES != "fpn" or "rcnn" not in m.TYPE:
        return 0
    return m.FPN_CHANNELS * m.BOX_POOL_SIZE ** 2 * m.REPRESENTATION_SIZE


def _architecture_checks(m) -> list:
    """Detectron's architecture keys (models/backbones.py builds them)."""
    one_of = {"FEATURES": ("fpn", "c4"), "BACKBONE_NORM": ("", "GN"), "FPN_NORM": ("", "GN"),
              "HEAD_NORM": ("", "GN"), "BOX_HEAD": ("2fc", "4conv1fc")}
    box_head = _box_head_weights(m)
    return [
        *((m[k] in v, f"MODEL.{k} must be one of {', '.join(map(repr, v))}; got {m[k]!r}") for k, v in one_of.items()),
        *((m[k] > 0, f"MODEL.{k} must be > 0, got {m[k]}") for k in ("BOX_POOL_SIZE", "MASK_POOL_SIZE",
                                                                        "KEYPOINT_POOL_SIZE")),
        (m.POOL_SAMPLING_RATIO >= 0, f"MODEL.POOL_SAMPLING_RATIO must be >= 0, got {m.POOL_SAMPLING_RATIO}"),
        (all(r > 0 for r in m.ANCHOR_RATIOS), f"MODEL.ANCHOR_RATIOS must be positive, got {m.ANCHOR_RATIOS}"),
        (len(m.PIXEL_MEAN) in (0, 3) and len(m.PIXEL_STD) in (0, 3) and all(x > 0 for x in m.PIXEL_STD),
         f"MODEL.PIXEL_MEAN and PIXEL_STD must be [] or three values (RGB, std > 0); got {m.PIXEL_MEAN}, {m.PIXEL_STD}"),
        *((0 <= m[k] <= 1, f"MODEL.{k} must be 0 to 1, got {m[k]}") for k in _FRACTIONS),
        *((m[k] == -1 or 0 <= m[k] <= 1, f"MODEL.{k} must be -1 (torchvision's) or 0 to 1, got {m[k]}")
          for k in _OR_DEFAULT),
        (m.RPN_BG_IOU <= m.RPN_FG_IOU, f"MODEL.RPN_BG_IOU {m.RPN_BG_IOU} must not exceed MODEL.RPN_FG_IOU {m.RPN_FG_IOU}"),
        (m.BG_IOU <= (m.FG_IOU if m.FG_IOU != -1 else 0.5),  # torchvision's foreground IoU is 0.5 for every type
         f"MODEL.BG_IOU {m.BG_IOU} must not exceed MODEL.FG_IOU ({m.FG_IOU if m.FG_IOU != -1 else 0.5})"),
        *((m[k] <= high, f"MODEL.{k} must be at most {high:,}, got {m[k]:,}") for k, high in _CEILINGS.items()),
        (box_head <= MAX_BOX_HEAD_WEIGHTS, "MODEL.FPN_CHANNELS x BOX_POOL_SIZE² x REPRESENTATION_SIZE (the box "
         f"head's first layer) must be at most {MAX_BOX_HEAD_WEIGHTS:,} weights, got {box_head:,}"),
        (m.TOPK_CANDIDATES == -1 or m.TOPK_CANDIDATES > 0,
         f"MODEL.TOPK_CANDIDATES must be -1 (torchvision's) or > 0, got {m.TOPK_CANDIDATES}"),
    ]
