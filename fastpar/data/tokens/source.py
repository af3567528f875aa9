"""Where token shards come from: a ``.bin`` or ``.npy`` file, a folder or glob of them, a folder written by
``fastpar data prepare`` (its ``index.json`` names the shards, dtype and vocabulary), or the same in an
object store (``s3://bucket/prefix``), downloaded once into a local cache and read from there.

Every shard is memory-mapped (``np.memmap`` / ``np.load(mmap_mode="r")``): only the windows a batch
reads are paged in, never a whole file. Files that cannot be token shards are refused here, before the
first step, each with one :class:`TokenDataError` that says what is wrong and what to do.
"""

from __future__ import annotations

import glob
import io
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...user_errors import UserError, redact_url
from ..remote.cache import ObjectCache
from ..remote.folder import relative_key
from ..remote.store import ObjectInfo, StoreOptions, open_store
from ..remote.urls import ObjectURL, is_url, local_path

INDEX_FILE = "index.json"
INDEX_FORMAT = "fastpar-tokens"
DTYPES = ("uint16", "uint32")
SUFFIXES = (".bin", ".npy")
_GLOB_CHARS = frozenset("*?[")


class TokenDataError(UserError, ValueError):
    """Token data that cannot be read as asked; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class TokenShard:
    """One file of tokens: ``name`` for messages, ``tokens`` a 1-D memory-mapped integer array."""

    name: str
    tokens: np.ndarray


@dataclass(frozen=True)
class TokenSource:
    """The shards of one split, in a fixed order, and the index that described them (or None)."""

    shards: list[TokenShard]
    index: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int | None:
        return None if self.index is None else self.index.get("vocab_size")

    @property
    def eot_token(self) -> int | None:
        return None if self.index is None else self.index.get("eot_token")


def check_dtype(dtype: Any) -> np.dtype:
    """``uint16`` / ``uint32`` (as a name, numpy type or dtype), little-endian as nanoGPT writes them."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in DTYPES:
        raise TokenDataError(f"dtype {dtype!r} is not a token dtype: use one of {', '.join(DTYPES)}")
    return resolved.newbyteorder("<")


def parse_index(text: bytes | str, where: str) -> dict[str, Any]:
    try:
        index = json.loads(text)
    except ValueError as exc:
        raise TokenDataError(f"{where} is not valid JSON ({exc}); run 'fastpar data prepare' again") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("splits"), dict):
        raise TokenDataError(f"{where} is not an index written by 'fastpar data prepare'; remove it or prepare again")
    return index


def split_files(index: dict[str, Any], split: str | None, where: str) -> list[str]:
    """The shard file names of ``split`` (default "train") listed by ``index``."""
    split = split or "train"
    entry = index["splits"].get(split)
    if entry is None or not entry.get("shards"):
        known = ", ".join(name for name, e in index["splits"].items() if e.get("shards")) or "none"
        raise TokenDataError(f"{where} has no shards for split {split!r} (splits with data: {known})")
    return [shard["file"] for shard in entry["shards"]]


def open_token_source(
    source: str | Path,
    *,
    split: str | None = None,
    dtype: Any = None,
    cache_dir: str | Path | None = None,
    cache_max_bytes: int | str | None = None,
    storage: StoreOptions | None = None,
) -> TokenSource:
    """The memory-mapped shards at ``source``; see :func:`fastpar.data.token_loader`."""
    if dtype is not None:
        dtype = check_dtype(dtype)
    if is_url(source):
        return _open_remote(str(source), split, dtype, cache_dir, cache_max_bytes, storage or StoreOptions())
    return _open_local(source, split, dtype)


def _open_local(source: str | Path, split: str | None, dtype: np.dtype | None) -> TokenSource:
    path = local_path(source)
    index = None
    if path.is_dir():
        index_path = path / INDEX_FILE
        if index_path.is_file():
            index = parse_index(index_path.read_bytes(), str(index_path))
            files = [path / name for name in split_files(index, split, str(index_path))]
        else:
            files = _pick_split(sorted(p for p in path.iterdir() if _is_token_file(p.name) and p.is_file()), split)
            if not files:
                raise TokenDataError(
                    f"folder {path} holds no {' or '.join(SUFFIXES)} token files"
                    + (f" named {split}_*" if split else "")
                    + f"; write some with 'fastpar data prepare TEXT... --out {path}'"
                )
    elif path.is_file():
        files = [path]
    elif _GLOB_CHARS & set(str(source)):
        matched = [Path(p) for p in glob.glob(str(source), recursive=True) if Path(p).is_file()]
        files = sorted(p for p in matched if _is_token_file(p.name))  # not index.json or notes beside the shards
        if not files:
            what = f"no {' or '.join(SUFFIXES)} files" if matched else "no files"
            raise TokenDataError(f"the pattern {str(source)!r} matches {what}; check it (quote it in a shell)")
    else:
        raise TokenDataError(f"{source}: no such file, folder or glob; pass token shards (.bin/.npy) or their folder")
    if index is None:  # a shard of a prepared folder, given by name: its folder's index has the dtype
        parents = {f.parent for f in files}
        if len(parents) == 1 and (candidate := next(iter(parents)) / INDEX_FILE).is_file():
            index = parse_index(candidate.read_bytes(), str(candidate))
    dtype = dtype or _index_dtype(index)
    return TokenSource([open_shard(f, str(f), dtype) for f in files], index)


def _is_token_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and not name.startswith(".")


def _pick_split(files: list[Path], split: str | None) -> list[Path]:
    return [f for f in files if f.name.startswith(f"{split}_")] if split else files


def _index_dtype(index: dict[str, Any] | None) -> np.dtype | None:
    return None if index is None or "dtype" not in index else check_dtype(index["dtype"])


def open_shard(path: Path, name: str, dtype: np.dtype | None, suffix: str | None = None) -> TokenShard:
    """One file as a 1-D token array, memory-mapped. ``suffix`` (".bin"/".npy") when ``path``'s name has none."""
    suffix = suffix or path.suffix
    if suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise TokenDataError(f"{name} is not a readable .npy array ({exc}); write it with np.save") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise TokenDataError(
                f"{name} holds a {tokens.dtype} array of shape {tokens.shape}; token shards are 1-D integer arrays"
            )
    else:
        if dtype is None:
            raise TokenDataError(
                f"{name} is raw tokens of unknown width: pass dtype='uint16' (nanoGPT's GPT-2 shards) or "
                f"'uint32', or prepare the data with 'fastpar data prepare', whose {INDEX_FILE} records it"
            )
        size = path.stat().st_size
        if size == 0:
            raise TokenDataError(f"{name} is empty; remove it or prepare the data again")
        if size % dtype.itemsize:
            raise TokenDataError(
                f"{name} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name} tokens): it is cut "
                "short or holds another dtype; pass the dtype it was written with, or prepare it again"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) == 0:
        raise TokenDataError(f"{name} holds no tokens; remove it or prepare the data again")
    return TokenShard(name, tokens)


def default_cache_dir() -> Path:
    """Where downloaded shards live when no ``cache_dir`` is given."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastpar" / "tokens"


def _open_remote(
    url: str,
    split: str | None,
    dtype: np.dtype | None,
    cache_dir: str | Path | None,
    cache_max_bytes: int | str | None,
    storage: StoreOptions,
) -> TokenSource:
    store = open_store(url, storage)
    objects, single = _top_level(store, url), None
    if not objects and url.endswith(SUFFIXES):  # one object named by its URL: list its "folder" instead
        parsed = ObjectURL.parse(url)
        parent, _, single = parsed.prefix.rpartition("/")
        store = open_store(parsed.key_url(parent) if parent else f"{parsed.scheme}://{parsed.bucket}", storage)
        objects = _top_level(store, url)
    index = None
    if INDEX_FILE in objects:
        where = redact_url(objects[INDEX_FILE].url)
        index = parse_index(store.get(objects[INDEX_FILE]), where)
    if single is not None:
        names = [single] if single in objects else []
    elif index is not None:
        names = split_files(index, split, where)
        missing = [n for n in names if n not in objects]
        if missing:
            raise TokenDataError(f"{where} lists {missing[0]}, but {redact_url(url)} holds no such object")
    else:
        names = [f.name for f in _pick_split([Path(n) for n in sorted(objects) if _is_token_file(n)], split)]
    if not names:
        raise TokenDataError(
            f"no {' or '.join(SUFFIXES)} token objects under {redact_url(url)}"
            + (f" named {split}_*" if split else "")
            + "; upload the folder 'fastpar data prepare' wrote"
        )
    dtype = dtype or _index_dtype(index)
    cache = ObjectCache(cache_dir if cache_dir is not None else default_cache_dir(), cache_max_bytes)
    return TokenSource([_cached_shard(store, cache, objects[n], dtype) for n in names], index)


def _top_level(store: Any, url: str) -> dict[str, ObjectInfo]:
    """The objects right under the store's prefix (as a local folder's files), by name."""
    objects = {}
    for info in store.list():
        if info.key.endswith("/"):  # "folder/" markers: no data
            continue
        parts = relative_key(info.key, store.base, redact_url(url))
        if len(parts) == 1 and not parts[0].startswith("."):
            objects[parts[0]] = info
    return objects


def _cached_shard(store: Any, cache: ObjectCache, info: ObjectInfo, dtype: np.dtype | None) -> TokenShard:
    """The object downloaded once into the cache (by whichever rank gets there first), then memory-mapped."""
    data = cache.fetch_once(info, lambda: store.get(info))
    path, name, suffix = cache.path(info), redact_url(info.url), Path(info.key).suffix
    if path.is_file() and path.stat().st_size == info.size:
        del data  # the cached file is mapped instead
        return open_shard(path, name, dtype, suffix)
    warnings.warn(f"{name} could not be kept in the cache {cache.root}: it is held in memory", stacklevel=4)
    return _in_memory(data, name, dtype, suffix)


def _in_memory(data: np.ndarray, name: str, dtype: np.dtype | None, suffix: str) -> TokenShard:
    if suffix == ".npy":
        tokens = np.load(io.BytesIO(data.tobytes()), allow_pickle=False)
        return TokenShard(name, tokens)
    if dtype is None or len(data) % dtype.itemsize or not len(data):
        raise TokenDataError(f"{name}: pass dtype='uint16' or 'uint32' for raw token shards, of whole tokens")
    return TokenShard(name, data.view(dtype))


__all__ = ["TokenDataError", "TokenShard", "TokenSource", "open_shard", "open_token_source"]
