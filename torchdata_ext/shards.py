"""Logical-shard maths: pure functions, no I/O.

A dataset's documents, taken in file order, are numbered globally ``0 .. D-1``. Logical shard
``s`` of ``N`` owns the contiguous global range ``[s*D//N, (s+1)*D//N)``, so shard sizes differ by
at most one document and a shard touches only the files its range overlaps (a file may be
split fractionally between neighbouring shards). Global worker ``g`` of ``G`` owns the contiguous
shards ``[g*N//G, (g+1)*N//G)``: balanced to within one shard, any ``N >= G`` works, and every
(rank, worker) computes its share locally with no communication.

::

    files     |---- f0 ----|-- f1 --|------- f2 -------|
    shards    |  s0  |  s1  |  s2  |  s3  |  s4  |  s5  |
    workers   |    w0       |     w1      |     w2      |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from torchdata_ext._checks import check_int

__all__ = [
    "Fragment",
    "check_shard_count",
    "file_offsets",
    "shard_bounds",
    "shard_fragments",
    "worker_shards",
]


class Fragment(NamedTuple):
    """The documents ``[start, stop)`` of file number ``file`` that belong to one shard."""

    file: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def file_offsets(doc_counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """Cumulative document counts: ``offsets[f]`` is the global index of file ``f``'s first doc.

    Returns an ``int64`` array of length ``len(doc_counts) + 1`` starting at 0.
    """
    counts = np.asarray(doc_counts, dtype=np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("doc_counts must be a 1-D sequence of non-negative integers")
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])


def check_shard_count(n_logical_shards: int, total_docs: int, total_workers: int = 1) -> None:
    """Raise a clear error unless ``total_workers <= n_logical_shards <= total_docs``."""
    check_int("n_logical_shards", n_logical_shards, 1)
    check_int("total_workers", total_workers, 1)
    if n_logical_shards < total_workers:
        raise ValueError(
            f"{n_logical_shards=} must be >= the number of global workers "
            f"(ranks x dataloader workers = {total_workers}); raise n_logical_shards"
        )
    if n_logical_shards > total_docs:
        raise ValueError(
            f"{n_logical_shards=} must be <= the number of documents ({total_docs}); "
            "lower n_logical_shards (or add data)"
        )


def shard_bounds(total_docs: int, n_logical_shards: int) -> np.ndarray:
    """Global document boundaries of every shard: shard ``s`` is ``[b[s], b[s+1])``."""
    total_docs = check_int("total_docs", total_docs, 0)
    n = check_int("n_logical_shards", n_logical_shards, 1)
    s = np.arange(n + 1, dtype=np.int64)
    # (s * D) // N without overflow for D up to ~9e18 / N: use Python ints when large
    if total_docs * n < 2**62:
        return (s * total_docs) // n
    return np.array([(i * total_docs) // n for i in range(n + 1)], dtype=np.int64)


def shard_fragments(offsets: np.ndarray, n_logical_shards: int, shard: int) -> list[Fragment]:
    """The per-file pieces of logical shard ``shard``, in file order.

    Args:
        offsets: the result of :func:`file_offsets` for the dataset.
        n_logical_shards: N, the number of logical shards of the dataset.
        shard: the shard id in ``[0, N)``.
    """
    n = check_int("n_logical_shards", n_logical_shards, 1)
    shard = check_int("shard", shard, 0)
    if shard >= n:
        raise ValueError(f"{shard=} must be < {n_logical_shards=}")
    total = int(offsets[-1])
    lo = (shard * total) // n
    hi = ((shard + 1) * total) // n
    out: list[Fragment] = []
    if hi <= lo:
        return out
    f = int(np.searchsorted(offsets, lo, side="right")) - 1
    while lo < hi:
        f_start, f_stop = int(offsets[f]), int(offsets[f + 1])
        stop = min(hi, f_stop)
        if stop > lo:
            out.append(Fragment(f, lo - f_start, stop - f_start))
        lo = max(lo, stop)
        f += 1
    return out


def worker_shards(n_logical_shards: int, total_workers: int, global_worker: int) -> range:
    """The logical shards global worker ``global_worker`` of ``total_workers`` owns."""
    n = check_int("n_logical_shards", n_logical_shards, 1)
    g = check_int("total_workers", total_workers, 1)
    w = check_int("global_worker", global_worker, 0)
    if w >= g:
        raise ValueError(f"{global_worker=} must be < {total_workers=}")
    if n < g:
        raise ValueError(
            f"{n_logical_shards=} must be >= the number of global workers ({total_workers}); "
            "raise n_logical_shards"
        )
    return range((w * n) // g, ((w + 1) * n) // g)
