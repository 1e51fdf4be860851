"""Background threads that do tracking's network work, so the training thread never waits on it.

`MetricSender`: the training thread appends one tuple per iteration to a bounded deque; a thread
turns them into `log_batch` calls of at most 1000 metrics, retrying with backoff while the server
is down. A point is dropped only when the deque overflows (counted and reported), never twice
sent on purpose: a retried batch carries the same timestamps, which the server deduplicates. With
`beat`, an interval with nothing to send still sends an empty batch: the run's heartbeat rides on it.

`Uploader`: a FIFO of jobs (artifact uploads, checkpoint upload + tags, the run's final status),
each retried with backoff until it succeeds or the close deadline passes; a job given up on runs
its `dropped` fallback, if it has one, on the closing thread.
"""
from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from typing import Callable

from trainer.errors import first_line

log = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
STALLED_S = 10.0  # a batch unanswered this long: the server counts as down (one that hangs never fails)


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = 15.0):
        self.first, self.cap, self.delay = first, cap, first

    def failed(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.first


class MetricSender:
    """Batches metric points to `send(list_of_(key, value, timestamp_ms, step))`."""

    def __init__(self, send: Callable[[list], None], max_pending: int = 200_000, interval: float = 1.0,
                 beat: bool = False):
        self._send = send
        self._beat = beat  # send([]) when an interval passes with nothing to send: the run's heartbeat
        self._last_send = -float("inf")
        self._pending: collections.deque = collections.deque(maxlen=max_pending)
        self._interval = interval
        self._stop = threading.Event()
        self._nudge = threading.Event()  # send now, don't wait out the interval
        self._inflight: list = []  # the puts of the batch being sent, as they were queued
        self._taking = threading.Lock()  # a batch taken from the queue, against queued()
        self._deadline = float("inf")
        self.dropped = 0
        self.failures = 0
        self._failed = False  # the last send failed: the server is down (or refusing) now
        self._sending_since: float | None = None  # when the batch in flight went out
        self._thread = threading.Thread(target=self._run, name="metric-sender", daemon=True)
        self._thread.start()

    @property
    def failing(self) -> bool:
        """The last send failed, or the one in flight has waited STALLED_S for its answer."""
        since = self._sending_since
        return self._failed or (since is not None and time.monotonic() - since > STALLED_S)

    def put(self, metrics: dict, step: int) -> None:
        """Training thread: one append, no conversion, no lock."""
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
        self._pending.append((step, int(time.time() * 1000), metrics))

    def put_late(self, metrics: dict, step: int) -> None:
        """Another thread's point for a step the training thread has passed (an evaluation's scores
        logged after training went on): queued in step order, which wait_sent() relies on."""
        with self._taking:  # not while the sender takes a batch: its peek and pop must see one queue
            at = bisect.bisect_right(self._pending, step, key=lambda queued: queued[0])
            point = (step, int(time.time() * 1000), metrics)
            try:
                self._pending.insert(at, point)
            except IndexError:  # full: the oldest point makes room, as put() would drop it
                self._pending.popleft()
                self.dropped += 1
                self._pending.insert(max(0, at - 1), point)
        self._nudge.set()

    def wait_sent(self, step: float, timeout: float) -> bool:
        """Block until every point put for iterations <= `step` has been sent; False on timeout.

        The uploader calls this before it marks checkpoint N complete, so a job killed after that
        resumes at N+1 with no hole in its curves.
        """
        end = time.monotonic() + timeout
        self._nudge.set()
        while self._unsent_through(step):
            if time.monotonic() >= end or not self._thread.is_alive():
                return False
            self._nudge.set()
            time.sleep(0.02)
        return True

    def _unsent_through(self, step: float) -> bool:
        inflight = self._inflight
        if inflight and inflight[0][0] <= step:
            return True
        try:
            return self._pending[0][0] <= step  # steps are put in order
        except IndexError:
            return False

    def close(self, timeout: float) -> bool:
        """Send what is queued, giving up at the deadline; True when nothing was left behind."""
        self._deadline = time.monotonic() + timeout
        self._stop.set()
        self._nudge.set()
        self._thread.join(max(0.0, timeout))  # not a moment longer: a hung server must not hold the exit
        left = len(self._pending) + len(self._inflight)  # the batch given up on too
        if left or self.dropped:
            log.warning("metrics: %d iterations not sent before the deadline, %d dropped on overflow",
                        left, self.dropped)
        return left == 0 and not self._thread.is_alive()

    def resend(self, points: list) -> None:
        """Points an earlier process of the run could not send, ahead of everything put after; past
        the queue's room the oldest are dropped (and counted), as put() drops them."""
        groups = _grouped(points)
        room = self._pending.maxlen - len(self._pending)
        if len(groups) > room:
            self.dropped += len(groups) - room
            groups = groups[len(groups) - room:]
        with self._taking:
            for step, ts, metrics in reversed(groups):
                self._pending.appendleft((step, ts, metrics))
        self._nudge.set()

    def queued(self) -> list:
        """What is not sent yet, one (step, timestamp_ms, metrics) per put, the batch in flight first
        (after close(): what was given up on)."""
        with self._taking:  # a point is in the queue or in the batch, never between the two
            return self._inflight + list(self._pending)

    def leftover(self) -> list:
        """queued(), one (key, value, timestamp_ms, step) point each: a resend of the batch in flight
        that did arrive is the same point, which the server keeps once."""
        return points_of(self.queued())

    def _next_batch(self) -> list:
        """Puts from the queue, up to MAX_METRICS_PER_BATCH points, as points; `_inflight` holds the puts."""
        batch: list = []
        with self._taking:
            self._inflight = []
            while self._pending and len(batch) < MAX_METRICS_PER_BATCH:
                if len(batch) + len(self._pending[0][2]) > MAX_METRICS_PER_BATCH and batch:
                    break
                self._inflight.append(self._pending[0])  # before the pop: wait_sent() must see it somewhere
                batch += points_of([self._pending.popleft()])
            if not batch:
                self._inflight = []
        return batch

    def _run(self) -> None:
        backoff, batch = Backoff(), []
        while True:
            if not batch:
                batch = self._next_batch()
            if not batch:
                if self._stop.is_set():
                    return
                if self._beat and time.monotonic() - self._last_send >= self._interval:
                    self._send_beat()
                self._nudge.wait(self._interval)
                self._nudge.clear()
                continue
            try:
                self._timed_send(batch)
            except Exception as e:  # a server that is down is retried
                self.failures += 1
                delay = backoff.failed()
                if time.monotonic() + delay > self._deadline:
                    log.warning("metrics: giving up on %d points: %s", len(batch), first_line(e))
                    return
                # One warning per outage, not one per retry: logs stay readable, stderr never floods.
                (log.warning if self.failures == 1 or backoff.delay == backoff.first * 2 else log.debug)(
                    "metrics: send failed (%s), retrying in %.1fs", first_line(e, 200), delay)
                time.sleep(delay)
                continue
            self._last_send = time.monotonic()
            batch, self._inflight = [], []
            backoff.reset()

    def _timed_send(self, points: list) -> None:
        """One request; while it waits, `failing` turns true after STALLED_S."""
        self._sending_since = time.monotonic()
        try:
            self._send(points)
        except Exception:
            self._failed = True  # before the clock is cleared: `failing` never drops in between
            raise
        finally:
            self._sending_since = None
        self._failed = False

    def _send_beat(self) -> None:
        self._last_send = time.monotonic()
        try:
            self._timed_send([])
        except Exception as e:  # the next batch retries; a missed beat only makes a watcher wait
            log.debug("metrics: heartbeat not sent: %s", first_line(e))


def points_of(puts: list) -> list:
    """The sender's (step, timestamp_ms, metrics) puts as (key, value, timestamp_ms, step) points."""
    return [(k, float(v), ts, step) for step, ts, metrics in puts for k, v in metrics.items()]


def _grouped(points: list) -> list:
    """(key, value, timestamp_ms, step) points back to the sender's (step, timestamp_ms, metrics)."""
    groups: dict = {}
    for key, value, ts, step in points:
        groups.setdefault((step, ts), {})[key] = value
    return [(step, ts, metrics) for (step, ts), metrics in groups.items()]


class Uploader:
    """Runs network jobs in order on one thread, each retried until it succeeds or time runs out."""

    def __init__(self, retryable: Callable[[BaseException], bool] = lambda e: True):
        self._retryable = retryable
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._deadline = float("inf")
        self._closing = False
        self.failed: list[str] = []
        self.why: dict[str, str] = {}  # a job failed for good by an error no retry mends: that error, for the last line
        self._busy: str | None = None  # the description of the job in progress
        self._abandoned = False  # close() gave up on the job in progress: it is reported already
        self._thread = threading.Thread(target=self._run, name="uploader", daemon=True)
        self._thread.start()

    def submit(self, description: str, job: Callable[[], None], dropped: Callable[[], None] | None = None) -> None:
        """`dropped` runs instead when the job fails for good or is never run (close's deadline)."""
        with self._cv:
            self._jobs.append((description, job, dropped))
            self._cv.notify()

    def wait(self, timeout: float) -> bool:
        """Wait until every job queued so far is done (or failed); True when the queue drained."""
        end = time.monotonic() + timeout
        with self._cv:
            while (self._jobs or self._busy is not None) and time.monotonic() < end:
                self._cv.wait(min(0.1, max(0.0, end - time.monotonic())))
            return not (self._jobs or self._busy is not None)

    def close(self, timeout: float) -> bool:
        with self._cv:
            self._deadline = time.monotonic() + timeout
            self._closing = True
            self._cv.notify_all()
        self._thread.join(max(0.0, timeout))  # a job stuck in a hung request is left behind (daemon thread)
        with self._cv:
            left = len(self._jobs) + (self._busy is not None)
            self._abandoned = self._thread.is_alive()
            stuck = [self._busy] if self._abandoned and self._busy is not None else []
            late = stuck + [description for description, _, _ in self._jobs]  # those that failed are said already
            self.failed += late
            never_run, self._jobs = list(self._jobs), collections.deque()
        for _, _, dropped in never_run:
            _fallback(dropped)
        if late:
            log.warning("tracking: not done before the deadline: %s", ", ".join(late))
        return left == 0 and not self.failed

    def _take(self):
        with self._cv:
            while not self._jobs and not self._closing:
                self._cv.wait()
            if not self._jobs:
                return None
            item = self._jobs.popleft()
            self._busy = item[0]
            return item

    def _run(self) -> None:
        while (item := self._take()) is not None:
            description, job, dropped = item
            if not self._attempt(description, job):
                _fallback(dropped)
            with self._cv:
                self._busy = None
                self._cv.notify_all()

    def _attempt(self, description: str, job: Callable[[], None]) -> bool:
        """True once the job succeeded; False when it failed for good (not when close() gave up on
        it while it ran: the process is ending, and a late success must not be done twice)."""
        backoff = Backoff()
        while True:
            try:
                job()
                return True
            except Exception as e:  # retried until the deadline
                delay = backoff.failed()
                if self._abandoned:  # close() has reported it; the job is exiting
                    return True
                final = not self._retryable(e)
                if final or time.monotonic() + delay > self._deadline:
                    log.warning("tracking: %s failed: %s", description, first_line(e))
                    self.failed.append(description)
                    if final:
                        self.why[description] = first_line(e, 500)
                    return False
                first = backoff.delay == backoff.first * 2
                (log.warning if first else log.debug)("tracking: %s failed (%s); retrying", description, first_line(e, 200))
                time.sleep(delay)


def _fallback(dropped: Callable[[], None] | None) -> None:
    try:
        if dropped is not None:
            dropped()
    except Exception as e:  # a fallback is best effort: the job's failure is reported already
        log.warning("tracking: %s", first_line(e))
