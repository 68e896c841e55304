"""Count the HTTP requests this process sends to S3, by kind, for tests and benchmarks.

:func:`count_s3_requests` wraps the one place every ``s3fs`` request passes through
(aiobotocore's ``AIOHTTPSession.send``, once per attempt, retries included) while a block
is open, puts the original method back when the last block closes, and tallies each request
as one of::

    LIST        GET of a bucket with a listing query (list-type=2, prefix=, delimiter=)
    GET         GET of a whole object
    RANGE_GET   GET of an object with a Range header
    HEAD        HEAD (an object's or a bucket's)
    PUT, POST, DELETE, and any other method by its name

:func:`count_s3_objects` counts the same requests by kind and object key
(``"GET data/web/meta/torchdata_ext_index.json"``): how often each file is read.

It counts in this process only (each rank counts its own requests), so spawned ranks report
their own counts: per-rank figures need no proxy. What the counts are used for, against S3's
documented per-prefix request rates, is in ``docs/object-storage-at-scale.md``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

__all__ = ["KINDS", "count_s3_objects", "count_s3_requests", "request_kind"]

KINDS = ("LIST", "GET", "RANGE_GET", "HEAD", "PUT", "POST", "DELETE")
"""The kinds counted, in the order reports print them."""

_LIST_QUERY = ("list-type=", "prefix=", "delimiter=", "continuation-token=")


def request_kind(method: str, url: str, headers: Any) -> str:
    """The kind of one S3 request (see the module doc).

    Args:
        method: the HTTP method.
        url: the request URL (path-style or virtual-host style).
        headers: the request headers (a mapping; ``Range`` is looked up case-insensitively).
    """
    method = method.upper()
    if method != "GET":
        return method
    query = urlsplit(url).query
    if any(q in query for q in _LIST_QUERY):
        return "LIST"
    if any(str(k).lower() == "range" for k in headers):
        return "RANGE_GET"
    return "GET"


_lock = threading.Lock()
# the open blocks' counters, each with whether it counts by object key too
_active: list[tuple[Counter[str], bool]] = []
_real_send: Any = None  # aiobotocore's own AIOHTTPSession.send while the wrapper is in place


async def _counted_send(self: Any, request: Any) -> Any:
    """``AIOHTTPSession.send`` while a block is open: tally the request, then send it."""
    kind = request_kind(request.method, request.url, request.headers)
    with _lock:
        for counter, by_key in _active:
            counter[f"{kind} {_key(request.url)}" if by_key else kind] += 1
        real = _real_send
    return await real(self, request)


def _key(url: str) -> str:
    """The bucket and key a request URL names (path-style, as s3fs sends to an endpoint URL),
    without its query."""
    return urlsplit(url).path.lstrip("/")


def _install() -> None:
    """Put the wrapper in place (the caller holds ``_lock`` and opens the first block)."""
    global _real_send
    from aiobotocore.httpsession import AIOHTTPSession

    _real_send = AIOHTTPSession.send
    AIOHTTPSession.send = _counted_send


def _uninstall() -> None:
    """Put aiobotocore's own method back (the caller holds ``_lock`` and closed the last block)."""
    global _real_send
    from aiobotocore.httpsession import AIOHTTPSession

    AIOHTTPSession.send = _real_send
    _real_send = None


@contextlib.contextmanager
def count_s3_requests() -> Iterator[Counter[str]]:
    """Count the S3 requests this process sends inside the block, by kind.

    The first open block wraps ``AIOHTTPSession.send``; the last one to close (normally or
    by an exception) puts the original method back, so nothing stays patched after the block.

    Yields:
        A ``Counter`` of kind -> requests, filled as requests are sent (read it after the
        block, or during it for a running figure). Blocks may nest; each counts what was sent
        while it was open.

    Raises:
        ImportError: ``s3fs`` (and so aiobotocore) is not installed.
    """
    with _counting(by_key=False) as counter:
        yield counter


@contextlib.contextmanager
def count_s3_objects() -> Iterator[Counter[str]]:
    """Count the S3 requests this process sends inside the block by kind and object, as
    :func:`count_s3_requests` does by kind.

    Yields:
        A ``Counter`` of ``"<kind> <bucket>/<key>"`` -> requests (a LIST names its bucket,
        its prefix is in the query left out).
    """
    with _counting(by_key=True) as counter:
        yield counter


@contextlib.contextmanager
def _counting(by_key: bool) -> Iterator[Counter[str]]:
    """One counting block (see :func:`count_s3_requests`)."""
    counter: Counter[str] = Counter()
    entry = (counter, by_key)
    with _lock:
        if not _active:
            _install()
        _active.append(entry)
    try:
        yield counter
    finally:
        with _lock:
            # by identity: two blocks' counters may be equal (both empty)
            del _active[next(i for i, e in enumerate(_active) if e is entry)]
            if not _active:
                _uninstall()
