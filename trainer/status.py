"""`tracktron status`: the jobs of an experiment at a glance, from the tracking server alone."""
from __future__ import annotations

import json
import time
from datetime import timedelta

from trainer.redaction import printable, redact_text
from trainer.tracking.heartbeat import HEARTBEAT_TAG, STALE_S, gone_from_here
from trainer.tracking.runs import LATEST_TAG, last_step_of, run_url, tracking_uri
from trainer.tracking.search import job_runs


def job_rows(uri: str | None = None, experiment: str | None = None, timeout: float = 120.0) -> list[dict]:
    uri = tracking_uri(None, uri)
    return [_row(run, exp, uri) for exp, run in job_runs(uri, experiment, timeout)]


def _row(run, exp, uri: str) -> dict:
    step = last_step_of(run)
    eta = run.data.metrics.get("eta_seconds")
    status, note = _liveness(run)
    running = status == "RUNNING"
    return {
        "run": run.info.run_id,
        "name": run.info.run_name or "",
        "experiment": exp.name,
        "model": run.data.params.get("MODEL.TYPE", "-"),  # the family: a sweep over several reads apart
        "status": status,
        "iteration": f"{'-' if step < 0 else step + 1}/{run.data.params.get('SOLVER.MAX_ITER', '?')}",
        "checkpoint": run.data.tags.get(LATEST_TAG, "-"),
        "loss": _number(run.data.metrics.get("loss")),
        "eta": _duration(eta) if running else "-",
        "ui": run_url(uri, exp.experiment_id, run.info.run_id) or "",
        "note": note,  # a column only when some row has one
    }


def _liveness(run) -> tuple[str, str]:
    """The status to show, and why when it is not the run's own: a RUNNING run whose heartbeat
    (heartbeat.py) is missing or older than STALE_S is LOST, one from further ahead than that (a wrong
    clock) UNKNOWN; on the trainer's own machine its process answers at once."""
    if run.info.status != "RUNNING":
        return run.info.status, ""
    sent = _beat_time(run.data.tags.get(HEARTBEAT_TAG))
    if sent is None:
        return "LOST", "no heartbeat"
    if gone_from_here(run.data.tags.get(HEARTBEAT_TAG)):
        return "LOST", "its trainer's process on this machine has ended"
    age = time.time() - sent  # the trainer's clock against this one's, as heartbeat.py allows for
    if age > STALE_S:
        return "LOST", f"no heartbeat for {f'{age:.0f} s' if age < 3600 else _duration(age)}"
    if age < -STALE_S:
        ahead = _duration(-age)
        return "UNKNOWN", f"its heartbeat is {ahead if ahead != '-' else 'ages'} ahead of this clock: a trainer's clock is wrong"
    return "RUNNING", ""


def _beat_time(value: str | None) -> float | None:
    """The time in a heartbeat tag; None for one edited into something else."""
    try:
        found = json.loads(value) if value else None
    except (ValueError, RecursionError):  # anyone may edit a tag
        return None
    sent = found.get("time") if isinstance(found, dict) else None
    ok = isinstance(sent, (int, float)) and not isinstance(sent, bool) and abs(sent) < 1e300  # an int of 400 digits too
    return sent if ok else None


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"  # MLflow keeps inf as 1.8e308


def _duration(seconds: float | None) -> str:
    """h:mm:ss, or "-" for none or one no clock shows (NaN, negative, past 3,000 years)."""
    return str(timedelta(seconds=int(seconds))) if seconds is not None and 0 <= seconds < 1e11 else "-"


def _cell(value, limit: int = 200) -> str:
    text = printable(redact_text(str(value)))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render(rows: list[dict]) -> str:
    """The table, each cell as text a terminal shows: whoever wrote a run's name or tags, no
    escape sequence, carriage return or newline of theirs reaches the screen, and no credential."""
    if not rows:
        return "no tracktron jobs found"
    rows = [{c: _cell(v) for c, v in r.items()} for r in rows]
    columns = [c for c in rows[0] if any(r[c] for r in rows)]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
