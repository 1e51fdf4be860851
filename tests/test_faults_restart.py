"""Fault injection, a job stopped at a moment of its life and started again with the same command
(helper-79's sweep; docs/FAULTS.md has the matrix, tests/test_faults.py the other signals)."""
from __future__ import annotations

import os
import signal

from mlflow import MlflowClient

from tests.conftest import run_trainer
from tests.faultkit import (  # noqa: F401 - jobs, _no_run_id_file are fixtures
    _no_run_id_file, job_args, jobs, logged_iters, only_run, steps, wait_until)


def test_a_stop_after_the_run_opened_and_before_the_loop_says_no_training_began(tmp_path, data_dir, jobs):
    """SIGTERM once the run is open, while the network and loader are set up: nothing of this start
    was trained, yet the job said `stopped by SIGTERM; the job resumes from its last checkpoint`, of a
    job that had none. The process is held (SIGSTOP) at the run's line, so the signal lands in the set-up."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "setup-stop"})
    job = jobs(args, tmp_path)
    wait_until(lambda: "MLflow run" in job.stderr, job, "the run", poll=0.002)
    os.kill(job.pid, signal.SIGSTOP)
    job.signal_group(signal.SIGTERM)
    os.kill(job.pid, signal.SIGCONT)
    assert job.wait(60) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert logged_iters(tmp_path / "output") == [], "the signal was meant to land before the first iteration"
    assert job.last_line.endswith("stopped by SIGTERM before training began"), job.stderr[-3000:]
    assert "resumes from its last checkpoint" not in job.stderr and "Traceback" not in job.stderr, job.stderr[-3000:]
    client = MlflowClient(uri)
    assert only_run(client, "setup-stop").info.status == "KILLED"

    again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    run = only_run(client, "setup-stop")
    assert run.info.status == "FINISHED" and steps(client, run.info.run_id) == list(range(10))


def test_a_stop_during_a_finished_jobs_rerun_says_its_training_is_over(tmp_path, data_dir, jobs):
    """SIGTERM to the rerun of a finished job while it evaluates model_final for its run (the job
    trained untracked): it said `the job resumes from its last checkpoint` (or, once set-up stops
    said so, `before training began`) of a job whose model_final was saved."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "rerun-stop",
                                           "TEST.DATASETS": "('synth_shapes_val',)"})
    assert run_trainer([*args, "TRACKING.ENABLED", "false"], cwd=tmp_path).returncode == 0
    rerun = jobs(args, tmp_path, name="rerun")
    wait_until(lambda: "evaluating it now" in rerun.stderr, rerun, "the final evaluation", poll=0.002)
    os.kill(rerun.pid, signal.SIGSTOP)
    rerun.signal_group(signal.SIGTERM)
    os.kill(rerun.pid, signal.SIGCONT)
    assert rerun.wait(60) == 128 + signal.SIGTERM, rerun.stderr[-3000:]
    assert rerun.last_line.endswith("stopped by SIGTERM; model_final.pth is saved: the next start sends the run "
                                    "what it still lacks"), rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr, rerun.stderr[-3000:]

    again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0 and "evaluating it now" in again.stderr, again.stderr[-3000:]
    assert only_run(MlflowClient(uri), "rerun-stop").info.status == "FINISHED"
