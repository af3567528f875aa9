"""``fastpar bench data --tokens``: tokens/s and anonymous memory of ``token_loader`` against a bare
``np.memmap`` reader (the floor) and a torch DataLoader (the peer), on generated corpora of two sizes.

Each corpus is one ``.bin`` file of random uint16 token ids below ``--vocab``, written into a temporary
folder. Every variant yields int64 ``(x, y)`` tensors of shape ``(batch, seq_len)`` from the same windows:
``seq_len + 1`` tokens starting every ``seq_len`` tokens, in a random order per epoch.

  floor          the windows copied from a bare ``np.memmap`` into int64 arrays, in this process
  fastpar        ``fastpar.data.token_loader`` over the file, as a raw ``.bin`` is read (no vocabulary given:
                 nothing to check the ids against); the goals are this row's
  fastpar_vocab  the same with ``vocab_size=--vocab``: every batch's ids checked (its cost, no goal)
  dataloader     ``torch.utils.data.DataLoader(shuffle=True, num_workers=0)`` over a map-style dataset that
                 returns one window of the memmap per index; ``dataloader_wN`` the same with N workers
  streaming      MosaicML Streaming's ``StreamingDataset`` over the same windows written in its MDS
                 format, when ``streaming`` imports (it is not a dependency of fastpar); else a note. It runs
                 in a process of its own, which is let go quiet before every timed call: its prefetch
                 threads keep working after a call returns, and would slow the next variant's call

A call takes ``--batches`` batches from a variant's endless stream of epochs (``token_windows``); the
variants of all corpora are interleaved round by round (``harness.interleaved_rounds``) in two groups: those
that read in this process alone (floor, fastpar, fastpar_vocab, dataloader), then those with workers or
threads of their own, which keep working between calls and would blur the floor-bound ratios. Before
timing, two batches of every variant are checked: each row is a window of the corpus at a window start,
``y`` is ``x`` shifted by one.

Memory: each in-process variant runs again in a fresh (spawned) process per corpus, which reads its
``Anonymous:`` total from ``/proc/self/smaps_rollup`` (resident memory without file-backed pages: the
page cache of the memory-mapped corpus is not in it) after ``--memory-batches`` batches. A loader whose
memory grows with the corpus would copy or index it; the goal holds fastpar's to within 10% between the
smallest and the largest corpus. DataLoader rows with workers are not measured (their memory is in the workers).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..context import BenchContext
from ..goals import AT_LEAST, AT_MOST, Goal, beyond_floor
from ..harness import BenchUsageError, Plan, interleaved_rounds, median
from ..table import BenchReport, Column, PlotSpec
from .token_windows import (
    ChildStream,
    WindowShape,
    anonymous_kib,
    check_batch,
    make_stream,
    measure_memory,
    streaming_note,
    streaming_problem,
    window_heads,
    write_corpus,
    write_mds,
)

VS_FLOOR = Goal("fastpar tokens/s", "floor", 0.95, AT_LEAST)
VS_DATALOADER = Goal("fastpar tokens/s", "dataloader", 1.5, AT_LEAST)
VS_STREAMING = Goal("fastpar tokens/s", "streaming", 1.0, AT_LEAST)
MEMORY = Goal("fastpar anonymous memory", "between corpus sizes", 1.10, AT_MOST)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tokens", action="store_true", help="token windows instead of images: token_loader vs memmap vs DataLoader"
    )
    group.add_argument("--seq-len", type=int, default=1024, help="--tokens: tokens per window (default 1024)")
    group.add_argument("--batch-size", type=int, default=8, help="--tokens: windows per batch (default 8)")
    group.add_argument(
        "--corpus-mb",
        default="10,1024",
        help="--tokens: generated corpus sizes in MiB, comma-separated (default 10,1024)",
    )
    group.add_argument("--batches", type=int, default=5000, help="--tokens: batches per timed call (default 5000)")
    group.add_argument(
        "--memory-batches",
        type=int,
        default=200,
        help="--tokens: batches read before memory is measured, 0 to skip memory (default 200)",
    )
    group.add_argument("--vocab", type=int, default=50257, help="--tokens: token ids are below this (default 50257)")


def _parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchUsageError(f"cannot read --corpus-mb {text!r}: write sizes in MiB such as 10,1024") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise BenchUsageError(f"--corpus-mb needs positive sizes, got {text!r}")
    return sorted(set(sizes))


def _check_flags(flags: argparse.Namespace) -> tuple[list[float], WindowShape]:
    if flags.images or flags.root or flags.local_s3:
        raise BenchUsageError("--tokens generates its own corpora; --images, --root and --local-s3 do not apply")
    for flag, value, least in (
        ("--seq-len", flags.seq_len, 1),
        ("--batch-size", flags.batch_size, 1),
        ("--batches", flags.batches, 1),
        ("--memory-batches", flags.memory_batches, 0),
        ("--workers", flags.workers, 0),
    ):
        if value < least:
            raise BenchUsageError(f"{flag} must be at least {least}, got {value}")
    if not 2 <= flags.vocab <= 1 << 16:
        raise BenchUsageError(f"--vocab must be in 2..65536 (uint16 tokens), got {flags.vocab}")
    sizes, shape = _parse_sizes(flags.corpus_mb), WindowShape(flags.seq_len, flags.batch_size, flags.vocab)
    smallest = int(min(sizes) * (1 << 20)) // 2
    if (smallest - 1) // shape.seq_len < shape.batch:
        raise BenchUsageError(
            f"a {min(sizes):g} MiB corpus holds fewer than --batch-size {shape.batch} windows of --seq-len "
            f"{shape.seq_len}: use a larger --corpus-mb or a smaller --seq-len"
        )
    return sizes, shape


def _label(size_mb: float) -> str:
    return f"{size_mb:g}MB"


def _variants(workers: int, streaming: bool) -> list[str]:
    names = ["floor", "fastpar", "fastpar_vocab", "dataloader"]
    if workers > 0:
        names.append(f"dataloader_w{workers}")
    if streaming:
        names.append("streaming")
    return names


def run(ctx: BenchContext) -> BenchReport:
    flags = ctx.flags
    sizes, shape = _check_flags(flags)
    plan = Plan(ctx.warmup, ctx.rounds, ctx.iters)
    torch.set_num_threads(ctx.threads)
    notes = []
    problem = streaming_problem()
    if problem is not None:
        notes.append(f"streaming skipped: MosaicML Streaming does not import here ({problem})")
    elif streaming_note():
        notes.append(streaming_note())
    names = _variants(flags.workers, problem is None)
    folder = Path(tempfile.mkdtemp(prefix="fastpar-bench-tokens-"))
    try:
        paths = {
            size: write_corpus(folder / f"{_label(size)}.bin", size, shape.vocab, seed=i)
            for i, size in enumerate(sizes)
        }
        sources = {(size, name): paths[size] for size in sizes for name in names}
        if problem is None:
            for size in sizes:
                sources[size, "streaming"] = write_mds(paths[size], folder / f"{_label(size)}-mds", shape)
        corpora = {size: np.memmap(path, dtype=np.uint16, mode="r") for size, path in paths.items()}
        heads = {size: window_heads(tokens, shape.seq_len) for size, tokens in corpora.items()}
        times: dict[tuple[float, str], list[float]] = {}
        # in-process variants first, then those with processes or threads of their own (DataLoader workers,
        # Streaming): those keep working between calls, so no floor-bound ratio is timed beside them
        for helpers in (False, True):
            keys = [key for key in sources if _has_helpers(key[1]) == helpers]
            if keys:
                times |= _time_streams({key: sources[key] for key in keys}, shape, plan, flags.batches, corpora, heads)
        del corpora
        memory = {}
        if flags.memory_batches and anonymous_kib() is not None:
            for size in sizes:
                for name in names:
                    # workers hold their memory elsewhere; fastpar_vocab holds fastpar's
                    if name.startswith("dataloader_w") or name == "fastpar_vocab":
                        continue
                    memory[size, name] = measure_memory(name, sources[size, name], shape, flags.memory_batches)
        elif flags.memory_batches:
            notes.append("memory not measured: /proc/self/smaps_rollup is not readable on this system")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tokens_per_call = flags.batches * shape.batch * shape.seq_len
    rate = {key: tokens_per_call / median(t) for key, t in times.items()}
    return _report(ctx, sizes, names, shape, rate, times, memory, notes, problem)


def _has_helpers(variant: str) -> bool:
    """Whether the variant reads with processes or threads of its own (DataLoader workers, Streaming's pool)."""
    return variant.startswith("dataloader_w") or variant == "streaming"


def _time_streams(sources: dict, shape: WindowShape, plan: Plan, batches: int, corpora, heads) -> dict:
    """Seconds per call of ``batches`` batches of each stream, interleaved round by round, after checking each."""
    streams = {
        key: ChildStream(key[1], path, shape) if key[1] == "streaming" else make_stream(key[1], path, shape)
        for key, path in sources.items()
    }
    try:
        for (size, name), stream in streams.items():  # correctness first
            for _ in range(2):
                check_batch(f"{name} ({_label(size)})", *next(stream), corpora[size], heads[size], shape)

        def take(stream: Iterator) -> Callable[[], None]:
            if isinstance(stream, ChildStream):
                return lambda: stream.take(batches)

            def call() -> None:
                for _ in range(batches):
                    next(stream)

            return call

        children = [s for s in streams.values() if isinstance(s, ChildStream)]
        return interleaved_rounds(
            {key: take(s) for key, s in streams.items()},
            plan,
            torch.device("cpu"),
            before_round=lambda: [child.settle() for child in children],
        )
    finally:
        for stream in streams.values():  # DataLoader workers and Streaming's process end here
            stream.close()


def _report(ctx, sizes, names, shape: WindowShape, rate, times, memory, notes, problem) -> BenchReport:
    flags = ctx.flags
    rows, goals, footer = [], [], []
    for size in sizes:
        floor = rate[size, "floor"]
        loaders = {name: rate[size, name] for name in names if name.startswith("dataloader")}
        best = max(loaders, key=loaders.get)
        for name in names:
            before, after = memory.get((size, name), (None, None))
            rows.append(
                dict(
                    corpus=_label(size),
                    variant=name,
                    tokens_per_s=rate[size, name],
                    of_floor=rate[size, name] / floor,
                    x_dataloader=rate[size, name] / loaders[best],
                    anon_mib=after / 1024 if after is not None else None,
                    grew_mib=(after - before) / 1024 if after is not None else None,
                )
            )
        fastpar, scope = rate[size, "fastpar"], _label(size)
        # fastpar does the floor's work, so its median lands on either side of the floor's by noise: flagged only
        # when it beat the floor in every round (its slowest call faster than the floor's fastest)
        flag = beyond_floor(
            "fastpar's slowest call", max(times[size, "fastpar"]), min(times[size, "floor"]), "the floor's fastest"
        )
        goals.append(VS_FLOOR.check(fastpar / floor, scope=scope, flag=flag))
        goals.append(VS_DATALOADER.check(fastpar / loaders[best], scope=scope, reference=best))
        if problem is None:
            goals.append(VS_STREAMING.check(fastpar / rate[size, "streaming"], scope=scope))
        else:
            footer.append(f"goal: {VS_STREAMING.claim(scope)}: not measured (streaming does not import)")
    small, large = min(sizes), max(sizes)
    if (small, "fastpar") in memory and small != large:
        a, b = memory[small, "fastpar"][1], memory[large, "fastpar"][1]
        goals.append(
            MEMORY.check(
                max(a, b) / min(a, b),
                reference=f"{_label(large)} vs {_label(small)} corpus",
                detail=f"{b / 1024:.1f} vs {a / 1024:.1f} MiB",
            )
        )
    summary = {
        "tokens_per_s": {f"{_label(s)}/{n}": v for (s, n), v in rate.items()},
        "anonymous_mib": {f"{_label(s)}/{n}": after / 1024 for (s, n), (_, after) in memory.items()},
        "goals_not_measured": [VS_STREAMING.claim(_label(s)) for s in sizes] if problem else [],
    }
    memory_line = (
        f"Anonymous of /proc/self/smaps_rollup in a fresh process after {flags.memory_batches} batches; "
        "grew = since before the loader was made"
        if memory
        else "not measured"
    )
    return BenchReport(
        benchmark="data",
        title=f"token windows, seq_len {shape.seq_len}, batch {shape.batch}, int64 (x, y)",
        columns=[
            Column("corpus", "corpus", 8),
            Column("variant", "variant", 14),
            Column("tokens_per_s", "tokens/s", 12, ".0f", "1/s"),
            Column("of_floor", "of_floor", 9, ".1%"),
            Column("x_dataloader", "x loader", 9, ".2f", "x"),
            Column("anon_mib", "anon_MiB", 9, ".1f", "MiB"),
            Column("grew_mib", "grew_MiB", 9, ".1f", "MiB"),
        ],
        rows=rows,
        header={
            "corpora": ", ".join(
                f"{_label(s)} ({int(s * (1 << 20)) // 2} uint16 tokens below {shape.vocab})" for s in sizes
            ),
            "x loader": "against the fastest DataLoader row of the same corpus",
            "memory": memory_line,
            "timing": (
                f"median of {ctx.rounds} interleaved rounds x {ctx.iters} call(s) of {flags.batches} batches "
                f"after {ctx.warmup} warm-up call(s), {ctx.threads} torch thread(s)"
            ),
        },
        footer=footer,
        goals=goals,
        notes=notes,
        summary=summary,
        plot=PlotSpec("bar", "variant", "tokens_per_s", series="corpus", ylabel="tokens/s"),
    )
