"""DataLoader workers: seeded, tied to the trainer's life, deaf to the job's stop signals."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import multiprocessing
import os
import random
import shutil
import signal
import sys

import numpy as np
import torch

from trainer.errors import UserError
from trainer.preemption import STOP_SIGNALS, held

_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def forking():
    """Around the fork of loader workers. The stop signals are blocked on this thread, so a worker
    starts with them blocked: a signal to the whole group in that moment can neither run the
    trainer's handler in the worker nor write to the trainer's signal pipe (the trainer's watch
    thread would take it for a second signal). The trainer's own handler acts once the workers are
    up (held): run inside the fork's hooks, its StopRequested was dropped with logging's lock held."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        with held():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@atexit.register  # after multiprocessing's own exit handler is registered: it runs first
def _kill_leftover_workers() -> None:
    """Workers the job stopped before it could shut them down (a signal while they were starting)
    ignore the SIGTERM that multiprocessing's exit handler sends before it joins them: kill them."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def init_worker(parent_pid: int, worker_id: int) -> None:
    """Each loader worker: seeded, tied to the trainer's life, deaf to the job's stop signals."""
    _bind_to_parent(parent_pid)
    seed = torch.initial_seed() % 2**32  # torch gives each worker base_seed + worker_id
    np.random.seed(seed)
    random.seed(seed)


def _bind_to_parent(parent_pid: int) -> None:
    """Workers never outlive the trainer, and a stop signal is the trainer's to handle.

    - The stop signals are ignored: Ctrl-C, a closed terminal, `kill -- -PGID`, systemd, slurm or
      `tini -g` signal the whole process group, and a worker that dies of it would turn the
      trainer's orderly stop (finish the iteration, checkpoint, KILLED) into a crash. The trainer
      shuts its workers down itself.
    - Linux: SIGKILL when the trainer's main thread (which forks the workers) dies, so a trainer
      killed with SIGKILL or exiting at once on a second signal leaves no worker behind (torch's
      own watchdog notices only after up to 5 s).
    """
    signal.set_wakeup_fd(-1)  # the trainer's signal pipe, inherited through fork: its watch thread reads it
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the fork (forking()); one that came is dropped
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: torch's watchdog still ends the worker
            return
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


SHM = "/dev/shm"


def in_shared_memory(batch):
    """A worker's batch moved into shared memory here, where a failure is the worker's error. torch
    moves it in the queue's feeder thread, which on a full /dev/shm (docker's default is 64 MB) drops
    the batch that the trainer then waits for forever."""
    info = torch.utils.data.get_worker_info()
    if info is None:  # DATA_LOADER.NUM_THREADS 0: the trainer loads its own batches
        return batch
    try:
        map_tensors(lambda tensor: tensor.share_memory_(), batch)
    except RuntimeError as e:
        if "shared memory" not in str(e) and "No space left" not in str(e):
            raise
        raise UserError(_no_shared_memory(info.num_workers, str(e))) from None
    return batch


def check_shared_memory(workers: int) -> None:
    """Before the loader's workers start: their queues lock with POSIX semaphores, files in /dev/shm;
    one already full (or missing) would fail the loader's start with a bare `OSError: [Errno 28]`."""
    if not workers:
        return
    try:  # as many as torch's loader makes: its result queue 3 and done event 5, each worker's queue 3
        held = [multiprocessing.Lock() for _ in range(8 + 3 * workers)]
        del held
    except OSError as e:
        if e.errno == errno.ENOSPC or not os.path.isdir(SHM):
            raise UserError(_no_shared_memory(workers, str(e))) from None
        raise


def map_tensors(fn, value):
    """`value` (tensors in dicts, lists and tuples) with `fn` applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def _no_shared_memory(workers: int, error: str) -> str:
    """torch's error (`unable to allocate shared memory(shm) for file </torch_…>: No space left on
    device (28)`) as the user's line. Only a full or missing /dev/shm is blamed on its size: another
    cause (`Too many open files (24)`, `Permission denied (13)`) is said as torch gives it."""
    try:
        usage = shutil.disk_usage(SHM)
        held = f"{SHM} holds {usage.total / 2**20:.1f} MiB ({usage.free / 2**20:.1f} MiB free)"
    except OSError:
        held = f"{SHM} is missing"
    else:
        if "No space left" not in error:
            reason = error.strip().splitlines()[0].rsplit(": ", 1)[-1]
            return (f"the data loader's workers cannot put a batch in shared memory ({SHM}): {reason}; "
                    "set DATA_LOADER.NUM_THREADS 0 to load the batches in the trainer")
    return (f"the data loader's workers are out of shared memory: {held}, and the {workers} workers of "
            f"DATA_LOADER.NUM_THREADS {workers} pass each batch through it; give the container more "
            "(docker run --shm-size=8g; in Kubernetes an emptyDir of medium Memory on /dev/shm), "
            "or set DATA_LOADER.NUM_THREADS 0 to load the batches in the trainer")


def worker_error(e: BaseException) -> BaseException:
    """A UserError from a loader worker arrives with the worker's traceback; keep its one line."""
    text = str(e)
    if isinstance(e, UserError) and "Original Traceback" in text:
        return type(e)(text.rstrip().splitlines()[-1].split(": ", 1)[-1])
    return e
