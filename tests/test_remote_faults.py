"""Faults of object storage, as a user meets them.

An endpoint that cannot be reached (nothing listens, unknown host, wrong scheme, not a URL, not
an S3 server) fails within seconds with an error naming the URL, the endpoint and what to check,
instead of being retried for a minute; real transient errors are retried, one log line each;
the full pipeline through 2 worker processes over a store that answers 10% of requests with 503
(or drops connections mid-download) delivers every token of every document exactly once, its
checkpoint written to and restored from that store.
"""

from __future__ import annotations

import errno
import functools
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import FaultProxy, S3Endpoint
from harness import check_exactly_once, document_lengths
from test_remote_pipeline import _cfg, _write_corpus, build
from test_rescale import NAMES, cover

from torchdata_ext import DatasetIndex
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.remote import (
    RemoteError,
    RetryPolicy,
    ShardCache,
    is_transient,
    read_bytes,
    with_retries,
    write_bytes_atomic,
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _NotS3(BaseHTTPRequestHandler):
    """A web server that is not an S3 endpoint: 404 for GET/HEAD, 501 for anything else."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_error(404)


@pytest.fixture
def web_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _options(endpoint: str) -> dict:
    return S3Endpoint(endpoint, "").options_via(endpoint)


def _tiny_loader(tmp_path) -> TokenLoader:
    data = str(tmp_path / "data")
    _write_corpus(data)
    loader = TokenLoader(functools.partial(build, _cfg(data)))
    next(iter(loader))
    return loader


FAIL_FAST_S = 15
"""Seconds a refused store may take to fail: retried, it took 60-75 s; a TLS handshake
failure alone took over 3 s on a loaded 2-core machine."""


@pytest.mark.parametrize(
    "endpoint, says",
    [
        ("http://127.0.0.1:{closed}", r"cannot connect to the endpoint http://127\.0\.0\.1:\d+ "
         r"\(connection refused.*check the endpoint URL .*endpoint_url.*server is running"),
        ("http://no-such-host.invalid:9000", r"endpoint http://no-such-host\.invalid:9000 "
         r"\(unknown host.*check the endpoint URL"),
        ("localhost:9000", r"endpoint URL 'localhost:9000' is not valid.*'http://host:9000'"),
        ("https://{web}", r"endpoint https://127\.0\.0\.1:\d+ \(the TLS handshake failed.*"
         r"check the scheme of the endpoint URL \(http:// for a server without TLS\)"),
    ],
    ids=["refused", "unknown-host", "not-a-url", "https-to-http"],
)  # fmt: skip
def test_an_unreachable_endpoint_fails_at_once_naming_it(
    s3, tmp_path, web_server, endpoint, says
) -> None:
    """Writes, reads, the shard cache, a dataset listing and ``save_checkpoint``: each fails
    within seconds (before: 8 retries over 60-75 s each, then a raw botocore error from
    ``save_checkpoint``)."""
    so = _options(endpoint.format(closed=_closed_port(), web=web_server))
    bucket = f"s3://gone-{uuid.uuid4().hex[:8]}"  # never answered in this process
    loader = _tiny_loader(tmp_path)
    calls = {
        "write": lambda: write_bytes_atomic(f"{bucket}/x.json", b"{}", so),
        "read": lambda: read_bytes(f"{bucket}/x.json", so),
        "cache": lambda: ShardCache(tmp_path / "cache").acquire(f"{bucket}/d/p0.arrow", so),
        "save_checkpoint": lambda: save_checkpoint(loader, f"{bucket}/ckpt", storage_options=so),
    }
    for what, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=f"^{bucket}/.*: [a-z]+ failed: .*{says}"):
            call()
        # a bound far below the 60-75 s of retries, with room for a loaded 2-core CI machine
        assert time.monotonic() - t0 < FAIL_FAST_S, what
    # a listing: the probe (a GET, not a LIST) refuses the store before it is sent
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=f"^{bucket}/data: access failed: .*{says}"):
        DatasetIndex.build(f"{bucket}/data", storage_options=so)
    assert time.monotonic() - t0 < 20


def test_a_server_that_is_not_s3_is_named_as_such(s3, web_server) -> None:
    so = _options(f"http://{web_server}")
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"does not implement this request.*S3-compatible"):
        write_bytes_atomic(f"s3://b-{uuid.uuid4().hex[:8]}/x.json", b"{}", so)
    assert time.monotonic() - t0 < FAIL_FAST_S


def _refused(host: str = "127.0.0.1", port: int = 9) -> BaseException:
    """The chain botocore raises when nothing listens (as s3fs passes it on)."""
    from aiohttp import ClientConnectorError
    from aiohttp.client_reqrep import ConnectionKey
    from botocore.exceptions import EndpointConnectionError

    key = ConnectionKey(host, port, False, True, None, None, None)
    inner = ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    outer = EndpointConnectionError(endpoint_url=f"http://{host}:{port}/bucket/key")
    outer.__cause__ = inner
    return outer


def test_unreachable_endpoints_are_permanent_and_real_faults_transient() -> None:
    from botocore.exceptions import ClientError, ConnectTimeoutError

    def client_error(code: str, status: int) -> ClientError:
        meta = {"HTTPStatusCode": status}
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": meta}, "GetObject")

    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    dns_timeout = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    permanent = [
        _refused(),
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
        unknown,
        ValueError("Invalid endpoint: localhost:9000"),
        client_error("NotImplemented", 501),
    ]
    transient = [
        dns_timeout,
        ConnectTimeoutError(endpoint_url="http://10.0.0.1:9000/b/k"),
        client_error("SlowDown", 503),
        client_error("InternalError", 500),
        ConnectionResetError(errno.ECONNRESET, "reset"),
    ]
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)
    assert [is_transient(e) for e in transient] == [True] * len(transient)


def test_each_retry_is_one_log_line_with_url_attempt_and_wait(caplog) -> None:
    errors = [ConnectionResetError(errno.ECONNRESET, "reset by peer")] * 3

    def flaky() -> str:
        if errors:
            raise errors.pop()
        return "ok"

    policy = RetryPolicy(max_attempts=5, base_delay_s=0.01, max_delay_s=0.02)
    with caplog.at_level(logging.DEBUG, logger="torchdata_ext.remote"):
        assert with_retries(flaky, "s3://b/k.arrow", policy, what="download") == "ok"
    lines = [r for r in caplog.records if r.name.startswith("torchdata_ext.remote")]
    assert len(lines) == 3 and all(r.levelno == logging.WARNING for r in lines)
    for k, r in enumerate(lines, start=1):
        assert r.exc_info is None and "\n" not in r.getMessage()
        assert r.getMessage().startswith(
            f"s3://b/k.arrow: download failed (ConnectionResetError: [Errno 104] reset by peer); "
            f"attempt {k} of 5, retrying in 0.0"
        )


def test_a_store_that_answered_before_is_waited_for_when_it_goes_away() -> None:
    """A refused connection to a store that answered earlier is an outage (a server restarting):
    retried under the policy, not a configuration error."""
    url = f"s3://seen-{uuid.uuid4().hex[:8]}/k"
    policy = RetryPolicy(max_attempts=50, base_delay_s=0.01, max_delay_s=0.02, total_timeout_s=5)
    with pytest.raises(RemoteError, match="cannot connect"):
        with_retries(lambda: (_ for _ in ()).throw(_refused()), url, policy)
    assert with_retries(lambda: "up", url, policy) == "up"
    down = [_refused(), _refused()]
    retried: list[BaseException] = []

    def restarting() -> str:
        if down:
            raise down.pop()
        return "back"

    assert with_retries(restarting, url, policy, on_retry=retried.append) == "back"
    assert len(retried) == 2


# ----------------------------------------------------------------- the full pipeline under faults
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kinds, share",
    [(("503",), 0.1), (("truncate",), 0.2)],
    ids=["10%-503-SlowDown", "connections-dropped-mid-download"],
)
def test_full_pipeline_under_faults_delivers_every_token_exactly_once(
    s3, s3_proxy: FaultProxy, tmp_path, monkeypatch, caplog, capfd, kinds, share
) -> None:
    """Interleave + pack + shuffle buffer through 2 worker processes, reading through the
    fault-injecting proxy with the default retry policy; a checkpoint written through it after 6
    steps restores onto 1 worker (a fresh shard cache), and the rest of the epoch comes through
    the same faults: every token of every document exactly once, by provenance."""
    data = s3.url("data")
    _write_corpus(data, s3.storage_options)
    for name in NAMES:  # count the documents once, without faults (meta/ counts file)
        DatasetIndex.build(f"{data}/{name}", storage_options=s3.storage_options)
    s3_proxy.share, s3_proxy.kinds = share, kinds
    so = s3.options_via(s3_proxy.endpoint_url)
    cfg = _cfg(data, so)
    ckpt = s3.url("ckpt", "step_6")
    coverage: dict = {}
    with caplog.at_level(logging.WARNING, logger="torchdata_ext"):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=2)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 6:
                break
        cover(coverage, seqs, NAMES)
        save_checkpoint(loader, ckpt, storage_options=so)
        retries = loader.io_stats()["retries"]
        del loader
        monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "fresh_cache"))
        loader = TokenLoader(functools.partial(build, cfg), num_workers=1)
        load_checkpoint(loader, ckpt, storage_options=so)
        cover(coverage, list(loader), NAMES)
        retries += loader.io_stats()["retries"]
    check_exactly_once(coverage, document_lengths(_cfg(data, s3.storage_options)))
    assert s3_proxy.faults[kinds[0]] > 0, s3_proxy.faults
    # the faults reached the data files' downloads (else the seed tests nothing of them), and
    # each faulted one was sent again
    downloads = [k for k in s3_proxy.faulted if k[0] == "GET" and k[1].endswith(".arrow")]
    assert downloads, s3_proxy.faulted
    assert all(s3_proxy.requests[k] > s3_proxy.faulted[k] for k in downloads), s3_proxy.requests
    if "truncate" in kinds:  # a cut-short download is retried here; s3fs retries a 503 itself
        assert retries > 0
    # retries in this process (restoring old workers' graphs reads data too): a line each
    for r in caplog.records:
        assert r.exc_info is None and re.match(r"s3://\S+: \w+ failed .*retrying in", r.message)
    assert "Traceback" not in capfd.readouterr().err  # nor from the worker processes
