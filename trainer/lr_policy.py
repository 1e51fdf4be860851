"""Detectron's learning-rate policies (`detectron/utils/lr_policy.py`: lr_func_*, then warm-up),
reproduced numerically, including its final `np.float32` cast, so that a schedule gives the same
learning rate at every iteration as the Caffe2 original. numpy only, no torch: config_checks uses
them to refuse a schedule that overflows before anything is built; the solver trains with them."""
from __future__ import annotations

import bisect
import math
import operator

import numpy as np

from trainer.errors import ConfigError

F32_MAX = float(np.finfo(np.float32).max)


def _step_index(s, it: int) -> int:
    """Detectron's get_step_index: the last step of STEPS that `it` has reached (STEPS starts at 0 and
    increases; Detectron's loop over STEPS + [MAX_ITER] gives the same index past MAX_ITER)."""
    return bisect.bisect_right(s.STEPS, it) - 1


def _step(s, it: int) -> float:
    return s.BASE_LR * s.GAMMA ** (it // s.STEP_SIZE)


def _steps_with_decay(s, it: int) -> float:
    return s.BASE_LR * s.GAMMA ** _step_index(s, it)


def _steps_with_lrs(s, it: int) -> float:
    return s.LRS[_step_index(s, it)]


def _cosine_decay(s, it: int) -> float:
    iter_frac = float(it) / s.MAX_ITER
    return s.BASE_LR * (0.5 * (np.cos(np.pi * iter_frac) + 1))


def _exp_decay(s, it: int) -> float:
    # GAMMA is the ratio of the final to the initial learning rate
    iter_frac = float(it) / s.MAX_ITER
    return s.BASE_LR * np.exp(iter_frac * np.log(s.GAMMA))


POLICIES = {
    "step": _step,
    "steps_with_decay": _steps_with_decay,
    "steps_with_lrs": _steps_with_lrs,
    "cosine_decay": _cosine_decay,
    "exp_decay": _exp_decay,
}

STEP_POLICIES = ("steps_with_decay", "steps_with_lrs")  # those that read SOLVER.STEPS (from 0)


# SOLVER.WARM_UP_METHOD: the factor the LR is multiplied by at iteration it < WARM_UP_ITERS.
WARM_UP = {
    "constant": lambda s, it: s.WARM_UP_FACTOR,
    "linear": lambda s, it: s.WARM_UP_FACTOR * (1 - it / s.WARM_UP_ITERS) + it / s.WARM_UP_ITERS,
}


def lr_at(s, it: int) -> float:
    """Detectron's get_lr_at_iter for a config's SOLVER: the policy's LR, times the warm-up factor while
    it < WARM_UP_ITERS."""
    lr = POLICIES[s.LR_POLICY](s, it)
    if it < s.WARM_UP_ITERS:
        lr *= WARM_UP[s.WARM_UP_METHOD](s, it)
    return float(np.float32(lr))  # Detectron returns np.float32; keep its rounding


def _finite(compute, *args) -> bool:
    """Whether compute(*args) is a finite float32 (Python's float power raises past 1.8e308 instead)."""
    try:
        with np.errstate(over="ignore"):
            return math.isfinite(np.float32(compute(*args)))
    except OverflowError:
        return False


def _lr_peaks(s) -> list[int]:
    """The iterations where the LR can peak: between them each policy is monotonic (or constant
    between steps) and the warm-up factor linear. MAX_ITER too: the scheduler steps past the last."""
    marks = {0, s.WARM_UP_ITERS - 1, s.WARM_UP_ITERS, s.MAX_ITER - 1, s.MAX_ITER}
    if s.LR_POLICY in STEP_POLICIES:
        marks.update(x for step in s.STEPS for x in (step - 1, step))
    return sorted(m for m in marks if 0 <= m <= s.MAX_ITER)


def _first_overflow(s) -> int | None:
    """The first iteration whose LR is no finite float32: found at a peak, then bisected back to
    the last peak that was fine (the LR is monotonic between them)."""
    ok = -1
    for bad in _lr_peaks(s):
        if _finite(lr_at, s, bad):
            ok = bad
            continue
        while bad - ok > 1:
            mid = (ok + bad) // 2
            ok, bad = (mid, bad) if _finite(lr_at, s, mid) else (ok, mid)
        return bad
    return None


def _overflow_cause(s, it: int) -> str:
    """The key (and value) that takes the LR at `it` past float32's range."""
    if it < s.WARM_UP_ITERS and s.WARM_UP_FACTOR > 1 and _finite(POLICIES[s.LR_POLICY], s, it):
        return f"SOLVER.WARM_UP_FACTOR {s.WARM_UP_FACTOR:g}"
    if s.LR_POLICY == "steps_with_lrs":
        return f"SOLVER.LRS[{_step_index(s, it)}] {s.LRS[_step_index(s, it)]:g}"
    if s.BASE_LR > F32_MAX or s.LR_POLICY == "cosine_decay":  # cosine never rises above BASE_LR
        return f"SOLVER.BASE_LR {s.BASE_LR:g}"
    return f"SOLVER.GAMMA {s.GAMMA:g}"


def check_schedule(s) -> None:
    """Every LR of the schedule a finite float32 (the solver's and the biases'): an overflow would be
    a traceback in the first steps, or inf weights, after the run was made."""
    it = _first_overflow(s)
    if it is not None:
        when = f"iteration {it}" + (", which the scheduler computes after the last step" if it == s.MAX_ITER else "")
        raise ConfigError(f"{_overflow_cause(s, it)} makes the learning rate overflow at {when} ({s.LR_POLICY})")
    peak = max(lr_at(s, m) for m in _lr_peaks(s))
    if not _finite(operator.mul, peak, s.BIAS_LR_FACTOR):
        raise ConfigError(f"SOLVER.BIAS_LR_FACTOR {s.BIAS_LR_FACTOR:g} makes the biases' learning rate overflow "
                          f"(the LR peaks at {peak:g})")
