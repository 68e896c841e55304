"""The reader's state format: per-shard cursors as column arrays, and reading either format.

A :class:`~torchdata_ext.nodes.reader.ShardReader` state (format 2) holds its cursors as:

* ``cursors``: ``{"ids", "epoch", "pos", "offset", "skips"}``, one NumPy integer array per
  field over the copy's logical shards sorted by id (each in the narrowest integer dtype that
  holds its values). These are the cursors as they were when each shard was last left (a shard
  finished its epoch or delivered its handed-back pieces); the dict and its arrays are made
  again (copy-on-write, only the columns that changed) when one of them changes and never
  written after ``get_state`` returned them (read-only arrays), so a state delta skips them
  with one ``is`` test on most steps.
* ``active``: the cursor of the shard being read (it moves every step), a small dict
  ``{"shard", "epoch", "pos", "offset", "skips", "skipped_files", "skipped_docs",
  "returned"}`` that overrides that shard's columns; None when no shard is active.
* ``extras``: ``{str(shard_id): {...}}``, only for the shards that have them, the per-shard
  lists that are not fixed scalars: ``skipped_files`` (file numbers), ``skipped_docs``
  (``[file, doc]``) and ``returned`` (pieces ``[file, doc, start, stop]`` handed back by a
  rescale, delivered first).

Format 1 (``shards``: ``{str(shard_id): {"epoch", "pos", "offset", "skipped_files",
"skipped_docs", "skips", "returned"}}``) is still read everywhere: every consumer reads a state
through :func:`reader_cursors`, a uniform view of either format, and writes one with
:func:`cursor_state`. :func:`merge_reader_states` (rescaling: re-partitioning by shard id is an
array selection) lives here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "COLUMNS",
    "EXTRAS",
    "READ_FORMATS",
    "STATE_FORMAT",
    "ReaderCursors",
    "cursor_state",
    "merge_reader_states",
    "narrow",
    "reader_cursors",
]

STATE_FORMAT = 2
READ_FORMATS = (1, 2)
COLUMNS = ("epoch", "pos", "offset", "skips")
EXTRAS = ("skipped_files", "skipped_docs", "returned")
_CURSOR_KEYS = ("shards", "cursors", "extras", "active")
_INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))


def narrow(a: np.ndarray) -> np.ndarray:
    """``a`` (integers) in the narrowest signed integer dtype that holds its values, read-only."""
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    dt = next(t for t in _INT_DTYPES if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
    out = np.array(a, dt)  # always a copy: the caller's array stays its own
    out.flags.writeable = False
    return out


@dataclass
class Cursor:
    """One logical shard's place in its walk (the reader's working copy, mutable)."""

    epoch: int = 0
    pos: int = 0
    offset: int = 0
    skipped_files: list[int] = field(default_factory=list)
    skipped_docs: list[list[int]] = field(default_factory=list)
    skips: int = 0
    # pieces handed back after a rescale, delivered before the walk goes on:
    # [file, doc, start, stop] (stop -1: to the end of the document)
    returned: list[list[int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Every field, lists copied (a format 1 cursor, and the body of ``active``)."""
        return {
            "returned": [list(x) for x in self.returned],
            "epoch": self.epoch,
            "pos": self.pos,
            "offset": self.offset,
            "skipped_files": list(self.skipped_files),
            "skipped_docs": [list(x) for x in self.skipped_docs],
            "skips": self.skips,
        }

    def extras(self) -> dict[str, Any]:
        """The non-empty per-shard lists, copied (an ``extras`` entry; empty: none)."""
        d = self.as_dict()
        return {k: d[k] for k in EXTRAS if d[k]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cursor:
        return cls(
            int(d["epoch"]),
            int(d["pos"]),
            int(d["offset"]),
            [int(x) for x in d.get("skipped_files", [])],
            [[int(a), int(b)] for a, b in d.get("skipped_docs", [])],
            int(d["skips"]),
            [[int(v) for v in x] for x in d.get("returned", [])],
        )


@dataclass
class ReaderCursors:
    """Every cursor of a reader state, whatever its format: one row per logical shard.

    Attributes:
        ids: the logical shard ids, sorted (int64).
        epoch: per shard, its epoch (int64, as the columns below).
        pos: per shard, the walk positions finished in its epoch (documents).
        offset: per shard, the tokens of the next document already delivered.
        skips: per shard, documents skipped by ``on_error="skip"`` (all epochs).
        extras: ``{shard_id: {"skipped_files"?, "skipped_docs"?, "returned"?}}``, only the
            shards with non-empty lists, only those lists.

    The arrays and lists are the view's own (writable copies); a state never shares them.
    """

    ids: np.ndarray
    epoch: np.ndarray
    pos: np.ndarray
    offset: np.ndarray
    skips: np.ndarray
    extras: dict[int, dict[str, Any]]

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def fresh(cls, ids: Sequence[int] | np.ndarray) -> ReaderCursors:
        """Cursors at the start (epoch 0, position 0) for shards ``ids`` (sorted)."""
        arr = np.asarray(ids, np.int64)
        return _cursors(arr, [np.zeros(len(arr), np.int64) for _ in COLUMNS], {})

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (one of :data:`COLUMNS` or ``"ids"``)."""
        return getattr(self, name)

    def rows(self, shards: np.ndarray) -> np.ndarray:
        """The row of each of ``shards``; -1 for those not in the view."""
        shards = np.asarray(shards, np.int64)
        i = np.searchsorted(self.ids, shards)
        i = np.minimum(i, max(len(self.ids) - 1, 0))
        ok = (self.ids[i] == shards) if len(self.ids) else np.zeros(len(shards), bool)
        return np.where(ok, i, -1)

    def cursor(self, row: int) -> Cursor:
        """A working :class:`Cursor` for row ``row`` (its lists copied)."""
        ex = self.extras.get(int(self.ids[row]), {})
        return Cursor.from_dict(
            {
                **{k: int(self.column(k)[row]) for k in COLUMNS},
                **ex,
                "returned": ex.get("returned", []),
            }
        )

    def take(self, rows: np.ndarray) -> ReaderCursors:
        """The view of rows ``rows`` (ascending), e.g. the shards a new worker owns."""
        rows = np.asarray(rows, np.int64)
        ids = self.ids[rows]
        keep = set(ids.tolist())
        return _cursors(
            ids,
            [self.column(k)[rows] for k in COLUMNS],
            {s: e for s, e in self.extras.items() if s in keep},
        )

    @classmethod
    def concat(cls, parts: Sequence[ReaderCursors]) -> ReaderCursors:
        """The rows of all ``parts``, sorted by shard id.

        Raises:
            ValueError: a shard id appears twice.
        """
        ids = np.concatenate([p.ids for p in parts])
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        dup = np.flatnonzero(ids[1:] == ids[:-1])
        if dup.size:
            raise ValueError(
                f"logical shard {int(ids[dup[0]])} appears in two states; pass each copy once"
            )
        extras: dict[int, dict[str, Any]] = {}
        for p in parts:
            extras.update(p.extras)
        cols = (np.concatenate([p.column(k) for p in parts])[order] for k in COLUMNS)
        return _cursors(ids, list(cols), extras)


def _cursors(
    ids: np.ndarray, cols: Sequence[np.ndarray], extras: dict[int, dict[str, Any]]
) -> ReaderCursors:
    """A view from its ids, its :data:`COLUMNS` in order and its extras."""
    epoch, pos, offset, skips = cols
    return ReaderCursors(ids, epoch, pos, offset, skips, extras)


def _copy_extras(d: dict[str, Any]) -> dict[str, Any]:
    """The non-empty :data:`EXTRAS` lists of ``d``, copied (inner lists too): the view's own."""
    return {e: [x if isinstance(x, int) else list(x) for x in d[e]] for e in EXTRAS if d.get(e)}


def reader_cursors(state: dict[str, Any]) -> ReaderCursors:
    """The cursors of a reader state of either format (1 or 2), as one uniform view.

    Args:
        state: a :class:`~torchdata_ext.nodes.reader.ShardReader` state (``get_state``, a
            checkpoint's, or :func:`merge_reader_states`').

    Raises:
        ValueError: ``state`` is no reader state or of an unknown format.
    """
    if not isinstance(state, dict) or not ("shards" in state or "cursors" in state):
        raise ValueError("not a ShardReader state: it has neither 'cursors' nor 'shards'")
    fmt = state.get("format")
    if fmt not in READ_FORMATS:
        raise ValueError(
            f"reader state format {fmt!r} is not supported (this version reads formats "
            f"{', '.join(map(str, READ_FORMATS))}); read it with the version that wrote it"
        )
    if fmt == 1:  # no release wrote it; tests/test_reader_state.py writes it to check it reads
        items = sorted((int(k), v) for k, v in state["shards"].items())
        n = len(items)
        ids = np.fromiter((k for k, _ in items), np.int64, n)
        cols = [np.fromiter((int(v[c]) for _, v in items), np.int64, n) for c in COLUMNS]
        extras = {}
        for sid, v in items:
            ex = _copy_extras(v)
            if ex:
                extras[sid] = ex
        return _cursors(ids, cols, extras)
    c = state["cursors"]
    view = _cursors(
        np.array(c["ids"], np.int64),
        [np.array(c[k], np.int64) for k in COLUMNS],
        {int(k): _copy_extras(v) for k, v in state.get("extras", {}).items()},
    )
    active = state.get("active")
    if active is not None:
        sid = int(active["shard"])
        row = int(view.rows(np.array([sid]))[0])
        if row < 0:
            raise ValueError(f"the reader state's active shard {sid} is not among its cursors")
        for k in COLUMNS:
            view.column(k)[row] = int(active[k])
        ex = Cursor.from_dict(active).extras()
        view.extras.pop(sid, None)
        if ex:
            view.extras[sid] = ex
    return view


def cursor_state(header: dict[str, Any], cursors: ReaderCursors) -> dict[str, Any]:
    """A format 2 reader state: ``header``'s keys (dataset, fingerprint, seed...; a state of
    either format) with ``cursors`` (no shard active)."""
    out = {k: v for k, v in header.items() if k not in _CURSOR_KEYS}
    out["format"] = STATE_FORMAT
    out["cursors"] = {"ids": narrow(cursors.ids), **{k: narrow(cursors.column(k)) for k in COLUMNS}}
    out["extras"] = {str(s): cursors.extras[s] for s in sorted(cursors.extras)}
    out["active"] = None
    return out


def merge_reader_states(
    states: Sequence[dict[str, Any]], *, complete: bool = True
) -> dict[str, Any]:
    """Merge the states of all copies of one reader (every rank and worker) into one.

    The merged state restores on any number of ranks x workers: each new copy takes the
    cursors of the logical shards it owns under the new partition. States of format 1 and 2
    can be mixed; the result is format 2.

    Args:
        states: reader states of one dataset, each covering the shards of one copy.
        complete: require every logical shard to be covered (False: a rescale merges only
            the old copies a new one needs).

    Raises:
        ValueError: the states come from different datasets, seeds or shard counts, a shard
            appears twice, or (with ``complete``) a shard is missing.
    """
    if not states:
        raise ValueError("merge_reader_states needs at least one state")
    first = states[0]
    for i, st in enumerate(states):
        for key in ("fingerprint", "seed", "n_logical_shards", "split"):
            if st.get(key) != first.get(key):
                raise ValueError(
                    f"state {i} has {key}={st.get(key)!r} but state 0 has {first.get(key)!r}; "
                    "only states of the same reader can be merged"
                )
    merged = ReaderCursors.concat([reader_cursors(st) for st in states])
    n = int(first["n_logical_shards"])
    if complete and len(merged) != n:
        missing = np.setdiff1d(np.arange(n), merged.ids)
        raise ValueError(
            f"the states cover {len(merged)} of {n} logical shards (missing e.g. "
            f"{missing[:5].tolist()}); pass the states of all ranks and workers"
        )
    return cursor_state(first, merged)
