"""``fastpar data prepare`` / :func:`prepare_tokens`: text files to token shards that ``token_loader`` reads.

Each file is one document, followed by the tokenizer's end-of-text id. Whole documents go to the
validation split (``val_fraction`` of them, picked by ``seed``) or to training. Each split is written as
``<split>_000000.bin``, ``<split>_000001.bin``, ... of ``shard_tokens`` raw little-endian tokens (a last
remainder under half a shard joins the shard before it), ``uint16`` when the vocabulary fits, else
``uint32``, and ``index.json`` records the dtype, vocabulary, end-of-text id, tokenizer and counts.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ...user_errors import UserError
from .source import INDEX_FILE, INDEX_FORMAT, parse_index
from .tokenizers import Tokenizer, get_tokenizer

SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 100_000_000


def text_files(inputs: Iterable[str | Path], suffixes: Iterable[str] = ()) -> list[Path]:
    """The files ``inputs`` name: files as given, folders searched recursively (hidden entries skipped;
    only names ending in one of ``suffixes`` when given), globs expanded (``**`` recurses); in order, once each."""
    suffixes = tuple(suffixes)
    found: dict[Path, None] = {}
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                hidden = any(part.startswith(".") for part in child.relative_to(path).parts)
                if not hidden and child.is_file() and (not suffixes or child.name.endswith(suffixes)):
                    found[child] = None
        elif path.is_file():
            found[path] = None
        elif set("*?[") & set(str(item)):
            matched = sorted(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
            if not matched:
                raise UserError(f"the pattern {str(item)!r} matches no files; check it (quote it in a shell)")
            found.update(dict.fromkeys(matched))
        else:
            raise UserError(f"{item}: no such file or folder; pass text files, folders or globs")
    if not found:
        shown = f" ending in {', '.join(suffixes)}" if suffixes else ""
        raise UserError(f"no files{shown} in {', '.join(map(str, inputs))}; pass text files, folders or globs")
    return list(found)


class _ShardWriter:
    """Writes one split's tokens into shards of ``shard_tokens``, buffering at most one shard."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.documents = 0
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    def add(self, ids: np.ndarray) -> None:
        self.documents += 1
        self._pending.append(ids)
        self._pending_len += len(ids)
        while self._pending_len >= self.shard_tokens:
            joined = np.concatenate(self._pending)
            self._write_new(joined[: self.shard_tokens])
            self._pending, self._pending_len = [joined[self.shard_tokens :]], len(joined) - self.shard_tokens

    def close(self) -> None:
        if not self._pending_len:
            return
        rest = np.concatenate(self._pending)
        if self.shards and len(rest) < self.shard_tokens // 2:  # no short shard at the end: seq_len may exceed it
            last = self.shards[-1]
            with open(self.out / last["file"], "ab") as f:
                f.write(rest.tobytes())
            last["tokens"] += len(rest)
        else:
            self._write_new(rest)
        self._pending, self._pending_len = [], 0

    def _write_new(self, ids: np.ndarray) -> None:
        name = f"{self.split}_{len(self.shards):06d}.bin"
        with open(self.out / name, "wb") as f:
            f.write(ids.tobytes())
        self.shards.append({"file": name, "tokens": len(ids)})

    def summary(self) -> dict[str, Any]:
        tokens = sum(s["tokens"] for s in self.shards)
        return {"shards": self.shards, "tokens": tokens, "documents": self.documents}


def _val_documents(count: int, val_fraction: float, seed: int) -> set[int]:
    if val_fraction <= 0 or count < 2:
        return set()
    k = min(count - 1, max(1, round(val_fraction * count)))
    return set(np.random.default_rng(seed).choice(count, size=k, replace=False).tolist())


def _remove_old_shards(out: Path) -> None:
    """The shards of an earlier prepare into ``out`` (named by its index), so none outlives the new index."""
    index_path = out / INDEX_FILE
    if not index_path.is_file():
        return
    old = parse_index(index_path.read_bytes(), str(index_path))
    for entry in old["splits"].values():
        for shard in entry.get("shards", []):
            name = Path(shard["file"]).name  # never a path outside out
            (out / name).unlink(missing_ok=True)
    index_path.unlink()


def prepare_tokens(
    inputs: str | Path | Iterable[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Tokenizer = "bytes",
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    suffixes: Iterable[str] = (),
    seed: int = 0,
) -> dict[str, Any]:
    """Tokenize text files into shards in ``out`` for :func:`token_loader`; returns the index it wrote.

    ``inputs``: files, folders (searched recursively; ``suffixes=(".py",)`` keeps only those names) and
    globs. ``tokenizer``: "bytes" (no dependencies), "tiktoken:NAME" or "hf:PATH/tokenizer.json".
    ``val_fraction`` of the documents (files), at least one when it is above 0 and there are two or more,
    go to the "val" split. Files that are not UTF-8 text are skipped, with one warning.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise UserError(f"shard_tokens must be at least 1, got {shard_tokens}")
    files = text_files([inputs] if isinstance(inputs, (str, Path)) else list(inputs), suffixes)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    dtype = np.dtype("<u2") if tok.vocab_size <= 1 << 16 else np.dtype("<u4")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    _remove_old_shards(out)
    writers = {split: _ShardWriter(out, split, dtype, shard_tokens) for split in SPLITS}
    val = _val_documents(len(files), val_fraction, seed)
    skipped = []
    for number, path in enumerate(files):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(str(path))
            continue
        ids = np.asarray([*tok.encode(text), tok.eot_token], dtype=dtype)
        writers["val" if number in val else "train"].add(ids)
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        warnings.warn(
            f"skipped {len(skipped)} files that are not UTF-8 text: {', '.join(skipped[:3])}{more}", stacklevel=2
        )
    for writer in writers.values():
        writer.close()
    if not writers["train"].shards:
        raise UserError(f"no text to train on in {len(files)} files (all skipped or in the val split)")
    index = {
        "format": INDEX_FORMAT,
        "version": 1,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eot_token": tok.eot_token,
        "tokenizer": tok.name,
        "splits": {split: writer.summary() for split, writer in writers.items()},
        "skipped_files": len(skipped),
    }
    temporary = out / f".{INDEX_FILE}.tmp"
    temporary.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(temporary, out / INDEX_FILE)  # a reader sees the whole index or none
    return index


__all__ = ["prepare_tokens", "text_files"]
