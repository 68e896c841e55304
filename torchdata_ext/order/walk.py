"""Random-walk shuffling: a seeded bijection on ``[0, n)`` with O(1) memory.

The walk is a small Feistel network on the next even power of two >= ``n`` with cycle
walking (values that land outside ``[0, n)`` are encrypted again until they land inside), which
gives a permutation of ``[0, n)`` for every ``n >= 1``. Element ``i`` of the walk can be computed
directly, so a position in the walk is one integer and a walk can be resumed anywhere.

Seeds for the walks of different shards and epochs are derived with :func:`mix_seed`, a
SplitMix64-style hash, so that every (seed, shard, epoch, ...) tuple gives an independent walk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["RandomWalk", "mix_seed", "mix_seeds", "walk_prefixes"]

_M64 = (1 << 64) - 1
_ROUNDS = 4


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """Hash any number of integers into one 63-bit seed (order matters).

    Args:
        values: integers (seed, shard id, epoch, ...); negative values are allowed.
    """
    h = 0x6A09E667F3BCC908
    for v in values:
        h = _splitmix(h ^ (int(v) & _M64))
    return h >> 1


def mix_seeds(*values: int | np.ndarray) -> np.ndarray:
    """:func:`mix_seed` element by element: the same hash of arrays of integers (broadcast
    together), e.g. the walk seeds of many shards at once.

    Args:
        values: integers or integer arrays (negative values are allowed, as for
            :func:`mix_seed`).

    Returns:
        ``uint64`` array of the broadcast shape, each value ``mix_seed`` of its elements.
    """
    arrays = [_as_u64(v) for v in values]
    shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
    h = np.full(shape, 0x6A09E667F3BCC908, np.uint64)
    with np.errstate(over="ignore"):
        for a in arrays:
            h = _splitmix_np(h ^ a)
    return h >> np.uint64(1)


def _as_u64(v: int | np.ndarray) -> np.ndarray:
    """``v & (2**64 - 1)`` as ``uint64`` (two's complement for negative values)."""
    if isinstance(v, (int, np.integer)):
        return np.asarray(int(v) & _M64, np.uint64)
    a = np.asarray(v)
    if a.dtype == np.uint64:
        return a
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"mix_seeds takes integers or integer arrays, got dtype {a.dtype}")
    return a.astype(np.int64).view(np.uint64)


def walk_prefixes(sizes: np.ndarray, seeds: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The first ``counts[i]`` elements of ``RandomWalk(sizes[i], seeds[i])`` for every ``i``,
    concatenated: many walks in one vectorised pass (no per-walk Python or table).

    Args:
        sizes: ``n`` of each walk (documents).
        seeds: the seed of each walk (as given to :class:`RandomWalk`; non-negative, below
            ``2**63``, as :func:`mix_seed` gives them).
        counts: how many leading elements of each walk to return, ``0 <= counts[i] <=
            sizes[i]``.

    Returns:
        ``int64`` array of ``sum(counts)`` elements, walk 0's first, each walk in walk order.
    """
    sizes = np.asarray(sizes, np.int64)
    counts = np.asarray(counts, np.int64)
    seeds = np.asarray(seeds).astype(np.uint64)
    if not sizes.shape == counts.shape == seeds.shape or sizes.ndim != 1:
        raise ValueError("sizes, seeds and counts must be 1-D arrays of the same length")
    if ((counts < 0) | (counts > sizes)).any():
        raise ValueError("every count must be between 0 and the size of its walk")
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    # the Feistel domain of each walk, as RandomWalk.__init__ computes it
    top = np.maximum(sizes - 1, 1)
    bits = ((top[:, None] >> np.arange(63, dtype=np.int64)) > 0).sum(1)
    bits = np.maximum(bits, 2)
    bits += bits & 1
    half = (bits // 2).astype(np.uint64)
    mask = (np.uint64(1) << half) - np.uint64(1)
    keys = [mix_seeds(seeds, r) for r in range(_ROUNDS)]
    owner = np.repeat(np.arange(len(sizes)), counts)
    first = np.cumsum(counts) - counts
    x = (np.arange(total, dtype=np.int64) - first[owner]).astype(np.uint64)
    h, m, k = half[owner], mask[owner], [key[owner] for key in keys]
    n = sizes[owner].astype(np.uint64)
    out = _feistel(x, h, m, k)
    bad = np.flatnonzero(out >= n)
    while bad.size:  # cycle walking
        out[bad] = _feistel(out[bad], h[bad], m[bad], [key[bad] for key in k])
        bad = bad[out[bad] >= n[bad]]
    return out.astype(np.int64)


class RandomWalk:
    """A seeded pseudo-random permutation of ``[0, n)``.

    Args:
        n: the number of elements (documents); ``n >= 0``.
        seed: any integer; different seeds give (practically) independent orders.
        max_table: the largest Feistel domain (elements) for which :meth:`take` builds the
            permutation table (see below); 0 never builds one.

    ``walk[i]`` is the ``i``-th element visited; :meth:`take` computes a run of them at once
    with NumPy. The walk's position is O(1) (one integer); for speed, a walk whose Feistel
    domain (the even power of two at or above ``n``, so up to ``4 n``) has at most
    ``max_table`` elements (by default ``n`` up to 2**20) builds the domain's whole permutation
    once, on the first :meth:`take` (4 bytes and ~40 ns per element: at most 4 MB and ~40 ms),
    and walks every position's cycle there, all at once, so a :meth:`take` is one slice: a
    reader takes a shard piece's whole walk in runs of a few dozen documents, and each run
    cost ~45 NumPy calls per cycle-walking step before the table, then one lookup per step
    (a dozen steps for a run of 64 in a domain 4x ``n``). The walk is the same either way.
    """

    __slots__ = ("_half", "_keys", "_mask", "_table", "_use_table", "n", "seed")

    def __init__(self, n: int, seed: int, *, max_table: int = 1 << 20) -> None:
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{n=} must be a non-negative integer")
        self.n = int(n)
        self.seed = int(seed)
        bits = max(2, (max(self.n - 1, 1)).bit_length())
        bits += bits & 1  # even, so the two Feistel halves have equal width
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys = tuple(mix_seed(self.seed, r) for r in range(_ROUNDS))
        self._table: np.ndarray | None = None
        self._use_table = 1 << (2 * self._half) <= max_table

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"walk index {i} out of range for n={self.n}")
        x = int(i)
        while True:
            x = self._encrypt_scalar(x)
            if x < self.n:
                return x

    def take(self, start: int, count: int) -> np.ndarray:
        """Elements ``start .. start + count`` of the walk as an ``int64`` array."""
        if start < 0 or count < 0 or start + count > self.n:
            raise IndexError(f"walk slice [{start}, {start + count}) out of range for n={self.n}")
        if self._use_table:
            table = self._table
            if table is None:
                table = self._table = self._walk_table()
            return table[start : start + count].astype(np.int64)
        x = np.arange(start, start + count, dtype=np.uint64)
        return _cycle_walk(self._encrypt(x), self.n, self._encrypt).astype(np.int64)

    def _walk_table(self) -> np.ndarray:
        """The whole walk as a ``uint32`` array: the Feistel permutation of the domain, then
        cycle walking done once for every position (one lookup per step, all positions at
        once), so :meth:`take` is a slice."""
        domain = np.arange(1 << (2 * self._half), dtype=np.uint64)
        perm = self._encrypt(domain).astype(np.uint32)
        return _cycle_walk(perm[: self.n].copy(), self.n, perm.__getitem__)

    def __iter__(self) -> Iterator[int]:
        chunk = 65536
        for s in range(0, self.n, chunk):
            yield from self.take(s, min(chunk, self.n - s)).tolist()

    # -- Feistel network -------------------------------------------------------------------
    def _encrypt_scalar(self, x: int) -> int:
        h, m = self._half, self._mask
        left, right = x >> h, x & m
        for key in self._keys:
            left, right = right, left ^ (_splitmix(right ^ key) & m)
        return (left << h) | right

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        keys = [np.uint64(key) for key in self._keys]
        return _feistel(x, np.uint64(self._half), np.uint64(self._mask), keys)

    def __repr__(self) -> str:
        return f"RandomWalk(n={self.n}, seed={self.seed})"


def _cycle_walk(out: np.ndarray, n: int, step: Any) -> np.ndarray:
    """Cycle walking in place: each value of ``out`` at or above ``n`` (outside the walk's
    range) is replaced by ``step`` of it until it is below ``n``; returns ``out``."""
    bad = np.flatnonzero(out >= n)
    while bad.size:
        out[bad] = step(out[bad])
        bad = bad[out[bad] >= n]
    return out


def _feistel(x: np.ndarray, half: Any, mask: Any, keys: Sequence[Any]) -> np.ndarray:
    """The Feistel rounds on ``uint64`` values ``x``: ``half``, ``mask`` and each round key
    are ``uint64`` scalars (one walk) or arrays shaped like ``x`` (a walk per element)."""
    left, right = x >> half, x & mask
    for key in keys:
        left, right = right, left ^ (_splitmix_np(right ^ key) & mask)
    return (left << half) | right


def _splitmix_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
