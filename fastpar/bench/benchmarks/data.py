"""``fastpar bench data``: images/s and CPU% of fastpar's image loaders against the bare DALI pipeline.

Pipelines (train transforms: decode + random resized crop 224 + flip + normalise), same thread/worker
count, one epoch over a generated JPEG folder per call, interleaved in rounds:

  dali_bare     ``fastpar.data.dali_backend.bare_pipeline``: the same DALI operators, no fastpar
                wrapping, outputs left in DALI: the floor of the wrapping cost. Its reader has no partial
                batch, so an epoch is ceil(images / batch) full batches; it is credited with every image
                it decoded (the images column says how many), not just the folder's count
  fastpar_dali  ``fastpar.data.image_loader(backend="dali")``
  fastpar_torch ``fastpar.data.image_loader(backend="torch")``: a torch DataLoader over PIL, the peer

Each timed epoch starts after a short pause (SETTLE_S), so the batches a DALI pipeline prefetches past
the end of its epoch are decoded before, not during, the next pipeline's timing; both DALI pipelines
start an epoch with their prefetch queue full (the bare reader runs on, fastpar starts the next pass ahead).

CPU% = (CPU time of this process and its finished children) / wall time x 100, so 200% = two cores busy.
DALI rows are skipped with a note when DALI is not installed. fastpar_dali faster than dali_bare (the floor)
is flagged, and its goal is IMPOSSIBLE. With an ``s3://`` ``--root`` or ``--local-s3`` the run is
``data_remote``'s; with ``--tokens`` it is ``data_tokens``'s (token windows instead of images).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..._optional import available
from ...safe_files import folder_problem, write_new
from ..context import BenchContext
from ..goals import AT_LEAST, Goal, beyond_floor
from ..harness import BenchUsageError, Plan, WrongResultError, median
from ..table import BenchReport, Column, PlotSpec
from . import data_remote, data_tokens
from .image_loading import SETTLE_S, check_batch, cpu_seconds

DESCRIPTION = (
    "image loaders: fastpar DALI vs torch DataLoader vs bare DALI pipeline (images/s, CPU%); "
    "--tokens: token_loader vs np.memmap vs DataLoader (tokens/s, memory)"
)
USES: set[str] = set()
DEFAULTS = {"iters": 1, "warmup": 1, "rounds": 3}
DALI_VS_TORCH = Goal("fastpar_dali images/s", "fastpar_torch", 1.5, AT_LEAST)
DALI_VS_BARE = Goal("fastpar_dali images/s", "dali_bare", 0.95, AT_LEAST)
_COMPLETE = ".complete"  # written last into a generated image set: the set is whole


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--count", type=int, default=600, help="images to generate (default 600)")
    group.add_argument("--image-size", default="500x375", help="generated image WIDTHxHEIGHT (default 500x375)")
    group.add_argument("--images", help="use this class-folder of JPEGs instead of generating one")
    group.add_argument(
        "--root",
        help="a class folder, or an object-store URL (s3://bucket/prefix): reading it is "
        "timed against a local copy of it",
    )
    group.add_argument(
        "--local-s3",
        action="store_true",
        help="serve the generated images from a local moto S3 server and read them from it, against the local folder",
    )
    group.add_argument("--workers", type=int, default=2, help="DALI threads = DataLoader workers (default 2)")
    group.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    group.add_argument("--size", type=int, default=224, help="crop size (default 224)")
    data_tokens.add_arguments(group)
    parser.epilog = (
        "-n counts epochs per round; each pipeline runs -w warm-up epochs first. With --local-s3 or an s3:// --root, "
        "-n epochs run back to back (default 3). With --tokens, -n counts calls of --batches batches."
    )


def image_folder(images: str | None, count: int, image_size: str, flag: str = "--images") -> Path:
    """The folder to read: ``images`` (given with ``flag``), or a generated one cached by count and size."""
    if images:
        from ...data import scan_image_folder

        try:
            scan_image_folder(images)
        except (OSError, ValueError) as exc:  # missing, empty, no class folders, no images
            raise BenchUsageError(f"{flag}: {exc}") from None
        return Path(images)
    from ...data.synthetic import make_image_folder

    width, height = _parse_image_size(image_size)
    classes = 4
    per_class = math.ceil(count / classes)
    root = Path(tempfile.gettempdir()) / f"fastpar-bench-images-{classes * per_class}-{width}x{height}"
    if not _own_complete_set(root):  # generating is slow (seconds per hundred images): once per machine and user
        # write aside (a private folder), then rename into place: a concurrent run or a crash never leaves a
        # half-written set
        staging = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=root.parent))
        make_image_folder(staging, classes=classes, per_class=per_class, size=(width, height), seed=0, fmt="jpeg")
        write_new(staging / _COMPLETE, b"ok\n")
        try:
            staging.rename(root)
        except OSError:  # root is taken: by another run's complete set, a set a crash left half-written, or a
            if not _own_complete_set(root):  # folder of another user's: then this run reads its private copy
                return staging
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _own_complete_set(root: Path) -> bool:
    """Whether ``root`` holds a generated set this user finished: a folder of theirs that no one else may write
    to, holding their ``.complete`` marker. A set in the shared temporary folder made or marked by anyone
    else is never read: they would choose the images (and the timings) of this run."""
    try:
        if folder_problem(root) is not None:
            return False
        marker = os.lstat(root / _COMPLETE)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(marker.st_mode) and marker.st_uid == os.geteuid()


def _parse_image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise BenchUsageError(f"cannot read --image-size {text!r}: write WIDTHxHEIGHT such as 500x375") from None
    if width < 8 or height < 8:
        raise BenchUsageError(f"--image-size must be at least 8x8, got {text}")
    return width, height


def _pipelines(
    root: Path, flags: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Callable], dict[str, int], list[str]]:
    """name -> a call that runs one epoch and returns how many images it produced; name -> how many it
    must produce; skip notes."""
    from ...data import image_loader, scan_image_folder

    folder = scan_image_folder(root)

    def loader_epoch(backend: str) -> Callable[[], int]:
        loader = image_loader(
            root,
            flags.batch,
            size=flags.size,
            backend=backend,
            num_threads=flags.workers,
            device=device,
            rank=0,
            world_size=1,
        )
        epoch = iter(range(1 << 30))

        def run_epoch() -> int:
            loader.set_epoch(next(epoch))
            seen = 0
            for images, labels in loader:
                check_batch(images, labels, backend, flags.size)
                seen += images.shape[0]
            return seen

        return run_epoch

    calls: dict[str, Callable[[], int]] = {}
    produced = {"fastpar_dali": len(folder.files), "fastpar_torch": len(folder.files)}
    notes = []
    if available("nvidia.dali"):
        from ...data.dali_backend import bare_pipeline

        pipe = bare_pipeline(
            folder.files,
            folder.labels,
            flags.batch,
            flags.workers,
            size=flags.size,
            device_id=device.index if device.type == "cuda" else None,
        )
        steps = math.ceil(len(folder.files) / flags.batch)

        def bare_epoch() -> int:
            seen = 0
            for _ in range(steps):
                images, _ = pipe.run()
                seen += len(images)
            return seen  # the reader wraps around to fill the last batch: those images were decoded too

        calls["dali_bare"] = bare_epoch
        produced["dali_bare"] = steps * flags.batch
        calls["fastpar_dali"] = loader_epoch("dali")
    else:
        notes.append("dali_bare and fastpar_dali skipped: NVIDIA DALI is not installed (pip install 'fastpar[dali]')")
    calls["fastpar_torch"] = loader_epoch("torch")
    return calls, produced, notes


def run(ctx: BenchContext) -> BenchReport:
    flags = ctx.flags
    if flags.tokens:
        return data_tokens.run(ctx)
    for flag, value in (("--count", flags.count), ("--workers", flags.workers), ("--batch", flags.batch)):
        if value < 1:
            raise BenchUsageError(f"{flag} must be at least 1, got {value}")
    Plan(ctx.warmup, ctx.rounds, ctx.iters)
    _parse_image_size(flags.image_size)
    if flags.size < 8:
        raise BenchUsageError(f"--size must be at least 8, got {flags.size}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if data_remote.wants_remote(flags):
        data_remote.check(ctx)
        torch.set_num_threads(ctx.threads)
        return data_remote.run(ctx, device, lambda: image_folder(None, flags.count, flags.image_size))
    root = image_folder(
        flags.images or flags.root, flags.count, flags.image_size, "--images" if flags.images else "--root"
    )
    torch.set_num_threads(ctx.threads)
    calls, produced, notes = _pipelines(root, flags, device)
    for name, call in calls.items():  # correctness first: every pipeline yields the whole folder
        seen = call()
        if seen != produced[name]:
            raise WrongResultError(f"{name} produced {seen} images in one epoch, expected {produced[name]}")
    for call in calls.values():
        for _ in range(ctx.warmup):
            call()
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in calls}
    for _ in range(ctx.rounds):
        for name, call in calls.items():
            # DALI pipelines keep decoding a couple of batches ahead after an epoch: let that finish
            # before the next timing starts, so it is not charged to whichever pipeline runs next
            time.sleep(SETTLE_S)
            wall, cpu, images = time.perf_counter(), cpu_seconds(), 0
            for _ in range(ctx.iters):
                images += call()
            samples[name].append((time.perf_counter() - wall, cpu_seconds() - cpu, images))
    return _report(ctx, root, device, samples, produced, notes)


def _goals(rate: dict[str, float]) -> list:
    goals = []
    if "fastpar_dali" in rate and "fastpar_torch" in rate:
        goals.append(DALI_VS_TORCH.check(rate["fastpar_dali"] / rate["fastpar_torch"]))
    if "fastpar_dali" in rate and "dali_bare" in rate:
        # seconds per image: the bare pipeline is the floor of the same decoding
        flag = beyond_floor("fastpar_dali", 1 / rate["fastpar_dali"], 1 / rate["dali_bare"], "dali_bare")
        goals.append(DALI_VS_BARE.check(rate["fastpar_dali"] / rate["dali_bare"], flag=flag))
    return goals


def _report(
    ctx: BenchContext, root: Path, device: torch.device, samples, produced: dict[str, int], notes: list[str]
) -> BenchReport:
    flags = ctx.flags
    rate = {name: median([n / wall for wall, _, n in s]) for name, s in samples.items()}
    cpu = {name: median([100.0 * c / wall for wall, c, _ in s]) for name, s in samples.items()}
    rows = []
    for name in samples:
        rows.append(
            dict(
                pipeline=name,
                images=produced[name],
                threads=flags.workers,
                images_per_s=rate[name],
                cpu_percent=cpu[name],
                vs_bare=rate[name] / rate["dali_bare"] if "dali_bare" in rate else None,
                vs_torch=rate[name] / rate["fastpar_torch"],
            )
        )
    return BenchReport(
        benchmark="data",
        title=f"image loading, decode + random resized crop {flags.size} + flip + normalise",
        columns=[
            Column("pipeline", "pipeline", 14),
            Column("images", "images", 7),
            Column("threads", "threads", 8),
            Column("images_per_s", "images/s", 10, ".1f", "1/s"),
            Column("cpu_percent", "CPU%", 7, ".0f", "%"),
            Column("vs_bare", "of_bare", 8, ".1%"),
            Column("vs_torch", "x torch", 8, ".2f", "x"),
        ],
        rows=rows,
        header={
            "folder": f"{root} ({produced['fastpar_torch']} images)",
            "device": str(device),
            "batch": str(flags.batch),
            "cpus": str(os.cpu_count()),
            "timing": f"median of {ctx.rounds} interleaved rounds x {ctx.iters} epoch(s) after {ctx.warmup} warm-up",
        },
        goals=_goals(rate),
        notes=notes,
        summary={"images_per_s": rate, "cpu_percent": cpu},
        plot=PlotSpec("bar", "pipeline", "images_per_s", ylabel="images/s"),
    )
