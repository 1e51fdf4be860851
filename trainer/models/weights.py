"""Initial weights: a checkpoint file, a torchvision weight name, or a Detectron .pkl; whatever fits loads."""
from __future__ import annotations

import logging
import pickle
import urllib.parse
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torchvision.models.detection._utils import overwrite_eps

from trainer import torch_load
from trainer.hashing import sha256_of
from trainer.errors import UserError, first_line, user_path
from trainer.models.builders import WEIGHT_NAME, torchvision_weight, unwrap, zero_eps_weights
from trainer.downloads import URL_SCHEMES, download, writable_cache
from trainer.models.detectron_weights import convert, read_blobs

log = logging.getLogger(__name__)

@dataclass
class LoadReport:
    source: str
    target: str  # "model" or "backbone.body"
    loaded: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # shape differs from the model's (e.g. a class head)
    missing: list = field(default_factory=list)  # the model's tensors the weights do not have
    unexpected: list = field(default_factory=list)  # the weights' tensors the model does not have


def load_weights(model: nn.Module, spec: str, option: str = "TRAIN.WEIGHTS", shown: str | None = None) -> LoadReport | None:
    """Initialise from TRAIN.WEIGHTS: a checkpoint file or a torchvision weight name; '' = nothing.
    `shown` names the weights in messages (the URI a downloaded file came from).

    Loads whatever fits: tensors of another shape are skipped, so COCO weights seed a model with
    other classes. Weights that fit the backbone body better than the model (ImageNet) go there.
    """
    if not spec:
        return None
    model, shown = unwrap(model), shown or spec
    state, weight = _read_weights(spec, option, shown, model)
    if bad := next((k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())), None):
        raise UserError(f"{option} {shown}: {bad} holds NaN or infinite values (a diverged job's weights, or a "
                        "damaged file): the first iteration's loss would be NaN")
    target, module, state = _pick_target(model, state)
    own = module.state_dict()
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    kept = {k: v for k, v in state.items() if k not in skipped}
    if not any(k in own for k in kept):
        raise UserError(f"{option} {shown} has no tensor that fits {type(model).__name__} "
                        f"(skipped for shape: {len(skipped)})")
    result = module.load_state_dict(kept, strict=False)
    missing = [k for k in result.missing_keys if k not in skipped]
    report = LoadReport(shown, target, [k for k in own if k in kept], skipped, missing, list(result.unexpected_keys))
    if weight is not None and zero_eps_weights(spec):  # as build_model does for TRAIN.WEIGHTS (eval --weights)
        overwrite_eps(model, 0.0)
    _log_report(report)
    return report


def _read_weights(spec: str, option: str, shown: str, model: nn.Module):
    if spec.startswith(URL_SCHEMES):
        path = download(spec, option)
        try:
            return _read_path(path, option, shown, model), None
        except UserError as e:  # a proxy's error page cached as weights: the next start fetches it again
            path.unlink(missing_ok=True)
            raise UserError(f"{e} (the downloaded copy was removed from the cache)") from None
    path = user_path(spec, option)
    if path.is_file():
        return _read_path(path, option, shown, model), None
    if path.exists():  # a folder, a pipe, a device
        raise UserError(f"{option} {spec}: not a weights file (a folder or a device)")
    if not WEIGHT_NAME.fullmatch(spec):
        raise UserError(f"{option} {spec}: no such file (nor a torchvision weight name such as "
                        "ResNet50_Weights.IMAGENET1K_V1)")
    if (weight := torchvision_weight(spec)) is None:
        raise UserError(f"{option} {spec}: unknown torchvision weight name")
    return _read_file(hub_file(weight, option, spec), option, spec), weight


def hub_file(weight, option: str, spec: str) -> Path:
    """torchvision's file for `weight` in torch hub's cache, downloaded there if it is not yet, and
    checked against the sha256 prefix in its name whoever put it there: torch.hub checks only what
    it downloads, and its loader (weight.get_state_dict) unpickles whatever the file holds."""
    from torch.hub import HASH_REGEX, download_url_to_file, get_dir

    name = Path(urllib.parse.urlsplit(weight.url).path).name
    path = Path(get_dir()) / "checkpoints" / name
    expected = HASH_REGEX.search(name)
    if not path.is_file():
        writable_cache(path.parent, f"{option} {spec}", "TORCH_HOME")
        try:
            download_url_to_file(weight.url, str(path), expected and expected.group(1), progress=False)
        except Exception as e:  # no network, proxy, disk full, bad hash: all the same to the user
            raise UserError(f"{option} {spec}: download failed ({type(e).__name__}: {first_line(e)}); "
                            f"fetch {weight.url} elsewhere and set {option} to the file's path") from None
    if expected and not sha256_of(path).startswith(expected.group(1)):
        raise UserError(f"{option} {spec}: {path} is not the file torchvision publishes (its sha256 does not start "
                        f"with {expected.group(1)}, as its name says): delete it, and it is downloaded again")
    return path


def _read_path(path: Path, option: str, shown: str, model: nn.Module) -> dict:
    if not zipfile.is_zipfile(path) and (path.suffix.lower() == ".pkl" or _numpy_pickle(path)):
        return convert(read_blobs(path, shown, option), model)  # Detectron's Caffe2 blobs (torch.save's are zips)
    return _read_file(path, option, shown)


def _numpy_pickle(path: Path) -> bool:
    """A pickle of numpy arrays under another name than *.pkl (R-50, model_final.pickle): read by the
    arrays-only reader too, which refuses whatever else it may hold. A legacy torch.save names torch."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:  # unreadable: torch.load's attempt says so in one line
        return False
    return head[:1] == b"\x80" and b"numpy" in head and b"torch" not in head


def load_error(e: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in words for the user. torch's own message
    suggests weights_only=False, which would run the pickle's code."""
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):  # a class or function to call
        return ("is not a weights file tracktron loads: it holds pickled objects other than tensors "
                "(unpickling them would run code)")
    if isinstance(e, pickle.UnpicklingError):
        return "is not a valid torch checkpoint (not a pickle of tensors)"
    if isinstance(e, MemoryError):  # a small file can announce a huge tensor (a compressed zip entry)
        return "does not fit in this process's memory (its tensors are larger than the memory it may use)"
    if isinstance(e, EOFError):  # torch.load of an empty file, or of one cut before its pickle
        return "is not a valid torch checkpoint (the file is empty or cut short)"
    return f"is not a valid torch checkpoint ({type(e).__name__}: {first_line(e)})"


def _read_file(path: Path, option: str, shown: str) -> dict:
    try:
        obj = torch_load.load(path)
    except Exception as e:  # pickle, zip and format errors of every kind
        raise UserError(f"{option} {shown} {load_error(e)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # our checkpoints: {'model': state_dict, 'optimizer': ..., ...}
    state = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, dict) else {}
    if not state:
        raise UserError(f"{option} {shown} holds no model weights (a state_dict or {{'model': state_dict}})")
    for key, value in state.items():  # what torch.load takes but load_state_dict cannot (a traceback there)
        if not isinstance(key, str) or value.layout != torch.strided or value.is_quantized or value.is_meta:
            what = "a key that is no name" if not isinstance(key, str) else "a sparse, quantized or meta tensor"
            raise UserError(f"{option} {shown} is not a weights file tracktron loads: {key!r} is {what}")
    if all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _pick_target(model: nn.Module, state: dict):
    candidates = [("model", model, state)]
    body = getattr(getattr(model, "backbone", None), "body", None)
    if body is not None:  # classification weights: resnet keys as they are, mobilenet's without features.
        candidates.append(("backbone.body", body, {k.removeprefix("features."): v for k, v in state.items()}))
    return max(candidates, key=lambda c: len(c[1].state_dict().keys() & c[2].keys()))


def _log_report(r: LoadReport) -> None:
    log.info("weights %s: loaded %d tensors into %s", r.source, len(r.loaded), r.target)
    if r.skipped:
        log.warning("weights %s: skipped %d whose shape differs: %s", r.source, len(r.skipped), _short(r.skipped))
    if r.missing:
        log.info("weights %s: %d left initialised: %s", r.source, len(r.missing), _short(r.missing))
    if r.unexpected:
        log.info("weights %s: %d not in the model: %s", r.source, len(r.unexpected), _short(r.unexpected))


def _short(keys: list, limit: int = 20) -> str:
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


