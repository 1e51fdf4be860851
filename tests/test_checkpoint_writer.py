"""The checkpoint writer: a child process writes what the training process would, and when it
cannot (it died, no shared memory, a full disk) nothing is lost and the job hears of it."""
from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from trainer import checkpoint as ckpt
from trainer.checkpoint_writer import CheckpointWriter


def training_like_state(seed: int, momentum: bool = True) -> dict:
    """What engine.training_state holds, in miniature: nested dicts, lists, tuples, tensors of
    several dtypes and shapes (a scalar, an empty one), plain values."""
    g = torch.Generator().manual_seed(seed)
    model = {"conv.weight": torch.randn(16, 3, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(seed),
             "head.bias": torch.randn(7, generator=g).half(), "empty": torch.zeros(0)}
    opt_state = {0: {"momentum_buffer": torch.randn(16, 3, 3, 3, generator=g)}} if momentum else {}
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": [{"lr": 0.01, "params": [0]}]},
            "iteration": seed, "config": {"SOLVER": {"BASE_LR": 0.01}}, "rng": [ckpt.capture_rng()],
            "sampler": {"seed": 3, "next_iter": seed + 1}, "flags": (True, [torch.ones(2, dtype=torch.bool)])}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_the_child_writes_the_same_bytes_as_the_training_process_would(tmp_path):
    saved = []
    writer = CheckpointWriter(lambda path, digest: saved.append((path, digest)))
    assert writer.in_child(timeout=60)  # the child has started (until then, the thread writes)
    assert writer.child_pid not in (None, os.getpid())
    states = [training_like_state(2, momentum=False), training_like_state(5), training_like_state(8)]
    for state in states:  # the tensors change shape after the first: the shared buffer is remade
        writer.submit(state, tmp_path / ckpt.checkpoint_name(state["iteration"]))
        writer.wait()
        # In a session of its own: a Ctrl-C to the job leaves it to finish the job's last checkpoint.
        assert os.getsid(writer.child_pid) == writer.child_pid != os.getsid(0)
    writer.close()
    assert [p.name for p, _ in saved] == ["model_iter2.pth", "model_iter5.pth", "model_iter8.pth"]
    for (path, digest), state in zip(saved, states):
        assert digest == ckpt.sha256_of(path)
        assert_same(ckpt.load(path), state)
        # written by the thread in this process: byte for byte the same file
        reference = tmp_path / "thread" / path.name
        assert ckpt.save_atomic(state, reference) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_iter2.pth", "model_iter5.pth", "model_iter8.pth",
                                                          "thread"]


def test_a_checkpoint_holds_the_state_as_it_was_when_submitted(tmp_path):
    writer = CheckpointWriter()
    assert writer.in_child(timeout=60)
    weight = torch.zeros(1000, 100)
    writer.submit({"model": {"w": weight}, "iteration": 1}, tmp_path / "model_iter1.pth")
    weight.fill_(7)  # the next iteration, while the child may still be writing
    writer.submit({"model": {"w": weight}, "iteration": 2}, tmp_path / "model_iter2.pth")
    writer.close()
    assert torch.count_nonzero(ckpt.load(tmp_path / "model_iter1.pth")["model"]["w"]) == 0
    assert torch.all(ckpt.load(tmp_path / "model_iter2.pth")["model"]["w"] == 7)


def test_when_the_child_dies_the_thread_writes_and_nothing_is_lost(tmp_path, caplog):
    writer = CheckpointWriter()
    assert writer.in_child(timeout=60)
    writer.submit(training_like_state(1), tmp_path / "model_iter1.pth")
    writer.wait()
    os.kill(writer.child_pid, signal.SIGKILL)  # the OOM killer, say
    caplog.set_level(logging.WARNING, "trainer.checkpoint")
    states = {it: training_like_state(it) for it in (2, 3)}
    for it, state in states.items():
        writer.submit(state, tmp_path / f"model_iter{it}.pth")
    writer.close()
    assert "checkpoint writer process ended" in caplog.text
    assert writer.child_pid is None
    for it, state in states.items():
        assert_same(ckpt.load(tmp_path / f"model_iter{it}.pth"), state)
    assert ckpt.load(tmp_path / "model_iter1.pth")["iteration"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_full_disk_in_the_child_fails_the_job_clearly_and_keeps_the_older_checkpoint(tmp_path):
    writer = CheckpointWriter()
    assert writer.in_child(timeout=60)
    writer.submit({"model": {"w": torch.zeros(10)}, "iteration": 1}, tmp_path / "model_iter1.pth")
    writer.wait()
    resource.prlimit(writer.child_pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # a 1 MiB file limit
    writer.submit({"model": {"w": torch.zeros(1 << 20)}, "iteration": 2}, tmp_path / "model_iter2.pth")
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        writer.wait()
    assert str(err.value).startswith(f"cannot write checkpoint {tmp_path / 'model_iter2.pth'}: File too large")
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_iter1.pth"]
    assert ckpt.load(tmp_path / "model_iter1.pth")["iteration"] == 1


JOB = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from trainer.checkpoint_writer import CheckpointWriter
    writer = CheckpointWriter()
    assert writer.in_child(timeout=60)
    writer.submit({"model": {"w": torch.ones(1000)}, "iteration": 4}, Path(sys.argv[1]) / "model_iter4.pth")
    writer.wait()
    print(writer.child_pid, flush=True)
    time.sleep(60)
""")  # no `if __name__ == "__main__"`: the child must not run this script again


def test_a_checkpoint_before_the_child_has_started_is_written_at_once_by_the_thread(tmp_path):
    writer = CheckpointWriter()
    assert writer.child_pid is None  # started by the first checkpoint, not before: a resume has the cores
    assert not writer.in_child()
    os.kill(writer.child_pid, signal.SIGSTOP)  # a child that takes its time importing torch
    try:
        writer.submit({"model": {"w": torch.ones(10)}, "iteration": 0}, tmp_path / "model_iter0.pth")
        waiting = threading.Thread(target=writer.wait)
        waiting.start()
        waiting.join(60)
        assert not waiting.is_alive(), "the first checkpoint waited for the child to start"
        assert ckpt.load(tmp_path / "model_iter0.pth")["iteration"] == 0
    finally:
        os.kill(writer.child_pid, signal.SIGCONT)
    assert writer.in_child(timeout=60)  # and the next ones go to the child
    writer.close()


def test_the_child_dies_with_a_killed_job(tmp_path):
    job = subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(job.stdout.readline())
    job.kill()
    job.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert ckpt.load(tmp_path / "model_iter4.pth")["iteration"] == 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read() if os.path.exists(f"/proc/{pid}/stat") else ""
    return " Z " not in stat  # a zombie has exited


def test_no_memory_for_the_shared_buffer_falls_back_to_the_thread(tmp_path, monkeypatch, caplog):
    writer = CheckpointWriter()
    assert writer.in_child(timeout=60)

    def no_space(fd, offset, length):  # the memory cgroup's limit, say
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    caplog.set_level(logging.WARNING, "trainer.checkpoint")
    writer.submit({"model": {"w": torch.ones(1 << 20)}, "iteration": 3}, tmp_path / "model_iter3.pth")
    writer.close()
    assert "no memory for the checkpoint's shared buffer" in caplog.text and "No space left" in caplog.text
    assert writer.child_pid is None
    assert torch.all(ckpt.load(tmp_path / "model_iter3.pth")["model"]["w"] == 1)
