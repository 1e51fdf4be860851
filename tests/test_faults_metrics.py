"""Metrics that never reached the run: a job whose tracking server is down when it stops (a SIGTERM,
or the end of training) keeps them in OUTPUT_DIR/unsent_metrics.json, and its next start sends them
first, so the run's curves have every iteration once. Against a real `mlflow server` behind a
FaultProxy; the file's reader is tried with what nobody would write."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import uuid

import pytest
from mlflow import MlflowClient

from tests.conftest import run_trainer
from tests.faultkit import jobs, job_args, only_run, sha_tag, steps, wait_until  # noqa: F401 - jobs is a fixture
from tests.servers import FaultProxy
from trainer.checkpoint.files import UNSENT_METRICS
from trainer.hashing import sha256_of
from trainer.tracking.unsent import UnsentMetrics
from trainer.tracking.background import MetricSender
from trainer.tracking.base import RunInfo

LAST = 999  # the last iteration of the job the unit tests' files belong to (SOLVER.MAX_ITER 1000)


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
        assert "the tracking server did not get: " in job.stderr and f"(kept in {out / UNSENT_METRICS})" in job.stderr
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


@pytest.mark.parametrize("outage", ["error", "hang"])
def test_a_job_killed_while_the_server_is_down_resumes_without_a_hole_and_uploads_its_checkpoint(
        outage, tmp_path, data_dir, mlflow_server, jobs):
    """SIGKILL (a lost node, the OOM killer) during an outage: nothing runs at the stop, so the points
    since the outage began were only in memory, and the next start resumed after the newest local
    checkpoint with those iterations missing for good (it said so, row 160). Now each checkpoint
    written once the sender has found the server down keeps what the server lacks of its iterations
    beside it. The checkpoint it resumes from, which the server never got, goes up as well: before,
    only later ones did, so a job lost on this machine before the next upload went back further.
    A server that hangs (accepts, never answers) is down as well once a batch has waited
    STALLED_S: no send ever failed, so no checkpoint kept anything (helper-48's red team)."""
    exp, out = f"unsent-kill-{uuid.uuid4().hex[:6]}", tmp_path / "output"

    def checkpoints() -> list[int]:
        return sorted(int(p.stem[len("model_iter"):]) for p in out.glob("model_iter*.pth"))

    def kept_through() -> int:
        try:
            return max(p[3] for p in json.loads((out / UNSENT_METRICS).read_text())["points"])
        except (OSError, ValueError, KeyError):
            return -1

    max_iter = 200 if outage == "error" else 800  # a hang is found STALLED_S into a batch: still training then
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "SOLVER.MAX_ITER": max_iter, "TRAIN.SNAPSHOT_ITERS": 20})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        proxy.set_mode(outage)  # the sender finds out at its next batch (every 5 s), or STALLED_S into it
        wait_until(lambda: checkpoints() and kept_through() == checkpoints()[-1], job, "a checkpoint's metrics kept")
        job.kill_group()
        newest = kept_through()
        for later in [n for n in checkpoints() if n > newest]:  # written between the look and the kill: as if
            (out / f"model_iter{later}.pth").unlink()         # the kill had come first
        resumed = f"model_iter{newest}.pth"
        sha256 = sha256_of(out / resumed)  # the job's own pruning may remove it later
        proxy.set_mode("pass")
        again = run_trainer(args, cwd=tmp_path, timeout=900)  # ~650 iterations: 250 s on a loaded machine
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at iteration {newest + 1}" in again.stderr and "that an earlier start could not send" in again.stderr
    assert "has no metrics for iterations" not in again.stderr
    assert f"uploading {resumed}, which run" in again.stderr
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)
    assert steps(client, run.info.run_id) == list(range(max_iter))  # every iteration, once
    assert run.data.tags[sha_tag(resumed)] == sha256  # complete on the server: resumable from there
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


def test_the_scores_of_an_evaluation_during_an_outage_to_the_end_are_kept_and_sent_by_the_rerun(
        tmp_path, data_dir, mlflow_server, jobs):
    """A periodic evaluation whose logging waits behind its checkpoint's upload, the server down to
    the end: the uploader gave up on both at the deadline and the scores were lost for good (an open
    point since 2026-12-03). They are kept with the metrics the run lacks; the rerun sends them."""
    exp, out = f"unsent-eval-{uuid.uuid4().hex[:6]}", tmp_path / "output"
    with FaultProxy(mlflow_server.url) as proxy:
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": exp,
                                               "TRACKING.FLUSH_TIMEOUT_S": 4, "TEST.EVAL_PERIOD": 5,
                                               "TEST.DATASETS": "('synth_shapes_val',)"})
        job = jobs(args, tmp_path)
        wait_until(lambda: 1 in job.iters(), job, "iteration 1")
        proxy.set_mode("error")
        assert job.wait() == 1, job.stderr[-3000:]
        kept = json.loads((out / UNSENT_METRICS).read_text().splitlines()[0])["points"]
        assert [p[3] for p in kept if p[0] == "bbox/AP"] == [4], job.last_line  # model_final's: evaluated again
        proxy.set_mode("pass")
        again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    client = MlflowClient(mlflow_server.url)
    run_id = only_run(client, exp).info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "bbox/AP")) == [4, 9]
    assert steps(client, run_id) == list(range(10))
    assert not (out / UNSENT_METRICS).exists()


def test_another_runs_file_is_left_as_it_is_by_a_job_that_sends_everything(tmp_path, data_dir):
    """A file the job did not take (another run's: a folder reused by hand) is never sent to this
    run; it moves to `earlier-<time>/`, so that it neither blocks this run's own leftovers for good
    nor is lost (helper-44's red team)."""
    out = tmp_path / "output"
    out.mkdir()
    foreign = json.dumps({"run_id": "someone-else", "points": [["loss", 0.5, 1000, 3]]})
    (out / UNSENT_METRICS).write_text(foreign)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = run_trainer(job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 4}), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "holds metrics of run 'someone-else', not of this job's run" in done.stderr
    assert not (out / UNSENT_METRICS).exists()
    assert [p.read_text() for p in out.glob(f"earlier-*/{UNSENT_METRICS}")] == [foreign]  # kept, out of the way
    client = MlflowClient(uri)
    assert steps(client, only_run(client, "demo").info.run_id) == [0, 1, 2, 3]



def test_a_point_past_the_jobs_last_iteration_never_reaches_its_run(tmp_path, data_dir):
    """helper-50's red team: one hand-written `loss` at step 10**6 was sent, then counted as logged,
    so every later start of the job dropped all it logged and the run's curves ended for good. Such
    a file is no start's of this job: it is refused (moved aside, kept) and the run keeps its steps."""
    out, uri = tmp_path / "output", f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 4})
    assert run_trainer(args, cwd=tmp_path).returncode == 0
    client = MlflowClient(uri)
    run_id = only_run(client, "demo").info.run_id
    forged = json.dumps({"run_id": run_id, "points": [["loss", 7.0, 1780000000000, 10**6]]})
    (out / UNSENT_METRICS).write_text(forged)
    again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "a point no start of this job made: 'loss' at step 1000000" in again.stderr
    assert steps(client, run_id) == [0, 1, 2, 3]
    assert [p.read_text() for p in out.glob(f"earlier-*/{UNSENT_METRICS}")] == [forged]


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



def test_scores_logged_late_hold_their_checkpoint_until_they_are_sent():
    """An evaluation's scores of iteration 9, put by the uploader thread once training has queued
    iterations 10-20 (its link to a model given up on): wait_sent(9) said they were sent while they
    sat behind 15-20 in the queue, so checkpoint 9 could be tagged complete without them."""
    taken, server = threading.Event(), threading.Event()
    got = []

    def send(points):
        taken.set()
        server.wait(30)
        got.extend(points)

    sender = MetricSender(send, interval=60)
    for step in range(10, 15):
        sender.put({"loss": 1.0}, step)
    sender.wait_sent(14, timeout=0.01)  # nudged: 10-14 go out as one batch, held by the server
    assert taken.wait(10)
    for step in range(15, 21):
        sender.put({"loss": 1.0}, step)
    sender.put_late({"bbox/AP": 0.5}, 9)
    assert not sender.wait_sent(9, timeout=0.2)
    server.set()
    assert sender.wait_sent(9, timeout=10)
    assert sender.close(10)
    assert [p[3] for p in got] == [*range(10, 15), 9, *range(15, 21)]
    assert ("bbox/AP", 0.5, 9) == (got[5][0], got[5][1], got[5][3])


class Queue:
    """Stands in for the MetricSender: its queue (what resend() puts first, what leftover() reads) and
    whether its last batch failed."""

    def __init__(self, points=(), failing=True):
        self.points, self.failing = list(points), failing

    def queued(self):
        return [(step, ts, {key: value}) for key, value, ts, step in self.points]

    def resend(self, points):
        self.points = list(points) + self.points


def _on_disk(tmp_path) -> list[int]:
    """The steps the file holds, line by line (points sent since may stay in it)."""
    lines = (tmp_path / UNSENT_METRICS).read_text().splitlines()
    return [p[3] for p in json.loads(lines[0])["points"]] + [p[3] for line in lines[1:] for p in json.loads(line)]


def _sent_by_next_start(tmp_path, server_has: int) -> list[int]:
    """The steps the job's next start sends, its run holding `loss` up to `server_has`."""
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue([])
    kept.resend(queue, RunInfo("r1", last_step=-1), {"loss": server_has})
    return [p[3] for p in queue.points]


def test_a_checkpoint_during_an_outage_keeps_its_iterations_and_the_file_goes_once_they_are_sent(tmp_path):
    points = [("loss", 0.5, 1000, step) for step in range(12)]
    kept = UnsentMetrics(tmp_path, "r1", LAST)
    kept.spill(Queue(points), 7, "model_iter7.pth")
    assert json.loads((tmp_path / UNSENT_METRICS).read_text())["run_id"] == "r1"
    assert _on_disk(tmp_path) == list(range(8))  # 8-11: trained again from model_iter7
    up = Queue(points[10:], failing=False)  # the server answers again, 10 and 11 not sent yet: appended
    kept.spill(up, 11, "model_iter11.pth")
    assert _on_disk(tmp_path) == [*range(8), 10, 11]
    assert _sent_by_next_start(tmp_path, server_has=9) == [10, 11]  # 0-9 reached the run: not sent twice
    up.points = []
    kept.spill(up, 15, "model_iter15.pth")
    assert not (tmp_path / UNSENT_METRICS).exists()
    healthy = UnsentMetrics(tmp_path, "r1", LAST)  # a job whose server never failed writes nothing, reads nothing
    healthy.spill(up, 3, "model_iter3.pth")
    assert not (tmp_path / UNSENT_METRICS).exists()


def test_the_file_follows_the_queue_while_it_drains_and_keeps_an_earlier_starts_points_until_sent(tmp_path):
    """helper-45's red team of the above: once one batch got through (a backlog draining 1000 metrics
    a batch, a flaky server), checkpoints stopped keeping the new points, so a SIGKILL then resumed past
    iterations it did not hold; and a file taken at the start lost the points above the next
    checkpoint (this start does not log those steps again) while they were still queued."""
    point = [("loss", 0.5, 1000, step) for step in range(60)]
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue(point[:20])
    kept.spill(queue, 19, "model_iter19.pth")
    queue.failing, queue.points = False, point[10:40]  # 0-9 sent, the server answers again; 10-39 queued
    kept.spill(queue, 39, "model_iter39.pth")
    assert set(_on_disk(tmp_path)) == set(range(40))
    assert _sent_by_next_start(tmp_path, server_has=9) == list(range(10, 40))

    (tmp_path / UNSENT_METRICS).write_text(json.dumps({"run_id": "r1", "points": [list(p) for p in point[:51]]}))
    again, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue([])
    again.resend(queue, RunInfo("r1", last_step=-1), {})  # a start resumed from before step 50
    queue.failing, queue.points = False, queue.points[20:]  # 0-19 sent
    again.spill(queue, 19, "model_iter19.pth")
    assert _sent_by_next_start(tmp_path, server_has=19) == list(range(20, 51))
    queue.points = []
    again.spill(queue, 39, "model_iter39.pth")
    assert not (tmp_path / UNSENT_METRICS).exists()


def test_a_long_outage_appends_each_checkpoints_new_points_and_a_torn_append_costs_only_its_own(tmp_path):
    """Each checkpoint of an outage rewrote the whole file: 3.7 s and 124 MB on the writer thread for
    the sender's full queue (helper-45). It appends a line of the points the file lacks; what was
    written stays byte for byte. A kill in the middle of an append leaves a line without its end:
    the lines before it are sent, the file is not refused."""
    point = [("loss", 0.5, 1000 + step, step) for step in range(100)]
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue(point[:10])
    kept.spill(queue, 9, "model_iter9.pth")
    written = []
    for through in (19, 29, 39):
        written.append((tmp_path / UNSENT_METRICS).read_bytes())
        queue.points = point[:through + 5]  # the iterations after the checkpoint are queued too: not kept yet
        kept.spill(queue, through, f"model_iter{through}.pth")
        assert (tmp_path / UNSENT_METRICS).read_bytes().startswith(written[-1])
    assert _on_disk(tmp_path) == list(range(40))
    assert len((tmp_path / UNSENT_METRICS).read_text().splitlines()) == 4
    kept.spill(queue, 39, "model_iter39.pth")  # nothing new: the file as it was
    assert _on_disk(tmp_path) == list(range(40))

    with open(tmp_path / UNSENT_METRICS, "a") as f:
        f.write(json.dumps([list(p) for p in point[40:50]])[:-7])  # SIGKILL
    again, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue([])
    again.resend(queue, RunInfo("r1", last_step=-1), {})
    assert [p[3] for p in queue.points] == list(range(40)) and not list(tmp_path.glob("earlier-*"))
    queue.points = point[:60]  # the next start's own checkpoint in the outage: after the last whole line
    again.spill(queue, 59, "model_iter59.pth")
    assert _sent_by_next_start(tmp_path, server_has=-1) == list(range(60))


def test_an_addition_never_goes_through_a_link_put_in_the_files_place(tmp_path):
    point = [("loss", 0.5, 1000 + step, step) for step in range(40)]
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue(point[:20])
    kept.spill(queue, 19, "model_iter19.pth")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("a user's file\n")
    (tmp_path / UNSENT_METRICS).unlink()
    (tmp_path / UNSENT_METRICS).symlink_to(elsewhere)
    queue.points = point
    kept.spill(queue, 39, "model_iter39.pth")
    assert elsewhere.read_text() == "a user's file\n"
    assert not (tmp_path / UNSENT_METRICS).is_symlink() and _on_disk(tmp_path) == list(range(40))



def test_a_file_read_through_a_symbolic_link_is_refused_and_what_it_points_at_is_never_touched(tmp_path, caplog):
    """helper-50's red team: the file's torn last line was cut off in place through a link to a file
    outside OUTPUT_DIR; a link to what never ends a read (/proc/kmsg) hung the job's start. A link is
    never opened: it moves aside (the link itself), what it points at stays as it was."""
    good = json.dumps({"run_id": "r1", "points": [["loss", 0.5, 1000, 3]]}) + '\n[["loss", 0.4, 10'
    outside = tmp_path / "outside.json"
    outside.write_text(good)
    out = tmp_path / "out"
    out.mkdir()
    (out / UNSENT_METRICS).symlink_to(outside)
    kept, sent, run = _resend(out)
    assert sent == [] and outside.read_text() == good
    assert "(a symbolic link): not sent; moved to" in caplog.text
    assert [p.readlink() for p in out.glob(f"earlier-*/{UNSENT_METRICS}")] == [outside]


@pytest.mark.parametrize("torn", [True, False], ids=["torn-last-line", "whole"])
def test_a_file_with_another_name_is_sent_but_never_written_in_place(tmp_path, torn):
    """A hard link (a `cp -al` or `rsync --link-dest` snapshot of OUTPUT_DIR): its points are this
    run's and are sent, but the file is never cut or appended to in place, which would change the
    snapshot's copy too (helper-50): it is written anew under its name."""
    head = json.dumps({"run_id": "r1", "points": [["loss", 0.5, 1000, 3]]}) + "\n"
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(head + ('[["loss", 0.4, 10' if torn else ""))
    before = snapshot.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    os.link(snapshot, out / UNSENT_METRICS)
    kept, queue = UnsentMetrics(out, "r1", LAST), Queue([])
    kept.resend(queue, RunInfo("r1", last_step=-1), {})
    assert [p[3] for p in queue.points] == [3]
    queue.points.append(("loss", 0.4, 1010, 4))
    kept.spill(queue, 4, "model_iter4.pth")
    assert snapshot.read_bytes() == before
    assert _on_disk(out) == [3, 4]


def test_one_value_per_metric_and_step_is_sent_the_first_the_file_holds(tmp_path):
    """Hand-edited conflicting values at one step all went to the run (helper-50): a job logs a step
    once, so the first the file holds is its value."""
    _kept(tmp_path, {"run_id": "r1", "points": [["loss", 5.0, 1000, 14], ["loss", 6.0, 1000, 14], ["lr", 0.1, 1000, 14],
                                                ["loss", 5, 1001, 14], ["loss", 4.0, 1002, 15]]})
    _, sent, _ = _resend(tmp_path)
    assert sent == [("loss", 5.0, 1000, 14), ("lr", 0.1, 1000, 14), ("loss", 4.0, 1002, 15)]


def test_a_disk_full_in_the_middle_of_an_addition_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """Half a line written, then ENOSPC (and the rewrite fails too): the half is cut off again, so the
    next addition does not follow it and the file stays readable."""
    point = [("loss", 0.5, 1000 + step, step) for step in range(30)]
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue(point[:10])
    kept.spill(queue, 9, "model_iter9.pth")
    before = (tmp_path / UNSENT_METRICS).read_bytes()
    real = os.write

    def full(fd, data):
        real(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def cannot(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        m.setattr("trainer.tracking.unsent.write_atomic", cannot)
        queue.points = point[:20]
        kept.spill(queue, 19, "model_iter19.pth")
    assert (tmp_path / UNSENT_METRICS).read_bytes() == before
    queue.points = point
    kept.spill(queue, 29, "model_iter29.pth")
    assert _sent_by_next_start(tmp_path, server_has=-1) == list(range(30))


def test_an_append_past_the_size_limit_writes_the_file_anew_with_what_is_queued(tmp_path, monkeypatch):
    point = [("loss", 0.5, 1000 + step, step) for step in range(100)]
    kept, queue = UnsentMetrics(tmp_path, "r1", LAST), Queue(point[:30])
    kept.spill(queue, 29, "model_iter29.pth")
    limit = len((tmp_path / UNSENT_METRICS).read_bytes()) * 3 // 2
    monkeypatch.setattr("trainer.tracking.unsent.MAX_BYTES", limit)
    queue.points = point[20:60]  # 0-19 sent; an append of 30-59 would pass the limit
    kept.spill(queue, 59, "model_iter59.pth")
    assert len((tmp_path / UNSENT_METRICS).read_bytes()) <= limit
    assert _on_disk(tmp_path) == list(range(20, 60))
    assert _sent_by_next_start(tmp_path, server_has=19) == list(range(20, 60))


# ---- the file: what nobody would write ----

def _kept(tmp_path, body):
    (tmp_path / UNSENT_METRICS).write_text(body if isinstance(body, str) else json.dumps(body))


def _resend(tmp_path, run_id="r1", logged=None):
    kept, sender, run = UnsentMetrics(tmp_path, run_id, LAST), Queue(), RunInfo(run_id, last_step=1)
    kept.resend(sender, run, logged or {})
    return kept, sender.points, run


@pytest.mark.parametrize("body", [
    "not json", "[]", "null", '{"run_id": "r1"}', {"run_id": 7, "points": []}, {"run_id": "r1", "points": "abcd"},
    {"run_id": "r1", "points": [["loss", "0.5", 1, 2]]}, {"run_id": "r1", "points": [["loss", True, 1, 2]]},
    {"run_id": "r1", "points": [["loss", 10**400, 1, 2]]}, {"run_id": "r1", "points": [["loss", 0.5, -1, 2]]},
    {"run_id": "r1", "points": [["loss", 0.5, 1, 2**63]]}, {"run_id": "r1", "points": [["loss", 0.5, 1.5, 2]]},
    {"run_id": "r1", "points": [["loss", 0.5, 1]]}, {"run_id": "r1", "points": [["../loss", 0.5, 1, 2]]},
    {"run_id": "r1", "points": [["/loss", 0.5, 1, 2]]}, {"run_id": "r1", "points": [["a//b", 0.5, 1, 2]]},
    {"run_id": "r1", "points": [["loss\n", 0.5, 1, 2]]}, {"run_id": "r1", "points": [["x" * 251, 0.5, 1, 2]]},
    {"run_id": "r1", "points": [["", 0.5, 1, 2]]}, {"run_id": "r1", "points": [["loss", 0.5, 1, 2], ["lr", 1, 1]]},
    '{"run_id": "r1", "points": ' + "[" * 200_000,  # deeper than the parser's recursion
    # steps and times no start of this job made (helper-50): a run's `loss` at step 10**6 made every later
    # start drop all it logged as "logged already", and the run's curves ended there for good
    {"run_id": "r1", "points": [["loss", 0.5, 1000, 3], ["loss", 7.0, 1780000000000, LAST + 1]]},
    {"run_id": "r1", "points": [["lr", 1.0, 1000, 2**63 - 1]]}, {"run_id": "r1", "points": [["lr", 1.0, 2**63 - 1, 3]]},
], ids=lambda body: repr(body)[:70])
def test_a_damaged_file_sends_nothing_fails_nothing_and_moves_aside(tmp_path, caplog, body):
    """A point MLflow would refuse must never reach the sender: the server's refusal of the first
    batch would hold back every metric after it, and every checkpoint's completion with them. A
    file nested too deep was a RecursionError that failed every start of the job (red team). The
    file is kept as it was, in `earlier-<time>/`, and this run's own leftovers take its name."""
    _kept(tmp_path, body)
    before = (tmp_path / UNSENT_METRICS).read_bytes()
    with caplog.at_level(logging.WARNING):
        kept, sent, run = _resend(tmp_path)
    assert sent == [] and run.last_step == 1
    assert "is not a list of metric points" in caplog.text and "moved to" in caplog.text
    assert [p.read_bytes() for p in tmp_path.glob(f"earlier-*/{UNSENT_METRICS}")] == [before]
    assert kept.keep([("loss", 0.5, 1000, 5)]) == [f"the metrics of iteration 5 (kept in {tmp_path / UNSENT_METRICS})"]


def test_another_runs_file_is_neither_sent_nor_replaced(tmp_path, caplog):
    """A start over (--no-resume) in a folder without checkpoints found the earlier run's file: it
    was refused at every start, and this run's own leftovers were never kept (red team)."""
    _kept(tmp_path, {"run_id": "r0", "points": [["loss", 0.5, 1, 2]]})
    before = (tmp_path / UNSENT_METRICS).read_bytes()
    kept, sent, run = _resend(tmp_path)
    assert sent == [] and run.last_step == 1
    assert "holds metrics of run 'r0', not of this job's run r1: not sent; moved to" in caplog.text
    assert [p.read_bytes() for p in tmp_path.glob(f"earlier-*/{UNSENT_METRICS}")] == [before]
    kept.keep([])
    assert not (tmp_path / UNSENT_METRICS).exists()


def test_a_refused_file_that_cannot_move_is_never_overwritten(tmp_path, monkeypatch, caplog):
    _kept(tmp_path, {"run_id": "r0", "points": [["loss", 0.5, 1, 2]]})
    before = (tmp_path / UNSENT_METRICS).read_bytes()

    def cannot(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr("trainer.tracking.unsent.move_aside", cannot)
    kept, _, _ = _resend(tmp_path)
    assert kept.keep([("loss", 0.5, 1000, 5)]) == [
        f"the metrics of iteration 5 (lost: they could not be kept in {tmp_path / UNSENT_METRICS})"]
    kept.keep([])
    assert (tmp_path / UNSENT_METRICS).read_bytes() == before


def test_what_cannot_be_kept_is_said_lost_and_a_long_outage_keeps_the_newest(tmp_path, monkeypatch, caplog):
    """The end-of-job line promises that a rerun sends what the run lacks: not for metrics that
    could not be written (here OUTPUT_DIR's place is a file). Past MAX_BYTES, the newest points."""
    (tmp_path / "file").write_text("")
    assert UnsentMetrics(tmp_path / "file", "r1", LAST).keep([("loss", 0.5, 1000, 5)]) == [
        f"the metrics of iteration 5 (lost: they could not be kept in {tmp_path / 'file' / UNSENT_METRICS})"]
    monkeypatch.setattr("trainer.tracking.unsent.MAX_BYTES", 2000)
    points = [("loss", 0.5, 1000 + s, s) for s in range(200)]
    said = UnsentMetrics(tmp_path, "r1", LAST).keep(points)
    kept = json.loads((tmp_path / UNSENT_METRICS).read_text())["points"]
    assert len((tmp_path / UNSENT_METRICS).read_text()) <= 2000
    assert [p[3] for p in kept] == list(range(200 - len(kept), 200))
    assert said == [f"the metrics of 200 iterations (0-199) (those of {len(kept)} iterations ({200 - len(kept)}-199) "
                     f"kept in {tmp_path / UNSENT_METRICS})"]
    assert "the older are lost" in caplog.text


def test_unicode_metric_names_are_kept_and_sent(tmp_path):
    """MLflow takes any word character: an evaluation of a test set named `größe_val` logs
    `größe_val/bbox/AP`. An ASCII-only check refused the whole file, losing every point (red team)."""
    UnsentMetrics(tmp_path, "r1", LAST).keep([("loss", 0.5, 1000, 5), ("größe_val/bbox/AP", 0.3, 1000, 5)])
    _, sent, _ = _resend(tmp_path)
    assert [p[0] for p in sent] == ["loss", "größe_val/bbox/AP"]


def test_points_the_run_holds_are_not_sent_again_and_resent_steps_count_as_logged(tmp_path):
    """Node-local OUTPUT_DIRs: steps kept on one machine that the run got since from another start
    (the newest step per key says so) are not sent twice (red team); NaN survives the file."""
    UnsentMetrics(tmp_path, "r1", LAST).keep([("loss", 1.0, 1000, 3), ("loss", float("nan"), 1000, 7),
                                              ("bbox/AP", 0.25, 1000, 3), ("bbox/AP", 0.5, 1000, 9)])
    kept, sent, run = _resend(tmp_path, logged={"loss": 4, "bbox/AP": 2})
    assert [(p[0], p[3]) for p in sent] == [("loss", 7), ("bbox/AP", 3), ("bbox/AP", 9)]
    assert sent[0][1] != sent[0][1]  # NaN
    assert run.last_step == 7  # the loss's newest step: a resume from before it sends none of them twice
    assert run.resent_metrics == "the metrics of 3 iterations (3-9)"
    kept.keep([])
    assert not (tmp_path / UNSENT_METRICS).exists()  # taken, all sent: removed


def test_a_resend_past_the_queues_room_drops_the_oldest_and_counts_them():
    """The points sit in the queue or in the batch being sent (a server that does not answer here):
    leftover() has them either way."""
    server = threading.Event()
    sender = MetricSender(lambda points: server.wait(), max_pending=3, interval=60)
    sender.put({"loss": 9.0}, 9)
    sender.resend([("loss", float(s), 1000 + s, s) for s in range(4)])
    assert sender.dropped == 2
    assert [p[3] for p in sender.leftover()] == [2, 3, 9]
    server.set()
