"""Data locations given as URLs (``s3://bucket/prefix``, other fsspec URLs) rather than local folders."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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
        if not match:
            raise ValueError(f"{url!r} is not a URL: expected scheme://bucket/prefix, e.g. s3://my-bucket/train")
        scheme, rest = match.group(1).lower(), match.group(2)
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket: expected {scheme}://bucket/prefix")
        if scheme in ("s3", "s3a") and not _BUCKET.match(bucket):
            raise ValueError(
                f"{bucket!r} in {url!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' and '-')"
            )
        return cls("s3" if scheme == "s3a" else scheme, bucket, prefix.strip("/"))

    def key_url(self, key: str) -> str:
        """The URL of one object of this bucket."""
        return f"{self.scheme}://{self.bucket}/{key}"

    @property
    def list_prefix(self) -> str:
        """The prefix to list: the "folder" itself, so ``s3://b/train`` does not match ``train2/``."""
        return f"{self.prefix}/" if self.prefix else ""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.list_prefix}"
