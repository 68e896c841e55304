"""A pipeline that can never yield fails instead of hanging, and one that keeps almost nothing
warns (``torchdata_ext.nodes.drops``): document filters and maps, the reader's ``min_length``, and
``chunk`` packing with ``drop_remainder``, on endless streams; a legitimately selective filter
and a finite stream are left alone."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from torchdata_ext import World
from torchdata_ext.nodes.drops import NothingKeptError
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.nodes.transform import FilterDocuments
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.transforms import Map

N_DOCS = 500
# document i starts with token 100 + i: a function can pick one out
DOCS = [np.array([100 + i] + [7] * (1 + i % 5), np.int64) for i in range(N_DOCS)]
ONE = World(0, 1, 0, 1)


@pytest.fixture(scope="module")
def index() -> DatasetIndex:
    return DatasetIndex.from_documents("web", DOCS, docs_per_file=100)


def reader(index, **kw) -> ShardReader:
    return ShardReader(index, 4, seed=1, world=ONE, block_docs=16, **kw)


def never(tokens, meta) -> bool:
    return False


def only_doc_3(block) -> np.ndarray:
    return block.tokens[block.offsets[:-1]] == 103


def emptied(tokens, meta) -> np.ndarray:
    return tokens[:0]


def one_in_200(block) -> np.ndarray:
    return block.tokens[block.offsets[:-1]] % 200 == 0


def test_a_filter_that_keeps_nothing_fails_after_a_whole_pass(index) -> None:
    node = FilterDocuments(reader(index), never)
    node.reset()
    with pytest.raises(NothingKeptError) as info:
        next(node)
    assert str(info.value) == (
        "dataset 'web': the transforms [Filter(never, on='tokens')]: 1,000 documents read in a "
        "row and none kept (step 'never' dropped 1,000), a whole pass over this worker's data: "
        "nothing would ever come out; check the filters and maps (a filter's True keeps a "
        "document), or raise max_dropped_documents if they are meant to be this selective"
    )
    assert isinstance(info.value, ValueError)


def test_a_map_that_empties_every_document_fails_in_the_pipeline(index) -> None:
    cfg = PipelineConfig(
        data_path="unused", datasets="web", seq_length=8, logical_shards=4, batch_size=2, shuffle_buffer=1,
        transforms=[Map(emptied)], eos_token=None,
    )  # fmt: skip
    node = build_pipeline(cfg, ONE, {"web": index})
    node.reset()
    with pytest.raises(NothingKeptError, match=r"1,000 came out of the steps with no data"):
        next(node)


def test_max_dropped_stops_a_long_run_before_a_whole_pass(index) -> None:
    node = FilterDocuments(reader(index), never, max_dropped=40)
    node.reset()
    with pytest.raises(NothingKeptError) as info:
        next(node)
    assert "48 documents read in a row and none kept (step 'never' dropped 48) (the limit: " in str(
        info.value
    )
    assert "max_dropped_documents=40): the pipeline would wait for a batch forever;" in str(
        info.value
    )


def test_a_selective_filter_keeps_running_and_a_finite_stream_just_ends(index) -> None:
    node = FilterDocuments(reader(index), block_fn=only_doc_3)
    node.reset()
    got = [int(next(node).tokens[0]) for _ in range(5)]  # one document per pass, five passes
    assert got == [103] * 5
    finite = FilterDocuments(reader(index, epochs=2), never)
    finite.reset()
    with pytest.raises(StopIteration):
        next(finite)


def test_the_reader_fails_on_max_dropped_naming_min_length(index) -> None:
    node = reader(index, min_length=50, max_dropped=100)
    node.reset()
    with pytest.raises(NothingKeptError) as info:
        next(node)
    assert str(info.value).startswith("dataset 'web': the reader: 1")
    assert "documents read in a row and none kept (min_length=50) (the limit: " in str(info.value)
    assert str(info.value).endswith(
        "lower min_length, check eval_fraction / subset and the files on_error='skip' logged, "
        "or raise max_dropped_documents if the data is meant to be this sparse"
    )


def test_chunk_packing_that_drops_every_remainder_fails(index) -> None:
    cfg = PipelineConfig(
        data_path="unused", datasets="web", seq_length=64, logical_shards=4, batch_size=2, shuffle_buffer=1,
        pack_mode="chunk", drop_remainder=True,
    )  # fmt: skip
    node = build_pipeline(cfg, ONE, {"web": index})
    node.reset()
    with pytest.raises(NothingKeptError) as info:
        next(node)
    assert str(info.value) == (
        "Pack(mode='chunk', drop_remainder=True, seq_len=64): 1,000 documents read in a row "
        "and none kept, a whole pass over this worker's data: nothing would ever come out; the "
        "documents are shorter than a sequence: lower seq_len or set drop_remainder=False (pad "
        "them), or raise max_dropped_documents"
    )


def test_almost_everything_dropped_warns_once(index, caplog) -> None:
    node = FilterDocuments(reader(index), block_fn=one_in_200)
    node.reset()
    with caplog.at_level(logging.WARNING, logger="torchdata_ext"):
        for _ in range(40):  # 2 per pass of 500 (200, 400): 20 passes, 10,000 documents
            next(node)
    warned = [r.getMessage() for r in caplog.records if "documents read" in r.getMessage()]
    assert warned == [
        "dataset 'web': the transforms [Filter(one_in_200, on='tokens')]: kept 40 of the first "
        "10,000 documents read (step 'one_in_200' dropped 9,960); check it is meant to be this "
        "selective"
    ]


def test_max_dropped_documents_is_checked() -> None:
    with pytest.raises(ValueError, match="max_dropped_documents"):
        PipelineConfig(data_path="x", max_dropped_documents=0)
