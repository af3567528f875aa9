"""Errors of object-store data: each says which bucket/object, what went wrong and what to do.

They subclass the OSError a local folder would raise in the same situation (FileNotFoundError,
PermissionError), so code that handles a missing folder handles a missing bucket too. No message holds a
credential: URLs in them are redacted (``fastpar.user_errors.redact_url``), and so are the messages of the
client's exceptions they are raised from (``scrub``), which a traceback shows too.
"""

from __future__ import annotations

from typing import Any

from ...user_errors import UserError, redact_url
from .urls import ObjectURL


class ObjectStoreError(OSError, UserError):
    """Reading data from an object store failed (the ``fastpar`` command shows it as one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_url(message))


class UnsafeObjectKeyError(ObjectStoreError, ValueError):
    """An object's key cannot name a file below a local folder (an empty, ``.`` or ``..`` component)."""


def scrub(exc: BaseException) -> BaseException:
    """``exc`` and the exceptions chained to it with the URLs in their messages redacted, in place: a client's
    error quotes the request URL, endpoint userinfo included, and a traceback prints every link of the chain."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.args = tuple(redact_url(a) if isinstance(a, str) else a for a in link.args)
        kwargs = getattr(link, "kwargs", None)  # botocore rebuilds its message from these when pickled
        if isinstance(kwargs, dict):
            link.kwargs = {k: redact_url(v) if isinstance(v, str) else v for k, v in kwargs.items()}
        link = link.__cause__ or link.__context__
    return exc


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket (or fsspec location) does not exist."""


class StoreAccessError(ObjectStoreError, PermissionError):
    """The store refused the request: no permission, or credentials it does not accept."""


class StoreUnreachableError(ObjectStoreError, ConnectionRefusedError):
    """Nothing listens at the store's endpoint (connection refused)."""


class ObjectReadError(ObjectStoreError):
    """An object could not be read: retries used up, or it changed or vanished after it was listed."""


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}


def s3_error(exc: Any, what: str, url: ObjectURL, endpoint: str, credential_source: str) -> ObjectStoreError:
    """The error to raise for a botocore ClientError that retrying will not fix."""
    error = exc.response.get("Error", {})
    code, message = error.get("Code", "?"), error.get("Message", "")
    said = f"(the server said {code}: {message})" if message else f"(the server said {code})"
    where = f"at {endpoint}"
    if code in ("NoSuchBucket", "NoSuchBucketPolicy") or (code == "404" and what.startswith("listing")):
        return BucketNotFoundError(
            f"bucket {url.bucket!r} does not exist {where}, {what} {said}. Check the bucket name, and for an "
            "S3-compatible store the endpoint (AWS_ENDPOINT_URL or endpoint_url=)"
        )
    if code in _CREDENTIAL_CODES:
        return StoreAccessError(
            f"the server {where} rejected the credentials from {credential_source} when {what} {said}. Check "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or AWS_PROFILE"
        )
    if code in ("AccessDenied", "AllAccessDisabled", "403", "Forbidden"):
        action = "s3:ListBucket on bucket" if what.startswith("listing") else "s3:GetObject on the objects of bucket"
        return StoreAccessError(
            f"access denied {what} {where} with the credentials from {credential_source} {said}: they need "
            f"{action} {url.bucket!r}"
        )
    if code in ("NoSuchKey", "404"):
        return ObjectReadError(f"{what}: the object was listed but is gone {said}; was it deleted while training?")
    if code in ("PreconditionFailed", "412"):
        return ObjectReadError(
            f"{what}: the object changed after it was listed (its ETag no longer matches) {said}; start again to "
            "list the current objects"
        )
    return ObjectStoreError(f"{what} failed {where} {said}")
