"""What the fault tests share: the job (DETERMINISTIC, CPU; SOLVER.MAX_ITER 10 and
TRAIN.SNAPSHOT_ITERS 3, so checkpoints model_iter2, 5, 8 and model_final), the trainer as a process
of its own group, waiting and checking helpers, and the uninterrupted run's weights to compare with.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import demo_overrides, run_trainer, trainer_cmd
from trainer.checkpoint.state import load as load_checkpoint

MAX_ITER = 10
JOB = {"DETERMINISTIC": "true", "SOLVER.MAX_ITER": MAX_ITER, "TRAIN.SNAPSHOT_ITERS": 3, "LOG_PERIOD": 1,
       "TRAIN.CHECKPOINTS_KEEP": 10, "DATA_LOADER.NUM_THREADS": 0,
       # Not part of the job (its hash): no evaluation, no pickled model at the end, to save time.
       "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false"}
TMP_RE = re.compile(r"^\.model_(iter\d+|final)\.pth\.tmp")
# A job that is to get SIGHUP starts with its default action: the tests themselves may run under
# nohup, whose ignored SIGHUP every child inherits (and the trainer then keeps ignoring, as it should).
HUP_DEFAULT = ("env", "--default-signal=HUP")
# A test that sends SIGINT as a terminal's Ctrl-C would: a pytest-xdist worker starts its children with
# SIGINT ignored, which the trainer keeps ignored (as `cmd &` in a script), so the launcher restores it.
INT_DEFAULT = ("env", "--default-signal=INT")


# ---- helpers ----------------------------------------------------------------------------------------

def job_args(tmp: Path, data_dir: Path, **keys) -> list[str]:
    return demo_overrides(tmp, data_dir, **{**JOB, **keys})


class Job:
    """The trainer as a process of its own group (so a test can signal the group as a shell does)."""

    def __init__(self, args: list[str], cwd: Path, env: dict | None = None, name: str = "job",
                 launcher: tuple[str, ...] = ()):
        cwd.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*launcher, *trainer_cmd(*args)], cwd=cwd, stdout=out, stderr=err,
                                         env={**os.environ, **(env or {})}, start_new_session=True)
        self.pid = self.proc.pid

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise AssertionError(f"the trainer did not end within {timeout}s:\n{self.stderr[-3000:]}") from None

    def iters(self) -> list[int]:
        """The iterations this process has finished (its own `json_stats` lines, LOG_PERIOD 1)."""
        return [json.loads(line[len("json_stats: "):])["iter"] for line in self.out_path.read_text().splitlines()
                if line.startswith("json_stats: {") and line.endswith("}")]

    def children(self) -> list[int]:
        """The trainer's child processes: its data loader's workers, and nothing else."""
        pids = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def signal_group(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def jobs():
    """Started jobs; whatever is still running at the end of a test is killed with its group."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        job = Job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.proc.poll() is None:
            job.kill_group()


def wait_until(predicate, job: Job, what: str, timeout: float = 240, poll: float = 0.02):
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if job.proc.poll() is not None:
            raise AssertionError(f"the trainer ended (exit {job.proc.returncode}) before {what}:\n{job.stderr[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}:\n{job.stderr[-3000:]}")
        time.sleep(poll)


def logged_iters(out: Path) -> list[int]:
    log = out / "json_stats.log"
    if not log.exists():
        return []
    return [json.loads(line)["iter"] for line in log.read_text().splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids: list[int], within: float = 2.0) -> None:
    end = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    left = [p for p in pids if alive(p)]
    assert not left, f"child processes outlived the trainer: {left}"


def assert_same_weights(reference: dict, final: Path) -> None:
    weights = load_checkpoint(final)["model"]
    assert weights.keys() == reference.keys()
    differ = [k for k in reference if not torch.equal(reference[k], weights[k])]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run, e.g. {differ[:3]}"


def temp_files(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if TMP_RE.match(p.name)] if out.is_dir() else []


def flip_bytes(path: Path) -> None:
    """Corrupt a checkpoint the way bit rot or a partial overwrite would: same size, other bytes."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


def garble_image_data(png: Path) -> bytes:
    """Keep a PNG's header (what a job's check at start reads), garble its image data; the old bytes."""
    data = png.read_bytes()
    start = data.index(b"IDAT") + 8
    png.write_bytes(data[:start] + b"U" * (len(data) - start - 12) + data[-12:])
    return data


def only_run(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"one job is one run; found {len(runs)}"
    return runs[0]


def steps(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def sha_tag(name: str) -> str:
    return f"tracktron.ckpt.{name}.sha256"


@pytest.fixture(scope="session")
def reference(tmp_path_factory, data_dir) -> dict:
    """The uninterrupted job's final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run_trainer(job_args(tmp, data_dir, **{"TRACKING.ENABLED": "false"}), cwd=tmp)
    assert result.returncode == 0, result.stderr
    return load_checkpoint(tmp / "output" / "model_final.pth")["model"]


@pytest.fixture(autouse=True)
def _no_run_id_file(monkeypatch):
    monkeypatch.delenv("TRACKTRON_RUN_ID_FILE", raising=False)  # MLFLOW_*: conftest's _isolated_environment


