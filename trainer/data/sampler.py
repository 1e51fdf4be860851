"""A deterministic, resumable, aspect-grouped infinite batch sampler."""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


class InfiniteGroupedBatchSampler:
    """Endless batches of (index, flip); batch (iteration, rank) is a pure function of the seed.

    Each epoch is a seeded permutation split into aspect groups (landscape/square vs portrait),
    chunked into full batches and shuffled. Global batch `iteration * world_size + rank` maps to
    (epoch, offset) with a fixed number of batches per epoch, so resuming needs only start_iter.
    """

    def __init__(self, aspect_ratios, batch_size: int, seed: int, start_iter: int = 0, rank: int = 0,
                 world_size: int = 1, flip: bool = True, group: bool = True):
        if batch_size < 1 or not 0 <= rank < world_size or not len(aspect_ratios):
            raise ValueError(f"bad sampler arguments: batch {batch_size}, rank {rank}/{world_size}, "
                             f"{len(aspect_ratios)} images")
        self.batch_size, self.seed, self.start_iter = batch_size, int(seed) % 2**64, start_iter
        self.rank, self.world_size, self.flip = rank, world_size, flip
        groups = (np.asarray(aspect_ratios) < 1).astype(np.int64) if group else np.zeros(len(aspect_ratios), np.int64)
        counts = np.bincount(groups, minlength=2)
        if any(0 < c < batch_size for c in counts):  # a group that cannot fill a batch would never be seen
            log.info("aspect grouping off: a group has fewer than %d images (%s)", batch_size, counts.tolist())
            groups[:] = 0
            counts = np.bincount(groups, minlength=2)
        self._groups = groups
        self.batches_per_epoch = max(1, int(sum(c // batch_size for c in counts)))
        self._cache = (None, None)

    def _epoch(self, epoch: int) -> list:
        if self._cache[0] == epoch:
            return self._cache[1]
        n, size = len(self._groups), self.batch_size
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n)
        flips = rng.random(n) < 0.5 if self.flip else np.zeros(n, bool)
        if n < size:  # a dataset smaller than one batch: repeat it
            order = np.resize(order, size)
        batches = []
        for g in (0, 1):
            members = order[self._groups[order] == g]
            full = len(members) // size
            batches.extend(members[: full * size].reshape(full, size))
        batches = [[(int(i), bool(flips[i])) for i in batches[j]] for j in rng.permutation(len(batches))]
        self._cache = (epoch, batches)
        return batches

    def batch_at(self, iteration: int) -> list:
        epoch, offset = divmod(iteration * self.world_size + self.rank, self.batches_per_epoch)
        return self._epoch(epoch)[offset]

    def __iter__(self):
        iteration = self.start_iter
        while True:
            yield self.batch_at(iteration)
            iteration += 1
