"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's server in its own process.

Why a process of its own: DALI's ``pipe.build()``/``run()`` hold the GIL while DALI's AWS SDK waits on
the network, so a server thread in the same Python process cannot answer DALI's requests (DALI lists,
then fails with curl error 28, "Timeout was reached"; see the README). A separate process also lets a
test stop and restart the server mid-epoch.

The server is seeded before it listens (the same folders again after a restart, so objects and ETags
are unchanged), and a small WSGI layer in front of moto adds what tests need and S3 does not offer:
a log of the requests it served (``GET /_fastpar/requests``) and injected faults (``POST
/_fastpar/faults``: answer ``503 SlowDown``, or drop the connection half-way through the body, for the
next N matching requests). ``auth=True`` enforces IAM after seeding, with three users: ``reader`` (all
of S3), ``lister`` (may list, not read) and ``nobody`` (no permissions).

    with LocalS3({"imgs": "/data/train"}) as server:      # bucket -> local folder
        os.environ.update(server.env())                   # AWS_ENDPOINT_URL, region, credentials
        loader = image_loader("s3://imgs", 64)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from ..._optional import require
from ...launcher import free_port

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_POLICIES = {
    "reader": {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
    # AWS authorises listing as s3:ListBucket; moto >= 5.2 checks the operation's name instead (ListObjectsV2,
    # ListObjects), so the lister is granted all three: on either moto it may list and still not read
    "lister": {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:ListObjectsV2", "s3:ListObjects"], "Resource": "*"},
}


class LocalS3:
    """Start (``start()`` or ``with``), ``stop()``, ``restart()`` a local moto S3 server seeded with
    ``buckets`` (bucket name -> local folder uploaded as its objects, keys relative to the folder)."""

    def __init__(
        self,
        buckets: dict[str, str | Path],
        *,
        auth: bool = False,
        port: int | None = None,
        startup_timeout_s: float = 120.0,
    ):
        require("moto", extra="s3-test", purpose="a local S3 server")
        self.buckets = {name: str(Path(folder).resolve()) for name, folder in buckets.items()}
        self.auth, self.port, self.startup_timeout_s = auth, port or free_port(), startup_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix="fastpar-local-s3-"))
        # its log and ready file go when the server object does (or at exit): stop() keeps them for restart()
        self._remove_workdir = weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)
        self.users: dict[str, dict[str, str]] = {}  # auth=True: user -> access key id/secret
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, user: str = "reader") -> dict[str, str]:
        """Environment for a client of this server (with ``auth``: ``user``'s keys, else any keys)."""
        keys = self.users.get(user, {"id": "testing", "secret": "testing"})
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": keys["id"],
            "AWS_SECRET_ACCESS_KEY": keys["secret"],
        }

    def start(self) -> LocalS3:
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "fastpar.data.remote.local_s3",
            "--port",
            str(self.port),
            "--ready",
            str(ready),
            "--parent",
            str(os.getpid()),
        ]
        args += [f"--bucket={name}={folder}" for name, folder in self.buckets.items()]
        args += ["--auth"] if self.auth else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
        with open(self.workdir / "server.log", "ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.workdir / "server.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"the local S3 server on port {self.port} did not start:\n{tail}")
            time.sleep(0.05)
        self.users = json.loads(ready.read_text())["users"]
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(30)
        self._proc = None

    def close(self) -> None:
        """Stop the server for good and remove its working folder."""
        self.stop()
        self._remove_workdir()

    def restart(self, down_s: float = 0.0) -> None:
        """Stop now; start again on the same port (same objects and ETags) after ``down_s`` seconds."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def restart_in_background(self, down_s: float) -> threading.Thread:
        thread = threading.Thread(target=self.restart, args=(down_s,), daemon=True)
        thread.start()
        return thread

    def _control(self, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        with urllib.request.urlopen(urllib.request.Request(self.endpoint + path, data=data), timeout=30) as r:
            return json.loads(r.read())

    def requests(self) -> list[tuple[str, str, str]]:
        """(method, path, status) of every S3 request served since start/``clear()``."""
        return [tuple(r) for r in self._control("/_fastpar/requests")]

    def object_gets(self) -> int:
        """GETs of objects (not listings) served since start/``clear()``."""
        return sum(1 for method, path, _ in self.requests() if method == "GET" and path.count("/") >= 2)

    def clear(self) -> None:
        """Forget the request log and any faults still pending."""
        self._control("/_fastpar/reset", {})

    def inject(self, fault: str, count: int, *, method: str = "GET", path_contains: str = "") -> None:
        """The next ``count`` requests of ``method`` whose path contains ``path_contains`` fail with
        ``fault``: "503" (503 SlowDown) or "drop" (half the body, then the connection closes)."""
        if fault not in ("503", "drop"):
            raise ValueError(f"fault must be '503' or 'drop', got {fault!r}")
        self._control("/_fastpar/faults", {"fault": fault, "count": count, "method": method, "path": path_contains})

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Faults:
    """WSGI layer in front of moto: request log, injected faults, the control endpoints."""

    def __init__(self, app: Any):
        self.app, self.lock, self.log, self.faults = app, threading.Lock(), [], []

    def _json(self, start_response, value: Any) -> list[bytes]:
        body = json.dumps(value).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    def __call__(self, environ: dict, start_response) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if path.startswith("/_fastpar/"):
            with self.lock:
                if path == "/_fastpar/requests":
                    return self._json(start_response, self.log)
                body = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)) or b"{}")
                if path == "/_fastpar/reset":
                    self.log, self.faults = [], []
                else:
                    self.faults.append(body)
                return self._json(start_response, {"ok": True})
        fault = self._take_fault(method, path)
        if fault == "503":
            self._record(method, path, "503")
            start_response(
                "503 Slow Down", [("Content-Type", "application/xml"), ("Content-Length", str(len(_SLOW_DOWN)))]
            )
            return [_SLOW_DOWN]
        status = []

        def recording_start(code, headers, exc_info=None):
            status.append(code.split()[0])
            return start_response(code, headers, exc_info)

        chunks = self.app(environ, recording_start)
        self._record(method, path, status[0] if status else "?")
        return self._cut(chunks) if fault == "drop" else chunks

    def _take_fault(self, method: str, path: str) -> str | None:
        with self.lock:
            for fault in self.faults:
                if fault["count"] > 0 and fault["method"] == method and fault["path"] in path:
                    fault["count"] -= 1
                    return fault["fault"]
        return None

    def _record(self, method: str, path: str, status: str) -> None:
        with self.lock:
            self.log.append((method, path, status))

    @staticmethod
    def _cut(chunks):
        body = b"".join(chunks)
        yield body[: len(body) // 2]
        raise ConnectionAbortedError("fault injected: connection dropped mid-body")  # werkzeug closes the socket


def _seed(buckets: dict[str, str], auth: bool) -> dict[str, dict[str, str]]:
    """Upload the folders through a throwaway in-process server (moto's backends are process-global)."""
    import boto3
    from moto.server import ThreadedMotoServer

    seeder = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    seeder.start()
    host, port = seeder.get_host_and_port()
    kw = dict(
        endpoint_url=f"http://{host}:{port}",
        region_name="us-east-1",
        aws_access_key_id="seed",
        aws_secret_access_key="seed",
    )
    s3, users = boto3.client("s3", **kw), {}
    for bucket, folder in buckets.items():
        s3.create_bucket(Bucket=bucket)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                s3.put_object(Bucket=bucket, Key=path.relative_to(folder).as_posix(), Body=path.read_bytes())
    if auth:
        iam = boto3.client("iam", **kw)
        for user in ("reader", "lister", "nobody"):
            iam.create_user(UserName=user)
            if user in _POLICIES:
                document = json.dumps({"Version": "2012-10-17", "Statement": [_POLICIES[user]]})
                iam.put_user_policy(UserName=user, PolicyName=f"{user}-s3", PolicyDocument=document)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            users[user] = {"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        request = urllib.request.Request(
            f"http://{host}:{port}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request, timeout=30).read()  # from now on every request is authenticated
    seeder.stop()
    return users


def _exit_with_parent(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a local moto S3 server for fastpar's tests and benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready", required=True, help="file written (JSON) once the server listens")
    parser.add_argument("--bucket", action="append", default=[], help="NAME=FOLDER: a bucket seeded from a folder")
    parser.add_argument("--auth", action="store_true", help="enforce IAM after seeding (users reader/lister/nobody)")
    parser.add_argument("--parent", type=int, help="exit when this process is gone (no server outlives its test)")
    args = parser.parse_args(argv)
    if args.parent:
        threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    users = _seed(dict(b.split("=", 1) for b in args.bucket), args.auth)
    app = _Faults(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", args.port, app, threaded=True)
    tmp = Path(args.ready).with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": args.port, "users": users}))
    tmp.replace(args.ready)
    server.serve_forever()


if __name__ == "__main__":
    main()
