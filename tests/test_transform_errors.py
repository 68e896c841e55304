"""A transform misused says so: a filter that returns something other than a bool is refused
naming the step and what it returned, and an exception in a user function comes back saying
where it happened (step, dataset, file, document), chained to the original."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from torchdata_ext import World
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.nodes.transform import FilterDocuments, MapDocuments
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.testing import write_arrow_batches
from torchdata_ext.transforms import Filter, Map, TransformError

# document d of file f starts with token 1000 * f + d: a function can pick one out
DOCS = {
    f: [np.array([1000 * f + d, 7, 8, 9][: 1 + d % 4], np.uint32) for d in range(10)]
    for f in (0, 1)
}
BAD = (1, 6)  # (file, doc) the failing functions choke on


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> DatasetIndex:
    root = tmp_path_factory.mktemp("errors") / "web"
    for f, docs in DOCS.items():
        write_arrow_batches(str(root / f"p{f}.arrow"), docs)
    return DatasetIndex.build(str(root))


def reader(index: DatasetIndex) -> ShardReader:
    return ShardReader(index, 2, seed=1, world=World(0, 1, 0, 1), epochs=1, block_docs=4)


def says_false(tokens, meta):
    return "False"


def an_array(tokens, meta):
    return tokens > 3


def explode(tokens, meta):
    if int(tokens[0]) == 1000 * BAD[0] + BAD[1]:
        raise KeyError("no such thing")
    return tokens


def explode_block(block):
    raise ZeroDivisionError("bad block")


def drain(node) -> None:
    node.reset()
    for _ in node:
        pass


def test_a_filter_returning_a_string_is_refused_naming_it(index) -> None:
    with pytest.raises(TypeError) as info:
        drain(FilterDocuments(reader(index), says_false))
    msg = str(info.value)
    assert msg.startswith("filter 'says_false' returned 'False' (a str) for dataset 'web', file ")
    assert msg.endswith(
        "a filter must return True (keep) or False (drop), e.g. `return bool(...)` of one "
        "condition (the string 'False' is true)"
    )


def test_a_filter_returning_an_array_is_refused_naming_its_shape(index) -> None:
    with pytest.raises(TypeError, match=r"filter 'an_array' returned array\(\[") as info:
        drain(FilterDocuments(reader(index), an_array))
    assert "(a ndarray of shape (" in str(info.value)
    assert "ambiguous" not in str(info.value)


@pytest.mark.parametrize("node", ["map", "filter"])
def test_an_error_in_a_user_function_says_where_and_chains_the_original(index, node) -> None:
    make = MapDocuments if node == "map" else FilterDocuments
    fn = explode if node == "map" else (lambda t, m: bool(explode(t, m) is not None))
    name = "explode" if node == "map" else "<lambda>"
    with pytest.raises(TransformError) as info:
        drain(make(reader(index), fn))
    err = info.value
    url = index.files[BAD[0]]
    assert str(err) == (
        f"transform {name!r} raised KeyError: 'no such thing' (on dataset 'web', file 1 "
        f"({url}), document {BAD[1]})"
    )
    assert err.where == ("web", *BAD)
    assert isinstance(err.__cause__, KeyError) and err.__cause__.args == ("no such thing",)


def test_an_error_in_a_block_function_names_the_block(index) -> None:
    with pytest.raises(TransformError) as info:
        drain(MapDocuments(reader(index), block_fn=explode_block))
    msg = str(info.value)
    assert msg.startswith(
        "transform 'explode_block' raised ZeroDivisionError: bad block (on a block of dataset "
        "'web': "
    )
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def _build(cfg, world):
    return build_pipeline(cfg, world)


@pytest.mark.multiprocess
def test_the_error_crosses_a_worker_process_with_its_message(index) -> None:
    cfg = PipelineConfig(
        data_path=str(index.root), seq_length=4, logical_shards=2, batch_size=1,
        shuffle_buffer=1, transforms=[Map(explode)], epochs=1,
    )  # fmt: skip
    loader = TokenLoader(functools.partial(_build, cfg), num_workers=1)
    with pytest.raises(
        TransformError,
        match=r"transform 'explode' raised KeyError: 'no such thing' \(on dataset '[^']+', file 1 \(.*p1.arrow\), document 6\)",
    ):
        for _ in loader:
            pass


def test_a_filter_of_bools_still_filters(index) -> None:
    kept = Filter(lambda t, m: bool(len(t) > 2))
    node = FilterDocuments(reader(index), kept.fn)
    node.reset()
    got = sorted((d.file, d.doc) for b in node for d in b)
    assert got == [(f, d) for f in (0, 1) for d in range(10) if 1 + d % 4 > 2]
