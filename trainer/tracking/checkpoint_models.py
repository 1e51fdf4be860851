"""Checkpoints as MLflow 3 LoggedModels, so that MLflow can answer "which checkpoint was best".

Each evaluation during training (and of model_final) becomes a LoggedModel of the run, named after
the checkpoint it evaluated, with model_type `tracktron-checkpoint`, its step, and a tag pointing
at the checkpoint artifact already uploaded (no second copy of the weights); the evaluation's
metrics are logged with that model's id. The best is the one with the highest TEST.BEST_METRIC
(`search_logged_models` ordered by it); the run's tags name it (final_model.py registers it as @best).
Functions of an MlflowClient, called on the tracker's uploader thread (evaluation_due: on the
training thread of a job that has nothing left to train).
"""
from __future__ import annotations

import re
import time

from trainer.tracking.runs import CHECKPOINT_TAG, CHECKPOINT_TYPE, checkpoint_artifact, takes_scores
from trainer.tracking.search import every_page

MODEL_TAG = "tracktron.model_id"  # on the run: its servable model is logged (and registered, if asked)
BEST_CHECKPOINT_TAG = "tracktron.best_checkpoint"  # the run's best checkpoint, its LoggedModel and its score
BEST_MODEL_TAG, BEST_METRIC_TAG = "tracktron.best_model_id", "tracktron.best_metric"


def checkpoint_models(client, experiment_id: str, run_id: str, order_by: str | None = None,
                      checkpoint: str | None = None) -> list:
    """The run's checkpoint models (only `checkpoint`'s, when given: the server filters, where a run
    of hundreds of evaluations would be listed whole at each), the best first when `order_by` names
    a metric."""
    order = [{"field_name": f"metrics.{order_by}", "ascending": False}] if order_by else None
    name = checkpoint and _name(checkpoint)
    named = f" AND name = '{name}'" if name and re.fullmatch(r"[\w.-]+", name) else ""  # eval's is anyone's
    found = every_page(client.search_logged_models, experiment_ids=[experiment_id], order_by=order,
                       filter_string=f"source_run_id = '{run_id}' AND model_type = '{CHECKPOINT_TYPE}'{named}")
    return [m for m in found if not name or m.name == name]


def link_evaluation(client, experiment_id: str, run_id: str, checkpoint: str, metrics: dict, step: int) -> str:
    """The LoggedModel of `checkpoint` (made once: a retried or resumed call finds it), with the
    evaluation's metrics logged into the run under its id. Returns the model id."""
    from mlflow.entities import Metric

    model = next(iter(checkpoint_models(client, experiment_id, run_id, checkpoint=checkpoint)), None)
    if model is None:
        model = client.create_logged_model(
            experiment_id, name=_name(checkpoint), source_run_id=run_id, model_type=CHECKPOINT_TYPE,
            tags={CHECKPOINT_TAG: f"runs:/{run_id}/{checkpoint_artifact(checkpoint)}", "tracktron.iteration": str(step)})
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, step, model_id=model.model_id) for k, v in metrics.items()],
                     synchronous=True)
    client.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def evaluation_due(client, experiment_id: str, run, checkpoint: str, datasets: list[dict]) -> bool:
    """Whether a rerun of a finished job evaluates the run's `checkpoint` into it: the run lacks that
    evaluation (no READY LoggedModel of it: one is made READY once the metrics are in), and its
    scores on `datasets` would be the run's own (runs.takes_scores)."""
    if any(str(m.status) == "READY" for m in checkpoint_models(client, experiment_id, run.info.run_id,
                                                               checkpoint=checkpoint)):
        return False
    return takes_scores(client, run, datasets, refused=f"{checkpoint} is not evaluated into")


def update_best(client, experiment_id: str, run_id: str, metric: str):
    """Tag the run with its best checkpoint so far; returns that LoggedModel (None: none has `metric`)."""
    from mlflow.entities import RunTag

    ranked = [m for m in checkpoint_models(client, experiment_id, run_id, metric)
              if any(x.key == metric for x in m.metrics or [])]
    if not ranked:
        return None
    best = ranked[0]
    value = max(x.value for x in best.metrics if x.key == metric)
    client.log_batch(run_id, tags=[RunTag(BEST_CHECKPOINT_TAG, checkpoint_file(best)), RunTag(BEST_MODEL_TAG, best.model_id),
                                   RunTag(BEST_METRIC_TAG, f"{metric}={value:.6g}")])
    return best


def checkpoint_file(model) -> str:
    """model_iter{N}.pth or model_final.pth, from a checkpoint LoggedModel's tag."""
    return model.tags.get(CHECKPOINT_TAG, "").rsplit("/", 1)[-1]


def _name(checkpoint: str) -> str:
    return checkpoint.removesuffix(".pth")
