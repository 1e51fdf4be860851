"""The checkpoint-writer process: writes the checkpoints the training process copies into shared
memory (see checkpoint_writer.py), so that torch.save runs on a GIL of its own.

Started by the job as `python -c '...main(["PARENT_PID", "SOCKET_FD"])'`, in a session of its own (a
Ctrl-C or a group SIGTERM is the job's to handle, and it may still need this process to write its
preemption checkpoint). Messages on the
socket are length-prefixed pickles between two processes of the same job; a new shared buffer (a
memfd) comes with its message as a passed file descriptor. This module imports no torch until the
process has made sure it dies with the job, so a job killed at once leaves no writer behind.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_HEADER = struct.Struct("!Q")


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the state: its index in the shared buffer's list of tensors."""

    index: int


def map_leaves(obj, fn):
    """`obj` (dicts, lists and tuples of anything) with `fn` applied to every other value."""
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def join(obj, tensors: list):
    """The state again: every Slot replaced by its tensor."""
    return map_leaves(obj, lambda x: tensors[x.index] if isinstance(x, Slot) else x)


def views(buffer, specs: list) -> list:
    """The tensors laid out in `buffer` (a uint8 tensor) by `specs`: (offset, dtype, shape) each."""
    return [buffer[o:o + s.numel() * d.itemsize].view(d).view(s) for o, d, s in specs]


def send(sock: socket.socket, obj, fds: tuple = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def recv(sock: socket.socket) -> tuple[object, list[int]]:
    """(the object, the file descriptors that came with it); EOFError when the other end is gone."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    header += _exactly(sock, _HEADER.size - len(header))
    return pickle.loads(_exactly(sock, _HEADER.unpack(header)[0])), fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other process closed the socket")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _die_with(parent: int, started_by_main_thread: bool) -> None:
    """Killed with the job at once where Linux can (PR_SET_PDEATHSIG, which comes when the thread
    that started us ends), else within 50 ms (the way DataLoader workers watch theirs): a write in
    progress is left as a temporary file whose process is gone, which the next job removes, as when
    the job wrote it itself."""
    if started_by_main_thread and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.05)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


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
    parent, fd = int(argv[0]), int(argv[1])
    _die_with(parent, argv[2] == "main")
    serve(socket.socket(fileno=fd))
