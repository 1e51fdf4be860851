"""The checks of a job that need its data, its network or its weights, made before a run is made for
it. The engine then trains on what was built here, so nothing is built or downloaded twice."""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.checkpoint.state import CheckpointError, newest_valid, restore_rng
from trainer.config import Config
from trainer.job_identity import job_keys
from trainer.errors import UserError, first_line
from trainer.data import build_train_dataset, check_test_datasets
from trainer.data.checks import category_difference, same_categories
from trainer.data.coco import check_batch_size
from trainer.distributed import check_devices
from trainer.inference import categories_of, category_key_of
from trainer.lineage import initial_weights
from trainer.models import build_model, load_weights, unread_keys
from trainer.solver import build_lr_scheduler, build_optimizer
from trainer.tracking.model_uris import check_source

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    dataset: object
    model: torch.nn.Module
    weights_loaded: bool = False  # TRAIN.WEIGHTS is in the model already (load_initial_weights) ...
    parent: dict = field(default_factory=dict)  # ... and the model in MLflow they came from, for the run
    local: tuple[Path, dict] | None = None  # the newest checkpoint in OUTPUT_DIR (this job's) ...
    local_checked: bool = False  # ... when check_local looked (rank 0 of a resumable job)
    test_sizes: dict = field(default_factory=dict)  # TEST.DATASETS' numbers of images, by name


def seed_everything(cfg: Config) -> None:
    random.seed(cfg.RNG_SEED)
    np.random.seed(cfg.RNG_SEED)
    torch.manual_seed(cfg.RNG_SEED)
    if cfg.DETERMINISTIC:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # Off unless asked (detectron2's default): a padded batch's shape follows its images' aspect
    # ratios, and cuDNN times its algorithms again for every new shape
    torch.backends.cudnn.benchmark = cfg.CUDNN_BENCHMARK and not cfg.DETERMINISTIC


def check_deterministic(cfg: Config) -> None:
    """DETERMINISTIC makes torch raise at an op with no deterministic CUDA kernel, such as the backward of
    the keypoint head's bilinear upsampling: a keypointrcnn job on a GPU would fail at its first step."""
    if cfg.DETERMINISTIC and cfg.MODEL.TYPE.startswith("keypointrcnn") and torch.cuda.is_available():
        raise UserError(f"DETERMINISTIC true cannot train {cfg.MODEL.TYPE} on a GPU: its keypoint head upsamples "
                        "bilinearly, and torch has no deterministic CUDA backward for that; set DETERMINISTIC false")


def prepare(cfg: Config) -> Prepared:
    """UserError for the first thing that would stop the job. Seeds first: the network's random
    initialisation is the job's."""
    check_devices()
    check_deterministic(cfg)
    seed_everything(cfg)
    dataset = build_train_dataset(cfg)
    test_sizes = check_test_datasets(cfg, dataset)
    check_batch_size(cfg, dataset)
    model = build_model(cfg, dataset.num_classes, getattr(dataset, "num_keypoints", 0))
    if unread := unread_keys(cfg):  # said, not refused: a config shared across model types is no mistake
        log.warning("%d of the MODEL keys set mean nothing for %s and are ignored: %s", len(unread), cfg.MODEL.TYPE,
                    ", ".join(unread))
    if cfg.TRACKING.REGISTERED_MODEL and not cfg.TRACKING.LOG_MODEL and cfg.TRACKING.ENABLED:
        log.warning("TRACKING.REGISTERED_MODEL %r is ignored: TRACKING.LOG_MODEL is false, so no model is logged "
                    "to register", cfg.TRACKING.REGISTERED_MODEL)
    return Prepared(dataset, model, test_sizes=test_sizes)


def load_initial_weights(cfg: Config, prepared: Prepared) -> None:
    """TRAIN.WEIGHTS (a file, a URL, a torchvision name, a model in MLflow) into the network of a job
    that starts from iteration 0, before its run is made (a resumed job's checkpoint holds its weights)."""
    if not cfg.TRAIN.WEIGHTS:
        return
    check_source(cfg, cfg.TRAIN.WEIGHTS)  # an MLflow URI names something: said more plainly than its download
    with initial_weights(cfg) as (weights, parent):
        load_weights(prepared.model, weights, shown=cfg.TRAIN.WEIGHTS)
    prepared.weights_loaded, prepared.parent = True, parent


def check_local(cfg: Config, prepared: Prepared | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint in OUTPUT_DIR that loads and that the engine can restore into the
    network built here (others are skipped with a warning), kept in `prepared`; UserError when it is
    another job's, or when none restores but one loads (a start from iteration 0 would write over it)."""
    unrestorable = []

    def usable(path: Path, state: dict) -> None:
        check_same_job(cfg, path, state)
        check_named_iteration(cfg, path, state)
        if prepared is not None:
            if path.name != FINAL:  # a finished job needs no data
                check_same_categories(path, state, prepared.dataset)
            try:
                check_restores(cfg, path, state, prepared.model)
            except CheckpointError as e:
                unrestorable.append(e)
                raise

    local = newest_valid(Path(cfg.OUTPUT_DIR), usable)
    if local is None and unrestorable:
        raise UserError(f"{unrestorable[0]}; no checkpoint in OUTPUT_DIR does: move them out of it, or --no-resume "
                        "to start this job over (they move to earlier-<time>/)")
    if prepared is not None:
        prepared.local, prepared.local_checked = local, True
    return local


_NUMBERS = ("lr", "momentum", "weight_decay", "dampening")  # what SGD's step computes with
_SCALER = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")  # GradScaler's


def check_restores(cfg: Config, path, state: dict, model: torch.nn.Module) -> None:
    """The engine's restore of `state`, tried before the run is made, so that a checkpoint that loads but
    does not restore makes way for its predecessor. Nothing changes: the weights are compared, not loaded,
    the optimizer is a new one, the CPU's RNGs are put back."""
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()  # CPU's: no CUDA context made here
    try:
        weights, own = state["model"], model.state_dict()
        if not isinstance(weights, dict) or weights.keys() != own.keys():
            raise ValueError("the weights are not those of this network (other names)")
        if other := [k for k, v in own.items() if not isinstance(weights[k], torch.Tensor) or weights[k].shape != v.shape]:
            raise ValueError(f"{other[0]} is no tensor of shape {tuple(own[other[0]].shape)}")
        if path.name == FINAL:  # a finished job restores nothing else
            return
        optimizer = build_optimizer(cfg, model)
        optimizer.load_state_dict(state["optimizer"])
        if not all(type(g[k]) in (int, float) for g in optimizer.param_groups for k in _NUMBERS):
            raise ValueError(f"the optimizer's {'/'.join(_NUMBERS)} are not all numbers")
        if any(t.shape != p.shape for p, held in optimizer.state.items() for t in held.values()
               if isinstance(t, torch.Tensor) and t.dim()):
            raise ValueError("the optimizer's momentum is not of its parameters' shapes")
        scheduler = build_lr_scheduler(cfg, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        if type(scheduler.last_epoch) is not int:
            raise ValueError("the scheduler's iteration is not a number")
        if not (isinstance(state["rng"], list) and state["rng"]):
            raise ValueError("no random states")
        for rng in state["rng"]:
            if not (isinstance(rng.get("cuda"), list)
                    and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng["cuda"])):
                raise ValueError("no CUDA random states")
            restore_rng({**rng, "cuda": []})
        scaler = state.get("scaler") or {}
        if not (isinstance(scaler, dict) and all(type(scaler.get(k, 0)) in (int, float) for k in _SCALER)):
            raise ValueError(f"the AMP scaler's {'/'.join(_SCALER)} are not all numbers")
    except Exception as e:
        raise CheckpointError(f"{path}: it does not restore into this job's network and optimizer "
                              f"({type(e).__name__}: {first_line(e)})") from None
    finally:
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])


def check_same_job(cfg: Config, path: Path, state: dict) -> None:
    """Never resume (or call finished) another job's checkpoints left in OUTPUT_DIR."""
    ours, theirs = job_keys(cfg), job_keys(state.get("config", {}))
    if ours != theirs:
        diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise UserError(f"{path} is from another job ({', '.join(diff[:4])} differ): use another "
                        "OUTPUT_DIR, or --no-resume to start this job over in it")


def check_named_iteration(cfg: Config, path: Path, state: dict) -> None:
    """A checkpoint holds the iteration its name says (model_final: the job's last): one copied over
    another (model_iter2.pth as model_final.pth) would pass for a finished job or resume the wrong iterations."""
    last = cfg.SOLVER.MAX_ITER - 1
    named = last if path.name == FINAL else iteration_of(path.name)
    held = state.get("iteration")
    if type(held) is not int or held != named:  # 5.0 == 5 and tensor(5) == 5, yet neither is an iteration
        raise UserError(f"{path} holds iteration {held!r}, not the {named} its name says (a file "
                        "copied or renamed): move it out of OUTPUT_DIR")
    if named > last:
        raise UserError(f"{path} holds iteration {named}, past this job's last ({last}, SOLVER.MAX_ITER "
                        f"{cfg.SOLVER.MAX_ITER}): not this job's checkpoint; move it out of OUTPUT_DIR")


def check_same_categories(path, state: dict, dataset) -> None:
    """A checkpoint's labels mean its categories (and keypoints): resumed on a training set with others,
    its classifier would not fit them or would learn another class under an old label."""
    stored = state.get("categories") or {}
    if not stored.get("categories"):  # weights that do not say
        return
    keypoints = dataset.keypoints and "keypoint_names" in stored
    theirs, ours = category_key_of(stored, keypoints), category_key_of(categories_of(dataset), keypoints)
    instead = "resume it on its own data, or use another OUTPUT_DIR, or --no-resume to start this job over"
    if not same_categories(theirs, ours):
        raise UserError(f"{path} was trained on {len(theirs)} categories ({_names(theirs)}) and the training set now "
                        f"has {len(ours)} ({_names(ours)}): {instead}")
    if theirs != ours:  # the keypoint head's channels would mean other points (and flips swap others)
        raise UserError(f"the training set now has other keypoints than {path} was trained with "
                        f"({category_difference(ours, theirs)}): {instead}")


def _names(categories: list, shown: int = 5) -> str:
    names = ", ".join(str(key[1]) for key in categories[:shown])
    return names + (f" and {len(categories) - shown} more" if len(categories) > shown else "")
