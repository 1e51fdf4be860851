"""The checkpoint-writer process: writes the checkpoints the training process copies into shared
memory (see checkpoint_writer.py), so that torch.save runs on a GIL of its own.

A helper process of the job (child_process.py); a new shared buffer (a memfd) comes with its message
as a passed file descriptor. This module imports no torch until the process has made sure it dies
with the job, so a job killed at once leaves no writer behind. A write in progress when the job dies
is left as a temporary file whose process is gone, which the next job removes, as when the job
wrote it itself.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from trainer.child_process import attach, recv, send


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the state: its index in the shared buffer's list of tensors."""

    index: int


_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})


def map_leaves(obj, fn):
    """`obj` (dicts, lists and tuples of anything) with `fn` applied to every other value; `fn`
    must leave plain values (numbers, strings, None) as they are."""
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _PLAIN:  # Python's RNG state (625 ints), parameter indices: at C speed
            return obj if isinstance(obj, tuple) else type(obj)(obj)
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def join(obj, tensors: list):
    """The state again: every Slot replaced by its tensor."""
    return map_leaves(obj, lambda x: tensors[x.index] if isinstance(x, Slot) else x)


def views(buffer, specs: list) -> list:
    """The tensors laid out in `buffer` (a uint8 tensor) by `specs`: (offset, dtype, shape) each."""
    return [buffer[o:o + s.numel() * d.itemsize].view(d).view(s) for o, d, s in specs]


def serve(sock: socket.socket) -> None:
    """Write each checkpoint sent; answer with its sha256, or with what went wrong."""
    import mmap

    import torch

    from trainer.checkpoint import CheckpointWriteError, save_atomic

    send(sock, "ready")
    tensors: list = []
    while True:
        try:
            message, fds = recv(sock)
        except (EOFError, OSError):  # the job is gone
            return
        if message is None:
            return
        skeleton, path, shared = message
        if fds:  # a new buffer: its memfd, size and layout
            size, specs = shared
            buffer = torch.frombuffer(mmap.mmap(fds[0], size), dtype=torch.uint8)
            os.close(fds[0])
            tensors = views(buffer, specs)
        try:
            # A storage per tensor, as torch.save in the job would write them (views of the one
            # buffer would each be saved as the whole buffer).
            send(sock, ("ok", save_atomic(join(skeleton, [t.clone() for t in tensors]), Path(path))))
        except CheckpointWriteError as e:
            send(sock, ("disk", e.errno, e.strerror, e.free))
        except Exception as e:  # noqa: BLE001 - reported to the job, which raises it
            send(sock, ("error", f"{type(e).__name__}: {e}"))


def main(argv: list[str]) -> None:
    sock, _ = attach(argv)
    serve(sock)
