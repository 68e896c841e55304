"""Whole-object helpers on any URL, and the filesystem clients this package does remote I/O with.

:func:`is_remote` tells object stores from local paths; :func:`read_bytes` and
:func:`write_bytes_atomic` read and write a whole object with retries (the write is atomic),
:func:`remove_file` deletes one;
:func:`check_access` explains an empty listing (wrong bucket, credentials or endpoint);
:func:`default_cache_dir` is where a :class:`~torchdata_ext.remote.ShardCache` lives by default;
:func:`private_filesystem` makes the fsspec clients the helpers and the caches use (the S3
client's own retries off, so that :class:`~torchdata_ext.remote.RetryPolicy` alone decides).

``check_access`` sits here rather than with the errors in :mod:`.retry` because it lists a
bucket: :mod:`.retry` does no I/O and imports nothing from this module.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from typing import Any

from fsspec.core import split_protocol

from torchdata_ext.remote.process_state import FILESYSTEMS
from torchdata_ext.remote.retry import RetryPolicy, with_retries
from torchdata_ext.remote.urls import filesystem, is_local, storage_options_of

__all__ = [
    "check_access",
    "default_cache_dir",
    "is_remote",
    "private_filesystem",
    "read_bytes",
    "remove_file",
    "write_bytes_atomic",
]

_LOCAL_PROTOCOLS = (None, "file", "local")

# private filesystems of this process, by protocol and options (clients are slow to make)


def is_remote(url: str) -> bool:
    """Whether ``url`` is on a non-local filesystem (anything but a path or ``file://``)."""
    return split_protocol(str(url))[0] not in _LOCAL_PROTOCOLS


def read_bytes(
    url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> bytes:
    """The content of ``url``, with retries."""
    fs, path = _client(url, storage_options)
    return bytes(with_retries(lambda: fs.cat_file(path), url, retry, what="read"))


def write_bytes_atomic(
    url: str,
    data: bytes,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    *,
    durable: bool = True,
) -> None:
    """Write ``data`` to ``url`` so a reader sees the old content or the new, never a part.

    The project's one atomic-write helper. Guarantee:

    * Local files: ``data`` is written to a temporary file in the same folder as ``url``
      (``.<name>.tmp-<random hex>``, so on the same filesystem), flushed and ``fsync``-ed, then
      renamed over ``url`` (``os.replace``, atomic). A process killed at any moment leaves
      ``url`` whole, old before the rename and new after it: never a half-written file. If the
      write or the rename fails (a full disk...), the temporary file is removed and an
      ``OSError`` naming ``url`` raised (same ``errno``); only a kill can leave the temporary
      file behind (under its hidden name, never as ``url``).
    * Object stores: a single PUT is atomic (the object appears whole or not at all), so the
      object is written in one call, retried under ``retry`` on transient errors.

    Args:
        url: where to write (a path or any fsspec URL); its folder is created if missing.
        data: the whole new content.
        storage_options: fsspec options (credentials, endpoint).
        retry: the :class:`~torchdata_ext.remote.RetryPolicy` of the PUT (default
            ``RetryPolicy()``); local writes are not retried.
        durable: ``fsync`` a local file before the rename (so it survives a power cut, not
            only a killed process). ``False`` for files that can be made again (test data):
            still atomic, and a reader that mapped the old file keeps reading the old bytes.
    """
    fs, path = _client(url, storage_options)
    if is_local(fs):
        folder = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # a failed write() names no file: say which, and what to do
            raise OSError(
                exc.errno,
                f"cannot write {url} ({exc.strerror or exc}); check the space left and the "
                "permissions of that folder, or write elsewhere",
            ) from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return
    with_retries(lambda: fs.pipe_file(path, data), url, retry, what="write")


def remove_file(
    url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> None:
    """Delete the file or object ``url`` if it exists (retried on object stores)."""
    fs, path = _client(url, storage_options)
    if is_local(fs):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        with_retries(lambda: fs.rm_file(path), url, retry, what="delete")


def check_access(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Raise a clear :class:`~torchdata_ext.remote.RemoteError` if ``url``'s bucket is missing or
    refuses access.

    Used to explain a listing that found nothing: ``no files match`` is often a wrong bucket,
    wrong credentials or a wrong endpoint. Does nothing for local URLs or when all looks fine.
    """
    if not is_remote(url):
        return
    fs, path = _client(url, storage_options)
    bucket = path.split("/", 1)[0]
    if not bucket:
        return
    with_retries(lambda: fs.ls(bucket, detail=False, refresh=True), url, what="list")


def default_cache_dir() -> str:
    """``$TORCHDATA_EXT_CACHE_DIR``, else ``<tempdir>/torchdata_ext_cache_<uid>``."""
    env = os.environ.get("TORCHDATA_EXT_CACHE_DIR")
    if env:
        return env
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"torchdata_ext_cache_{uid}")


def private_filesystem(
    url: str, storage_options: dict[str, Any], *, own_retries: bool
) -> tuple[Any, str]:
    """A filesystem of this package's remote I/O in this process (not shared with the user's
    code) and the path of ``url`` on it; with ``own_retries`` (and no ``AWS_MAX_ATTEMPTS``,
    and no ``retries`` in ``storage_options`` ``config_kwargs``), the S3 client's own retries
    are off, so that :class:`~torchdata_ext.remote.RetryPolicy` alone bounds the time spent on
    a failing object, and an endpoint that cannot be reached fails in one attempt."""
    so = storage_options
    protocol = split_protocol(url)[0] or "file"
    own = own_retries and "AWS_MAX_ATTEMPTS" not in os.environ
    key = f"{protocol}|{own}|{sorted(so.items())!r}"
    hit = FILESYSTEMS.get(key)
    if hit is None:
        opts = dict(so)
        s3 = protocol in ("s3", "s3a")
        if s3 and own:
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            opts["config_kwargs"] = config
        opts["skip_instance_cache"] = True
        fs, _ = filesystem(url, opts)
        if s3 and own:
            fs.retries = 1  # s3fs's own retry loop (a class attribute)
        hit = FILESYSTEMS.setdefault(key, fs)
    return hit, hit._strip_protocol(url)


def _client(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The filesystem of the whole-object helpers: private (retries left to
    :class:`~torchdata_ext.remote.RetryPolicy`) for object stores, the shared one otherwise."""
    if is_remote(url):
        return private_filesystem(url, storage_options_of(storage_options), own_retries=True)
    return filesystem(url, storage_options)
