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


class PreemptionGuard:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.deadline = float("inf")
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def preempted(self) -> Preempted:
        return Preempted(self.signum or signal.SIGTERM, min(self.deadline, time.monotonic() + self.grace_s))

    def __exit__(self, *exc):
        if self.signum is None:  # once stopping, ours stay: a second signal during the preemption
            for sig, handler in self._previous.items():  # checkpoint's upload or the flush exits at once
                signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:
            os.write(2, b"second signal: exiting now\n")
            os._exit(128 + signum)
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        _exit_at(self.deadline - EXIT_MARGIN_S, signum, self.grace_s)
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
