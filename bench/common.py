"""What every benchmark shares: the machine's description, the real servers, timing helpers, results.

Every figure the suite reports is a RATIO of two things measured side by side in the same process,
interleaved (A, B, A, B, ...), so that it holds on a shared, noisy machine: the absolute numbers
move with the load, the ratio of neighbours much less.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


# ---------------------------------------------------------------------------------------- results

@dataclass
class Section:
    """One benchmark's outcome, rendered into RESULTS.md."""

    name: str
    title: str
    what: str  # how it was measured, in a paragraph
    headline: str  # the key figure(s), one line
    target: str
    passed: bool | str | None  # None: no target, or it could not be judged; or UNRESOLVED
    tables: list[str] = field(default_factory=list)  # markdown tables
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def md_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def fmt_s(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


UNRESOLVED = "unresolved"  # a Section.passed: the target lies within the measurement's 95% CI


def verdict(passed: bool | str | None) -> str:
    return {True: "PASS", False: "**FAIL**", None: "n/a", UNRESOLVED: "**UNRESOLVED** (within noise)"}[passed]


# ---------------------------------------------------------------------------------------- machine

def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "n/a"


def machine_info() -> dict:
    import torch
    import torchvision
    import mlflow

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem = "n/a"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} logical, {usable} usable by this process",
        "memory": mem,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": f"{torch.__version__} (intra-op threads {torch.get_num_threads()})",
        "torchvision": torchvision.__version__,
        "mlflow": mlflow.__version__,
        "python": f"{sys.version.split()[0]} on {platform.platform()}",
    }


# ---------------------------------------------------------------------------------------- CPU time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _group_stats(pgid: int):
    """(pid, /proc/pid/stat fields after the name) of the live processes in process group `pgid`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # pgrp
            yield int(entry.name), fields


def group_cpu_seconds(pgid: int) -> float:
    """user+system CPU seconds of the live processes in process group `pgid` (a server and its workers)."""
    return sum(int(f[11]) + int(f[12]) for _, f in _group_stats(pgid)) / _TICK  # utime, stime


def place_threads(training: set[int] | None, groups: list[int]) -> None:
    """Put this process's main (training) thread on the `training` cores and every other thread
    (our background threads, and those of the processes in `groups`: the servers) on the remaining
    cores, as on a training host whose spare cores take the trainer's background threads; threads
    started later inherit their creator's cores. `training=None`: every thread on every core."""
    every = set(range(os.cpu_count() or 1))
    rest = every - training if training else every
    main = threading.main_thread().native_id
    tasks = [(int(t), training if training and int(t) == main else rest) for t in os.listdir("/proc/self/task")]
    for pgid in groups:
        for pid, _ in _group_stats(pgid):
            with contextlib.suppress(OSError):
                tasks += [(int(t), rest) for t in os.listdir(f"/proc/{pid}/task")]
    for tid, cores in tasks:
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(tid, cores)


# ---------------------------------------------------------------------------------------- batches

class InMemoryBatches:
    """Stands in for the engine's Prefetcher: batches already in memory, in a fixed order, so that
    neither side of a comparison pays for data loading."""

    def __init__(self, batches: list):
        self.batches, self.index = batches, 0

    def next(self):
        item = self.batches[self.index % len(self.batches)]
        self.index += 1
        return item

    def qsize(self) -> int:
        return 0

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------- servers

class Env:
    """What the benchmarks run against: a scratch folder, the demo's datasets, and (lazily) the
    servers of tests/servers.py: moto's S3 and `mlflow server` (sqlite) whose artifacts it proxies
    to that S3, all on 127.0.0.1."""

    def __init__(self, quick: bool, workdir: Path | None = None):
        self.quick = quick
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tracktron-bench-")
            workdir = Path(self._tmp.name)
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / "datasets"
        self._s3 = None
        self._mlflow = None

    # datasets ------------------------------------------------------------------------------
    def demo_cfg(self, *opts, config: Path = DEMO):
        """The demo config with DATA_DIR here and KEY VALUE overrides (strings or not)."""
        from trainer.config import load_config

        base = ["DATA_DIR", str(self.data_dir), "OUTPUT_DIR", str(self.workdir / "output")]
        return load_config(config, base + [str(x) for x in opts])

    def ensure_datasets(self) -> None:
        from trainer.data import resolve_dataset

        cfg = self.demo_cfg()
        for name in ("synth_shapes_train", "synth_shapes_val"):
            resolve_dataset(cfg, name)  # generated on first use

    # servers -------------------------------------------------------------------------------
    @property
    def s3(self):
        if self._s3 is None:
            from tests.servers import S3Server

            self._s3 = S3Server(self._mkdir("s3")).start()
            os.environ.update(self._s3.env)  # boto3 clients of this process find moto
        return self._s3

    @property
    def mlflow(self):
        if self._mlflow is None:
            from tests.servers import PROXY_MULTIPART, MlflowServer

            s3 = self.s3
            self._mlflow = MlflowServer(self._mkdir("mlflow"), artifacts=f"s3://{s3.bucket}/proxied",
                                        env={**s3.env, **PROXY_MULTIPART}).start()
        return self._mlflow

    def server_groups(self) -> list[int]:
        """The process groups of the servers started (each server leads its own)."""
        return [s.proc.pid for s in (self._s3, self._mlflow) if s and s.proc]

    def server_cpu_seconds(self) -> float:
        """CPU seconds used so far by the mlflow server and moto (both process groups)."""
        return sum(group_cpu_seconds(s.proc.pid) for s in (self._s3, self._mlflow) if s and s.proc)

    def _mkdir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def scratch(self, name: str) -> Path:
        """A fresh, empty folder."""
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.workdir))

    def close(self) -> None:
        for server in (self._mlflow, self._s3):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        self._mlflow = self._s3 = None
        if self._tmp is not None:
            self._tmp.cleanup()


def quiet_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
                        stream=sys.stderr)
    for name in ("mlflow", "alembic", "urllib3", "botocore", "boto3", "s3transfer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")


def thread_cpu_seconds() -> dict[str, float]:
    """user+system CPU seconds of each live Python thread of this process, by thread name.

    Threads that are not Python's (torch's intra-op pool, loader pin threads) are summed under
    "other native threads"; the process total is time.process_time().
    """
    import threading

    out: dict[str, float] = {}
    for th in threading.enumerate():
        tid = getattr(th, "native_id", None)
        if tid is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[th.name] = out.get(th.name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


# ---------------------------------------------------------------------------------------- the loop

def fresh_loop(cfg, tracker, ctx=None):
    """(Job, LoopState) from scratch, as train_model sets them up: the run found (tracker.run waits
    for start()'s lookup), seeds, the dataset and model built, weights, optimizer, loader, writer."""
    from trainer import engine
    from trainer.distributed import Context
    from trainer.job import Job
    from trainer.preflight import prepare
    from trainer.resume import CreatedModel, StartPoint

    tracker.run  # the run exists before anything is logged to it
    job = Job(cfg, ctx or Context(), tracker, Path(cfg.OUTPUT_DIR))
    p = prepare(cfg)  # seeds, then the dataset and the network, as a job's start does
    created = CreatedModel(StartPoint(), p)
    return job, engine.setup_model_for_training(job, created)


def quiet_stats(job, s) -> None:
    """The loop's TrainingStats, printing to /dev/null: the json_stats lines are still formatted and
    written to json_stats.log, and no terminal progress line depends on where stdout goes."""
    from trainer.stats import TrainingStats

    s.stats.close()
    devnull = open(os.devnull, "w")
    path = job.output_dir / "json_stats.log" if job.ctx.is_main else None
    s.stats = TrainingStats(job.cfg, 0, path, is_main=job.ctx.is_main, stream=devnull, progress_stream=devnull)
