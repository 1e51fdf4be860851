"""The tracking agent: a helper process finds the job's run and makes tracking's calls against the
real `mlflow server`; when it dies, the training process makes them and nothing is lost; what the
server rejects or cannot answer comes back classified as before."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from mlflow import MlflowClient

from tests.conftest import DEMO, ROOT
from tests.faultkit import alive, assert_gone
from trainer import checkpoint as ckpt
from trainer.config import load_config
from trainer.mlflow_runs import sha_tag
from trainer.mlflow_tracking import MlflowTracker
from trainer.tracking_agent import AgentError, TrackingCalls

KEYS = ("loss", "lr", "time")


def new_tracker(tmp_path, uri: str) -> MlflowTracker:
    cfg = load_config(DEMO, ["TRACKING.URI", uri, "TRACKING.EXPERIMENT", f"agent-{tmp_path.name}",
                             "OUTPUT_DIR", str(tmp_path)])
    tracker = MlflowTracker(cfg)
    tracker.start(cfg, new_run=True)
    return tracker


def checkpoint(tmp_path, tracker: MlflowTracker, iteration: int) -> None:
    path = tmp_path / ckpt.checkpoint_name(iteration)
    path.write_bytes(os.urandom(100_000))
    tracker.log_checkpoint(path, ckpt.sha256_of(path))


def log_steps(tracker: MlflowTracker, steps: range) -> None:
    for step in steps:
        tracker.log_metrics({k: step / 10 for k in KEYS}, step)


def assert_on_server(uri: str, run_id: str, last_step: int, checkpoints: list[str]) -> None:
    client = MlflowClient(uri)
    for key in KEYS:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(last_step + 1)), key
    tags = client.get_run(run_id).data.tags
    stored = {f.path for f in client.list_artifacts(run_id, "checkpoints")}
    for name in checkpoints:
        assert sha_tag(name) in tags and f"checkpoints/{name}" in stored
    assert tags["tracktron.ckpt.latest"] == checkpoints[-1]


def test_the_agent_finds_the_run_and_makes_every_call(tmp_path, mlflow_server):
    tracker = new_tracker(tmp_path, mlflow_server.url)
    assert tracker.agent_pid not in (None, os.getpid()) and tracker.in_agent()
    # In a session of its own: a Ctrl-C to the job leaves it to deliver the job's last checkpoint.
    assert os.getsid(tracker.agent_pid) == tracker.agent_pid != os.getsid(0)
    log_steps(tracker, range(0, 3))
    checkpoint(tmp_path, tracker, 2)
    log_steps(tracker, range(3, 6))
    checkpoint(tmp_path, tracker, 5)
    assert tracker.wait(60)
    pid = tracker.agent_pid
    assert tracker.finish("FINISHED", timeout=30) == []
    assert tracker._calls.here == 0  # the run's lookup, params, metrics, uploads, tags, status: all in the agent
    assert tracker._calls.by_agent >= 6
    assert tracker._calls._local is None  # this process never made an MlflowClient of its own
    assert_gone([pid])  # finish() ends it
    assert_on_server(mlflow_server.url, tracker.run.run_id, 5, ["model_iter2.pth", "model_iter5.pth"])
    assert MlflowClient(mlflow_server.url).get_run(tracker.run.run_id).info.status == "FINISHED"


def test_when_the_agent_dies_the_training_process_makes_the_calls_and_nothing_is_lost(tmp_path, mlflow_server,
                                                                                   caplog):
    caplog.set_level(logging.WARNING)
    tracker = new_tracker(tmp_path, mlflow_server.url)
    log_steps(tracker, range(0, 3))
    checkpoint(tmp_path, tracker, 2)
    assert tracker.in_agent(timeout=60) and tracker.wait(60)
    os.kill(tracker.agent_pid, signal.SIGKILL)  # the OOM killer, say
    log_steps(tracker, range(3, 9))
    checkpoint(tmp_path, tracker, 5)
    checkpoint(tmp_path, tracker, 8)
    assert tracker.wait(60)
    assert tracker.finish("FINISHED", timeout=30) == []
    assert "the tracking agent process ended" in caplog.text
    assert caplog.text.count("the tracking agent process ended") == 1  # one warning, not one per call
    assert not tracker.in_agent()  # and not started again
    assert_on_server(mlflow_server.url, tracker.run.run_id, 8,
                     ["model_iter2.pth", "model_iter5.pth", "model_iter8.pth"])


def test_without_an_agent_the_training_process_tracks_the_job_itself(tmp_path, mlflow_server, monkeypatch):
    def no_process(*args):
        raise OSError(11, "Resource temporarily unavailable")  # fork failed: a pids cgroup at its limit

    monkeypatch.setattr("trainer.tracking_agent.Helper", no_process)
    tracker = new_tracker(tmp_path, mlflow_server.url)
    assert tracker.agent_pid is None and not tracker.in_agent()
    log_steps(tracker, range(0, 3))
    checkpoint(tmp_path, tracker, 2)
    assert tracker.wait(60)
    assert tracker.finish("FINISHED", timeout=30) == []
    assert tracker._calls.by_agent == 0 and tracker._calls.here >= 4
    assert_on_server(mlflow_server.url, tracker.run.run_id, 2, ["model_iter2.pth"])


def test_the_agents_failures_come_back_with_their_message_and_whether_to_retry(tmp_path, s3_server, monkeypatch):
    from tests.servers import MlflowServer

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the agent's environment is the job's

    server = MlflowServer(tmp_path / "server", artifacts=f"s3://{s3_server.bucket}/agent", env=s3_server.env)
    (tmp_path / "server").mkdir()
    server.start()
    calls = TrackingCalls(server.url)
    try:
        calls.start_agent()
        assert calls.in_agent(timeout=60)
        with pytest.raises(AgentError) as rejected:  # a request the server rejects: final
            calls.log_batch("0123456789abcdef0123456789abcdef", tags=[("a", "b")])
        assert not rejected.value.retryable
        assert "RESOURCE_DOES_NOT_EXIST" in str(rejected.value) or "not found" in str(rejected.value).lower()
        server.stop()
        with pytest.raises(AgentError) as down:  # a server that is down: retried by the caller
            calls.log_batch("0123456789abcdef0123456789abcdef", tags=[("a", "b")])
        assert down.value.retryable
        assert calls.here == 0 and calls.by_agent == 2
    finally:
        calls.close()
        server.stop()


JOB = textwrap.dedent("""
    import sys
    from trainer.tracking_agent import TrackingCalls
    calls = TrackingCalls(sys.argv[1])
    calls.start_agent()
    assert calls.in_agent(timeout=60)
    print(calls.agent_pid, flush=True)
    import time
    time.sleep(60)
""")  # no `if __name__ == "__main__"`: the agent must not run this script again


def test_a_killed_jobs_agent_dies_with_it(tmp_path):
    job = subprocess.Popen([sys.executable, "-c", JOB, "http://127.0.0.1:9"], cwd=tmp_path,
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        agent = int(job.stdout.readline())
        assert alive(agent)
        job.kill()  # SIGKILL: no finish(), no goodbye to the agent
        job.wait()
        assert_gone([agent], within=5.0)  # it watches its parent (started by a thread of it, or not)
    finally:
        job.kill()
        job.wait()
