"""Document-aware packing: windows cut from a stream of documents, each ended by an end-of-text token.

A window holds the end of one document, whole documents and the start of another. ``document_ids``
number them inside each row (the end-of-text token belongs to the document it ends), ``position_ids``
count from 0 at each document's first token, and :func:`document_mask` lets attention see only earlier
tokens of the same document, so packed documents do not attend to each other.
"""

from __future__ import annotations

import numpy as np
import torch


def document_ids(inputs: np.ndarray, eot_token: int) -> np.ndarray:
    """``(B, L)`` int64: 0 for the row's first document, +1 after each end-of-text token."""
    is_eot = inputs == eot_token
    return np.cumsum(is_eot, axis=1, dtype=np.int64) - is_eot


def position_ids(doc_ids: np.ndarray) -> np.ndarray:
    """``(B, L)`` int64: each token's position inside its document (0 where one starts)."""
    batch, length = doc_ids.shape
    index = np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length))
    starts = np.ones((batch, length), dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)  # where the current document began
    return index - first


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """A causal, block-diagonal attention mask from ``(B, L)`` document ids: ``(B, 1, L, L)`` bool, True where
    query ``i`` may attend to key ``j`` (``j <= i`` and the same document). Pass it as ``attn_mask`` to
    ``torch.nn.functional.scaled_dot_product_attention``; the 1 broadcasts over heads."""
    if doc_ids.dim() != 2:
        raise ValueError(f"document_mask expects (batch, seq_len) document ids, got shape {tuple(doc_ids.shape)}")
    length = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, L, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


__all__ = ["document_ids", "document_mask", "position_ids"]
