"""Stop signals (SIGTERM, SIGINT, SIGHUP, SIGUSR1/2): finish the iteration, checkpoint it, then stop.

The first signal sets a flag the loop checks between iterations and arms a deadline: whatever still
runs at TRAIN.PREEMPT_GRACE_S, the process exits with 128 + the signal number after a bounded last
word to the tracker (the run's status). A second signal exits at once (the status first).

Python runs a handler only when the main thread is back in the interpreter, and a collective waiting
for a dead rank holds it in C++ for up to 30 minutes; so a watch thread gets the signals too
(`signal.set_wakeup_fd`), arms the deadline and takes the second signal.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from concurrent.futures import wait
from typing import Callable

from trainer.daemon_call import daemon_call

log = logging.getLogger(__name__)

EXIT_MARGIN_S = 0.2  # the hard exit comes this long before the deadline
LAST_WORDS_S = 3.0  # before it, this long for the run's status (one request or two)
SECOND_WORDS_S = 1.0  # a second signal exits at once, after at most this long for the run's status
# SIGHUP: the terminal or ssh session that started the job closed (under nohup it stays ignored).
# SIGUSR1/2: Slurm's warning before a time limit (`--signal=USR1@120`), for a requeued job to resume.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


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
    """Stop-signal handlers for a `with` block (main thread only). The first signal calls
    `_first` on the main thread; the watch thread arms the grace deadline and exits at once on a
    second signal. Once a signal came, the handlers stay after the block, so a second signal during
    the preemption upload or the flush still exits."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.deadline = float("inf")
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            _Watch.start(self.grace_s)
            for sig in STOP_SIGNALS:
                if sig in (signal.SIGHUP, signal.SIGINT) and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup: the job is to outlive its terminal; `cmd &` in a script: Ctrl-C is the script's
                self._previous[sig] = signal.signal(sig, self._handle)
            _Watch.active += 1
        return self

    def __exit__(self, *exc):
        if self._previous and not _Watch.came:  # once one came, a second one exits wherever it lands
            _Watch.active -= 1
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second one: the watch thread is ending the process
            return
        self.signum, _Watch.came = signum, True
        self.deadline = _Watch.deadline if _Watch.deadline < float("inf") else time.monotonic() + self.grace_s
        if _Watch.holding:  # acted on when the held block ends
            _Watch.pending = self
            return
        self._first(signum)

    def _first(self, signum: int) -> None:
        raise NotImplementedError


class _Watch:
    """The process's one watch thread: reads the signal numbers Python writes to the wakeup pipe
    the moment a signal arrives. Signals count only while a handler block is active (or once one
    came): the first arms the deadline, a second exits at once."""

    active = 0
    came = False  # a stop signal reached a handler
    holding = 0  # inside held(): a handler takes the signal but acts only when the block ends
    pending: _OnSignal | None = None
    grace_s = 0.0
    deadline = float("inf")
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, grace_s: float) -> None:
        cls.grace_s = grace_s
        if cls._thread is not None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler never blocks on a full pipe
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        cls._thread = threading.Thread(target=cls._run, args=(read_fd,), name="signal-watch", daemon=True)
        cls._thread.start()

    @classmethod
    def _run(cls, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum not in STOP_SIGNALS or not (cls.active or cls.deadline < float("inf")):
                    continue
                if cls.deadline < float("inf"):
                    os.write(2, b"second signal: exiting now\n")
                    _speak(f"stopped by a second {signal.Signals(signum).name}", time.monotonic() + SECOND_WORDS_S)
                    os._exit(128 + signum)
                cls.deadline = time.monotonic() + cls.grace_s
                _exit_at(cls.deadline - EXIT_MARGIN_S, signum, cls.grace_s)


@contextlib.contextmanager
def held():
    """A stop signal that comes in this block is acted on when it ends: code that must run whole is
    never cut by StopRequested. A fork is such code: Python runs pending handlers in the hooks around
    it (logging's lock release among them), where an exception is dropped and leaves the lock taken."""
    _Watch.holding += 1
    try:
        yield
    finally:
        _Watch.holding -= 1
        if not _Watch.holding and _Watch.pending is not None:
            handler, _Watch.pending = _Watch.pending, None
            handler._first(handler.signum)


_last_words: Callable[[str], None] | None = None


def on_hard_exit(last_words: Callable[[str], None] | None) -> None:
    """What to say (the run's status, with a reason) when the grace period ends with the job still
    running: called on a thread of its own, given at most LAST_WORDS_S, then the process exits."""
    global _last_words
    _last_words = last_words


class StopOnSignal(_OnSignal):
    """Around the whole job: outside the loop, a signal stops it where it is (StopRequested)."""

    def _first(self, signum: int) -> None:
        raise StopRequested(signum, self.deadline)


class PreemptionGuard(_OnSignal):
    """Around the loop: a signal sets a flag that the loop checks between iterations. Once the loop
    is over (`finishing`), the job completes its last steps within the grace period instead."""

    finishing = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def preempted(self) -> Preempted:
        return Preempted(self.signum or signal.SIGTERM, min(self.deadline, time.monotonic() + self.grace_s))

    def _first(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.finishing:
            log.warning("%s received: the last iteration is done; the job completes model_final, the final evaluation "
                        "and the model's logging (the grace period of %gs ends the job if they take longer)", name, self.grace_s)
        else:
            log.warning("%s received: finishing this iteration, then checkpointing and stopping", name)


def _exit_at(when: float, signum: int, grace_s: float) -> None:
    """A daemon thread that ends the process at `when` (time.monotonic()) unless it ended before."""
    def watchdog():
        _sleep_until(when - min(LAST_WORDS_S, grace_s / 2))  # a short grace period: its second half
        _speak(f"stopped by {signal.Signals(signum).name}: still running when its {grace_s:g}s grace period ended", when)
        _sleep_until(when)
        os.write(2, f"grace period of {grace_s:g}s over: exiting now\n".encode())
        os._exit(128 + signum)

    threading.Thread(target=watchdog, name="preemption-deadline", daemon=True).start()


def _sleep_until(when: float) -> None:
    while (left := when - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def _speak(reason: str, until: float) -> None:
    """The last words (the run's status), on a thread of their own, waited for until `until` at most."""
    if _last_words is not None:
        wait([daemon_call(functools.partial(_say, _last_words, reason), "last-words")], max(0.0, until - time.monotonic()))


def _say(last_words: Callable[[str], None], reason: str) -> None:
    try:
        last_words(reason)
    except Exception as e:  # the server is down too: the exit goes ahead
        log.warning("could not record the job's end: %s", e)
