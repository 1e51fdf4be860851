"""SIGTERM/SIGINT handling: finish the iteration, checkpoint it, then stop.

Kubernetes sends SIGTERM and waits terminationGracePeriodSeconds (30 s by default) before
SIGKILL; a preemptible VM gives about as long. The first signal only sets a flag that the loop
checks between iterations; a second one exits at once.

The first signal also arms a deadline: whatever the process is still doing when TRAIN.PREEMPT_GRACE_S
is over (an upload to a server that stopped answering, a collective that waits for a dead rank,
interpreter shutdown), it exits then with 128 + the signal number. The checkpoint, written first,
is complete by then or not renamed into place at all.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

EXIT_MARGIN_S = 0.2  # the hard exit comes this long before the deadline


class Preempted(Exception):
    """Raised by the engine after the preemption checkpoint is safe."""

    def __init__(self, signum: int, deadline: float):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.deadline = deadline  # time.monotonic() by which the process must be gone


class StopRequested(BaseException):
    """A signal outside the training loop (set-up, the final evaluation): there is no iteration to
    finish, so the job stops where it is. A BaseException, so that no `except Exception` on the way
    (a tracking call that turns errors into one line) takes it for a fault."""

    def __init__(self, signum: int, deadline: float):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.deadline = deadline


class _OnSignal:
    """SIGTERM and SIGINT handlers for a `with` block (main thread only). The first signal arms the
    grace deadline and calls `_first`; a second one exits at once. Once a signal came, the handlers
    stay after the block, so a second signal during the preemption upload or the flush still exits."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.deadline = float("inf")
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        if self.signum is None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:
            os.write(2, b"second signal: exiting now\n")
            os._exit(128 + signum)
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        _exit_at(self.deadline - EXIT_MARGIN_S, signum, self.grace_s)
        self._first(signum)

    def _first(self, signum: int) -> None:
        raise NotImplementedError


class StopOnSignal(_OnSignal):
    """Around the whole job: outside the loop, a signal stops it where it is (StopRequested)."""

    def _first(self, signum: int) -> None:
        raise StopRequested(signum, self.deadline)


class PreemptionGuard(_OnSignal):
    """Around the loop: a signal sets a flag that the loop checks between iterations."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def preempted(self) -> Preempted:
        return Preempted(self.signum or signal.SIGTERM, min(self.deadline, time.monotonic() + self.grace_s))

    def _first(self, signum: int) -> None:
        log.warning("%s received: finishing this iteration, then checkpointing and stopping",
                    signal.Signals(signum).name)


def _exit_at(when: float, signum: int, grace_s: float) -> None:
    """A daemon thread that ends the process at `when` (time.monotonic()) unless it ended before."""
    def watchdog():
        while (left := when - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
        os.write(2, f"grace period of {grace_s:g}s over: exiting now\n".encode())
        os._exit(128 + signum)

    threading.Thread(target=watchdog, name="preemption-deadline", daemon=True).start()
