"""A container's CPU quota (docker run --cpus, a pod's CPU limit) sizes torch's threads: the cgroup
files read from fake ones under tmp_path, and a real trainer pointed at them."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import DEMO, demo_overrides
from trainer import cpu_quota
from trainer.cpu_quota import read_cpu_quota, use_cpu_quota


def cgroup(root, files: dict[str, str | bytes]):
    """A fake container cgroup mount under `root` holding `files` (path: content)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def test_cgroup_v2_quota_and_no_quota(tmp_path):
    assert read_cpu_quota(cgroup(tmp_path / "a", {"cpu.max": "400000 100000\n"})) == (4.0, "cgroup cpu.max")
    assert read_cpu_quota(cgroup(tmp_path / "b", {"cpu.max": "150000 100000\n"})) == (1.5, "cgroup cpu.max")
    assert read_cpu_quota(cgroup(tmp_path / "c", {"cpu.max": "max 100000\n"})) is None
    assert read_cpu_quota(cgroup(tmp_path / "d", {})) is None  # no cgroup files at all (not Linux, a bare chroot)


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    v1 = {"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert read_cpu_quota(cgroup(tmp_path / "a", v1)) == (2.0, "cgroup cpu.cfs_quota_us")
    none = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert read_cpu_quota(cgroup(tmp_path / "b", none)) is None


@pytest.mark.parametrize("content", ["", "max", "400000", "four 100000", "400000 0", "0 100000", "-5 100000",
                                     "400000 100000 7", b"\xff\xfe 100000"])
def test_a_malformed_cpu_max_is_no_quota(tmp_path, content):
    assert read_cpu_quota(cgroup(tmp_path, {"cpu.max": content})) is None


def test_an_unreadable_cpu_max_is_no_quota(tmp_path):
    assert read_cpu_quota(cgroup(tmp_path, {"cpu.max/x": "a folder where the file should be"})) is None


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """use_cpu_quota on a 64-CPU affinity, no thread count set, its cgroup files under tmp_path; the
    test process's own thread count and OMP_NUM_THREADS put back after."""
    import torch

    threads = torch.get_num_threads()
    for name in cpu_quota.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))

    def with_files(files):
        monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", cgroup(tmp_path, files))
    yield with_files
    torch.set_num_threads(threads)


def test_a_quota_below_the_affinity_sets_the_thread_count_once_at_info(fake_host, caplog):
    import torch

    fake_host({"cpu.max": "450000 100000"})
    torch.set_num_threads(8)  # torch loaded before (eval, predict and config import it first): its pool is set too
    with caplog.at_level(logging.INFO, logger="tracktron"):
        use_cpu_quota()
        use_cpu_quota()  # eval sets itself up twice: said once
    assert os.environ["OMP_NUM_THREADS"] == "4" and torch.get_num_threads() == 4
    assert [r.getMessage() for r in caplog.records] == [
        "a CPU quota of 4.5 CPUs (cgroup cpu.max): torch uses 4 threads, not 64 (set OMP_NUM_THREADS to choose)"]


def test_a_quota_above_the_affinity_or_a_users_thread_count_is_left_alone(fake_host, monkeypatch, caplog):
    fake_host({"cpu.max": "8000000 100000"})  # 80 CPUs of quota on 64
    with caplog.at_level(logging.INFO, logger="tracktron"):
        use_cpu_quota()
        assert "OMP_NUM_THREADS" not in os.environ
        fake_host({"cpu.max": "50000 100000"})  # half a CPU: one thread, unless the user said otherwise
        monkeypatch.setenv("MKL_NUM_THREADS", "3")
        use_cpu_quota()
        assert "OMP_NUM_THREADS" not in os.environ
        monkeypatch.delenv("MKL_NUM_THREADS")
        use_cpu_quota()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert len(caplog.records) == 1


def test_a_quota_that_changes_no_thread_count_is_not_said(fake_host, monkeypatch, caplog):
    """Half a CPU on a one-CPU affinity: torch has its one thread already; "uses 1 thread, not 1" is noise."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    fake_host({"cpu.max": "50000 100000"})
    with caplog.at_level(logging.INFO, logger="tracktron"):
        use_cpu_quota()
    assert "OMP_NUM_THREADS" not in os.environ and not caplog.records


# The real CLI in a process of its own, its module's cgroup root pointed at fake files before main():
# no environment variable or option for a fake cgroup in the product, where a user could set it.
WITH_FAKE_CGROUP = ("import sys; from pathlib import Path; from trainer import cpu_quota; "
                    "cpu_quota.CGROUP_ROOT = Path(sys.argv[1]); from trainer.cli import main; main(sys.argv[2:]); "
                    "import torch; print('torch threads:', torch.get_num_threads())")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a quota below the affinity needs 2 CPUs")
def test_a_trainer_under_a_cpu_quota_uses_that_many_threads(tmp_path, data_dir):
    root = cgroup(tmp_path / "cgroup", {"cpu.max": "100000 100000\n"})  # docker run --cpus 1
    env = {k: v for k, v in os.environ.items() if k not in cpu_quota.THREAD_VARIABLES}  # conftest sets 1
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 2, "TRACKING.ENABLED": "false"})
    done = subprocess.run([sys.executable, "-c", WITH_FAKE_CGROUP, str(root), "train", "--config",
                           str(DEMO), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cpus = len(os.sched_getaffinity(0))
    line = f"a CPU quota of 1 CPU (cgroup cpu.max): torch uses 1 thread, not {cpus}"
    assert "torch threads: 1\n" in done.stdout, done.stdout  # not one per CPU of the affinity
    assert (done.stdout + done.stderr).count(line) == 1, done.stderr
