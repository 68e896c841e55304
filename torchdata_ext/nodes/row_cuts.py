"""Where the mix may cut a document: Pack's row ends in the mix's own output (concat mode).

:class:`~torchdata_ext.nodes.interleave.Interleave` in ``"tokens"`` mode mirrors the cursor of
the ``concat`` Pack it feeds (:meth:`~torchdata_ext.nodes.stream.StreamCursor.units`), so it
knows how many tokens of the current row its output has filled. These pure functions cut a
block at a token offset, find the row ends a run may stop at, and move the row position on::

    stream  |B a a a a a a a a a a a a|  ...      capacity 5, fill 2 before the block
    rows        ^ end   ^ end     ^ end            a run may stop at a row end inside a, and
                                                   the rest of a starts the next row later

A row end between a document's BOS and its first token, or between its last token and its
EOS, is no place to cut (a piece cannot be split from its special); a cut leaves at least one
token of the document on each side. A unit Pack must start a row with (``Units.pin_at``: the
rest of a document a rescale handed back, or one whose BOS was delivered before it) ends the
row before it, padded, and the rows after it are counted from it, so the rest of a handed-back
document is cut at row ends like any other.
"""

from __future__ import annotations

import bisect
from typing import Any

from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.stream_types import Units

__all__ = ["RunBlock", "cut_block", "fill_after", "first_row_end"]

RUN_OF = "_stream_run_of"
"""The key under which a block cut from another (a run of the mix) keeps ``(the other block,
lo, a, hi, b)`` of :func:`cut_block` in its ``__dict__``, so Pack's cursor slices the other
block's stream instead of laying the run out (see :mod:`~torchdata_ext.nodes.stream`)."""

_CUT_FIELDS = ("tokens", "texts", "offsets", "file", "doc", "start", "last")


def cut_block(block: DocumentBlock, lo: int, a: int, hi: int, b: int) -> DocumentBlock:
    """Pieces ``lo .. hi`` of ``block`` from token ``a`` of piece ``lo`` on, and tokens ``0 ..
    b`` of piece ``hi`` (none when ``b`` is 0), sharing ``block``'s tokens (zero-copy)."""
    if not a and not b:
        return block.select(lo, hi)
    end = hi + 1 if b else hi  # the pieces: lo .. end
    assert block.tokens is not None, "only token blocks are cut inside a document"
    base = int(block.offsets[lo])
    off = block.offsets[lo : end + 1] - base
    start, last = block.start[lo:end].copy(), block.last[lo:end].copy()
    if b:  # the last piece ends inside its document
        off[-1] = off[-2] + b
        last[-1] = False
    if a:  # the first piece begins where an earlier run cut it
        off[1:] -= a
        start[0] += a
    tokens = block.tokens[base + a : base + a + int(off[-1])]
    stop = None if block.stop is None else block.stop[lo:end]
    return DocumentBlock(  # one block built, without dataclasses.replace (a hot path)
        block.dataset, tokens, None, off, block.file[lo:end], block.doc[lo:end], start, last,
        block.shard, block.epoch, stop,
    )  # fmt: skip


class RunBlock(DocumentBlock):
    """``cut_block(block, lo, a, hi, b)`` whose arrays are built only when first read.

    Pack's cursor lays a run of the mix out by slicing the stream of the whole ``block``
    (:data:`RUN_OF`), so on that path the run's own offsets, tokens and provenance arrays are
    never looked at; anything else that reads them (a budget, a hand-back, ``==``) gets exactly
    :func:`cut_block`'s, made then. ``len`` and :attr:`num_tokens` come from ``tok``, the
    block's token offsets as a list (:func:`~torchdata_ext.nodes.stream.token_offsets`).
    """

    def __init__(  # noqa: D107 - the class docstring says it
        self, block: DocumentBlock, lo: int, a: int, hi: int, b: int, tok: list[int]
    ) -> None:
        d = self.__dict__
        d["dataset"], d["shard"], d["epoch"] = block.dataset, block.shard, block.epoch
        d["stop"] = None if block.stop is None else block.stop[lo : hi + 1 if b else hi]
        d[RUN_OF] = (block, lo, a, hi, b)
        d["_pieces"] = hi - lo + (1 if b else 0)
        d["_tokens"] = (tok[hi] + b if b else tok[hi]) - tok[lo] - a

    def __getattr__(self, name: str) -> Any:
        if name not in _CUT_FIELDS:
            raise AttributeError(name)
        cut = cut_block(*self.__dict__[RUN_OF])
        for field in _CUT_FIELDS:
            self.__dict__[field] = getattr(cut, field)
        return self.__dict__[name]

    def __len__(self) -> int:
        return int(self.__dict__["_pieces"])

    @property
    def num_tokens(self) -> int:
        return int(self.__dict__["_tokens"])


def fill_after(units: Units, fill: int, capacity: int) -> int:
    """The row position (tokens of the current row) after Pack lays out ``units`` from
    ``fill`` on; a unit that must start a row ends the one before, padded."""
    at = 0
    for pin in units.pin_at or ():
        fill, at = 0, pin
    return (fill + int(units.off[-1]) - at) % capacity


def first_row_end(
    offsets: list[int],
    unit_off: list[int],
    bos: list[int],
    pins: list[int] | None,
    start: int,
    base: int,
    j0: int,
    stop: int,
    fill: int,
    capacity: int,
    t0: int,
    weight: float,
    r2: float,
    side: Any,
) -> tuple[int, int] | None:
    """The first row end of a run where the mix's rule stops, as ``(piece, tokens of it before
    the cut)`` (the piece's length when the cut is after the piece and its EOS).

    The run is a block's stream from stream offset ``start`` on (at row position ``fill``),
    and from the block's token ``base`` on; the block's pieces are at token ``offsets``, and
    laid out as units at stream offsets ``unit_off`` with ``bos`` (1: a BOS placed before the
    piece) and ``pins`` (units that start a row: from one on, rows are counted from its
    offset; None: none), as :class:`~torchdata_ext.nodes.stream_types.Units` has them. Row
    ends are looked for in pieces ``j0 .. stop``. Inside piece ``j0`` the rule stops where the
    source's ratio ``(t0 + tokens of the run) / weight`` passes ``r2`` (``side`` as
    ``numpy.searchsorted``'s); after it, at the first row end. None: no row end. Python lists
    and ints: a piece holds 0-2 row ends here, too few for NumPy's per-call cost (a long
    document's many are bisected)."""
    pins = pins or []
    origin = start  # the row position of stream offset x is (fill + x - origin) % capacity
    for j in range(j0, stop):
        p = bisect.bisect_right(pins, unit_off[j]) if pins else 0
        if p:  # the rows from the last pin at or before this unit start at the pin
            fill, origin = 0, pins[p - 1]
        length = offsets[j + 1] - offsets[j]
        lead = unit_off[j] + bos[j]  # the stream offset of the piece's token 0
        first = max(lead, start)  # of its first token in the run
        at = first + 1 + (origin - fill - first - 1) % capacity  # the first row end after a token
        inside = range(at, lead + length, capacity)  # the row ends inside it
        after = unit_off[j + 1]  # after the piece (and its EOS)
        k = len(inside)
        count = k + ((fill + after - origin) % capacity == 0)  # and the one after it
        if not count:
            continue
        i = 0
        if j == j0:  # inside the rule's last piece: where the rule stops (a bisect on the
            taken = offsets[j] - base + t0  # ratios, which grow with the row end: a long
            # document holds many, and each run of it would otherwise compute them all)
            i = (bisect.bisect_right if side == "right" else bisect.bisect_left)(
                range(count),
                r2,
                key=lambda x: (
                    (min((inside[x] if x < k else after) - lead, length) + taken) / weight
                ),
            )
            if i == count:
                continue
        if i == k:
            return j, length
        return j, inside[i] - lead
    return None
