"""Listing and reading objects in S3 (boto3) or any other fsspec store, with retries and errors that name the object.

Credentials come from the client's standard chain (for S3: environment variables, the shared
credentials/config files and ``AWS_PROFILE``, container and instance roles) and are never logged; errors
name only where they came from, and show URLs (the endpoint's too) with any userinfo or secret query
parameter redacted. The endpoint is ``StoreOptions.endpoint_url``, else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` (read by boto3 itself), else AWS. A custom endpoint (MinIO, Ceph, a local test server)
is addressed path-style (``http://host:port/bucket/key``), which every S3-compatible store serves.

Retries: throttling (503 SlowDown and other 5xx), timeouts and dropped connections, including a body cut
off mid-transfer, are retried ``retries`` times with exponential backoff (``backoff_s`` doubling up to
``max_backoff_s``, half of it random so many ranks do not retry in lockstep); then an ObjectReadError names
the bucket, key, attempts and the last error. Missing buckets, refused credentials and missing objects
fail at once: waiting does not fix them.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..._optional import require
from ...user_errors import redact_url
from .errors import (
    BucketNotFoundError,
    ObjectReadError,
    ObjectStoreError,
    StoreAccessError,
    StoreUnreachableError,
    s3_error,
    scrub,
)
from .urls import ObjectURL

T = TypeVar("T")
READERS = ("auto", "client", "dali")


@dataclass(frozen=True)
class StoreOptions:
    """How objects are fetched; every knob and its default in one place."""

    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS itself
    retries: int = 10  # attempts after the first, for throttling and dropped connections
    backoff_s: float = 0.2  # first retry waits 0.1-0.2 s, doubling each time ...
    max_backoff_s: float = 5.0  # ... up to this (10 retries: about 20 s in all)
    max_requests: int = 16  # concurrent GETs per process
    prefetch_batches: int = 2  # planned batches fetched ahead of the one being decoded
    list_page_size: int = 1000  # keys per listing request (S3's maximum)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    anonymous: bool = False  # unsigned requests, for public buckets
    reader: str = "auto"  # DALI backend: "client" (this module), "dali" (DALI's own S3 reader), "auto"
    fsspec_kwargs: dict[str, Any] = field(default_factory=dict)  # for non-S3 URLs: fsspec filesystem options

    def __post_init__(self) -> None:
        for name in ("retries", "max_requests", "prefetch_batches", "list_page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "retries" else 1):
                raise ValueError(
                    f"StoreOptions.{name} must be an integer >= {0 if name == 'retries' else 1}, got {value!r}"
                )
        for name in ("backoff_s", "max_backoff_s", "connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StoreOptions.{name} must be positive, got {getattr(self, name)!r}")
        if self.reader not in READERS:
            raise ValueError(f"StoreOptions.reader must be one of {READERS}, got {self.reader!r}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0-based): half fixed, half random ("equal jitter")."""
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: ``version`` (the ETag, or what the store has instead) keys the cache."""

    url: str
    key: str
    size: int
    version: str


class StoreStats:
    """Counters of one process's requests, for tests and benchmarks (thread-safe)."""

    FIELDS = ("requests", "retries", "bytes", "cache_hits", "cache_misses")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.retries = self.bytes = self.cache_hits = self.cache_misses = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


class _Retryable(Exception):
    """A failure worth retrying; ``cause`` is what the client raised."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def retrying(call: Callable[[], T], what: str, options: StoreOptions, stats: StoreStats) -> T:
    """``call()``, retried while it raises _Retryable; then an ObjectReadError naming ``what``."""
    start = time.monotonic()
    for attempt in range(options.retries + 1):
        try:
            return call()
        except _Retryable as failure:
            if attempt == options.retries:
                scrub(failure.cause)
                elapsed = time.monotonic() - start
                raise ObjectReadError(
                    f"gave up on {what} after {attempt + 1} attempts over {elapsed:.1f} s: "
                    f"{type(failure.cause).__name__}: {failure.cause}. The store kept throttling or dropping the "
                    "connection; check that it is up and reachable, or raise StoreOptions(retries=...)"
                ) from failure.cause
            stats.add(retries=1)
            time.sleep(options.backoff(attempt))
    raise AssertionError("unreachable")


class S3Store:
    """One bucket through boto3. The client is made lazily, once per process (it is not fork-safe)."""

    RETRY_CODES = {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }

    def __init__(self, url: ObjectURL, options: StoreOptions):
        self.url, self.options, self.stats = url, options, StoreStats()
        self.credential_source = "?"  # where the client found credentials (env, iam-role, ...): for messages
        self._client: Any = None
        self._pid = -1
        self.reached = False  # a request got an answer: a later refusal is a restart, worth retrying
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # pickled into DataLoader workers / spawned ranks: no client
        state = self.__dict__.copy()
        state.update(_client=None, _pid=-1, _lock=None, stats=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self.stats = threading.Lock(), StoreStats()

    @property
    def base(self) -> str:
        """What every listed key starts with: the keys below it are ``<class>/<image>``."""
        return self.url.list_prefix

    @property
    def endpoint(self) -> str:
        """Where requests go, for messages (credentials redacted): the explicit endpoint, the environment's, or AWS."""
        o = self.options
        url = o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return redact_url(url) if url else "AWS S3"

    def client(self) -> Any:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client, self._pid = self._make_client(), os.getpid()
            return self._client

    def _make_client(self) -> Any:
        boto3 = require("boto3", extra="s3", purpose=f"reading {self.url}")  # str(ObjectURL) is redacted
        from botocore import UNSIGNED
        from botocore.config import Config

        o = self.options
        session = boto3.session.Session()
        custom_endpoint = self.endpoint != "AWS S3"
        config = Config(
            retries={"total_max_attempts": 1},  # retried here, where the error can name the object
            connect_timeout=o.connect_timeout_s,
            read_timeout=o.read_timeout_s,
            max_pool_connections=o.max_requests + 4,
            s3={"addressing_style": "path"} if custom_endpoint else None,
            signature_version=UNSIGNED if o.anonymous else None,
        )
        region = session.region_name or ("us-east-1" if custom_endpoint else None)
        self.credential_source = self._credential_source(session)
        return session.client("s3", endpoint_url=o.endpoint_url, region_name=region, config=config)

    def _credential_source(self, session: Any) -> str:
        """Where the credentials came from (env, shared-credentials-file, iam-role, ...), never what they are."""
        if self.options.anonymous:
            return "none (anonymous)"
        credentials = session.get_credentials()
        return "nowhere (none found)" if credentials is None else credentials.method

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One request: retryable failures become _Retryable, the others an error that says what to do."""
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
        )
        from botocore.exceptions import ConnectionError as TransportError

        self.stats.add(requests=1)
        try:
            answer = fn()
            self.reached = True
            return answer
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if error.get("Code") in self.RETRY_CODES or status >= 500:
                raise _Retryable(scrub(exc)) from exc
            raise s3_error(exc, what, self.url, self.endpoint, self.credential_source) from scrub(exc)
        except NoCredentialsError as exc:
            raise StoreAccessError(
                f"no AWS credentials found for {what}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                "(~/.aws/credentials), or run where an instance/container role applies; for a public bucket pass "
                "StoreOptions(anonymous=True)"
            ) from exc
        except EndpointConnectionError as exc:
            scrub(exc)  # its message quotes the request URL, endpoint userinfo included
            if self.reached or "refused" not in str(exc.kwargs.get("error", "")).lower():
                raise _Retryable(exc) from exc  # a server that answered before (restarting?), a timeout: may pass
            raise StoreUnreachableError(  # nothing has ever listened there: retrying won't change that
                f"connection refused at {self.endpoint} when {what}: no S3 server answers there; start it, or fix the "
                "endpoint (AWS_ENDPOINT_URL or endpoint_url=)"
            ) from exc
        except (TransportError, HTTPClientError, IncompleteReadError) as exc:  # reset, timed out, cut off
            raise _Retryable(scrub(exc)) from exc
        except Exception as exc:  # anything else is raised as it is, without the endpoint's credentials
            scrub(exc)
            raise

    def list(self) -> list[ObjectInfo]:
        """Every object under the prefix, in pages of 1000 (each page retried on its own)."""
        client, url, objects = self.client(), self.url, []
        kwargs: dict[str, Any] = {
            "Bucket": url.bucket,
            "Prefix": url.list_prefix,
            "MaxKeys": self.options.list_page_size,
        }
        while True:
            page = retrying(
                lambda: self._call(f"listing {url}", lambda: client.list_objects_v2(**kwargs)),
                f"listing {url}",
                self.options,
                self.stats,
            )
            for entry in page.get("Contents", []):
                key = entry["Key"]
                objects.append(ObjectInfo(url.key_url(key), key, int(entry["Size"]), entry.get("ETag", "").strip('"')))
            if not page.get("IsTruncated"):
                return objects
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def top_level(self) -> list[str]:
        """Up to 20 "folders" at the top of the bucket: the hint for a prefix that holds nothing."""
        client = self.client()
        page = self._call(
            f"listing s3://{self.url.bucket}/",
            lambda: client.list_objects_v2(Bucket=self.url.bucket, Delimiter="/", MaxKeys=20),
        )
        return [p["Prefix"] for p in page.get("CommonPrefixes", [])] + [c["Key"] for c in page.get("Contents", [])]

    def get(self, info: ObjectInfo) -> bytes:
        """The object's bytes, exactly as listed (If-Match on its ETag: a changed object is an error)."""
        client = self.client()
        condition = {"IfMatch": f'"{info.version}"'} if info.version else {}

        def attempt() -> bytes:
            response = self._call(
                f"reading {info.url}", lambda: client.get_object(Bucket=self.url.bucket, Key=info.key, **condition)
            )
            try:
                body = response["Body"].read()
            except Exception as exc:  # the connection dropped mid-body
                raise _Retryable(exc) from exc
            if len(body) != info.size:
                raise _Retryable(ObjectStoreError(f"got {len(body)} of {info.size} bytes"))
            self.stats.add(bytes=len(body))
            return body

        return retrying(
            attempt, f"reading {info.url} (bucket {self.url.bucket!r}, key {info.key!r})", self.options, self.stats
        )


class FsspecStore:
    """Any other fsspec URL (gs://, az://, memory://, ...): listed with ``find``, read with ``cat_file``."""

    def __init__(self, url: str, options: StoreOptions):
        fsspec = require("fsspec", extra="s3", purpose=f"reading {redact_url(url)}")
        self.fs, self.path = fsspec.core.url_to_fs(url, **options.fsspec_kwargs)
        self.url, self.options, self.stats, self.endpoint = ObjectURL.parse(url), options, StoreStats(), redact_url(url)
        self.base = self.path.rstrip("/") + "/"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        self.stats.add(requests=1)
        try:
            return fn()
        except FileNotFoundError as exc:
            raise BucketNotFoundError(f"{what}: {exc}") from scrub(exc)
        except PermissionError as exc:
            raise StoreAccessError(f"access denied {what}: {exc}") from scrub(exc)
        except (OSError, TimeoutError) as exc:
            raise _Retryable(scrub(exc)) from exc
        except Exception as exc:  # raised as it is, without credentials a URL in its message may hold
            scrub(exc)
            raise

    def list(self) -> list[ObjectInfo]:
        found = retrying(
            lambda: self._call(f"listing {self.url}", lambda: self.fs.find(self.path, detail=True)),
            f"listing {self.url}",
            self.options,
            self.stats,
        )
        objects = []
        for path, info in sorted(found.items()):
            version = next(
                (
                    str(info[k])
                    for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "created")
                    if info.get(k) is not None
                ),
                "",
            )
            objects.append(ObjectInfo(self.fs.unstrip_protocol(path), path, int(info.get("size") or 0), version))
        return objects

    def top_level(self) -> list[str]:
        return sorted(self.fs.ls(self.url.bucket, detail=False))[:20]

    def get(self, info: ObjectInfo) -> bytes:
        def attempt() -> bytes:
            body = self._call(f"reading {info.url}", lambda: self.fs.cat_file(info.key))
            self.stats.add(bytes=len(body))
            return body

        return retrying(attempt, f"reading {info.url}", self.options, self.stats)


def open_store(url: str, options: StoreOptions) -> S3Store | FsspecStore:
    """The store for ``url``: boto3 for ``s3://``, fsspec for other schemes."""
    parsed = ObjectURL.parse(url)
    return S3Store(parsed, options) if parsed.scheme == "s3" else FsspecStore(url, options)


__all__ = [
    "BucketNotFoundError",
    "ObjectInfo",
    "ObjectReadError",
    "ObjectStoreError",
    "S3Store",
    "StoreAccessError",
    "StoreOptions",
    "open_store",
]
