"""The first access to an object store, made fast and clear.

An S3 client left to itself answers a closed port, a missing bucket or missing credentials
after 6-30 s of its own retries and back-off, with a long botocore/aiohttp traceback.
:func:`probe_store` is called by :func:`torchdata_ext.remote.urls.filesystem` (so by every entry
point: the pipeline, ``prepare``, ``inspect``, ``audit``, checkpoints) the first time a process
resolves a URL of a store: one GET of an object that is not there (:data:`PROBE_KEY`), with
a short connect timeout and no retry. Not a LIST: a store serves listings at a tenth of the rate
and ten times the price of GETs, and every process of a job (ranks and their dataloader workers)
probes once, so a LIST here would be ranks x workers listings at every start. The GET's error
says as much as a listing's (``NoSuchKey``: the store works; ``NoSuchBucket``,
``InvalidAccessKeyId``, ``SignatureDoesNotMatch``: it cannot). A permanent failure (nothing listens at the endpoint, unknown host, TLS mismatch, an
invalid endpoint URL, a missing bucket, missing or invalid credentials) raises a
:class:`~torchdata_ext.remote.RemoteError` at once saying what to check
(:func:`~torchdata_ext.remote.explain_error`). Anything else (a transient error, a timeout, a
plain ``AccessDenied``: the credentials may read objects without listing the bucket) leaves the
decision to the real operation and its retries. A store that answered is not probed again in
this process.

Only ``s3://`` (s3fs) is probed: other protocols are left to their own clients. Imports nothing
of this package but :mod:`.retry` and :mod:`.process_state` (``urls`` calls it; ``.files``
imports ``urls``).
"""

from __future__ import annotations

import os
from typing import Any

from torchdata_ext.remote.process_state import PROBE_CLIENTS, PROBED_STORES
from torchdata_ext.remote.retry import (
    RemoteError,
    client_error_info,
    exception_chain,
    explain_error,
    unreachable_endpoint,
)

__all__ = ["PROBE_CONNECT_TIMEOUT_S", "PROBE_KEY", "probe_store"]

PROBE_CONNECT_TIMEOUT_S = 2.0
"""The probe's connect and read timeout, seconds (a refused connection fails at once)."""

PROBE_KEY = "torchdata-ext-probe/absent"
"""The key the probe asks for, in every bucket it opens: keep it free (an object there would be
read whole by every process)."""

_PROBED = ("s3", "s3a")
# S3 error codes that say the bucket or the credentials are wrong whatever the object
_PERMANENT_CODES = frozenset(
    {"NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidBucketName"}
)
# what an S3 client reads from the environment when the options do not say
_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
)


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
    if PROBED_STORES.get(key):
        return
    try:
        fs = _client(protocol, storage_options)
        fs.call_s3("get_object", Bucket=bucket, Key=PROBE_KEY)
    except Exception as exc:
        if _permanent(exc):
            clear = explain_error(url, exc, "access")
            if isinstance(clear, RemoteError):
                try:
                    raise clear from None  # the message says it all: no client traceback
                finally:  # the frame must not hold the error its traceback holds (a cycle)
                    del clear
        # undecided (a transient error...): the real operation decides, with its retries
    PROBED_STORES.setdefault(key, True)


def _client(protocol: str, storage_options: dict[str, Any]) -> Any:
    """The probe's S3 filesystem for these options (short timeouts, no retry), one per
    process (making a client costs ~0.1-0.5 s of CPU)."""
    key = f"{protocol}|{_options_key(storage_options)}"
    fs = PROBE_CLIENTS.get(key)
    if fs is None:
        import fsspec

        opts = dict(storage_options)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", PROBE_CONNECT_TIMEOUT_S)
        config.setdefault("read_timeout", PROBE_CONNECT_TIMEOUT_S)
        config["retries"] = {"total_max_attempts": 1, "mode": "standard"}
        opts["config_kwargs"] = config
        opts["skip_instance_cache"] = True
        fs = fsspec.filesystem(protocol, **opts)
        fs.retries = 1  # s3fs's own retry loop
        fs = PROBE_CLIENTS.setdefault(key, fs)
    return fs


def _options_key(storage_options: dict[str, Any]) -> str:
    """The options that decide whether a store works (not the client's retries or caching)."""
    opts = {k: v for k, v in storage_options.items() if k != "skip_instance_cache"}
    config = {k: v for k, v in (opts.pop("config_kwargs", None) or {}).items() if k != "retries"}
    env = [(k, os.environ.get(k)) for k in _ENVIRONMENT]  # what the client reads besides
    return repr((sorted({**opts, "config_kwargs": config}.items()), env))


def _permanent(exc: BaseException) -> bool:
    """Whether the probe's failure is about the endpoint, bucket or credentials as a whole."""
    if unreachable_endpoint(exc) is not None:
        return True
    for e in exception_chain(exc):
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return True
        info = client_error_info(e)
        if info is not None and info[0] in _PERMANENT_CODES:
            return True
    return False
