"""Tokenizers for ``fastpar data prepare``, chosen by one string:

- ``bytes``: UTF-8 bytes as ids 0-255 and end-of-text 256 (vocabulary 257); needs nothing installed;
- ``tiktoken:NAME``: a tiktoken encoding such as ``tiktoken:gpt2`` (``pip install tiktoken``);
- ``hf:PATH``: a Hugging Face ``tokenizers`` ``tokenizer.json`` (``pip install tokenizers``).

Each adapter gives ``encode(text) -> ids``, ``decode(ids) -> text``, ``vocab_size`` and ``eot_token``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..._optional import require
from ...user_errors import UserError

# end-of-text spellings looked up in a tokenizer.json's vocabulary, most common first
EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eot_id|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # ids are below it, the end-of-text id included
    eot_token: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes; the end-of-text id is 256."""

    name = "bytes"
    vocab_size = 257
    eot_token = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    def __init__(self, encoding: str):
        tiktoken = require("tiktoken", purpose="fastpar data prepare --tokenizer tiktoken:NAME")
        try:
            self._enc: Any = tiktoken.get_encoding(encoding)
        except ValueError as exc:
            raise UserError(f"tiktoken has no encoding {encoding!r} ({exc}); try tiktoken:gpt2") from None
        self.name = f"tiktoken:{encoding}"
        self.eot_token = int(self._enc.eot_token)
        self.vocab_size = int(self._enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


class HFTokenizer:
    """A ``tokenizer.json``; its end-of-text token is the first of EOT_NAMES it knows, else a new id."""

    def __init__(self, path: str):
        if not Path(path).is_file():
            raise UserError(f"hf:{path}: no such tokenizer.json file; pass hf:PATH/TO/tokenizer.json")
        tokenizers = require("tokenizers", purpose="fastpar data prepare --tokenizer hf:PATH")
        try:
            self._tok: Any = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise UserError(f"hf:{path} is not a tokenizers tokenizer.json ({exc})") from None
        self.name = f"hf:{path}"
        size = int(self._tok.get_vocab_size(with_added_tokens=True))
        known = [self._tok.token_to_id(t) for t in EOT_NAMES]
        found = [i for i in known if i is not None]
        self.eot_token = found[0] if found else size  # none: one id past the vocabulary
        self.vocab_size = max(size, self.eot_token + 1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def get_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names: "bytes", "tiktoken:NAME" or "hf:PATH"."""
    kind, _, arg = spec.partition(":")
    if kind == "bytes" and not arg:
        return ByteTokenizer()
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise UserError(f"unknown tokenizer {spec!r}: use bytes, tiktoken:NAME (e.g. tiktoken:gpt2) or hf:PATH")


__all__ = ["ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "Tokenizer", "get_tokenizer"]
