"""SGD, the learning-rate scheduler over Detectron's policies and warm-up (lr_policy.py), gradient clipping.

No SOLVER.SCALE_MOMENTUM: Detectron's Caffe2 SGD kept the LR inside the momentum buffer and rescaled
it when the LR changed; PyTorch's SGD applies the LR outside the buffer, so nothing needs rescaling.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from trainer.config import Config
from trainer.lr_policy import lr_at

log = logging.getLogger(__name__)
LOG_LR_CHANGE_RATIO = 1.1  # Detectron's SOLVER.LOG_LR_CHANGE_THRESHOLD: a step, not warm-up's small moves

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def _is_norm(module: nn.Module) -> bool:
    # torchvision's FrozenBatchNorm2d and similar custom layers are not _NormBase subclasses
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _param_groups(model: nn.Module, s) -> list[dict]:
    """Trainable parameters grouped by (weight decay, LR factor): with NO_DECAY_NORM_AND_BIAS norm layers
    and biases get no decay, and biases learn at BIAS_LR_FACTOR x the LR (Detectron's BIAS_DOUBLE_LR)."""
    groups: dict[tuple, list] = {(s.WEIGHT_DECAY, 1.0): [], (0.0, 1.0): [], (s.WEIGHT_DECAY, s.BIAS_LR_FACTOR): [],
                                 (0.0, s.BIAS_LR_FACTOR): []}
    seen = set()
    for module in model.modules():
        norm = _is_norm(module)
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # shared parameters go in one group only
                continue
            seen.add(id(p))
            bias = name.endswith("bias")
            decay = 0.0 if s.NO_DECAY_NORM_AND_BIAS and (norm or bias) else s.WEIGHT_DECAY
            groups[(decay, s.BIAS_LR_FACTOR if bias else 1.0)].append(p)
    return [{"params": params, "weight_decay": decay, "lr_factor": factor}
            for (decay, factor), params in groups.items() if params]


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.SGD:
    """Momentum SGD at SOLVER.BASE_LR (the scheduler's factors are relative to it)."""
    s = cfg.SOLVER
    return torch.optim.SGD(_param_groups(model, s), lr=s.BASE_LR, momentum=s.MOMENTUM, weight_decay=s.WEIGHT_DECAY)


def build_lr_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose lr after k calls of .step() is lr_at(cfg.SOLVER, k).

    The factor is a plain function, so it is not saved in state_dict: a resumed job uses the
    schedule of its own config and only the iteration count comes from the checkpoint.
    """
    base_lr = cfg.SOLVER.BASE_LR
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = base_lr * group.get("lr_factor", 1.0)  # LambdaLR scales initial_lr

    said = [0]  # the last iteration whose change was looked at: LambdaLR calls factor once per param group

    def factor(it: int) -> float:
        lr = lr_at(cfg.SOLVER, it)
        # The previous LR comes from the schedule, not from an earlier call: a resumed scheduler's
        # first call was factor(0). Iteration MAX_ITER never runs (the scheduler steps past the last).
        if said[0] != it and 0 < it < cfg.SOLVER.MAX_ITER:
            said[0] = it
            _log_change(lr_at(cfg.SOLVER, it - 1), lr, it)
        return lr / base_lr

    # AMP's scaler skips optimizer.step() when its first scale overflows; the schedule still counts
    # that iteration (Detectron's LR is a function of the iteration), so torch's order warning is moot
    warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _log_change(old: float, new: float, it: int) -> None:
    """Detectron's line, when its _get_lr_change_ratio is past LOG_LR_CHANGE_RATIO (an LR of 0, where
    WARM_UP_FACTOR 0 starts, counts as 1e-10)."""
    eps = 1e-10
    if max(new / max(old, eps), old / max(new, eps)) > LOG_LR_CHANGE_RATIO:
        log.info("Changing learning rate %.6f -> %.6f at iter %d", old, new, it)


def clip_gradients(cfg: Config, model_or_params: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Clip the gradients' total norm to SOLVER.CLIP_GRAD_NORM (the caller unscales them first under AMP);
    the norm before clipping, left on the gradients' device so that no iteration waits for the GPU (a CPU
    zero when no parameter has a gradient; None when clipping is off)."""
    max_norm = cfg.SOLVER.CLIP_GRAD_NORM
    if max_norm <= 0:
        return None
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
