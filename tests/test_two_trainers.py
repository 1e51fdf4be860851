"""The same job started twice while it trains, in another folder or on another machine: the second
trainer must not log into the run the first is training (the job is its config, so both find the
same run). A trainer that died without a word (SIGKILL, a lost machine) leaves its run RUNNING; its
job must still continue, on this machine at once, from another one once its heartbeat is seen to stop.
"Another machine" is another pid namespace (`unshare --pid`), whose processes this one cannot see."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, trainer_cmd
from tests.servers import FaultProxy
from tests.test_tracking import only_run, steps, tracked

LONG = {"SOLVER.MAX_ITER": 3000, "TRAIN.SNAPSHOT_ITERS": 25}  # stopped by the test
SHORT = {"SOLVER.MAX_ITER": 150, "TRAIN.SNAPSHOT_ITERS": 25}
HEARTBEAT = "tracktron.heartbeat"
ELSEWHERE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _run(tag: str | None, status: str = "RUNNING"):
    """What check_not_held reads of an mlflow Run."""
    return SimpleNamespace(info=SimpleNamespace(run_id="r1", status=status),
                           data=SimpleNamespace(tags={HEARTBEAT: tag} if tag is not None else {}))


class _Store:
    """get_run answers with the tag's next value each time it is asked (the last one repeats)."""

    def __init__(self, *tags):
        self.tags = list(tags)

    def get_run(self, run_id):
        return _run(self.tags.pop(0) if len(self.tags) > 1 else self.tags[0])


def _beat(**change) -> str:
    from trainer.tracking import heartbeat

    return json.dumps({**json.loads(heartbeat.beat()), **change})


def test_a_heartbeat_tells_a_live_trainer_from_a_gone_one(monkeypatch):
    """One function, every kind of beat a run can carry, hand-edited ones included."""
    from trainer.errors import UserError
    from trainer.tracking import heartbeat

    monkeypatch.setattr(heartbeat, "WATCH_S", 0.6)
    monkeypatch.setattr(heartbeat, "POLL_S", 0.05)
    parent = os.getppid()  # a live process of this machine, not this one
    live_here = _beat(pid=parent, started=heartbeat._process_start(parent))
    gone_here = _beat(pid=parent, started="1")  # the pid, but another process's start time: reused
    elsewhere = _beat(machine="another-boot:1", pid=parent)
    ended = subprocess.Popen(["sleep", "0.2"])  # not reaped: a zombie, its /proc entry still there
    ended_start = open(f"/proc/{ended.pid}/stat").read().rsplit(")", 1)[1].split()[19]
    os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)  # it has exited, and is left unreaped
    zombie = _beat(pid=ended.pid, started=ended_start)
    no_start = _beat(pid=2**22 + 7, started=None)  # hand-edited: no start time to match a process by
    for free in (None, "", "not json", "[1, 2]", '{"time": "soon"}', _beat(), gone_here, zombie, no_start,
                 _beat(machine="another-boot:1", time=time.time() - 2 * 86400)):  # forgotten
        heartbeat.check_not_held(_Store(free), _run(free))  # nothing to watch: returns at once
    heartbeat.check_not_held(_Store(live_here), _run(live_here, status="KILLED"))  # it ended and said so
    with pytest.raises(UserError, match=f"run r1 of this job is being trained right now by .* \\(pid {parent}\\)"):
        heartbeat.check_not_held(_Store(live_here), _run(live_here))
    started = time.monotonic()
    heartbeat.check_not_held(_Store(elsewhere), _run(elsewhere))  # unchanged while watched: gone
    assert time.monotonic() - started >= 0.6
    with pytest.raises(UserError, match="is being trained right now"):  # it beat again meanwhile
        heartbeat.check_not_held(_Store(elsewhere, _beat(machine="another-boot:1", pid=parent)), _run(elsewhere))
    # A live trainer on a machine whose clock is 10 minutes slow: its beats look old, yet they change.
    slow = _beat(machine="another-boot:1", time=time.time() - 600)
    with pytest.raises(UserError, match="is being trained right now"):
        heartbeat.check_not_held(_Store(slow, _beat(machine="another-boot:1", time=time.time() - 595)), _run(slow))
    odd = _beat(pid=parent, started=heartbeat._process_start(parent), host="evil\n\x1b[2Jhost" * 50)
    with pytest.raises(UserError) as refused:  # a hand-edited host: still one printable line
        heartbeat.check_not_held(_Store(odd), _run(odd))
    assert str(refused.value).isprintable() and len(str(refused.value)) < 400
    ended.wait()


def _elsewhere_works() -> bool:
    try:
        return subprocess.run([*ELSEWHERE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_first(tmp_path, data_dir, mlflow_server, s3_server, exp, keys, checkpoint=True):
    """The job on 'machine 1', once its run carries its heartbeat (and a complete checkpoint)."""
    first = tmp_path / "machine1"
    first.mkdir()
    proc = subprocess.Popen(trainer_cmd(*tracked(first, data_dir, mlflow_server, exp, **keys)), cwd=first,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **s3_server.env})
    client = MlflowClient(mlflow_server.url)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        assert proc.poll() is None, "the first trainer ended early"
        experiment = client.get_experiment_by_name(exp)
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        if runs and HEARTBEAT in runs[0].data.tags and (not checkpoint or "tracktron.ckpt.latest" in runs[0].data.tags):
            return proc, runs[0]
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the first trainer's run never carried a heartbeat and a checkpoint")


def _second(tmp_path, data_dir, mlflow_server, s3_server, exp, keys, prefix=(), flags=()):
    second = tmp_path / "machine2"
    second.mkdir(exist_ok=True)
    cmd = [*prefix, *trainer_cmd(*flags, *tracked(second, data_dir, mlflow_server, exp, **keys))]
    return subprocess.run(cmd, cwd=second, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **s3_server.env})


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


@pytest.mark.parametrize("where", ["this machine", "another machine"])
def test_a_second_trainer_of_a_job_that_is_training_is_refused_and_the_first_goes_on(
        tmp_path, data_dir, mlflow_server, s3_server, where):
    if where == "another machine" and not _elsewhere_works():
        pytest.skip("needs `unshare --pid` (root or user namespaces) to stand for another machine")
    exp = f"twice-{uuid.uuid4().hex[:6]}"
    first, run = _start_first(tmp_path, data_dir, mlflow_server, s3_server, exp, LONG, checkpoint=False)
    try:
        started = time.monotonic()
        done = _second(tmp_path, data_dir, mlflow_server, s3_server, exp, LONG,
                       prefix=ELSEWHERE if where == "another machine" else ())
        took = time.monotonic() - started
        assert done.returncode == 2, done.stderr[-3000:]
        lines = done.stderr.strip().splitlines()
        last = lines[-1]
        assert all("WARNING" in line for line in lines[:-1]), lines  # what it watched, then the one error
        assert last.startswith(f"error: run {run.info.run_id} of this job is being trained right now by ")
        assert f"(pid {first.pid})" in last and "--no-resume" in last
        assert took < 120  # seen at once here; within a few missed beats from elsewhere
        plan = _second(tmp_path, data_dir, mlflow_server, s3_server, exp, LONG, flags=["--dry-run"])
        assert plan.returncode == 0, plan.stderr[-3000:]
        assert f"continues run {run.info.run_id} (RUNNING, last heartbeat " in plan.stdout
        assert first.poll() is None  # the first trains on
    finally:
        _stop(first)
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)  # no second run either
    assert run.info.status == "KILLED"  # as the first left it (SIGTERM), not reopened by the second
    logged = steps(client, run.info.run_id)
    assert logged == sorted(set(logged)) and logged[0] == 0  # one trainer's curve: no step twice
    assert not [p for p in (tmp_path / "machine2" / "output").glob("model_*.pth")]


def test_a_job_whose_trainer_died_elsewhere_continues_once_its_heartbeat_stops(tmp_path, data_dir, mlflow_server,
                                                                               s3_server):
    if not _elsewhere_works():
        pytest.skip("needs `unshare --pid` (root or user namespaces) to stand for another machine")
    exp = f"died-{uuid.uuid4().hex[:6]}"
    first, run = _start_first(tmp_path, data_dir, mlflow_server, s3_server, exp, SHORT)
    first.send_signal(signal.SIGKILL)  # a machine lost: the run stays RUNNING, its heartbeat fresh
    first.wait()
    client = MlflowClient(mlflow_server.url)
    saved = client.get_run(run.info.run_id).data.tags["tracktron.ckpt.latest"]
    resumed = _second(tmp_path, data_dir, mlflow_server, s3_server, exp, SHORT, prefix=ELSEWHERE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "watching it for up to" in resumed.stderr and "it is gone; this job continues the run" in resumed.stderr
    assert f"resuming from run {run.info.run_id} ({saved})" in resumed.stderr
    run = only_run(client, exp)
    assert run.info.status == "FINISHED"


def _first_to_end(procs: list, timeout: float = 240):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc in procs:
            if proc.poll() is not None:
                return proc
        time.sleep(0.2)
    raise AssertionError(f"neither trainer stopped within {timeout:.0f} s: both are training the job")


def test_two_trainers_of_a_job_started_together_one_trains(tmp_path, data_dir, mlflow_server, s3_server):
    """Both find the job's run free, and open it once their checks are done. A new job's: both started
    at once, each makes a run, and the first made keeps the job. A stopped job's: the second trainer's
    opening is held back (a slow link to the server), so that the first reopens the run in between;
    the second then finds the first's heartbeat on it. The one refused stops in one line. Found by
    the red team of 2026-12-02: two trainers started 8 s apart both trained the run, every step
    logged twice."""
    exp = f"together-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    with FaultProxy(mlflow_server.url) as slow:
        slow.delay_requests(rb"^GET /api/2\.0/mlflow/runs/get\b", 15)  # the second's reopening, not its lookup
        for phase, servers in (("new", (mlflow_server, mlflow_server)), ("stopped", (mlflow_server, slow))):
            procs, logs = [], []
            for i, server in enumerate(servers):
                folder = tmp_path / f"{phase}{i}"
                folder.mkdir()
                logs.append(folder / "stderr.txt")
                with open(logs[-1], "w") as err:
                    procs.append(subprocess.Popen(trainer_cmd(*tracked(folder, data_dir, server, exp, **LONG)),
                                                  cwd=folder, stdout=subprocess.DEVNULL, stderr=err,
                                                  env={**os.environ, **s3_server.env}))
            try:
                ended = _first_to_end(procs)
                other = procs[1 - procs.index(ended)]
                said = logs[procs.index(ended)].read_text().strip().splitlines()
                assert ended.returncode == 2, said[-20:]
                assert said[-1].startswith("error: run ") and f"is being trained right now by {os.uname().nodename} " \
                    f"(pid {other.pid})" in said[-1], said[-20:]
                assert phase == "new" or ended is procs[1]
                assert other.poll() is None  # the one that opened it trains on
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        _stop(proc)
    run = only_run(client, exp)  # one run for the job (a run made second is deleted)
    logged = steps(client, run.info.run_id)
    assert logged == sorted(set(logged))  # one trainer's curve at a time: no step twice


def test_two_trainers_handed_one_bare_run_adopt_it_once(tmp_path, data_dir):
    """`mlflow run --run-id X` started twice, or `--resume X` of a bare run given to two machines:
    both find the run bare and free, and each opens it once its checks are done. The first adopts
    it; the second finds the first's heartbeat on it and is refused. Adopting did not claim the run
    (only reopening the job's own did), so both trained into it."""
    from trainer.config import load_config
    from trainer.errors import UserError
    from trainer.tracking.job_run import find_run, open_run

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    bare = client.create_run(client.create_experiment("demo", artifact_location=str(tmp_path / "artifacts")))
    cfg = load_config(DEMO, demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}))
    first, second = (find_run(client, uri, cfg, bare.info.run_id, new_run=False) for _ in range(2))
    opened = open_run(client, uri, cfg, 1, first)
    with pytest.raises(UserError, match=f"^run {bare.info.run_id} of this job is being trained right now by "):
        open_run(client, uri, cfg, 1, second)
    run = client.get_run(bare.info.run_id)
    assert opened.run.info.run_id == run.info.run_id and HEARTBEAT in run.data.tags
    assert run.data.tags[HEARTBEAT] == opened.run.data.tags[HEARTBEAT]  # the first's, not overwritten


def test_a_run_made_twice_by_a_retried_create_leaves_only_the_trainers_own(tmp_path):
    """MLflow's client sends runs/create again when the answer is lost (a reset link): the server
    made the run twice, with the same start time and heartbeat. The copy the trainer never got
    back stayed RUNNING, and won ties: the trainer then refused itself ("being trained right now by
    <its own pid>"), or a later start continued the empty copy from iteration 0. Found by the red
    team of 2026-12-03; the two requests are made here as the retry makes them."""
    from trainer.tracking.job_run import settle_new_run

    client = MlflowClient(f"sqlite:///{tmp_path / 'store.db'}")
    exp = client.create_experiment("demo", artifact_location=str(tmp_path / "artifacts"))
    tags = {"tracktron.job": "0123456789abcdef", HEARTBEAT: json.dumps({"host": "vm", "pid": 5601, "time": 1.0})}
    lost, mine = (client.create_run(exp, start_time=1_700_000_000_000, tags=tags) for _ in range(2))
    other_job = client.create_run(exp, start_time=1_700_000_000_000, tags={**tags, "tracktron.job": "fedcba9876543210"})
    other_trainer = client.create_run(exp, start_time=1_700_000_000_000, tags={**tags, HEARTBEAT: "{}"})
    settle_new_run(client, exp, mine, first_wins=False)
    assert client.get_run(lost.info.run_id).info.lifecycle_stage == "deleted"
    for kept in (mine, other_job, other_trainer):  # another job's run, another trainer's: not copies of this one
        assert client.get_run(kept.info.run_id).info.lifecycle_stage == "active"


# ---- the OUTPUT_DIR lock (helper-52's red team) ----

def test_a_lock_file_with_another_name_is_neither_written_nor_locked(tmp_path):
    """`.lock` a hard link: of a running job's folder copied with `cp -al` (its trainer's lock then
    refused the copy's job as "in use" by that trainer), or of a file outside OUTPUT_DIR (which was
    truncated and overwritten with the trainer's host and pid). That name is dropped for a new file."""
    from trainer.output_lock import OutputLock

    running = OutputLock(tmp_path / "running").acquire()
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file\n")
    try:
        held = (tmp_path / "running" / ".lock").read_text()
        for outside in (tmp_path / "running" / ".lock", precious):
            copy = tmp_path / f"copy-of-{outside.stem or 'lock'}"
            copy.mkdir()
            os.link(outside, copy / ".lock")
            lock = OutputLock(copy).acquire()
            assert (copy / ".lock").read_text() == f"host {os.uname().nodename}, pid {os.getpid()}\n"
            assert os.stat(copy / ".lock").st_nlink == 1
            lock.release()
        assert (tmp_path / "running" / ".lock").read_text() == held and precious.read_text() == "a user's file\n"
    finally:
        running.release()


def test_a_folder_made_for_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A non-root user with `umask 0777`: OUTPUT_DIR was made (mode 000), its lock could not be written,
    the error said so, and the folder stayed, where a job that wrote nothing leaves none (helper-61).
    The kernel's refusal is what such a user gets; root is refused nothing, so it is played here."""
    from trainer.errors import UserError
    from trainer.output_lock import LOCK_NAME, OutputLock

    real_open = os.open

    def refused(path, *args, **kwargs):
        if str(path).endswith(LOCK_NAME):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    before = os.umask(0o777)
    try:
        with pytest.raises(UserError) as e:
            OutputLock(tmp_path / "new" / "out").acquire()
    finally:
        os.umask(before)
    assert str(e.value) == (f"cannot write to OUTPUT_DIR {tmp_path / 'new' / 'out'}: Permission denied (this process's "
                            "umask 0777 makes folders it cannot write)")
    assert not (tmp_path / "new").exists()


def test_a_dry_run_checking_the_folder_as_a_trainer_starts_does_not_refuse_it(tmp_path):
    """A --dry-run's check holds shared locks for an instant: a trainer that started then was refused,
    `in use by another trainer`, naming the pid a stale `.lock` held (helper-52: 1250 of 2000 starts)."""
    import threading

    from trainer.output_lock import OutputLock

    out, done = tmp_path / "out", threading.Event()
    out.mkdir()

    def checking():
        while not done.is_set():
            try:
                OutputLock(out).check()
            except Exception:  # the trainer holds it: what a dry run then says
                pass

    checker = threading.Thread(target=checking)
    checker.start()
    try:
        for _ in range(100):
            OutputLock(out).acquire().release()
    finally:
        done.set()
        checker.join()


def test_a_lock_knows_when_its_folder_is_no_longer_at_its_path(tmp_path):
    """The lock is on the folder the path led to at the start; a link on the path changed (or the
    folder renamed) while the job trains lets a second trainer into the new folder the path leads to."""
    from trainer.output_lock import OutputLock

    (tmp_path / "r1").mkdir()
    (tmp_path / "r2").mkdir()
    (tmp_path / "cur").symlink_to("r1")
    first = OutputLock(tmp_path / "cur").acquire()
    (tmp_path / "r1" / ".lock").unlink()  # deleted by hand: the folder's own lock still holds
    assert first.still_here()
    (tmp_path / "next").symlink_to("r2")
    os.replace(tmp_path / "next", tmp_path / "cur")
    assert not first.still_here()
    second = OutputLock(tmp_path / "cur").acquire()
    assert second.still_here()
    os.rename(tmp_path / "r2", tmp_path / "r2.old")
    (tmp_path / "r2").mkdir()
    assert not second.still_here()
    first.release()
    second.release()


def test_a_job_whose_output_dir_is_moved_while_it_trains_stops_before_writing_into_the_new_one(tmp_path, data_dir):
    """helper-52's red team: OUTPUT_DIR a link, pointed at another folder while the job trained; a
    second job started there took the free lock, and both wrote checkpoints into it: one's
    model_final overwrote the other's. The job checks at each checkpoint that the path still leads to
    the folder it locked, and stops in one line before writing elsewhere."""
    (tmp_path / "r1").mkdir()
    (tmp_path / "r2").mkdir()
    (tmp_path / "cur").symlink_to("r1")
    args = demo_overrides(tmp_path, data_dir, **{"OUTPUT_DIR": tmp_path / "cur", "SOLVER.MAX_ITER": 400,
                                                 "TRACKING.ENABLED": "false"})
    job = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while not (tmp_path / "r1" / "model_iter2.pth").exists():
            assert job.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        (tmp_path / "next").symlink_to("r2")
        os.replace(tmp_path / "next", tmp_path / "cur")
        _, stderr = job.communicate(timeout=240)
    finally:
        job.kill()
    assert job.returncode == 2, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith(
        f"error: OUTPUT_DIR {tmp_path / 'cur'} is no longer the folder this job locked")
    assert not list((tmp_path / "r2").glob("model_*.pth"))
    assert (tmp_path / "r1" / "model_iter2.pth").exists()
