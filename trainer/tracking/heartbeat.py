"""Which trainer is training a run right now. Rank 0 keeps a tag on its run fresh (its heartbeat:
who it is and when, sent with every metrics batch, and on its own when no metrics are due), so that
a second trainer of the same job, in another folder or on another machine, can tell a live trainer
from one that died without a word (SIGKILL, a lost machine), whose run still says RUNNING.

On the same machine the process itself answers (its pid and start time); from another one, a beat
that changes while it watches. Two trainers that both found the run free (started within the time a
job's checks take) meet again when they open it: the run goes to one of them (`claim_run`, and for a
new job's run, the first one made)."""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time

from trainer.errors import UserError
from trainer.redaction import printable

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "tracktron.heartbeat"
STALE_S = 60.0  # what `status` takes for a stopped beat; a second trainer watches instead (clocks differ)
WATCH_S = 20.0  # a beat from another machine that does not change for this long (4 missed beats): gone
FORGOTTEN_S = 86400.0  # one older than this is not watched: no clock is a day off, no trainer that quiet
POLL_S = 1.0


def _process_start(pid: int) -> str | None:
    """The process's start time since boot (field 22 of /proc/PID/stat), None when it has ended (a
    zombie too): a pid and its start time name one process, even once the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, *rest = f.read().rsplit(")", 1)[1].split()
        return None if state in ("Z", "X") else rest[18]
    except (OSError, IndexError, ValueError):
        return None


def _machine() -> str:
    """This boot of this host, and this pid namespace (a container has its own pids)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: only a changing beat tells
        return f"{socket.gethostname()}:unknown"


@functools.lru_cache(maxsize=None)
def _this_trainer() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _process_start(pid), "machine": _machine()}


def beat() -> str:
    """The tag's value: this trainer and the time."""
    return json.dumps({**_this_trainer(), "time": round(time.time(), 1)})


def _parse(value: str | None) -> dict | None:
    try:
        found = json.loads(value) if value else None
        return found if isinstance(found, dict) and isinstance(found.get("time"), (int, float)) else None
    except ValueError:  # edited by hand: no evidence of a trainer
        return None


def _alive_here(found: dict, me: dict) -> bool | None:
    """Whether the trainer of beat `found` still runs, when it is on this machine (its pid and start
    time answer at once); None when it is on another one (or this one's identity is unknown)."""
    if me["machine"].endswith(":unknown") or found.get("machine") != me["machine"]:
        return None
    pid, started = found.get("pid"), found.get("started")
    return isinstance(pid, int) and started is not None and _process_start(pid) == started


def gone_from_here(value: str | None) -> bool:
    """A heartbeat tag of a trainer on this machine whose process has ended (SIGKILL, the OOM killer):
    gone now, as the trainer's next start sees it, not once its beat is STALE_S old."""
    found = _parse(value)
    return found is not None and _alive_here(found, _this_trainer()) is False


def _live_beat(run) -> dict | None:
    """The beat of a RUNNING run, None when it has none (or ended, and said so)."""
    return _parse(run.data.tags.get(HEARTBEAT_TAG)) if run.info.status == "RUNNING" else None


def check_not_held(client, run, stop: threading.Event | None = None) -> None:
    """Return when no other live trainer beats on `run` (an mlflow Run, as found); UserError when one
    does. May watch the run for up to WATCH_S seconds, or until `stop` is set (the job ends)."""
    other, me = _live_beat(run), _this_trainer()
    if other is None:
        return
    if (alive := _alive_here(other, me)) is not None:
        if alive and other.get("pid") != me["pid"]:
            raise _held(run, other)
        return
    # Its age is read on two clocks: one slow by minutes makes a live trainer's beat look old. Only
    # a change seen while watching tells; a start after a crash elsewhere waits WATCH_S for it.
    age = time.time() - other["time"]
    if age > FORGOTTEN_S:
        return
    log.warning("run %s was being trained by %s %.0f s ago: watching it for up to %.0f s to see whether it still is",
                run.info.run_id, _who(other), max(age, 0), WATCH_S)
    deadline = time.monotonic() + WATCH_S
    stop = stop or threading.Event()
    while time.monotonic() < deadline:
        if stop.wait(POLL_S):
            return
        now = client.get_run(run.info.run_id)
        if now.info.status != "RUNNING":  # it stopped meanwhile and said so
            return
        if now.data.tags.get(HEARTBEAT_TAG) != run.data.tags[HEARTBEAT_TAG]:
            raise _held(run, _parse(now.data.tags.get(HEARTBEAT_TAG)) or other)
    log.info("run %s: no heartbeat from %s for %.0f s, it is gone; this job continues the run",
             run.info.run_id, _who(other), WATCH_S)


def claim_run(client, seen, now):
    """The job's run, reopened by this trainer: `seen` as the lookup found it, `now` as it is once the
    job's checks are done. A beat written in between is another trainer's of this job, which opened
    the run while this one was being checked: it keeps the run. Ours is then written and read back,
    so that of two trainers writing at nearly the same moment the later one keeps it. Returns the run
    as read back."""
    if now.data.tags.get(HEARTBEAT_TAG) != seen.data.tags.get(HEARTBEAT_TAG):
        raise taken(now)
    mine = beat()
    client.set_tag(now.info.run_id, HEARTBEAT_TAG, mine)
    now = client.get_run(now.info.run_id)
    if now.data.tags.get(HEARTBEAT_TAG) != mine:
        raise taken(now)
    return now


def taken(run) -> UserError:
    """The refusal for a run another trainer of this job has just made or reopened."""
    return _held(run, _parse(run.data.tags.get(HEARTBEAT_TAG)) or {})


def last_seen(run) -> str:
    """For --dry-run: ", last heartbeat N s ago from HOST (pid P)" for a RUNNING run that has one."""
    other = _live_beat(run)
    if other is None:
        return ""
    return f", last heartbeat {max(time.time() - other['time'], 0):.0f} s ago from {_who(other)}"


def _who(beat_: dict) -> str:  # a tag anyone with access can edit: one printable line, however odd
    return printable(f"{str(beat_.get('host', '?'))[:100]} (pid {str(beat_.get('pid', '?'))[:20]})")


def _held(run, other: dict) -> UserError:
    return UserError(f"run {run.info.run_id} of this job is being trained right now by {_who(other)}: stop that "
                     "trainer first (a second one would log into the same run), or train this job in a new run "
                     "with --no-resume")
