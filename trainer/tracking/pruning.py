"""TRACKING.CHECKPOINTS_KEEP: a run keeps its newest N complete `model_iter` checkpoints on the server.

Runs on the tracker's uploader thread after each checkpoint is uploaded and tagged complete. A
pass deletes at most PRUNE_BATCH and the next is queued behind the uploads that came meanwhile, so
a KEEP set late on a run of hundreds of checkpoints never holds a preemption's checkpoint long.

An older `model_iter` goes unless something still names it: the run's best-checkpoint tag, a
LoggedModel of the run, a registered version whose source is that file, or an evaluation not linked
yet. `model_final` and the checkpoint just uploaded always stay. The artifact goes before its sha256
tag, so a failed delete leaves the checkpoint whole (the next pass retries); a tag left behind is
reached by a resume only when every newer checkpoint fails its sha256, and the next pass removes it.
"""
from __future__ import annotations

import logging

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.tracking.checkpoint_models import BEST_CHECKPOINT_TAG
from trainer.tracking.runs import CHECKPOINT_DIR, CHECKPOINT_TAG, checkpoint_artifact, checkpoints_from, sha_tag
from trainer.tracking.search import every_page

log = logging.getLogger(__name__)

PRUNE_BATCH = 16  # deletes a pass: about a second against a server; its caller queues the next pass


def prune_run(client, repo, run_id: str, experiment_id: str, keep: int, evaluated: set[str],
              newest: float, limit: int = PRUNE_BATCH) -> tuple[list[str], bool]:
    """Delete the run's complete model_iter checkpoints past the newest `keep` up to `newest` (the
    one this process has just uploaded) that nothing names, the oldest `limit` of them; returns
    their names and whether more are left for another pass. keep 0 keeps all.
    A tag of a later iteration (a file that failed its sha256, a hand-made tag) is neither counted,
    which would delete each checkpoint this job uploads as it arrives, nor deleted: it is the user's."""
    if keep <= 0:
        return [], False
    tags = client.get_run(run_id).data.tags
    ours = [n for n in checkpoints_from(tags) if n != FINAL and iteration_of(n) <= newest]
    older = ours[keep:]  # newest first: the one just uploaded is never here
    doomed = [n for n in older if n not in evaluated and n != tags.get(BEST_CHECKPOINT_TAG)]
    if doomed:
        named = _named_by_models(client, experiment_id, run_id) | _registered(client, run_id)
        doomed = [n for n in doomed if n not in named]
    batch = doomed[::-1][:limit]  # oldest first
    for name in batch:
        repo.delete_artifacts(checkpoint_artifact(name))  # the proxy: DELETE mlflow-artifacts; S3, disk: directly
        _delete_tag(client, run_id, sha_tag(name))
        log.info("deleted %s from the run (TRACKING.CHECKPOINTS_KEEP %d)", name, keep)
    return batch, len(doomed) > len(batch)


def _named_by_models(client, experiment_id: str, run_id: str) -> set[str]:
    """Checkpoint files that a LoggedModel of the run points at (its tracktron.checkpoint tag)."""
    models = every_page(client.search_logged_models, experiment_ids=[experiment_id],
                        filter_string=f"source_run_id = '{run_id}'")
    return {m.tags[CHECKPOINT_TAG].rsplit("/", 1)[-1] for m in models if CHECKPOINT_TAG in (m.tags or {})}


def _registered(client, run_id: str) -> set[str]:
    """Checkpoint files that a registered model version of the run has as its source."""
    versions = every_page(client.search_model_versions, filter_string=f"run_id = '{run_id}'")
    return {v.source.rstrip("/").rsplit("/", 1)[-1] for v in versions
            if f"/{CHECKPOINT_DIR}/" in (v.source or "")}


def _delete_tag(client, run_id: str, key: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_tag(run_id, key)
    except MlflowException as e:  # gone already: a retry after the artifact went
        if "RESOURCE_DOES_NOT_EXIST" not in str(e.error_code):
            raise
