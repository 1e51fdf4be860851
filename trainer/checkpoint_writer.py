"""Writing checkpoints so that training hardly notices: one host copy on the training thread.

torch.save holds the GIL for most of its work (pickling, CRC-32s, the writes), so a writer *thread*
delays the training thread's Python by about as long as the save takes (measured: a demo iteration
went from 135 to 256 ms while saves ran back to back on a thread). So the file is written by a
child process instead (checkpoint_process.py). The training thread copies the state's tensors into
one shared buffer (a memfd: anonymous shared memory, not bounded by /dev/shm's size; allocated at
the first checkpoint and reused while the tensors keep their shapes, as big as they are) and queues
the rest (iteration, config, RNG states); the writer thread sends that to the child and waits,
holding no GIL, for the file's sha256. Then `on_saved(path, sha256)` runs on the writer thread (the
tracker hands the file to its uploader).

The child writes the bytes `save_atomic` would write here. It is started at the first checkpoint;
until it is ready (has imported torch), and wherever it cannot be used (no memfd outside Linux, no
memory for the buffer, the child died), the thread writes, as before.
"""
from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointWriteError, save_atomic, to_cpu
from trainer.checkpoint_process import Slot, join, map_leaves, views
from trainer.child_process import Helper, recv, send

log = logging.getLogger("trainer.checkpoint")

_ALIGN = 64  # bytes: every tensor of the buffer starts aligned for any dtype (and vector loads)


def _split(obj, tensors: list):
    """`obj` with every dense tensor moved to `tensors` and replaced by its Slot (sparse or
    quantized ones, which a state dict hardly ever has, stay in place as host copies)."""
    def slot(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.layout != torch.strided or x.is_quantized:
            return to_cpu(x)
        tensors.append(x)
        return Slot(len(tensors) - 1)

    return map_leaves(obj, slot)


class SharedMemoryError(RuntimeError):
    """No memory for the shared buffer (a memory cgroup's limit, say)."""


class SharedState:
    """The host copy of the state's tensors, in one shared buffer (a memfd) that the child maps."""

    def __init__(self):
        self.specs: list = []  # (offset, dtype, shape) per tensor
        self.tensors: list[torch.Tensor] = []
        self.fd: int | None = None
        self.size = 0

    def copy_in(self, state: dict) -> tuple[object, bool]:
        """(the state with its tensors replaced by slots, whether the buffer was reallocated)."""
        found: list = []
        skeleton = _split(state, found)
        layout = [(t.dtype, t.shape) for t in found]
        new = layout != [(d, s) for _, d, s in self.specs]
        if new:
            self._allocate(layout)
        with torch.no_grad():
            try:  # one call, not one per tensor (500 in the demo)
                torch._foreach_copy_(self.tensors, found)
            except (RuntimeError, NotImplementedError):  # no tensors, or devices its kernel will not mix
                for dst, src in zip(self.tensors, found):
                    dst.copy_(src)
        return skeleton, new

    def _allocate(self, layout: list) -> None:
        specs, offset = [], 0
        for dtype, shape in layout:
            specs.append((offset, dtype, shape))
            offset += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.close()  # the old buffer goes first
        size = max(offset, 1)
        fd = os.memfd_create("tracktron-checkpoint", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)  # the memory now, or ENOSPC now (not SIGBUS later)
            buffer = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        except OSError as e:
            os.close(fd)
            raise SharedMemoryError(f"{size / 2**20:.0f} MiB: {e.strerror or e}") from e
        self.fd, self.size, self.specs, self.tensors = fd, size, specs, views(buffer, specs)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the mapping stays while tensors use it
        self.fd, self.size, self.specs, self.tensors = None, 0, [], []


# ---- the child ----

class _Child(Helper):
    """The checkpoint-writer process: until it is ready (has imported torch) the thread writes, so
    that a job's first checkpoint is not seconds late."""

    def __init__(self):
        super().__init__("trainer.checkpoint_process")

    def save(self, skeleton, path: Path, shared: SharedState, new_buffer: bool) -> str:
        if new_buffer:
            send(self.sock, (skeleton, str(path), (shared.size, shared.specs)), fds=(shared.fd,))
        else:
            send(self.sock, (skeleton, str(path), None))
        reply, _ = recv(self.sock)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "disk":
            error = CheckpointWriteError(path, OSError(reply[1], reply[2]))
            error.free = reply[3]
            raise error
        raise RuntimeError(f"writing checkpoint {path}: {reply[1]}")


# ---- the writer ----

@dataclass
class _Job:
    state: object  # host copies (the thread writes), or the skeleton whose tensors are in the buffer
    path: Path
    in_child: bool = False
    new_buffer: bool = False  # the child is to map a new buffer first


class CheckpointWriter:
    """Writes checkpoints in the background, one at a time, in order.

    `submit` copies the state to host memory and returns; it waits only while the previous
    checkpoint is still being written. `on_saved(path, sha256)` runs on the writer thread after
    each file is complete. A write error is kept and re-raised on the training thread at the next
    `submit()` or at `close()`, so a full disk stops the job instead of being lost.
    `in_child=False`: the thread in this process writes (also the child's fallback).
    """

    def __init__(self, on_saved=None, in_child: bool = True):
        self._on_saved = on_saved
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._child: _Child | None = None
        self._start_child = in_child and hasattr(os, "memfd_create")  # at the first checkpoint
        self._shared = SharedState()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, state: dict, path: Path) -> None:
        """The first checkpoint starts the child (started earlier, its import of torch would slow
        a resume on a small machine) and is written by the thread; the next ones by the child."""
        self._raise_pending()
        self._maybe_start_child()
        if self._child is not None:
            self._queue.join()  # the shared buffer holds the previous checkpoint until it is written
            self._raise_pending()
        self._queue.put(self._host_copy(state, path))

    def wait(self) -> None:
        self._queue.join()
        self._raise_pending()

    def in_child(self, timeout: float = 0.0) -> bool:
        """Whether checkpoints now go to the child process (starting it if it is not, and waiting up
        to `timeout` s for it to be ready)."""
        self._maybe_start_child()
        return self._child is not None and self._child_ready(timeout)

    def _maybe_start_child(self) -> None:
        if self._start_child:
            self._start_child = False
            try:
                self._child = _Child()
            except OSError as e:  # no process can be started: the thread writes
                log.warning("checkpoints are written by a thread of the training process (%s)", e)

    @property
    def child_pid(self) -> int | None:
        """The writer process's pid (a session of its own), None when the thread writes."""
        child = self._child
        return child.pid if child is not None else None

    def close(self, raise_errors: bool = True) -> None:
        if self._thread.is_alive():
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
        self._stop_child()
        if raise_errors:
            self._raise_pending()

    def _host_copy(self, state: dict, path: Path) -> _Job:
        if self._child is not None and self._child_ready():
            try:
                skeleton, new = self._shared.copy_in(state)
                return _Job(skeleton, path, in_child=True, new_buffer=new)
            except SharedMemoryError as e:
                log.warning("no memory for the checkpoint's shared buffer (%s): checkpoints are written by a "
                            "thread of the training process", e)
                self._stop_child()
        return _Job(to_cpu(state), path)

    def _child_ready(self, timeout: float = 0.0) -> bool:
        try:
            return self._child.ready(timeout)
        except (EOFError, OSError):  # it died starting
            self._stop_child()
            return False

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.close(timeout=10)
        self._shared.close()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                digest = self._write(job)
                log.info("wrote checkpoint %s", job.path)
                if self._on_saved:
                    self._on_saved(job.path, digest)
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, job: _Job) -> str:
        if not job.in_child:
            return save_atomic(job.state, job.path)
        try:
            return self._child.save(job.state, job.path, self._shared, job.new_buffer)
        except CheckpointWriteError:
            raise
        except (EOFError, OSError) as e:  # the child died (killed, out of memory): we write it
            child, state = self._child, join(job.state, [t.clone() for t in self._shared.tensors])
            self._stop_child()
            log.warning("the checkpoint writer process ended (%s, exit code %s): checkpoints are written by "
                        "a thread of the training process from now on", type(e).__name__, child.process.returncode)
            return save_atomic(state, job.path)
