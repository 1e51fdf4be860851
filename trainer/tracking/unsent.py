"""Metric points a job could not send (the tracking server down at a checkpoint, at a signal, a
failure or the end of training), kept in OUTPUT_DIR beside its checkpoints: the next start of the
job that reopens the same run sends them first, so a checkpoint resumed there leaves no hole in
the run's curves, even after a SIGKILL.

The file is JSON lines: `{"run_id": ..., "points": [...]}`, then one list of points per checkpoint
of an outage, appended, so that a long outage costs each checkpoint its new points only. Points
that were sent since stay in it: the next start sends only the steps the run lacks."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import stat
import time
from pathlib import Path

from trainer.atomic_write import write_atomic
from trainer.checkpoint.files import UNSENT_METRICS, move_aside
from trainer.errors import first_line
from trainer.tracking.background import points_of

log = logging.getLogger(__name__)

KEY = re.compile(r"[\w\-. /:]{1,250}")  # MLflow's rule for a metric's name, with its path rule (valid_point)
MAX_BYTES = 256 * 2**20  # what the sender holds at most (200,000 iterations of ~12 metrics) is ~150 MB
CLOCK_SKEW_MS = 24 * 3600 * 1000  # a point's time may be ahead of this host's clock by as much (another host's)


class UnsentMetrics:
    """OUTPUT_DIR/unsent_metrics.json of one run: taken at the start, rewritten at the end. A file
    it refuses (another run's, damaged) is never sent or rewritten: it moves to `earlier-<time>/`."""

    def __init__(self, output_dir: Path, run_id: str, last_iter: int):
        self.path, self.run_id, self.last_iter = Path(output_dir) / UNSENT_METRICS, run_id, last_iter
        self.taken = False  # the file is this run's: removed once nothing in it is left to send
        self.blocked = False  # a refused file that could not be moved aside holds the name
        self.resent_through = -1  # the newest step resent from an earlier start's file
        self._in_file: set = set()  # (step, timestamp_ms) of the queued puts the file holds

    def resend(self, sender, run, logged: dict[str, int]) -> None:
        """Queue the points an earlier start left ahead of everything else, but those the run holds
        (`logged`: its newest step per key); the loss's steps count as logged (run.last_step), so a
        resume from before them sends none of them twice."""
        points = [p for p in self._take() if p[3] > logged.get(p[0], -1)]
        if points:
            run.resent_metrics = f"the metrics of {describe(points)}"
            log.info("sending %s that an earlier start could not send", run.resent_metrics)
            sender.resend(points)
            self.resent_through = max(p[3] for p in points)
            run.last_step = max([run.last_step, *(step for key, _, _, step in points if key == "loss")])

    def spill(self, sender, step: float, checkpoint: str) -> None:
        """At a checkpoint of iteration `step` (the writer thread, its file complete): once the
        server has been found down, the points it lacks of the iterations the checkpoint holds are
        kept, with those an earlier start's file left (this start does not log their steps again),
        so a job killed before they are sent (SIGKILL, a lost node) resumes there without a hole.
        Each later checkpoint appends what is queued and not in the file yet; one that finds nothing
        queued (or the job's end, keep) removes it."""
        if not (sender.failing or self.taken):
            return
        through = max(step, self.resent_through)
        queued = [put for put in sender.queued() if put[0] <= through]
        new = [put for put in queued if put[:2] not in self._in_file]
        if queued and not new:
            return  # the file holds them all
        if queued and self.taken and self._append(new):
            self._in_file = {put[:2] for put in queued}
            said = [f"the metrics of {_steps(sorted({put[0] for put in queued}))} (kept in {self.path})"]
        else:  # removed when none are left; or written anew
            said = self.keep(points_of(queued), stopping=False)
        if said and sender.failing:  # else the queue drains: no news
            log.info("metrics not taken by the tracking server at %s: %s", checkpoint, said[0])  # down, or refusing the run

    def _append(self, puts: list) -> bool:
        """One line of `puts`' points at the end of this run's file; False where the file must be
        written anew (gone, about to pass MAX_BYTES, or the append failed)."""
        line, size = memoryview((json.dumps(points_of(puts)) + "\n").encode()), None
        try:  # never through a link put in its place: the file is written anew instead
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:  # unbuffered: nothing of a failed write is left to go out at close
            st = os.fstat(fd)
            if not _own(st) or st.st_size + len(line) > MAX_BYTES:
                return False
            size = st.st_size
            while line:
                line = line[os.write(fd, line):]
        except OSError:  # a disk full in the middle: the next addition must not follow half a line
            if size is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
            return False
        finally:
            os.close(fd)
        return True

    def keep(self, points: list, stopping: bool = True) -> list[str]:
        """Write the points the run never got (the newest, up to MAX_BYTES), or remove a file it took
        when none are left. What the run lacks, for the job's last line: [] or one description."""
        if not points:
            if self.taken:
                with contextlib.suppress(OSError):  # one it cannot remove is sent again, and kept once
                    self.path.unlink(missing_ok=True)
                    self.taken, self._in_file = False, set()
            return []
        lacking, which = f"the metrics of {describe(points)}", ""
        data = _file(self.run_id, points)
        if len(data) > MAX_BYTES:  # a long outage: the newest points, as the sender's queue keeps them
            points = points[len(points) - int(len(points) * MAX_BYTES * 0.9 / len(data)):]
            data = _file(self.run_id, points)
            which = f"those of {describe(points)} "
            log.warning("%s: only %s are kept (%d MiB at most), the older are %s", lacking, which, MAX_BYTES >> 20,
                        "lost" if stopping else "still queued to send, in memory only")
        try:
            if self.blocked and self.path.exists():
                raise FileExistsError(f"{self.path} holds what this job refused to send")
            write_atomic(self.path, data)
            self.taken = True  # this run's file now: removed once nothing is left to send
            self._in_file = {(step, ts) for _, _, ts, step in points}
        except OSError as e:  # the folder is gone or full: those points are lost, and said so
            log.warning("could not keep the unsent metrics in %s: %s", self.path, first_line(e))
            return [f"{lacking} (lost: they could not be kept in {self.path})"]
        return [f"{lacking} ({which}kept in {self.path})"]

    def _take(self) -> list:
        try:
            data = _read(self.path)
            if data is None:
                return []
            head, *appended = _lines(data.decode("utf-8"))
            kept = json.loads(head)
            owner, points = kept["run_id"], kept["points"]
            if not isinstance(owner, str):
                raise ValueError("no run id")
            if owner != self.run_id:
                return self._refuse(f"holds metrics of run {owner[:100]!r}, not of this job's run {self.run_id}")
            points = [points, *map(json.loads, appended)]
            if not all(isinstance(line, list) and all(map(valid_point, line)) for line in points):
                raise ValueError("a point is no (key, value, timestamp, step) that MLflow takes")
            points = [tuple(p) for line in points for p in line]
            if beyond := [p for p in points if p[3] > self.last_iter or p[2] > time.time() * 1000 + CLOCK_SKEW_MS]:
                raise ValueError(f"a point no start of this job made: {beyond[0][0]!r} at step {beyond[0][3]}, "
                                 f"time {beyond[0][2]} ms (its last iteration is {self.last_iter})")
        except Exception as e:  # not ours, or damaged (too deep, too large): never sent, never fatal
            return self._refuse(f"is not a list of metric points ({first_line(e)})")
        self.taken = True
        if b"\n" in data and not data.endswith(b"\n"):  # what follows is added after the last whole line;
            with contextlib.suppress(OSError):  # written anew, not cut in place: a hard link's other name keeps it
                write_atomic(self.path, data[:data.rindex(b"\n") + 1])
        first: dict = {}  # one value per key and step, the first written: a job logs a step once
        for key, value, ts, step in points:
            first.setdefault((key, step), (key, float(value), ts, step))
        points = list(first.values())
        self._in_file = {(step, ts) for _, _, ts, step in points}
        return points

    def _refuse(self, why: str) -> list:
        """Out of the way, kept: the name is free for this run's own leftovers."""
        try:
            folder = move_aside(self.path.parent, [self.path])
            log.warning("%s %s: not sent; moved to %s", self.path, why, folder)
        except OSError as e:
            self.blocked = True
            log.warning("%s %s: not sent (%s)", self.path, why, first_line(e))
        return []


def _read(path: Path) -> bytes | None:
    """The file's bytes, or None when there is none. Never through a symbolic link (its target may
    be anyone's, or block a read, as /proc/kmsg does), never from what is no regular file. A hard
    link is read: a snapshot's copy of the folder holds the job's own points (only never written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError("a symbolic link" if os.path.islink(path) else first_line(e)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES >> 20} MiB")
        return f.read(MAX_BYTES + 1)


def _own(st: os.stat_result) -> bool:
    """A regular file with no other name: one that may be written in place."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def valid_point(p) -> bool:
    """A point as the sender made it: (key, value, timestamp_ms, step). A key MLflow would refuse
    must never reach the sender: the server's refusal of a batch would hold back every metric (and
    checkpoint tag) after it."""
    if not (isinstance(p, list) and len(p) == 4):
        return False
    key, value, timestamp, step = p
    good_key = (isinstance(key, str) and KEY.fullmatch(key) is not None and posixpath.normpath(key) == key
                and key != "." and not key.startswith(("..", "/")))
    good_value = isinstance(value, float) or (type(value) is int and abs(value) < 2**53)
    return good_key and good_value and all(type(n) is int and 0 <= n < 2**63 for n in (timestamp, step))


def describe(points: list) -> str:
    return _steps(sorted({p[3] for p in points}))


def _steps(steps: list) -> str:
    return f"iteration {steps[0]}" if len(steps) == 1 else f"{len(steps)} iterations ({steps[0]}-{steps[-1]})"


def _file(run_id: str, points: list) -> str:
    return json.dumps({"run_id": run_id, "points": points}) + "\n"


def _lines(text: str) -> list[str]:
    """The file's complete lines: a last one without its newline is an append cut short (a kill in
    the middle of it), whose points the line before it does not need. A file of one line without a
    newline is whole (as written before the appends)."""
    lines = text.split("\n")
    if len(lines) > 1:
        lines.pop()  # "" after the last newline, or the torn end of an append
    return [line for line in lines if line] or [""]
