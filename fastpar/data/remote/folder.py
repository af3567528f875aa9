"""An image-classification "folder" in an object store: ``s3://bucket/prefix/<class>/<image>``.

The listing happens once: on rank 0 when a process group is up (every rank then receives the same
plan by broadcast, so N ranks do not each list a million objects, and all ranks raise rank 0's error
if the listing failed), else in this process. Keys are ordered like the local scan orders paths (by
path components), so the same images in a local folder and in a bucket give the same plan.

A key is a name chosen by whoever may write to the bucket, not a path: one with an empty, ``.`` or ``..``
component (``train//tmp/x.jpg``, ``train/../x.jpg``) would name a file outside any folder it is copied
into, so the listing refuses it (``relative_key``), and so does every place that turns a key into a path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from ..folder import ImageFolder, sort_image_files
from .errors import ObjectStoreError, UnsafeObjectKeyError
from .store import FsspecStore, ObjectInfo, S3Store
from .urls import ObjectURL


@dataclass(frozen=True)
class ObjectImageFolder(ImageFolder):
    """An ImageFolder whose ``files`` are object URLs; ``objects[i]`` describes ``files[i]``."""

    objects: list[ObjectInfo] = field(default_factory=list, repr=False)


def relative_key(key: str, base: str, where: str) -> list[str]:
    """The components of ``key`` below the listed prefix ``base``: names a path may be built from, or an
    UnsafeObjectKeyError naming the key. ``where`` (the listed URL) is for the message."""
    parts = key[len(base) :].split("/")
    if any(part in ("", ".", "..") or "\0" in part for part in parts):
        raise UnsafeObjectKeyError(
            f"object key {key!r} under {where} has an empty, '.' or '..' path component (a '//', or a leading "
            "'/'): it names no file below a folder, so fastpar will not read or copy it. Rename the object to "
            "prefix/<class>/<image>, or list a prefix without it"
        )
    return parts


def scan_object_folder(store: S3Store | FsspecStore, *, strict: bool = True) -> ObjectImageFolder:
    """List ``store``'s prefix and apply the local folder's rules (classes, suffixes, hidden files)."""
    url: ObjectURL = store.url
    root = str(url)
    listed = store.list()
    class_files: dict[str, list[tuple[list[str], str]]] = {}
    by_url: dict[str, ObjectInfo] = {}
    loose = 0
    for info in listed:
        if info.key.endswith("/"):  # "folder/" markers: no data
            continue
        parts = relative_key(info.key, store.base, root)
        if any(p.startswith(".") for p in parts):  # hidden files and folders, as in a local folder
            continue
        if len(parts) == 1:
            loose += 1
            continue
        class_files.setdefault(parts[0], []).append((parts, info.url))
        by_url[info.url] = info
    if not listed:
        raise ValueError(f"no objects under {root}: {_empty_hint(store)}")
    sorted_files = {name: [u for _, u in sorted(entries)] for name, entries in class_files.items()}
    classes, files, labels = sort_image_files(root, sorted_files, loose=loose, strict=strict)
    return ObjectImageFolder(root=root, classes=classes, files=files, labels=labels, objects=[by_url[f] for f in files])


def _empty_hint(store: S3Store | FsspecStore) -> str:
    """What the bucket holds instead, so a misspelt prefix is obvious."""
    try:
        found = store.top_level()
    except ObjectStoreError:
        found = []
    if not store.url.prefix:
        return "the bucket is empty. Upload one folder of images per class (prefix/<class>/<image>)"
    shown = ", ".join(found[:10]) if found else "nothing"
    return (
        f"the prefix {store.url.prefix + '/'!r} is empty or misspelt (the top of bucket {store.url.bucket!r} "
        f"holds: {shown}). Pass the prefix whose subfolders are the classes"
    )


def list_once(store: S3Store | FsspecStore, *, strict: bool, world_size: int) -> ObjectImageFolder:
    """The folder, listed on rank 0 and broadcast when a process group spans the ranks; else listed here."""
    dist = torch.distributed
    shared = dist.is_available() and dist.is_initialized() and world_size > 1 and dist.get_world_size() == world_size
    if not shared:
        return scan_object_folder(store, strict=strict)
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                payload[0] = ("ok", scan_object_folder(store, strict=strict), [str(w.message) for w in caught])
        except (ObjectStoreError, ValueError) as exc:  # every rank raises it, none waits for a plan
            payload[0] = ("error", exc, [])
    dist.broadcast_object_list(payload, src=0)
    status, value, messages = payload[0]
    for message in messages:  # the scan's warnings (skipped files, empty classes), on every rank alike
        warnings.warn(message, stacklevel=3)
    if status == "error":
        raise type(value)(f"{value} (listed on rank 0)") from None
    return value


__all__ = ["ObjectImageFolder", "list_once", "relative_key", "scan_object_folder"]
