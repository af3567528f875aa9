"""ZeRO-2's staging rule, in one place for the runtime (``fastpar.zero.gradient_pool``, which explains it) and the
planner (``strategy_memory``): how many pooled buffers, how large, and how buckets are split to fit them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_STAGING_NUMEL", "POOL_CAPACITY", "split_to_fit", "staging_numel"]

# Buffers per dtype. One bucket is being filled by backward while the one launched before it is on the wire and
# the one before that is being summed: fewer would make backward wait for every bucket's exchange in turn.
POOL_CAPACITY = 3
# Below this a buffer's messages cost more than its memory saves (4 KiB of fp32): only toy models take it.
MIN_STAGING_NUMEL = 1024


def staging_numel(
    gradient_numel: int,
    itemsize: int,
    world_size: int,
    cap_bytes: int,
    with_scratch: bool,
    capacity: int = POOL_CAPACITY,
) -> int:
    """Elements of one pooled buffer: ``capacity`` of them (and their scratch) within ``min(2 x cap_bytes,
    G (N - 1) / (2 N))``, G being ``gradient_numel`` elements of ``itemsize`` bytes; a multiple of ``world_size``."""
    n = world_size
    budget = min(2 * cap_bytes, gradient_numel * itemsize * (n - 1) / (2 * n))
    per_element = itemsize * ((2 * n - 1) / n if with_scratch and n > 1 else 1)
    numel = max(int(budget / (capacity * per_element)), MIN_STAGING_NUMEL)
    return max(numel // n * n, n)


def split_to_fit(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Runs of consecutive indices of ``sizes`` (members of one bucket, in order) whose total stays within
    ``limit``; a member larger than ``limit`` is a run of its own."""
    runs: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not runs or total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs
