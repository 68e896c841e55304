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


def minus_one(tokens, meta):
    if int(tokens[0]) == 1000 * BAD[0] + BAD[1]:
        return np.array([5, -1], np.int64)
    return tokens.astype(np.int64)


def shift_block(block):
    return block.tokens.astype(np.int64) + 2000, block.offsets


@pytest.mark.parametrize("check_deterministic", [True, False])
def test_a_map_returning_a_negative_id_is_refused_naming_it(index, check_deterministic) -> None:
    # the check runs on the first block (checked twice for determinism) and on later ones
    node = MapDocuments(reader(index), minus_one, check_deterministic=check_deterministic)
    with pytest.raises(ValueError) as info:
        drain(node)
    assert str(info.value) == (
        f"transform 'minus_one' returned token id -1 for dataset 'web', file 1 "
        f"({index.files[1]}), document {BAD[1]}: ids must be 0 or more; make the transform "
        "return ids of the tokenizer's vocabulary"
    )


def test_a_map_beyond_the_vocabulary_is_refused_naming_it(index) -> None:
    node = MapDocuments(reader(index), block_fn=shift_block, max_id=2999,
                        ids_from="the vocabulary of the tokenizer 't.json'")  # fmt: skip
    with pytest.raises(ValueError, match=r"^transform 'shift_block' returned token id 3\d\d\d "
                       r"for dataset 'web', file 1 \(.*p1\.arrow\), document \d: ids must be in "
                       r"0\.\.2999 \(the vocabulary of the tokenizer 't\.json'\); make the "
                       r"transform return ids"):  # fmt: skip
        drain(node)
    drain(MapDocuments(reader(index), block_fn=shift_block, max_id=3009))  # all fit


def test_the_config_bounds_a_token_map_by_the_tokenizer(tmp_path) -> None:
    from torchdata_ext.testing import write_jsonl

    write_jsonl(str(tmp_path / "web" / "a.jsonl"), ["some text", "more text"])
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web", file_type="jsonl",
                         col_name="text", tokenizer="byte", seq_length=4, logical_shards=1,
                         shuffle_buffer=1, epochs=1, transforms=[Map(block_fn=shift_block)])  # fmt: skip
    node = build_pipeline(cfg, World())
    with pytest.raises(ValueError, match=r"^transform 'shift_block' returned token id 2\d\d\d "
                       r"for dataset 'web', file 0 \(.*a\.jsonl\), document \d: ids must be in "
                       r"0\.\.256 \(the vocabulary of the tokenizer 'byte' \(byte_offset=1\) and "
                       r"the special ids of the config\)"):  # fmt: skip
        drain(node)
    # token data without a tokenizer: the output dtype bounds the ids
    write_arrow_batches(str(tmp_path / "tok" / "a.arrow"), [np.array([1, 2, 3], np.int64)] * 4)
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="tok", seq_length=4, dtype="int32",
                         logical_shards=1, shuffle_buffer=1, epochs=1,
                         transforms=[Map(block_fn=past_int32), Map(minus_one)])  # fmt: skip
    with pytest.raises(ValueError) as info:
        drain(build_pipeline(cfg, World()))
    assert str(info.value) == (
        "past_int32 on a block of dataset 'tok': token ids 2147483649..2147483651 do not fit "
        "the pipeline's int32 (-2147483648..2147483647); make it return ids of the tokenizer's "
        "vocabulary"
    )
    cfg = PipelineConfig(**{**cfg.to_dict(), "transforms": [Map(negate)]})
    with pytest.raises(ValueError, match=r"^transform 'negate' returned token id -\d for dataset "
                       r"'tok', file 0 \(.*a\.arrow\), document \d: ids must be in "
                       r"0\.\.2147483647 \(the output dtype int32\)"):  # fmt: skip
        drain(build_pipeline(cfg, World()))


def past_int32(block):
    return block.tokens.astype(np.int64) + 2**31, block.offsets


def negate(tokens, meta):
    return -tokens
