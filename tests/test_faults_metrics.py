"""Metrics that never reached the run: a job whose tracking server is down when it stops (a SIGTERM,
or the end of training) keeps them in OUTPUT_DIR/unsent_metrics.json, and its next start sends them
first, so the run's curves have every iteration once. Against a real `mlflow server` behind a
FaultProxy; the file's reader is tried with what nobody would write."""
from __future__ import annotations

import json
import logging
import signal
import uuid

import pytest
from mlflow import MlflowClient

from tests.conftest import run_trainer
from tests.faultkit import jobs, job_args, only_run, steps, wait_until  # noqa: F401 - jobs is a fixture
from tests.servers import FaultProxy
from trainer.checkpoint.files import UNSENT_METRICS
from trainer.tracking import unsent
from trainer.tracking.background import MetricSender
from trainer.tracking.base import RunInfo


def test_a_job_stopped_while_the_server_is_down_leaves_no_hole_in_its_curves(tmp_path, data_dir, mlflow_server, jobs):
    """SIGTERM during an outage: the checkpoint of the current iteration is local only, the points
    since the outage began were never sent. Before, the next start resumed after that checkpoint and
    the run lacked those iterations for good; now it sends them first, and sends no step twice."""
    exp, out = f"unsent-{uuid.uuid4().hex[:6]}", tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "SOLVER.MAX_ITER": 30, "TRAIN.PREEMPT_GRACE_S": 8})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        proxy.set_mode("error")  # every request: HTTP 503
        wait_until(lambda: (out / "model_iter8.pth").exists(), job, "model_iter8")
        job.signal_group(signal.SIGTERM)
        assert job.wait() == 128 + signal.SIGTERM, job.stderr[-3000:]
        kept = json.loads((out / UNSENT_METRICS).read_text())
        stopped_at = max(job.iters())
        assert max(p[3] for p in kept["points"]) == stopped_at
        proxy.set_mode("pass")
        again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "that an earlier start could not send" in again.stderr
    assert "has no metrics for iterations" not in again.stderr
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)
    assert run.info.run_id == kept["run_id"]
    assert steps(client, run.info.run_id) == list(range(30))  # every iteration, once
    assert not (out / UNSENT_METRICS).exists()


def test_metrics_the_server_never_got_at_the_end_are_named_and_sent_by_the_rerun(tmp_path, data_dir, mlflow_server,
                                                                                 jobs):
    """The server down from iteration 1 to the end (the first batch of metrics is due 5 s in): exit
    1, and the error line names the metrics (where they are kept) beside the checkpoints; the same
    command, the server back, sends them. Before, the metrics were lost for good."""
    exp, out = f"unsent-end-{uuid.uuid4().hex[:6]}", tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "TRACKING.FLUSH_TIMEOUT_S": 4})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        proxy.set_mode("error")
        assert job.wait() == 1, job.stderr[-3000:]
        last = job.last_line
        assert last.startswith("error: the tracking server did not get: ") and "model_final.pth" in last, last
        assert f", the metrics of 10 iterations (0-9) (kept in {out / UNSENT_METRICS})." in last, last
        proxy.set_mode("pass")
        again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train; sent the run what it lacked: the metrics of " in again.stdout
    client = MlflowClient(mlflow_server.url)
    assert steps(client, only_run(client, exp).info.run_id) == list(range(10))
    assert not (out / UNSENT_METRICS).exists()


# ---- the sender: what it gives up on, and sends again first ----

def test_the_sender_hands_back_every_point_it_gave_up_on_and_sends_them_first_next_time():
    def down(points):
        raise ConnectionError("down")

    sender = MetricSender(down, interval=0.05)
    for step in range(5):
        sender.put({"loss": step / 10, "lr": 0.01}, step)
    assert not sender.close(0.3)
    left = sender.leftover()
    assert sorted({p[3] for p in left}) == [0, 1, 2, 3, 4] and len(left) == 10

    got = []
    again = MetricSender(got.extend, interval=0.05)
    again.resend(left)
    again.put({"loss": 0.9}, 7)
    assert again.close(5)
    assert [p[3] for p in got] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 7]
    assert sorted(got[:10]) == sorted(left)  # the same points: same values and timestamps


# ---- the file: what nobody would write ----

def _kept(tmp_path, body):
    (tmp_path / UNSENT_METRICS).write_text(body if isinstance(body, str) else json.dumps(body))


@pytest.mark.parametrize("body", [
    "not json", "[]", "null", '{"run_id": "r1"}', {"run_id": "r1", "points": "abcd"},
    {"run_id": "r1", "points": [["loss", "0.5", 1, 2]]}, {"run_id": "r1", "points": [["loss", True, 1, 2]]},
    {"run_id": "r1", "points": [["loss", 0.5, -1, 2]]}, {"run_id": "r1", "points": [["loss", 0.5, 1, 2**63]]},
    {"run_id": "r1", "points": [["loss", 0.5, 1.5, 2]]}, {"run_id": "r1", "points": [["loss", 0.5, 1]]},
    {"run_id": "r1", "points": [["../loss", 0.5, 1, 2]]}, {"run_id": "r1", "points": [["/loss", 0.5, 1, 2]]},
    {"run_id": "r1", "points": [["a//b", 0.5, 1, 2]]}, {"run_id": "r1", "points": [["loss\n", 0.5, 1, 2]]},
    {"run_id": "r1", "points": [["x" * 251, 0.5, 1, 2]]}, {"run_id": "r1", "points": [["", 0.5, 1, 2]]},
])
def test_a_damaged_or_foreign_file_sends_nothing_and_stays(tmp_path, caplog, body):
    """A point MLflow would refuse must never reach the sender: the server's refusal of the first
    batch would hold back every metric after it, and every checkpoint's completion with them."""
    _kept(tmp_path, body)
    with caplog.at_level(logging.WARNING):
        assert unsent.take(tmp_path, "r1") == []
    assert "not sent" in caplog.text
    assert (tmp_path / UNSENT_METRICS).exists()


def test_another_runs_points_are_not_sent_to_this_one(tmp_path, caplog):
    _kept(tmp_path, {"run_id": "r0", "points": [["loss", 0.5, 1, 2]]})
    run = RunInfo("r1", last_step=1)
    assert not unsent.resend(None, tmp_path, run)
    assert "holds metrics of run r0, not of this job's run r1" in caplog.text
    assert run.last_step == 1


def test_resent_steps_count_as_logged_and_nan_survives(tmp_path):
    unsent.keep(tmp_path, "r1", [("loss", float("nan"), 1000, 7), ("bbox/AP", 0.25, 1000, 9)])
    sent = []

    class Sender:
        resend = sent.extend

    run = RunInfo("r1", last_step=3)
    assert unsent.resend(Sender, tmp_path, run)
    assert run.last_step == 7  # the loss's newest step: a resume from before it sends none of them twice
    assert run.resent_metrics == "the metrics of 2 iterations (7-9)"
    assert [p[0] for p in sent] == ["loss", "bbox/AP"] and sent[0][1] != sent[0][1]
