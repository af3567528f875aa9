"""The token-window streams that ``fastpar bench data --tokens`` times, and how it checks and measures them.

Every stream yields int64 ``(x, y)`` tensors of shape ``(batch, seq_len)`` from the windows of one ``.bin``
file of uint16 tokens: ``seq_len + 1`` tokens starting every ``seq_len`` tokens, in a random order per
epoch, without end (epoch after epoch). ``make_stream`` builds one by variant name: ``floor``, ``fastpar``,
``dataloader`` / ``dataloader_wN`` and ``streaming`` (MosaicML Streaming, only where it imports).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..harness import WrongResultError

_CHUNK_TOKENS = 1 << 23  # tokens generated and written at a time


@dataclass(frozen=True)
class WindowShape:
    """What every stream yields: ``batch`` windows of ``seq_len`` (+1) tokens below ``vocab``, in ``seed``'s order."""

    seq_len: int
    batch: int
    vocab: int
    seed: int = 0


def write_corpus(path: Path, size_mb: float, vocab: int, seed: int) -> Path:
    """A ``.bin`` file of ``size_mb`` MiB of random uint16 token ids below ``vocab``."""
    rng = np.random.default_rng(seed)
    left = int(size_mb * (1 << 20)) // 2
    with open(path, "wb") as out:
        while left > 0:
            count = min(left, _CHUNK_TOKENS)
            rng.integers(0, vocab, size=count, dtype=np.uint16).tofile(out)
            left -= count
    return path


class WindowDataset(torch.utils.data.Dataset):
    """The peer's map-style dataset: index ``i`` -> ``(x, y)`` of window ``i`` of a memory-mapped ``.bin``."""

    def __init__(self, path: Path, seq_len: int):
        self.path, self.seq_len = path, seq_len
        self.count = (path.stat().st_size // 2 - 1) // seq_len
        self._tokens: np.ndarray | None = None  # opened in the process that reads (each worker its own)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = index * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def _floor(path: Path, shape: WindowShape) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    tokens = np.memmap(path, dtype=np.uint16, mode="r").view(np.ndarray)  # slices without memmap objects
    length, batch = shape.seq_len, shape.batch
    count = (len(tokens) - 1) // length
    rng = np.random.default_rng(shape.seed)
    while True:
        starts = rng.permutation(count) * length
        for first in range(0, count - batch + 1, batch):
            # each token read once as stored, widened once into each output: the fewest bytes moved
            rows = np.empty((batch, length + 1), dtype=tokens.dtype)  # (B, L + 1)
            for row, start in enumerate(starts[first : first + batch].tolist()):
                rows[row] = tokens[start : start + length + 1]
            yield torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))


def _endless(loader) -> Iterator:
    while True:
        yield from loader


def _fastpar(path: Path, shape: WindowShape) -> Iterator:
    from ...data import token_loader

    loader = token_loader(
        path, seq_len=shape.seq_len, batch_size=shape.batch, dtype="uint16", vocab_size=shape.vocab, seed=shape.seed
    )
    return _endless(loader)


def _dataloader(path: Path, shape: WindowShape, workers: int) -> Iterator:
    loader = torch.utils.data.DataLoader(
        WindowDataset(path, shape.seq_len),
        batch_size=shape.batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(shape.seed),
    )
    return _endless(loader)


def streaming_problem() -> str | None:
    """Why MosaicML Streaming cannot be measured here, or None when it imports."""
    try:
        import streaming  # noqa: F401
    except Exception as exc:  # not installed, or a dependency of it (torchvision) fails to load
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def write_mds(path: Path, out: Path, shape: WindowShape) -> Path:
    from streaming import MDSWriter

    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    with MDSWriter(out=str(out), columns={"tokens": "bytes"}, compression=None) as writer:
        for start in range(0, ((len(tokens) - 1) // shape.seq_len) * shape.seq_len, shape.seq_len):
            writer.write({"tokens": tokens[start : start + shape.seq_len + 1].tobytes()})
    return out


def _collate_windows(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.frombuffer(s["tokens"], dtype=np.uint16) for s in samples]).astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def _streaming(mds: Path, shape: WindowShape) -> Iterator:
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(mds), shuffle=True, shuffle_seed=shape.seed, batch_size=shape.batch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=shape.batch, collate_fn=_collate_windows, drop_last=True)
    return _endless(loader)


def make_stream(variant: str, path: Path, shape: WindowShape) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The endless batch stream of ``variant`` over the corpus at ``path`` (an MDS folder for streaming)."""
    if variant == "floor":
        return _floor(path, shape)
    if variant == "fastpar":
        return _fastpar(path, shape)
    if variant == "streaming":
        return _streaming(path, shape)
    if variant.startswith("dataloader"):
        return _dataloader(path, shape, int(variant.removeprefix("dataloader").removeprefix("_w") or 0))
    raise ValueError(f"unknown variant {variant!r}")


def anonymous_kib() -> int | None:
    """This process's anonymous resident memory in KiB (``Anonymous:`` of smaps_rollup), None where unknown."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    return None


def _memory_child(variant: str, path: Path, shape: WindowShape, batches: int, conn) -> None:
    torch.set_num_threads(1)
    before = anonymous_kib()
    stream = make_stream(variant, path, shape)
    for _ in range(batches):
        next(stream)
    conn.send((before, anonymous_kib()))
    conn.close()


def measure_memory(variant: str, path: Path, shape: WindowShape, batches: int) -> tuple[int, int]:
    """(anonymous KiB before the loader is made, after ``batches`` batches) in a fresh process."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_memory_child, args=(variant, path, shape, batches, send))
    proc.start()
    send.close()
    try:
        if not receive.poll(600):
            raise WrongResultError(f"{variant}: the memory measurement did not finish in 600 s")
        return receive.recv()
    except EOFError:
        raise WrongResultError(f"{variant}: the memory measurement process failed (exit {proc.exitcode})") from None
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def window_heads(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """The first token of every window of ``tokens``, to find a batch's rows by."""
    count = (len(tokens) - 1) // seq_len
    return np.array(tokens[: count * seq_len].reshape(count, seq_len)[:, 0])


def check_batch(
    variant: str, x: torch.Tensor, y: torch.Tensor, tokens: np.ndarray, heads: np.ndarray, shape: WindowShape
) -> None:
    """Raise WrongResultError unless ``(x, y)`` are whole windows of ``tokens`` at window starts (``heads``:
    :func:`window_heads`)."""
    want = (shape.batch, shape.seq_len)
    if x.dtype != torch.int64 or y.dtype != torch.int64 or tuple(x.shape) != want or tuple(y.shape) != want:
        raise WrongResultError(
            f"{variant}: batch {x.dtype} {tuple(x.shape)} / {y.dtype} {tuple(y.shape)}, want int64 {want}"
        )
    if not (x.is_contiguous() and y.is_contiguous()):
        raise WrongResultError(f"{variant}: x and y must be contiguous tensors, as a model takes them")
    if not torch.equal(x[:, 1:], y[:, :-1]):
        raise WrongResultError(f"{variant}: y is not x shifted by one token")
    if int(x.max()) >= shape.vocab or int(y.max()) >= shape.vocab or int(x.min()) < 0:
        raise WrongResultError(f"{variant}: a token id outside 0..{shape.vocab - 1}")
    length = shape.seq_len
    for row in range(want[0]):
        # the windows whose first token matches, then the one whose tokens all do
        candidates = np.flatnonzero(heads == int(x[row, 0]))
        found = any(
            np.array_equal(tokens[k * length : k * length + length + 1][1:], y[row].numpy())
            and np.array_equal(tokens[k * length : k * length + length], x[row].numpy())
            for k in candidates.tolist()
        )
        if not found:
            raise WrongResultError(f"{variant}: row {row} of a batch is not a window of the corpus at a window start")
