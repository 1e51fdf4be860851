"""The checkpoint writer: a thread of the training process writes each checkpoint as it was when
submitted, in order, byte for byte what torch.save writes; a full disk fails the job clearly and
keeps the older checkpoints."""
from __future__ import annotations

import resource
import threading
import time

import pytest
import torch

from trainer.checkpoint.files import checkpoint_name, prune
from trainer.hashing import sha256_of
from trainer.checkpoint.state import CheckpointWriteError, capture_rng, load as load_checkpoint, save_atomic
from trainer.checkpoint.writer import CheckpointWriter


def training_like_state(seed: int, momentum: bool = True) -> dict:
    """What engine.training_state holds, in miniature: nested dicts, lists, tuples, tensors of
    several dtypes and shapes (a scalar, an empty one), plain values."""
    g = torch.Generator().manual_seed(seed)
    model = {"conv.weight": torch.randn(16, 3, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(seed),
             "head.bias": torch.randn(7, generator=g).half(), "empty": torch.zeros(0)}
    opt_state = {0: {"momentum_buffer": torch.randn(16, 3, 3, 3, generator=g)}} if momentum else {}
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": [{"lr": 0.01, "params": [0]}]},
            "iteration": seed, "config": {"SOLVER": {"BASE_LR": 0.01}}, "rng": [capture_rng()],
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


def test_the_thread_writes_what_torch_save_writes_in_order(tmp_path):
    saved = []
    before = set(threading.enumerate())
    writer = CheckpointWriter(lambda path, digest: saved.append((path, digest)))
    assert {t.name for t in set(threading.enumerate()) - before} == {"checkpoint-writer"}
    states = [training_like_state(2, momentum=False), training_like_state(5), training_like_state(8)]
    for state in states:
        writer.submit(state, tmp_path / checkpoint_name(state["iteration"]))
    writer.close()
    assert [p.name for p, _ in saved] == ["model_iter2.pth", "model_iter5.pth", "model_iter8.pth"]
    for (path, digest), state in zip(saved, states):
        assert digest == sha256_of(path)
        assert_same(load_checkpoint(path), state)
        reference = tmp_path / "direct" / path.name  # torch.save from this thread: byte for byte the same
        assert save_atomic(state, reference) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct", "model_iter2.pth", "model_iter5.pth",
                                                          "model_iter8.pth"]
    assert not writer._thread.is_alive()


def test_a_checkpoint_holds_the_state_as_it_was_when_submitted(tmp_path):
    writer = CheckpointWriter()
    weight = torch.zeros(1000, 100)
    writer.submit({"model": {"w": weight}, "iteration": 1}, tmp_path / "model_iter1.pth")
    weight.fill_(7)  # the next iteration, while the thread may still be writing
    writer.submit({"model": {"w": weight}, "iteration": 2}, tmp_path / "model_iter2.pth")
    writer.close()
    assert torch.count_nonzero(load_checkpoint(tmp_path / "model_iter1.pth")["model"]["w"]) == 0
    assert torch.all(load_checkpoint(tmp_path / "model_iter2.pth")["model"]["w"] == 7)


def test_submit_returns_while_the_file_is_written(tmp_path):
    """The training thread waits for the host copy only, not for torch.save and fsync."""
    release = threading.Event()
    writer = CheckpointWriter(lambda path, digest: release.wait(30))  # the thread is busy after the file
    writer.submit({"model": {"w": torch.ones(10)}, "iteration": 1}, tmp_path / "model_iter1.pth")
    start = time.monotonic()
    writer.submit({"model": {"w": torch.ones(10)}, "iteration": 2}, tmp_path / "model_iter2.pth")  # queued
    assert time.monotonic() - start < 1.0
    release.set()
    writer.close()
    assert load_checkpoint(tmp_path / "model_iter2.pth")["iteration"] == 2


def test_a_full_disk_fails_the_job_clearly_and_keeps_the_older_checkpoint(tmp_path):
    writer = CheckpointWriter()
    writer.submit({"model": {"w": torch.zeros(10)}, "iteration": 1}, tmp_path / "model_iter1.pth")
    writer.wait()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))  # a 1 MiB file limit (Python ignores SIGXFSZ)
    try:
        writer.submit({"model": {"w": torch.zeros(1 << 20)}, "iteration": 2}, tmp_path / "model_iter2.pth")
        with pytest.raises(CheckpointWriteError) as err:
            writer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert str(err.value).startswith(f"cannot write checkpoint {tmp_path / 'model_iter2.pth'}: File too large")
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_iter1.pth"]
    assert load_checkpoint(tmp_path / "model_iter1.pth")["iteration"] == 1


def test_pruning_keeps_the_newest_up_to_the_one_written_and_spares_pending_uploads(tmp_path):
    names = ["model_iter2.pth", "model_iter5.pth", "model_iter8.pth", "model_iter11.pth", "model_final.pth",
             "model_iter900.pth"]  # 900: a copy from elsewhere, past the job's MAX_ITER
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = prune(tmp_path, keep=1, upto=11, spare={"model_iter5.pth"})  # 5's upload is still to come
    assert sorted(p.name for p in removed) == ["model_iter2.pth", "model_iter8.pth"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model_iter5.pth", "model_iter11.pth",
                                                                  "model_final.pth", "model_iter900.pth"])


def test_a_checkpoint_this_user_may_not_read_is_named_so_and_the_one_before_is_used(tmp_path, monkeypatch, caplog):
    """helper-51: a mode-000 model_iter (as a user other than root) was skipped as "not a complete
    checkpoint archive", which sends the user looking for a torn write. Root reads any mode here, so
    the open is refused the way the kernel refuses it."""
    import zipfile

    from trainer.checkpoint import state as state_module

    older, newer = tmp_path / checkpoint_name(1), tmp_path / checkpoint_name(3)
    save_atomic(training_like_state(1), older)
    save_atomic(training_like_state(3), newer)
    real = zipfile.ZipFile

    def refused(path, *args, **kwargs):
        if str(path) == str(newer):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(state_module.zipfile, "ZipFile", refused)
    with caplog.at_level("WARNING"):
        path, state = state_module.newest_valid(tmp_path)
    assert path == older and state["iteration"] == 1
    assert f"{newer}: cannot be read (Permission denied)" in caplog.text
    assert "not a complete checkpoint archive" not in caplog.text


@pytest.mark.parametrize("held, device, restored", [
    (["own"], 3, "own"),                 # one state: this rank's own GPU, whichever it is here
    (["gpu0", "gpu1"], 1, "gpu1"),       # an earlier checkpoint's every visible GPU: the current one's
    (["gpu0", "gpu1"], 0, "gpu0"),
])
def test_a_gpu_random_state_goes_to_the_current_gpu_only(monkeypatch, held, device, restored):
    """A job checkpointed where its process saw 2 GPUs (a workstation, no CUDA_VISIBLE_DEVICES) and
    resumed where it sees 1 (a pod given one) failed on the device it lacks: every visible GPU's
    state was put back. (No GPU here: torch.cuda's three calls are stood in for.)"""
    from trainer.checkpoint import state as checkpoint_state
    put, cpu = [], capture_rng()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": put.append(s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state put back"))
    checkpoint_state.restore_rng({**cpu, "cuda": held})
    assert put == [restored]
