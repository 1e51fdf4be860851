"""Batches pulled ahead on a background thread and moved to the device, so the loop rarely waits."""
from __future__ import annotations

import contextlib
import queue
import threading

import torch

from trainer.data.images import as_float
from trainer.data.workers import map_tensors, worker_error


class Prefetcher:
    """Pulls (images, targets) batches on a background thread into a bounded queue, moved to `device`
    on the way and the images made float there."""

    def __init__(self, batches, device=None, depth: int = 2):
        self._source = batches
        self._it = iter(batches)  # here, so loader workers fork before our thread exists
        self._device = torch.device(device) if device is not None else None
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._end = None  # the exception that ended the stream, raised again on every next()
        self._thread = threading.Thread(target=self._run, name="prefetcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                images, targets = next(self._it)  # uint8 images become float on the device, off the training thread
                images = [as_float(_to_device(im, self._device)) for im in images]
                self._put((True, (images, _to_device(targets, self._device))))
        except BaseException as e:  # handed to the consumer, who re-raises it
            self._put((False, worker_error(e)))

    def _put(self, item) -> None:
        while not self._stop.is_set():  # a timeout, so close() is never stuck behind a full queue
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.05)
                return

    def next(self):
        while self._end is None:
            if self._stop.is_set():
                raise RuntimeError("Prefetcher is closed")
            try:
                ok, value = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if ok:
                return value
            self._end = value
        raise self._end

    __next__ = next

    def __iter__(self):
        return self

    def qsize(self) -> int:
        """Detectron's `mb_qsize`: how many ready minibatches wait for the training thread."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the thread and the loader's worker processes; returns within about two seconds."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(queue.Empty):  # free the ready batches (and pinned memory)
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=0.5)
        shutdown = getattr(self._it, "_shutdown_workers", None)  # a DataLoader iterator
        if shutdown is not None:
            shutdown()
            self._thread.join(timeout=1.0)  # the thread may have been waiting on a worker
        if getattr(self._source, "_iterator", None) is self._it:  # persistent workers keep a reference
            self._source._iterator = None
        self._it = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _to_device(obj, device):
    if device is None:
        return obj
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), obj)  # the same tensor when already there
