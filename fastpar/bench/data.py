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
DALI rows are skipped with a note when DALI is not installed.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .._optional import available
from .harness import BenchUsageError, Plan, WrongResultError, median
from .table import BenchReport, Column, PlotSpec, goal_line

DESCRIPTION = "image loaders: fastpar DALI vs torch DataLoader vs bare DALI pipeline (images/s, CPU%)"
USES: set[str] = set()
DEFAULTS = {"iters": 1, "warmup": 1, "rounds": 3}
SETTLE_S = 0.5  # pause between timed epochs (background prefetch of ~2 batches takes well under this)
GOALS = (("fastpar_dali", "fastpar_torch", 1.5), ("fastpar_dali", "dali_bare", 0.95))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--count", type=int, default=600, help="images to generate (default 600)")
    group.add_argument("--image-size", default="500x375", help="generated image WIDTHxHEIGHT (default 500x375)")
    group.add_argument("--images", help="use this class-folder of JPEGs instead of generating one")
    group.add_argument("--root", help="a class folder, or an object-store URL (s3://bucket/prefix): reading it is "
                       "timed against a local copy of it")  # fmt: skip
    group.add_argument("--local-s3", action="store_true", help="serve the generated images from a local moto S3 "
                       "server and read them from it, against the local folder")  # fmt: skip
    group.add_argument("--workers", type=int, default=2, help="DALI threads = DataLoader workers (default 2)")
    group.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    group.add_argument("--size", type=int, default=224, help="crop size (default 224)")
    parser.epilog = (
        "-n counts epochs per round; each pipeline runs -w warm-up epochs first. With --local-s3 or an s3:// --root, "
        "-n epochs run back to back (default 3)."
    )


def _cpu_seconds() -> float:
    """CPU time of this process plus its finished (reaped) children, e.g. DataLoader workers."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def image_folder(args: argparse.Namespace) -> Path:
    """The folder to read: ``--images`` (or a local ``--root``), or a generated one cached by count and size."""
    if args.images or args.root:
        from ..data import scan_image_folder

        flag, folder = ("--images", args.images) if args.images else ("--root", args.root)
        try:
            scan_image_folder(folder)
        except (OSError, ValueError) as exc:  # missing, empty, no class folders, no images
            raise BenchUsageError(f"{flag}: {exc}") from None
        return Path(folder)
    from ..data.synthetic import make_image_folder

    width, height = _parse_image_size(args.image_size)
    classes = 4
    per_class = math.ceil(args.count / classes)
    root = Path(tempfile.gettempdir()) / f"fastpar-bench-images-{classes * per_class}-{width}x{height}"
    if not (root / ".complete").exists():  # generating is slow (seconds per hundred images): once per machine
        # write aside, then rename into place: a concurrent run or a crash never leaves a half-written set
        staging = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=root.parent))
        make_image_folder(staging, classes=classes, per_class=per_class, size=(width, height), seed=0, fmt="jpeg")
        (staging / ".complete").write_text("ok\n")
        try:
            staging.rename(root)
        except OSError:  # root is taken: by another run's complete set, or by a set a crash left half-written
            if not (root / ".complete").exists():
                return staging
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _parse_image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise BenchUsageError(f"cannot read --image-size {text!r}: write WIDTHxHEIGHT such as 500x375") from None
    if width < 8 or height < 8:
        raise BenchUsageError(f"--image-size must be at least 8x8, got {text}")
    return width, height


def _pipelines(
    root: Path, args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Callable], dict[str, int], list[str]]:
    """name -> a call that runs one epoch and returns how many images it produced; name -> how many it
    must produce; skip notes."""
    from ..data import image_loader, scan_image_folder

    folder = scan_image_folder(root)

    def loader_epoch(backend: str) -> Callable[[], int]:
        loader = image_loader(root, args.batch, size=args.size, backend=backend, num_threads=args.workers,
                              device=device, rank=0, world_size=1)  # fmt: skip
        epoch = iter(range(1 << 30))

        def run_epoch() -> int:
            loader.set_epoch(next(epoch))
            seen = 0
            for images, labels in loader:
                _check_batch(images, labels, backend, args.size)
                seen += images.shape[0]
            return seen

        return run_epoch

    calls: dict[str, Callable[[], int]] = {}
    produced = {"fastpar_dali": len(folder.files), "fastpar_torch": len(folder.files)}
    notes = []
    if available("nvidia.dali"):
        from ..data.dali_backend import bare_pipeline

        pipe = bare_pipeline(folder.files, folder.labels, args.batch, args.workers, size=args.size,
                             device_id=device.index if device.type == "cuda" else None)  # fmt: skip
        steps = math.ceil(len(folder.files) / args.batch)

        def bare_epoch() -> int:
            seen = 0
            for _ in range(steps):
                images, _ = pipe.run()
                seen += len(images)
            return seen  # the reader wraps around to fill the last batch: those images were decoded too

        calls["dali_bare"] = bare_epoch
        produced["dali_bare"] = steps * args.batch
        calls["fastpar_dali"] = loader_epoch("dali")
    else:
        notes.append("dali_bare and fastpar_dali skipped: NVIDIA DALI is not installed (pip install 'fastpar[dali]')")
    calls["fastpar_torch"] = loader_epoch("torch")
    return calls, produced, notes


def _check_batch(images: torch.Tensor, labels: torch.Tensor, backend: str, size: int) -> None:
    if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, size, size) or len(labels) != len(images):
        raise WrongResultError(
            f"{backend} loader yielded images {tuple(images.shape)} {images.dtype} with {len(labels)} labels; "
            f"expected (B, 3, {size}, {size}) float32 with B labels"
        )


def run(args: argparse.Namespace) -> BenchReport:
    for flag, value in (("--count", args.count), ("--workers", args.workers), ("--batch", args.batch)):
        if value < 1:
            raise BenchUsageError(f"{flag} must be at least 1, got {value}")
    Plan(args.warmup, args.rounds, args.iters)
    _parse_image_size(args.image_size)
    if args.size < 8:
        raise BenchUsageError(f"--size must be at least 8, got {args.size}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from . import data_remote

    if data_remote.wants_remote(args):
        data_remote.check(args)
        torch.set_num_threads(args.threads)
        return data_remote.run(args, device, lambda: image_folder(args))
    root = image_folder(args)
    torch.set_num_threads(args.threads)
    calls, produced, notes = _pipelines(root, args, device)
    for name, call in calls.items():  # correctness first: every pipeline yields the whole folder
        seen = call()
        if seen != produced[name]:
            raise WrongResultError(f"{name} produced {seen} images in one epoch, expected {produced[name]}")
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            # DALI pipelines keep decoding a couple of batches ahead after an epoch: let that finish
            # before the next timing starts, so it is not charged to whichever pipeline runs next
            time.sleep(SETTLE_S)
            wall, cpu, images = time.perf_counter(), _cpu_seconds(), 0
            for _ in range(args.iters):
                images += call()
            samples[name].append((time.perf_counter() - wall, _cpu_seconds() - cpu, images))
    return _report(args, root, device, samples, produced, notes)


def _report(args, root: Path, device: torch.device, samples, produced: dict[str, int], notes: list[str]) -> BenchReport:
    rate = {name: median([n / wall for wall, _, n in s]) for name, s in samples.items()}
    cpu = {name: median([100.0 * c / wall for wall, c, _ in s]) for name, s in samples.items()}
    rows = []
    for name in samples:
        rows.append(
            dict(pipeline=name, images=produced[name], threads=args.workers, images_per_s=rate[name],
                 cpu_percent=cpu[name], vs_bare=rate[name] / rate["dali_bare"] if "dali_bare" in rate else None,
                 vs_torch=rate[name] / rate["fastpar_torch"])
        )  # fmt: skip
    footer, goals = [], {}
    for ours, theirs, goal in GOALS:
        if ours in rate and theirs in rate:
            ratio = rate[ours] / rate[theirs]
            goals[f"{ours} / {theirs} >= {goal}"] = ratio >= goal
            footer.append(goal_line(f"{ours} >= {goal:.2f}x {theirs}", f"{ratio:.2f}x", ratio >= goal))
    return BenchReport(
        benchmark="data",
        title=f"image loading, decode + random resized crop {args.size} + flip + normalise",
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
            "batch": str(args.batch),
            "cpus": str(os.cpu_count()),
            "timing": f"median of {args.rounds} interleaved rounds x {args.iters} epoch(s) after {args.warmup} warm-up",
        },
        footer=footer,
        notes=notes,
        summary={"images_per_s": rate, "cpu_percent": cpu, "goals_met": goals},
        plot=PlotSpec("bar", "pipeline", "images_per_s", ylabel="images/s"),
    )
