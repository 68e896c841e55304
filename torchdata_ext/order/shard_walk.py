"""A logical shard's walk in an epoch: pure functions of ``(seed, shard, epoch)``, no I/O.

In epoch ``e`` the reader visits logical shard ``s``'s file pieces (:func:`~torchdata_ext.order.shards.
shard_fragments`) in an order shuffled from ``(seed, s, e)``, and inside each piece the documents
in the order of a :class:`~torchdata_ext.order.walk.RandomWalk` seeded from ``(seed, s, e, file,
start)``. Walk position ``p`` of the shard is therefore a document known without reading
anything: the reader (:class:`~torchdata_ext.nodes.reader.ShardReader`) walks these plans one
block at a time, and the audit (:mod:`torchdata_ext.audit.report`) lists the documents a cursor has
passed, for every shard at once (:func:`walked_documents`, vectorised).

::

    shard s, epoch e:   pieces (f2, 0..40) (f1, 70..100)   shuffled from (seed, s, e)
    plan:               | f2 piece: walk of 40 | f1 piece: walk of 30 |
    walk position 42 -> second piece, its walk's element 2 -> (f1, 70 + walk[2])

The shards themselves are read in an order shuffled per epoch (:func:`shard_order_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from torchdata_ext.checks import check_int
from torchdata_ext.order.shards import Fragment, shard_bounds
from torchdata_ext.order.walk import mix_seed, mix_seeds, walk_prefixes

__all__ = [
    "PlanTable",
    "ShardPlan",
    "latest_epochs",
    "plan_table",
    "shard_order_rank",
    "shard_plan",
    "walked_documents",
]

# tags keep the derived seeds of different uses apart
FRAGMENT_TAG = 0x46524147
WALK_TAG = 0x57414C4B
ORDER_TAG = 0x4F524452


@dataclass(frozen=True)
class ShardPlan:
    """A shard's walk in one epoch: its file pieces in order and where each starts.

    Attributes:
        fragments: the shard's file pieces in walk order.
        starts: ``int64``, ``len(fragments) + 1``: the walk position where each piece starts
            (the last value is the shard's size in documents).
        seeds: the :class:`~torchdata_ext.order.walk.RandomWalk` seed of each piece.
    """

    fragments: tuple[Fragment, ...]
    starts: np.ndarray
    seeds: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(self.starts[-1])


class PlanTable(NamedTuple):
    """The plans of many ``(shard, epoch)`` entries as flat arrays, one row per file piece,
    each entry's pieces together and in walk order.

    Attributes:
        entry: which requested entry (index into the ``shards`` / ``epochs`` given) the piece
            belongs to.
        file: the piece's file number.
        start: its first document in the file.
        stop: one past its last document in the file.
        walk_start: the walk position in its shard where the piece starts.
        seed: the piece's walk seed (``uint64``).
    """

    entry: np.ndarray
    file: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    walk_start: np.ndarray
    seed: np.ndarray


def plan_table(
    offsets: np.ndarray,
    n_logical_shards: int,
    seed: int,
    shards: np.ndarray,
    epochs: np.ndarray,
) -> PlanTable:
    """The plans of shard ``shards[i]`` in epoch ``epochs[i]`` for every ``i``.

    Args:
        offsets: :func:`~torchdata_ext.order.shards.file_offsets` of the dataset.
        n_logical_shards: N, the dataset's logical shard count.
        seed: the shuffling seed.
        shards: logical shard ids in ``[0, N)``.
        epochs: the epoch of each entry (>= 0).

    Returns:
        A :class:`PlanTable`. Per entry it is :func:`shard_plan`; the work is vectorised but
        for shards split over several files, whose pieces are shuffled one shard at a time.
    """
    n = check_int("n_logical_shards", n_logical_shards, 1)
    shards = np.asarray(shards, np.int64).reshape(-1)
    epochs = np.broadcast_to(np.asarray(epochs, np.int64), shards.shape)
    if len(shards) and (shards.min() < 0 or shards.max() >= n):
        raise ValueError(f"shard ids must be in [0, {n_logical_shards=})")
    bounds = shard_bounds(int(offsets[-1]), n)
    lo, hi = bounds[shards], bounds[shards + 1]
    first = np.searchsorted(offsets, lo, side="right") - 1
    last = np.searchsorted(offsets, hi - 1, side="right") - 1
    counts = np.where(hi > lo, last - first + 1, 0)
    entry = np.repeat(np.arange(len(shards), dtype=np.int64), counts)
    file = first[entry] + (
        np.arange(len(entry), dtype=np.int64) - (np.cumsum(counts) - counts)[entry]
    )
    start = np.maximum(lo[entry], offsets[file]) - offsets[file]
    stop = np.minimum(hi[entry], offsets[file + 1]) - offsets[file]
    keep = stop > start  # files without documents inside the range hold no piece
    entry, file, start, stop = entry[keep], file[keep], start[keep], stop[keep]
    # pieces of one shard in the order shuffled from (seed, shard, epoch)
    per_entry = np.bincount(entry, minlength=len(shards))
    base = np.cumsum(per_entry) - per_entry
    order = np.arange(len(entry), dtype=np.int64)
    for i in np.flatnonzero(per_entry > 1).tolist():
        k, b = int(per_entry[i]), int(base[i])
        rng = np.random.default_rng(mix_seed(seed, FRAGMENT_TAG, int(shards[i]), int(epochs[i])))
        order[b : b + k] = b + rng.permutation(k)
    file, start, stop = file[order], start[order], stop[order]
    size = stop - start
    ends = np.cumsum(size)
    walk_start = ends - size - (ends - size)[base[entry]] if len(entry) else size
    seeds = mix_seeds(seed, WALK_TAG, shards[entry], epochs[entry], file, start)
    return PlanTable(entry, file, start, stop, walk_start, seeds)


def shard_plan(
    offsets: np.ndarray, n_logical_shards: int, seed: int, shard: int, epoch: int
) -> ShardPlan:
    """Logical shard ``shard``'s walk in ``epoch`` (see the module docstring).

    Args:
        offsets: :func:`~torchdata_ext.order.shards.file_offsets` of the dataset.
        n_logical_shards: N, the dataset's logical shard count.
        seed: the shuffling seed.
        shard: the shard id in ``[0, N)``.
        epoch: the epoch (>= 0).
    """
    t = plan_table(offsets, n_logical_shards, seed, np.array([shard]), np.array([epoch]))
    frags = tuple(
        Fragment(f, a, b) for f, a, b in zip(t.file.tolist(), t.start.tolist(), t.stop.tolist())
    )
    starts = np.zeros(len(frags) + 1, np.int64)
    starts[1:] = t.walk_start + (t.stop - t.start)
    starts[:-1] = t.walk_start
    return ShardPlan(frags, starts, tuple(int(s) for s in t.seed.tolist()))


def shard_order_rank(seed: int, n_logical_shards: int, epoch: int) -> np.ndarray:
    """Each shard's place in epoch ``epoch``'s shuffled shard order (``rank[s]``: a worker
    reads its shards of one epoch by increasing rank)."""
    perm = np.random.default_rng(mix_seed(seed, ORDER_TAG, epoch)).permutation(n_logical_shards)
    ranks = np.empty_like(perm)
    ranks[perm] = np.arange(n_logical_shards)
    return ranks


def walked_documents(
    offsets: np.ndarray,
    n_logical_shards: int,
    seed: int,
    shards: np.ndarray,
    epochs: np.ndarray,
    positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents at walk positions ``0 .. positions[i] - 1`` of shard ``shards[i]`` in
    epoch ``epochs[i]``, for every ``i``, in one vectorised pass.

    Args:
        offsets: :func:`~torchdata_ext.order.shards.file_offsets` of the dataset.
        n_logical_shards: N, the dataset's logical shard count.
        seed: the shuffling seed.
        shards: logical shard ids.
        epochs: the epoch of each entry.
        positions: how many documents of each entry's walk (0 .. the shard's size).

    Returns:
        ``(entry, file, doc)``: ``int64`` arrays, one element per document, each entry's
        documents together and in walk order (``entry`` indexes the arguments).
    """
    t = plan_table(offsets, n_logical_shards, seed, shards, epochs)
    positions = np.broadcast_to(np.asarray(positions, np.int64), np.shape(shards))
    size = t.stop - t.start
    take = np.clip(positions[t.entry] - t.walk_start, 0, size)
    sizes = np.bincount(t.entry, weights=size, minlength=len(positions)).astype(np.int64)
    if (positions < 0).any() or (positions > sizes).any():
        raise ValueError("every position must be between 0 and the size of its shard")
    walked = walk_prefixes(size, t.seed, take)
    file = np.repeat(t.file, take)
    return np.repeat(t.entry, take), file, walked + np.repeat(t.start, take)


def latest_epochs(
    offsets: np.ndarray,
    n_logical_shards: int,
    seed: int,
    cursors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    documents: np.ndarray,
) -> np.ndarray:
    """The latest epoch in which each of ``documents`` (global ids) was consumed, given the
    cursors of the shards holding them: the epoch ``e`` of its shard's cursor when the walk of
    ``e`` has passed it (a document begun counts), else ``e - 1`` (-1: never consumed). A
    document whose shard has no cursor in ``cursors`` gets -2 (unknown).

    Args:
        offsets: :func:`~torchdata_ext.order.shards.file_offsets` of the dataset.
        n_logical_shards: N, the dataset's logical shard count.
        seed: the shuffling seed.
        cursors: ``(ids, epoch, pos, offset)``, one element per shard (a reader state's
            :func:`~torchdata_ext.state.reader_state.reader_cursors` columns).
        documents: global document ids.
    """
    ids, epoch, pos, offset = (np.asarray(c, np.int64) for c in cursors)
    documents = np.asarray(documents, np.int64)
    out = np.full(len(documents), -2, np.int64)
    shard = np.searchsorted(shard_bounds(int(offsets[-1]), n_logical_shards), documents, "right")
    at = np.searchsorted(ids, shard - 1)
    known = (
        (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == shard - 1) if len(ids) else at < 0
    )
    if not known.any():
        return out
    need = np.unique(at[known])
    _, file, doc = walked_documents(
        offsets, n_logical_shards, seed, ids[need], epoch[need], pos[need] + (offset[need] > 0)
    )
    passed = np.isin(documents[known], offsets[file] + doc)
    out[known] = epoch[at[known]] - np.where(passed, 0, 1)
    return out
