"""A run of the mix is laid out as a slice of its block's stream.

The interleave emits runs of its sources' blocks (``cut_block``: pieces ``lo .. hi`` from
token ``skip`` of the first, and ``cut`` tokens of piece ``hi``). Pack's cursor lays each run
out by slicing the stream of the whole block, laid out once (``StreamCursor._slice``), and the
mix finds row ends and moves its row position in that stream's offsets
(``StreamCursor.span``, ``first_row_end``). These tests hold the slices to laying each run
out on its own, field by field, over random blocks (pieces that begin or end with the
BOS/EOS ids already, empty pieces, continuations and cuts) and every kind of specials.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.packed import Layout
from torchdata_ext.nodes.row_cuts import RunBlock, cut_block, first_row_end
from torchdata_ext.nodes.stream import StreamCursor
from torchdata_ext.nodes.stream_types import Specials, Stream

_SPECIALS = [(None, 0), (1, 2), (1, None), (None, None), (3, 3), (0, 0)]


def _block(lengths: list[int], starts: list[int], lasts: list[bool], seed: int) -> DocumentBlock:
    n = len(lengths)
    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return DocumentBlock(
        "d", rng.integers(0, 4, int(off[-1])).astype(np.int32), None, off,
        np.zeros(n, np.int32), np.arange(n, dtype=np.int64),
        np.array([starts[i] if lengths[i] else 0 for i in range(n)], np.int64),
        np.array(lasts[:n], bool),
    )  # fmt: skip


def _run(block: DocumentBlock, data: st.DataObject) -> tuple[int, int, int, int]:
    """A run as the mix cuts one: ``(lo, skip, hi, cut)`` with a token of a cut piece on
    each side of a cut."""
    n, lengths = len(block), block.lengths.tolist()
    lo = data.draw(st.integers(0, n - 1))
    skip = data.draw(st.integers(0, max(0, lengths[lo] - 1)))
    hi = data.draw(st.integers(lo + 1 if skip else lo, n))
    cut = 0
    if hi < n and lengths[hi] > 1 + (skip if hi == lo else 0):
        cut = data.draw(st.integers(0, lengths[hi] - 1))
        if hi == lo and cut <= skip:
            cut = 0
    if hi == lo and not cut:
        hi = lo + 1
    return lo, skip, hi, cut


def _cursor(specials: tuple[int | None, int | None]) -> StreamCursor:
    bos, eos = specials
    return StreamCursor(None, np.dtype(np.int32), Specials(bos, eos, None, None, 0))  # type: ignore[arg-type]


def _same_stream(got: Stream, want: Stream) -> None:
    names = [f.name for f in dataclasses.fields(Stream)] + ["rows", "row_off"]
    for name in names:
        if name in ("parent", "run_at", "_row_off", "_doc_ends", "block", "pre_state"):
            continue
        if name in ("own_rows", "own_row_off"):  # a slice takes them when asked for
            continue
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert a is not None and b is not None, (name, a, b)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), (name, a, b)
        else:
            assert a == b, (name, a, b)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    starts=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    lasts=st.lists(st.booleans(), min_size=8, max_size=8),
    specials=st.sampled_from(_SPECIALS),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_run_is_laid_out_as_a_slice_of_its_blocks_stream(
    lengths, starts, lasts, specials, seed, data
) -> None:
    """Pack's cursor lays a run out from its block's stream (``RUN_OF``): the stream equals
    laying the cut block out itself, field by field, with the same document runs; the run is
    tokens ``span`` of the block's stream; and the block's own units are ``units``."""
    block = _block(lengths, starts, lasts, seed)
    lo, skip, hi, cut = _run(block, data)
    cursor = _cursor(specials)
    layout = Layout(
        16, False, np.dtype(np.int32), Specials(specials[0], specials[1], None, None, 0)
    )
    cut_one = cut_block(block, lo, skip, hi, cut)
    want = cursor._expand(cut_one, None)
    out = RunBlock(block, lo, skip, hi, cut, block.offsets.tolist())  # what the mix emits
    assert (len(out), out.num_tokens) == (len(cut_one), cut_one.num_tokens)
    got = cursor._expand(out, None)
    span = cursor.span(block, lo, skip, hi, cut)
    if specials[0] is not None and specials[0] == specials[1]:  # open documents are followed
        assert span is None and cursor.own_layout(block) is None and got.parent is None
        return
    assert got.parent is not None and span is not None
    _same_stream(got, want)
    whole = cursor._expand(block, None)
    assert whole.tokens[span[0] : span[1]].tolist() == want.tokens.tolist()
    assert layout.runs(got) == layout.runs(want)
    size = len(want.tokens)
    for x in range(size):
        assert got.starts_with_literal(x) == want.starts_with_literal(x)
        y = data.draw(st.integers(x + 1, size))
        assert got.rows_between(x, y).tolist() == want.rows_between(x, y).tolist()
    for f in dataclasses.fields(DocumentBlock):  # the run's arrays, once read, are cut_block's
        a, b = getattr(out, f.name), getattr(cut_one, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), f.name
        else:
            assert a == b, f.name
    own, units = cursor.own_layout(block), cursor.units(block, peek=True)
    assert own is not None and own.units.off.tolist() == own.off == units.off.tolist()
    assert own.units.bos.tolist() == own.bos == units.bos.tolist() and units.pin_at is None
    assert own.tok == block.offsets.tolist()


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    lasts=st.lists(st.booleans(), min_size=8, max_size=8),
    specials=st.sampled_from([(None, 0), (1, 2), (1, None), (None, None)]),
    seed=st.integers(0, 2**16),
    capacity=st.integers(1, 7),
    fill=st.integers(0, 6),
    t0=st.integers(0, 30),
    r2=st.floats(0, 60),
    side=st.sampled_from(["left", "right"]),
    data=st.data(),
)
def test_row_ends_found_in_the_blocks_stream_are_those_of_the_rest(
    lengths, lasts, specials, seed, capacity, fill, t0, r2, side, data
) -> None:
    """The mix looks for the row end a run stops at in the whole block's stream (from the
    run's ``span``), instead of laying out the rest of the block: the cut found is the one
    the rest laid out on its own gives."""
    n = len(lengths)
    block = _block(lengths, [0] * 8, lasts, seed)
    cursor = _cursor(specials)
    lo = data.draw(st.integers(0, n - 1))
    skip = data.draw(st.integers(0, lengths[lo] - 1))
    end = data.draw(st.integers(lo, n - 1))
    stop = data.draw(st.integers(end + 1, n))
    fill %= capacity

    rest = cut_block(block, lo, skip, stop, 0)
    units = cursor.units(rest, peek=True)
    at = first_row_end(
        rest.offsets.tolist(), units.off.tolist(), units.bos.tolist(), units.pin_at, 0, 0,
        end - lo, len(rest), fill, capacity, t0, 1.0, r2, side,
    )  # fmt: skip
    want = None
    if at is not None:
        j, t = at
        want = (lo + j + 1, 0) if t == rest.lengths[j] else (lo + j, t + (skip if j == 0 else 0))
    own, span = cursor.own_layout(block), cursor.span(block, lo, skip, lo, 0)
    assert own is not None and span is not None
    at = first_row_end(
        own.tok, own.off, own.bos, None, span[0], own.tok[lo] + skip, end, stop,
        fill, capacity, t0, 1.0, r2, side,
    )  # fmt: skip
    got = None
    if at is not None:
        j, t = at
        got = (j + 1, 0) if t == block.lengths[j] else (j, t)
    assert got == want
