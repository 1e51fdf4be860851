"""Fault injection: each job either finishes with the weights of an uninterrupted run or fails
with a clear message and damages nothing (docs/FAULTS.md has the matrix and its results).

Faults come from outside the product, as they do in production: signals to the trainer (or to its
whole process group, as Ctrl-C, systemd and `tini -g` send them), SIGKILL at chosen moments
(SIGSTOP first, so "while the checkpoint's temporary file is half written" is a fact, not a race),
a TCP proxy between the trainer and the tracking server or S3 (slow, hung, answering 503, or
holding one upload), SIGKILL of a loader worker. S3 failing and a full disk: test_faults_storage.py;
the shared job, process and helpers: faultkit.py.

Every weight comparison is against one uninterrupted run of the same job (DETERMINISTIC, CPU):
SOLVER.MAX_ITER 10, TRAIN.SNAPSHOT_ITERS 3, so checkpoints model_iter2, 5, 8 and model_final (9).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import run_trainer, trainer_cmd
from tests.faultkit import (  # noqa: F401 - jobs, reference, _no_run_id_file are fixtures
    assert_gone, assert_same_weights, flip_bytes, HUP_DEFAULT, INT_DEFAULT, Job, job_args, jobs, logged_iters, MAX_ITER,
    _no_run_id_file, only_run, reference, sha_tag, steps, temp_files, wait_until)
from tests.servers import FaultProxy
from trainer.checkpoint.files import iteration_of, local_checkpoints
from trainer.hashing import sha256_of
from trainer.checkpoint.state import load as load_checkpoint


# ---- SIGKILL: mid-iteration, then mid-checkpoint-write ---------------------------------------------

def _kill_while_writing(job: Job, out: Path) -> Path:
    """SIGSTOP the trainer (its checkpoint-writer thread is writing; its pid ends the temporary file's
    name) the moment the file appears; if the file is still a temporary one then, SIGKILL the trainer
    there (else let it go on and catch the next)."""
    while True:
        tmp = wait_until(lambda: temp_files(out), job, "a checkpoint being written", poll=0.0005)[0]
        writer = int(tmp.name.rsplit(".", 1)[1])
        try:
            os.kill(writer, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        if tmp.exists():
            children = job.children()
            job.kill_group()
            assert_gone(children)
            return tmp
        os.kill(writer, signal.SIGCONT)


def test_sigkill_mid_iteration_then_mid_checkpoint_write_then_resume(tmp_path, data_dir, reference, jobs):
    args = job_args(tmp_path, data_dir, **{"TRACKING.ENABLED": "false"})
    out = tmp_path / "output"

    # 1. SIGKILL in the middle of iteration 4 (iterations 3 and 4 are not in any checkpoint).
    first = jobs(args + ["DATA_LOADER.NUM_THREADS", "2"], tmp_path, name="first")
    # model_iter2 is written by a thread: on a loaded machine it may land after iteration 3 is logged.
    wait_until(lambda: 3 in first.iters() and (out / "model_iter2.pth").exists(), first, "iteration 3")
    os.kill(first.pid, signal.SIGSTOP)  # held where it was seen: no model_iter5 while a loaded test looks on
    workers = first.children()
    assert len(workers) == 2  # the loader's workers; checkpoints are written by a thread
    os.kill(first.pid, signal.SIGKILL)  # the trainer alone, as the OOM killer does
    assert first.wait() == -signal.SIGKILL
    assert_gone(workers)  # PR_SET_PDEATHSIG: not left behind for torch's 5 s watchdog
    assert [p.name for p in local_checkpoints(out)] == ["model_iter2.pth"]

    # 2. Resumed; SIGKILL while its next checkpoint is half written.
    second = jobs(args, tmp_path, name="second")
    torn = _kill_while_writing(second, out)
    assert "resuming from" in second.stderr and "model_iter2.pth at iteration 3" in second.stderr
    name = torn.name[1:].split(".tmp")[0]
    assert not (out / name).exists(), "the checkpoint being written already had its final name"
    newest = local_checkpoints(out)[0]  # the torn file is not a checkpoint to anyone
    assert newest.name != name
    newest_iter = load_checkpoint(newest)["iteration"]

    # 3. Resumed again: from the newest complete checkpoint, to the uninterrupted run's weights.
    third = run_trainer(args, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert f"{newest.name} at iteration {newest_iter + 1}" in third.stderr
    assert "removed 1 partial file(s) left by a killed job" in third.stderr
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
    wait_until(lambda: (out / "model_iter2.pth").exists(), first, "model_iter2")
    workers = children = first.children()
    os.kill(workers[0], signal.SIGKILL)
    code = first.wait(120)
    assert code == 1, first.stderr[-3000:]
    assert re.search(r"\nRuntimeError: DataLoader worker \(pid\(?s?\)? ?" + str(workers[0]) +
                     r"\)? .*(killed by signal: Killed|exited unexpectedly)", first.stderr), first.stderr[-3000:]
    assert_gone(children)  # the other worker too
    run = only_run(client, "faults")
    assert run.info.status == "FAILED"
    assert "DataLoader worker" in run.data.tags["tracktron.status_reason"]
    # The batches already in the pipeline still train after the kill: the newest checkpoint is
    # model_iter2, or model_iter5 on a loaded machine. Each is intact, and its tag (if any) true.
    newest = local_checkpoints(out)[0]
    for path in local_checkpoints(out):
        assert load_checkpoint(path)["iteration"] == iteration_of(path.name)
        if sha_tag(path.name) in run.data.tags:  # the server never holds other bytes than the tag says
            assert run.data.tags[sha_tag(path.name)] == sha256_of(path)

    # 2. Resumed in the same run; Ctrl-C reaches the trainer and its workers alike.
    second = jobs(args, tmp_path, name="second", launcher=INT_DEFAULT)
    wait_until(lambda: second.iters(), second, "its first iteration")
    children = second.children()
    second.signal_group(signal.SIGINT)
    assert second.wait(60) == 130, second.stderr[-3000:]
    assert f"{newest.name} at iteration {iteration_of(newest.name) + 1}" in second.stderr
    assert "SIGINT received" in second.stderr and "Traceback" not in second.stderr
    assert_gone(children)
    done = logged_iters(out)[-1]
    assert load_checkpoint(out / f"model_iter{done}.pth")["iteration"] == done  # the iteration it was in, saved
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


# A container's /dev/shm (docker's default is 64 MB), in a mount namespace of the trainer's own.
SMALL_SHM = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh")


def _fill(folder: Path) -> None:
    """Writes into `folder` until its file system is full."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
        except OSError:
            pass


def test_a_full_dev_shm_fails_the_job_in_one_line_naming_shm_size_and_keeps_its_checkpoints(tmp_path, data_dir, jobs):
    """Loader workers pass batches through /dev/shm. When it filled, the worker's queue thread printed a
    traceback (`unable to allocate shared memory(shm) …: No space left on device`) and dropped the batch,
    and the trainer waited for it forever (helper-86: an hour-long job that never ends, in a container
    started without --shm-size)."""
    if subprocess.run([*SMALL_SHM, "true"], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs in a mount namespace needs root (CAP_SYS_ADMIN)")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "shm", "DATA_LOADER.NUM_THREADS": 2,
                                           "SOLVER.MAX_ITER": 30})  # batches left to load after the disk fills
    out = tmp_path / "output"
    first = jobs(args, tmp_path, name="first", launcher=SMALL_SHM)
    wait_until(lambda: (out / "model_iter2.pth").exists(), first, "model_iter2")
    _fill(Path(f"/proc/{first.pid}/root/dev/shm"))  # the trainer's /dev/shm, not this process's
    assert first.wait(120) == 2, first.stderr[-3000:]
    assert first.last_line.startswith("error: the data loader's workers are out of shared memory: /dev/shm holds 8.0 MiB"), \
        first.stderr[-3000:]
    assert "docker run --shm-size" in first.last_line and "DATA_LOADER.NUM_THREADS 0" in first.last_line
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    run = only_run(MlflowClient(uri), "shm")
    assert run.info.status == "FAILED" and "out of shared memory" in run.data.tags["tracktron.status_reason"]
    for path in local_checkpoints(out):
        assert load_checkpoint(path)["iteration"] == iteration_of(path.name)

    second = run_trainer(args, cwd=tmp_path)  # the same job with the host's /dev/shm: it resumes and ends
    assert second.returncode == 0, second.stderr[-3000:]
    assert only_run(MlflowClient(uri), "shm").info.status == "FINISHED"


def test_a_dev_shm_full_before_the_workers_start_is_the_same_one_line(tmp_path, data_dir):
    """The loader's queues lock with semaphores, files in /dev/shm: one already full (a 4 KiB tmpfs here,
    a crashed job's leftovers in docker's 64 MB) failed the loader's start with a bare `OSError: [Errno
    28] No space left on device` traceback and an AttributeError from torch's half-built iterator at exit."""
    full = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=4k tmpfs /dev/shm && exec "$@"', "sh")
    if subprocess.run([*full, "true"], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs in a mount namespace needs root (CAP_SYS_ADMIN)")
    args = job_args(tmp_path, data_dir, **{"TRACKING.ENABLED": "false", "DATA_LOADER.NUM_THREADS": 2, "SOLVER.MAX_ITER": 2})
    done = subprocess.run([*full, *trainer_cmd(*args)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.rstrip().splitlines()[-1].startswith(
        "error: the data loader's workers are out of shared memory: /dev/shm holds 0.0 MiB"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


# ---- signals: a second one exits at once; SIGTERM while the server hangs keeps the grace period -----

def test_second_signal_exits_at_once_and_leaves_nothing_behind(tmp_path, data_dir, mlflow_server, jobs):
    out = tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": "twice",
                                               "TRAIN.PREEMPT_GRACE_S": 60, "DATA_LOADER.NUM_THREADS": 2})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        children = job.children()  # the loader's workers
        proxy.set_mode("hang")  # the first signal's clean stop now waits on uploads: time for a second one
        job.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM received" in job.stderr, job, "the first signal's warning", timeout=30)
        time.sleep(0.5)
        assert job.proc.poll() is None
        job.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert job.wait(30) == 128 + signal.SIGTERM
        took = time.monotonic() - start
    assert took < 3.5, f"exited {took:.1f}s after the second signal"  # 1 s for the run's status, not the uploads'
    assert "second signal: exiting now" in job.stderr
    assert_gone(children, within=5.0)
    for path in local_checkpoints(out):  # whatever has a checkpoint's name is complete
        load_checkpoint(path)


def test_two_quick_signals_exit_at_once_with_the_run_killed(tmp_path, data_dir, jobs):
    """A second signal exits at once: it used to leave the run RUNNING."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "twice-quick"}), tmp_path)
    wait_until(lambda: 1 in job.iters(), job, "iteration 1")
    job.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(30) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert only_run(MlflowClient(uri), "twice-quick").info.status == "KILLED", job.stderr[-3000:]


def test_a_short_grace_period_is_kept_to_the_exit(tmp_path, data_dir, jobs):
    """TRAIN.PREEMPT_GRACE_S 1: the stop is done in a fraction of a second, but the interpreter's
    teardown (torch, MLflow) took 2-3 s more, after the hard deadline could no longer act."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "short-grace",
                                               "TRAIN.PREEMPT_GRACE_S": 1}), tmp_path)
    wait_until(lambda: 1 in job.iters(), job, "iteration 1")
    job.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert job.wait(30) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert time.monotonic() - start < 1.5, "exited after the grace period"
    assert only_run(MlflowClient(uri), "short-grace").info.status == "KILLED", job.stderr[-3000:]


def test_a_group_signal_while_loader_workers_start_is_one_clean_stop(tmp_path, data_dir, jobs):
    """`kill -- -PGID` in the moment the loader forks its workers: a new worker still had the
    trainer's handler and signal pipe, so the one signal counted twice (an exit at once, the run left
    RUNNING, a traceback), or a worker died of it; workers that outlived the stop held the exit
    until the grace period's end. Workers now fork with the signals blocked."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "forking",
                                           "DATA_LOADER.NUM_THREADS": 2})
    job = jobs(args, tmp_path)
    wait_until(lambda: "MLflow run" in job.stderr, job, "the run", poll=0.005)
    time.sleep(0.05)  # the loader's workers start about now
    job.signal_group(signal.SIGTERM)
    start = time.monotonic()
    assert job.wait(60) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert time.monotonic() - start < 15, "held until the grace period's end"
    assert "Traceback" not in job.stderr and "second signal" not in job.stderr, job.stderr[-3000:]
    assert only_run(MlflowClient(uri), "forking").info.status == "KILLED"
    end = time.monotonic() + 3
    while time.monotonic() < end:  # no worker left behind in the group (PR_SET_PDEATHSIG, then reaped)
        try:
            os.killpg(job.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("processes of the job's group outlived it")


def test_a_closed_terminal_stops_like_sigterm_and_nohup_keeps_the_job_running(tmp_path, data_dir, jobs):
    """SIGHUP to the group (the terminal or ssh session that started the job closed) killed the
    trainer and its workers at once and left the run RUNNING. It is now a clean stop (exit 129,
    KILLED, the iteration checkpointed); under `nohup` it is ignored and the job trains on."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "hangup",
                                           "DATA_LOADER.NUM_THREADS": 2})
    out, client = tmp_path / "output", MlflowClient(uri)
    first = jobs(args, tmp_path, name="first", launcher=HUP_DEFAULT)
    wait_until(lambda: 1 in first.iters(), first, "iteration 1")
    first.signal_group(signal.SIGHUP)
    assert first.wait(60) == 128 + signal.SIGHUP, first.stderr[-3000:]
    assert "SIGHUP received" in first.stderr and "Traceback" not in first.stderr, first.stderr[-3000:]
    done = logged_iters(out)[-1]
    assert load_checkpoint(out / f"model_iter{done}.pth")["iteration"] == done
    run = only_run(client, "hangup")
    assert run.info.status == "KILLED" and run.data.tags["tracktron.status_reason"] == "stopped by SIGHUP"

    second = jobs(args, tmp_path, name="second", launcher=("nohup",))
    wait_until(lambda: second.iters(), second, "its first resumed iteration")
    second.signal_group(signal.SIGHUP)
    assert second.wait(120) == 0, second.stderr[-3000:]
    assert second.iters()[0] == done + 1 and second.iters()[-1] == MAX_ITER - 1
    assert only_run(client, "hangup").info.status == "FINISHED"


def test_a_job_started_with_sigint_ignored_keeps_it_ignored(tmp_path, data_dir, jobs):
    """`tracktron train ... &` in a script: bash starts it with SIGINT ignored, so that a Ctrl-C meant
    for the script does not stop it. The trainer put its own handler in and stopped (exit 130) as
    nohup's SIGHUP is kept ignored (helper-47's red team)."""
    job = jobs(job_args(tmp_path, data_dir), tmp_path, launcher=("env", "--ignore-signal=INT"))
    wait_until(lambda: 1 in job.iters(), job, "iteration 1")
    job.signal_group(signal.SIGINT)
    assert job.wait(120) == 0, job.stderr[-3000:]
    assert "SIGINT" not in job.stderr and job.iters()[-1] == MAX_ITER - 1


def test_a_job_killed_during_a_periodic_evaluation_evaluates_that_checkpoint_first_when_it_resumes(tmp_path, data_dir,
                                                                                                    jobs):
    """A stop during a periodic evaluation (a COCO evaluation outlasts the 25 s grace period) resumed
    after the checkpoint being evaluated: its scores and its model were lost for good, with no word
    (helper-47's red team). The resumed job evaluates it first, into the run, linked to its model."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "cut-short",
                                           "TEST.DATASETS": "('synth_shapes_val',)", "TEST.EVAL_PERIOD": 5})
    client = MlflowClient(uri)
    first = jobs(args, tmp_path, name="first")
    def uploaded() -> bool:  # on the server, tagged complete: its evaluation is under way
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()]) if re.search(
            r"wrote checkpoint \S*model_iter4\.pth", first.stderr) else []
        return bool(runs) and sha_tag("model_iter4.pth") in runs[0].data.tags

    wait_until(uploaded, first, "model_iter4 uploaded")
    first.kill_group()
    run_id = only_run(client, "cut-short").info.run_id
    lacked = 4 not in [m.step for m in client.get_metric_history(run_id, "bbox/AP")]
    second = jobs(args, tmp_path, name="second")
    assert second.wait(240) == 0, second.stderr[-3000:]
    assert ("the run lacks the evaluation of model_iter4.pth" in second.stderr) == lacked
    assert sorted(m.step for m in client.get_metric_history(run_id, "bbox/AP")) == [4, 9]
    models = {m.name for m in client.search_logged_models([only_run(client, "cut-short").info.experiment_id])}
    assert {"model_iter4", "model_final"} <= models, models  # linked to the checkpoint the run holds



def test_a_periodic_evaluation_cut_short_with_its_checkpoints_upload_is_evaluated_once_the_resume_uploads_it(
        tmp_path, data_dir, mlflow_server, s3_server, jobs):
    """The job is killed while it evaluates model_iter4, whose upload the proxy holds: the server
    never got the checkpoint, so the resumed job had no model to link the scores to and went on
    without them. Now the resume uploads the checkpoint (row 216), then evaluates it first, linked."""
    exp, out = f"cut-upload-{uuid.uuid4().hex[:6]}", tmp_path / "output"
    client = MlflowClient(mlflow_server.url)
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.hold(rb"PUT /api/2\.0/mlflow-artifacts/artifacts/\S*/checkpoints/model_iter4\.pth ", after=1 << 20)
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "TEST.DATASETS": "('synth_shapes_val',)", "TEST.EVAL_PERIOD": 5})
        first = jobs(args, tmp_path, env=s3_server.env, name="first")
        wait_until(proxy.held.is_set, first, "the upload of model_iter4", timeout=300)
        first.kill_group()
        for later in [p for p in local_checkpoints(out) if iteration_of(p.name) > 4]:
            later.unlink()  # written between the hold and the kill: as if the kill had come first
        run_id = only_run(client, exp).info.run_id
        assert sha_tag("model_iter4.pth") not in client.get_run(run_id).data.tags
        second = jobs(args, tmp_path, env=s3_server.env, name="second")  # the proxy held one request only
        assert second.wait(300) == 0, second.stderr[-3000:]
    err = second.stderr
    assert "uploading model_iter4.pth, which run" in err
    assert "the run lacks the evaluation of model_iter4.pth" in err
    run = client.get_run(run_id)
    assert run.data.tags[sha_tag("model_iter4.pth")] == sha256_of(out / "model_iter4.pth")
    assert sorted(m.step for m in client.get_metric_history(run_id, "bbox/AP")) == [4, 9]
    models = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert {"model_iter4", "model_final"} <= models, models


def test_slurms_time_limit_warning_stops_the_job_for_its_requeue(tmp_path, data_dir, jobs):
    """`sbatch --signal=USR1@120`: SIGUSR1 (or SIGUSR2) before the time limit, for the job to save
    and be requeued. Its default action killed the trainer mid-iteration and left the run RUNNING."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "slurm",
                                               "DATA_LOADER.NUM_THREADS": 1}), tmp_path)
    wait_until(lambda: 1 in job.iters(), job, "iteration 1")
    job.signal_group(signal.SIGUSR1)
    assert job.wait(60) == 128 + signal.SIGUSR1, job.stderr[-3000:]
    done = logged_iters(tmp_path / "output")[-1]
    assert load_checkpoint(tmp_path / "output" / f"model_iter{done}.pth")["iteration"] == done
    run = only_run(MlflowClient(uri), "slurm")
    assert run.info.status == "KILLED" and run.data.tags["tracktron.status_reason"] == "stopped by SIGUSR1"


def test_sigterm_after_model_final_lets_the_job_complete_within_its_grace_period(tmp_path, data_dir, jobs):
    """A signal during the final evaluation and model logging: the job completes them (exit 0,
    FINISHED, the model logged) and says so; it said 'finishing this iteration, then checkpointing'."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "last-steps",
                                               "TEST.DATASETS": "('synth_shapes_val',)",
                                               "TRACKING.LOG_MODEL": "true"}), tmp_path)
    wait_until(lambda: "model_final.pth" in job.stderr, job, "model_final", poll=0.01)
    time.sleep(0.3)  # the final evaluation has begun
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0, job.stderr[-3000:]
    assert ("SIGTERM received: the last iteration is done; the job completes model_final, the final evaluation and "
            "the model's logging") in job.stderr
    run = only_run(MlflowClient(uri), "last-steps")
    assert run.info.status == "FINISHED" and "tracktron.model_id" in run.data.tags


# os.replace made slow for model_final.pth, after a mark that its rename has begun: the job's window
# between its last iteration and its last steps, held open for a test.
SLOW_FINAL_RENAME = """
import os, time
_replace = os.replace
def _slow(src, dst, *args, **kwargs):
    if str(dst).endswith("model_final.pth"):
        open(os.environ["MARK_RENAMING"], "w").close()
        time.sleep(3)
    return _replace(src, dst, *args, **kwargs)
os.replace = _slow
"""


def test_sigterm_while_model_final_is_written_says_the_job_completes(tmp_path, data_dir, jobs):
    """A signal while model_final is being written, after the last iteration: the job completes (exit
    0, FINISHED), and it said 'finishing this iteration, then checkpointing and stopping' (helper-79)."""
    site, uri = tmp_path / "site", f"sqlite:///{tmp_path / 'mlflow.db'}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_FINAL_RENAME)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
           "MARK_RENAMING": str(site / "renaming")}
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "final-window"}),
               tmp_path, env=env)
    wait_until(lambda: (site / "renaming").exists(), job, "model_final's rename", poll=0.01)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0, job.stderr[-3000:]
    assert "SIGTERM received: the last iteration is done; the job completes model_final" in job.stderr
    assert "finishing this iteration" not in job.stderr
    assert load_checkpoint(tmp_path / "output" / "model_final.pth")["iteration"] == MAX_ITER - 1
    assert only_run(MlflowClient(uri), "final-window").info.status == "FINISHED"


def test_sigterm_while_the_final_model_is_logged_lets_the_upload_complete(tmp_path, data_dir, jobs):
    """The model is logged by the uploader while the job waits for its uploads: a signal then, as
    during the final evaluation, lets them complete (exit 0, FINISHED, the model logged). It was
    KILLED at once with exit 143, the model never logged (2026-12-04's red team)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "flush-signal",
                                               "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "true"}), tmp_path)
    wait_until(lambda: "Validating input example" in job.stderr, job, "the model being logged", poll=0.01)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0, job.stderr[-3000:]
    assert ("SIGTERM received: the last iteration is done; the job completes model_final, the final evaluation and "
            "the model's logging") in job.stderr
    run = only_run(MlflowClient(uri), "flush-signal")
    assert run.info.status == "FINISHED" and "tracktron.model_id" in run.data.tags


def test_a_flush_timeout_too_short_for_the_model_still_ends_the_run(tmp_path, data_dir, mlflow_server):
    """TRACKING.FLUSH_TIMEOUT_S 0 (or 1), with a model whose logging takes longer (here the server
    finalizes it 4 s late): the uploads took the whole time and the run stayed RUNNING for good
    (2026-12-04's red team). Its status is one request of its own now: FINISHED (training did
    finish), and the job exits 1 naming what the server lacks; the rerun sends it."""
    exp = f"short-flush-{uuid.uuid4().hex[:6]}"
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.delay_requests(rb"^PATCH /api/2\.0/mlflow/logged-models/", 4.0)
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "SOLVER.MAX_ITER": 2, "TRACKING.LOG_MODEL": "true"})
        job = run_trainer([*args, "TRACKING.FLUSH_TIMEOUT_S", "0"], cwd=tmp_path)
        assert job.returncode == 1, job.stderr[-3000:]
        last = job.stderr.strip().splitlines()[-1]
        assert last.startswith("error: the tracking server did not get: log the final model"), last
        client = MlflowClient(mlflow_server.url)
        assert only_run(client, exp).info.status == "FINISHED"
        short = run_trainer([*args, "TRACKING.FLUSH_TIMEOUT_S", "0"], cwd=tmp_path)  # a rerun that is cut short too
        assert short.returncode == 1, short.stderr[-3000:]
        assert short.stdout.strip().splitlines()[-1].endswith("): nothing to train")  # it claimed 'sent ... the model'
        again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1].endswith("sent the run what it lacked: the model")
    assert "tracktron.model_id" in only_run(client, exp).data.tags


def test_a_job_waiting_for_its_last_uploads_still_beats(tmp_path, data_dir, mlflow_server, jobs):
    """helper-72's red team: the heartbeat rode on the metric sender, which was closed before the
    uploader's last jobs; while a model uploaded (minutes for a real detector) `status` called the
    job LOST, and the same job started elsewhere would take its run as free after 20 s. The sender
    now beats until those jobs are done."""
    exp = f"flush-beat-{uuid.uuid4().hex[:6]}"
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.delay_requests(rb"^PATCH /api/2\.0/mlflow/logged-models/", 20.0)  # the model's finalize
        job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                                   "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "true"}), tmp_path)
        wait_until(lambda: "Validating input example" in job.stderr, job, "the model being logged", poll=0.05)
        client = MlflowClient(mlflow_server.url)
        beats = [json.loads(only_run(client, exp).data.tags["tracktron.heartbeat"])["time"]]
        time.sleep(12)  # more than two of the sender's intervals (METRICS_INTERVAL_S)
        run = only_run(client, exp)
        beats.append(json.loads(run.data.tags["tracktron.heartbeat"])["time"])
        assert run.info.status == "RUNNING" and beats[1] > beats[0], job.stderr[-2000:]
        assert job.wait(120) == 0, job.stderr[-3000:]
    run = only_run(client, exp)
    assert run.info.status == "FINISHED" and "tracktron.model_id" in run.data.tags


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
        children = job.children()
        proxy.set_mode("hang")  # accepts, reads, never answers
        job.signal_group(signal.SIGTERM)  # as systemd or `tini -g` do: the workers get it too
        start = time.monotonic()
        code = job.wait(grace + 30)
        took = time.monotonic() - start
    assert code == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert took <= grace + 5, f"exited {took:.1f}s after SIGTERM; the grace period is {grace}s"
    assert "Traceback" not in job.stderr
    assert "stopped by SIGTERM" in job.stderr or f"grace period of {grace}s over: exiting now" in job.stderr
    assert_gone(children)
    done = logged_iters(out)[-1]
    assert load_checkpoint(out / f"model_iter{done}.pth")["iteration"] == done
    run = only_run(MlflowClient(mlflow_server.url), exp)
    assert sha_tag(f"model_iter{done}.pth") not in run.data.tags  # never claimed without its bytes


@pytest.mark.parametrize("flags", [["--resume", "0123456789abcdef0123456789abcdef"], []],
                         ids=["resume-run-id", "auto-resume"])
def test_a_tracking_server_that_never_answers_the_run_lookup_stops_the_job_in_one_line(tmp_path, data_dir,
                                                                                        mlflow_server, flags):
    """The lookup of the job's run (and the check that --resume's run is this job's, not someone
    else's) against a server that accepts and never answers: one line, within MLflow's request
    timeout as the user set it, before anything is trained or written."""
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.set_mode("hang")
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": "silent"})
        start = time.monotonic()
        done = run_trainer([*flags, *args], cwd=tmp_path, timeout=180,
                           env={"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
        took = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("error: ") and proxy.url.split("//")[1] in lines[-1], lines[-1]
    assert took < 60, f"{took:.0f}s with a 3 s request timeout and no retries"
    assert not (tmp_path / "output").exists() or not list((tmp_path / "output").glob("*.pth"))
    assert MlflowClient(mlflow_server.url).get_experiment_by_name("silent") is None


def test_a_tracking_server_that_answers_errors_is_not_called_unreachable(tmp_path, data_dir):
    """A server (or its proxy) that is up and answers 503 to everything: the line said "cannot reach
    the tracking server (is it running?)", which sends the user to check the wrong thing. Found
    by the red team of 2026-12-03."""
    with FaultProxy("http://127.0.0.1:9") as proxy:  # answers 503 itself, whatever is behind it
        proxy.set_mode("error")
        done = run_trainer(job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url}), cwd=tmp_path, timeout=180,
                           env={"MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (f"error: the tracking server at {proxy.url} answers with HTTP 503 "
                                                    "errors (see its log); TRACKING.ENABLED false trains without tracking")


# ---- tracking server: SIGKILL mid-upload, tampered local and truncated server checkpoints, slow server ---

def test_sigkill_mid_upload_then_corrupt_checkpoints_then_resume_through_a_slow_server(
        tmp_path, data_dir, mlflow_server, s3_server, reference, jobs):
    """The first model_iter upload to go out is held after 1 MiB and the trainer SIGKILLed there; the
    newer local checkpoints rot; the resumed job goes through a slow link. Each checkpoint is evaluated
    (evaluation restores the RNG states, so the weights are the reference's): an evaluated checkpoint is
    never superseded, so one is uploaded however far the uploader lags behind the first second's jobs
    (a fresh clone's run once saw model_iter2, 5 and 8 all superseded by model_final)."""
    exp = f"upload-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    machine = tmp_path / "machine1"
    out = machine / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.hold(rb"PUT /api/2\.0/mlflow-artifacts/artifacts/\S*/checkpoints/model_iter\d+\.pth ", after=1 << 20)
        args = job_args(machine, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                              "TRACKING.FLUSH_TIMEOUT_S": 120, "TEST.EVAL_PERIOD": 3,
                                              "TEST.DATASETS": "('synth_shapes_val',)"})
        first = jobs(args, machine, env=s3_server.env, name="first")
        wait_until(proxy.held.is_set, first, "the upload of a model_iter checkpoint", timeout=300)
        held = int(re.search(rb"model_iter(\d+)\.pth", proxy.held_request).group(1))
        # Training goes on while the upload is held (it may still be evaluating the held one now).
        wait_until(lambda: any(iteration_of(p.name) > held for p in local_checkpoints(out)), first,
                   "a checkpoint past the held one", timeout=300)
        first.kill_group()  # 1 MiB of the held checkpoint has gone out; the rest never will

        tags = only_run(client, exp).data.tags
        assert "tracktron.ckpt.latest" not in tags  # the half-uploaded checkpoint is not claimed
        assert not [t for t in tags if t.endswith(".sha256")]
        assert load_checkpoint(out / f"model_iter{held}.pth")["iteration"] == held
        rotten = [p for p in local_checkpoints(out) if iteration_of(p.name) > held]
        assert rotten  # the trainer went on past the held upload: at least model_final
        for path in rotten:  # whatever the trainer wrote after the held checkpoint rots
            flip_bytes(path)

        # Resumed through a slow link: every byte of every request is delayed.
        proxy.set_mode("slow", delay=0.03)
        second = run_trainer(args, cwd=machine, env=s3_server.env, timeout=400)
    assert second.returncode == 0, second.stderr
    err = second.stderr
    for path in rotten:
        assert f"{path.name}: corrupt (record" in err or f"{path.name}: not a complete checkpoint" in err
    assert f"resuming from {out / f'model_iter{held}.pth'} at iteration {held + 1}" in err
    assert f"uploading model_iter{held}.pth, which run" in err  # the half-uploaded one goes up whole (row 216)
    run = only_run(client, exp)
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(MAX_ITER))
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert run.data.tags[sha_tag("model_final.pth")] == sha256_of(out / "model_final.pth")
    assert run.data.tags[sha_tag(f"model_iter{held}.pth")] == sha256_of(out / f"model_iter{held}.pth")
    for name in ("model_iter5.pth", "model_iter8.pth"):  # uploaded unless a newer one superseded it first
        if sha_tag(name) in run.data.tags:
            assert run.data.tags[sha_tag(name)] == sha256_of(out / name)
    assert_same_weights(reference, out / "model_final.pth")


def test_a_resumed_job_that_fails_its_checks_drops_the_checkpoint_it_began_downloading(
        tmp_path, data_dir, mlflow_server, s3_server, jobs):
    """A resumed job's newest checkpoint downloads from the moment its run is found, before the checks
    (it overlaps torch's import). Here that download hangs and a check fails: the job still ends at
    once with its one line, leaves no partial download behind and the run as it was; with its data
    mended it resumes from that checkpoint."""
    exp = f"prefetch-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    keys = {"TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": exp}
    first = jobs(job_args(tmp_path / "machine1", data_dir, **keys), tmp_path / "machine1", env=s3_server.env)

    def complete() -> bool:  # the run (made once the checks passed) holds a checkpoint with its tag
        made = client.get_experiment_by_name(exp)  # made a moment before the run: none may be there yet
        runs = client.search_runs([made.experiment_id]) if made else []
        return any(t.endswith(".sha256") for run in runs for t in run.data.tags)

    wait_until(complete, first, "a checkpoint complete on the server", poll=0.2)
    first.kill_group()
    before = only_run(client, exp)
    newest = before.data.tags["tracktron.ckpt.latest"]

    machine = tmp_path / "machine2"  # an empty machine whose copy of the dataset is broken
    broken = machine / "data"
    shutil.copytree(data_dir, broken)
    (broken / "synth_shapes" / "train" / "annotations.json").write_text("{")
    out = machine / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        # The checkpoint's presigned URL (ranged reads from the store), or its GET through the server, hangs.
        proxy.hold(rb"GET /api/2\.0/mlflow-artifacts/(artifacts|presigned)/\S*/checkpoints/" + re.escape(newest.encode()),
                   after=0)
        args = job_args(machine, broken, **{**keys, "TRACKING.URI": proxy.url})
        bad = run_trainer(args, cwd=machine, env=s3_server.env, timeout=120)
        assert proxy.held.is_set()  # the download had begun when the check failed
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "annotations.json" in bad.stderr.strip().splitlines()[-1]
    assert not out.exists()  # as it found it: the partial download gone, then the folder it made
    after = only_run(client, exp)
    assert (after.info.status, after.data.tags) == (before.info.status, before.data.tags)

    good = run_trainer(job_args(machine, data_dir, **keys), cwd=machine, env=s3_server.env)
    assert good.returncode == 0, good.stderr[-3000:]
    resumed = f"resuming from run {before.info.run_id} ({newest}) at iteration {iteration_of(newest) + 1}"
    assert resumed in good.stderr, good.stderr[-3000:]
    assert only_run(client, exp).info.status == "FINISHED"


def test_a_checkpoint_is_marked_complete_only_after_the_metrics_of_its_iterations(tmp_path, monkeypatch):
    """SIGKILL right after checkpoint N is complete on the server: the resumed job continues at N+1,
    so iterations <= N must already be in the run's curves, or they have a hole for good (before
    this held, test_tracking.py::test_killed_job_resumes_from_the_server_on_an_empty_machine failed).
    In-process, against sqlite, with a metrics path 3 s slower than the rest: deterministic."""
    from tests.conftest import DEMO
    from trainer.config import load_config
    from trainer.tracking.mlflow_tracker import MlflowTracker

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEMO, ["TRACKING.URI", f"sqlite:///{tmp_path / 'store.db'}", "OUTPUT_DIR", str(tmp_path)])
    tracker = MlflowTracker(cfg)
    tracker.start(cfg)
    run_id = tracker.run.run_id
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
    tracker.log_checkpoint(path, sha256_of(path))
    assert tracker.wait(30)
    tracker.finish("FINISHED", timeout=30)
    tagged = calls.index(("tag", sha_tag("model_iter2.pth")))
    assert any(kind == "metrics" and step >= 2 for kind, step in calls[:tagged]), calls
    assert steps(MlflowClient(cfg.TRACKING.URI), run_id) == [0, 1, 2]


# ---- a signal before the loop: no iteration to finish; during the checks no run is made yet ----------

def test_a_signal_during_the_checks_stops_at_once_and_makes_no_run(tmp_path, mlflow_server, jobs):
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
    assert client.get_experiment_by_name(exp) is None  # the run (and its experiment) come after the checks

    again = jobs(args, tmp_path, name="again")  # the same job, to the end, in one run
    assert again.wait(240) == 0, again.stderr[-3000:]
    assert only_run(client, exp).info.status == "FINISHED"


# ---- an outage holds the uploads: local pruning keeps what is still to go ------------------------------

def test_an_outage_never_lets_local_pruning_delete_an_evaluated_checkpoint_before_its_upload(
        tmp_path, data_dir, mlflow_server, jobs):
    """TRAIN.CHECKPOINTS_KEEP 1 with every checkpoint evaluated (so each must reach the run, linked
    to its model), while the server answers 503 to everything from iteration 1 until model_iter8 is
    written. Found by the second adversarial pass: a checkpoint pruned locally before its queued
    upload ran was reported "No such file", its evaluation linked to nothing on the server."""
    exp = f"outage-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "TRAIN.CHECKPOINTS_KEEP": 1, "TEST.DATASETS": "('synth_shapes_val',)",
                                               "TEST.EVAL_PERIOD": 3, "TEST.VIS_IMAGES": 0})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        proxy.set_mode("error")  # every request: HTTP 503 (the uploads queue up and retry)
        wait_until(lambda: (out / "model_iter8.pth").exists(), job, "model_iter8")
        proxy.set_mode("pass")
        assert job.wait() == 0, job.stderr[-3000:]
    assert "No such file" not in job.stderr
    run = only_run(MlflowClient(mlflow_server.url), exp)
    for name in ("model_iter2.pth", "model_iter5.pth", "model_iter8.pth", "model_final.pth"):
        assert sha_tag(name) in run.data.tags, f"{name} never reached the run"
    assert {"model_final.pth", "model_iter8.pth"} <= {p.name for p in local_checkpoints(out)}


def test_a_resume_into_a_run_that_lacks_iterations_says_so(tmp_path, data_dir, jobs):
    """A job stopped while it trained untracked, resumed with tracking on: its new run has no
    metrics before the checkpoint, and nothing said so (the same when a SIGKILL comes before the
    metric sender's next batch). One warning names the missing iterations."""
    job = jobs(job_args(tmp_path, data_dir, **{"TRACKING.ENABLED": "false", "SOLVER.MAX_ITER": 40}), tmp_path)
    wait_until(lambda: (tmp_path / "output" / "model_iter5.pth").exists(), job, "model_iter5")
    job.signal_group(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM
    stopped_at = max(iteration_of(p.name) for p in local_checkpoints(tmp_path / "output"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracked = run_trainer(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 40}), cwd=tmp_path)
    assert tracked.returncode == 0, tracked.stderr[-2000:]
    run = only_run(MlflowClient(uri), "demo")
    assert f"run {run.info.run_id} has no metrics for iterations 0-{stopped_at} " in tracked.stderr
    assert steps(MlflowClient(uri), run.info.run_id) == list(range(stopped_at + 1, 40))



def test_a_tracked_resume_from_checkpoints_copied_without_their_log_ends_0(tmp_path, data_dir):
    """Checkpoints copied to a new folder without json_stats.log, resumed tracked: the first
    checkpoint, before the first log line, queued the upload of a log that was not there, and the job
    trained to the end and exited 1 (`did not get: upload json_stats.log`; helper-51)."""
    keys = {"SOLVER.MAX_ITER": 9, "LOG_PERIOD": 20}
    assert run_trainer(job_args(tmp_path / "a", data_dir, **keys, **{"TRACKING.ENABLED": "false"}),
                       cwd=tmp_path).returncode == 0
    (tmp_path / "b" / "output").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "output" / "model_iter2.pth", tmp_path / "b" / "output")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resumed = run_trainer(job_args(tmp_path / "b", data_dir, **keys, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    run = only_run(MlflowClient(uri), "demo")
    assert all(sha_tag(name) in run.data.tags for name in ("model_iter2.pth", "model_iter5.pth", "model_final.pth"))
    assert "json_stats.log" in {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}


def test_a_finished_job_whose_run_lacks_metrics_says_so_on_its_nothing_to_do(tmp_path, data_dir):
    """A job whose metrics never reached its run (every log-batch failed; trained untracked, here)
    and that is then started again: nothing to train, exit 0, and not a word of the empty curve.
    Found by the red team of 2026-12-03."""
    assert run_trainer(job_args(tmp_path, data_dir, **{"TRACKING.ENABLED": "false", "SOLVER.MAX_ITER": 6}),
                       cwd=tmp_path).returncode == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = run_trainer(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 6}), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    run = only_run(MlflowClient(uri), "demo")
    assert "nothing to train; sent the run what it lacked: model_final.pth" in again.stdout
    assert f"run {run.info.run_id} has no metrics for iterations 0-5 " in again.stderr


def test_a_model_final_without_categories_is_logged_with_the_training_sets(tmp_path, data_dir):
    """A model_final written before checkpoints named their categories (2026-11-30), its run without
    a model: the rerun ended 0 with a warning that no model could be logged, and nothing at the end
    said so (helper-67's red team). The job's training set names them, and its network takes the
    weights: the model is logged with them."""
    keys = {"SOLVER.MAX_ITER": 4, "TRACKING.LOG_MODEL": "true"}
    assert run_trainer(job_args(tmp_path, data_dir, **keys, **{"TRACKING.ENABLED": "false"}),
                       cwd=tmp_path).returncode == 0
    final = tmp_path / "output" / "model_final.pth"
    state = torch.load(final, weights_only=True)
    del state["categories"]
    torch.save(state, final)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = run_trainer(job_args(tmp_path, data_dir, **keys, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "model_final.pth predates the categories a model keeps: the training set's are taken" in again.stderr
    run = only_run(MlflowClient(uri), "demo")
    assert "tracktron.model_id" in run.data.tags, again.stderr[-3000:]
    logged = json.loads((tmp_path / "output" / "model" / "detector" / "categories.json").read_text())
    assert [c["name"] for c in logged["categories"]] == ["square", "circle", "triangle"]


def test_a_rerun_evaluates_model_final_when_its_run_lacks_the_evaluation(tmp_path, data_dir):
    """A job killed during its final evaluation (or whose server was down then, or that finished
    untracked, as here) was "nothing to do" when run again: the run never got its AP, and @best went
    to the final model as "nothing was evaluated". The rerun now evaluates model_final into the run
    first, then logs and registers the model; a third start has nothing left to send.
    Found by the red team of 2026-12-03 (second)."""
    keys = {"SOLVER.MAX_ITER": 6, "TEST.DATASETS": "('synth_shapes_val',)", "TRACKING.LOG_MODEL": "true",
            "TRACKING.REGISTERED_MODEL": "det"}
    assert run_trainer(job_args(tmp_path, data_dir, **keys, **{"TRACKING.ENABLED": "false"}),
                       cwd=tmp_path).returncode == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = run_trainer(job_args(tmp_path, data_dir, **keys, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run lacks the evaluation of model_final.pth: evaluating it now" in again.stderr
    assert "nothing was evaluated" not in again.stderr
    client = MlflowClient(uri)
    run = only_run(client, "demo")
    assert steps(client, run.info.run_id, "bbox/AP") == [5]
    assert run.data.tags["tracktron.best_checkpoint"] == "model_final.pth"
    assert run.info.status == "FINISHED" and "tracktron.model_id" in run.data.tags
    final, best = (client.get_model_version_by_alias("det", a) for a in ("final", "best"))
    assert best.version == final.version and final.run_id == run.info.run_id

    third = run_trainer(job_args(tmp_path, data_dir, **keys, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "evaluating it now" not in third.stderr and "lacks its logged model" not in third.stderr
    assert steps(client, run.info.run_id, "bbox/AP") == [5]


def test_a_rerun_never_scores_the_run_on_test_sets_that_are_not_its_own(tmp_path, data_dir):
    """TEST is no part of the job: a rerun of a finished job with other TEST.DATASETS than its run
    was scored on would put their AP under the run's `bbox/AP` (and could move @best). It says so
    and logs the model without it. Found by the review of 2026-12-03 (second)."""
    keys = {"SOLVER.MAX_ITER": 6, "TRACKING.LOG_MODEL": "true"}
    val, uri = {"TEST.DATASETS": "('synth_shapes_val',)"}, f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert run_trainer(job_args(tmp_path, data_dir, **keys, **val, **{"TRACKING.ENABLED": "false"}),
                       cwd=tmp_path).returncode == 0
    logged = run_trainer(job_args(tmp_path, data_dir, **keys, **{"TEST.DATASETS": "()", "TRACKING.URI": uri}),
                         cwd=tmp_path)
    assert logged.returncode == 0 and "evaluating it now" not in logged.stderr, logged.stderr[-3000:]
    client = MlflowClient(uri)
    run = only_run(client, "demo")
    client.set_tag(run.info.run_id, "tracktron.eval.datasets", '[["synth_shapes_train", "0123"]]')
    again = run_trainer(job_args(tmp_path, data_dir, **keys, **val, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"model_final.pth is not evaluated into run {run.info.run_id}: its scores are of synth_shapes_train; "
            "these test sets are synth_shapes_val (or other annotation files)") in again.stderr
    assert steps(client, run.info.run_id, "bbox/AP") == []


def test_a_start_over_sets_the_earlier_checkpoints_aside_so_its_own_resume(tmp_path, data_dir, jobs):
    """--no-resume in a folder with a finished job's files left its model_final in place: the new
    start, stopped and run again, took it for its own (nothing to do) and closed its new run with
    the earlier job's model."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 40, "TRACKING.LOG_MODEL": "true",
                                           "TEST.DATASETS": "('synth_shapes_val',)"})
    assert run_trainer(args, cwd=tmp_path).returncode == 0
    out = tmp_path / "output"
    earlier_final = sha256_of(out / "model_final.pth")
    earlier_model = sha256_of(out / "model" / "detector" / "weights.pt")
    assert (out / "eval" / "synth_shapes_val" / "detections.json").is_file()
    plan = run_trainer(["--no-resume", "--dry-run", *args], cwd=tmp_path)
    assert plan.stdout.strip().endswith("starts over: its 11 checkpoints move to earlier-<time>/"), plan.stdout
    again = jobs(["--no-resume", *args], tmp_path)
    wait_until(lambda: (out / "model_iter5.pth").exists(), again, "the new start's model_iter5")
    again.signal_group(signal.SIGTERM)
    assert again.wait() == 128 + signal.SIGTERM
    [aside] = list(out.glob("earlier-*"))
    assert sha256_of(aside / "model_final.pth") == earlier_final and (aside / "json_stats.log").is_file()
    assert (aside / "log.txt").read_text().endswith("the job ends FINISHED\n")  # the new start's log is its own
    assert (out / "log.txt").read_text().count("started on") == 1 and "the job ends KILLED" in (out / "log.txt").read_text()
    assert "model_final.pth" not in os.listdir(out)
    # helper-70: `predict --weights output/model/detector` used the earlier job's model until the new one's end
    assert sha256_of(aside / "model" / "detector" / "weights.pt") == earlier_model and (aside / "eval").is_dir()
    assert not {"model", "eval"} & set(os.listdir(out))
    rerun = run_trainer(args, cwd=tmp_path)
    assert rerun.returncode == 0 and "training finished" in rerun.stdout, rerun.stderr[-2000:]
    assert re.search(r"resuming from .*model_iter\d+\.pth.* at iteration", rerun.stderr)  # the new start's own
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert steps(client, runs[1].info.run_id) == list(range(40))
