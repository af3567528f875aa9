"""``fastpar bench data --root s3://bucket/prefix`` or ``--local-s3``: the image loader reading from an
object store, against the same images in a local folder, in one run.

Rows, per backend (DALI when installed, and the torch DataLoader), each one epoch per call over the
same plan: ``local_*`` the local folder (the peer: what the data would give on local disk), ``s3_*``
the store without a cache (every epoch is a first epoch), ``s3_cached_*`` the store with a warm
``cache_dir`` (later epochs); with DALI also ``s3_dali_reader`` (DALI's own S3 reader, fn.io.file.read),
and ``fetch_only``: the objects of an epoch fetched by the client without decoding (the store's limit).

``--local-s3`` starts moto's S3 server on 127.0.0.1 (``fastpar.data.remote.local_s3``, in its own process),
seeded with the generated images; then the ``srv_CPU%`` column is that server's CPU (on this machine it
competes with decoding for the same cores) and ``GETs`` counts the object requests it served per epoch.
A ``--root`` URL is copied to a private local folder first, for the ``local_*`` rows; a key that cannot
name a file below it (an empty, ``.`` or ``..`` component) stops the run with one line, and nothing is
written outside it. The URL is shown, and kept in the JSON, without its credentials. An ``s3_*`` row faster than
``fetch_only`` (what the wire delivers without decoding) is flagged, and its goal is IMPOSSIBLE.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..._optional import available
from ...data.remote.store import StoreOptions
from ...data.remote.urls import ObjectURL, is_url
from ...safe_files import write_new
from ...user_errors import redact_url
from ..context import BenchContext
from ..goals import AT_LEAST, Goal, Verdict, beyond_floor
from ..harness import BenchUsageError, Plan, WrongResultError, median
from ..table import BenchReport, Column, PlotSpec
from .image_loading import SETTLE_S, check_batch, cpu_seconds

# of the local folder's throughput, same backend; the scope names the backend
S3_VS_LOCAL = Goal("s3 images/s", "local", 0.60, AT_LEAST)
S3_CACHED_VS_LOCAL = Goal("s3_cached images/s", "local", 0.95, AT_LEAST)


def _server_cpu(server) -> float:
    """CPU seconds the local S3 server process has used (0 without one)."""
    if server is None or server._proc is None:
        return 0.0
    fields = Path(f"/proc/{server._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _download(url: str, dest: Path) -> Path:
    """Copy the objects under ``url`` into ``dest`` (class folders kept), for the local rows. Each key is
    checked to name a path below ``dest`` (``relative_key``), and each file is new: nothing is followed."""
    from ...data.remote.folder import relative_key, scan_object_folder
    from ...data.remote.store import open_store

    store = open_store(url, StoreOptions())
    folder = scan_object_folder(store)

    def copy(info) -> None:
        path = dest.joinpath(*relative_key(info.key, store.base, str(store.url)))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_new(path, store.get(info))

    with ThreadPoolExecutor(StoreOptions().max_requests) as pool:
        list(pool.map(copy, folder.objects))
    return dest


def run(ctx: BenchContext, device: torch.device, local_folder: Callable[[], Path]) -> BenchReport:
    from ...data import image_loader
    from ...data.remote.local_s3 import LocalS3

    flags = ctx.flags
    if flags.local_s3 and flags.root:
        raise BenchUsageError("--local-s3 serves generated images; drop --root (or drop --local-s3 to read --root)")
    work = Path(tempfile.mkdtemp(prefix="fastpar-bench-s3-"))  # the local copy and the cache: removed at the end
    server, notes, saved_env = None, [], dict(os.environ)
    try:
        if flags.local_s3:
            root = local_folder()
            server = LocalS3({"fastpar-bench": root}).start()
            os.environ.update(server.env())  # this process's clients (boto3 and DALI's) go to the local server
            url = "s3://fastpar-bench"
        else:
            url, root = flags.root, _download(flags.root, work / "local")
        backends = (["dali"] if available("nvidia.dali") else []) + ["torch"]
        common = dict(size=flags.size, num_threads=flags.workers, device=device, rank=0, world_size=1)
        loaders = {}
        for b in backends:
            loaders[f"local_{b}"] = image_loader(root, flags.batch, backend=b, **common)
            loaders[f"s3_{b}"] = image_loader(url, flags.batch, backend=b, **common)
            loaders[f"s3_cached_{b}"] = image_loader(url, flags.batch, backend=b, cache_dir=work / "cache", **common)
        if "dali" in backends:
            try:
                loaders["s3_dali_reader"] = image_loader(
                    url, flags.batch, backend="dali", storage=StoreOptions(reader="dali"), **common
                )
            except ValueError as exc:  # no S3 in this DALI, a non-S3 URL, another endpoint in this process
                notes.append(f"s3_dali_reader skipped: {exc}")
        calls = {name: _epochs(loader, name, flags.size) for name, loader in loaders.items()}
        calls["fetch_only"] = _fetch_epochs(loaders[f"s3_{backends[-1]}"])
        _check_same_batches(loaders, backends)  # also fills the cache: the cached rows time later epochs
        for call in calls.values():
            call(ctx.warmup)
        samples: dict[str, list[tuple[float, float, float, int, int]]] = {name: [] for name in calls}
        for _ in range(ctx.rounds):
            for name, call in calls.items():
                _settle(server)  # prefetches past an epoch's end (DALI, the client) are not charged to the next timing
                gets = server.object_gets() if server else 0
                wall, cpu, srv = time.perf_counter(), cpu_seconds(), _server_cpu(server)
                images = call(ctx.iters)
                samples[name].append(
                    (
                        time.perf_counter() - wall,
                        cpu_seconds() - cpu,
                        _server_cpu(server) - srv,
                        images,
                        (server.object_gets() - gets) if server else -1,
                    )
                )
                if name.startswith("s3_cached") and server and samples[name][-1][4] > 0:
                    raise WrongResultError(f"{name}: {samples[name][-1][4]} GETs reached the server; the cache missed")
        return _report(ctx, url, root, device, samples, loaders, server is not None, notes)
    finally:
        if server is not None:
            server.close()
            os.environ.clear()
            os.environ.update(saved_env)
        shutil.rmtree(work, ignore_errors=True)


def _settle(server, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """Wait until the previous row's look-ahead is done: the server saw no request for ``quiet_s``."""
    time.sleep(SETTLE_S)
    if server is None:
        return
    deadline, seen = time.monotonic() + limit_s, -1
    while time.monotonic() < deadline:
        count = len(server.requests())
        if count == seen:
            return
        seen = count
        time.sleep(quiet_s)


def _epochs(loader, name: str, size: int) -> Callable[[int], int]:
    """``run(n)``: n epochs back to back, as training runs them (the loader starts each next epoch's
    downloads and decoding during the last batch of the one before), from a cold start: the first
    epoch is one the loader did not expect, so nothing was fetched for it beforehand."""
    starts = iter(range(0, 1 << 30, 1 << 10))

    def run(n: int) -> int:
        seen, start = 0, next(starts)
        loader.set_epoch(start)
        for _ in range(n):  # each full pass moves the loader on to the next epoch
            for images, labels in loader:
                check_batch(images, labels, name, size)
                seen += images.shape[0]
        return seen

    return run


def _fetch_epochs(loader) -> Callable[[int], int]:
    """The client fetching n epochs' objects, ahead as the loader does, without decoding them."""
    from ...data.sharding import rank_batches

    epochs = iter(range(1 << 30))

    def run(n: int) -> int:
        batches = [idx.tolist() for _ in range(n) for idx, _ in rank_batches(loader.spec, next(epochs))]
        return sum(len(b) for b in loader.backend.source.batches(batches))

    return run


def _check_same_batches(loaders: dict, backends: list[str]) -> None:
    """Epoch 0 from the store equals epoch 0 from the local folder, batch by batch, bit for bit."""
    for b in backends:
        reference = [(x.double().sum().item(), y.tolist()) for x, y in loaders[f"local_{b}"]]
        names = [n for n in (f"s3_{b}", f"s3_cached_{b}", "s3_dali_reader" if b == "dali" else "") if n in loaders]
        for name in names:
            got = [(x.double().sum().item(), y.tolist()) for x, y in loaders[name]]
            if got != reference:
                raise WrongResultError(f"{name} gave other batches than local_{b} for the same images and seed")
        for name in [f"local_{b}", *names]:
            loaders[name].set_epoch(0)


def _goals(rate: dict[str, float]) -> list[Verdict]:
    goals = []
    for backend in ("dali", "torch"):
        local = f"local_{backend}"
        for goal, name in ((S3_VS_LOCAL, f"s3_{backend}"), (S3_CACHED_VS_LOCAL, f"s3_cached_{backend}")):
            if name in rate and local in rate:
                flag = None
                if name.startswith("s3_") and not name.startswith("s3_cached") and "fetch_only" in rate:
                    # fetching and decoding cannot beat fetching alone
                    flag = beyond_floor(name, 1 / rate[name], 1 / rate["fetch_only"], "fetch_only")
                goals.append(goal.check(rate[name] / rate[local], scope=backend, reference=local, flag=flag))
    return goals


def _report(
    ctx: BenchContext, url: str, root: Path, device, samples, loaders, local_server: bool, notes: list[str]
) -> BenchReport:
    flags = ctx.flags
    rate = {n: median([imgs / wall for wall, _, _, imgs, _ in s]) for n, s in samples.items()}
    cpu = {n: median([100.0 * c / wall for wall, c, _, _, _ in s]) for n, s in samples.items()}
    srv = {n: median([100.0 * c / wall for wall, _, c, _, _ in s]) for n, s in samples.items()}
    gets = {n: median([g / ctx.iters for *_, g in s]) for n, s in samples.items()}
    rows = []
    for name in samples:
        backend = "dali" if "dali" in name else "torch" if "torch" in name else None
        local = rate.get(f"local_{backend}") if backend else None
        rows.append(
            dict(
                pipeline=name,
                images_per_s=rate[name],
                cpu_percent=cpu[name],
                server_cpu_percent=srv[name] if local_server else None,
                gets=gets[name] if local_server else None,
                vs_local=rate[name] / local if local else None,
            )
        )
    images = len(loaders[next(iter(loaders))].folder)
    return BenchReport(
        benchmark="data",
        title=f"image loading from {redact_url(url)} vs a local folder, decode + random resized crop {flags.size} + flip + normalise",
        columns=[
            Column("pipeline", "pipeline", 18),
            Column("images_per_s", "images/s", 10, ".1f", "1/s"),
            Column("cpu_percent", "CPU%", 7, ".0f", "%"),
            Column("server_cpu_percent", "srv_CPU%", 9, ".0f", "%"),
            Column("gets", "GETs", 6, ".0f"),
            Column("vs_local", "of_local", 9, ".1%"),
        ],
        rows=rows,
        header={
            "store": f"{redact_url(url)} ({images} images; local copy {root})"
            + (" on a local moto server" if local_server else ""),
            "device": str(device),
            "batch": str(flags.batch),
            "threads": f"{flags.workers} DALI threads / DataLoader workers; client: "
            f"{StoreOptions().max_requests} requests at once per process",
            "cpus": str(os.cpu_count()),
            "timing": f"median of {ctx.rounds} interleaved rounds of {ctx.iters} epoch(s) back to back from a cold "
            f"start, after {ctx.warmup} warm-up epoch(s)",
        },
        goals=_goals(rate),
        notes=notes,
        summary={"images_per_s": rate, "cpu_percent": cpu},
        plot=PlotSpec("bar", "pipeline", "images_per_s", ylabel="images/s"),
    )


def wants_remote(flags: argparse.Namespace) -> bool:
    return bool(flags.local_s3 or (flags.root and is_url(flags.root)))


def check(ctx: BenchContext) -> None:
    if "iters" not in ctx.explicit:
        ctx.iters = 3  # epochs back to back per round: the look-ahead between epochs is part of the timing
    Plan(ctx.warmup, ctx.rounds, ctx.iters)
    if ctx.flags.local_s3 and not available("moto"):
        raise BenchUsageError("--local-s3 needs moto's server: pip install 'fastpar[s3-test]'")
    if not available("boto3"):
        raise BenchUsageError("reading s3:// needs boto3: pip install 'fastpar[s3]'")
    if ctx.flags.root:
        try:
            ObjectURL.parse(ctx.flags.root)
        except ValueError as exc:  # a typo or credentials in the URL: one line, before anything starts
            raise BenchUsageError(f"--root: {exc}") from None
