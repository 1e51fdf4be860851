"""Checkpoints written on a background thread: the training thread only makes a host copy, then
goes on while torch.save, fsync, the sha256 and the rename happen here (state.save_atomic)."""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Callable

from trainer.checkpoint.state import save_atomic, to_cpu

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes checkpoints one at a time, in order, on its own thread.

    `submit` copies the state to host memory and returns; it waits only while an earlier checkpoint
    is still queued. `on_saved(path, sha256)` runs on the writer thread once each file is complete.
    A write error is kept and raised on the training thread at the next `submit()`, `wait()` or
    `close()`, so a full disk stops the job instead of being lost.
    """

    def __init__(self, on_saved: Callable[[Path, str], None] | None = None):
        self._on_saved = on_saved
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, state: dict, path: Path) -> None:
        self._raise_pending()
        self._queue.put((to_cpu(state), path))

    def wait(self) -> None:
        """Until every checkpoint submitted so far is written (and handed on)."""
        self._queue.join()
        self._raise_pending()

    def close(self, raise_errors: bool = True) -> None:
        """Finish what was submitted, then stop the thread; a checkpoint is never left torn."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if raise_errors:
            self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            state, path = item
            try:
                digest = save_atomic(state, path)
                log.info("wrote checkpoint %s", path)
                if self._on_saved:
                    self._on_saved(path, digest)
            except BaseException as e:  # surfaced on the training thread
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()
