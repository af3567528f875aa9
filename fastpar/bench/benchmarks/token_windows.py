"""The token-window streams that ``fastpar bench data --tokens`` times, and how it checks and measures them.

Every stream yields int64 ``(x, y)`` tensors of shape ``(batch, seq_len)`` from the windows of one ``.bin``
file of uint16 tokens: ``seq_len + 1`` tokens starting every ``seq_len`` tokens, in a random order per
epoch, without end (epoch after epoch). ``make_stream`` builds one by variant name: ``floor``, ``fastpar``,
``fastpar_vocab``, ``dataloader`` / ``dataloader_wN`` and ``streaming`` (MosaicML Streaming, only where it
imports).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import types
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
        starts = (rng.permutation(count) * length).tolist()  # the epoch's window starts as ints, made once
        for first in range(0, count - batch + 1, batch):
            # each token read once as stored, widened once into each output: the fewest bytes moved
            rows = np.empty((batch, length + 1), dtype=tokens.dtype)  # (B, L + 1)
            for row, start in enumerate(starts[first : first + batch]):
                rows[row] = tokens[start : start + length + 1]
            yield torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))


def _endless(loader) -> Iterator:
    while True:
        yield from loader


def _fastpar(path: Path, shape: WindowShape, vocab_size: int | None) -> Iterator:
    from ...data import token_loader

    loader = token_loader(
        path, seq_len=shape.seq_len, batch_size=shape.batch, dtype="uint16", vocab_size=vocab_size, seed=shape.seed
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


_STOOD_IN: list[str] = []  # the torchvision names stood in for while streaming was imported (streaming_note)


def _import_streaming():
    """MosaicML Streaming's module. Its package imports its vision datasets, which need torchvision; where torchvision
    is missing or its wheel does not load beside this torch (a CUDA build's operators beside the CPU torch), the
    two names that import reads are stood in for while it imports, and removed again: the benchmark measures only
    ``StreamingDataset`` over bytes."""
    import importlib.util
    import sys

    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    if importlib.util.find_spec("streaming") is None:
        raise ModuleNotFoundError("No module named 'streaming'")
    try:
        import streaming
    except Exception as exc:
        if not _torchvision_broken():
            raise
        saved = {n: m for n, m in sys.modules.items() if n == "torchvision" or n.startswith("torchvision.")}
        for name in [n for n in sys.modules if n.startswith("streaming")] + list(saved):
            del sys.modules[name]  # half-imported by the failed attempt
        stand_in = _torchvision_stand_in()
        sys.modules.update(stand_in)
        try:
            import streaming
        except Exception:
            raise exc from None
        finally:
            for name in stand_in:  # other code must not find a torchvision without a spec
                del sys.modules[name]
            sys.modules.update(saved)
        _STOOD_IN[:] = sorted(stand_in)
    return streaming


def _torchvision_broken() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:
        return True
    return False


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
    root, datasets, transforms, functional = (types.ModuleType(name) for name in names)
    datasets.VisionDataset = type("VisionDataset", (torch.utils.data.Dataset,), {})
    functional.to_tensor = None  # streaming's image datasets only; never called here
    root.datasets, root.transforms, transforms.functional = datasets, transforms, functional
    return dict(zip(names, (root, datasets, transforms, functional), strict=True))


def streaming_problem() -> str | None:
    """Why MosaicML Streaming cannot be measured here, or None when it imports."""
    try:
        _import_streaming()
    except Exception as exc:  # not installed, or a dependency of it fails to load
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def streaming_note() -> str | None:
    """What the streaming row ran with, where torchvision had to be stood in for."""
    if _STOOD_IN:
        return (
            "streaming: torchvision is missing or does not load beside this torch, so the two names streaming's vision module "
            "imports were stood in for while it imported (not used: only StreamingDataset over bytes is measured)"
        )
    return None


def write_mds(path: Path, out: Path, shape: WindowShape) -> Path:
    MDSWriter = _import_streaming().MDSWriter

    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    with MDSWriter(out=str(out), columns={"tokens": "bytes"}, compression=None) as writer:
        for start in range(0, ((len(tokens) - 1) // shape.seq_len) * shape.seq_len, shape.seq_len):
            writer.write({"tokens": tokens[start : start + shape.seq_len + 1].tobytes()})
    return out


def _collate_windows(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.frombuffer(s["tokens"], dtype=np.uint16) for s in samples]).astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def _streaming(mds: Path, shape: WindowShape) -> Iterator:
    StreamingDataset = _import_streaming().StreamingDataset

    dataset = StreamingDataset(local=str(mds), shuffle=True, shuffle_seed=shape.seed, batch_size=shape.batch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=shape.batch, collate_fn=_collate_windows, drop_last=True)
    return _endless(loader)


def make_stream(variant: str, path: Path, shape: WindowShape) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The endless batch stream of ``variant`` over the corpus at ``path`` (an MDS folder for streaming)."""
    if variant == "floor":
        return _floor(path, shape)
    if variant == "fastpar":  # as a raw nanoGPT .bin is read: no vocabulary to check against
        return _fastpar(path, shape, None)
    if variant == "fastpar_vocab":  # every batch's ids checked against vocab_size
        return _fastpar(path, shape, shape.vocab)
    if variant == "streaming":
        return _streaming(path, shape)
    if variant.startswith("dataloader"):
        return _dataloader(path, shape, int(variant.removeprefix("dataloader").removeprefix("_w") or 0))
    raise ValueError(f"unknown variant {variant!r}")


class ChildStream:
    """A variant's stream in a spawned process of its own: for loaders with background threads (Streaming's
    prefetch pool keeps working after a batch is taken, and in this process it would slow the next variant's
    timed call). ``next()`` brings one batch back; ``take(n)`` takes ``n`` batches there and brings none."""

    def __init__(self, variant: str, path: Path, shape: WindowShape):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_stream_child, args=(variant, path, shape, child), daemon=True)
        self._proc.start()
        child.close()
        self.variant = variant
        self._ask(None)  # the stream is made before the next one starts (Streaming names its shared memory by scanning)

    def _ask(self, count: int | None):
        if count is not None:
            self._conn.send(count)
        if not self._conn.poll(600):
            raise WrongResultError(f"{self.variant}: its process gave no batches in 600 s")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise WrongResultError(f"{self.variant}: its process ended (exit {self._proc.exitcode})") from None
        if not ok:
            raise WrongResultError(f"{self.variant}: {value}")
        return value

    def __iter__(self) -> ChildStream:
        return self

    def __next__(self):
        return self._ask(0)

    def take(self, count: int) -> None:
        self._ask(count)

    def settle(self) -> None:
        """Return once the process's threads have gone quiet (at most 10 s): called before every timed call, so
        that work left running after this stream's call does not land in another variant's time."""
        self._ask(_SETTLE)

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(_STOP)
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


_STOP, _SETTLE = -1, -2  # what ChildStream sends besides a batch count


def _wait_until_quiet(limit_s: float = 10.0) -> None:
    """Until this process's threads together use under 10% of a core over 50 ms."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = time.process_time()
        time.sleep(0.05)
        if time.process_time() - before < 0.005:
            return


def _stream_child(variant: str, path: Path, shape: WindowShape, conn) -> None:
    torch.set_num_threads(1)
    try:
        stream = make_stream(variant, path, shape)
        next(stream)  # Streaming's shared memory is set up at the first batch
        conn.send((True, None))
        while (count := conn.recv()) != _STOP:
            if count == _SETTLE:
                _wait_until_quiet()
                conn.send((True, None))
                continue
            if count == 0:
                conn.send((True, next(stream)))
                continue
            for _ in range(count):
                next(stream)
            conn.send((True, None))
    except Exception as exc:  # brought back as the variant's failure
        conn.send((False, f"{type(exc).__name__}: {exc}"))


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
