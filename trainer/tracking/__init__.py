"""Experiment tracking.

The engine, evaluation and the CLI know nothing of MLflow's API: they call a `Tracker` (base.py,
with the no-op implementation). The MLflow implementation (mlflow_tracker.py) queues the training
thread's network work (metrics, checkpoint uploads) for background threads (background.py); job_run.py
finds the job's run; runs.py holds the checkpoint-tag protocol; transfers.py moves checkpoint-sized files (multipart,
timeouts by size) and checkpoint_uploads.py keeps TRACKING.CHECKPOINTS_KEEP of them in the run;
system_metrics.py runs MLflow's system-metrics monitor. `create_tracker` picks the implementation
from TRACKING.ENABLED and the rank; `attach` and `record_evaluation` log `tracktron eval`'s scores.
"""
from __future__ import annotations

import logging
import os
import time

from trainer.config import Config
from trainer.errors import UserError, first_line
from trainer.tracking.base import RunInfo, Tracker

log = logging.getLogger(__name__)

__all__ = ["RunInfo", "Tracker", "attach", "create_tracker", "record_evaluation", "resend_advice"]

ENTRY_POINT_TAG = "mlflow.project.entryPoint"  # set by `mlflow run` on the run it makes


def create_tracker(cfg: Config, rank: int = 0, world_size: int = 1) -> Tracker:
    """Only global rank 0 talks to MLflow."""
    if not cfg.TRACKING.ENABLED or rank != 0:
        return Tracker()
    from trainer.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(cfg, world_size)


def attach(cfg: Config, run_id: str, datasets: list[dict]) -> Tracker:
    """A tracker that logs `tracktron eval`'s scores of a run's checkpoint into that run (its status
    left alone), when they are scores of the run's own test sets (runs.same_scores: names, order and
    annotation files; `datasets` as lineage.dataset_inputs gives them). Those of other sets would read as the run's own
    `bbox/AP` and could move its best checkpoint: they are printed, not logged. A run trained without
    test sets takes those of its first evaluation as its own."""
    from trainer.tracking.mlflow_tracker import MlflowTracker
    from trainer.tracking.runs import takes_scores
    from trainer.tracking.server_errors import run_refusal, start_error, without_logged_models

    tracker = MlflowTracker(cfg)
    tracker.attach(run_id)
    try:
        run = tracker.client.get_run(run_id)
        active = run.info.lifecycle_stage == "active"
        lacking = active and without_logged_models(tracker.uri, tracker.client)  # scores link to the checkpoint's model
        taken = active and not lacking and takes_scores(tracker.client, run, datasets)
    except Exception as e:  # the checkpoint's download just worked: a server that fails now
        raise UserError(start_error(tracker.uri, e)) from None
    if run.info.lifecycle_stage != "active":  # MLflow refuses every write to it: said now, not after the evaluation
        tracker.finish(None)
        why, detail = run_refusal(tracker.client, run_id) or ("deleted", "")
        how = (f"`mlflow experiments restore --experiment-id {detail}` (its experiment is deleted)"
               if why == "experiment deleted" else f"`mlflow runs restore --run-id {run_id}`")
        raise UserError(f"run {run_id} is deleted, so its evaluation cannot be logged into it: restore it ({how}) "
                        "or evaluate a copy of the checkpoint file")
    if lacking:
        log.warning("%s: these scores are printed, not logged into run %s; use an MLflow 3 server", lacking, run_id)
    if not taken:
        tracker.finish(None)
        return Tracker()
    return tracker


def record_evaluation(cfg: Config, weights: str, metrics: dict[str, float], step: int, logged_into: str | None) -> None:
    """The run `mlflow run -e eval` makes for an evaluation and hands over in MLFLOW_RUN_ID gets the
    scores too, and where they were logged, rather than staying empty beside the run that got them.
    Only a run MLflow Projects made for the eval entry point and that holds no metric yet: a
    MLFLOW_RUN_ID left in a shell (a training run's) is never written to."""
    launcher = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if not (launcher and metrics and cfg.TRACKING.ENABLED) or launcher == logged_into:
        return
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    from trainer.redaction import redact_urls
    from trainer.tracking.runs import tracking_uri

    try:
        client = MlflowClient(tracking_uri(cfg))
        run = client.get_run(launcher)
        if run.data.tags.get(ENTRY_POINT_TAG) != "eval" or run.data.metrics:
            return
        now = int(time.time() * 1000)
        tags = [RunTag("tracktron.weights", redact_urls(weights))]
        if logged_into:
            tags.append(RunTag("tracktron.scores_run_id", logged_into))
        client.log_batch(launcher, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], tags=tags)
    except Exception as e:  # the scores are printed and, for a run's checkpoint, in that run: a warning
        log.warning("could not record the scores in MLflow run %s (MLFLOW_RUN_ID): %s", launcher, first_line(e))


def resend_advice(tracker: Tracker) -> str:
    """What the last line of a job whose run lacks some of it advises: a rerun sends the rest, unless
    the server refuses the run's writes (MlflowTracker.refusal): those are said, with what to do."""
    usual = "The local files are intact; running the same command again sends what the run lacks"
    run_id = tracker.run.run_id
    why, detail = tracker.refusal() or ("", "")
    if why == "credentials":
        return f"The tracking server now refuses the credentials ({detail}): renew them; {usual[0].lower()}{usual[1:]}"
    if why == "gone":  # deleted, then `mlflow gc`: no restoring
        return (f"Run {run_id} no longer exists on the tracking server (deleted for good while the job ran): what it "
                "lacks cannot be sent; the local files are intact, and running the same command again logs the job "
                "into a new run")
    if why in ("deleted", "experiment deleted"):
        how = (f"mlflow experiments restore --experiment-id {detail}" if why == "experiment deleted"
               else f"mlflow runs restore --run-id {run_id}")
        return (f"Run {run_id} was deleted while the job ran: restore it (`{how}`) and run the same command again, "
                "which sends what it lacks (the local files are intact)")
    return usual
