"""Code paths that run only on CUDA, tested on the CPU with torch.cuda's answers faked (one function
each); what needs a real GPU is in bench/gpu_checks.py."""
import pytest
import torch

from trainer import preflight
from trainer.config import load_config
from trainer.errors import UserError


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
