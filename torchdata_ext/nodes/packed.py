"""Pack's output side: a packed line's layout, from parts of streams to the output dict.

Shared by both packing strategies (:mod:`.concat_pad`, :mod:`.best_fit`). A strategy picks
the parts of a sequence (stream tokens ``a .. b``, see :mod:`.stream`); :meth:`Layout.emit`
lays them between the line specials, pads, and cuts the line into document runs, giving a
small :class:`PackedSequence`::

    parts   |B a a a E| |b b|        line  |bol B a a a E b b P P eol|
    runs     bol | B a a a E | b b | P P | eol      ids -1 | 0 | 1 | -1 | -1

:meth:`Layout.materialize` spreads the runs over the tokens (``position_ids`` count from each
run's start) into the output dict, :meth:`Layout.materialize_batch_into` does it for a whole
batch, and :meth:`Layout.assemble` makes the same dict from tokens and provenance alone (what
``Pack.rebuild`` uses).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from torchdata_ext.batch import layout_runs, loss_mask
from torchdata_ext.nodes.stream_types import Specials, Stream, StreamPart
from torchdata_ext.provenance import LITERAL, PAD, literal_code

__all__ = ["PackedSequence"]


class PackedSequence(NamedTuple):
    """A packed sequence before its layout is spread over its tokens.

    What :meth:`Pack.next_packed <torchdata_ext.nodes.pack.Pack.next_packed>` gives; about a
    quarter of the memory of the output dict, which ``Pack.materialize`` makes.

    Attributes:
        tokens: the packed tokens (``seq_len``, or ``seq_len + 1`` with ``shift``).
        provenance: the ``(k, 5)`` provenance table (the output dict's ``provenance``).
        cuts: where each run of the layout starts (positions count from 0 there).
        ids: the document id of each run (-1 for line specials and padding).
        pad: the padding's token range ``(lo, hi)`` (``lo == hi``: none).
    """

    tokens: np.ndarray
    provenance: np.ndarray
    cuts: list[int]
    ids: list[int]
    pad: tuple[int, int]


class Layout:
    """How Pack lays out a line of ``seq_len`` tokens (``seq_len + 1`` with ``shift``).

    Args:
        seq_len: tokens per output sequence.
        shift: pack one more token, for ``labels``.
        dtype: the integer dtype of the packed tokens.
        specials: the token ids to place (a run starts at an added BOS; lines begin with
            ``bol`` and end with ``eol``, padding before ``eol``).

    Attributes:
        packed_len: tokens packed per line.
        capacity: room for document tokens in a line (``packed_len`` less the line specials;
            may be < 1, which Pack refuses).
    """

    def __init__(self, seq_len: int, shift: bool, dtype: np.dtype, specials: Specials) -> None:
        self.seq_len = seq_len
        self.shift = shift
        self.dtype = dtype
        self.bol_token, self.eol_token, self.pad_token = specials.bol, specials.eol, specials.pad
        self.packed_len = seq_len + int(shift)
        self.capacity = self.packed_len - (specials.bol is not None) - (specials.eol is not None)
        self._bos_role = specials.bos_role  # token id of an added BOS
        self._arange = np.arange(self.packed_len, dtype=np.int32)
        self._batch_arange = self._arange  # grown to a batch's tokens on first use

    @property
    def output_keys(self) -> tuple[str, ...]:
        """The keys of the output dict."""
        if self.shift:
            return (
                "input_ids",
                "labels",
                "position_ids",
                "document_ids",
                "loss_mask",
                "provenance",
            )
        return ("input_ids", "position_ids", "document_ids", "loss_mask", "provenance")

    # -- packing -------------------------------------------------------------------------------
    def emit(self, parts: list[StreamPart]) -> PackedSequence:
        """The sequence made of ``parts`` (then padding and the line specials).

        Materialized, equal to :meth:`assemble` ``(tokens, provenance)`` (which ``Pack.rebuild``
        uses), but the layout comes from the streams' document runs (:meth:`runs`) instead of
        :meth:`layout`: inside a part a row continues the row before it exactly as in its
        whole stream, so only a part's first row needs :meth:`layout`'s rule, against the last
        row of the part before (the first part always starts a run). The sequence is cut into
        runs, each with the position its counting starts from and its document id (-1 for the
        line specials and the padding), which :meth:`materialize` spreads over the tokens.
        """
        size = self.packed_len
        if len(parts) == 1 and self.bol_token is None and self.eol_token is None:
            s, a, b = parts[0]
            if b - a == size:  # the usual row: one part of one stream, no line specials
                return self._one_part(s, a, b)
        x = np.empty(size, self.dtype)
        cuts: list[int] = []  # where each run starts; its positions count from there
        ids: list[int] = []  # its document id
        pieces: list[np.ndarray] = []
        p = 0
        if self.bol_token is not None:
            x[0] = self.bol_token
            cuts.append(0)
            ids.append(-1)
            pieces.append(np.array([[LITERAL, self.bol_token, 0, 0, 1]], np.int64))
            p = 1
        first_cut = True  # whether the next part's first row starts a run
        doc = 0
        for part in parts:
            s, a, b = _in_whole(*part)
            run_at = self.runs(s)
            x[p : p + b - a] = s.tokens[a:b]
            rows = s.rows_between(a, b)
            if pieces and not first_cut:
                first_cut = not self._continues(pieces[-1][-1].tolist(), rows[0].tolist())
            if first_cut:
                cuts.append(p)
                ids.append(doc)
                doc += 1
            lo = bisect.bisect_right(run_at, a)  # runs starting inside a .. b
            hi = bisect.bisect_left(run_at, b, lo)
            if hi > lo:
                shift = p - a
                cuts.extend([r + shift for r in run_at[lo:hi]])
                ids.extend(range(doc, doc + hi - lo))
                doc += hi - lo
            pieces.append(rows)
            p += b - a
            first_cut = False
        end = size - (self.eol_token is not None)
        if end > p:
            x[p:end] = self.pad_token
            cuts.append(p)
            ids.append(-1)
            pieces.append(np.array([[PAD, self.pad_token, 0, 0, end - p]], np.int64))
        if end < size:
            x[-1] = self.eol_token
            cuts.append(end)
            ids.append(-1)
            pieces.append(np.array([[LITERAL, self.eol_token, 0, 0, 1]], np.int64))
        rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return PackedSequence(x, rows, cuts, ids, (p, max(end, p)))

    def _one_part(self, s: Stream, a: int, b: int) -> PackedSequence:
        """:meth:`emit` of a full row that is tokens ``a .. b`` of one stream (no padding, no
        line specials): its runs are the stream's runs inside it, the first starting at 0."""
        s, a, b = _in_whole(s, a, b)
        run_at = self.runs(s)
        lo = bisect.bisect_right(run_at, a)
        hi = bisect.bisect_left(run_at, b, lo)
        cuts = [0, *[r - a for r in run_at[lo:hi]]]
        size = b - a
        return PackedSequence(
            s.tokens[a:b].copy(), s.rows_between(a, b), cuts, list(range(len(cuts))), (size, size)
        )

    def _continues(self, prev: list[int], cur: list[int]) -> bool:
        """:meth:`layout`'s rule for two content rows: whether ``cur`` continues the run of
        ``prev`` (an EOS does, unless it names another document than ``prev``'s: a lone EOS a
        rescale handed back; a document row does after a BOS or the contiguous previous piece
        of its document; a BOS never does)."""
        bos = self._bos_role
        if bos is not None and cur[0] == LITERAL and cur[1] == bos:
            return False
        if cur[0] < 0:
            return bool(_same_owner(np.array([prev]), np.array([cur]))[0])
        if bos is not None and prev[0] == LITERAL and prev[1] == bos:
            return True
        return prev[0] >= 0 and prev[:3] == cur[:3] and cur[3] == prev[3] + prev[4]

    def runs(self, s: Stream) -> list[int]:
        """Stream token offsets where the document runs of stream ``s`` start (increasing,
        from 0), with :meth:`layout`'s rule (the stream read as one piece). A stream cut from
        a whole block's (``s.parent``) takes the whole stream's runs inside it: the rule
        compares each row with the one before, and those rows are the same there."""
        if s.run_at is None and s.parent is not None:
            whole, a = s.parent
            run_at = self.runs(whole)
            b = a + len(s.tokens)
            i = bisect.bisect_right(run_at, a)
            inside = [r - a for r in run_at[i : bisect.bisect_left(run_at, b, i)]]
            s.run_at = [0, *inside] if b > a else []
        if s.run_at is None:
            rows = s.rows
            ds = rows[:, 0]
            is_data = ds >= 0
            prev, cur = rows[:-1], rows[1:]
            same_doc = (
                is_data[:-1]
                & (cur[:, 0] == prev[:, 0])
                & (cur[:, 1] == prev[:, 1])
                & (cur[:, 2] == prev[:, 2])
                & (cur[:, 3] == prev[:, 3] + prev[:, 4])
            )
            starts = np.ones(len(rows), bool)
            lone = ~is_data[1:] & ~_same_owner(prev, cur)  # an EOS of another document
            if self._bos_role is not None:
                is_bos = (ds == LITERAL) & (rows[:, 1] == self._bos_role)
                starts[1:] = is_bos[1:] | (is_data[1:] & ~is_bos[:-1] & ~same_doc) | lone
            else:
                starts[1:] = (is_data[1:] & ~same_doc) | lone
            s.run_at = s.row_off[:-1][starts].tolist()
        return s.run_at

    # -- output --------------------------------------------------------------------------------
    def materialize(self, item: PackedSequence) -> dict[str, np.ndarray]:
        """The output dict of ``item``: its runs spread over its tokens."""
        x, rows, cuts, ids, (lo, hi) = item
        size = len(x)
        lens = [b - a for a, b in zip(cuts, cuts[1:])]
        lens.append(size - cuts[-1])
        pos = np.array(cuts, np.int32).repeat(lens)
        np.subtract(self._arange, pos, out=pos)
        doc = np.array(ids, np.int32).repeat(lens)
        if not self.shift:
            real = np.empty(size, bool)
            real.fill(True)
            real[lo:hi] = False
            return {
                "input_ids": x,
                "position_ids": pos,
                "document_ids": doc,
                "loss_mask": real,
                "provenance": rows,
            }
        mask = np.empty(size - 1, bool)
        mask.fill(True)
        if hi > lo:  # the input or the label is padding
            mask[max(lo - 1, 0) : hi] = False
        return {
            "input_ids": x[:-1],
            "labels": x[1:].copy(),
            "position_ids": pos[:-1],
            "document_ids": doc[:-1],
            "loss_mask": mask,
            "provenance": rows,
        }

    def materialize_batch_into(
        self, items: Sequence[PackedSequence], out: dict[str, np.ndarray]
    ) -> None:
        """Write ``materialize(items[i])`` into row ``i`` of each ``[len(items), seq_len]`` array
        in ``out`` (see ``Pack.materialize_batch_into``)."""
        n = self.seq_len
        size = self.packed_len
        bad = [k for k in out if k not in self.output_keys or k == "provenance"]
        if bad:
            raise KeyError(f"a Pack sequence has no {bad[0]!r}; its keys: {self.output_keys}")
        if not items:
            return
        if "input_ids" in out:
            dest = out["input_ids"]
            for i, item in enumerate(items):
                dest[i] = item.tokens[:n]
        if "labels" in out:
            dest = out["labels"]
            for i, item in enumerate(items):
                dest[i] = item.tokens[1:]
        if "position_ids" in out or "document_ids" in out:
            # every item's runs laid end to end: run r covers flat tokens cuts[r] .. cuts[r + 1]
            cuts: list[int] = []
            ids: list[int] = []
            for i, item in enumerate(items):
                base = i * size
                cuts.extend([c + base for c in item.cuts])
                ids.extend(item.ids)
            total = len(items) * size
            if len(self._batch_arange) < total:
                self._batch_arange = np.arange(total, dtype=np.int32)
            layout_runs(
                np.array(cuts, np.int32),
                np.array(ids, np.int32),
                len(items),
                size,
                n,
                out,
                self._batch_arange,
            )
        if "loss_mask" in out:
            out["loss_mask"][...] = loss_mask(
                np.array([item.pad for item in items], np.int64).reshape(-1, 2), n, self.shift
            )

    # -- from provenance -----------------------------------------------------------------------
    def assemble(self, x: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The output dict of packed tokens ``x`` and their provenance ``rows``."""
        pos, doc_ids, real = self.layout(rows)
        if not self.shift:
            return {
                "input_ids": x,
                "position_ids": pos,
                "document_ids": doc_ids,
                "loss_mask": real,
                "provenance": rows,
            }
        return {
            "input_ids": x[:-1],
            "labels": x[1:].copy(),
            "position_ids": pos[:-1],
            "document_ids": doc_ids[:-1],
            "loss_mask": real[:-1] & real[1:],
            "provenance": rows,
        }

    def packed(self, x: np.ndarray, rows: np.ndarray) -> PackedSequence:
        """The :class:`PackedSequence` of packed tokens ``x`` and their provenance ``rows``
        (what :meth:`emit` gave for them: :meth:`materialize` of it is :meth:`assemble`)."""
        pos, doc_ids, real = self.layout(rows)
        cuts = np.flatnonzero(pos == 0)  # every run's positions count from 0 at its start
        pad = np.flatnonzero(~real)
        size = len(x)
        span = (int(pad[0]), int(pad[-1]) + 1) if len(pad) else (size, size)
        return PackedSequence(x, rows, cuts.tolist(), doc_ids[cuts].tolist(), span)

    def layout(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Position ids, document ids and the not-padding mask, from provenance rows only.

        Rows between the line specials and outside padding are document content. A content
        row starts a new document run unless it continues the previous content row: an EOS
        always continues, a document row continues a BOS or the contiguous previous piece of
        the same document. The first content row always starts a run.
        """
        ds, lens = rows[:, 0], rows[:, 4]
        content = ds != PAD
        if self.bol_token is not None:
            content[0] = False
        if self.eol_token is not None:
            content[-1] = False
        is_data = ds >= 0
        if self._bos_role is not None:
            is_bos = content & (ds == LITERAL) & (rows[:, 1] == self._bos_role)
        else:
            is_bos = np.zeros(len(rows), bool)
        prev, cur = rows[:-1], rows[1:]
        same_doc = (
            is_data[:-1]
            & (cur[:, :3] == prev[:, :3]).all(axis=1)
            & (cur[:, 3] == prev[:, 3] + prev[:, 4])
        )
        eos_goes_on = ~is_data[1:] & _same_owner(prev, cur)
        continues = content[:-1] & ~is_bos[1:] & (eos_goes_on | is_bos[:-1] | same_doc)
        starts = content.copy()
        starts[1:] &= ~continues
        row_off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=row_off[1:])
        base = np.where(starts | ~content, row_off[:-1], 0).astype(np.int32)
        np.maximum.accumulate(base, out=base)
        doc_row = np.where(content, starts.cumsum(dtype=np.int32) - 1, -1).astype(np.int32)
        pos = self._arange - base.repeat(lens)
        return pos, doc_row.repeat(lens), (ds != PAD).repeat(lens)


def _same_owner(prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Per pair of provenance rows, for ``cur`` a BOS/EOS row: whether it names the document
    of ``prev`` (a document row, or a BOS/EOS row naming one), or names none (written before
    literals were named, or a line special)."""
    code = np.where(prev[:, 0] >= 0, literal_code(prev[:, 0], prev[:, 1]), prev[:, 3])
    return (cur[:, 3] >= 0) | ((code == cur[:, 3]) & (prev[:, 2] == cur[:, 2]))


def _in_whole(s: Stream, a: int, b: int) -> StreamPart:
    """Tokens ``a .. b`` of stream ``s`` as the same tokens of its whole block's stream: a
    run's stream is tokens ``at ..`` of its parent's, with the same tokens, rows and runs."""
    while s.parent is not None:
        s, at = s.parent
        a, b = a + at, b + at
    return s, a, b
