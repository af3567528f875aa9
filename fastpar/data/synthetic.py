"""Generated image-classification folders: for tests, demos and benchmarks without a data set.

Each class has its own colour and shape; every image draws that shape at a random position and
scale on a noisy background tinted with the class colour. A small CNN learns it in a few epochs,
the mean colour of any crop still tells the class (handy for label checks), and the same seed
always writes the same files. ``hard=True`` paints each shape in a random colour and leaves only a
faint class tint, mixed with a random one, in the background: a small CNN then needs several epochs
to learn it (``fastpar demo`` shows the learning curve).
"""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np

from .._optional import require

# The first classes get well-separated primaries; more classes get evenly spaced hues.
_PALETTE = [
    ("red", (220, 40, 40)),
    ("green", (40, 200, 60)),
    ("blue", (40, 70, 230)),
    ("yellow", (230, 210, 40)),
    ("magenta", (210, 50, 200)),
    ("cyan", (40, 210, 210)),
]
_SHAPES = ("ellipse", "rectangle", "triangle", "cross")
_FORMATS = {"jpeg": ("JPEG", ".jpg"), "jpg": ("JPEG", ".jpg"), "png": ("PNG", ".png")}


def class_colours(classes: int) -> list[tuple[str, tuple[int, int, int]]]:
    """(name, RGB) of each class, in label order."""
    if classes <= len(_PALETTE):
        return _PALETTE[:classes]
    colours = []
    for k in range(classes):
        r, g, b = colorsys.hsv_to_rgb(k / classes, 0.8, 0.9)
        colours.append((f"hue{k * 360 // classes:03d}", (int(r * 255), int(g * 255), int(b * 255))))
    return colours


def _shape_mask(kind: str, h: int, w: int, cy: float, cx: float, radius: float) -> np.ndarray:
    """Boolean (H, W) mask of one filled shape centred at (cy, cx)."""
    ys, xs = np.ogrid[:h, :w]
    dy, dx = (ys - cy) / radius, (xs - cx) / radius
    if kind == "ellipse":
        return dy**2 + (dx * 0.8) ** 2 <= 1.0
    if kind == "rectangle":
        return (np.abs(dy) <= 0.7) & (np.abs(dx) <= 1.0)
    if kind == "triangle":  # apex up, base at dy = 1
        return (dy <= 1.0) & (np.abs(dx) <= (dy + 1.0) / 2.0)
    # cross
    return ((np.abs(dy) <= 1.0) & (np.abs(dx) <= 0.3)) | ((np.abs(dx) <= 1.0) & (np.abs(dy) <= 0.3))


def _random_colour(rng: np.random.Generator) -> np.ndarray:
    return np.asarray(colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(0.5, 0.9), rng.uniform(0.6, 1.0))) * 255.0


def _render(
    rng: np.random.Generator, colour: tuple[int, int, int], shape: str, w: int, h: int, hard: bool = False
) -> np.ndarray:
    """One (H, W, 3) uint8 image of ``shape`` in ``colour`` on a tinted noisy background (``hard``: see above)."""
    base = np.asarray(colour, dtype=np.float32)
    grey = rng.uniform(70.0, 150.0)
    background = 0.6 * grey + 0.4 * base  # tint: the mean colour of any crop identifies the class
    if hard:  # a faint tint, blurred by a random one: learnable, but not from the first batches
        background = 0.5 * grey + 0.3 * base + 0.2 * _random_colour(rng)
        base = _random_colour(rng).astype(np.float32)
    img = np.empty((h, w, 3), dtype=np.int16)  # int16 arithmetic: several times faster than float
    img[:] = background.astype(np.int16)
    radius = rng.uniform(0.2, 0.4) * min(h, w)
    cy, cx = rng.uniform(radius * 0.5, h - radius * 0.5), rng.uniform(radius * 0.5, w - radius * 0.5)
    mask = _shape_mask(shape, h, w, cy, cx, radius)
    img[mask] = (base * rng.uniform(0.85, 1.1)).astype(np.int16)
    img += rng.integers(-30, 31, size=(h, w, 1), dtype=np.int16)  # luminance noise
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(
    root: str | Path,
    *,
    classes: int = 4,
    per_class: int = 50,
    size: tuple[int, int] = (64, 48),
    seed: int = 0,
    fmt: str = "jpeg",
    quality: int = 90,
    hard: bool = False,
) -> Path:
    """Write ``classes`` subfolders of ``per_class`` images each under ``root`` and return ``root``.

    ``size`` is (width, height). Folder names sort in label order (``00_red``, ``01_green``, ...), so
    ``image_loader`` assigns label k to class k. The files depend only on the arguments.
    ``hard=True``: shapes in random colours, a faint class tint (see the module docstring).
    """
    pil_image = require("PIL.Image", extra="dev", purpose="writing synthetic images")
    if fmt.lower() not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    if classes < 1 or per_class < 1:
        raise ValueError(f"classes and per_class must be at least 1, got {classes} and {per_class}")
    w, h = size
    if w < 8 or h < 8:
        raise ValueError(f"size (width, height) must be at least 8x8, got {size}")
    pil_format, suffix = _FORMATS[fmt.lower()]
    root = Path(root)
    rng = np.random.default_rng(seed)
    for label, (name, colour) in enumerate(class_colours(classes)):
        folder = root / f"{label:02d}_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        shape = _SHAPES[label % len(_SHAPES)]
        for i in range(per_class):
            pixels = _render(rng, colour, shape, w, h, hard)
            path = folder / f"{i:05d}{suffix}"
            if pil_format == "JPEG":
                pil_image.fromarray(pixels).save(path, pil_format, quality=quality)
            else:
                pil_image.fromarray(pixels).save(path, pil_format)
    return root
