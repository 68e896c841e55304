"""Shared fixtures: a real S3 endpoint on 127.0.0.1 (moto's server) and a fault-injecting proxy.

``s3`` gives each test its own bucket on one moto server per session (started on a free port of
127.0.0.1, stopped at the end), with AWS credentials set in the environment for that test only.
``s3_proxy`` puts a :class:`FaultProxy` in front of it: an HTTP proxy that can answer a share of
requests with ``503 SlowDown``, reset the connection, or cut a response body short, and counts
every request.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import socket
import struct
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _cache_dir_of_the_test_run(tmp_path_factory) -> Iterator[None]:
    """Counts and shard caches the library writes go into the run's temporary folder, not the
    machine's shared cache folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path_factory.mktemp("library_cache")))
        yield


@dataclass
class S3Endpoint:
    """A bucket on the test S3 endpoint.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        bucket: a fresh bucket for this test.
        storage_options: fsspec options reaching the endpoint (``key``/``secret``/``client_kwargs``).
    """

    endpoint_url: str
    bucket: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def options_via(self, endpoint_url: str, **extra: Any) -> dict[str, Any]:
        """The storage options pointed at another endpoint (e.g. a proxy)."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
            **extra,
        }


def _storage_options(endpoint_url: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }


#: the moto server's process: serves until a line or EOF on its stdin, or its parent's death
_MOTO_MAIN = """
import ctypes, logging, signal, sys
try:  # ended with the test process, even by SIGKILL (Linux: PR_SET_PDEATHSIG)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except (AttributeError, OSError):
    pass
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.readline()  # a line at the session's end; EOF if the test process is gone
server.stop()
"""


@pytest.fixture(scope="session")
def _one_botocore_loader() -> Iterator[None]:
    """Every botocore session of this process reads the S3 service model and the endpoint
    data through one ``Loader``, as a session's clients do: each new session parsed those
    JSON files again, ~0.1 s of CPU per client, and the S3 tests make hundreds of clients
    (a test's own filesystems, the library's private ones per endpoint, each worker's after
    a fork, which inherits the parsed files). The data read, the clients and their requests
    are the same; only the parsing is done once."""
    pytest.importorskip("botocore")
    import botocore.session

    loaders: dict[str | None, Any] = {}
    create_loader = botocore.session.create_loader

    def shared_loader(search_path_string: str | None = None) -> Any:
        if search_path_string not in loaders:
            loaders[search_path_string] = create_loader(search_path_string)
        return loaders[search_path_string]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(botocore.session, "create_loader", shared_loader)
        yield


@pytest.fixture(scope="session")
def s3_server(_one_botocore_loader: None) -> Iterator[str]:
    """One moto S3 server on 127.0.0.1 for the session, in a process of its own; yields its
    endpoint URL.

    Not a thread of the test process: a loader worker forked from it would inherit the
    server's connection sockets (a connection the server closes stays open while the worker
    lives), and the server would wait for the test's own work to release the GIL. The
    server exits when it reads a line at the session's end (not at EOF alone: a process
    forked from the test process, e.g. a loader worker, holds a copy of the pipe's write end
    and kept the server waiting out the 30 s below, at the end of the suite), and when the
    test process dies, even by SIGKILL (nothing is left running)."""
    import select
    import subprocess

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    proc = subprocess.Popen(
        [sys.executable, "-c", _MOTO_MAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        url = proc.stdout.readline().strip() if ready else ""
        if not url.startswith("http://"):
            raise RuntimeError(f"the moto server did not start (exit code {proc.poll()})")
        yield url
    finally:
        with contextlib.suppress(OSError):  # gone already: nothing to stop
            proc.stdin.write("stop\n")
            proc.stdin.flush()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def credentials_checked(endpoint_url: str) -> Iterator[None]:
    """The moto server at ``endpoint_url`` checks credentials inside the block (it accepts
    any by default), through its ``/moto-api/reset-auth`` API."""
    import json
    import urllib.request

    def reset(count: str) -> str:
        request = urllib.request.Request(
            f"{endpoint_url}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would be parsed, not read
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.load(response)["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])

    before = reset("0")
    try:
        yield
    finally:
        reset(before)


@pytest.fixture
def s3(
    s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Endpoint]:
    """A fresh bucket on the session's S3 endpoint; AWS variables set for this test only, and
    the default shard cache folder (``TORCHDATA_EXT_CACHE_DIR``) in a temporary folder."""
    import s3fs

    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path_factory.mktemp("shard_cache")))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    options = _storage_options(s3_server)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    fs.call_s3("create_bucket", Bucket=bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield S3Endpoint(s3_server, bucket, options)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


# ------------------------------------------------------------------------------ fault proxy
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class _QuietServer(ThreadingHTTPServer):
    """The proxy's server: a client that drops its connection is no error of the proxy's (the
    default prints a traceback to stderr, which tests read for the workers' tracebacks)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    """An HTTP proxy to the S3 endpoint that injects faults, deterministically.

    Attempt ``n`` of a request (method + path + query) fails when ``n < max_faults`` and a hash of
    ``(seed, request without the bucket, n)`` falls below ``share``; the fault kind (``"503"``, ``"reset"``: the
    connection is reset without an answer, ``"truncate"``: half the body then a reset) comes from
    the same hash. Requests for keys ending in one of ``always_fail`` get ``503`` every time.
    The outcome depends only on each request's own history, not on thread timing.

    Attributes:
        requests: ``Counter`` of ``(method, path)`` seen.
        faults: ``Counter`` of fault kinds injected.
    """

    def __init__(
        self,
        upstream_url: str,
        share: float = 0.0,
        *,
        seed: int = 0,
        max_faults: int = 3,
        kinds: tuple[str, ...] = ("503", "reset", "truncate"),
    ) -> None:
        host, port = upstream_url.split("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.share = share
        self.seed = seed
        self.max_faults = max_faults
        self.kinds = kinds
        self.always_fail: set[str] = set()
        self.methods: tuple[str, ...] = ("GET", "HEAD", "PUT", "POST", "DELETE")  # faulted
        self.requests: Counter[tuple[str, str]] = Counter()
        self.faults: Counter[str] = Counter()
        self.faulted: Counter[tuple[str, str]] = Counter()  # (method, key) faults
        self._attempts: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def restart_faults(self) -> None:
        """Forget the attempts seen so far: the next requests get a fresh fault pattern."""
        with self._lock:
            self._attempts.clear()

    def gets(self, suffix: str = "") -> int:
        """GET and HEAD requests for keys ending in ``suffix``."""
        return sum(
            n
            for (method, path), n in self.requests.items()
            if method in ("GET", "HEAD") and path.endswith(suffix) and "?" not in path
        )

    def _fault(self, method: str, path: str) -> str | None:
        key = f"{method} {path}"
        bare = path.split("?", 1)[0]
        with self._lock:
            n = self._attempts[key]
            self._attempts[key] += 1
            self.requests[(method, path if "list-type" in path else bare)] += 1
        if any(bare.endswith(s) for s in self.always_fail):
            return "503"
        if n >= self.max_faults or self.share <= 0 or method not in self.methods:
            return None
        # the bucket (random per test) is left out, so a seed gives the same faults every run
        unbucketed = f"{method} {path.lstrip('/').partition('/')[2]}"
        h = hashlib.sha256(f"{self.seed}|{unbucketed}|{n}".encode()).digest()
        if int.from_bytes(h[:8], "little") / 2**64 >= self.share:
            return None
        return self.kinds[h[8] % len(self.kinds)]

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else b""
        kind = self._fault(req.command, req.path)
        if kind == "truncate" and req.command != "GET":
            kind = "reset"
        if kind is not None:
            with self._lock:
                self.faults[kind] += 1
                self.faulted[(req.command, req.path.split("?", 1)[0])] += 1
        if kind == "503":
            req.send_response(503)
            req.send_header("Content-Type", "application/xml")
            req.send_header("Content-Length", str(len(_SLOWDOWN)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(_SLOWDOWN)
            return
        if kind == "reset":
            self._reset(req)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP_HEADERS}
            conn.request(req.command, req.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        req.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_HEADERS and k.lower() != "content-length":
                req.send_header(k, v)
        if req.command == "HEAD":
            req.send_header("Content-Length", resp.getheader("Content-Length") or "0")
            req.end_headers()
            return
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if kind == "truncate" and len(data) > 1:
            req.wfile.write(data[: len(data) // 2])
            req.wfile.flush()
            self._reset(req)
            return
        req.wfile.write(data)

    @staticmethod
    def _reset(req: BaseHTTPRequestHandler) -> None:
        # shutdown() first: close() alone ends the connection only when no other process holds
        # the socket, and loader workers forked from this process while it was open hold it
        # (the client then waited for its read timeout, 15 s, instead of seeing the drop)
        req.close_connection = True
        with contextlib.suppress(OSError):
            req.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            req.connection.shutdown(socket.SHUT_RDWR)
        req.connection.close()


@pytest.fixture
def s3_proxy(s3: S3Endpoint) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the test endpoint (no faults until configured)."""
    proxy = FaultProxy(s3.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.stop()
