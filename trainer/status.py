"""`tracktron status`: the jobs of an experiment at a glance, from the tracking server alone."""
from __future__ import annotations

from datetime import timedelta

from mlflow import MlflowClient

from trainer.mlflow_runs import JOB_TAG, LATEST_TAG


def _last_step(run, key: str = "loss") -> int | None:
    # RunData keeps each key's latest point with its step (the public dict drops the step).
    steps = [m.step for m in getattr(run.data, "_metric_objs", []) if m.key == key]
    return max(steps) if steps else None


def job_rows(client: MlflowClient, uri: str, experiment: str | None = None) -> list[dict]:
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        experiments = [exp] if exp else []
    else:
        experiments = client.search_experiments()
    rows = []
    for exp in experiments:
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{JOB_TAG}` != ''",
                                  order_by=["attributes.start_time DESC"])
        rows += [_row(run, exp, uri) for run in runs]
    return rows


def _row(run, exp, uri: str) -> dict:
    step = _last_step(run)
    eta = run.data.metrics.get("eta_seconds")
    running = run.info.status == "RUNNING"
    link = f"{uri.rstrip('/')}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}" if uri.startswith("http") else ""
    return {
        "run": run.info.run_id,
        "name": run.info.run_name or "",
        "experiment": exp.name,
        "status": run.info.status,
        "iteration": f"{'-' if step is None else step + 1}/{run.data.params.get('SOLVER.MAX_ITER', '?')}",
        "checkpoint": run.data.tags.get(LATEST_TAG, "-"),
        "loss": f"{run.data.metrics['loss']:.4f}" if "loss" in run.data.metrics else "-",
        "eta": str(timedelta(seconds=int(eta))) if running and eta is not None else "-",
        "ui": link,
    }


def render(rows: list[dict]) -> str:
    if not rows:
        return "no tracktron jobs found"
    columns = [c for c in rows[0] if any(r[c] for r in rows)]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
