"""The first access to an object store, made fast and clear.

An S3 client left to itself answers a closed port, a missing bucket or missing credentials
after 6-30 s of its own retries and back-off, with a long botocore/aiohttp traceback.
:func:`probe_store` is called by :func:`torchdata_ext.urls.filesystem` (so by every entry
point: the pipeline, ``prepare``, ``inspect``, ``audit``, checkpoints) the first time a process
resolves a URL of a store: one listing of at most one key, with a short connect timeout and no
retry. A permanent failure (nothing listens at the endpoint, unknown host, TLS mismatch, an
invalid endpoint URL, a missing bucket, missing or invalid credentials) raises a
:class:`~torchdata_ext.remote.RemoteError` at once saying what to check
(:func:`~torchdata_ext.remote.explain_error`). Anything else (a transient error, a timeout, a
plain ``AccessDenied``: the credentials may read objects without listing the bucket) leaves the
decision to the real operation and its retries. A store that answered is not probed again in
this process.

Only ``s3://`` (s3fs) is probed: other protocols are left to their own clients. Imports nothing
of this package but :mod:`.retry` (``urls`` calls it; ``.files`` imports ``urls``).
"""

from __future__ import annotations

import threading
from typing import Any

from torchdata_ext.remote.retry import RemoteError, _unreachable, explain_error

__all__ = ["PROBE_CONNECT_TIMEOUT_S", "probe_store"]

PROBE_CONNECT_TIMEOUT_S = 2.0
"""The probe's connect and read timeout, seconds (a refused connection fails at once)."""

_PROBED = ("s3", "s3a")
# S3 error codes that say the bucket or the credentials are wrong whatever the object
_PERMANENT_CODES = frozenset(
    {"NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidBucketName"}
)
_ANSWERED: set[str] = set()  # stores (protocol, bucket, options) that answered the probe
_LOCK = threading.Lock()


def probe_store(url: str, protocol: str, bucket: str, storage_options: dict[str, Any]) -> None:
    """Raise a clear :class:`~torchdata_ext.remote.RemoteError` when the store of
    ``protocol://bucket`` with ``storage_options`` cannot work at all; once per process.

    Args:
        url: the URL being opened (named in the error).
        protocol: the URL's protocol (only ``s3``/``s3a`` are probed).
        bucket: the bucket (the first part of the URL's path); nothing is probed without one.
        storage_options: the fsspec options the URL is opened with.
    """
    if protocol not in _PROBED or not bucket or any(c in bucket for c in "*?[{"):
        return
    key = f"{protocol}|{bucket}|{_options_key(storage_options)}"
    with _LOCK:
        if key in _ANSWERED:
            return
    import fsspec

    opts = dict(storage_options)
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("connect_timeout", PROBE_CONNECT_TIMEOUT_S)
    config.setdefault("read_timeout", PROBE_CONNECT_TIMEOUT_S)
    config["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    opts["config_kwargs"] = config
    opts["skip_instance_cache"] = True
    try:
        fs = fsspec.filesystem(protocol, **opts)
        fs.retries = 1  # s3fs's own retry loop
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as exc:
        if _permanent(exc):
            clear = explain_error(url, exc, "access")
            if isinstance(clear, RemoteError):
                raise clear from None  # the message says it all: no client traceback
        # undecided (a transient error...): the real operation decides, with its retries
    with _LOCK:
        _ANSWERED.add(key)


def _options_key(storage_options: dict[str, Any]) -> str:
    """The options that decide whether a store works (not the client's retries or caching)."""
    opts = {k: v for k, v in storage_options.items() if k != "skip_instance_cache"}
    config = {k: v for k, v in (opts.pop("config_kwargs", None) or {}).items() if k != "retries"}
    return repr(sorted({**opts, "config_kwargs": config}.items()))


def _permanent(exc: BaseException) -> bool:
    """Whether the probe's failure is about the endpoint, bucket or credentials as a whole."""
    if _unreachable(exc) is not None:
        return True
    cur: BaseException | None = exc
    for _ in range(12):
        if cur is None:
            break
        if type(cur).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return True
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            if str(response.get("Error", {}).get("Code", "")) in _PERMANENT_CODES:
                return True
        cur = cur.__cause__ or cur.__context__
    return False
