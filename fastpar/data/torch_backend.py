"""The DataLoader backend: PIL decoding in worker processes, batches from the shared epoch plan.

Each sampler item is a whole planned batch, so workers decode a batch and ship one uint8 tensor
(4x less inter-process traffic than float); the main process normalises it, on the GPU when the
loader's device is one. Augmentation draws from a per-sample RNG seeded from (seed, epoch, position):
the same epoch gives the same crops and flips, and a resumed epoch matches the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from .sharding import sample_seeds
from .sources import LocalFiles, ObjectFiles
from .transforms import CorruptImageError, load_transformed, normalize_batch


class _BatchDecoder(torch.utils.data.Dataset):
    """Dataset whose items are planned batches: (epoch, sample indices, positions) -> decoded batch."""

    def __init__(
        self, source: LocalFiles | ObjectFiles, labels: np.ndarray, size: int, train: bool, seed: int, skip: bool
    ):
        self.source, self.labels, self.size, self.train, self.seed, self.skip = source, labels, size, train, seed, skip

    def __getitem__(
        self, item: tuple[int, np.ndarray, np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, list[str], Exception | None]:
        """(images (B, H, W, 3) uint8, labels, skipped names, the error that stops the epoch or None)."""
        epoch, indices, positions = item
        seeds = sample_seeds(self.seed, epoch, positions)
        pixels, kept, corrupt = [], [], []
        try:
            encoded = self.source.read(indices.tolist())  # objects: fetched in parallel
            for index, data, seed in zip(indices.tolist(), encoded, seeds.tolist(), strict=True):
                try:
                    pixels.append(load_transformed(data, self.source.names[index], self.size, self.train, seed))
                    kept.append(index)
                except CorruptImageError:
                    if not self.skip:
                        raise
                    corrupt.append(self.source.names[index])
        except (CorruptImageError, OSError) as exc:
            # Returned, not raised: a worker's exception reaches the user wrapped in DataLoader's
            # "Caught ... in DataLoader worker process" text; the main process raises it plainly.
            return torch.empty(0), torch.empty(0), [], exc
        if pixels:
            images = torch.from_numpy(np.stack(pixels))  # (B, H, W, 3) uint8
        else:
            images = torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        return images, torch.from_numpy(self.labels[kept]), corrupt, None

    def __len__(self) -> int:  # not used for sampling (the sampler is the plan); keeps DataLoader happy
        return len(self.source.names)


class TorchImageBackend:
    """Decodes planned batches with a torch DataLoader over PIL; ``num_workers=0`` decodes in-process."""

    name = "torch"

    def __init__(
        self,
        source: LocalFiles | ObjectFiles,
        labels: Sequence[int],
        *,
        size: int,
        train: bool,
        seed: int,
        num_workers: int,
        device: torch.device,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        skip_corrupt: bool,
    ):
        self.source = source
        self.decoder = _BatchDecoder(source, np.asarray(labels, dtype=np.int64), size, train, seed, skip_corrupt)
        self.num_workers, self.device, self.mean, self.std = num_workers, device, mean, std

    def iterate(
        self,
        epoch: int,
        batches: list[tuple[np.ndarray, np.ndarray]],
        on_corrupt: Callable[[list[str]], None],
        next_pass: Callable[[], tuple[int, list[tuple[np.ndarray, np.ndarray]]]] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (images, labels) for ``batches`` in order; corrupt files go to ``on_corrupt(paths)``.

        ``next_pass`` (the :class:`~fastpar.data.loader.ImageBackend` signature) is not used: a DataLoader's
        workers prefetch within a pass, and each pass starts its own.
        """
        items = [(epoch, indices, positions) for indices, positions in batches]
        loader = torch.utils.data.DataLoader(
            self.decoder,
            batch_size=None,  # items are batches already: no collation
            sampler=items,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=2 if self.num_workers else None,
        )
        error = None
        for images, labels, corrupt, error in loader:
            if error is not None:
                break
            if corrupt:
                on_corrupt(corrupt)
            yield normalize_batch(images, self.mean, self.std, self.device), labels.to(self.device, non_blocking=True)
        if error is not None:  # raised after the loop, once the DataLoader's workers are shut down
            del loader
            if isinstance(error, CorruptImageError):
                raise CorruptImageError(
                    f"{error}; remove or replace it, or pass on_corrupt='skip' to skip undecodable images"
                )
            raise error

    def describe(self) -> str:
        return f"torch ({self.num_workers} workers, {self.source.describe()})"
