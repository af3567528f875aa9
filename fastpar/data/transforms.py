"""Image transforms shared by the torch backend: PIL decode, random resized crop, centre crop, flip.

No torchvision (it cannot be installed next to every torch build): crop boxes are computed here and
PIL resamples the box straight to the output size, one resample per image. Normalisation runs later
on whole batches (on the GPU when there is one), so workers ship uint8.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import torch

from ..user_errors import redact_url

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875  # eval: shorter side resized to size / 0.875, then a size x size centre crop
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3.0 / 4.0, 4.0 / 3.0)


class CorruptImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the path (an object URL without credentials)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_url(message))


def random_resized_crop_box(width: int, height: int, rng: random.Random) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of an Inception-style crop: area in RRC_SCALE, aspect ratio in RRC_RATIO."""
    area = width * height
    log_lo, log_hi = math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*RRC_SCALE)
        ratio = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    # fallback: the largest centre crop within the ratio range
    ratio = width / height
    if ratio < RRC_RATIO[0]:
        w, h = width, round(width / RRC_RATIO[0])
    elif ratio > RRC_RATIO[1]:
        w, h = round(height * RRC_RATIO[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def centre_crop_box(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """The box in source pixels that 'resize shorter side to size/0.875, centre crop size' keeps."""
    side = min(width, height) * EVAL_CROP_FRACTION  # source pixels that end up as `size` output pixels
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def _to_rgb(img, image_module):
    """Any PIL image -> upright RGB, as DALI's decoders give it. Camera JPEGs store their rotation in EXIF
    (DALI applies it, PIL does not by itself). 16-bit greyscale PNGs open as "I;16" (or "I" in old Pillow),
    which ``convert("RGB")`` clips at 255 (an all-white image): keep their top 8 bits, as DALI does."""
    from PIL import ImageOps

    img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16") or (img.mode == "I" and img.getextrema()[1] > 255):
        pixels = np.asarray(img).astype(np.uint32) >> 8
        img = image_module.fromarray(pixels.astype(np.uint8), "L")
    return img.convert("RGB")


def decode_rgb(data: np.ndarray | bytes, name: str):
    """The encoded image ``data`` (file or object bytes) as an upright RGB PIL image; raises
    CorruptImageError naming ``name`` (its path or URL)."""
    from .._optional import require

    image_module = require("PIL.Image", extra="dev", purpose="decoding images on the CPU")
    try:
        with image_module.open(io.BytesIO(data)) as img:
            return _to_rgb(img, image_module)
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise CorruptImageError(f"cannot decode image {name}: {type(exc).__name__}: {exc}") from None


def load_transformed(data: np.ndarray | bytes, name: str, size: int, train: bool, seed: int) -> np.ndarray:
    """Decode ``data`` and return the (size, size, 3) uint8 crop; raises CorruptImageError naming ``name``."""
    from PIL import Image as image_module

    img = decode_rgb(data, name)
    width, height = img.size
    if train:
        rng = random.Random(seed)
        box = random_resized_crop_box(width, height, rng)
        flip = rng.random() < 0.5
    else:
        box, flip = centre_crop_box(width, height, size), False
    img = img.resize((size, size), image_module.BILINEAR, box=box)
    if flip:
        img = img.transpose(image_module.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def normalize_batch(
    images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float32 on ``device``, (x/255 - mean) / std."""
    images = images.to(device, non_blocking=True)
    out = torch.empty((images.shape[0], 3, images.shape[1], images.shape[2]), dtype=torch.float32, device=device)
    out.copy_(images.permute(0, 3, 1, 2))
    scale = torch.tensor([255.0 * s for s in std], device=device).view(1, 3, 1, 1)
    shift = torch.tensor([255.0 * m for m in mean], device=device).view(1, 3, 1, 1)
    return out.sub_(shift).div_(scale)
