"""A run's checkpoints on their way to the tracking server, in order, on the Uploader's thread: which
ones to send (a newer one supersedes an older one not yet sent), when one is complete (its metrics,
then its bytes, then its tags), and pruning the run's older ones (TRACKING.CHECKPOINTS_KEEP).

Pruning keeps the run's newest N complete `model_iter` checkpoints. A pass deletes at most
PRUNE_BATCH and the next is queued behind the uploads that came meanwhile, so a KEEP set late on a
run of hundreds of checkpoints never holds a preemption's checkpoint long. An older `model_iter`
goes unless something still names it: the run's best-checkpoint tag, a LoggedModel of the run, a
registered version whose source is that file, or an evaluation not linked yet. `model_final` and
the checkpoint just uploaded always stay. The artifact goes before its sha256 tag, so a failed
delete leaves the checkpoint whole (the next pass retries); a tag left behind is reached by a resume
only when every newer checkpoint fails its sha256, and the next pass removes it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.errors import first_line
from trainer.tracking.checkpoint_models import BEST_CHECKPOINT_TAG
from trainer.tracking.runs import CHECKPOINT_DIR, CHECKPOINT_TAG, LATEST_TAG, checkpoint_artifact, checkpoints_from, sha_tag
from trainer.tracking.search import every_page
from trainer.tracking.transfers import file_identity, upload as upload_file

log = logging.getLogger(__name__)

PRUNE_JOB = "prune older checkpoints on the server"  # never a failure: what it would delete stays
UPLOAD_JOB = "upload checkpoint "  # + the file's name: the Uploader's description of the job
METRICS_WAIT_S = 60.0  # for the metrics of a checkpoint's iterations, before its upload counts as failed
PRUNE_BATCH = 16  # deletes a pass: about a second against a server; its caller queues the next pass


@dataclass
class Destination:
    """Where the tracker sends a checkpoint, each asked for when an upload runs (the run is opened,
    and the artifact repository made, on other threads)."""
    client: Callable[[], Any]  # MLflow's client
    run_id: Callable[[], str]
    artifacts: Callable[[], Any]  # the run's artifact repository
    experiment_id: Callable[[], str]
    metrics_sent: Callable[[float, float], bool]  # (iteration, timeout): its metrics are on the server


class CheckpointUploads:
    def __init__(self, uploader, keep_on_server: int, to: Destination):
        self._uploader, self._keep, self._to = uploader, keep_on_server, to
        self._newest = self._newest_uploaded = -1.0  # handed to submit(); tagged complete on the server
        self.uploaded: set[str] = set()  # checkpoint files this process put on the server
        self.evaluated: set[str] = set()  # checkpoints evaluated: uploaded even when superseded
        self._queued: set[str] = set()  # checkpoint files whose upload has not succeeded or been skipped

    def submit(self, path: Path, sha256: str) -> None:
        """Queue `path`'s upload; `sha256` is its bytes' as written."""
        iteration, written = iteration_of(path.name), file_identity(path)  # the file its upload must still find
        self._newest = max(self._newest, iteration)
        self._queued.add(path.name)
        self._uploader.submit(UPLOAD_JOB + path.name, lambda: self._upload(path, iteration, written, sha256))

    def _upload(self, path: Path, iteration: float, written, sha256: str) -> None:
        from mlflow.entities import RunTag

        # Complete means resumable without a hole: the metrics of every iteration it holds are on
        # the server too, or a job killed now would resume past unsent points. They go first (not
        # after the file): a job killed during the upload keeps them as well. A newer checkpoint
        # written meanwhile (a slow server) makes this one's bytes needless: its own upload sends them.
        if self._skipped(path.name):
            return
        sent = self._to.metrics_sent(iteration, METRICS_WAIT_S)
        if self._skipped(path.name):
            return
        if not sent:
            raise TimeoutError(f"metrics up to {path.name} not delivered yet")
        upload_file(self._to.artifacts(), path, CHECKPOINT_DIR, written)  # still that file; parts, timeouts: transfers.py
        # The tags say "complete": set only after the bytes are on the artifact store.
        self._to.client().log_batch(self._to.run_id(), tags=[RunTag(sha_tag(path.name), sha256),
                                                             RunTag(LATEST_TAG, path.name)])
        self._newest_uploaded = max(self._newest_uploaded, iteration)
        self.uploaded.add(path.name)
        self._queued.discard(path.name)
        if self._keep > 0:  # a job of its own: a slow or failing delete is no failed upload
            self._uploader.submit(PRUNE_JOB, self._prune)

    def _skipped(self, name: str) -> bool:
        """Whether a newer checkpoint supersedes `name` (an evaluated one is sent all the same: its model
        is linked to it); if so it leaves the queue, said once."""
        if iteration_of(name) >= self._newest or name in self.evaluated:
            return False
        if name in self._queued:
            log.info("not uploading %s: a newer checkpoint supersedes it", name)
            self._queued.discard(name)
        return True

    def uploading(self) -> set[str]:  # list(): a copy, the uploader thread changes the set
        """The checkpoints still to be sent (not the superseded ones): the local pruning spares them."""
        return {n for n in list(self._queued) if n in self.evaluated or iteration_of(n) >= self._newest}

    def lost(self, failed: list[str]) -> list[str]:
        """Of the Uploader's failed jobs, those that lost something. A checkpoint lost nothing when a
        newer one reached the server, or failed too and is named instead: the job's next start sends
        its newest, and only that (an older one evaluated meanwhile keeps its scores, logged without
        a model, as its warning said)."""
        names = {d: n for d in failed if (n := d.removeprefix(UPLOAD_JOB)) != d}
        newest = max([self._newest_uploaded, *(iteration_of(n) for n in names.values())])
        return [d for d in failed if d not in names or iteration_of(names[d]) >= newest]

    def _prune(self) -> None:
        """TRACKING.CHECKPOINTS_KEEP, once a checkpoint is complete: a failure costs disk space only (logged)."""
        newest = max((iteration_of(n) for n in list(self.uploaded) if n != FINAL), default=-1)  # this job's own
        try:
            gone, more = prune_run(self._to.client(), self._to.artifacts(), self._to.run_id(), self._to.experiment_id(),
                                   self._keep, self.evaluated, newest)
        except Exception as e:  # the server refused or failed a delete: everything is still there
            log.warning("tracking: older checkpoints stay on the server for now: %s", first_line(e, 300))
            return
        self.uploaded.difference_update(gone)
        if more:  # the next pass goes behind what was queued meanwhile (a preemption's checkpoint)
            self._uploader.submit(PRUNE_JOB, self._prune)


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
