"""torch's threads within the container's CPU quota: `docker run --cpus 4` or a pod's CPU limit is a
CFS quota, not an affinity, so torch would size its pool from the node's cores and be throttled.
Nothing here may fail a job: a cgroup file missing, unreadable or malformed is "no quota"."""
from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger("tracktron")

# Where the cgroup file systems are mounted; the tests point it at fake cgroup files.
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The thread counts torch honours (it reads OMP_NUM_THREADS, then MKL_NUM_THREADS): the user's, or torchrun's.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def use_cpu_quota() -> None:
    """When the whole CPUs of a CPU quota (at least 1) are fewer than the CPUs this process may run on,
    OMP_NUM_THREADS (read by torch as it loads, and by every OpenMP library) gets that many, said once.
    A thread count the user set is left as it is; loader workers are one thread each already."""
    if any(os.environ.get(name, "").strip() for name in THREAD_VARIABLES):
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: no cgroups either
        return
    found = read_cpu_quota(CGROUP_ROOT)
    if found is None:
        return
    quota, source = found
    threads = max(1, math.floor(quota))
    if threads >= cpus:  # half a CPU on one: torch's one thread already ("uses 1 thread, not 1" said nothing)
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() > threads:  # already loaded (a caller in this process)
        torch.set_num_threads(threads)
    log.info("a CPU quota of %s (%s): torch uses %s, not %d (set OMP_NUM_THREADS to choose)",
             _count(quota, "CPU"), source, _count(threads, "thread"), cpus)


def _count(n: float, what: str) -> str:
    return f"{n:g} {what}" if n == 1 else f"{n:g} {what}s"


def read_cpu_quota(root: Path) -> tuple[float, str] | None:
    """The container's CPU quota in CPUs, with the file that sets it; None when there is none. `root` is
    the container's own cgroup (its namespace), with cgroup v2's cpu.max or v1's cpu/cpu.cfs_quota_us."""
    return min(filter(None, (_v2_quota(root), _v1_quota(root / "cpu"))), default=None)


def _v2_quota(folder: Path) -> tuple[float, str] | None:
    """cpu.max: "400000 100000" is 4 CPUs, "max 100000" none."""
    fields = _read(folder / "cpu.max").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _cpus(fields[0], fields[1], "cgroup cpu.max")


def _v1_quota(folder: Path) -> tuple[float, str] | None:
    """cpu.cfs_quota_us over cpu.cfs_period_us; a quota of -1 is none."""
    quota, period = _read(folder / "cpu.cfs_quota_us").strip(), _read(folder / "cpu.cfs_period_us").strip()
    return _cpus(quota, period, "cgroup cpu.cfs_quota_us")


def _cpus(quota: str, period: str, source: str) -> tuple[float, str] | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # malformed, or a file missing ("")
        return None
    return (q / p, source) if q > 0 and p > 0 else None


def _read(path: Path) -> str:
    """A small file's text; "" when it is missing, unreadable or not text (a cgroup file is a line)."""
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii")
    except (OSError, ValueError):
        return ""
