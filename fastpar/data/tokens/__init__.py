"""Tokenized text for language-model training: ``prepare_tokens`` writes token shards, ``token_loader``
reads next-token windows from them (memory-mapped, local or ``s3://``) in one global order per epoch
that resumes exactly at any world size; ``document_mask`` for packed documents."""

from __future__ import annotations

from .loader import TokenLoader, token_loader
from .packing import document_mask
from .prepare import prepare_tokens
from .source import TokenDataError

__all__ = ["TokenDataError", "TokenLoader", "document_mask", "prepare_tokens", "token_loader"]
