"""Input pipelines for data-parallel training.

``image_loader`` reads a folder of class subfolders, local or in an object store (``s3://bucket/prefix``),
through DALI (GPU decoding with a GPU, CPU threads without) or a torch DataLoader fallback;
``array_loader`` and ``iterable_loader`` batch data already in Python; ``token_loader`` reads tokenized text
(memory-mapped shards that ``prepare_tokens`` / ``fastpar data prepare`` write, local or ``s3://``). All of them share one epoch plan (``fastpar.data.sharding``): equal batch counts on
every rank, ``set_epoch`` reshuffles, ``state_dict``/``load_state_dict`` resume exactly.
"""

from __future__ import annotations

from ..safe_files import UnsafeFolderError
from .arrays import ArrayLoader, SequenceLoader, StreamLoader, array_loader, iterable_loader
from .folder import ImageFolder, scan_image_folder
from .loader import ImageLoader, image_loader
from .remote.errors import (
    BucketNotFoundError,
    ObjectReadError,
    ObjectStoreError,
    StoreAccessError,
    UnsafeObjectKeyError,
)
from .remote.store import StoreOptions
from .sharding import ShardSpec, num_batches, rank_batches
from .synthetic import make_image_folder
from .tokens import TokenDataError, TokenLoader, document_mask, prepare_tokens, token_loader
from .transforms import CorruptImageError

__all__ = [
    "ArrayLoader",
    "BucketNotFoundError",
    "CorruptImageError",
    "ImageFolder",
    "ImageLoader",
    "ObjectReadError",
    "ObjectStoreError",
    "SequenceLoader",
    "ShardSpec",
    "StoreAccessError",
    "StoreOptions",
    "StreamLoader",
    "TokenDataError",
    "TokenLoader",
    "UnsafeFolderError",
    "UnsafeObjectKeyError",
    "array_loader",
    "document_mask",
    "image_loader",
    "iterable_loader",
    "make_image_folder",
    "num_batches",
    "prepare_tokens",
    "rank_batches",
    "scan_image_folder",
    "token_loader",
]
