"""Scanning an image-classification folder: ``root/<class>/<image>``, classes in sorted order."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..user_errors import redact_url

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# Files that sit in data sets without being samples: ignored rather than reported as unsupported.
_IGNORED_NAMES = {".DS_Store", "Thumbs.db", "desktop.ini"}


@dataclass(frozen=True)
class ImageFolder:
    """The files of one image folder with their labels (``labels[i]`` belongs to ``files[i]``)."""

    root: Path | str  # a local folder, or the URL of an object-store prefix
    classes: list[str]
    files: list[str] = field(repr=False)
    labels: list[int] = field(repr=False)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.files)


def _listing(paths: list, limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return shown + more


def scan_image_folder(root: str | Path, *, strict: bool = True) -> ImageFolder:
    """Find ``root/<class>/*.{jpg,jpeg,png}`` (case-insensitive suffixes; nested and symlinked folders
    included; hidden files and folders, such as ``._x.jpg`` or ``.ipynb_checkpoints``, left out).

    Label k is the k-th class folder in sorted order. Raises a ValueError naming the problem for a
    missing root, a root without class folders, or no images at all. Files with other suffixes raise
    with ``strict=True`` (listing them) and are skipped with one warning otherwise.
    """
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"image folder {root} is a file; pass the folder that holds one folder per class")
    class_dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    loose = sum(1 for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    class_files = {d.name: [str(p) for p in _walk_files(d)] for d in class_dirs}
    classes, files, labels = sort_image_files(str(root), class_files, loose=loose, strict=strict)
    return ImageFolder(root=root, classes=classes, files=files, labels=labels)


def sort_image_files(
    root: str, class_files: dict[str, list[str]], *, loose: int, strict: bool, empty_hint: str = " It is empty."
) -> tuple[list[str], list[str], list[int]]:
    """(classes, files, labels) from the files of each class folder (local paths or object URLs, each
    list in order): the policy shared by local folders and object stores. ``loose``: images found
    directly in the root, for the hint when there are no class folders."""
    if not class_files:
        hint = (
            f" It holds {loose} image file(s) directly; move them into one subfolder per class."
            if loose
            else empty_hint
        )
        raise ValueError(f"image folder {root} has no class subfolders (expected root/<class>/<image>).{hint}")
    classes = sorted(class_files)
    files: list[str] = []
    labels: list[int] = []
    unsupported: list[str] = []
    for label, name in enumerate(classes):
        for path in class_files[name]:
            if _suffix(path) in IMAGE_SUFFIXES:
                files.append(path)
                labels.append(label)
            elif path.rsplit("/", 1)[-1] not in _IGNORED_NAMES:
                unsupported.append(path)
    if unsupported:
        listed = redact_url(_listing(unsupported))  # object URLs: shown without credentials
        message = f"{len(unsupported)} file(s) under {root} are not {'/'.join(IMAGE_SUFFIXES)} images: {listed}"
        if strict:
            raise ValueError(message + ". Remove or convert them, or pass strict=False to skip them.")
        warnings.warn(message + "; skipping them.", stacklevel=3)
    folders = [f"{root.rstrip('/')}/{name}" for name in classes]
    if not files:
        raise ValueError(
            f"image folder {root} has {len(classes)} class folder(s) ({_listing(folders, 3)}) but no "
            f"{'/'.join(IMAGE_SUFFIXES)} images in them"
        )
    empty = [d for d, n in zip(folders, _counts(labels, len(classes)), strict=True) if n == 0]
    if empty:
        warnings.warn(f"{len(empty)} class folder(s) hold no images: {_listing(empty)}", stacklevel=3)
    if (better := _one_level_too_high(root, classes, class_files)) is not None:
        warnings.warn(
            f"image folder {root} looks one level too high: its class folders are {', '.join(classes)}, and the "
            f"images sit in folders below them; use {better} as the folder (its subfolders are the classes)",
            stacklevel=3,
        )
    return classes, files, labels


_SPLIT_NAMES = {"train", "training", "val", "valid", "validation", "test", "testing"}


def _one_level_too_high(root: str, classes: list[str], class_files: dict[str, list[str]]) -> str | None:
    """The folder to use instead of ``root`` when its "classes" are data splits (train/val) or there is only
    one, and their images are nested in subfolders (the real classes); else None."""
    if not classes or not (set(classes) <= _SPLIT_NAMES or len(classes) == 1):
        return None
    first = next((c for c in ("train", "training") if c in classes), classes[0])
    prefix = f"{root.rstrip('/')}/{first}/"
    nested = [f for f in class_files[first] if "/" in f.removeprefix(prefix)]
    return f"{root.rstrip('/')}/{first}" if nested else None


def _suffix(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return name[name.rfind(".") :].lower() if "." in name else ""


def _walk_files(folder: Path) -> list[Path]:
    """Files under ``folder``, sorted, following symlinked subfolders (data sets are often farms of
    links) but not into a loop. Hidden files and folders are left out: macOS "._name.jpg" resource
    forks and ".ipynb_checkpoints" copies have image suffixes without being samples."""
    found: list[Path] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link back up the tree
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file():  # is_file: a dangling link is no sample
                found.append(path)
    return sorted(found)


def _counts(labels: list[int], classes: int) -> list[int]:
    counts = [0] * classes
    for label in labels:
        counts[label] += 1
    return counts
