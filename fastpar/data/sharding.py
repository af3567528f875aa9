"""The epoch plan: which samples each rank sees, in which batches, in every epoch.

Pure functions of (number of samples, batch size, rank, world size, seed, epoch), shared by every
backend so DALI, the DataLoader and the array loaders cannot disagree. Guarantees, for every policy:

- every rank gets the same number of batches (a rank with one batch fewer would leave the others
  waiting at the last collective);
- the same seed and epoch give the same order; another epoch gives another permutation.

Policies (``last_batch=``):

- ``"partial"``: each sample exactly once per epoch across all ranks; rank shards differ by at most
  one sample; each rank spreads its shard over the same number of batches, full ones first.
- ``"drop"``: only full batches; the samples left over are the tail of this epoch's permutation, so
  they differ from epoch to epoch when shuffling.
- ``"pad"``: only full batches; the permutation is topped up with its own first samples.

Positions: a batch is described by positions into the epoch's (padded) order. The sample index is
``order[position]``; the position also seeds per-sample augmentation, so a padded repeat of a sample
gets its own augmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAST_BATCH_POLICIES = ("partial", "drop", "pad")


@dataclass(frozen=True)
class ShardSpec:
    """Everything that decides one rank's batches, except the epoch."""

    num_samples: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle: bool = True
    last_batch: str = "partial"

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}")
        if self.last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {self.last_batch!r}")
        if self.num_samples < 1:
            raise ValueError("the data set is empty: there is nothing to load")
        n, b, w = self.num_samples, self.batch_size, self.world_size
        if self.last_batch == "partial" and n < w:
            raise ValueError(
                f"last_batch='partial' needs at least one sample per rank, but {n} samples are split over "
                f"{w} ranks; use last_batch='pad' or fewer ranks"
            )
        if self.last_batch == "partial" and b == 1 and n % w:
            raise ValueError(
                f"last_batch='partial' with batch_size=1 cannot give every rank the same number of batches when "
                f"{n} samples do not divide over {w} ranks; use last_batch='pad' or 'drop', or a larger batch"
            )
        if self.last_batch == "drop" and n < b * w:
            raise ValueError(
                f"last_batch='drop' leaves no batch: {n} samples < batch_size {b} x world_size {w}; "
                "use a smaller batch_size or last_batch='partial'/'pad'"
            )

    def __len__(self) -> int:
        return num_batches(self.num_samples, self.batch_size, self.world_size, self.last_batch)


def num_batches(num_samples: int, batch_size: int, world_size: int = 1, last_batch: str = "partial") -> int:
    """Batches per rank per epoch: the same on every rank."""
    per_step = batch_size * world_size
    if last_batch == "drop":
        return num_samples // per_step
    if last_batch == "pad":
        return -(-num_samples // per_step)
    largest_shard = -(-num_samples // world_size)
    return -(-largest_shard // batch_size)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The permutation of sample indices for one epoch (identity without shuffling)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 0x5EED])
    return rng.permutation(num_samples).astype(np.int64)


def _split_sizes(shard_size: int, batches: int, batch_size: int) -> list[int]:
    """Batch sizes that spread ``shard_size`` samples over ``batches`` batches: full first, none empty."""
    sizes = [batch_size] * batches
    sizes[-1] = shard_size - batch_size * (batches - 1)
    if sizes[-1] < 1:  # a shard one smaller than a largest shard that ended with a single-sample batch
        sizes[-2] -= 1 - sizes[-1]
        sizes[-1] = 1
    return sizes


def rank_positions(spec: ShardSpec, epoch: int) -> list[np.ndarray]:
    """This rank's batches for ``epoch``, as positions into the epoch's (padded) order."""
    n, b, w, r = spec.num_samples, spec.batch_size, spec.world_size, spec.rank
    count = len(spec)
    if spec.last_batch == "drop":
        total = count * b * w
    elif spec.last_batch == "pad":
        total = count * b * w
    else:
        total = n
    shard = np.arange(r, total, w, dtype=np.int64)  # strided, like DistributedSampler
    if spec.last_batch != "partial":
        return list(shard.reshape(count, b))
    bounds = np.cumsum([0, *_split_sizes(len(shard), count, b)])
    return [shard[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def rank_batches(spec: ShardSpec, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's batches for ``epoch`` as (sample indices, positions) pairs."""
    order = epoch_order(spec.num_samples, spec.seed, epoch, spec.shuffle)
    batches = rank_positions(spec, epoch)
    # pad: position p past the end repeats order[p mod n]
    return [(order[pos % spec.num_samples], pos) for pos in batches]


def sample_seeds(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """One 63-bit seed per position, for per-sample augmentation that is reproducible and resumable."""
    mix = np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 0xA06]).generate_state(2, np.uint64)
    x = positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + mix[0]
    # splitmix64 finaliser: neighbouring positions get unrelated seeds
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= (x >> np.uint64(31)) ^ mix[1]
    return (x >> np.uint64(1)).astype(np.int64)
