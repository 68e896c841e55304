"""Pack's parts: the best-fit placement as a pure function, the documented examples of the
strategy modules, and the import paths that stay on ``torchdata_ext.nodes.pack``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from harness import run
from test_pack import ListSource

from torchdata_ext.nodes import packed as _packed
from torchdata_ext.nodes.best_fit import _place
from torchdata_ext.nodes.pack import Pack, PackedSequence


def reference_place(sizes: list[int], cap: int) -> list[int]:
    """Best fit by scanning every bin: the fullest that fits, the lowest id on ties."""
    room: list[int] = []
    out = []
    for size in sizes:
        fits = [k for k, r in enumerate(room) if r >= size]
        if fits:
            k = min(fits, key=lambda k: (room[k], k))
        else:
            k = len(room)
            room.append(cap)
        room[k] -= size
        out.append(k)
    return out


@pytest.mark.parametrize("cap", [1, 2, 5, 8])
def test_place_is_best_fit_over_all_short_size_lists(cap) -> None:
    for n in range(1, 6):
        for sizes in itertools.product(range(1, cap + 1), repeat=n):
            assert _place(list(sizes), cap) == reference_place(list(sizes), cap), sizes


def test_place_matches_the_reference_on_long_random_lists() -> None:
    rng = np.random.default_rng(0)
    for cap in (16, 100, 4096):
        sizes = rng.integers(1, cap + 1, 2000).tolist()
        assert _place(sizes, cap) == reference_place(sizes, cap)


def test_best_fit_module_example() -> None:
    # best_fit.py's docstring: capacity 8, units a:5 b:3 c:6 d:2 e:10 (head 2 + one chunk of 8)
    a, b, c, d, e = (np.arange(100 * k, 100 * k + n) for k, n in enumerate((5, 3, 6, 2, 10), 1))
    seqs = run(Pack(ListSource([a, b, c, d, e], block_docs=2), 8, mode="best_fit", window=5))
    assert [s["input_ids"].tolist() for s in seqs] == [
        [*a, *b],
        [*c, *d],
        [*e[:2], 0, 0, 0, 0, 0, 0],
        list(e[2:]),
    ]
    # the chunk counts positions from 0 again: attention cannot see the head's sequence
    assert seqs[3]["position_ids"].tolist() == list(range(8))


def test_concat_pad_module_example() -> None:
    # concat_pad.py's docstring: units of 5 (B, 3 tokens, E), capacity 7 between bol and eol
    docs = [np.arange(100 * k, 100 * k + 3) for k in (1, 2, 3)]
    kw = {"bos_token": 1, "eos_token": 2, "bol_token": 3, "eol_token": 4, "pad_token": 5}
    concat = run(Pack(ListSource(docs), 9, mode="concat", **kw))
    assert [s["input_ids"].tolist() for s in concat][:2] == [
        [3, 1, 100, 101, 102, 2, 1, 200, 4],
        [3, 201, 202, 2, 1, 300, 301, 302, 4],
    ]
    pad = run(Pack(ListSource(docs), 9, mode="pad", **kw))
    assert [s["input_ids"].tolist() for s in pad][:2] == [
        [3, 1, 100, 101, 102, 2, 5, 5, 4],
        [3, 1, 200, 201, 202, 2, 5, 5, 4],
    ]


def test_packed_sequence_is_importable_from_pack() -> None:
    assert PackedSequence is _packed.PackedSequence
    pack = Pack(ListSource([np.arange(100, 110)]), 4)
    pack.reset()
    item = pack.next_packed()
    assert isinstance(item, PackedSequence)
    assert pack.materialize(item)["input_ids"].tolist() == [100, 101, 102, 103]
