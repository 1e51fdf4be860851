"""The run `mlflow run -e eval` makes for an evaluation and hands over in MLFLOW_RUN_ID: it gets the
scores too, and where they were logged, rather than staying empty beside the run that got them."""
from __future__ import annotations

import logging
import os
import time

from trainer.errors import first_line
from trainer.redaction import redact_urls
from trainer.tracking.runs import tracking_uri

log = logging.getLogger(__name__)

ENTRY_POINT_TAG = "mlflow.project.entryPoint"  # set by `mlflow run` on the run it makes


def record_evaluation(cfg, weights: str, metrics: dict[str, float], step: int, logged_into: str | None) -> None:
    """Only a run MLflow Projects made for the eval entry point and that holds no metric yet: a
    MLFLOW_RUN_ID left in a shell (a training run's) is never written to."""
    launcher = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if not (launcher and metrics and cfg.TRACKING.ENABLED) or launcher == logged_into:
        return
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

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
