"""Helper processes of a training job (the checkpoint writer, the tracking agent, the system
metrics monitor): how they are started, how they die with the job, and the messages between them
and the job.

A helper is `python -c '...main(["PARENT_PID", "SOCKET_FD", "main"|"thread", ...])'` in a session of
its own: a Ctrl-C or a group SIGTERM is the job's to handle, and the job may still need its helpers
to write and upload its preemption checkpoint. Messages on the socket are length-prefixed pickles
between two processes of the same job; file descriptors can come with a message. This module
imports nothing heavy, so a helper makes sure it dies with the job before it imports torch or MLflow.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

_HEADER = struct.Struct("!Q")


class Helper:
    """A helper process (`module.main(argv)`, started now) and our end of its socket. Its first
    message says whether it is ready (it is importing torch or MLflow meanwhile)."""

    def __init__(self, module: str, *args: str):
        ours, theirs = socket.socketpair()
        code = f"import sys; from {module} import main; main(sys.argv[1:])"
        # Linux kills it with the thread that started it: with the job, if that is the main thread
        main = threading.current_thread() is threading.main_thread()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # imports as ours do
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(os.getpid()), str(theirs.fileno()), "main" if main else "thread",
                 *args], pass_fds=[theirs.fileno()], start_new_session=True, env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        self._greeting = None  # its first message: "ready", or why it cannot be

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether it has said it is ready (waiting up to `timeout` s for that); EOFError or OSError
        when it died first."""
        if self._greeting is None:
            self.sock.settimeout(timeout)
            try:
                self._greeting = recv(self.sock)[0]
            except (socket.timeout, BlockingIOError):
                return False
            finally:
                self.sock.settimeout(None)
        return self._greeting == "ready"

    @property
    def refused(self) -> bool:
        """It answered that it cannot do its work (and has exited)."""
        return self._greeting not in (None, "ready")

    def close(self, timeout: float) -> None:
        """Ask it to end (a None message), kill it if it has not within `timeout` s."""
        try:
            send(self.sock, None)
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()


def attach(argv: list[str]) -> tuple[socket.socket, list[str]]:
    """In the helper: die with the job from now on; (the socket to the job, the remaining args)."""
    parent, fd = int(argv[0]), int(argv[1])
    _die_with(parent, argv[2] == "main")
    return socket.socket(fileno=fd), argv[3:]


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
    if not header:
        raise EOFError("the other process closed the socket")
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
    that started us ends), else within 50 ms (the way DataLoader workers watch theirs)."""
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
