"""``token_loader``: batches of next-token windows from memory-mapped token shards, for one rank.

Cursor semantics are those of every fastpar.data loader: a pass yields the rest of the current epoch
and moves the cursor to the next epoch; ``set_epoch(e)`` moves it to the start of epoch ``e``;
``state_dict()``/``load_state_dict()`` save and restore it, and the next pass starts where the saved one
stopped. A pass abandoned part-way (``break``) starts that epoch again from its first batch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..loader import resolve_rank
from ..remote.store import StoreOptions
from .order import GlobalOrder, WindowTable
from .packing import document_ids, position_ids
from .source import TokenDataError, TokenSource, open_token_source

Batch = tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]

_CHUNK_BATCHES = 64  # batches whose window starts are computed at once (memory: 64 x batch_size ints)


class TokenLoader:
    """Iterate for batches; ``len()`` is the batches per rank in a whole epoch. See :func:`token_loader`."""

    def __init__(
        self,
        source: TokenSource,
        order: GlobalOrder,
        table: WindowTable,
        *,
        vocab_size: int | None = None,
        eot_token: int | None = None,
        device: str | torch.device | None = None,
    ):
        self.source, self.order, self.table = source, order, table
        self.vocab_size, self.eot_token = vocab_size, eot_token
        self.device = torch.device(device) if device is not None else None
        # plain ndarray views of the maps: slicing an np.memmap builds a memmap object per window
        self._arrays = [np.asarray(shard.tokens).view(np.ndarray) for shard in source.shards]
        self._row_dtype = np.result_type(*(shard.tokens.dtype for shard in source.shards))
        self._signed = np.issubdtype(self._row_dtype, np.signedinteger)
        # each batch's ids checked against vocab_size unless nothing stored can reach it: the dtype's range is
        # below it, or the data was written by `fastpar data prepare` with a vocabulary no larger
        reachable = np.iinfo(self._row_dtype).max + 1
        if source.vocab_size is not None:
            reachable = min(reachable, source.vocab_size)
        self._check_vocab = vocab_size is not None and vocab_size < reachable
        self._on_cpu = self.device is None or self.device.type == "cpu"
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch already yielded (by all ranks together)
        self._resume_at: int | None = None  # set by load_state_dict: where the next pass starts

    @property
    def seq_len(self) -> int:
        return self.table.seq_len

    @property
    def batch_size(self) -> int:
        return self.order.batch_size

    def __len__(self) -> int:
        return self.order.num_batches()

    def for_rank(self, rank: int, world_size: int) -> TokenLoader:
        """This loader for rank ``rank`` of ``world_size`` (same data, order and cursor): what ``fastpar.Trainer``
        does with a loader made before its workers exist."""
        if (rank, world_size) == (self.order.rank, self.order.world_size):
            return self
        if self.order.world_size != 1:
            raise TokenDataError(
                f"this token loader was made for world_size={self.order.world_size}, the run has {world_size} "
                "processes; make it without rank/world_size, or pass a factory fn(rank, world_size) -> loader"
            )
        mine = copy.copy(self)
        mine.order = dataclasses.replace(self.order, rank=rank, world_size=world_size)
        return mine

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next pass (as DistributedSampler.set_epoch)."""
        self.epoch, self.consumed, self._resume_at = int(epoch), 0, None

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.epoch, self._resume_at or 0
        self._resume_at = None
        order, span = self.order, self.seq_len + 1
        count, size = order.num_batches(start), order.batch_size
        # this rank's windows of the pass, (count, batch_size): a strided view of the permutation
        mine = order.permutation(epoch)[start : start + count * order.global_batch]
        mine = mine.reshape(count, order.world_size, size)[:, order.rank, :]
        self.consumed = start
        arrays, tokens, step = self._arrays, self._arrays[0], order.global_batch
        # nothing to check, pack or move: the batch is the widened rows (the common case, kept inline)
        plain = not (self._check_vocab or self._signed) and self.eot_token is None and self._on_cpu
        for chunk in range(0, count, _CHUNK_BATCHES):
            # where the next batches' windows start, located together: one numpy call per chunk, not per batch
            windows = mine[chunk : chunk + _CHUNK_BATCHES].ravel()
            if len(arrays) == 1:  # one shard (a nanoGPT .bin): no lookup
                shards, firsts = None, (windows * self.seq_len).tolist()
            else:
                shard_of, first = self.table.locate(windows)
                shards, firsts = shard_of.tolist(), first.tolist()
            for offset in range(0, len(firsts), size):
                # the windows as stored (uint16: a quarter of int64's bytes to check), widened once into x and y
                rows = np.empty((size, span), dtype=self._row_dtype)  # (B, L + 1)
                if shards is None:
                    for row, t in enumerate(firsts[offset : offset + size]):
                        rows[row] = tokens[t : t + span]  # pages in only this window
                else:
                    for row, (s, t) in enumerate(
                        zip(shards[offset : offset + size], firsts[offset : offset + size], strict=True)
                    ):
                        rows[row] = arrays[s][t : t + span]
                if plain:
                    out = (
                        torch.from_numpy(rows[:, :-1].astype(np.int64)),
                        torch.from_numpy(rows[:, 1:].astype(np.int64)),
                    )
                else:
                    out = self._batch(rows, shards[offset : offset + size] if shards is not None else None)
                self.consumed += step
                yield out
        self.epoch, self.consumed = epoch + 1, 0

    def _batch(self, rows: np.ndarray, shard_of: list[int] | None) -> Batch:
        """The batch of the windows ``rows`` (from shards ``shard_of``; None: the one shard)."""
        if self._check_vocab or self._signed:
            self._check_ids(rows, shard_of if shard_of is not None else [0] * len(rows))
        inputs, labels = rows[:, :-1].astype(np.int64), rows[:, 1:].astype(np.int64)
        if self.eot_token is None:
            return self._to_device(torch.from_numpy(inputs)), self._to_device(torch.from_numpy(labels))
        docs = document_ids(inputs, self.eot_token)
        named = {"input_ids": inputs, "labels": labels, "position_ids": position_ids(docs), "document_ids": docs}
        return {name: self._to_device(torch.from_numpy(value)) for name, value in named.items()}

    def _check_ids(self, rows: np.ndarray, shard_of: list[int]) -> None:
        if self._check_vocab and (top := int(rows.max())) >= self.vocab_size:
            bad = int(np.argwhere(rows == top)[0][0])
            raise TokenDataError(
                f"token id {top} in {self.source.shards[shard_of[bad]].name} is not below vocab_size "
                f"{self.vocab_size}: the data was tokenized with another tokenizer, or read with the wrong dtype; "
                "pass the vocab_size of the tokenizer that wrote it"
            )
        if self._signed and int(rows.min()) < 0:  # only a signed .npy can hold one
            raise TokenDataError(
                f"a negative token id in {self.source.shards[shard_of[int(np.argwhere(rows < 0)[0][0])]].name}: "
                "token ids are 0 or more; check how the array was written"
            )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._on_cpu else tensor.pin_memory().to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        """The cursor (epoch, global samples consumed) and the order it refers to."""
        return {
            "epoch": self.epoch,
            "samples_consumed": self.consumed,
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
            "num_windows": self.order.num_windows,
            "seq_len": self.seq_len,
            "world_size": self.order.world_size,  # informative: resuming at another world size is exact
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after the saved samples, at this loader's world size and batch size."""
        current = {
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
            "num_windows": self.order.num_windows,
            "seq_len": self.seq_len,
        }
        differ = {k: (state[k], v) for k, v in current.items() if k in state and state[k] != v}
        if differ:
            detail = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in differ.items())
            raise TokenDataError(
                f"cannot resume exactly: the saved token loader state refers to another order ({detail}). Use the "
                "same data, seq_len, seed and shuffle, or call set_epoch() to start an epoch"
            )
        consumed = int(state["samples_consumed"])
        if not 0 <= consumed <= self.order.num_windows:
            raise TokenDataError(f"saved samples_consumed {consumed} is outside 0..{self.order.num_windows}")
        self.epoch, self.consumed, self._resume_at = int(state["epoch"]), consumed, consumed


def token_loader(
    source: str | Path,
    *,
    seq_len: int,
    batch_size: int,
    split: str | None = None,
    dtype: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    vocab_size: int | None = None,
    eot_token: int | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | Path | None = None,
    cache_max_bytes: int | str | None = None,
    endpoint_url: str | None = None,
    storage: StoreOptions | None = None,
) -> TokenLoader:
    """A loader of ``(x, y)`` next-token batches from tokenized text, for this rank of a data-parallel job.

    ``source``: a ``.bin`` file of raw little-endian tokens (nanoGPT's format; ``dtype`` "uint16" or
    "uint32"), a 1-D ``.npy`` array, a folder or glob of such shards, a folder written by
    ``fastpar data prepare`` / :func:`prepare_tokens` (its ``index.json`` gives the dtype and vocabulary;
    ``split`` picks "train" (the default) or "val"), or any of these in an object store:
    ``s3://bucket/prefix`` (downloaded once into ``cache_dir``, default ``~/.cache/fastpar/tokens``,
    shared by the ranks; ``endpoint_url``/``storage`` as for :func:`image_loader`). Shards are
    memory-mapped, never read whole.

    Each batch is ``batch_size`` windows of ``seq_len + 1`` tokens: ``x = window[:-1]``, ``y = window[1:]``,
    int64 ``(batch_size, seq_len)`` tensors (on ``device``, default CPU). Windows start every ``seq_len``
    tokens of a shard and never cross shards. The windows are visited in one permutation per
    ``(seed, epoch)`` that does not depend on the world size: global batch ``i`` is samples
    ``[i*B*W, (i+1)*B*W)`` of it and rank ``r`` takes the ``r``-th slice of ``batch_size``, so every rank
    gets the same number of batches and ranks never share a window. **The end of each epoch that does not
    fill a global batch (fewer than batch_size x world_size windows) is dropped.** ``rank``/``world_size``
    default to torch.distributed's when it is initialised, else 0 and 1.

    ``set_epoch(e)`` reshuffles like DistributedSampler's. ``state_dict()`` records the epoch, the global
    samples consumed and the seed; ``load_state_dict()`` resumes after them exactly, also at another world
    size or batch size: no sample is repeated or skipped.

    ``eot_token``: the end-of-text id; given, each batch is a dict ``{"input_ids", "labels", "position_ids",
    "document_ids"}`` whose position ids restart after each end-of-text token; build the attention mask with
    :func:`document_mask`. ``vocab_size`` (default: the index's): a token id at or above it raises a
    :class:`TokenDataError` at the first batch that holds one. Batches are checked only where the data could
    hold such an id: not when the dtype cannot (``uint16`` and ``vocab_size >= 65536``) nor when ``fastpar data
    prepare`` wrote it with a vocabulary no larger (its tokenizer's ids are below it); where it runs, the check
    costs 12-18% of the loader's time (``fastpar bench data --tokens``, row ``fastpar_vocab``). Unreadable data
    (a file whose length is not a whole number of tokens, a shard shorter than ``seq_len + 1``, a folder or glob
    with no shards) raises one when the loader is made.
    """
    if seq_len < 1 or batch_size < 1:
        raise TokenDataError(f"seq_len and batch_size must be at least 1, got {seq_len} and {batch_size}")
    rank, world_size = resolve_rank(rank, world_size)
    if endpoint_url:
        storage = StoreOptions(**{**(storage or StoreOptions()).__dict__, "endpoint_url": endpoint_url})
    tokens = open_token_source(
        source, split=split, dtype=dtype, cache_dir=cache_dir, cache_max_bytes=cache_max_bytes, storage=storage
    )
    table = WindowTable.build(tokens.shards, seq_len)
    order = GlobalOrder(len(table), batch_size, rank, world_size, seed, shuffle)
    vocab_size = vocab_size if vocab_size is not None else tokens.vocab_size
    return TokenLoader(tokens, order, table, vocab_size=vocab_size, eot_token=eot_token, device=device)


__all__ = ["TokenLoader", "token_loader"]
