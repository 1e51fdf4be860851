"""The tracking agent: a helper process (child_process.py) that makes the job's MLflow calls.

Two reasons. MLflow's client spends milliseconds of Python on every call (measured here against a
local server: a 60-metric `log_batch` about 6 ms of CPU, 2 tags 3.5 ms, a 7.7 MB `log_artifact`
8 ms); made on a thread of the training process, that time is taken from the training thread, which
needs the same GIL. And importing MLflow takes 2-3 s of CPU: in the agent, it happens on another
core while the training process imports torch, and the run lookup and a resumed job's checkpoint
download follow it there.

A call is a module-level function `fn(client, *args)`, sent by reference with its arguments; the
agent runs it with its MlflowClient and answers with the result or the failure (its message, and
whether it is worth retrying). Retries, order and deadlines stay with the threads that call. If the
agent cannot start, or dies, the calls are made in the training process with a client of its own
(MLflow imported then); every call is safe to repeat. Nothing of MLflow is imported here at import
time: the agent first makes sure it dies with the job.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

from trainer.child_process import Helper, attach, recv, send
from trainer.logs import setup_logging

log = logging.getLogger("trainer.tracking")


class AgentError(Exception):
    """A call that failed in the agent: its message, and whether it is worth retrying."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def retryable(e: BaseException) -> bool:
    """Retry what a server that is down or overloaded causes; a request it rejects is final."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, AgentError):
        return e.retryable
    if isinstance(e, MlflowException):
        status = e.get_http_status_code()
        return status >= 500 or status == 429
    return not isinstance(e, (TypeError, ValueError, KeyError, AttributeError))


# What the background threads call; arguments are plain tuples, cheap to send.

def _log_batch(client, run_id: str, metrics=(), params=(), tags=()) -> None:
    from mlflow.entities import Metric, Param, RunTag

    client.log_batch(run_id, metrics=[Metric(*m) for m in metrics], params=[Param(*p) for p in params],
                     tags=[RunTag(*t) for t in tags], synchronous=True)


def _log_artifact(client, run_id: str, path: str, artifact_path: str | None) -> None:
    client.log_artifact(run_id, path, artifact_path)


def _set_terminated(client, run_id: str, status: str) -> None:
    client.set_terminated(run_id, status)


class TrackingCalls:
    """Calls made in the agent once it is started and ready, else with a client of this process."""

    def __init__(self, uri: str):
        self._uri, self._local = uri, None
        self._lock = threading.Lock()
        self._agent: Helper | None = None
        self._given_up = self._closed = False
        self._connections: list[socket.socket] = []
        self._mine = threading.local()  # this thread's connection to the agent
        self.by_agent = self.here = 0  # calls made by the agent, by this process

    def log_batch(self, run_id: str, metrics=(), params=(), tags=()) -> None:
        """metrics: (key, value, timestamp_ms, step) tuples; params and tags: (key, value)."""
        self.run(_log_batch, run_id, tuple(metrics), tuple(params), tuple(tags))

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.run(_log_artifact, run_id, path, artifact_path)

    def set_terminated(self, run_id: str, status: str) -> None:
        self.run(_set_terminated, run_id, status)

    @property
    def local(self):
        """This process's own MlflowClient, made (and MLflow imported) on first use."""
        if self._local is None:
            from mlflow import MlflowClient

            self._local = MlflowClient(tracking_uri=self._uri)
        return self._local

    def start_agent(self) -> None:
        """Start the agent (once); calls go to it once it has imported MLflow."""
        with self._lock:
            if self._agent is not None or self._given_up or self._closed:
                return
            try:
                self._agent = Helper("trainer.tracking_agent", self._uri)
            except OSError as e:
                self._given_up = True
                log.warning("tracking calls are made by the training process (%s)", e)

    @property
    def agent_pid(self) -> int | None:
        agent = self._agent
        return agent.pid if agent is not None else None

    def in_agent(self, timeout: float = 0.0) -> bool:
        """Whether calls now go to the agent (waiting up to `timeout` s for it to be ready)."""
        with self._lock:
            return self._agent_ready(timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            agent, self._agent = self._agent, None
            connections, self._connections = self._connections, []
        if agent is not None:
            agent.close(timeout)
        for sock in connections:
            sock.close()

    def run(self, fn, *args, wait: float = 0.0):
        """`fn(client, *args)` (a module-level function) in the agent, or here while it is not
        ready (waiting up to `wait` s for it first) or when it is gone."""
        if self._closed:
            raise RuntimeError("tracking is closed")
        sock = self._connection(wait)
        if sock is None:
            return self._here(fn, args)
        try:
            send(sock, (fn, args))
            reply, _ = recv(sock)
        except (EOFError, OSError) as e:
            self._lost(e)
            if self._closed:
                raise RuntimeError("tracking is closed") from None
            return self._here(fn, args)  # again: every call is safe to repeat
        self.by_agent += 1
        if reply[0] == "error":
            raise AgentError(reply[1], reply[2])
        return reply[1]

    def _here(self, fn, args: tuple):
        self.here += 1
        return fn(self.local, *args)

    def _connection(self, wait: float = 0.0) -> socket.socket | None:
        """This thread's connection to the agent, made on first use; None while there is no agent."""
        sock = getattr(self._mine, "sock", None)
        if sock is not None and not self._given_up:
            return sock
        with self._lock:
            if not self._agent_ready(wait):
                return None
            ours, theirs = socket.socketpair()
            try:
                send(self._agent.sock, "connect", fds=(theirs.fileno(),))
            except OSError as e:
                ours.close()
                self._give_up(e)
                return None
            finally:
                theirs.close()
            self._connections.append(ours)
        self._mine.sock = ours
        return ours

    def _agent_ready(self, timeout: float = 0.0) -> bool:
        """(Lock held.) Whether there is an agent and it is ready (waiting up to `timeout` s)."""
        if self._agent is None or self._given_up:
            return False
        try:
            if self._agent.ready(timeout):
                return True
            if self._agent.refused:  # it cannot use the URI: this process's client will say why
                self._give_up(None)
        except (EOFError, OSError) as e:  # it died starting
            self._give_up(e)
        return False

    def _lost(self, e: BaseException) -> None:
        with self._lock:
            if not self._given_up and not self._closed:
                self._give_up(e)

    def _give_up(self, e: BaseException | None) -> None:
        """(Lock held.) From now on the calls are made here."""
        self._given_up = True
        if self._agent is not None:
            self._agent.process.kill()
            code = self._agent.process.wait()
            if e is not None:
                log.warning("the tracking agent process ended (%s, exit code %s): tracking calls are made by "
                            "the training process from now on", type(e).__name__, code)


# ---- in the agent ----

def _serve(client, conn: socket.socket) -> None:
    """Perform each call sent on `conn`; answer with its result or with what went wrong."""
    while True:
        try:
            message, _ = recv(conn)
        except (EOFError, OSError):  # the job closed this connection
            return
        except Exception as e:  # noqa: BLE001 - a call this process cannot unpickle
            reply = _failure(e)
        else:
            fn, args = message
            try:
                reply = ("ok", fn(client, *args))
            except Exception as e:  # noqa: BLE001 - reported to the thread that asked
                reply = _failure(e)
        try:
            send(conn, reply)
        except OSError:
            return
        except Exception as e:  # noqa: BLE001 - a result that cannot be pickled
            send(conn, _failure(e))


def _failure(e: BaseException) -> tuple:
    return "error", str(e).strip() or type(e).__name__, retryable(e)


def main(argv: list[str]) -> None:
    control, (uri,) = attach(argv)
    setup_logging(logging.WARNING)  # MLflow's and urllib3's warnings, as the job shows them
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
    except Exception as e:  # noqa: BLE001 - a URI MLflow has no store for: the job says so, not us
        send(control, ("unusable", str(e)))
        os._exit(0)
    send(control, "ready")
    while True:
        try:
            message, fds = recv(control)
        except (EOFError, OSError):  # the job is gone
            return
        if message is None:  # every call was answered: nothing is left to flush
            os._exit(0)
        threading.Thread(target=_serve, args=(client, socket.socket(fileno=fds[0])), daemon=True).start()
