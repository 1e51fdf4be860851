"""The MLflow tracker against a real `mlflow server`: it finds the job's run on a thread, makes every
call from background threads of this one process with MLflow's own client, never lets uploads pile
up (a newer checkpoint supersedes an older one not yet started), and tells a rejected request (final)
from a server that is down (retried until it is back)."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from mlflow import MlflowClient

from tests.conftest import DEMO
from tests.servers import FaultProxy, MlflowServer
from trainer.checkpoint.files import checkpoint_name
from trainer.hashing import sha256_of
from trainer.config import load_config
from trainer.tracking.mlflow_tracker import MlflowTracker
from trainer.tracking.runs import sha_tag

KEYS = ("loss", "lr", "time")


def new_tracker(tmp_path, uri: str, **keys) -> MlflowTracker:
    overrides = {"TRACKING.URI": uri, "TRACKING.EXPERIMENT": f"tracker-{tmp_path.name}", "OUTPUT_DIR": str(tmp_path),
                 **keys}
    cfg = load_config(DEMO, [str(x) for kv in overrides.items() for x in kv])
    tracker = MlflowTracker(cfg)
    tracker.start(cfg, new_run=True)
    return tracker


def checkpoint(tmp_path, tracker: MlflowTracker, iteration: int | None, size: int = 100_000) -> None:
    path = tmp_path / checkpoint_name(iteration)
    path.write_bytes(os.urandom(size))
    tracker.log_checkpoint(path, sha256_of(path))


def log_steps(tracker: MlflowTracker, steps: range) -> None:
    for step in steps:
        tracker.log_metrics({k: step / 10 for k in KEYS}, step)


def stored_checkpoints(uri: str, run_id: str) -> set[str]:
    return {f.path.rsplit("/", 1)[1] for f in MlflowClient(uri).list_artifacts(run_id, "checkpoints")}


def assert_on_server(uri: str, run_id: str, last_step: int, checkpoints: list[str]) -> None:
    client = MlflowClient(uri)
    for key in KEYS:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(last_step + 1)), key
    tags = client.get_run(run_id).data.tags
    stored = stored_checkpoints(uri, run_id)
    for name in checkpoints:
        assert sha_tag(name) in tags and name in stored
    assert tags["tracktron.ckpt.latest"] == checkpoints[-1]


def test_start_returns_at_once_and_every_call_is_made_by_threads_of_this_process(tmp_path, mlflow_server):
    before = set(threading.enumerate())
    children_before = _children()
    started = time.monotonic()
    tracker = new_tracker(tmp_path, mlflow_server.url)
    assert time.monotonic() - started < 0.5, "start() waited for the run"  # the lookup is on a thread
    assert tracker.run.run_id  # ... which `run` waits for
    log_steps(tracker, range(0, 3))
    checkpoint(tmp_path, tracker, 2)
    assert tracker.wait(60)  # uploaded before the next one comes (else the next one supersedes it)
    log_steps(tracker, range(3, 6))
    checkpoint(tmp_path, tracker, 5)
    assert tracker.wait(60)
    names = {t.name for t in set(threading.enumerate()) - before}
    assert {"metric-sender", "uploader"} <= names
    assert _children() == children_before  # no process of ours, no helper: threads only
    assert tracker.finish("FINISHED", timeout=30) == []
    assert_on_server(mlflow_server.url, tracker.run.run_id, 5, ["model_iter2.pth", "model_iter5.pth"])
    assert MlflowClient(mlflow_server.url).get_run(tracker.run.run_id).info.status == "FINISHED"
    for thread in set(threading.enumerate()) - before:  # finish() leaves none of ours running
        assert thread.name not in ("metric-sender", "uploader"), thread.name


def test_a_checkpoint_superseded_before_its_upload_starts_is_not_uploaded(tmp_path, mlflow_server):
    """A slow tracking server (or its S3 on a slower core): checkpoints come faster than they go up.
    The uploader does not fall behind: only the newest waiting one is sent, and the job ends with
    nothing reported missing once model_final is there."""
    with FaultProxy(mlflow_server.url) as proxy:
        tracker = new_tracker(tmp_path, proxy.url, **{"TRACKING.FLUSH_TIMEOUT_S": 10})
        run_id = tracker.run.run_id
        proxy.delay_requests(rb"(PUT|POST) /api/2\.0/mlflow-artifacts/artifacts/.*model_iter", 2.0)
        for it in range(4, 40, 5):  # eight checkpoints in a burst, as a fast job makes them
            log_steps(tracker, range(it - 4, it + 1))
            checkpoint(tmp_path, tracker, it)
        checkpoint(tmp_path, tracker, None)
        assert tracker.finish("FINISHED") == []  # within 10 s: eight 2 s uploads in a row would not be
    stored = stored_checkpoints(mlflow_server.url, run_id)
    assert "model_final.pth" in stored
    assert len(stored) <= 3, stored  # the one in flight when the burst came, maybe one more, and model_final
    tags = MlflowClient(mlflow_server.url).get_run(run_id).data.tags
    assert tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert {n for n in stored if sha_tag(n) in tags} == stored  # what is there is complete


def test_a_checkpoint_superseded_while_its_metrics_go_up_is_not_uploaded(tmp_path, mlflow_server, caplog):
    """A slow server: checkpoint 4's upload waits for its iterations' metrics, and checkpoint 9 is
    written meanwhile. 4's bytes would only delay 9's: it is skipped once its metrics are there."""
    caplog.set_level(logging.INFO, logger="trainer.tracking")
    with FaultProxy(mlflow_server.url) as proxy:
        tracker = new_tracker(tmp_path, proxy.url, **{"TRACKING.FLUSH_TIMEOUT_S": 60})
        run_id = tracker.run.run_id
        assert tracker.wait(30)  # the run's params and tags are in: the uploader is idle
        proxy.delay_requests(rb"/runs/log-batch", 3.0)
        log_steps(tracker, range(0, 5))
        checkpoint(tmp_path, tracker, 4)
        time.sleep(1.0)  # its upload began: it waits for the metrics of iterations 0-4
        log_steps(tracker, range(5, 10))
        checkpoint(tmp_path, tracker, 9)
        assert tracker.finish("FINISHED") == []
    assert stored_checkpoints(mlflow_server.url, run_id) == {"model_iter9.pth"}
    assert "not uploading model_iter4.pth: a newer checkpoint supersedes it" in caplog.text
    assert_on_server(mlflow_server.url, run_id, 9, ["model_iter9.pth"])


def test_an_older_checkpoint_that_never_got_there_is_not_a_failure_once_a_newer_one_did(tmp_path, mlflow_server):
    tracker = new_tracker(tmp_path, mlflow_server.url)
    run_id = tracker.run.run_id
    log_steps(tracker, range(0, 5))
    gone = tmp_path / "model_iter4.pth"
    tracker.log_checkpoint(gone, "0" * 64)  # its file is gone before the upload (deleted by hand): fails for good
    assert tracker.wait(30)
    checkpoint(tmp_path, tracker, None)
    assert tracker.finish("FINISHED", timeout=30) == []  # model_final is there: nothing that matters is missing
    assert stored_checkpoints(mlflow_server.url, run_id) == {"model_final.pth"}

    alone = new_tracker(tmp_path / "alone", mlflow_server.url)  # the same without a newer one: reported
    assert alone.run.run_id  # opened, as a job's is before its first checkpoint
    alone.log_checkpoint(gone, "0" * 64)
    # with why, which no retry mends: what to do before the next start
    assert alone.finish("FINISHED", timeout=30) == [
        f"upload checkpoint model_iter4.pth ([Errno 2] No such file or directory: '{gone}')"]

    # Both failed (a run deleted mid-job fails them all): the newest is named, which the next start sends.
    # model_final evaluated too, as a job with test sets has it: it is the one named, not model_iter9 as well.
    for evaluated in (False, True):
        every = new_tracker(tmp_path / f"every-{evaluated}", mlflow_server.url)
        assert every.run.run_id
        for name in ("model_iter4.pth", "model_iter9.pth", "model_final.pth"):
            if evaluated and name == "model_final.pth":
                every.log_evaluation({"bbox/AP": 0.5}, 10, name)
            every.log_checkpoint(tmp_path / "none" / name, "0" * 64)  # no such files: every upload fails
            assert every.wait(30)  # one at a time: none is superseded before its upload starts
        assert every.finish("FINISHED", timeout=30) == [
            f"upload checkpoint model_final.pth ([Errno 2] No such file or directory: '{tmp_path / 'none' / 'model_final.pth'}')"]



def test_a_checkpoint_whose_file_changed_before_its_upload_is_never_tagged_complete(tmp_path, mlflow_server, caplog):
    """Its tags would say: resumable, with these bytes. A resume elsewhere then found the bytes
    on the server did not match and fell back to an older checkpoint (helper-48's red team)."""
    with FaultProxy(mlflow_server.url) as proxy:
        tracker = new_tracker(tmp_path, proxy.url)
        run_id = tracker.run.run_id
        proxy.delay_requests(rb"/runs/log-batch", 3)  # the upload first waits for its iterations' metrics
        log_steps(tracker, range(0, 5))
        path, other = tmp_path / "model_iter4.pth", tmp_path / "other.pth"
        path.write_bytes(os.urandom(100_000))
        tracker.log_checkpoint(path, sha256_of(path))
        other.write_bytes(os.urandom(100_000))
        os.replace(other, path)  # replaced while its upload waits
        (missing,) = tracker.finish("FINISHED", timeout=60)
        assert missing.startswith(f"upload checkpoint model_iter4.pth ({path} changed since it was written"), missing
    assert sha_tag("model_iter4.pth") not in MlflowClient(mlflow_server.url).get_run(run_id).data.tags
    assert stored_checkpoints(mlflow_server.url, run_id) == set()
    assert "model_iter4.pth changed since it was written" in caplog.text


def test_a_rejected_request_is_final_and_a_server_that_is_down_is_waited_for(tmp_path, s3_server):
    server = MlflowServer(tmp_path / "server", artifacts=f"s3://{s3_server.bucket}/tracker", env=s3_server.env)
    (tmp_path / "server").mkdir()
    server.start()
    try:
        tracker = new_tracker(tmp_path, server.url, **{"TRACKING.FLUSH_TIMEOUT_S": 120})
        run_id = tracker.run.run_id
        log_steps(tracker, range(0, 3))
        tracker.log_artifact(tmp_path / "missing.txt")  # a request that cannot succeed: reported at once
        server.stop()  # down: metrics and the checkpoint wait for it
        log_steps(tracker, range(3, 6))
        checkpoint(tmp_path, tracker, 5)
        time.sleep(3.0)
        server.start()
        assert tracker.finish("FINISHED") == [
            f"upload missing.txt ([Errno 2] No such file or directory: '{tmp_path / 'missing.txt'}')"]
        assert_on_server(server.url, run_id, 5, ["model_iter5.pth"])
    finally:
        server.stop()


def test_a_tracking_server_that_is_not_there_is_one_line_when_the_run_is_asked_for(tmp_path):
    import pytest

    from trainer.errors import UserError

    cfg = load_config(DEMO, ["TRACKING.URI", "http://127.0.0.1:9", "OUTPUT_DIR", str(tmp_path)])
    tracker = MlflowTracker(cfg)
    tracker.start(cfg)  # returns at once
    with pytest.raises(UserError, match="cannot reach the tracking server at http://127.0.0.1:9"):
        tracker.run
    assert tracker.finish("FAILED") == []  # nothing to finish, no hang


def _children() -> set[int]:
    pids = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return pids


def test_two_jobs_starting_at_once_in_a_new_experiment_both_get_their_run(tmp_path, mlflow_server):
    """Both look the experiment up, find none, and create it: the second create is refused by the
    server (it exists now), and that job takes the experiment the first one made."""
    experiment = f"together-{tmp_path.name}"
    trackers = []
    for name in ("a", "b"):
        cfg = load_config(DEMO, ["TRACKING.URI", mlflow_server.url, "TRACKING.EXPERIMENT", experiment,
                                 "OUTPUT_DIR", str(tmp_path / name), "SOLVER.MAX_ITER", "8" if name == "a" else "9"])
        trackers.append((MlflowTracker(cfg), cfg))
    for tracker, cfg in trackers:
        tracker.start(cfg)  # both lookups run at once, on their threads
    runs = [tracker.run.run_id for tracker, _ in trackers]
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name(experiment)
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == set(runs)
    for tracker, _ in trackers:
        assert tracker.finish("FINISHED", timeout=30) == []


def test_an_experiment_made_by_another_job_between_lookup_and_create_is_taken(tmp_path, mlflow_server):
    """The race above, made certain: the lookup saw no experiment, another job then made it."""
    from trainer.tracking.job_run import _experiment

    name = f"raced-{tmp_path.name}"
    theirs = MlflowClient(mlflow_server.url).create_experiment(name)

    class LateLookup(MlflowClient):
        looked = False

        def get_experiment_by_name(self, experiment_name):
            if not self.looked:  # what the lookup saw, a moment before the other job's create
                self.looked = True
                return None
            return super().get_experiment_by_name(experiment_name)

    assert _experiment(LateLookup(mlflow_server.url), name) == theirs


def test_a_stop_whose_time_runs_out_behind_a_stuck_upload_still_sets_the_runs_status(tmp_path, monkeypatch):
    """A SIGTERM with little grace left while the uploader is busy (the final model was being logged):
    the status job, queued behind it, never ran, and the run stayed RUNNING."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.chdir(tmp_path)  # a new SQLite store's experiment keeps its artifacts in ./mlruns, as MLflow's does
    tracker = new_tracker(tmp_path, uri)
    tracker.checks_passed()
    run_id = tracker.run.run_id
    stuck = tmp_path / "stuck.fifo"
    os.mkfifo(stuck)  # reading it blocks until a writer opens it: an upload that does not end
    tracker.log_artifact(stuck)
    started = time.monotonic()
    left = tracker.finish("KILLED", "stopped by SIGTERM", timeout=3)
    assert time.monotonic() - started < 4
    assert left == ["upload stuck.fifo"]  # what did not reach the store, and no more
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["tracktron.status_reason"] == "stopped by SIGTERM"
    os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))  # let the abandoned upload end


def test_the_metric_senders_count_of_what_it_gave_up_on_is_in_iterations(caplog):
    """A server that fails every log-batch: the warning said `1 iterations not sent` for a batch of
    ten given up on (the batch in flight counted as one). Found by the red team of 2026-12-03."""
    from trainer.tracking.background import MetricSender

    def refuse(batch):
        if batch:
            raise ConnectionError("HTTP 500")

    sender = MetricSender(refuse, interval=0.05)
    for step in range(10):
        sender.put({"loss": 1.0, "lr": 0.1}, step)
    caplog.set_level("WARNING", logger="trainer.tracking.background")
    assert sender.close(timeout=1.0) is False
    assert "metrics: 10 iterations not sent before the deadline, 0 dropped on overflow" in caplog.messages


def test_a_job_the_uploader_gives_up_on_runs_its_fallback_and_one_that_succeeds_does_not():
    """The fallback of a queued job (an evaluation's scores, kept for the job's next start) runs when
    the job fails for good or is never run before close()'s deadline; never twice, never after a success."""
    from trainer.tracking.background import Uploader

    ran, server_down = [], threading.Event()
    uploader = Uploader(retryable=lambda e: not isinstance(e, KeyError))
    uploader.submit("ok", lambda: ran.append("ok"), dropped=lambda: ran.append("ok dropped"))
    uploader.submit("refused", lambda: {}["x"], dropped=lambda: ran.append("refused dropped"))
    uploader.submit("stuck", lambda: server_down.wait(30) and None, dropped=lambda: ran.append("stuck dropped"))
    uploader.submit("behind", lambda: ran.append("behind"), dropped=lambda: ran.append("behind dropped"))
    uploader.submit("no fallback", lambda: ran.append("no fallback"))
    end = time.monotonic() + 30
    while len(ran) < 2 and time.monotonic() < end:  # "ok" ran, "refused" failed for good; "stuck" holds the thread
        time.sleep(0.01)
    assert not uploader.close(0.5)
    assert ran == ["ok", "refused dropped", "behind dropped"]
    assert uploader.failed == ["refused", "stuck", "behind", "no fallback"]
    server_down.set()


def test_a_run_made_before_the_job_could_go_on_is_failed_not_left_running(tmp_path, monkeypatch):
    """A pids limit (`ulimit -u`, a container's pids.max) let the run be made, then its metric sender's
    thread could not start: the run stayed RUNNING for good, and the error blamed the tracking server
    (helper-61)."""
    import pytest

    from trainer.errors import UserError
    from trainer.tracking import mlflow_tracker

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(mlflow_tracker, "MetricSender", no_thread)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = new_tracker(tmp_path, uri)
    with pytest.raises(UserError, match=r"^cannot start a thread: a limit on processes and threads \(ulimit -u"):
        tracker.run  # noqa: B018 (the property waits for the run to be opened)
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name(f"tracker-{tmp_path.name}").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["tracktron.status_reason"].startswith("cannot start a thread")


def test_a_long_jobs_evaluation_tables_all_arrive_and_nothing_is_said_to_have_failed(tmp_path, monkeypatch):
    """helper-73's soak test: MLflow's log_table lists each table in the run's mlflow.loggedArtifacts
    tag, which MLflow cut at 8,000 characters (about 97 evaluations of one test set) into JSON that no
    later log_table read: the job ended 1 naming tables that had arrived, and a rerun did not mend it."""
    monkeypatch.chdir(tmp_path)  # the store's artifacts: ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = new_tracker(tmp_path, uri)
    run_id = tracker.run.run_id
    table = {"category": ["circle", "square"], "AP": [0.5, None], "AP50": [0.75, None], "instances": [3, 0]}
    names = [f"eval/synth_shapes_val/per_category_ap_iter{i * 2000 + 1999}.json" for i in range(110)]
    for name in names:
        tracker.log_table(table, name)
    assert tracker.finish("FINISHED") == []  # the job's last line names nothing the server lacks
    client = MlflowClient(uri)
    listed = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])  # still JSON: the UI reads it
    assert 90 <= len(listed) < 110 and [e["path"] for e in listed] == names[:len(listed)]
    stored = {f.path for f in client.list_artifacts(run_id, "eval/synth_shapes_val")}
    assert stored == set(names)
    first, last = (json.loads(Path(client.download_artifacts(run_id, n, str(tmp_path / "dl"))).read_text())
                   for n in (names[0], names[-1]))
    assert first == last == {"columns": ["category", "AP", "AP50", "instances"],
                             "data": [["circle", 0.5, 0.75, 3], ["square", None, None, 0]]}  # one layout
