"""`tracktron status`: the jobs of an experiment at a glance, from the tracking server alone."""
from __future__ import annotations

from datetime import timedelta

from trainer.tracking.runs import LATEST_TAG, job_runs, last_step_of, run_url, tracking_uri


def job_rows(uri: str | None = None, experiment: str | None = None) -> list[dict]:
    uri = tracking_uri(None, uri)
    return [_row(run, exp, uri) for exp, run in job_runs(uri, experiment)]


def _row(run, exp, uri: str) -> dict:
    step = last_step_of(run)
    eta = run.data.metrics.get("eta_seconds")
    running = run.info.status == "RUNNING"
    return {
        "run": run.info.run_id,
        "name": run.info.run_name or "",
        "experiment": exp.name,
        "status": run.info.status,
        "iteration": f"{'-' if step < 0 else step + 1}/{run.data.params.get('SOLVER.MAX_ITER', '?')}",
        "checkpoint": run.data.tags.get(LATEST_TAG, "-"),
        "loss": f"{run.data.metrics['loss']:.4f}" if "loss" in run.data.metrics else "-",
        "eta": str(timedelta(seconds=int(eta))) if running and eta is not None else "-",
        "ui": run_url(uri, exp.experiment_id, run.info.run_id) or "",
    }


def render(rows: list[dict]) -> str:
    if not rows:
        return "no tracktron jobs found"
    columns = [c for c in rows[0] if any(r[c] for r in rows)]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
