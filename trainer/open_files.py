"""Enough file descriptors for the loader workers, checked before anything starts (no torch here).

Loader workers pass every tensor of a batch to the trainer as a file descriptor: a trainer that runs
out of them hangs or fails mid-job. The soft limit is raised to what the job needs where the hard
limit allows, as `ulimit -n` would; a job the hard limit is too low for is refused in one line."""
from __future__ import annotations

import logging
import resource

from trainer.errors import UserError

log = logging.getLogger(__name__)


def needed(workers: int, images_per_batch: int) -> int:
    """A generous bound (about 3x what the demo holds): each worker has 2 batches in flight and the
    trainer holds 2 more, a few tensors per image."""
    return 128 + 16 * images_per_batch * (workers + 1)


def check_open_files(workers: int, images_per_batch: int) -> None:
    """Without workers the batches never cross a process boundary: nothing to check."""
    if workers <= 0:
        return
    need = needed(workers, images_per_batch)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise too_few(workers, need, hard)
    try:  # an unlimited hard limit still stops at the kernel's fs.nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError) as e:
        raise too_few(workers, need, soft) from e
    log.info("open files limit raised from %d to %d for %d loader workers", soft, need, workers)


def too_few(workers: int, need: int, limit: int) -> UserError:
    return UserError(f"DATA_LOADER.NUM_THREADS {workers} needs about {need} open files and the limit is {limit} "
                     "(ulimit -n): raise it, or set DATA_LOADER.NUM_THREADS 0 to load the batches in the trainer")
