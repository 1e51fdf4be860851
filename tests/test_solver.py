"""Learning rates against values worked out by hand from Detectron's lr_policy.py formulas."""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from trainer.config import ConfigError, load_config
from trainer.lr_policy import lr_at
from trainer.solver import build_lr_scheduler, build_optimizer, clip_gradients


def cfg_of(**solver):
    opts = []
    for key, value in solver.items():
        opts += [f"SOLVER.{key}", str(value)]
    return load_config(None, opts)


def f32(x):
    """Detectron's get_lr_at_iter ends in np.float32(lr)."""
    return float(np.float32(x))


def check(cfg, expected: dict):
    for it, lr in expected.items():
        got = lr_at(cfg.SOLVER, it)
        assert isinstance(got, float)
        assert got == f32(lr), f"iteration {it}"
        assert got == f32(got)  # representable as a float32, as Detectron's value was


# Detectron's 1x schedule: 0.02, x0.1 at 60k and 80k, 90k iterations, 500 linear warm-up from 1/3.
ONE_X = dict(BASE_LR=0.02, LR_POLICY="steps_with_decay", GAMMA=0.1, STEPS="[0, 60000, 80000]",
             MAX_ITER=90000, WARM_UP_ITERS=500, WARM_UP_METHOD="linear", WARM_UP_FACTOR=1 / 3)


def test_steps_with_decay_1x_schedule_with_linear_warm_up():
    third = 1 / 3
    check(cfg_of(**ONE_X), {
        0: 0.02 * third,                                     # alpha 0: factor 1/3
        1: 0.02 * (third * (1 - 1 / 500) + 1 / 500),
        250: 0.02 * (third * 0.5 + 0.5),                     # alpha 0.5: factor 2/3
        499: 0.02 * (third * (1 - 0.998) + 0.998),
        500: 0.02,                                           # warm-up over
        59999: 0.02,
        60000: 0.002,                                        # step index 1: 0.02 * 0.1
        79999: 0.002,
        80000: 0.02 * 0.1 ** 2,                              # step index 2
        89999: 0.0002,
        90000: 0.0002,                                       # past MAX_ITER: still the last step
        120000: 0.0002,
    })
    assert lr_at(cfg_of(**ONE_X).SOLVER, 250) == pytest.approx(0.02 * 2 / 3, rel=1e-7)


def test_steps_with_lrs():
    cfg = cfg_of(**{**ONE_X, "LR_POLICY": "steps_with_lrs", "LRS": "[0.02, 0.002, 0.0002]",
                    "WARM_UP_ITERS": 0})
    check(cfg, {0: 0.02, 59999: 0.02, 60000: 0.002, 79999: 0.002, 80000: 0.0002, 90000: 0.0002})


def test_steps_with_lrs_is_warmed_up_too():
    cfg = cfg_of(**{**ONE_X, "LR_POLICY": "steps_with_lrs", "LRS": "[0.02, 0.002, 0.0002]"})
    check(cfg, {0: 0.02 / 3, 100: 0.02 * ((1 / 3) * 0.8 + 0.2), 500: 0.02})


def test_step():
    cfg = cfg_of(BASE_LR=0.01, LR_POLICY="step", GAMMA=0.1, STEP_SIZE=30000, WARM_UP_ITERS=0)
    check(cfg, {0: 0.01, 29999: 0.01, 30000: 0.001, 59999: 0.001, 60000: 0.01 * 0.1 ** 2,
                95000: 0.01 * 0.1 ** 3})


def test_cosine_decay():
    cfg = cfg_of(BASE_LR=0.02, LR_POLICY="cosine_decay", MAX_ITER=1000, WARM_UP_ITERS=0)
    check(cfg, {0: 0.02, 250: 0.01 * (1 + math.sqrt(2) / 2), 500: 0.01,
                750: 0.01 * (1 - math.sqrt(2) / 2), 999: 0.01 * (math.cos(math.pi * 0.999) + 1)})
    assert lr_at(cfg.SOLVER, 1000) == pytest.approx(0.0, abs=1e-12)


def test_exp_decay_ends_at_gamma_times_base_lr():
    # Detectron: GAMMA is the final / initial LR ratio; lr = BASE_LR * exp(it / MAX_ITER * ln GAMMA)
    cfg = cfg_of(BASE_LR=0.02, LR_POLICY="exp_decay", GAMMA=0.01, MAX_ITER=1000, WARM_UP_ITERS=0)
    check(cfg, {0: 0.02, 250: 0.02 * 0.01 ** 0.25, 500: 0.002, 1000: 0.0002})


def test_constant_warm_up():
    cfg = cfg_of(BASE_LR=0.02, LR_POLICY="step", STEP_SIZE=30000, WARM_UP_ITERS=100,
                 WARM_UP_METHOD="constant", WARM_UP_FACTOR=0.1)
    check(cfg, {0: 0.002, 50: 0.002, 99: 0.002, 100: 0.02})


def test_linear_warm_up_multiplies_the_policy():
    cfg = cfg_of(BASE_LR=0.02, LR_POLICY="cosine_decay", MAX_ITER=1000, WARM_UP_ITERS=100,
                 WARM_UP_METHOD="linear", WARM_UP_FACTOR=0.001)
    cos_at_10 = 0.02 * 0.5 * (math.cos(math.pi * 10 / 1000) + 1)
    check(cfg, {10: cos_at_10 * (0.001 * 0.9 + 0.1), 100: 0.01 * (math.cos(math.pi / 10) + 1)})


def test_steps_must_start_at_zero():
    with pytest.raises(ConfigError, match="starting at 0"):
        cfg_of(LR_POLICY="steps_with_decay", STEPS="[60000, 80000]", MAX_ITER=90000)


# --------------------------------------------------------------------------------------------- #


SMALL = dict(BASE_LR=0.02, LR_POLICY="steps_with_decay", GAMMA=0.1, STEPS="[0, 6, 8]", MAX_ITER=10,
             WARM_UP_ITERS=4, WARM_UP_METHOD="linear", WARM_UP_FACTOR=0.25)


def built(cfg):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = build_optimizer(cfg, model)
    return model, opt, build_lr_scheduler(cfg, opt)


def train_step(model, opt, sched):
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_scheduler_lr_after_k_steps_is_lr_at_k():
    cfg = cfg_of(**SMALL)
    model, opt, sched = built(cfg)
    for k in range(14):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(cfg.SOLVER, k), rel=1e-12), k
        train_step(model, opt, sched)
    assert lr_at(cfg.SOLVER, 0) == f32(0.02 * 0.25)
    assert lr_at(cfg.SOLVER, 2) == f32(0.02 * (0.25 * 0.5 + 0.5))
    assert lr_at(cfg.SOLVER, 7) == f32(0.002)


def test_a_first_step_skipped_by_the_amp_scaler_gives_no_scheduler_warning(recwarn):
    # GradScaler skips optimizer.step() when its first scale overflows the gradients (common on a GPU);
    # the schedule still advances one iteration, as the loop counts iterations, not optimizer steps
    cfg = cfg_of(**SMALL)
    model, opt, sched = built(cfg)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(cfg.SOLVER, 1))
    assert scaler.get_scale() < 2.0**16  # the step was skipped
    assert not [str(w.message) for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_scheduler_resumes_from_state_dict():
    cfg = cfg_of(**SMALL)
    model, opt, sched = built(cfg)
    for _ in range(5):
        train_step(model, opt, sched)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))  # a checkpoint
    expected = []
    for k in range(5, 12):
        expected.append(opt.param_groups[0]["lr"])
        train_step(model, opt, sched)

    model2, opt2, sched2 = built(cfg)  # a fresh process: built at iteration 0, then loaded
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert sched2.last_epoch == 5
    for k, lr in zip(range(5, 12), expected):
        assert opt2.param_groups[0]["lr"] == lr == pytest.approx(lr_at(cfg.SOLVER, k), rel=1e-12)
        train_step(model2, opt2, sched2)
    assert torch.equal(model.weight, model2.weight)


def test_each_lr_step_is_logged_as_detectron_logged_it_and_warm_up_is_not(caplog):
    """Detectron logged `Changing learning rate 0.020000 -> 0.002000 at iter 6` when the LR moved by
    more than 1.1x; tracktron said nothing. Warm-up's small moves and a resume are no change. Found
    by the Detectron review of 2026-12-03."""
    caplog.set_level("INFO", logger="trainer.solver")
    cfg = cfg_of(**{**ONE_X, "STEPS": "[0, 60, 80]", "MAX_ITER": 90, "WARM_UP_ITERS": 50})  # 1x, shrunk 1000x
    model, opt, sched = built(cfg)
    for _ in range(90):
        train_step(model, opt, sched)
    changes = [r.getMessage() for r in caplog.records if "Changing learning rate" in r.getMessage()]
    assert changes == ["Changing learning rate 0.020000 -> 0.002000 at iter 60",
                       "Changing learning rate 0.002000 -> 0.000200 at iter 80"]
    caplog.clear()
    _, _, from_zero = built(cfg_of(**{**SMALL, "WARM_UP_METHOD": "constant", "WARM_UP_FACTOR": 0}))  # lr 0: no division
    for _ in range(5):
        from_zero.step()
    assert "Changing learning rate 0.000000 -> 0.020000 at iter 4" in caplog.text
    saved = sched.state_dict()
    caplog.clear()
    _, _, resumed = built(cfg)  # a fresh process at iteration 0, then the checkpoint's state
    resumed.load_state_dict(saved)
    resumed.step()
    assert "Changing learning rate" not in caplog.text


def test_scheduler_ignores_a_preset_lr():
    cfg = cfg_of(**SMALL)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    build_lr_scheduler(cfg, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(cfg.SOLVER, 0), rel=1e-12)


# --------------------------------------------------------------------------------------------- #


class MyFrozenNorm(nn.Module):
    """Stands for a custom normalisation layer that is not a torch _NormBase."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.scale


def norm_model():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), MyFrozenNorm(4),
                          nn.Conv2d(4, 4, 1, bias=False), nn.Flatten(), nn.Linear(4, 2),
                          nn.LayerNorm(2))
    model[4].weight.requires_grad_(False)  # frozen: in no group at all
    return model


def ids(params):
    return {id(p) for p in params}


def test_no_decay_for_norm_layers_and_biases():
    model = norm_model()
    opt = build_optimizer(cfg_of(NO_DECAY_NORM_AND_BIAS="true", WEIGHT_DECAY=0.0001, MOMENTUM=0.8), model)
    decay, no_decay = opt.param_groups
    assert ids(decay["params"]) == ids([model[0].weight, model[6].weight])
    assert ids(no_decay["params"]) == ids([
        model[0].bias, model[1].weight, model[1].bias, model[2].weight, model[2].bias,
        model[3].scale, model[6].bias, model[7].weight, model[7].bias])
    assert decay["weight_decay"] == 0.0001 and no_decay["weight_decay"] == 0.0
    assert decay["momentum"] == no_decay["momentum"] == 0.8
    assert decay["lr"] == no_decay["lr"] == 0.001


def test_one_decayed_group_by_default():
    model = norm_model()
    opt = build_optimizer(cfg_of(), model)
    (group,) = opt.param_groups
    assert ids(group["params"]) == ids(p for p in model.parameters() if p.requires_grad)
    assert len(group["params"]) == 11
    assert group["weight_decay"] == 0.0005 and group["momentum"] == 0.9
    assert isinstance(opt, torch.optim.SGD)


def test_frozen_batchnorm_has_no_parameters_to_group():
    from torchvision.ops.misc import FrozenBatchNorm2d
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), FrozenBatchNorm2d(4))
    opt = build_optimizer(cfg_of(NO_DECAY_NORM_AND_BIAS="true"), model)
    (group,) = opt.param_groups  # the empty no-decay group is left out
    assert ids(group["params"]) == ids([model[0].weight])


# --------------------------------------------------------------------------------------------- #


def test_clip_gradients():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    norm = clip_gradients(cfg_of(CLIP_GRAD_NORM=1.0), [p])
    assert isinstance(norm, torch.Tensor)  # on the gradients' device: a float would wait for the GPU every iteration
    assert float(norm) == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-5)


def test_clip_gradients_of_a_model_skips_missing_grads():
    model = nn.Linear(2, 1)
    model.weight.grad = torch.tensor([[6.0, 8.0]])  # the bias has no gradient
    assert float(clip_gradients(cfg_of(CLIP_GRAD_NORM=20.0), model)) == pytest.approx(10.0)
    assert torch.equal(model.weight.grad, torch.tensor([[6.0, 8.0]]))  # under the limit: untouched


def test_no_clipping_by_default():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([30.0, 40.0])
    assert clip_gradients(cfg_of(), [p]) is None
    assert torch.equal(p.grad, torch.tensor([30.0, 40.0]))


# Iterations: the default schedule is step (GAMMA 0.1 every 30000), 500 linear warm-up from 1/3.
@pytest.mark.parametrize("solver, message", [
    # Python's float power raised OverflowError (a traceback, a FAILED run): the LR is inf from iteration 1
    (dict(GAMMA=1e300, STEP_SIZE=1, MAX_ITER=10, WARM_UP_ITERS=0),
     "SOLVER.GAMMA 1e+300 makes the learning rate overflow at iteration 1 (step)"),
    # the float32 cast gave inf, shown by --dry-run and trained with
    (dict(BASE_LR=1e39, WARM_UP_ITERS=0), "SOLVER.BASE_LR 1e+39 makes the learning rate overflow at iteration 0 (step)"),
    (dict(WARM_UP_FACTOR=1e300), "SOLVER.WARM_UP_FACTOR 1e+300 makes the learning rate overflow at iteration 0 (step)"),
    # 0.02 * 1e300 ** (it / 100) passes float32's 3.4e38 at iteration 14
    (dict(BASE_LR=0.02, LR_POLICY="exp_decay", GAMMA=1e300, MAX_ITER=100, WARM_UP_ITERS=0),
     "SOLVER.GAMMA 1e+300 makes the learning rate overflow at iteration 14 (exp_decay)"),
    (dict(LR_POLICY="steps_with_lrs", STEPS="[0, 10]", LRS="[0.1, 1e39]", MAX_ITER=20, WARM_UP_ITERS=0),
     "SOLVER.LRS[1] 1e+39 makes the learning rate overflow at iteration 10 (steps_with_lrs)"),
    (dict(LR_POLICY="cosine_decay", BASE_LR=1e39), "SOLVER.BASE_LR 1e+39 makes the learning rate overflow at iteration 6 "
                                                   "(cosine_decay)"),  # 1e39 / 3 at 0 still fits
    # 1e10 from iteration 5 to 9, the last trained; the scheduler's step after it raised OverflowError
    (dict(BASE_LR=1e-290, GAMMA=1e300, STEP_SIZE=5, MAX_ITER=10, WARM_UP_ITERS=0),
     "SOLVER.GAMMA 1e+300 makes the learning rate overflow at iteration 10, which the scheduler computes after the "
     "last step (step)"),
    (dict(BIAS_LR_FACTOR=1e300), "SOLVER.BIAS_LR_FACTOR 1e+300 makes the biases' learning rate overflow (the LR peaks at 0.001)"),
])
def test_a_learning_rate_that_overflows_is_refused_with_the_config(solver, message):
    with pytest.raises(ConfigError) as refused:
        cfg_of(**solver)
    assert str(refused.value) == message
    kept = cfg_of(BASE_LR=1.0, GAMMA=1e12, STEP_SIZE=10, MAX_ITER=30, WARM_UP_ITERS=0)  # within float32 throughout
    check(kept, {0: 1.0, 10: 1e12, 29: 1e24, 30: 1e36})


def test_a_stop_signal_during_an_iteration_stops_the_job_after_that_iteration():
    """The stop flag was read as the iteration began: a signal during iteration N trained N and all
    of N+1 before the checkpoint, past the grace period a slow iteration leaves (helper-47). It is
    read after the step, just before the iteration's one collective."""
    from types import SimpleNamespace

    from trainer.distributed import Context
    from trainer.engine import train_step

    signalled = []

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, images, targets):
            signalled.append(True)  # SIGTERM arrives while the iteration runs
            return {"loss_a": self.w.sum(), "loss_b": (self.w ** 2).sum()}

    model = Model()
    s = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        scaler=torch.amp.GradScaler("cpu", enabled=False))
    job = SimpleNamespace(ctx=Context(), cfg=SimpleNamespace(SOLVER=SimpleNamespace(CLIP_GRAD_NORM=0)))
    losses, stop = train_step(job, s, [], [], lambda: bool(signalled))
    assert stop and losses == {"loss": 4.0, "loss_a": 2.0, "loss_b": 2.0}
    assert train_step(job, s, [], [], lambda: False)[1] is False


def test_a_step_right_after_a_resume_is_logged_and_none_after_the_last_iteration(caplog):
    """The change was found by comparing with the scheduler's previous call: a resumed scheduler's
    was factor(0), so a step at the first iteration after the resumed one went unsaid; and the
    scheduler's step past the last iteration logged a change `at iter MAX_ITER`, an iteration that
    never runs (Detectron logged only as an iteration began). Found by helper-82's red team."""
    caplog.set_level("INFO", logger="trainer.solver")
    cfg = cfg_of(**SMALL, BIAS_LR_FACTOR=2.0)  # steps at 6 and 8, MAX_ITER 10; a param group for the bias
    _, _, sched = built(cfg)
    for _ in range(5):
        sched.step()
    saved = sched.state_dict()  # model_iter4's: the job resumes at iteration 5
    _, _, resumed = built(cfg)
    resumed.load_state_dict(saved)
    caplog.clear()
    resumed.step()  # the LR of iteration 6, the step
    assert caplog.messages == ["Changing learning rate 0.020000 -> 0.002000 at iter 6"]
    caplog.clear()
    _, _, ending = built(cfg_of(**{**SMALL, "LR_POLICY": "step", "STEP_SIZE": 5, "WARM_UP_ITERS": 0}))  # 5, MAX_ITER
    for _ in range(10):  # iterations 0-9, the scheduler stepped after each
        ending.step()
    assert caplog.messages == ["Changing learning rate 0.020000 -> 0.002000 at iter 5"]
