"""Code paths that run only on CUDA, tested on the CPU with torch.cuda's answers faked (one function
each); what needs a real GPU is in bench/gpu_checks.py."""
import io

import pytest
import torch

from trainer import distributed, preflight
from trainer import stats as stats_mod
from trainer.config import load_config
from trainer.errors import UserError
from trainer.stats import TrainingStats


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


def _never(*args, **kwargs):
    raise AssertionError("the job went on past its checks")


def test_a_deterministic_keypoint_job_on_a_gpu_is_refused_before_its_data(on_a_gpu, monkeypatch):
    # upsample_bilinear2d's CUDA backward (the keypoint predictor's) raises under deterministic algorithms
    monkeypatch.setattr(preflight, "check_devices", lambda: None)
    monkeypatch.setattr(preflight, "build_train_dataset", _never)
    cfg = load_config(None, ["MODEL.TYPE", "keypointrcnn_resnet50_fpn", "DETERMINISTIC", "true"])
    with pytest.raises(UserError, match="DETERMINISTIC true cannot train keypointrcnn_resnet50_fpn on a GPU"):
        preflight.prepare(cfg)


@pytest.mark.parametrize("keys", [["MODEL.TYPE", "keypointrcnn_resnet50_fpn"],  # not DETERMINISTIC
                                  ["MODEL.TYPE", "maskrcnn_resnet50_fpn", "DETERMINISTIC", "true"]])
def test_other_jobs_on_a_gpu_pass_the_deterministic_check(on_a_gpu, keys):
    preflight.check_deterministic(load_config(None, keys))


def test_a_deterministic_keypoint_job_on_the_cpu_passes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight.check_deterministic(load_config(None, ["MODEL.TYPE", "keypointrcnn_resnet50_fpn", "DETERMINISTIC", "true"]))


class FakeCudaMemory:
    """torch.cuda's peak-memory counter: `now` is allocated in each iteration."""

    def __init__(self):
        self.peak, self.resets = 0, 0

    def allocate(self, mb: int) -> None:
        self.peak = max(self.peak, mb * 1024 * 1024)

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.resets = 0, self.resets + 1


def test_json_stats_mem_is_the_peak_of_its_own_period(monkeypatch):
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    out = io.StringIO()
    stats = TrainingStats(load_config(None, ["LOG_PERIOD", "4", "SOLVER.MAX_ITER", "9"]), 0, None, stream=out)
    seen = []
    for it, mb in enumerate([100, 900, 100, 100, 100, 100, 100, 100, 120]):  # 900: an evaluation's peak, say
        stats.iter_tic()
        fake.allocate(mb)
        stats.iter_toc()
        stats.update({"loss": 1.0}, 0.01, 0.0, 0, 2)
        if stats.is_log_iter(it):
            seen.append(stats.json_stats(it)["mem"])
        stats.log(it)
    assert seen == [100, 900, 120]  # iterations 0, 1-4, 5-8: the 900 is in its own period's line only
    assert fake.resets == 3
    assert stats_mod.peak_memory_mb() == 0  # just reset, after the last line


@pytest.mark.parametrize("device, bound", [(torch.device("cuda", 1), torch.device("cuda", 1)),
                                           (torch.device("cpu"), None)])
def test_the_process_group_is_bound_to_the_ranks_own_gpu(monkeypatch, device, bound):
    # without device_id, NCCL's barriers guess a GPU per rank and warn that a wrong guess can hang
    joined = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: joined.setdefault("current", d))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    distributed._join_group("nccl" if bound else "gloo", device, 2)
    assert joined["device_id"] == bound
    assert joined.get("current") == bound
