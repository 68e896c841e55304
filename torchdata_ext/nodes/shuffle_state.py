"""The provenance state of a :class:`~torchdata_ext.nodes.shuffle.ShuffleBuffer`: the journal of
its draws, the blocks and groups a state lists, and reading a state's provenance back.

Each draw appends the slot and the new item's provenance table to a :class:`Journal`; a state
holds a prefix of it (:class:`LazyGroups`) and builds it into blocks of :data:`BLOCK` slots in
groups of :data:`GROUP` only when read, reusing the unchanged blocks and groups of the state
before (see the module doc of :mod:`torchdata_ext.nodes.shuffle`). A dataloader worker sends
the changes between two states (:class:`JournalDelta`), which the training process adds to a
journal of its own. :func:`buffered_provenance` and :func:`provenance_groups` read and write a
state's provenance without a buffer.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from torchdata_ext.provenance import PROV_COLUMNS

__all__ = [
    "BLOCK",
    "GROUP",
    "JOURNAL_SLACK",
    "Journal",
    "JournalDelta",
    "LazyGroups",
    "Snapshot",
    "buffered_provenance",
    "narrow",
    "provenance_groups",
    "standard_layout",
    "state_blocks",
    "too_long",
]

BLOCK = 4  # slots per provenance block (the unit a state delta resends)
GROUP = 64  # blocks per group (the unit a state delta looks inside)
JOURNAL_SLACK = 1024  # a journal may hold 2 x the buffer's slots + this many changes


def too_long(journal: Journal, slots: int) -> bool:
    """Whether ``journal`` should be built into a new base (:meth:`Journal.after`): it holds
    more than twice ``slots`` (the buffer's size) plus :data:`JOURNAL_SLACK` changes, so its
    memory is bounded (~20,000 small tables for a 10,000-sequence buffer) and building a
    state from it costs at most that many changes."""
    return len(journal) > 2 * slots + JOURNAL_SLACK


class Snapshot(NamedTuple):
    """The provenance of the buffer at one point, as a state lists it: ``groups`` of
    :class:`_ProvBlock` s or ``(counts, rows)`` pairs (never changed once made), over ``n``
    slots. ``groups`` may be a :class:`LazyGroups`, built when this snapshot is first built on."""

    groups: Sequence[Sequence[Any]]
    n: int


class Journal:
    """What changed in the buffer's slots since ``base`` (None: an empty buffer): slot
    ``slots[i]`` got an item with provenance table ``tables[i]``, in that order.

    Append-only: a state's :class:`LazyGroups` is a prefix of it, read later (or never), so
    taking a state costs a few references whatever the buffer size; a draw costs two appends.
    """

    __slots__ = ("__weakref__", "base", "received", "slots", "tables", "_parent")

    def __init__(self, base: Snapshot | None, *, received: bool = False) -> None:
        self.base = base
        self.slots: list[int] = []
        self.tables: list[Any] = []
        # made by JournalDelta.apply_to from a worker's deltas: only that extends it
        self.received = received
        # (the journal this one was built from, how many of its changes the base holds),
        # while that journal is alive: what a delta across a rebase needs (changes_since)
        self._parent: tuple[weakref.ref[Journal], int] | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def after(self, state: LazyGroups) -> Journal:
        """A journal from ``state`` (of this journal, built) on, with the changes since it."""
        out = Journal(Snapshot(state.groups(), state.n), received=self.received)
        out.slots = self.slots[state.k :]
        out.tables = self.tables[state.k :]
        out._parent = (weakref.ref(self), state.k)
        return out

    def changes_since(self, prev: LazyGroups, k: int) -> tuple[list[int], list[Any]] | None:
        """The changes (slots, tables) from state ``prev`` to the first ``k`` of this journal,
        ``prev`` being of this journal or of the one this was built from (:meth:`after`);
        None if it is of neither, or later."""
        if prev.journal is self:
            return (self.slots[prev.k : k], self.tables[prev.k : k]) if prev.k <= k else None
        if self._parent is None:
            return None
        ref, at = self._parent
        parent = ref()
        if parent is None or parent is not prev.journal or prev.k > at:
            return None
        return (
            parent.slots[prev.k : at] + self.slots[:k],
            parent.tables[prev.k : at] + self.tables[:k],
        )


class LazyGroups(Sequence[list[Any]]):
    """A state's ``prov_groups``: the first ``k`` changes of ``journal`` over ``n`` slots,
    made into the groups of blocks when first read (iterated, indexed or pickled).

    It pickles (and copies) as the plain list of groups it stands for. Groups and blocks that
    did not change since the journal's base are the base's own objects. A dataloader worker
    sends the journal's changes since the state before (:meth:`__state_diff__`, which
    :mod:`torchdata_ext.state.delta` calls), not the groups; where it cannot (the state before
    is of no journal of this one's), the groups are compared (``__state_value__``) and only
    the changed blocks are sent."""

    __slots__ = ("_groups", "journal", "k", "n")

    def __init__(self, journal: Journal, k: int, n: int) -> None:
        self.journal = journal
        self.k = k
        self.n = n
        self._groups: list[list[_ProvBlock]] | None = None

    @property
    def built(self) -> bool:
        return self._groups is not None

    def groups(self) -> list[list[_ProvBlock]]:
        groups = self._groups
        if groups is None:  # made again if two threads race here: same values, no harm
            groups = self._groups = _build_groups(self.journal, self.k, self.n)
        return groups

    __state_value__ = groups

    def __getitem__(self, i: Any) -> Any:
        return self.groups()[i]

    def __len__(self) -> int:
        return _counts(self.n)[1]

    def __iter__(self) -> Iterator[list[Any]]:
        return iter(self.groups())

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.groups(),))

    def __repr__(self) -> str:
        return f"LazyGroups({self.groups()!r})"

    def __state_diff__(self, prev: Any) -> JournalDelta | None:
        """What changed since state ``prev`` as the journal's changes (a dataloader worker's
        delta: the slots drawn and their new items' provenance tables, nothing built), or None
        when ``prev`` is not an earlier state of this journal (then the groups are compared)."""
        if type(prev) is not LazyGroups:
            return None
        changes = self.journal.changes_since(prev, self.k)
        return None if changes is None else JournalDelta(prev.n, self.n, *changes)


class JournalDelta(NamedTuple):
    """A shuffle buffer state's provenance as the change from the state before: the buffer
    held ``n_prev`` slots, then slot ``slots[i]`` got an item with provenance table
    ``tables[i]``, in order, and now holds ``n``. What a dataloader worker sends for
    ``prov_groups`` at each step (:mod:`torchdata_ext.state.delta`): a few slots and small
    tables, where the groups would cost building and comparing the changed blocks."""

    n_prev: int
    n: int
    slots: list[int]
    tables: list[Any]

    def __bool__(self) -> bool:
        """Whether anything changed."""
        return bool(self.slots) or self.n != self.n_prev

    def __reduce__(self) -> tuple[Any, ...]:
        # sent as one array of rows and their counts per table: pickling (and unpickling) a
        # few small arrays costs more than the rows (~10 us each, 8 per batch)
        tables = [np.asarray(t).reshape(-1, PROV_COLUMNS) for t in self.tables]
        counts = [len(t) for t in tables]
        rows = np.concatenate(tables) if tables else np.zeros((0, PROV_COLUMNS), np.int64)
        return (_unpack_delta, (self.n_prev, self.n, list(self.slots), counts, rows))

    def apply_to(self, old: Any) -> LazyGroups:
        """The state's ``prov_groups`` after these changes to ``old`` (the state before, as
        the receiver holds it: groups, or a :class:`LazyGroups` this made). Nothing is built:
        the changes extend the receiver's own journal, built when the state is read.

        Raises:
            ValueError: ``old`` does not hold ``n_prev`` slots (the delta is not of this
                state).
        """
        journal = old.journal if type(old) is LazyGroups else None
        if journal is None or not journal.received or old.k != len(journal) or old.n != self.n_prev:
            n_old = old.n if type(old) is LazyGroups else sum(len(b[0]) for g in old for b in g)
            if n_old != self.n_prev:
                raise ValueError(
                    f"a shuffle buffer's provenance delta from {self.n_prev} slots applied to a "
                    f"state of {n_old} slots: the states a worker sent and the ones applied here "
                    "differ (apply each delta to the state it was taken against)"
                )
            journal = Journal(Snapshot(old, n_old), received=True)
        if type(old) is LazyGroups and old.journal is journal and old.built:
            journal = journal.after(old)  # read (saved): later states build on it
        elif too_long(journal, max(self.n_prev, self.n)):
            journal = journal.after(LazyGroups(journal, len(journal), self.n_prev))
        journal.slots.extend(self.slots)
        journal.tables.extend(self.tables)
        return LazyGroups(journal, len(journal), self.n)


def _unpack_delta(
    n_prev: int, n: int, slots: list[int], counts: list[int], rows: np.ndarray
) -> JournalDelta:
    """A :class:`JournalDelta` as it was pickled: its tables are views of ``rows``."""
    return JournalDelta(n_prev, n, slots, _block_tables((counts, rows)))


def _counts(n: int) -> tuple[int, int]:
    """Blocks and groups of ``n`` slots (the last of each may be partial)."""
    n_blocks = -(-n // BLOCK)
    return n_blocks, -(-n_blocks // GROUP)


def _build_groups(journal: Journal, k: int, n: int) -> list[list[_ProvBlock]]:
    """The groups of blocks of ``n`` slots after the first ``k`` changes of ``journal``: the
    base's groups, with new blocks where a slot changed (or the last block was cut) and new
    lists for the groups they are in."""
    base = journal.base
    groups: list[Any] = list(base.groups) if base is not None else []
    n0 = base.n if base is not None else 0
    changes = dict(zip(journal.slots[:k], journal.tables[:k]))  # the last change of a slot
    dirty = {s // BLOCK for s in changes if s < n}
    if n < n0 and n % BLOCK:
        dirty.add((n - 1) // BLOCK)  # the last block lost slots
    n_blocks, n_groups = _counts(n)
    del groups[n_groups:]
    blocks = sorted(dirty)
    tables: list[Any] = []
    sizes: list[int] = []
    for b in blocks:
        lo, hi = b * BLOCK, min(b * BLOCK + BLOCK, n)
        kept = _block_tables(groups[b // GROUP][b % GROUP]) if lo < n0 else ()
        tables.extend(changes[s] if s in changes else kept[s - lo] for s in range(lo, hi))
        sizes.append(hi - lo)
    stale = _StaleGroup(tables, sizes)
    made: dict[int, list[_ProvBlock]] = {}
    if n_groups and len(groups) == n_groups:  # the last group may have lost blocks
        last = n_groups - 1
        if len(groups[last]) != n_blocks - last * GROUP:
            made[last] = groups[last][: n_blocks - last * GROUP]
    for i, b in enumerate(blocks):
        g, at = divmod(b, GROUP)
        group = made.get(g)
        if group is None:
            group = made[g] = list(groups[g]) if g < len(groups) else []
        block = _ProvBlock(stale, i)
        if at < len(group):
            group[at] = block
        else:  # blocks of slots added since the base come in order
            group.append(block)
    groups.extend([] for _ in range(n_groups - len(groups)))
    for g, group in made.items():
        groups[g] = group
    return groups


class _StaleGroup:
    """The provenance tables of the blocks one state found changed (a few per batch), made
    into ``(counts, rows)`` pairs together, on first use (one concatenation for all of them).
    Holds only the tables (small arrays, never written), not the items."""

    __slots__ = ("_pairs", "_sizes", "_starts", "_tables")

    def __init__(self, tables: list[np.ndarray], sizes: list[int]) -> None:
        self._tables = tables
        self._sizes = sizes  # items per block
        self._starts: list[int] | None = None
        self._pairs: list[tuple[np.ndarray, np.ndarray]] | None = None

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        pairs = self._pairs
        if pairs is None:  # made again if two threads race here: same values, no harm
            pairs = self._pairs = _pairs(self._tables, self._sizes)
        return pairs[i]

    def tables(self, i: int) -> list[Any]:
        """The provenance tables of block ``i``'s slots, as the items held them."""
        starts = self._starts
        if starts is None:
            starts = self._starts = [0, *itertools.accumulate(self._sizes)]
        return self._tables[starts[i] : starts[i + 1]]


def _pairs(tables: list[np.ndarray], sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block of ``sizes[i]`` consecutive tables: the rows per item and the rows
    (``[n, 5]``), each in the smallest integer dtype that holds the block's values (per block,
    as the format always had it: one wide value would otherwise widen every block)."""
    counts = np.array([len(t) for t in tables], np.int64)
    rows = np.concatenate(tables).reshape(-1, PROV_COLUMNS)
    ends = np.concatenate([[0], np.cumsum(counts)]).tolist()
    out, i = [], 0
    for n in sizes:
        out.append((narrow(counts[i : i + n]), narrow(rows[ends[i] : ends[i + n]])))
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

    def tables(self) -> list[Any]:
        """The provenance tables of the block's slots (what later blocks are made from)."""
        return self._group.tables(self._i)


def standard_layout(groups: list[Any], n: int) -> bool:
    """Whether ``groups`` cut ``n`` slots as this module does: blocks of ``BLOCK`` slots in
    groups of ``GROUP`` blocks, the last of each possibly partial."""
    n_blocks, n_groups = _counts(n)
    if len(groups) != n_groups or sum(len(g) for g in groups) != n_blocks:
        return False
    if any(len(g) != GROUP for g in groups[:-1]):
        return False
    sizes = [len(block[0]) for g in groups for block in g]
    return all(k == BLOCK for k in sizes[:-1]) and sizes[-1] == n - BLOCK * (n_blocks - 1)


def _block_tables(block: Any) -> list[Any]:
    """The provenance tables of a block's slots: a :class:`_ProvBlock`'s own, or split from a
    restored state's ``(counts, rows)`` pair."""
    if type(block) is _ProvBlock:
        return block.tables()
    counts, rows = block
    ends = np.cumsum(np.asarray(counts, np.int64)).tolist()
    rows = np.asarray(rows).reshape(-1, PROV_COLUMNS)
    return [rows[a:b] for a, b in zip([0, *ends], ends)]


def state_blocks(state: dict[str, Any]) -> list[Any]:
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
        blocks = state_blocks(state)
        if not blocks:
            return np.zeros(0, np.int64), np.zeros((0, PROV_COLUMNS), np.int64)
        # one concatenation, then one cast (blocks are narrowed each to its own dtype)
        counts = np.concatenate([c for c, _ in blocks]).astype(np.int64)
        rows = np.concatenate([np.reshape(r, (-1, PROV_COLUMNS)) for _, r in blocks])
        return counts, rows.astype(np.int64)
    # format 1, all items' columns concatenated: written by tests/test_shuffle.py and test_loader.py
    if "prov_counts" in state:
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


def provenance_groups(tables: Sequence[np.ndarray]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The ``prov_groups`` of a :class:`ShuffleBuffer` state (format 3) whose buffer holds, in
    slot order, items with these provenance tables (``(k, 5)`` integer arrays, see
    :mod:`torchdata_ext.provenance`): plain lists of ``(counts, rows)`` pairs, as a state
    pickles. A buffer restored from such a state rebuilds each item only when it is drawn."""
    journal = Journal(None)
    journal.slots = list(range(len(tables)))
    journal.tables = [np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS) for t in tables]
    groups = _build_groups(journal, len(tables), len(tables))
    return [[tuple(block) for block in group] for group in groups]  # type: ignore[misc]


_NARROW = [
    (np.dtype(dt), int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for dt in (np.int8, np.int16, np.int32)
]


def narrow(a: np.ndarray) -> np.ndarray:
    """``a`` in the smallest signed integer dtype that holds its values."""
    if a.size == 0:
        return a.astype(np.int8)
    lo, hi = int(a.min()), int(a.max())
    for dt, dt_min, dt_max in _NARROW:
        if dt_min <= lo and hi <= dt_max:
            return a.astype(dt)
    return a.astype(np.int64)
