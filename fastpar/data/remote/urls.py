"""Data locations given as URLs (``s3://bucket/prefix``, other fsspec URLs) rather than local folders.

A URL is shown (``str(ObjectURL)``, error messages) with its credentials redacted: an fsspec URL may carry
a password or token (``ftp://user:pass@host``, ``?token=``); an ``s3://`` URL never does (credentials come
from the AWS chain), so userinfo in one is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...user_errors import redact_url

# "scheme://": two or more letters, so a Windows drive ("C:\\data") is never taken for one
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://(.*)$")
# What an S3 bucket name may be (3-63 lowercase letters, digits, dots, hyphens); anything else is a typo
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_url(location: str | Path) -> bool:
    """True for ``scheme://...`` locations other than ``file://`` (a plain local path)."""
    if isinstance(location, Path):
        return False
    match = _URL.match(str(location))
    return bool(match) and match.group(1).lower() != "file"


def local_path(location: str | Path) -> Path:
    """A local folder given as a path or a ``file://`` URL."""
    match = _URL.match(str(location))
    return Path(match.group(2)) if match and match.group(1).lower() == "file" else Path(location)


@dataclass(frozen=True)
class ObjectURL:
    """``scheme://bucket/prefix`` split into its parts; ``prefix`` has no leading or trailing slash."""

    scheme: str
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> ObjectURL:
        match = _URL.match(url)
        shown = redact_url(url)
        if not match:
            raise ValueError(f"{shown!r} is not a URL: expected scheme://bucket/prefix, e.g. s3://my-bucket/train")
        scheme, rest = match.group(1).lower(), match.group(2)
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{shown!r} names no bucket: expected {scheme}://bucket/prefix")
        if scheme in ("s3", "s3a") and ("@" in bucket or ":" in bucket):  # user:password@ (no bucket has either)
            raise ValueError(
                f"{shown!r} holds credentials: an s3:// URL takes none; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead, and pass s3://bucket/prefix"
            )
        if scheme in ("s3", "s3a") and not _BUCKET.match(bucket):
            raise ValueError(
                f"{bucket!r} in {shown!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' and '-')"
            )
        return cls("s3" if scheme == "s3a" else scheme, bucket, prefix.strip("/"))

    def key_url(self, key: str) -> str:
        """The URL of one object of this bucket (to read it: credentials kept; show it through ``redact_url``)."""
        return f"{self.scheme}://{self.bucket}/{key}"

    @property
    def list_prefix(self) -> str:
        """The prefix to list: the "folder" itself, so ``s3://b/train`` does not match ``train2/``."""
        return f"{self.prefix}/" if self.prefix else ""

    def __str__(self) -> str:
        """For messages: credentials redacted."""
        return redact_url(f"{self.scheme}://{self.bucket}/{self.list_prefix}")
