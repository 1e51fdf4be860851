"""Two CPU processes under real torchrun (gloo): a run, and a resume that restores every rank."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.conftest import DEMO, demo_overrides
from tests.servers import free_port
from trainer.checkpoint.state import load as load_checkpoint


def torchrun(args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "trainer", "train", "--config", str(DEMO), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_process_run_then_resume_restores_every_rank(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 6, "TRAIN.SNAPSHOT_ITERS": 4,
                                                 "TRACKING.ENABLED": "false", "DETERMINISTIC": "true"})
    first = torchrun(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "output"
    # NUM_GPUS follows the world size: checkpoints every SNAPSHOT_ITERS // NUM_GPUS = 2 iterations.
    assert sorted(p.name for p in out.glob("*.pth")) == ["model_final.pth", "model_iter1.pth", "model_iter3.pth"]
    assert "NUM_GPUS set to the world size, 2" in first.stderr
    straight = load_checkpoint(out / "model_final.pth")["model"]
    assert load_checkpoint(out / "model_final.pth")["config"]["NUM_GPUS"] == 2

    (out / "model_final.pth").unlink()  # as if killed after model_iter3
    resumed = torchrun(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at iteration 4" in resumed.stderr
    again = load_checkpoint(out / "model_final.pth")["model"]
    # Equal only if both ranks restored weights, optimizer state, RNG and sampler position.
    assert all(torch.equal(straight[k], again[k]) for k in straight)
