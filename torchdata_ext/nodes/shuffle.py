"""Shuffle buffer: a uniform random pick from the last ``buffer_size`` items, refilled from
upstream, so neighbours in the stream come from far apart (Bamba used 10,000 sequences).

The state does not hold the buffered token arrays. Items that carry a provenance table
(packed sequences, see :mod:`torchdata_ext.provenance`) are saved as that table, in one
compact integer array, and rebuilt on restore by ``rebuild`` (by default the source's own
``rebuild``, which re-reads the documents). The state of a 10,000 x 4,096-token buffer is then
about a megabyte instead of 160 MB. Items without provenance are kept in the state as they are
(fine for small buffers and small items).

Long waits say what they are doing: a fill that lasts more than a couple of seconds logs its
progress (items so far of ``buffer_size``), as does rebuilding the items on restore, and a
buffer larger than this worker's share of the data (``worker_share``) warns once: filling it
reads the whole share (and more epochs), so the first batch waits for all of it.

Draws are counter-based: draw ``i`` picks slot ``mix_seed(seed, i) % len(buffer)``, so the state
holds the draw counter, not an RNG.

A source with ``next_packed()`` and ``materialize()`` (:class:`~torchdata_ext.nodes.pack.Pack`)
is read through ``next_packed()``: the buffer holds each sequence in that small form (its
tokens and provenance, about a quarter of the output dict) and materializes it when it is
drawn, so a 10,000-sequence buffer holds ~170 MB instead of ~700 MB (at seq_len 4096) and the
arrays handed downstream are freshly written.

The provenance of the buffered items is kept in blocks of ``_BLOCK`` (4) slots, each one
array made once and again only after one of its slots changed, and the blocks in groups of
``_GROUP`` (64); the state lists the groups, and a block or group that did not change is the
same object as in the previous state. So ``state_dict()`` costs a few references, and the
state a dataloader worker sends after a batch is a few kilobytes: only the blocks whose slots
were drawn, found by looking at ~40 groups and the ~8 changed ones' 64 blocks rather than at
all 2,500 blocks of a 10,000-sequence buffer (see :mod:`torchdata_ext.state_delta`).

State keys: ``source`` (upstream state after the last pull), ``draws``, ``exhausted``, and
either ``prov_groups`` (format 3: a list of groups, each a list of blocks of slots, each a
pair ``(counts, rows)``: rows per item and the items' provenance rows ``[sum(counts), 5]``, in
the narrowest integer dtype that holds them) or ``items`` (items kept as they are). The
earlier formats are still read: ``prov_blocks`` (format 2: the blocks in one list) and
``prov_counts`` / ``prov_rows`` (format 1: all items concatenated). Resume guarantee: the rest
of the stream is identical.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext._progress import Progress
from torchdata_ext.provenance import PROV_COLUMNS
from torchdata_ext.walk import mix_seed

__all__ = ["ShuffleBuffer", "buffered_provenance"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DRAW_TAG = 0x53485546
_BLOCK = 4  # slots per provenance block (the unit a state delta resends)
_GROUP = 64  # blocks per group (the unit a state delta looks inside)


class ShuffleBuffer(BaseNode[T], Generic[T]):
    """Shuffle items through a buffer of ``buffer_size``.

    Args:
        source: the upstream node.
        buffer_size: how many items the buffer holds (items, e.g. packed sequences); 1 passes
            items through in order.
        seed: the seed of the draws.
        rebuild: function from an item's provenance table to the item, used on restore;
            default: ``source.rebuild`` when the source has it. Only used for items that carry
            a ``provenance_key`` entry.
        provenance_key: the dict key holding an item's provenance table.
        worker_share: how many items this worker's share of one pass over the data makes (e.g.
            its tokens / sequence length), or a function returning it (None: unknown), called
            at the first fill, when the world is known; a larger ``buffer_size`` warns once.
            None: no check.

    When the source ends (finite runs), the buffer drains: every buffered item is still
    delivered, in random order, then ``StopIteration``.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[T],
        buffer_size: int,
        *,
        seed: int = 0,
        rebuild: Callable[[np.ndarray], T] | None = None,
        provenance_key: str = "provenance",
        worker_share: int | Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)):
            raise TypeError(f"{buffer_size=} must be an integer")
        if buffer_size < 1:
            raise ValueError(f"{buffer_size=} must be >= 1 (1 keeps the order)")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{seed=} must be an integer")
        self.source = source
        self.buffer_size = int(buffer_size)
        self.seed = int(seed)
        self._rebuild = rebuild if rebuild is not None else getattr(source, "rebuild", None)
        self.provenance_key = provenance_key
        self.worker_share = worker_share
        self._share_checked = False
        next_packed = getattr(source, "next_packed", None)
        materialize = getattr(source, "materialize", None)
        self._packed = callable(next_packed) and callable(materialize)
        self._pull: Callable[[], Any] = next_packed if self._packed else self._next_source  # type: ignore[assignment]
        self._out: Callable[[Any], T] = materialize if self._packed else _same  # type: ignore[assignment]
        self._buf: list[Any] = []
        self._draws = 0
        self._exhausted = False
        # provenance cache: per block of _BLOCK slots, (rows per item, the narrowed rows);
        # None where a slot changed since (listed in _dirty); see _refresh
        self._blocks: list[_ProvBlock | None] = []
        self._dirty: set[int] = set()
        # the blocks by group of _GROUP: each list made again only when one of its blocks
        # changed, or when the number of blocks changed (the last group)
        self._groups: list[list[_ProvBlock | None]] = []

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._buf = []
        self._blocks = []
        self._dirty = set()
        self._groups = []
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._draws = int(initial_state["draws"])
            self._exhausted = bool(initial_state["exhausted"])
            if "items" in initial_state:
                self._buf = list(initial_state["items"])
            else:
                self._buf = self._rebuild_items(initial_state)
        else:
            self.source.reset(None)
            self._draws = 0
            self._exhausted = False

    def next(self) -> T:
        return self._out(self._draw())

    def _draw(self) -> Any:
        buf = self._buf
        if not self._exhausted and len(buf) < self.buffer_size:
            self._fill()
        if not buf:
            raise StopIteration
        j = mix_seed(self.seed, _DRAW_TAG, self._draws) % len(buf)
        self._draws += 1
        item = buf[j]
        self._touch(j)
        if not self._exhausted:
            try:
                buf[j] = self._pull()
                return item
            except StopIteration:
                self._exhausted = True
        buf[j] = buf[-1]
        buf.pop()
        self._touch(len(buf))
        return item

    # -- the packed-item protocol of Pack, passed through ------------------------------------------
    def next_packed(self) -> Any:
        """The next item as the buffer holds it (a source's :meth:`~.pack.Pack.next_packed`
        form, not yet materialized); ``next()`` is ``materialize(next_packed())``."""
        return self._draw()

    def materialize(self, item: Any) -> T:
        """The item :meth:`next` would return for an item from :meth:`next_packed`."""
        return self._out(item)

    def materialize_batch_into(self, items: list[Any], out: dict[str, np.ndarray]) -> None:
        """The source's ``materialize_batch_into`` (see
        :meth:`~.pack.Pack.materialize_batch_into`)."""
        fill = getattr(self.source, "materialize_batch_into", None)
        if fill is None:
            raise TypeError(
                f"the source {type(self.source).__name__} has no materialize_batch_into"
            )
        fill(items, out)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """The source's ``output_keys`` (the keys of a materialized item), if it has them."""
        return tuple(getattr(self.source, "output_keys", ()))

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            self.SOURCE_KEY: self.source.state_dict(),
            "draws": self._draws,
            "exhausted": self._exhausted,
        }
        if self._buf and self._has_provenance():
            n_blocks = -(-len(self._buf) // _BLOCK)
            had = len(self._blocks)
            del self._blocks[n_blocks:]
            stale = [b for b in self._dirty if b < n_blocks]
            stale.extend(range(len(self._blocks), n_blocks))
            self._dirty.clear()
            self._refresh(stale)
            groups = {b // _GROUP for b in stale}
            if had != n_blocks:  # the last group grew or shrank
                groups.update(range(min(had, n_blocks) // _GROUP, -(-n_blocks // _GROUP)))
            del self._groups[-(-n_blocks // _GROUP) :]
            self._groups.extend([] for _ in range(-(-n_blocks // _GROUP) - len(self._groups)))
            for g in groups:
                self._groups[g] = self._blocks[g * _GROUP : (g + 1) * _GROUP]
            state["prov_groups"] = list(self._groups)  # references: the groups are cached
        else:
            state["items"] = [self._out(x) for x in self._buf]
        return state

    # -- helpers -------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Pull until the buffer is full or the source ends, reporting a long fill."""
        if not self._share_checked:
            self._share_checked = True
            self._check_share()
        buf = self._buf
        unit = "sequences" if self._packed else "items"
        with Progress(
            "filling the shuffle buffer", logger, total=self.buffer_size, unit=unit, bar=False
        ) as progress:
            progress.done = len(buf)
            while not self._exhausted and len(buf) < self.buffer_size:
                try:
                    buf.append(self._pull())
                except StopIteration:
                    self._exhausted = True
                else:
                    self._touch(len(buf) - 1)
                    progress.update()

    def _check_share(self) -> None:
        """Warn (once) when the buffer holds more items than this worker's share of the data."""
        share = self.worker_share() if callable(self.worker_share) else self.worker_share
        if share is None or self.buffer_size <= share:
            return
        logger.warning(
            "the shuffle buffer holds %d items but this worker's share of the data is only ~%d: "
            "the first batch waits until the buffer has read all of it (and more epochs), "
            "and items of several epochs mix; use a buffer_size (shuffle_buffer) below that, "
            "or fewer workers",
            self.buffer_size,
            share,
        )

    def _next_source(self) -> T:
        return next(self.source)

    def _has_provenance(self) -> bool:
        first = self._buf[0]
        if self._rebuild is None:
            return False
        if isinstance(first, dict):
            return self.provenance_key in first
        return self._packed and hasattr(first, "provenance")

    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Document tokens held in the buffer, as ``(dataset, file, doc, start, stop)``; used to
        hand them on when rescaling (needs a source with ``dataset_names``, i.e. a Pack)."""
        if not self._buf:
            return []
        names = getattr(self.source, "dataset_names", None)
        if names is None:
            raise ValueError(
                "cannot hand on shuffle-buffer contents: its source has no dataset_names "
                "(put the shuffle buffer on a Pack)"
            )
        out = []
        for item in self._buf:
            for ds, f, d, start, length in self._provenance(item).tolist():
                if ds >= 0 and length > 0:
                    out.append((names[ds], f, d, start, start + length))
        return out

    def _provenance(self, item: Any) -> np.ndarray:
        if isinstance(item, dict):
            return np.asarray(item[self.provenance_key])
        table = item.provenance
        return table if type(table) is np.ndarray else np.asarray(table)

    def _touch(self, slot: int) -> None:
        """Slot ``slot`` changed: drop its block from the provenance cache."""
        b = slot // _BLOCK
        if b < len(self._blocks):
            self._blocks[b] = None
            self._dirty.add(b)

    def _refresh(self, blocks: list[int]) -> None:
        """Give blocks ``blocks`` of slots their provenance again (see :class:`_ProvBlock`).

        A block is the same object until one of its slots changes: states share it and never
        see it change. Only references are taken here (the items' own provenance tables); the
        narrowed arrays are made when a state is pickled or read, so a state at every step
        costs the training process almost nothing when it is never saved."""
        if not blocks:
            return
        self._blocks.extend([None] * (max(blocks) + 1 - len(self._blocks)))
        buf, prov = self._buf, self._provenance
        slices = [buf[b * _BLOCK : (b + 1) * _BLOCK] for b in blocks]
        group = _StaleGroup([prov(x) for items in slices for x in items], [len(s) for s in slices])
        for i, b in enumerate(blocks):
            self._blocks[b] = _ProvBlock(group, i)

    def _rebuild_items(self, state: dict[str, Any]) -> list[T]:
        if self._rebuild is None:
            raise ValueError(
                "this shuffle buffer state holds provenance tables but the node has no way to "
                "rebuild items: pass rebuild=... or use a source with a rebuild() method"
            )
        counts, rows = buffered_provenance(state)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        out = []
        with Progress(
            "rebuilding the shuffle buffer", logger, total=len(counts), bar=False
        ) as progress:
            for i in range(len(counts)):
                out.append(self._rebuild(rows[bounds[i] : bounds[i + 1]]))
                progress.update()
        return out


class _StaleGroup:
    """The provenance tables of the blocks one state found changed (a few per batch), made
    into ``(counts, rows)`` pairs together, on first use (one concatenation for all of them).
    Holds only the tables (small arrays, never written), not the items."""

    __slots__ = ("_pairs", "_sizes", "_tables")

    def __init__(self, tables: list[np.ndarray], sizes: list[int]) -> None:
        self._tables = tables
        self._sizes = sizes  # items per block
        self._pairs: list[tuple[np.ndarray, np.ndarray]] | None = None

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        pairs = self._pairs
        if pairs is None:  # made again if two threads race here: same values, no harm
            pairs = self._pairs = _pairs(self._tables, self._sizes)
        return pairs[i]


def _pairs(tables: list[np.ndarray], sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block of ``sizes[i]`` consecutive tables: the rows per item and the rows
    (``[n, 5]``), each in the smallest integer dtype that holds the block's values (per block,
    as the format always had it: one wide value would otherwise widen every block)."""
    counts = np.array([len(t) for t in tables], np.int64)
    rows = np.concatenate(tables).reshape(-1, PROV_COLUMNS)
    ends = np.concatenate([[0], np.cumsum(counts)]).tolist()
    out, i = [], 0
    for n in sizes:
        out.append((_narrow(counts[i : i + n]), _narrow(rows[ends[i] : ends[i + n]])))
        i += n
    return out


class _ProvBlock(Sequence[np.ndarray]):
    """The provenance of one block of buffer slots in a state: the pair ``(counts, rows)``
    (rows per item, and the items' provenance rows ``[sum(counts), 5]``), made when first
    read. It pickles as that plain tuple, so checkpoints and the states a dataloader worker
    sends hold plain arrays (format 2), and a restored state has tuples here."""

    __slots__ = ("_group", "_i")

    def __init__(self, group: _StaleGroup, i: int) -> None:
        self._group = group
        self._i = i

    def __getitem__(self, k: Any) -> Any:
        return self._group.pair(self._i)[k]

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._group.pair(self._i))

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self._group.pair(self._i),))

    def __repr__(self) -> str:
        return f"_ProvBlock{self._group.pair(self._i)!r}"


def _state_blocks(state: dict[str, Any]) -> list[Any]:
    """The ``(counts, rows)`` blocks of a format 3 (``prov_groups``) or 2 (``prov_blocks``)
    state, in slot order."""
    if "prov_groups" in state:
        return [block for group in state["prov_groups"] for block in group]
    return list(state["prov_blocks"])


def buffered_provenance(state: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The provenance of the items a :class:`ShuffleBuffer` state holds, read from the state
    alone (nothing rebuilt): ``(counts, rows)``, ``counts[i]`` rows per item and the items'
    provenance rows ``[sum(counts), 5]`` (``int64``, see :mod:`torchdata_ext.provenance`),
    items in slot order.

    Raises:
        ValueError: the state keeps its items as they are (``items``: a source without
            provenance), so there is no provenance to read.
    """
    if "prov_groups" in state or "prov_blocks" in state:  # format 3 or 2
        blocks = _state_blocks(state)
        if not blocks:
            return np.zeros(0, np.int64), np.zeros((0, PROV_COLUMNS), np.int64)
        counts = np.concatenate([np.asarray(c, np.int64) for c, _ in blocks])
        rows = np.concatenate(
            [np.asarray(r, np.int64).reshape(-1, PROV_COLUMNS) for _, r in blocks]
        )
        return counts, rows
    if "prov_counts" in state:  # format 1: all items' columns concatenated
        counts = np.asarray(state["prov_counts"], np.int64)
        cols = [np.asarray(c, np.int64) for c in state["prov_rows"]]
        rows = np.stack(cols, axis=1) if cols else np.zeros((0, PROV_COLUMNS), np.int64)
        return counts, rows
    items = state.get("items")
    if not items:  # an empty buffer
        return np.zeros(0, np.int64), np.zeros((0, PROV_COLUMNS), np.int64)
    raise ValueError(
        "this shuffle buffer state keeps its items as they are, without provenance tables; "
        "put the shuffle buffer on a Pack to account for what it holds"
    )


def _same(item: T) -> T:
    return item


_NARROW = [
    (np.dtype(dt), int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for dt in (np.int8, np.int16, np.int32)
]


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` in the smallest signed integer dtype that holds its values."""
    if a.size == 0:
        return a.astype(np.int8)
    lo, hi = int(a.min()), int(a.max())
    for dt, dt_min, dt_max in _NARROW:
        if dt_min <= lo and hi <= dt_max:
            return a.astype(dt)
    return a.astype(np.int64)
