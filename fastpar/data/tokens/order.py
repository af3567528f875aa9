"""The global order of token windows, the same at every world size, and the cursor that resumes it.

A shard of ``n`` tokens holds ``(n - 1) // seq_len`` windows of ``seq_len + 1`` tokens, window ``k``
starting at token ``k * seq_len``: consecutive windows share only their boundary token, so the inputs
(``window[:-1]``) of all windows are disjoint and every token but a shard's first is a label once.
Windows never cross a shard boundary.

Epoch ``e`` visits the windows in one permutation fixed by ``(seed, e)`` (``fastpar.data.sharding``'s
``epoch_order``). Global batch ``i`` is the positions ``[i*B*W, (i+1)*B*W)`` of that permutation (``B``
the per-rank batch size, ``W`` the world size) and rank ``r`` takes the slice ``[r*B, (r+1)*B)`` of it.
So the stream of samples, read global batch after global batch, is the permutation itself whatever
``W`` is; only where it is cut into batches differs. The positions left after the last full global
batch (fewer than ``B*W``) are dropped for that epoch.

The cursor is ``(epoch, samples consumed)``: resuming at another world size starts the next global batch
at the first unconsumed position, so no sample is repeated or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sharding import epoch_order
from .source import TokenDataError, TokenShard


@dataclass(frozen=True)
class WindowTable:
    """Where each window lives: window ``g`` is in shard ``shard_of(g)`` at token ``start_of(g)``."""

    seq_len: int
    first_window: np.ndarray  # (num_shards + 1,): cumulative window counts

    @classmethod
    def build(cls, shards: list[TokenShard], seq_len: int) -> WindowTable:
        if seq_len < 1:
            raise TokenDataError(f"seq_len must be at least 1, got {seq_len}")
        counts = []
        for shard in shards:
            if len(shard.tokens) < seq_len + 1:
                raise TokenDataError(
                    f"{shard.name} holds {len(shard.tokens)} tokens, fewer than one window of seq_len + 1 = "
                    f"{seq_len + 1}: use a smaller seq_len, or prepare larger shards (--shard-tokens)"
                )
            counts.append((len(shard.tokens) - 1) // seq_len)
        return cls(seq_len, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    def __len__(self) -> int:
        return int(self.first_window[-1])

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, first token) of each window."""
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        return shard, (windows - self.first_window[shard]) * self.seq_len


@dataclass(frozen=True)
class GlobalOrder:
    """Which windows rank ``rank`` of ``world_size`` reads, batch after batch, in each epoch."""

    num_windows: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise TokenDataError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TokenDataError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}")
        if self.num_windows < self.global_batch:
            raise TokenDataError(
                f"the data holds {self.num_windows} windows, fewer than one global batch of batch_size "
                f"{self.batch_size} x world_size {self.world_size}: use a smaller batch_size or seq_len, or more data"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def num_batches(self, consumed: int = 0) -> int:
        """Batches per rank left in an epoch of which ``consumed`` samples are done (the same on every rank)."""
        return max(0, self.num_windows - consumed) // self.global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        return epoch_order(self.num_windows, self.seed, epoch, self.shuffle)

    def rank_windows(self, permutation: np.ndarray, consumed: int, batch: int) -> np.ndarray:
        """This rank's windows in batch ``batch`` of the epoch counted from position ``consumed``."""
        start = consumed + batch * self.global_batch + self.rank * self.batch_size
        return permutation[start : start + self.batch_size]


__all__ = ["GlobalOrder", "WindowTable"]
