"""Logical-shard maths: pure functions, no I/O.

A dataset's documents, taken in file order, are numbered globally ``0 .. D-1``. Logical shard
``s`` of ``N`` owns the contiguous global range ``[s*D//N, (s+1)*D//N)``, so shard sizes differ by
at most one document and a shard touches only the files its range overlaps (a file may be
split fractionally between neighbouring shards). Global worker ``g`` of ``G`` owns the contiguous
shards ``[g*N//G, (g+1)*N//G)``: balanced to within one shard, any ``N >= G`` works, and every
(rank, worker) computes its share locally with no communication.

Rescaling from ``G_old`` to ``G_new`` workers is the inverse map: the old workers a new worker
must read and the new workers that read an old one are computed in O(1) from the owner of a
shard (:func:`shard_owner`), never by scanning all workers.

::

    files     |---- f0 ----|-- f1 --|------- f2 -------|
    shards    |  s0  |  s1  |  s2  |  s3  |  s4  |  s5  |
    workers   |    w0       |     w1      |     w2      |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from torchdata_ext.checks import check_int

__all__ = [
    "Fragment",
    "check_shard_count",
    "count_new_readers",
    "file_offsets",
    "old_workers_to_read",
    "shard_bounds",
    "shard_fragments",
    "shard_owner",
    "shards_files",
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


def shards_files(
    doc_counts: Sequence[int] | np.ndarray, n_logical_shards: int, shards: range
) -> list[int]:
    """The file numbers holding documents of the logical shards ``shards`` (a contiguous
    range of shard ids in ``[0, N)``): the files their reader opens, in order. Empty files
    are left out (nothing of them is read)."""
    n = check_int("n_logical_shards", n_logical_shards, 1)
    if shards.step != 1 or not 0 <= shards.start <= shards.stop <= n:
        raise ValueError(f"{shards=} must be a contiguous range within [0, {n_logical_shards=}]")
    offsets = file_offsets(doc_counts)
    total = int(offsets[-1])
    lo, hi = (shards.start * total) // n, (shards.stop * total) // n
    if hi <= lo:  # shards without documents
        return []
    holds = (offsets[:-1] < hi) & (offsets[1:] > lo) & (offsets[1:] > offsets[:-1])
    return [int(f) for f in np.nonzero(holds)[0]]


def worker_shards(n_logical_shards: int, total_workers: int, global_worker: int) -> range:
    """The logical shards global worker ``global_worker`` of ``total_workers`` owns."""
    n = check_int("n_logical_shards", n_logical_shards, 1)
    g = check_int("total_workers", total_workers, 1)
    w = check_int("global_worker", global_worker, 0)
    if w >= g:
        raise ValueError(f"{global_worker=} must be < {total_workers=}")
    _check_enough_shards(n_logical_shards, total_workers)
    return range((w * n) // g, ((w + 1) * n) // g)


def _check_enough_shards(n_logical_shards: int, total_workers: int) -> None:
    """Every global worker must own at least one logical shard."""
    if n_logical_shards < total_workers:
        raise ValueError(
            f"{n_logical_shards=} must be >= the number of global workers ({total_workers}); "
            "raise n_logical_shards"
        )


def shard_owner(n_logical_shards: int, total_workers: int, shard: int) -> int:
    """The global worker of ``total_workers`` whose :func:`worker_shards` hold ``shard``.

    The owner is the largest ``g`` with ``g*N//G <= s``. Since ``floor(x) <= s`` exactly when
    ``x < s + 1``, that is ``g*N < (s+1)*G``, i.e. ``g <= ((s+1)*G - 1) // N`` (not ``s*G//N``,
    which is wrong when ``G`` does not divide ``N``). O(1).
    """
    n = check_int("n_logical_shards", n_logical_shards, 1)
    g = check_int("total_workers", total_workers, 1)
    s = check_int("shard", shard, 0)
    if s >= n:
        raise ValueError(f"{shard=} must be < {n_logical_shards=}")
    _check_enough_shards(n_logical_shards, total_workers)
    return ((s + 1) * g - 1) // n


def _overlapping(
    n_logical_shards: int, total: int, worker: int, other_total: int, names: tuple[str, str, str]
) -> range:
    """The workers of an ``other_total`` partition whose shards overlap those of ``worker`` of
    ``total``: the owners of its first and last shard and every worker between them (each owns
    at least one shard, all inside the range). ``names`` are the caller's argument names for
    ``total``, ``worker`` and ``other_total``, quoted in errors."""
    total_name, worker_name, other_name = names
    n = check_int("n_logical_shards", n_logical_shards, 1)
    total = check_int(total_name, total, 1)
    worker = check_int(worker_name, worker, 0)
    other_total = check_int(other_name, other_total, 1)
    if worker >= total:
        raise ValueError(f"{worker_name}={worker} must be < {total_name}={total}")
    for name, value in ((total_name, total), (other_name, other_total)):
        if n < value:
            raise ValueError(
                f"{n_logical_shards=} must be >= {name}={value} (every global worker owns at "
                "least one shard); raise n_logical_shards"
            )
    first, stop = (worker * n) // total, ((worker + 1) * n) // total  # worker_shards
    # shard_owner(n, other_total, s) = ((s + 1) * other_total - 1) // n for s = first, stop - 1
    return range(((first + 1) * other_total - 1) // n, (stop * other_total - 1) // n + 1)


def old_workers_to_read(
    n_logical_shards: int, old_total: int, new_total: int, new_worker: int
) -> range:
    """The old global workers whose shards overlap new global worker ``new_worker``'s: the
    checkpointed worker states it must read to rescale from ``old_total`` to ``new_total``
    workers. O(1); the range holds at most ``ceil(old_total / new_total) + 1`` workers.
    """
    names = ("new_total", "new_worker", "old_total")
    return _overlapping(n_logical_shards, new_total, new_worker, old_total, names)


def count_new_readers(
    n_logical_shards: int, old_total: int, new_total: int, old_worker: int
) -> int:
    """How many new global workers read old global worker ``old_worker``'s state (their shards
    overlap its) when rescaling from ``old_total`` to ``new_total`` workers: the number of
    parts its counters are split into. O(1)."""
    names = ("old_total", "old_worker", "new_total")
    return len(_overlapping(n_logical_shards, old_total, old_worker, new_total, names))
