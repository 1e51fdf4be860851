"""A run's checkpoint downloaded and checked against its sha256 tag (`download_verified`), and a
resumed job's newest one downloading from the moment the lookup found the run (`Prefetch`).

The prefetch overlaps torch's import, the job's checks and the model build, reads only (the run is
not touched), and lands in a hidden folder of OUTPUT_DIR that no one takes for a checkpoint; the
resume moves it into place, anything else drops it.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from trainer.checkpoint.files import FINAL, download_folder, drop_download_folder, iteration_of, local_checkpoints
from trainer.checkpoint.state import CheckpointError
from trainer.errors import first_line
from trainer.tracking.runs import checkpoint_artifact, checkpoints_from, sha_tag
from trainer.tracking.transfers import download, repository

log = logging.getLogger(__name__)


def download_verified(repo, name: str, folder: Path, expected: str | None) -> tuple:
    """(path, None) once checkpoints/<name> of the run whose artifact repository is `repo` is in
    `folder` and matches its sha256 tag; (None, why) when it cannot be downloaded. Bytes that are
    not the tagged ones raise CheckpointError: that checkpoint is bad, not merely out of reach."""
    try:
        path, sha256 = download(repo, checkpoint_artifact(name), folder)
    except Exception as e:  # a missing or unreadable artifact: the caller tries an older one
        return None, f"could not download checkpoint {name}: {first_line(e)}"
    if sha256 != expected:
        raise CheckpointError(f"checkpoint {name} from the tracking server does not match its sha256 tag")
    return path, None


class Prefetch:
    """One checkpoint downloading on a thread of its own into a hidden folder; `result()` waits for it."""

    def __init__(self, repo, name: str, expected: str, output_dir: Path):
        self.name, self.expected = name, expected  # the sha256 tag when it started
        self.folder = download_folder(output_dir)
        self._done: Future = Future()
        self._dropped = False
        threading.Thread(target=self._download, args=(repo,), name="checkpoint-prefetch",
                         daemon=True).start()

    @classmethod
    def newest(cls, tracking_uri: str, run, output_dir: Path) -> Prefetch | None:
        """The run's newest complete checkpoint, when it is newer than every local one."""
        names = checkpoints_from(run.data.tags)
        local = local_checkpoints(output_dir)
        if not names or names[0] == FINAL or iteration_of(names[0]) <= (iteration_of(local[0].name) if local else -1):
            return None
        return cls(repository(run.info.artifact_uri, tracking_uri), names[0], run.data.tags[sha_tag(names[0])],
                   output_dir)

    def result(self) -> Path | None:
        return self._done.result()

    def drop(self) -> None:
        self._dropped = True
        drop_download_folder(self.folder)

    def _download(self, repo) -> None:
        try:
            path, why = download_verified(repo, self.name, self.folder, self.expected)
            if why and not self._dropped:  # a dropped one fails as its folder goes: nothing to report
                log.warning("%s", why)
            self._done.set_result(path)
        except BaseException as e:  # handed to whoever asks for the result
            self._done.set_exception(e)
        if self._dropped:  # dropped while it ran: MLflow may have made the folder again
            drop_download_folder(self.folder)
