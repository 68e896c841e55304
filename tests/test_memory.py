"""In-memory sources: token arrays, texts, pyarrow tables and a datasets.Dataset, read with the
same logical shards, walk, state, restore and rescale as files."""

from __future__ import annotations

import collections
import functools
import pickle

import numpy as np
import pyarrow as pa
import pytest
from harness import check_exactly_once, check_restore_at_every_step, run

from torchdata_ext import DatasetIndex, PipelineConfig, ShardReader, World, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.handlers import DataFileError, MemorySource
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.order.split import EvalSplit
from torchdata_ext.provenance import LITERAL, PAD


def make_docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        np.concatenate([[i + 1_000_000], rng.integers(10, 50_000, int(rng.integers(0, 25)))])
        .astype(np.int32)
        for i in range(n)
    ]  # fmt: skip


DOCS = make_docs(300)


def delivered(index, shape=(1, 1), n_shards=12, **kw) -> list[tuple[int, ...]]:
    R, W = shape
    out = []
    for r in range(R):
        for w in range(W):
            reader = ShardReader(index, n_shards, world=World(r, R, w, W), epochs=1, **kw)
            out += [tuple(d.data.tolist()) for b in run(reader) for d in b]
    return out


def as_counter(docs) -> collections.Counter:
    return collections.Counter(tuple(np.asarray(d).tolist()) for d in docs)


@pytest.mark.parametrize("shape", [(1, 1), (2, 3)], ids=str)
@pytest.mark.parametrize("form", ["arrays", "lists", "generator", "table", "chunked"])
def test_every_document_once_exactly(shape, form) -> None:
    data: object = DOCS
    if form == "lists":
        data = [d.tolist() for d in DOCS]
    elif form == "generator":
        data = (d for d in DOCS)
    elif form == "table":
        data = pa.table({"tokens": [d.tolist() for d in DOCS], "other": range(len(DOCS))})
    elif form == "chunked":
        data = pa.chunked_array(
            [pa.array([d.tolist() for d in DOCS[:100]]), pa.array([d.tolist() for d in DOCS[100:]])]
        )
    index = DatasetIndex.from_documents("mem", data, docs_per_file=64)
    assert index.files[:2] == ("<memory>/mem/part-00000", "<memory>/mem/part-00001")
    assert index.doc_counts.tolist() == [64, 64, 64, 64, 44]
    assert index.total_tokens == sum(len(d) for d in DOCS)
    assert as_counter(delivered(index, shape)) == as_counter(DOCS)


def test_table_documents_are_zero_copy_views() -> None:
    table = pa.table({"tokens": pa.array([d.tolist() for d in DOCS], pa.list_(pa.int32()))})
    index = DatasetIndex.from_documents("mem", table, docs_per_file=100)
    handler = index.handler()
    reader = handler.open(index.files[1])
    doc = handler.get(reader, 5)
    assert doc.tolist() == DOCS[105].tolist()
    values = table.column("tokens").chunks[0].values.to_numpy()
    assert np.shares_memory(doc, values)


def test_texts_through_the_pipeline_with_the_byte_tokenizer() -> None:
    texts = [f"document number {i} " + "x" * (i % 13) for i in range(40)]
    index = DatasetIndex.from_documents("txt", texts, docs_per_file=16)
    assert index.total_tokens == -1
    got = [d.data for b in run(ShardReader(index, 4, world=World(0, 1, 0, 1), epochs=1)) for d in b]
    assert sorted(got) == sorted(texts)
    cfg = PipelineConfig(
        data_path="in-memory", datasets="txt", tokenizer="byte", seq_length=32, batch_size=2,
        logical_shards=4, shuffle_buffer=1, epochs=1, eos_token=None, output_keys="provenance",
    )  # fmt: skip
    seqs = list(build_pipeline(cfg, World(0, 1, 0, 1), {"txt": index}, collate=False))
    covered = collections.Counter()
    for s in seqs:
        for ds, _, d, _, n in s["provenance"].tolist():
            if ds not in (LITERAL, PAD):
                covered[d] += n
    # every text's bytes, once (a document of file f has doc index d in that file)
    assert sum(covered.values()) == sum(len(t.encode()) for t in texts)


def test_restore_at_every_step_and_split() -> None:
    index = DatasetIndex.from_documents("mem", DOCS, docs_per_file=50)

    def make():
        return ShardReader(
            index, 10, world=World(0, 1, 0, 1), epochs=2, block_docs=7, split=EvalSplit(0.25, 3)
        )

    items = check_restore_at_every_step(make)
    train = [tuple(d.data.tolist()) for b in items for d in b if b.epoch == 0]
    held = delivered(index, (1, 2), n_shards=10, split=EvalSplit(0.25, 3), subset="eval")
    assert as_counter(train) + as_counter(held) == as_counter(DOCS)
    assert 40 < len(held) < 110


def test_appending_documents_keeps_the_split() -> None:
    split = EvalSplit(0.3, 1)
    small = DatasetIndex.from_documents("mem", DOCS[:200], docs_per_file=64)
    large = DatasetIndex.from_documents("mem", DOCS, docs_per_file=64)
    a = set(delivered(small, split=split, subset="eval"))
    b = set(delivered(large, split=split, subset="eval"))
    assert a and a == {d for d in b if d[0] < 1_000_200}


def _build(cfg, datasets, world):
    return build_pipeline(cfg, world, datasets, collate=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("old", "new"), [((2, 2), (1, 3)), ((1, 0), (3, 1))], ids=str)
def test_pipeline_rescale_with_worker_processes(tmp_path, old, new) -> None:
    """Save mid-epoch at R x W (worker processes get the in-memory data pickled), restore at
    R' x W': every token of every document exactly once."""
    index = DatasetIndex.from_documents("mem", DOCS, docs_per_file=40)
    cfg = PipelineConfig(
        data_path="in-memory", datasets="mem", seq_length=24, eos_token=0, logical_shards=12,
        batch_size=2, shuffle_buffer=4, epochs=1, output_keys="provenance", block_docs=5,
    )  # fmt: skip
    build = functools.partial(_build, cfg, {"mem": index})
    coverage: dict = {}

    def cover(seqs):
        for s in seqs:
            for ds, f, d, start, n in np.asarray(s["provenance"]).tolist():
                if ds not in (LITERAL, PAD):
                    coverage.setdefault((f, d), []).append((start, start + n))

    ckpt = str(tmp_path / "ckpt")
    for r in range(old[0]):
        loader = TokenLoader(build, num_workers=old[1], rank=r, world_size=old[0])
        seqs = []
        for s in loader:
            seqs.append(s)
            if len(seqs) >= 5 + r:
                break
        cover(seqs)
        save_checkpoint(loader, ckpt)
    for r in range(new[0]):
        loader = TokenLoader(build, num_workers=new[1], rank=r, world_size=new[0])
        load_checkpoint(loader, ckpt)
        cover(list(loader))
    check_exactly_once(
        coverage, {(i // 40, i % 40): len(d) for i, d in enumerate(DOCS)}
    )  # fmt: skip


def test_bad_input_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="no documents"):
        DatasetIndex.from_documents("m", [])
    with pytest.raises(TypeError, match="document 1 is a 2-D"):
        DatasetIndex.from_documents("m", [np.arange(3), np.zeros((2, 2), int)])
    with pytest.raises(TypeError, match="float64"):
        DatasetIndex.from_documents("m", [[0.5, 1.5]])
    with pytest.raises(TypeError, match="sequence of token arrays"):
        DatasetIndex.from_documents("m", "just a string")
    table = pa.table({"text": ["a", "b"], "ids": [1, 2]})
    with pytest.raises(ValueError, match="column='text'"):
        DatasetIndex.from_documents("m", table)
    with pytest.raises(DataFileError, match="single integers"):
        DatasetIndex.from_documents("m", table, column="ids")
    with pytest.raises(ValueError, match="docs_per_file"):
        DatasetIndex.from_documents("m", DOCS, docs_per_file=0)
    with pytest.raises(ValueError, match="from_documents"):
        DatasetIndex.build("/somewhere", file_type="memory")
    source = MemorySource("m", DOCS, docs_per_file=100)
    with pytest.raises(DataFileError, match="not a file of the in-memory dataset"):
        source.file_number("<memory>/m/part-00003")


# -- Hugging Face datasets (the optional `hf` extra) ------------------------------------------
def test_datasets_dataset_is_read_through_its_arrow_table(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"input_ids": [d.tolist() for d in DOCS], "text": [str(i) for i in range(len(DOCS))]}
    )
    index = DatasetIndex.from_documents("hf", ds, column="input_ids", docs_per_file=70)
    assert as_counter(delivered(index, (2, 1))) == as_counter(DOCS)
    reader = index.handler().open(index.files[0])
    values = ds.data.table.column("input_ids").chunks[0].values.to_numpy()
    assert np.shares_memory(index.handler().get(reader, 3), values)  # zero-copy
    texts = DatasetIndex.from_documents("hf", ds, column="text", docs_per_file=70)
    assert sorted(delivered_texts(texts)) == sorted(str(i) for i in range(len(DOCS)))
    with pytest.raises(ValueError, match="flatten_indices"):
        DatasetIndex.from_documents("hf", ds.shuffle(seed=0), column="input_ids")
    # a dataset on disk pickles as its file paths (memory-mapped again), not as its data
    ds.save_to_disk(str(tmp_path / "ds"))
    mapped = datasets.load_from_disk(str(tmp_path / "ds"))
    on_disk = DatasetIndex.from_documents("hf", mapped, column="input_ids", docs_per_file=70)
    assert len(pickle.dumps(on_disk)) < 0.2 * sum(d.nbytes for d in DOCS)
    assert as_counter(delivered(pickle.loads(pickle.dumps(on_disk)))) == as_counter(DOCS)


def delivered_texts(index) -> list[str]:
    return [
        d.data for b in run(ShardReader(index, 4, world=World(0, 1, 0, 1), epochs=1)) for d in b
    ]
