"""The pipeline frees what it read by reference counting alone.

A block the pipeline is done with must go the moment its last reference does: its tokens (and
the stream laid out from them, a copy with the specials placed) are the largest objects the
loader holds. An object graph with a reference cycle is freed only by the cyclic garbage
collector, generations later: on the benchmark corpus the one-process graph ran at 0.8x for
it, and with the collector off grew to 2 GB (a whole block's stream, kept in the block's own
``__dict__``, named the block). Every packing mode and mix rule is run here with the collector
off and everything it would have freed kept (``gc.DEBUG_SAVEALL``): there must be nothing,
while it delivers and when it is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from harness import text_config, write_random_arrow_datasets, write_random_text_datasets

from torchdata_ext import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("no_cycles")
    # short documents, and long ones: cut at row ends and across blocks
    write_random_arrow_datasets(
        str(root), (("web", 300, 30), ("code", 80, 300), ("books", 20, 900)), seed=5
    )
    return PipelineConfig(
        data_path=str(root), datasets="web,code,books", weights=[3, 1, 1], seq_length=64,
        logical_shards=8, batch_size=2, shuffle_buffer=16, block_docs=8, seed=1, eos_token=0,
        max_chunksize=200,
    )  # fmt: skip


def _ours(objects: list[object]) -> list[object]:
    """The objects of this package's types among ``objects``: a cycle the pipeline made holds
    some (a block, a stream, a node); the rest of the garbage can be another library's,
    freed by its own threads meanwhile (a test process ran S3 clients before)."""
    return [o for o in objects if type(o).__module__.startswith("torchdata_ext")]


@contextmanager
def _cyclic_garbage() -> Iterator[list[object]]:
    """The objects of this package's types only the cyclic collector would free, made inside
    the block (:func:`_ours`)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[object] = []
    try:
        yield found
        gc.collect()
        found.extend(_ours(gc.garbage))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


CHANGES = [
    {},  # the default: concat, the mix cutting documents at row ends
    {"bos_token": 1},
    {"bos_token": 0},  # one separator token (epochraft)
    {"mix_quantum_tokens": 0},
    {"interleave_mode": "samples"},
    {"pack_mode": "pad"},
    {"pack_mode": "best_fit"},
    {"pack_mode": "chunk"},
]


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_no_reference_cycles_while_delivering(base, change) -> None:
    cfg = dataclasses.replace(base, **change)
    node = build_pipeline(cfg)
    node.reset()
    for _ in range(20):  # the buffer full, blocks read and done with
        next(node)
    with _cyclic_garbage() as garbage:
        for _ in range(60):
            next(node)
            node.state_dict()
    kinds = collections.Counter(type(o).__qualname__ for o in garbage)
    assert not garbage, f"reference cycles left for the cyclic collector: {kinds.most_common(8)}"


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_a_dropped_pipeline_is_freed_at_once(base, change) -> None:
    """A pipeline dropped (a loader closed, or rebuilt for new weights) frees its readers,
    their open files and the blocks it holds when its last reference goes (the mix's mirror
    of Pack's cursor held the mix, which holds the mirror)."""
    node = build_pipeline(dataclasses.replace(base, **change))
    node.reset()
    for _ in range(20):
        next(node)
    with _cyclic_garbage() as garbage:
        del node
    kinds = collections.Counter(type(o).__qualname__ for o in garbage)
    assert not garbage, f"a dropped pipeline left reference cycles: {kinds.most_common(8)}"


def test_text_through_the_tokenizer_makes_no_cycles(tmp_path) -> None:
    """JSONL texts tokenized on the way (the byte tokenizer), mixed, packed: no cycles while
    delivering nor when dropped."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    write_random_text_datasets(str(tmp_path), (("web", 200, 20), ("code", 60, 80)), words, 2)
    cfg = dataclasses.replace(text_config(str(tmp_path)), epochs=None, mix_quantum_tokens=32)
    node = build_pipeline(cfg)
    node.reset()
    for _ in range(10):
        next(node)
    with _cyclic_garbage() as garbage:
        for _ in range(40):
            next(node)
            node.state_dict()
        del node
    kinds = collections.Counter(type(o).__qualname__ for o in garbage)
    assert not garbage, f"reference cycles left for the cyclic collector: {kinds.most_common(8)}"
