"""A checkpoint's contents: the training state, written atomically, loaded safely.

A checkpoint holds the model, optimizer, LR scheduler, AMP scaler, iteration, config, RNG states and
the dataset's categories (the sampler is a pure function of seed and iteration, so the iteration is
its position). A killed writer leaves the old file or the new one, never half of one; a truncated or
bit-flipped file is skipped when loading, never trained on.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from trainer import torch_load
from trainer.atomic_write import WriteError, forget, temp_name
from trainer.checkpoint.files import local_checkpoints
from trainer.errors import first_line

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint file that is partial, corrupt or not ours."""


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written (disk full, quota, file size limit): one clear line."""

    what = "checkpoint"


# ---- RNG state: python, numpy, torch, cuda (weights_only-loadable types only) ----

def capture_rng() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],  # this rank's own GPU
    }


def restore_rng(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if torch.cuda.is_available() and cuda:
        # One state, the current GPU's; an older checkpoint's list of every visible GPU's: the current one's.
        here = torch.cuda.current_device()
        torch.cuda.set_rng_state(cuda[here] if here < len(cuda) else cuda[0])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- files ----

def to_cpu(obj):
    """A host copy of a state tree (dicts, lists, tuples), so training can go on while it is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class _HashingFile:
    """The file torch.save writes through: it hashes the bytes on their way (torch writes a
    file-like object strictly in order), so the sha256 costs no second read of the file. It also
    keeps the OSError that torch turns into "[enforce fail at inline_container.cc] unexpected pos"
    (ENOSPC, EFBIG, EDQUOT)."""

    def __init__(self, f):
        self._f, self.error, self.sha256 = f, None, hashlib.sha256()

    def write(self, data) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha256.update(data)
        return n

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def save_atomic(state: dict, path: Path) -> str:
    """Write `state` to `path` via temporary file + fsync + rename; return the file's sha256.

    On failure the temporary file is removed, `path` (an older file of that name included) is
    untouched, and a disk error is raised as `CheckpointWriteError`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    sink = None
    try:
        with open(tmp, "wb") as f:
            sink = _HashingFile(f)
            torch.save(state, sink)
            f.flush()
            os.fsync(f.fileno())
        digest = sink.sha256.hexdigest()
        os.replace(tmp, path)
    except BaseException as e:
        cause = sink.error if sink is not None and sink.error is not None else e
        disk = isinstance(cause, OSError) and not isinstance(cause, CheckpointWriteError) and cause.errno is not None
        error = CheckpointWriteError(path, cause) if disk else None  # its free space taken before the unlink
        tmp.unlink(missing_ok=True)
        if error is not None:
            raise error from e
        raise
    finally:
        forget(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return digest


def verify_archive(path: Path) -> None:
    """Every record of a zip-format torch file matches its CRC-32 (torch.load does not check)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except PermissionError as e:  # a complete file that this user may not read
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: not a complete checkpoint archive ({e})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt (record {bad} does not match its CRC-32)")


def load(path: Path, sha256_checked: bool = False) -> dict:
    """Load a checkpoint safely: tensors and plain containers only, never arbitrary pickles.

    A truncated or corrupted file raises CheckpointError before anything is unpickled (its CRCs
    are checked, unless its sha256 was just checked against the one taken as it was written).
    """
    if not sha256_checked:
        verify_archive(path)
    try:
        state = torch_load.load(path)
    except Exception as e:  # truncated zip, tampered pickle, not a torch file
        raise CheckpointError(f"{path}: {type(e).__name__}: {first_line(e)}") from e
    if not isinstance(state, dict) or "model" not in state or "iteration" not in state:
        raise CheckpointError(f"{path}: not a tracktron checkpoint")
    return state


def newest_valid(output_dir: Path, check: Callable[[Path, dict], None] | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads (and passes `check`); partial or corrupt files, and those
    `check` finds unusable (CheckpointError), are skipped with a warning."""
    for path in local_checkpoints(output_dir):
        try:
            state = load(path)
            if check is not None:
                check(path, state)
            return path, state
        except CheckpointError as e:
            log.warning("skipping unusable checkpoint %s", e)
    return None
