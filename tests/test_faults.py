"""Fault injection: each job either finishes with the weights of an uninterrupted run or fails
with a clear message and damages nothing (docs/FAULTS.md has the matrix and its results).

Faults come from outside the product, as they do in production: signals to the trainer (or to its
whole process group, as Ctrl-C, systemd and `tini -g` send them), SIGKILL at chosen moments
(SIGSTOP first, so "while the checkpoint's temporary file is half written" is a fact, not a race),
a TCP proxy between the trainer and the tracking server or S3 (slow, hung, answering 503, or
holding one upload), a small tmpfs (or RLIMIT_FSIZE) for a full disk, SIGKILL of a loader worker.

Every weight comparison is against one uninterrupted run of the same job (DETERMINISTIC, CPU):
SOLVER.MAX_ITER 10, TRAIN.SNAPSHOT_ITERS 3, so checkpoints model_iter2, 5, 8 and model_final (9).
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import demo_overrides, run_trainer, trainer_cmd
from tests.servers import FaultProxy
from trainer import checkpoint as ckpt

MAX_ITER = 10
JOB = {"DETERMINISTIC": "true", "SOLVER.MAX_ITER": MAX_ITER, "TRAIN.SNAPSHOT_ITERS": 3, "LOG_PERIOD": 1,
       "TRAIN.CHECKPOINTS_KEEP": 10, "DATA_LOADER.NUM_THREADS": 0,
       # Not part of the job (its hash): no evaluation, no pickled model at the end, to save time.
       "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false"}
TMP_RE = re.compile(r"^\.model_(iter\d+|final)\.pth\.tmp")


# ---- helpers ----------------------------------------------------------------------------------------

def job_args(tmp: Path, data_dir: Path, **keys) -> list[str]:
    return demo_overrides(tmp, data_dir, **{**JOB, **keys})


class Job:
    """The trainer as a process of its own group (so a test can signal the group as a shell does)."""

    def __init__(self, args: list[str], cwd: Path, env: dict | None = None, name: str = "job"):
        cwd.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(trainer_cmd(*args), cwd=cwd, stdout=out, stderr=err,
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

    def workers(self) -> list[int]:
        """Child processes (the data loader's workers)."""
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
    assert not left, f"data loader workers outlived the trainer: {left}"


def assert_same_weights(reference: dict, final: Path) -> None:
    weights = ckpt.load(final)["model"]
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


def only_run(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"one job is one run; found {len(runs)}"
    return runs[0]


def steps(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def sha_tag(name: str) -> str:
    return f"tracktron.ckpt.{name}.sha256"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> dict:
    """The uninterrupted job's final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run_trainer(job_args(tmp, data_dir, **{"TRACKING.ENABLED": "false"}), cwd=tmp)
    assert result.returncode == 0, result.stderr
    return ckpt.load(tmp / "output" / "model_final.pth")["model"]


@pytest.fixture(autouse=True)
def _no_run_id_file(monkeypatch):
    monkeypatch.delenv("TRACKTRON_RUN_ID_FILE", raising=False)  # MLFLOW_*: conftest's _isolated_environment


# ---- SIGKILL: mid-iteration, then mid-checkpoint-write ---------------------------------------------

def _kill_while_writing(job: Job, out: Path) -> Path:
    """SIGSTOP the trainer the moment a checkpoint's temporary file appears; if the file is still a
    temporary one then, SIGKILL it there (else let it go on and catch the next checkpoint)."""
    while True:
        tmp = wait_until(lambda: temp_files(out), job, "a checkpoint being written", poll=0.0005)[0]
        os.kill(job.pid, signal.SIGSTOP)
        if tmp.exists():
            job.kill_group()
            return tmp
        os.kill(job.pid, signal.SIGCONT)


def test_sigkill_mid_iteration_then_mid_checkpoint_write_then_resume(tmp_path, data_dir, reference, jobs):
    args = job_args(tmp_path, data_dir, **{"TRACKING.ENABLED": "false"})
    out = tmp_path / "output"

    # 1. SIGKILL in the middle of iteration 4 (iterations 3 and 4 are not in any checkpoint).
    first = jobs(args + ["DATA_LOADER.NUM_THREADS", "2"], tmp_path, name="first")
    wait_until(lambda: 3 in first.iters(), first, "iteration 3")
    workers = first.workers()
    assert len(workers) == 2
    os.kill(first.pid, signal.SIGKILL)  # the trainer alone, as the OOM killer does
    assert first.wait() == -signal.SIGKILL
    assert_gone(workers)  # PR_SET_PDEATHSIG: not left behind for torch's 5 s watchdog
    assert [p.name for p in ckpt.local_checkpoints(out)] == ["model_iter2.pth"]

    # 2. Resumed; SIGKILL while its next checkpoint is half written.
    second = jobs(args, tmp_path, name="second")
    torn = _kill_while_writing(second, out)
    assert "resuming from" in second.stderr and "model_iter2.pth at iteration 3" in second.stderr
    name = torn.name[1:].split(".tmp")[0]
    assert not (out / name).exists(), "the checkpoint being written already had its final name"
    newest = ckpt.local_checkpoints(out)[0]  # the torn file is not a checkpoint to anyone
    assert newest.name != name
    newest_iter = ckpt.load(newest)["iteration"]

    # 3. Resumed again: from the newest complete checkpoint, to the uninterrupted run's weights.
    third = run_trainer(args, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert f"{newest.name} at iteration {newest_iter + 1}" in third.stderr
    assert "removed 1 partial checkpoint file(s) left by a killed job" in third.stderr
    assert not temp_files(out)
    assert_same_weights(reference, out / "model_final.pth")
    assert logged_iters(out) == list(range(MAX_ITER))  # every iteration once, none lost, none twice


# ---- a loader worker dies, then Ctrl-C (SIGINT to the group), then the job finishes --------------------

def test_worker_crash_fails_cleanly_then_sigint_to_the_group_checkpoints_then_resume(tmp_path, data_dir,
                                                                                     reference, jobs):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "faults",
                                           "DATA_LOADER.NUM_THREADS": 2})
    out = tmp_path / "output"
    client = MlflowClient(uri)

    # 1. A loader worker is killed (OOM killer, a segfault in a decoder).
    first = jobs(args, tmp_path, name="first")
    wait_until(lambda: (out / "model_iter2.pth").exists() and 3 in first.iters(), first, "iteration 3")
    workers = first.workers()
    os.kill(workers[0], signal.SIGKILL)
    code = first.wait(120)
    assert code == 1, first.stderr[-3000:]
    assert re.search(r"\nRuntimeError: DataLoader worker \(pid\(?s?\)? ?" + str(workers[0]) +
                     r"\)? .*(killed by signal: Killed|exited unexpectedly)", first.stderr), first.stderr[-3000:]
    assert_gone(workers)
    run = only_run(client, "faults")
    assert run.info.status == "FAILED"
    assert "DataLoader worker" in run.data.tags["tracktron.status_reason"]
    state = ckpt.load(out / "model_iter2.pth")  # intact
    assert state["iteration"] == 2
    if sha_tag("model_iter2.pth") in run.data.tags:  # the server never holds other bytes than the tag says
        assert run.data.tags[sha_tag("model_iter2.pth")] == ckpt.sha256_of(out / "model_iter2.pth")

    # 2. Resumed in the same run; Ctrl-C reaches the trainer and its workers alike.
    second = jobs(args, tmp_path, name="second")
    wait_until(lambda: 4 in second.iters(), second, "iteration 4")
    workers = second.workers()
    second.signal_group(signal.SIGINT)
    assert second.wait(60) == 130, second.stderr[-3000:]
    assert "model_iter2.pth at iteration 3" in second.stderr
    assert "SIGINT received" in second.stderr and "Traceback" not in second.stderr
    assert_gone(workers)
    done = logged_iters(out)[-1]
    assert ckpt.load(out / f"model_iter{done}.pth")["iteration"] == done  # the iteration it was in, saved
    run = only_run(client, "faults")
    assert run.info.status == "KILLED"
    assert run.data.tags["tracktron.ckpt.latest"] == f"model_iter{done}.pth"
    assert steps(client, run.info.run_id) == list(range(done + 1))  # every finished iteration, once

    # 3. Resumed: not one iteration lost, and the uninterrupted run's weights.
    third = run_trainer(args, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert f"model_iter{done}.pth at iteration {done + 1}" in third.stderr
    run = only_run(client, "faults")
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(MAX_ITER))
    assert_same_weights(reference, out / "model_final.pth")


# ---- signals: a second one exits at once; SIGTERM while the server hangs keeps the grace period -----

def test_second_signal_exits_at_once_and_leaves_nothing_behind(tmp_path, data_dir, mlflow_server, jobs):
    out = tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": "twice",
                                               "TRAIN.PREEMPT_GRACE_S": 60, "DATA_LOADER.NUM_THREADS": 2})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        workers = job.workers()
        proxy.set_mode("hang")  # the first signal's clean stop now waits on uploads: time for a second one
        job.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM received" in job.stderr, job, "the first signal's warning", timeout=30)
        time.sleep(0.5)
        assert job.proc.poll() is None
        job.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert job.wait(30) == 128 + signal.SIGTERM
        took = time.monotonic() - start
    assert took < 2.0, f"exited {took:.1f}s after the second signal"
    assert "second signal: exiting now" in job.stderr
    assert_gone(workers, within=1.0)
    for path in ckpt.local_checkpoints(out):  # whatever has a checkpoint's name is complete
        ckpt.load(path)


def test_sigterm_while_the_tracking_server_hangs_exits_within_the_grace_period(tmp_path, data_dir, mlflow_server,
                                                                              jobs):
    grace = 10
    exp = f"hang-{uuid.uuid4().hex[:6]}"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "TRAIN.PREEMPT_GRACE_S": grace, "DATA_LOADER.NUM_THREADS": 2})
        out = tmp_path / "output"
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        workers = job.workers()
        proxy.set_mode("hang")  # accepts, reads, never answers
        job.signal_group(signal.SIGTERM)  # as systemd or `tini -g` do: the workers get it too
        start = time.monotonic()
        code = job.wait(grace + 30)
        took = time.monotonic() - start
    assert code == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert took <= grace + 2, f"exited {took:.1f}s after SIGTERM; the grace period is {grace}s"
    assert "Traceback" not in job.stderr
    assert "stopped by SIGTERM" in job.stderr or f"grace period of {grace}s over: exiting now" in job.stderr
    assert_gone(workers)
    done = logged_iters(out)[-1]
    assert ckpt.load(out / f"model_iter{done}.pth")["iteration"] == done
    run = only_run(MlflowClient(mlflow_server.url), exp)
    assert sha_tag(f"model_iter{done}.pth") not in run.data.tags  # never claimed without its bytes


# ---- tracking server: SIGKILL mid-upload, tampered local and truncated server checkpoints, slow server ---

def test_sigkill_mid_upload_then_corrupt_checkpoints_then_resume_through_a_slow_server(
        tmp_path, data_dir, mlflow_server, s3_server, reference, jobs):
    exp = f"upload-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    machine = tmp_path / "machine1"
    out = machine / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.hold(rb"PUT /api/2\.0/mlflow-artifacts/artifacts/\S*/checkpoints/model_iter8\.pth ", after=1 << 20)
        args = job_args(machine, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                              "TRACKING.FLUSH_TIMEOUT_S": 120})
        first = jobs(args, machine, env=s3_server.env, name="first")
        wait_until(proxy.held.is_set, first, "the upload of model_iter8.pth", timeout=300)
        first.kill_group()  # 1 MiB of model_iter8.pth has gone out; the rest never will

        run = only_run(client, exp)
        tags = run.data.tags
        assert tags["tracktron.ckpt.latest"] == "model_iter5.pth"
        assert sha_tag("model_iter8.pth") not in tags  # the half-uploaded checkpoint is not claimed
        for name in ("model_iter2.pth", "model_iter5.pth"):
            assert tags[sha_tag(name)] == ckpt.sha256_of(out / name)

        # The local model_iter8 and model_iter5 rot; the server's model_iter5 is cut in half.
        flip_bytes(out / "model_iter8.pth")
        flip_bytes(out / "model_iter5.pth")
        s3 = s3_server.client()
        key = next(o["Key"] for o in s3.list_objects_v2(Bucket=s3_server.bucket)["Contents"]
                   if o["Key"].endswith(f"{run.info.run_id}/artifacts/checkpoints/model_iter5.pth"))
        body = s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
        s3.put_object(Bucket=s3_server.bucket, Key=key, Body=body[: len(body) // 2])

        # Resumed through a slow link: every byte of every request is delayed.
        proxy.set_mode("slow", delay=0.03)
        second = run_trainer(args, cwd=machine, env=s3_server.env, timeout=400)
    assert second.returncode == 0, second.stderr
    err = second.stderr
    assert "model_iter8.pth: corrupt (record" in err and "model_iter5.pth: corrupt (record" in err
    assert "model_iter5.pth from the tracking server does not match its sha256 tag" in err
    assert f"resuming from {out / 'model_iter2.pth'} at iteration 3" in err
    run = only_run(client, exp)
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(MAX_ITER))
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    for name in ("model_iter5.pth", "model_iter8.pth", "model_final.pth"):
        assert run.data.tags[sha_tag(name)] == ckpt.sha256_of(out / name)
    assert_same_weights(reference, out / "model_final.pth")


def test_a_checkpoint_is_marked_complete_only_after_the_metrics_of_its_iterations(tmp_path, monkeypatch):
    """SIGKILL right after checkpoint N is complete on the server: the resumed job continues at N+1,
    so iterations <= N must already be in the run's curves, or they have a hole for good (before
    this held, test_tracking.py::test_killed_job_resumes_from_the_server_on_an_empty_machine failed).
    In-process, against sqlite, with a metrics path 3 s slower than the rest: deterministic."""
    from tests.conftest import DEMO
    from trainer.config import load_config
    from trainer.mlflow_tracking import MlflowTracker

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEMO, ["TRACKING.URI", f"sqlite:///{tmp_path / 'store.db'}", "OUTPUT_DIR", str(tmp_path)])
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(cfg).run_id
    (tmp_path / "warm-up.txt").write_text("the first upload imports MLflow's artifact code")
    tracker.log_artifact(tmp_path / "warm-up.txt")
    assert tracker.wait(60)
    calls: list[tuple[str, object]] = []
    real = tracker.client.log_batch

    def log_batch(run, metrics=(), params=(), tags=(), **kwargs):
        if metrics:
            time.sleep(3.0)
        real(run, metrics=metrics, params=params, tags=tags, **kwargs)
        calls.extend([("metrics", max(m.step for m in metrics))] if metrics else [])
        calls.extend([("tag", t.key) for t in tags])

    monkeypatch.setattr(tracker.client, "log_batch", log_batch)
    for step in range(3):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step)
    path = tmp_path / "model_iter2.pth"
    path.write_bytes(b"the checkpoint of iteration 2")
    tracker.log_checkpoint(path, ckpt.sha256_of(path))
    assert tracker.wait(30)
    tracker.finish("FINISHED", timeout=30)
    tagged = calls.index(("tag", sha_tag("model_iter2.pth")))
    assert any(kind == "metrics" and step >= 2 for kind, step in calls[:tagged]), calls
    assert steps(MlflowClient(cfg.TRACKING.URI), run_id) == [0, 1, 2]


# ---- a signal before the loop: no iteration to finish, the run is KILLED, not left RUNNING -------------

def test_a_signal_before_the_loop_stops_at_once_and_marks_the_run_killed(tmp_path, mlflow_server, jobs):
    data = tmp_path / "fresh-data"  # the synthetic dataset is generated first, before any iteration
    exp = f"early-{uuid.uuid4().hex[:6]}"
    args = job_args(tmp_path, data, **{"TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": exp})
    job = jobs(args, tmp_path)
    wait_until(lambda: list(data.glob("**/.*.tmp-*")), job, "the dataset being generated", poll=0.005)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert "stopped by SIGTERM" in job.stderr and "Traceback" not in job.stderr, job.stderr[-3000:]
    assert not job.iters() and not list(data.glob("**/.*.tmp-*"))  # no half dataset left behind
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)
    assert run.info.status == "KILLED"
    assert run.data.tags["tracktron.status_reason"] == "stopped by SIGTERM"

    again = jobs(args, tmp_path, name="again")  # the same job, in the same run, to the end
    assert again.wait(240) == 0, again.stderr[-3000:]
    finished = only_run(client, exp)
    assert (finished.info.run_id, finished.info.status) == (run.info.run_id, "FINISHED")


# ---- S3: failing uploads, then back; failing for good ------------------------------------------------

def _direct_s3_experiment(tmp: Path, s3_server, name: str) -> tuple[str, MlflowClient]:
    """The embedded sqlite store with artifacts straight on S3 (boto3 in the trainer)."""
    uri = f"sqlite:///{tmp / 'store.db'}"
    client = MlflowClient(uri)
    client.create_experiment(name, artifact_location=f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:6]}")
    return uri, client


def test_s3_failing_uploads_are_retried_until_it_is_back(tmp_path, data_dir, s3_server, reference, jobs):
    uri, client = _direct_s3_experiment(tmp_path, s3_server, "s3-outage")
    out = tmp_path / "output"
    with FaultProxy(s3_server.url, mode="error") as s3:  # every request: HTTP 503
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "s3-outage",
                                               "TRACKING.FLUSH_TIMEOUT_S": 120})
        job = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3.url})
        wait_until(lambda: (out / "model_iter5.pth").exists() and s3.errors_sent >= 3, job, "failed uploads")
        run = only_run(client, "s3-outage")
        assert not [t for t in run.data.tags if t.endswith(".sha256")]  # nothing claimed while S3 fails
        s3.set_mode("pass")
        assert job.wait(300) == 0, job.stderr[-3000:]
    assert re.search(r"tracking: upload \S+ failed \(.*\); retrying", job.stderr)
    run = only_run(client, "s3-outage")
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(MAX_ITER))
    for name in ("model_iter2.pth", "model_iter5.pth", "model_iter8.pth", "model_final.pth"):
        assert run.data.tags[sha_tag(name)] == ckpt.sha256_of(out / name)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket)["Contents"]]
    assert any(k.endswith(f"{run.info.run_id}/artifacts/checkpoints/model_final.pth") for k in keys)
    assert_same_weights(reference, out / "model_final.pth")


def test_s3_failing_for_good_claims_nothing_says_what_was_not_uploaded_and_a_rerun_uploads_it(
        tmp_path, data_dir, s3_server, jobs, monkeypatch):
    uri, client = _direct_s3_experiment(tmp_path, s3_server, "s3-down")
    out = tmp_path / "output"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "s3-down",
                                           "SOLVER.MAX_ITER": 4, "TRACKING.FLUSH_TIMEOUT_S": 5})
    with FaultProxy(s3_server.url, mode="error") as s3:
        job = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3.url, "AWS_MAX_ATTEMPTS": "2"})
        code = job.wait(120)
    # The job trained, but its run is not complete: exit 1, naming what the server lacks; no claim.
    assert code == 1, job.stderr[-3000:]
    last = job.last_line
    assert last.startswith("error: the tracking server did not get: ") and "model_final.pth" in last, last
    assert "Traceback" not in job.stderr
    run = only_run(client, "s3-down")
    assert not [t for t in run.data.tags if t.startswith("tracktron.ckpt.")]
    assert ckpt.load(out / "model_final.pth")["iteration"] == 3

    # S3 is back: the same command trains nothing and completes the run with the local model_final.
    again = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3_server.url}, name="again")
    assert again.wait(120) == 0, again.stderr[-3000:]
    assert "nothing to do" in again.out_path.read_text() and "uploading the local one" in again.stderr
    run = only_run(client, "s3-down")
    assert run.info.status == "FINISHED"
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert run.data.tags[sha_tag("model_final.pth")] == ckpt.sha256_of(out / "model_final.pth")
    for key, value in s3_server.env.items():  # this process reads the S3 store directly, as the trainer does
        monkeypatch.setenv(key, value)
    got = Path(client.download_artifacts(run.info.run_id, "checkpoints/model_final.pth", str(tmp_path / "dl")))
    assert ckpt.sha256_of(got) == ckpt.sha256_of(out / "model_final.pth")


# ---- a full disk while writing a checkpoint ----------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """OUTPUT_DIR on a 12 MiB tmpfs (one checkpoint fits, the second does not); where mounting is
    not allowed, a 4 MiB RLIMIT_FSIZE on the trainer (SIGXFSZ ignored, so write() fails with EFBIG)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = os.environ.get("TRACKTRON_TEST_DISK") != "rlimit" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True).returncode == 0

    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    def grow():
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)

    yield {"dir": mount, "tmpfs": mounted, "preexec": None if mounted else preexec, "grow": grow}
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_while_writing_a_checkpoint_fails_clearly_and_damages_nothing(tmp_path, data_dir, small_disk,
                                                                               reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = small_disk["dir"] / "output"
    args = job_args(tmp_path, data_dir, **{"OUTPUT_DIR": out, "TRACKING.URI": uri, "TRACKING.EXPERIMENT": "disk",
                                           "LOG_PERIOD": 100})
    failing = "model_iter5.pth" if small_disk["tmpfs"] else "model_iter2.pth"
    reason = "No space left on device" if small_disk["tmpfs"] else "File too large"
    result = subprocess.run(trainer_cmd(*args), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            preexec_fn=small_disk["preexec"])
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"cannot write checkpoint {out / failing}: {reason}" in last, last
    assert not temp_files(out) and not (out / failing).exists()
    client = MlflowClient(uri)
    run = only_run(client, "disk")
    assert run.info.status == "FAILED"
    assert reason in run.data.tags["tracktron.status_reason"]
    if small_disk["tmpfs"]:  # the checkpoint written before the disk filled up is whole, and is the server's
        assert ckpt.load(out / "model_iter2.pth")["iteration"] == 2
        assert run.data.tags[sha_tag("model_iter2.pth")] == ckpt.sha256_of(out / "model_iter2.pth")

    # Space again (the tmpfs grows; the file size limit is not set): the job resumes and finishes.
    small_disk["grow"]()
    resumed = run_trainer(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    if small_disk["tmpfs"]:
        assert "model_iter2.pth at iteration 3" in resumed.stderr
    assert only_run(client, "disk").info.status == "FINISHED"
    assert_same_weights(reference, out / "model_final.pth")
