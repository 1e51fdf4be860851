"""Metric points a job could not send before its deadline (the tracking server down at its end, or
at a SIGTERM's), kept in OUTPUT_DIR beside its checkpoints: the next start of the job that reopens
the same run sends them first, so a checkpoint resumed there leaves no hole in the run's curves."""
from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import re
from pathlib import Path

from trainer.atomic_write import write_atomic
from trainer.checkpoint.files import UNSENT_METRICS
from trainer.errors import first_line

log = logging.getLogger(__name__)

KEY = re.compile(r"[\w\-. /:]{1,250}", re.ASCII)  # MLflow's rule for a metric's name, with its path rule (_point)


def keep(output_dir: Path, run_id: str, points: list) -> list[str]:
    """Write the points the run never got (replacing the file), or remove the file when none are
    left. What the run lacks, for the job's last line: [] or one description."""
    path = Path(output_dir) / UNSENT_METRICS
    if not points:
        with contextlib.suppress(OSError):  # a file it cannot remove is sent again, and kept once
            path.unlink(missing_ok=True)
        return []
    lacking = f"the metrics of {describe(points)}"
    try:
        write_atomic(path, json.dumps({"run_id": run_id, "points": points}))
    except OSError as e:  # the folder is gone or full: those points are lost, as they were before
        log.warning("could not keep the unsent metrics in %s: %s", path, first_line(e))
        return [lacking]
    return [f"{lacking} (kept in {path})"]


def describe(points: list) -> str:
    steps = sorted({p[3] for p in points})
    return f"iteration {steps[0]}" if len(steps) == 1 else f"{len(steps)} iterations ({steps[0]}-{steps[-1]})"


def take(output_dir: Path, run_id: str) -> list:
    """The points an earlier start of this run left, checked; [] when there are none, or when they
    are another run's (left in place, said once)."""
    path = Path(output_dir) / UNSENT_METRICS
    if not path.is_file():
        return []
    try:
        kept = json.loads(path.read_text())
        points = [_point(p) for p in kept["points"]]
        owner = kept["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # not ours, or damaged: never sent, never fatal
        log.warning("%s is not a list of metric points (%s): not sent", path, first_line(e))
        return []
    if owner != run_id:
        log.warning("%s holds metrics of run %s, not of this job's run %s: not sent", path, owner, run_id)
        return []
    return points


def _point(p) -> tuple:
    """A point as the sender made it. A key MLflow would refuse is refused here: the server's refusal
    of the first batch would hold back every metric (and checkpoint tag) after it."""
    key, value, timestamp, step = p
    if not (isinstance(key, str) and KEY.fullmatch(key) and posixpath.normpath(key) == key
            and key != "." and not key.startswith(("..", "/")) and isinstance(value, (int, float)) and not isinstance(value, bool)
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in (timestamp, step))):
        raise ValueError(f"{p!r:.80} is no (key, value, timestamp, step)")
    return key, float(value), timestamp, step


def resend(sender, output_dir: Path, run) -> bool:
    """Queue what an earlier start of `run` left ahead of everything else; the steps they hold count
    as logged (run.last_step), so that a resume from before them does not send them twice. True
    when there was something to send: the file is then rewritten or removed at the end (keep)."""
    points = take(output_dir, run.run_id)
    if points:
        run.resent_metrics = f"the metrics of {describe(points)}"
        log.info("sending %s that an earlier start could not send", run.resent_metrics)
        sender.resend(points)
        run.last_step = max([run.last_step, *(step for key, _, _, step in points if key == "loss")])
    return bool(points)

