"""Shuffle buffer: a uniform random pick from the last ``buffer_size`` items, refilled from
upstream, so neighbours in the stream come from far apart (Bamba used 10,000 sequences).

The state does not hold the buffered token arrays. Items that carry a provenance table
(packed sequences, see :mod:`torchdata_ext.provenance`) are saved as that table, in one
compact integer array, and rebuilt on restore by ``rebuild`` (by default the source's own
``rebuild``, which re-reads the documents). The state of a 10,000 x 4,096-token buffer is then
about a megabyte instead of 160 MB. Items without provenance are kept in the state as they are
(fine for small buffers and small items).

The buffer delivers while it fills (``fill="stream"``, the default, as fms-fsdp's buffer): a
draw while the buffer is not yet full first adds one item from upstream, then picks one of the
items held so far and puts the next upstream item in its place, so the buffer grows by one item
per draw and the first item comes after two pulls, whatever ``buffer_size``. ``fill="full"``
fills the whole buffer before the first draw (a fill that lasts more than a couple of seconds
logs its progress). What streaming costs the shuffle (neighbours are closer in the source order
during the first ``buffer_size`` draws) is measured in ``docs/time-to-data.md``. A buffer larger
than this worker's share of the data (``worker_share``) warns once.

A restore is lazy: the restored buffer holds each item as its provenance table only
(:class:`ProvenanceItem`, see :meth:`ShuffleBuffer.items_from_provenance`) and rebuilds the item
(``rebuild``: reads, and for text re-tokenizes, its documents) when it is drawn, so the first
batch after a restore reads the documents of its own rows, not of the whole buffer.

Draws are counter-based: draw ``i`` picks slot ``mix_seed(seed, i) % len(buffer)``, so the state
holds the draw counter, not an RNG. The number of items held is in the state (its provenance),
so a state taken during a streaming fill restores exactly too.

A source with ``next_packed()`` and ``materialize()`` (:class:`~torchdata_ext.nodes.pack.Pack`)
is read through ``next_packed()``: the buffer holds each sequence in that small form (its
tokens and provenance, about a quarter of the output dict) and materializes it when it is
drawn, so a 10,000-sequence buffer holds ~170 MB instead of ~700 MB (at seq_len 4096) and the
arrays handed downstream are freshly written.

The provenance of the buffered items is journaled: each draw appends the slot and the new
item's provenance table, and a state holds the journal's length
(:class:`~.shuffle_state.LazyGroups`), so taking one costs a few references however large the
buffer. A state is built into its blocks of ``BLOCK`` (4) slots, in groups of ``GROUP`` (64),
only when read (pickled or iterated), from the last built state and the changes since: a block
or group that did not change is the same object as in the state before. A dataloader worker
sends, after each batch, the journal's changes since the state before (a few slots and their
tables, :class:`~.shuffle_state.JournalDelta`), nothing built; the training process extends its
own journal with them, so a training loop that takes a state at every step and saves few pays
for the ones it saves, on either side. A journal longer than twice the buffer is built into a
new base (``too_long``: its memory is bounded, ~20,000 small tables for a 10,000-sequence
buffer). The journal, its blocks and groups, and the readers of a state's provenance are in
:mod:`torchdata_ext.nodes.shuffle_state`.

State keys: ``source`` (upstream state after the last pull), ``draws``, ``exhausted``, and
either ``prov_groups`` (format 3: a list of groups, each a list of blocks of slots, each a
pair ``(counts, rows)``: rows per item and the items' provenance rows ``[sum(counts), 5]``, in
the narrowest integer dtype that holds them) or ``items`` (items kept as they are). Two
earlier formats, never released and written only by the tests that check they still read, are
read too: ``prov_blocks`` (format 2: the blocks in one list) and ``prov_counts`` /
``prov_rows`` (format 1: all items concatenated). Resume guarantee: the rest of the stream is
identical.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.nodes.shuffle_state import (
    GROUP,
    Journal,
    LazyGroups,
    Snapshot,
    buffered_provenance,
    provenance_groups,
    standard_layout,
    too_long,
)
from torchdata_ext.order.walk import mix_seeds
from torchdata_ext.progress import Progress
from torchdata_ext.provenance import PROV_COLUMNS, remap_ids

__all__ = [
    "FILL_MODES",
    "ProvenanceItem",
    "ShuffleBuffer",
    "buffered_provenance",
    "provenance_groups",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
DRAW_TAG = 0x53485546
"""The tag of the draws: draw ``i`` picks slot ``mix_seed(seed, DRAW_TAG, i) % len(buffer)``."""
_DRAW_HASHES = 256  # draws whose slot hashes _draw_hash makes at once
FILL_MODES = ("stream", "full")
"""``ShuffleBuffer(fill=...)``: deliver while filling (``"stream"``) or fill first (``"full"``)."""


class ProvenanceItem:
    """A buffered item known only by its provenance table (``(k, 5)``, see
    :mod:`torchdata_ext.provenance`): what a restored buffer holds until the item is drawn,
    then ``rebuild(provenance)`` makes it. Build them with
    :meth:`ShuffleBuffer.items_from_provenance`."""

    __slots__ = ("provenance",)

    def __init__(self, provenance: np.ndarray) -> None:
        self.provenance = provenance

    def __repr__(self) -> str:
        return f"ProvenanceItem({self.provenance.tolist()!r})"


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
        fill: ``"stream"`` (default): deliver from the first draw, the buffer growing by one
            item per draw until it holds ``buffer_size``; ``"full"``: fill the buffer before
            the first draw. Restore with the mode the state was taken with (the stream after a
            restore during the fill depends on it).

    When the source ends (finite runs), the buffer drains: every buffered item is still
    delivered, in random order, then ``StopIteration``. A buffer restored holding more than
    ``buffer_size`` items (from a state of a larger buffer) drains to ``buffer_size`` the same
    way before it refills.
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
        fill: str = "stream",
    ) -> None:
        super().__init__()
        if fill not in FILL_MODES:
            raise ValueError(f"{fill=} must be one of {FILL_MODES}")
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
        self.fill = fill
        self._share_checked = False
        next_packed = getattr(source, "next_packed", None)
        materialize = getattr(source, "materialize", None)
        self._packed = callable(next_packed) and callable(materialize)
        self._pull: Callable[[], Any] = next_packed if self._packed else self._next_source  # type: ignore[assignment]
        self._out: Callable[[Any], T] = materialize if self._packed else _same  # type: ignore[assignment]
        # a drawn ProvenanceItem is made in the form the buffer holds (Pack: PackedSequence)
        held = getattr(source, "rebuild_packed", None)
        self._make = held if rebuild is None and self._packed and callable(held) else self._rebuild
        self._buf: list[Any] = []
        self._draws = 0
        self._hashes: tuple[int, list[int]] = (0, [])  # _draw_hash's table: first draw, hashes
        self._exhausted = False
        # the provenance of the buffered items for the states: the slots' changes since a
        # snapshot (see Journal), each state a prefix of it (LazyGroups), built when read
        self._prov_of: Callable[[Any], Any] | None | object = _UNDECIDED
        self._journal = Journal(None)
        self._last: LazyGroups | None = None  # the provenance of the last state

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._buf = []
        self._journal = Journal(None)
        self._last = None
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._draws = int(initial_state["draws"])
            self._exhausted = bool(initial_state["exhausted"])
            if "items" in initial_state:
                self._buf = list(initial_state["items"])
                for slot, item in enumerate(self._buf):
                    self._note(slot, item)
            else:
                self._buf = self._restored_items(initial_state)
                self._restore_journal(initial_state)
        else:
            self.source.reset(None)
            self._draws = 0
            self._exhausted = False

    def next(self) -> T:
        return self._out(self._draw())

    def _draw(self) -> Any:
        if too_long(self._journal, self.buffer_size):
            self._rebase()  # bounds its memory, states taken or not (a plain Loader takes none)
        buf = self._buf
        if not self._exhausted and len(buf) < self.buffer_size:
            if self.fill == "full":
                self._fill()
            else:
                self._grow()
        if not buf:
            raise StopIteration
        j = self._draw_hash(self._draws) % len(buf)
        self._draws += 1
        item = buf[j]
        if not self._exhausted and len(buf) <= self.buffer_size:
            try:
                buf[j] = self._pull()
                self._note(j, buf[j])
                return item if type(item) is not ProvenanceItem else self._made(item)
            except StopIteration:
                self._exhausted = True
        buf[j] = buf[-1]
        buf.pop()
        if j < len(buf):
            self._note(j, buf[j])
        return item if type(item) is not ProvenanceItem else self._made(item)

    def _draw_hash(self, draw: int) -> int:
        """``mix_seed(seed, DRAW_TAG, draw)``, which picks draw number ``draw``'s slot: taken
        from a table of the next ``_DRAW_HASHES`` draws' hashes, made at once in NumPy (one
        Python hash per draw was ~3% of the pipeline)."""
        base, table = self._hashes
        if not 0 <= draw - base < len(table):
            counters = np.arange(draw, draw + _DRAW_HASHES, dtype=np.int64)
            table = mix_seeds(self.seed, DRAW_TAG, counters).tolist()
            base = draw
            self._hashes = (base, table)
        return table[draw - base]

    def _made(self, item: ProvenanceItem) -> Any:
        """The item a :class:`ProvenanceItem` stands for, rebuilt from its provenance."""
        return self._make(item.provenance)  # type: ignore[misc]

    @staticmethod
    def items_from_provenance(tables: Iterable[np.ndarray]) -> list[ProvenanceItem]:
        """Buffer items known only by their provenance tables (``(k, 5)`` integer arrays, see
        :mod:`torchdata_ext.provenance`), each rebuilt (its documents read, and for text
        re-tokenized, again) only when it is drawn.

        What a restored buffer holds: its state's provenance (:func:`buffered_provenance`)
        made into these. To give a buffer rows it did not hold before (e.g. rows handed on by a
        rescale), write them into its state with :func:`provenance_groups`."""
        return [ProvenanceItem(np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS)) for t in tables]

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
        if self._buf and self._prov_of is not None and self._prov_of is not _UNDECIDED:
            journal, last = self._journal, self._last
            if last is not None and last.built and last.journal is journal:
                # the last state was read (a dataloader worker sends each): build on it
                journal = self._journal = journal.after(last)
            self._last = LazyGroups(journal, len(journal), len(self._buf))
            state["prov_groups"] = self._last
        else:
            state["items"] = [self._out(x) for x in self._buf]
        return state

    # -- helpers -------------------------------------------------------------------------------
    def _restore_journal(self, state: dict[str, Any]) -> None:
        """Start the journal from the restored state's own blocks and groups (format 3 or 2),
        so the states that follow share the blocks not drawn from since (a dataloader worker's
        first delta after a restore is then a few blocks, not the whole buffer)."""
        if not self._buf:
            return
        self._prov_of = self._provenance_getter(self._buf[0])
        groups: list[Any] = []
        if "prov_groups" in state:
            groups = list(state["prov_groups"])  # its groups, the same objects
        elif "prov_blocks" in state:  # format 2: no release wrote it; tests/test_shuffle.py does
            blocks = list(state["prov_blocks"])
            groups = [blocks[i : i + GROUP] for i in range(0, len(blocks), GROUP)]
        if groups and standard_layout(groups, len(self._buf)):
            self._journal = Journal(Snapshot(groups, len(self._buf)))
        else:  # format 1, or blocks of another size: journal every slot
            self._journal.slots.extend(range(len(self._buf)))
            self._journal.tables.extend(x.provenance for x in self._buf)

    def _rebase(self) -> None:
        """Build the journal into a new base of the buffer as it is now, so it lets go of the
        tables of items handed out (states taken before keep the journal they were given)."""
        journal = self._journal
        now = LazyGroups(journal, len(journal), len(self._buf))
        now.groups()
        self._journal = journal.after(now)

    def _grow(self) -> None:
        """Add one item from upstream (``fill="stream"``: one per draw until full)."""
        if not self._share_checked:
            self._share_checked = True
            self._check_share()
        try:
            item = self._pull()
        except StopIteration:
            self._exhausted = True
        else:
            self._buf.append(item)
            self._note(len(self._buf) - 1, item)

    def _fill(self) -> None:
        """Pull until the buffer is full or the source ends, reporting a long fill."""
        if not self._share_checked:
            self._share_checked = True
            self._check_share()
        buf = self._buf
        unit = "sequences" if self._packed else "items"
        with Progress(
            "filling the shuffle buffer (the first batch comes once it is full)", logger,
            total=self.buffer_size, unit=unit, bar=False, level=logging.WARNING,
        ) as progress:  # fmt: skip
            progress.done = len(buf)
            while not self._exhausted and len(buf) < self.buffer_size:
                try:
                    buf.append(self._pull())
                except StopIteration:
                    self._exhausted = True
                else:
                    self._note(len(buf) - 1, buf[-1])
                    progress.update()

    def _check_share(self) -> None:
        """Warn (once) when the buffer holds more items than this worker's share of the data."""
        share = self.worker_share() if callable(self.worker_share) else self.worker_share
        if share is None or self.buffer_size <= share:
            return
        logger.warning(
            "the shuffle buffer holds %d items but this worker's share of the data is only ~%d: "
            "%sitems of several epochs mix; use a buffer_size (shuffle_buffer) below that, "
            "or fewer workers",
            self.buffer_size,
            share,
            "the first batch waits until the buffer has read all of it (and more epochs), and "
            if self.fill == "full"
            else "",
        )

    def _next_source(self) -> T:
        return next(self.source)

    def _note(self, slot: int, item: Any) -> None:
        """Slot ``slot`` now holds ``item``: journal its provenance table for the states."""
        prov_of = self._prov_of
        if prov_of is _UNDECIDED:  # the first item tells how items carry provenance
            prov_of = self._prov_of = self._provenance_getter(item)
        if prov_of is not None:
            self._journal.slots.append(slot)
            self._journal.tables.append(prov_of(item))  # type: ignore[operator]

    def _provenance_getter(self, item: Any) -> Callable[[Any], Any] | None:
        """How to get an item's provenance table (None: items carry none, or there is no way
        to rebuild them: the state then keeps the items as they are)."""
        if self._rebuild is None:
            return None
        if type(item) is ProvenanceItem:
            return operator.attrgetter("provenance") if self._packed else self._provenance
        if isinstance(item, dict):
            return self._provenance if self.provenance_key in item else None
        if self._packed and hasattr(item, "provenance"):
            return operator.attrgetter("provenance")  # several times cheaper than _provenance
        return None

    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Document tokens held in the buffer, as ``(dataset, file, doc, start, stop)``; used to
        hand them on when rescaling (needs a source with ``dataset_names``, i.e. a Pack)."""
        names, tables = self.held_rows()
        return [
            (names[ds], f, d, start, start + length)
            for table in tables
            for ds, f, d, start, length in table.tolist()
            if ds >= 0 and length > 0
        ]

    def held_rows(self) -> tuple[list[str], list[np.ndarray]]:
        """The buffered items as rows to hand on whole when rescaling: the dataset names the
        provenance ids index, and each item's provenance table (BOS/EOS and pieces as the
        item holds them, so the new owner delivers exactly this row again)."""
        if not self._buf:
            return [], []
        names = getattr(self.source, "dataset_names", None)
        if names is None:
            raise ValueError(
                "cannot hand on shuffle-buffer contents: its source has no dataset_names "
                "(put the shuffle buffer on a Pack)"
            )
        return list(names), [np.asarray(self._provenance(x), np.int64) for x in self._buf]

    @staticmethod
    def state_with_rows(state: dict[str, Any], tables: Sequence[np.ndarray]) -> dict[str, Any]:
        """A copy of a fresh (empty) buffer ``state`` holding ``tables`` (provenance tables,
        ids in the state's Pack names) as its items: what a rescale gives a new worker. The
        items are rebuilt on restore like any buffered item; more than ``buffer_size`` of them
        drain first (each draw takes one without refilling) until the buffer is back to size.
        """
        if state.get("items"):
            raise ValueError("state_with_rows needs the state of an empty shuffle buffer")
        out = {k: v for k, v in state.items() if k != "items"}
        if not tables:
            out["items"] = []
            return out
        out["prov_groups"] = provenance_groups(tables)
        return out

    def _provenance(self, item: Any) -> np.ndarray:
        if isinstance(item, dict):
            return np.asarray(item[self.provenance_key])
        table = item.provenance
        return table if type(table) is np.ndarray else np.asarray(table)

    def _restored_items(self, state: dict[str, Any]) -> list[ProvenanceItem]:
        """A state's buffered items as :class:`ProvenanceItem` s (rebuilt when drawn)."""
        if self._rebuild is None:
            raise ValueError(
                "this shuffle buffer state holds provenance tables but the node has no way to "
                "rebuild items: pass rebuild=... or use a source with a rebuild() method"
            )
        counts, rows = buffered_provenance(state)
        saved = state[self.SOURCE_KEY]
        saved = saved.get("dataset_names") if isinstance(saved, dict) else None
        names = getattr(self.source, "dataset_names", None)
        if saved is not None and names is not None:  # ids by name: the Pack may order them anew
            rows = remap_ids(rows, saved, names)
        ends = np.cumsum(counts).tolist()
        return [ProvenanceItem(rows[a:b]) for a, b in zip([0, *ends], ends)]


_UNDECIDED = object()  # ShuffleBuffer._prov_of before the first item


def _same(item: T) -> T:
    return item
