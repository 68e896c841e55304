"""The checksum of each loader entry in a ``torch.distributed.checkpoint`` (DCP).

DCP stores the loader's entries (:mod:`torchdata_ext.checkpoint.dcp_entries`) as bytes it does
not check, so a bit flip in one could restore a wrong position in silence (a checkpoint folder
checks every file's sha256: :mod:`torchdata_ext.checkpoint.folder`). Each entry is therefore
written sealed: ``MAGIC``, the 32-byte sha256 of the pickle, then the pickle. Reading checks
the digest and names the entry, its data file and its checkpoint when it does not match, or
when the bytes are no pickle at all. An entry without ``MAGIC`` (saved before the seal) is read
as the bare pickle it is.

Reading a damaged DCP checkpoint also fails inside torch (a truncated ``.distcp``, a damaged
``.metadata``): :func:`damaged` says which checkpoint and file, for the loads this package
makes itself (the audit, ``show_batches``).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

__all__ = ["MAGIC", "damaged", "seal", "unseal"]

MAGIC = b"TDXSEAL1"
"""The first bytes of a sealed entry (then its sha256, then its pickle)."""
_DIGEST = 32


def seal(obj: Any) -> io.BytesIO:
    """``obj`` pickled, behind ``MAGIC`` and the pickle's sha256 (what ``dcp.save`` stores)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return io.BytesIO(MAGIC + hashlib.sha256(data).digest() + data)


def unseal(raw: Any, what: str) -> Any:
    """The object of an entry ``dcp.load`` filled in (a ``BytesIO``), its digest checked.

    Args:
        raw: the entry's bytes (``BytesIO`` or bytes).
        what: the entry as the error names it (entry, file, checkpoint).

    Raises:
        ValueError: the digest does not match, or the bytes are no pickle: ``what`` is
            damaged.
    """
    data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
    if data.startswith(MAGIC):
        digest, data = data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
        if hashlib.sha256(data).digest() != digest:
            raise ValueError(
                f"{what} is damaged (its content does not match its sha256): restore from "
                "another checkpoint"
            )
    try:
        return pickle.loads(data)
    except Exception as exc:  # a damaged pickle fails in many ways
        raise ValueError(
            f"{what} is damaged (it cannot be unpickled: {type(exc).__name__}: {exc}): restore "
            "from another checkpoint"
        ) from None


def damaged(url: str, exc: BaseException, files: list[str]) -> ValueError:
    """The error for a DCP checkpoint ``url`` that torch failed to read (``exc``; its
    ``CheckpointException`` derives from ``BaseException`` and wraps each rank's error),
    naming the ``files`` read."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # {rank: (exception, traceback)}
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    lines = str(exc).strip().splitlines()
    cause = f"{type(exc).__name__}: {lines[0].split('. ')[0]}" if lines else type(exc).__name__
    return ValueError(
        f"DCP checkpoint {url} is damaged: reading {', '.join(files) or 'it'} failed ({cause}); "
        "restore from another checkpoint"
    )
