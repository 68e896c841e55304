"""Errors of remote storage and how they are retried.

:func:`with_retries` runs an operation under a :class:`RetryPolicy`: exponential backoff with
full jitter on transient errors (HTTP 5xx / 429 / ``SlowDown``, connection resets, timeouts,
truncated bodies), a bounded number of attempts and of total time, each retry one log line
(URL, attempt, wait), then a :class:`RemoteError` naming the URL. Permanent errors are not
retried: a missing bucket, bad credentials or an endpoint that cannot be reached (connection
refused, unknown host, failed TLS handshake, invalid endpoint URL) raise a :class:`RemoteError`
at once saying what to check (:func:`explain_error`); a missing object raises
``FileNotFoundError``. :func:`is_transient` is the classification.

No I/O here: the operations are the callers'.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

__all__ = [
    "IncompleteDownload",
    "RemoteError",
    "RetryPolicy",
    "explain_error",
    "is_transient",
    "with_retries",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# S3 / HTTP error codes worth retrying (throttling, server-side trouble, timeouts)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "PriorRequestNotComplete",
        "OperationAborted",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    }
)
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AccountProblem",
        "AllAccessDisabled",
        "403",
    }
)
_CREDENTIALS_HINT = (
    "check the credentials (storage_options key/secret/token, or the environment variables "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE), the bucket's "
    "access policy, and the endpoint (storage_options client_kwargs endpoint_url, or "
    "AWS_ENDPOINT_URL)"
)
_ENDPOINT_HINT = "storage_options client_kwargs endpoint_url, or AWS_ENDPOINT_URL"
# getaddrinfo errors that say the name does not exist (EAI_AGAIN, a DNS server that did not
# answer, stays transient)
_UNKNOWN_HOST = frozenset(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_SERVICE") if hasattr(socket, n)
)

# stores (``protocol://bucket``) that answered a request in this process: for them a refused
# connection or an unknown host is an outage (a server restarting) and is retried
_REACHED: set[str] = set()


class RemoteError(OSError):
    """Remote storage failed: transient errors that outlasted the retries, a missing bucket,
    refused credentials, or an unreachable endpoint.

    The reader never skips a file for this error (``on_error="skip"`` is for bad files, not for
    an outage), so a checkpoint never records healthy files as skipped.

    Attributes:
        url: the URL at fault.
        transient: True when the retries ran out (the store may work again later).
    """

    def __init__(self, url: str, message: str, *, transient: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.transient = transient

    def __reduce__(self) -> Any:  # keep url and message through pickling (worker processes)
        return _rebuild_remote_error, (self.url, str(self), self.transient)


def _rebuild_remote_error(url: str, text: str, transient: bool) -> RemoteError:
    err = RemoteError(url, "", transient=transient)
    err.args = (text,)
    return err


class IncompleteDownload(OSError):
    """A download ended with fewer (or more) bytes than the object has: retried."""


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried: exponential backoff with full jitter, bounded.

    Attempt ``k`` (from 1) that fails transiently is followed by a sleep drawn uniformly from
    ``[0, min(max_delay_s, base_delay_s * 2 ** (k - 1))]``. The call gives up with a
    :class:`RemoteError` after ``max_attempts`` attempts, or as soon as the next sleep would end
    after ``total_timeout_s`` seconds from the first attempt (a single slow attempt is bounded by
    the filesystem's own timeouts).

    Args:
        max_attempts: attempts in all (>= 1; 1 = no retry).
        base_delay_s: the first backoff bound, seconds.
        max_delay_s: the largest backoff bound, seconds.
        total_timeout_s: the bound on the time spent retrying one operation, seconds.
    """

    max_attempts: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    total_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts={self.max_attempts!r} must be an integer")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")
        for name in ("base_delay_s", "max_delay_s", "total_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name}={v!r} must be a number >= 0")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The sleep after failed attempt ``attempt`` (1-based): full jitter."""
        bound = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(attempt - 1, 60))
        return (rng or random).uniform(0.0, bound)


def with_retries(
    fn: Callable[[], T],
    url: str,
    policy: RetryPolicy | None = None,
    *,
    what: str = "read",
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``fn()``, retrying transient errors under ``policy``.

    Each retry logs one warning naming the URL, the error, the attempt and the wait (no
    traceback). An endpoint that cannot be reached (connection refused, unknown host) fails at
    once, unless the same store (``protocol://bucket``) answered earlier in this process: then
    it is an outage, retried like a transient error.

    Args:
        fn: the operation (no arguments).
        url: the URL it works on, named in errors and logs.
        policy: the retry policy (default :class:`RetryPolicy()`).
        what: a few words for messages (``"download"``, ``"list"``...).
        on_retry: called with the error before each retry (e.g. to count retries).

    Raises:
        RemoteError: the retries ran out (``transient=True``), or a permanent error that is
            about access, the bucket or the endpoint (message says what to check).
        FileNotFoundError: the object does not exist (unchanged, so callers can handle it).
        Exception: any other permanent error, unchanged.
    """
    policy = policy or RetryPolicy()
    store = _store(url)
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            out = fn()
        except Exception as exc:
            down = unreachable_endpoint(exc)
            outage = down is not None and down[0] in ("refused", "unknown host")
            if not ((outage and store in _REACHED) or is_transient(exc)):
                clear = explain_error(url, exc, what)
                try:
                    if clear is exc:
                        raise
                    raise clear from exc
                finally:  # else this frame (in the error's traceback) holds the error: a
                    del clear  # cycle that keeps every caller's locals until the collector runs
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt >= policy.max_attempts or elapsed + pause > policy.total_timeout_s:
                raise RemoteError(
                    url,
                    f"{what} failed {attempt} time(s) over {elapsed:.1f}s with transient errors "
                    f"(last: {_describe(exc)}); the store or the network kept failing: check the "
                    "endpoint and the network, or allow more time with "
                    "RetryPolicy(total_timeout_s=..., max_attempts=...)",
                    transient=True,
                ) from exc
            logger.warning(
                "%s: %s failed (%s); attempt %d of %d, retrying in %.2fs",
                url,
                what,
                _describe(exc),
                attempt,
                policy.max_attempts,
                pause,
            )
            if on_retry is not None:
                on_retry(exc)
            time.sleep(pause)
        else:
            _REACHED.add(store)
            return out


def _store(url: str) -> str:
    """``protocol://bucket`` of ``url`` (what a refused connection is remembered by)."""
    parts = urlsplit(str(url))
    return f"{parts.scheme}://{parts.netloc}"


def exception_chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < 12 and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def client_error_info(exc: BaseException) -> tuple[str, int] | None:
    """(code, HTTP status) of a botocore ``ClientError``-like exception, else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_transient_one(exc: BaseException) -> bool | None:
    """True / False when ``exc`` alone decides, None to look further down the chain."""
    if isinstance(exc, RemoteError):
        return False
    if isinstance(exc, IncompleteDownload):
        return True
    info = client_error_info(exc)
    if info is not None:
        code, status = info
        # 501 Not Implemented: the server does not do this request (often not an S3 server)
        return code in _TRANSIENT_CODES or (status >= 500 and status != 501) or status == 429
    if isinstance(
        exc,
        (
            FileNotFoundError,
            PermissionError,
            IsADirectoryError,
            NotADirectoryError,
            FileExistsError,
        ),
    ):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("botocore"):
        if name in ("NoCredentialsError", "PartialCredentialsError", "NoRegionError"):
            return False
        if name in ("ResponseParserError", "IncompleteReadError"):
            return True
        mro = {c.__name__ for c in type(exc).__mro__}
        if mro & {"HTTPClientError", "ConnectionError"}:
            return True
    if module.startswith("aiohttp"):
        http_status = getattr(exc, "status", None)
        if name == "ClientResponseError" and isinstance(http_status, int) and http_status < 500:
            return http_status == 429
        return True  # payload cut short, disconnected, connection reset, bad status line
    if name in ("FSTimeoutError", "IncompleteRead", "RemoteDisconnected"):
        return True
    if isinstance(exc, socket.gaierror):  # a DNS server that did not answer (else unknown host)
        return exc.errno == socket.EAI_AGAIN
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is worth retrying.

    Transient: HTTP 5xx (but 501), 429 and the S3 throttling codes (``SlowDown``...), connection
    resets, timeouts, truncated or unparsable responses (botocore, aiohttp, ``OSError`` with
    ``ECONNRESET``...). Permanent: missing objects or buckets, access denied, bad or missing
    credentials, an endpoint that cannot be reached (connection refused, unknown host, failed
    TLS handshake, invalid endpoint URL: see :func:`with_retries` for an endpoint that answered
    before), other 4xx, and anything unknown.
    """
    if unreachable_endpoint(exc) is not None:
        return False
    for e in exception_chain(exc):
        verdict = _is_transient_one(e)
        if verdict is not None:
            return verdict
    return False


def unreachable_endpoint(exc: BaseException) -> tuple[str, str, str] | None:
    """``(kind, endpoint, reason)`` when ``exc`` (or what caused it) says the endpoint cannot be
    reached at all; ``kind`` is ``"invalid"`` (not a URL), ``"refused"``, ``"unknown host"`` or
    ``"tls"`` (the handshake failed); ``endpoint`` is ``scheme://host:port`` when the error
    names it, else ``""``."""
    chain = exception_chain(exc)
    for e in chain:
        if isinstance(e, ValueError) and str(e).startswith("Invalid endpoint"):
            return "invalid", str(e).partition(":")[2].strip(), "not a URL"
        if isinstance(e, ConnectionRefusedError) or (
            isinstance(e, OSError) and e.errno == errno.ECONNREFUSED
        ):
            return "refused", _endpoint_of(chain), "connection refused: nothing listens there"
        if isinstance(e, socket.gaierror) and e.errno in _UNKNOWN_HOST:
            return "unknown host", _endpoint_of(chain), f"unknown host: {e.strerror or e}"
        if type(e).__name__ in ("ClientConnectorSSLError", "ClientConnectorCertificateError"):
            reason = f"the TLS handshake failed: {getattr(e, 'os_error', None) or e}"
            return "tls", _endpoint_of(chain), reason
    return None


def _endpoint_of(chain: list[BaseException]) -> str:
    """``scheme://host:port`` named by an error of ``chain`` (botocore or aiohttp), else ``""``."""
    for e in chain:
        request_url = getattr(e, "kwargs", {}).get("endpoint_url")  # botocore errors
        if isinstance(request_url, str):
            parts = urlsplit(request_url)
            return f"{parts.scheme}://{parts.netloc}"
        host, port = getattr(e, "host", None), getattr(e, "port", None)  # aiohttp
        if isinstance(host, str) and port is not None:
            scheme = "http" if getattr(e, "ssl", None) in (False, None) else "https"
            return f"{scheme}://{host}:{port}"
    return ""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def explain_error(url: str, exc: BaseException, what: str = "read") -> BaseException:
    """A permanent error made clear: a :class:`RemoteError` for access, credentials, missing
    buckets and endpoints that cannot be reached (saying what to check), ``exc`` itself
    otherwise."""
    if isinstance(exc, RemoteError):
        return exc
    unreachable = unreachable_endpoint(exc)
    if unreachable is not None:
        kind, endpoint, reason = unreachable
        if kind == "invalid":
            return RemoteError(
                url,
                f"{what} failed: the endpoint URL {endpoint!r} is not valid; give the whole URL "
                f"with its scheme, e.g. 'http://host:9000' ({_ENDPOINT_HINT})",
            )
        check = (
            "the scheme of the endpoint URL (http:// for a server without TLS) and the "
            "server's certificate (storage_options client_kwargs verify)"
            if kind == "tls"
            else f"the endpoint URL ({_ENDPOINT_HINT}), that the server is running and that "
            "this machine reaches it"
        )
        where = f"the endpoint {endpoint}" if endpoint else "the endpoint"
        return RemoteError(
            url, f"{what} failed: cannot connect to {where} ({reason}); check {check}"
        )
    chain = exception_chain(exc)
    codes = {info[0] for e in chain if (info := client_error_info(e)) is not None}
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    if "NoSuchBucket" in codes or "bucket does not exist" in text:
        return RemoteError(
            url,
            f"{what} failed: the bucket does not exist ({_describe(exc)}); check the bucket name "
            "in the URL and the endpoint (storage_options client_kwargs endpoint_url)",
        )
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return RemoteError(
            url,
            f"{what} failed: no credentials were found ({_describe(exc)}); pass "
            "storage_options={'key': ..., 'secret': ...}, set AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or storage_options={'anon': True} for a "
            "public bucket",
        )
    if codes & _AUTH_CODES or isinstance(exc, PermissionError):
        return RemoteError(
            url, f"{what} failed: access denied ({_describe(exc)}); {_CREDENTIALS_HINT}"
        )
    if any(info[1] == 501 for e in chain if (info := client_error_info(e)) is not None):
        return RemoteError(
            url,
            f"{what} failed: the server does not implement this request ({_describe(exc)}); "
            f"check that the endpoint URL ({_ENDPOINT_HINT}) points at an S3-compatible server",
        )
    return exc
