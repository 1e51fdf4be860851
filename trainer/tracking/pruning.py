"""TRACKING.CHECKPOINTS_KEEP: a run keeps its newest N complete `model_iter` checkpoints on the server.

Called on the tracker's uploader thread right after a checkpoint is uploaded and tagged complete.
A pass deletes PRUNE_BATCH at most, and the tracker queues the next one behind the uploads that
came meanwhile: a KEEP set late on a run of hundreds of checkpoints never holds a preemption's
checkpoint for more than one pass.

An older `model_iter` goes (its artifact, then its sha256 tag) unless something still names it:
the run's best-checkpoint tag, a LoggedModel of the run (an evaluated checkpoint), a registered
model version whose source is that file, or an evaluation of this process not linked yet.
`model_final` and the checkpoint just uploaded always stay; a tag of a later iteration than that
(a checkpoint the job could not resume from, or a hand-made tag) is neither counted nor deleted.
The artifact goes before its tag, so a delete that fails leaves the checkpoint whole and complete
(the next upload tries again); a tag whose own delete failed names an old checkpoint that a resume
(newest first) reaches only when every newer one fails its sha256, and the next pruning, which
starts from the tags, removes it.
"""
from __future__ import annotations

import logging

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.tracking.checkpoint_models import BEST_TAGS
from trainer.tracking.runs import CHECKPOINT_TAG, checkpoints_from, sha_tag
from trainer.tracking.search import every_page

log = logging.getLogger(__name__)

PRUNE_BATCH = 16  # deletes a pass: about a second against a server; its caller queues the next pass


def prune_run(client, repo, run_id: str, experiment_id: str, keep: int, evaluated: set[str],
              newest: float, limit: int = PRUNE_BATCH) -> tuple[list[str], bool]:
    """Delete the run's complete model_iter checkpoints past the newest `keep` up to `newest` (the
    one this process has just uploaded) that nothing names, the oldest `limit` of them; returns
    their names and whether more are left for another pass. keep 0 keeps all.
    A tag of a later iteration is no newer checkpoint of this job: one whose file failed its sha256
    (the job went on from an earlier one), or a hand-made tag; counted first, it had every checkpoint
    this job uploaded deleted as it arrived. Such a tag is left to the user."""
    if keep <= 0:
        return [], False
    tags = client.get_run(run_id).data.tags
    ours = [n for n in checkpoints_from(tags) if n != FINAL and iteration_of(n) <= newest]
    older = ours[keep:]  # newest first: the one just uploaded is never here
    doomed = [n for n in older if n not in evaluated and n != tags.get(BEST_TAGS[0])]
    if doomed:
        named = _named_by_models(client, experiment_id, run_id) | _registered(client, run_id)
        doomed = [n for n in doomed if n not in named]
    batch = doomed[::-1][:limit]  # oldest first
    for name in batch:
        repo.delete_artifacts(f"checkpoints/{name}")  # the proxy: DELETE mlflow-artifacts; S3, disk: directly
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
            if "/checkpoints/" in (v.source or "")}


def _delete_tag(client, run_id: str, key: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_tag(run_id, key)
    except MlflowException as e:  # gone already: a retry after the artifact went
        if "RESOURCE_DOES_NOT_EXIST" not in str(e.error_code):
            raise
