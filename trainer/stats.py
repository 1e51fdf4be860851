"""Detectron's TrainingStats: smoothed losses, iteration timing, ETA and the `json_stats` log.

Per iteration only deque appends; medians, formatting and file I/O happen on log iterations (every
LOG_PERIOD and the last), as in Detectron. metrics(cur_iter) gives the raw values for tracking.
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

import torch

from trainer.atomic_write import write_atomic
from trainer.logs import write_or_drop

try:
    import resource
except ImportError:  # not on Windows; memory then reads 0
    resource = None

_PROGRESS_PERIOD_S = 0.1  # the terminal progress line is redrawn at most ~10 times a second


class SmoothedValue:
    """A series' median and mean over a window, and its global mean (Detectron/maskrcnn-benchmark)."""

    __slots__ = ("deque", "total", "count")

    def __init__(self, window: int):
        self.deque: deque = deque(maxlen=window)
        self.total = 0.0
        self.count = 0

    def update(self, value: float) -> None:
        self.deque.append(value)
        self.total += value
        self.count += 1

    @property
    def latest(self) -> float:
        return self.deque[-1]

    @property
    def median(self) -> float:
        if math.isnan(self.total):  # a NaN is in the window (the job stops at it): NaN, as numpy's median says
            return math.nan
        return statistics.median(self.deque)

    @property
    def avg(self) -> float:
        return statistics.fmean(self.deque)

    @property
    def global_avg(self) -> float:
        return self.total / self.count


class Timer:
    """Detectron's Timer: the last interval and the average since the last reset."""

    def __init__(self):
        self.start = 0.0
        self.diff = 0.0
        self.reset()

    def reset(self) -> None:
        # the last interval survives a reset: metrics() after it still reads this iteration's time
        self.total = 0.0
        self.calls = 0

    def tic(self) -> None:
        self.start = time.perf_counter()

    def toc(self) -> float:
        self.diff = time.perf_counter() - self.start
        self.total += self.diff
        self.calls += 1
        return self.diff

    @property
    def average_time(self) -> float:
        return self.total / self.calls if self.calls else 0.0


_MAX_ETA_S = datetime.timedelta.max.total_seconds()


def format_eta(seconds: float) -> str:
    """Detectron's str(timedelta(seconds=int(eta))): '0:03:20', '1 day, 1:08:29'; '-' when there is
    no such time (NaN, or past timedelta's range: a process stopped for days, a billion iterations
    to go). An ETA never stops the job."""
    if not seconds < _MAX_ETA_S:  # NaN compares false too
        return "-"
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def peak_memory_mb() -> float:
    """Peak CUDA memory allocated by this process since the last json_stats line (detectron2 resets
    it per log period), or its peak RSS without CUDA (the whole process's: it cannot be reset), in MB."""
    if torch.cuda.is_initialized():  # a cheap flag, unlike is_available(); metrics() runs per iteration
        return torch.cuda.max_memory_allocated() / 1024 / 1024
    if resource is None:
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 / 1024 if sys.platform == "darwin" else rss / 1024  # bytes there, KiB here


def drop_entries_from(path: Path, start_iter: int) -> None:
    """Rewrite a json_stats log without the entries a resumed job will log again."""
    if not path.is_file():
        return
    lines = path.read_bytes().splitlines()  # bytes: a line that is not UTF-8 is one more line to drop
    kept = [line for line in lines if _iter_of(line) < start_iter]
    if len(kept) == len(lines):
        return
    write_atomic(path, b"".join(line + b"\n" for line in kept))  # a kill mid-write leaves the old log


def _iter_of(line: bytes) -> float:
    """The entry's iteration; +inf (always dropped) for a line cut short when the job was killed, or
    one that is not JSON in UTF-8."""
    try:
        entry = json.loads(line)
    except ValueError:
        return math.inf
    value = entry.get("iter") if isinstance(entry, dict) else None
    return value if isinstance(value, int) else math.inf


def _round6(value):
    # Detectron printed top-level floats with 6 decimals; kept, as JSON numbers. NaN and infinity are
    # no JSON: written as Detectron wrote them, "nan" and "inf", so that a strict parser reads the line.
    if not isinstance(value, float):
        return value
    return float(f"{value:.6f}") if math.isfinite(value) else f"{value:.6f}"


class TrainingStats:
    """Tracks one training job's iteration statistics; only the main rank prints or writes."""

    def __init__(self, cfg, start_iter: int, json_log_path: Path | None, is_main: bool = True,
                 stream: TextIO | None = None, progress_stream: TextIO | None = None):
        self.log_period = cfg.LOG_PERIOD  # Detectron: window size = log period = 20
        self.max_iter = cfg.SOLVER.MAX_ITER
        self.start_iter = start_iter
        self.is_main = is_main
        self.stream = stream if stream is not None else sys.stdout
        self.progress_stream = progress_stream if progress_stream is not None else sys.stderr
        self.json_log_path = Path(json_log_path) if json_log_path is not None and is_main else None
        self.iter_timer = Timer()
        self.losses: dict[str, SmoothedValue] = {}
        self.data_time = SmoothedValue(self.log_period)
        self.mb_qsize = SmoothedValue(self.log_period)
        self.images = SmoothedValue(self.log_period)
        self.lr = float("nan")
        self._progress = is_main and _isatty(self.stream)
        self._drawn_at = -math.inf
        self._line_open = False
        if self.json_log_path is not None:
            self.json_log_path.parent.mkdir(parents=True, exist_ok=True)
            drop_entries_from(self.json_log_path, start_iter)

    # -- per iteration --------------------------------------------------------------------- #

    def iter_tic(self) -> None:
        self.iter_timer.tic()

    def iter_toc(self) -> float:
        return self.iter_timer.toc()

    def update(self, losses: dict[str, float], lr: float, data_time: float, mb_qsize: int,
               images: int) -> None:
        """Record one iteration: 'loss' (the total) and each component by torchvision's name."""
        for name, value in losses.items():
            smoothed = self.losses.get(name)
            if smoothed is None:
                smoothed = self.losses[name] = SmoothedValue(self.log_period)
            smoothed.update(float(value))
        self.lr = float(lr)
        self.data_time.update(float(data_time))
        self.mb_qsize.update(mb_qsize)
        self.images.update(images)

    def maybe_reset_timer(self, cur_iter: int) -> None:
        # Detectron: drop the first LOG_PERIOD iterations (warm-up, cudnn autotuning) from the average
        if cur_iter == self.start_iter + self.log_period:
            self.iter_timer.reset()

    def is_log_iter(self, cur_iter: int) -> bool:
        return cur_iter % self.log_period == 0 or cur_iter == self.max_iter - 1

    def log(self, cur_iter: int) -> None:
        """On log iterations print `json_stats: {...}` and append it to the json log."""
        if not self.is_main:
            return
        if self.is_log_iter(cur_iter):
            stats = self.json_stats(cur_iter)
            if torch.cuda.is_initialized():  # each line's `mem` is its own period's peak, not the job's so far:
                torch.cuda.reset_peak_memory_stats()  # an evaluation's or the first iterations' would stay in every line
            self._end_line("\r\x1b[K")
            line = json.dumps(stats, sort_keys=True)
            write_or_drop(self.stream, f"json_stats: {line}\n")
            if self.json_log_path is not None:
                with open(self.json_log_path, "a") as f:
                    f.write(line + "\n")
            self._drawn_at = -math.inf  # redraw the progress line under the printed one now
        if self._progress:
            self._draw_progress(cur_iter)

    # -- values ---------------------------------------------------------------------------- #

    def _average_time(self) -> float:
        # right after the timer reset there is no average yet: the last interval stands in
        return self.iter_timer.average_time if self.iter_timer.calls else self.iter_timer.diff

    def eta_seconds(self, cur_iter: int) -> float:
        return self._average_time() * (self.max_iter - cur_iter)  # Detectron's formula

    def metrics(self, cur_iter: int) -> dict[str, float]:
        """This iteration's raw values, for experiment tracking."""
        out = {name: smoothed.latest for name, smoothed in self.losses.items()}
        seconds = self.iter_timer.diff
        images = self.images.latest if self.images.count else 0
        out.update(
            lr=self.lr,
            time=seconds,
            data_time=self.data_time.latest if self.data_time.count else 0.0,
            eta_seconds=self.eta_seconds(cur_iter),
            mem_mb=peak_memory_mb(),
            mb_qsize=float(self.mb_qsize.latest if self.mb_qsize.count else 0),
            images_per_sec=images / seconds if seconds > 0 else 0.0,
        )
        return out

    def json_stats(self, cur_iter: int) -> dict:
        """Detectron's GetStats: smoothed medians, average iteration time, ETA, peak memory."""
        avg_time = self._average_time()
        stats = dict(
            iter=cur_iter,
            lr=float(f"{self.lr:.6g}") if math.isfinite(self.lr) else f"{self.lr:.6f}",
            time=_round6(avg_time),
            eta=format_eta(self.eta_seconds(cur_iter)),
            mb_qsize=int(round(self.mb_qsize.median)) if self.mb_qsize.count else 0,
            mem=int(math.ceil(peak_memory_mb())),
            data_time=_round6(self.data_time.median) if self.data_time.count else 0.0,
            images_per_sec=_round6(self.images.avg / avg_time) if avg_time > 0 and self.images.count else 0.0,
        )
        for name, smoothed in self.losses.items():
            stats[name] = _round6(smoothed.median)
        return stats

    # -- terminal progress line ------------------------------------------------------------ #

    def _draw_progress(self, cur_iter: int) -> None:
        now = time.monotonic()
        last = cur_iter >= self.max_iter - 1
        if now - self._drawn_at < _PROGRESS_PERIOD_S and not last:
            return
        self._drawn_at = now
        loss = self.losses.get("loss")
        loss_text = f"{loss.latest:.4f}" if loss is not None else "-"
        text = (f"\riter {cur_iter + 1}/{self.max_iter}  loss {loss_text}  lr {self.lr:.6g}"
                f"  eta {format_eta(self.eta_seconds(cur_iter))}\x1b[K")
        write_or_drop(self.progress_stream, text + ("\n" if last else ""))
        self._line_open = not last

    def _end_line(self, text: str) -> None:
        if self._line_open:
            write_or_drop(self.progress_stream, text)
            self._line_open = False

    def close(self) -> None:
        """End the progress line (kept on screen) if the loop stopped early: preemption, error."""
        self._end_line("\n")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
