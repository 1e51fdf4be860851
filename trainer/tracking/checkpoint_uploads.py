"""A run's checkpoints on their way to the tracking server, in order, on the Uploader's thread: which
ones to send (a newer one supersedes an older one not yet sent), when one is complete (its metrics,
then its bytes, then its tags), and pruning the run's older ones (TRACKING.CHECKPOINTS_KEEP)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.errors import first_line
from trainer.tracking.pruning import prune_run
from trainer.tracking.runs import CHECKPOINT_DIR, LATEST_TAG, sha_tag
from trainer.tracking.transfers import file_identity, upload as upload_file

log = logging.getLogger(__name__)

PRUNE_JOB = "prune older checkpoints on the server"  # never a failure: what it would delete stays
UPLOAD_JOB = "upload checkpoint "  # + the file's name: the Uploader's description of the job
METRICS_WAIT_S = 60.0  # for the metrics of a checkpoint's iterations, before its upload counts as failed


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
