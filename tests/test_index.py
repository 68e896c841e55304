"""DatasetIndex: deterministic listing, counts kept next to the data, Bamba counts layout."""

from __future__ import annotations

import os

import numpy as np
import pytest

from torchdata_ext import DatasetIndex
from torchdata_ext.handlers import base as handler_base
from torchdata_ext.sources.index import COUNTS_FILE
from torchdata_ext.testing import write_arrow_batches, write_flat_tokens, write_jsonl


def _docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, int(rng.integers(1, 20)), dtype=np.uint32) for _ in range(n)]


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "data" / "web"
    root.mkdir(parents=True)
    sizes = [5, 0, 12, 7]
    for i, n in enumerate(sizes):
        write_arrow_batches(str(root / f"shard_{i:02d}.arrow"), _docs(n, i))
    return root, sizes


class _CountingOpens:
    def __init__(self, monkeypatch):
        self.n = 0
        cls = handler_base._resolve("arrow")
        orig = cls.open

        def counted(this, url):
            self.n += 1
            return orig(this, url)

        monkeypatch.setattr(cls, "open", counted)


def test_files_sorted_counts_written_and_reused(dataset, monkeypatch) -> None:
    root, sizes = dataset
    opens = _CountingOpens(monkeypatch)
    index = DatasetIndex.build(str(root))
    assert [f.rsplit("/", 1)[1] for f in index.files] == [f"shard_{i:02d}.arrow" for i in range(4)]
    assert index.doc_counts.tolist() == sizes and index.name == "web"
    assert opens.n == 4
    assert not (root / "meta").exists()  # kept in the local cache, not in the data folder
    again = DatasetIndex.build(str(root))
    assert opens.n == 4  # counts came from the metadata file, no file opened
    assert (
        again.doc_counts.tolist() == sizes
        and again.token_counts.tolist() == index.token_counts.tolist()
    )
    assert again.fingerprint() == index.fingerprint()


def test_changed_file_is_recounted(dataset) -> None:
    root, sizes = dataset
    DatasetIndex.build(str(root))
    write_arrow_batches(str(root / "shard_03.arrow"), _docs(9, 99))
    assert DatasetIndex.build(str(root)).doc_counts.tolist() == sizes[:3] + [9]


def test_reads_bamba_counts_layout(dataset, monkeypatch) -> None:
    root, sizes = dataset
    meta = root.parent / "meta"
    meta.mkdir()
    rows = ["dataset/filename,documents,tokens"]
    rows += [f"web/shard_{i:02d}.arrow,{n},{n * 10}" for i, n in enumerate(sizes)]
    (meta / "combined_counts.csv").write_text("\n".join(rows) + "\n")
    opens = _CountingOpens(monkeypatch)
    index = DatasetIndex.build(str(root), write_counts=False)
    assert opens.n == 0
    assert index.doc_counts.tolist() == sizes
    assert index.token_counts.tolist() == [n * 10 for n in sizes]


def test_fingerprint_is_location_independent(dataset, tmp_path) -> None:
    root, _ = dataset
    import shutil

    copy = tmp_path / "elsewhere" / "web"
    shutil.copytree(root, copy)
    assert (
        DatasetIndex.build(str(copy)).fingerprint() == DatasetIndex.build(str(root)).fingerprint()
    )


def test_globs_braces_and_data_sources_txt(dataset, tmp_path) -> None:
    root, sizes = dataset
    a = DatasetIndex.build(str(root / "shard_{00..02}.arrow"))
    assert a.doc_counts.tolist() == sizes[:3]
    b = DatasetIndex.build(str(root / "shard_0[13].arrow"))
    assert b.doc_counts.tolist() == [sizes[1], sizes[3]]
    flat = tmp_path / "bolmo"
    flat.mkdir()
    for i in range(2):
        write_flat_tokens(str(flat / f"bolmo_data_{i:05d}.npy"), _docs(4, i), eos_token=0)
    (flat / "data_sources.txt").write_text(
        "\n".join(str(flat / f"bolmo_data_{i:05d}.npy") for i in range(2)) + "\n"
    )
    c = DatasetIndex.build(
        str(flat / "data_sources.txt"), file_type="flat", handler_options={"eos_token": 0}
    )
    assert c.doc_counts.tolist() == [4, 4] and c.total_tokens > 0


def test_offsets_sidecars_are_not_listed_as_data(tmp_path) -> None:
    """A folder of flat token files with ``.offsets.npy`` sidecars lists only the data files,
    whether the format is given or sniffed."""
    for i in range(2):
        write_flat_tokens(str(tmp_path / f"part_{i}.npy"), _docs(3, i), offsets=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "part_0.npy",
        "part_0.npy.offsets.npy",
        "part_1.npy",
        "part_1.npy.offsets.npy",
    ]
    for file_type in ("flat", None):
        ix = DatasetIndex.build(str(tmp_path), file_type=file_type)
        assert [os.path.basename(f) for f in ix.files] == ["part_0.npy", "part_1.npy"]
        assert ix.doc_counts.tolist() == [3, 3]


def test_memory_filesystem(tmp_path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        for i in range(2):
            write_jsonl(
                f"memory://idx-test/texts/p{i}.jsonl", [f"doc {i} {j}" for j in range(3 + i)]
            )
        index = DatasetIndex.build("memory://idx-test/texts")
        assert index.doc_counts.tolist() == [3, 4] and index.total_tokens == -1
        assert all(f.startswith("memory://") for f in index.files)
    finally:
        fs.rm("/idx-test", recursive=True)


def test_errors_name_the_path_and_fix(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no data files match .*empty"):
        DatasetIndex.build(str(empty))
    with pytest.raises(FileNotFoundError, match="nope"):
        DatasetIndex.build(str(tmp_path / "nope" / "*.arrow"))
    (tmp_path / "x.weird").write_text("hi")
    with pytest.raises(ValueError, match="x.weird: unknown file suffix.*file_type"):
        DatasetIndex.build(str(tmp_path / "x.weird"))
    with pytest.raises(FileNotFoundError, match="looking for names ending in"):
        DatasetIndex.build(str(tmp_path / "*.weird"))
    with pytest.raises(ValueError, match="unknown file_type='cbor2'"):
        DatasetIndex.build(str(tmp_path / "x.weird"), file_type="cbor2")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_arrow_batches(str(mixed / "a.arrow"), _docs(2))
    write_jsonl(str(mixed / "b.jsonl"), ["x"])
    with pytest.raises(ValueError, match="several formats"):
        DatasetIndex.build(str(mixed))
    only_empty = tmp_path / "zero"
    only_empty.mkdir()
    write_arrow_batches(str(only_empty / "a.arrow"), [])
    with pytest.raises(ValueError, match="no documents"):
        DatasetIndex.build(str(only_empty))


# -- counts as fms-fsdp writes them; nothing written into the data folder -------------------------
def _tree(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _no_counting(monkeypatch) -> None:
    """Fail if any arrow file is opened to count its documents."""

    def refuse(this, reader):
        raise AssertionError("a file was opened to count its documents")

    monkeypatch.setattr(handler_base._resolve("arrow"), "length", refuse)


@pytest.mark.parametrize(
    "row",
    [
        "/web/{name}",  # fms-fsdp's own tests
        "{root}/{name}",  # the absolute path where it was counted
        "/mnt/elsewhere/data/web/{name}",  # counted on another mount
        "s3://bucket/data/web/{name}",  # counted from an object store
    ],
)
@pytest.mark.parametrize("meta_in", ["parent", "data"])
def test_counts_rows_with_leading_slash_or_absolute_paths_are_used(
    dataset, monkeypatch, tmp_path, row, meta_in
) -> None:
    root, sizes = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    meta = (root.parent if meta_in == "parent" else root) / "meta"
    meta.mkdir()
    rows = ["dataset/filename,documents,tokens"]
    rows += [
        f"{row.format(root=root, name=f'shard_{i:02d}.arrow')},{n},{n * 10}"
        for i, n in enumerate(sizes)
    ]
    (meta / "bamba_counts.csv").write_text("\n".join(rows) + "\n")
    before = _tree(tmp_path / "data")
    _no_counting(monkeypatch)
    opens = _CountingOpens(monkeypatch)
    index = DatasetIndex.build(str(root))
    assert opens.n == 0
    assert index.doc_counts.tolist() == sizes
    assert index.token_counts.tolist() == [n * 10 for n in sizes]
    assert _tree(tmp_path / "data") == before  # no counts file written
    assert not (tmp_path / "cache").exists()  # nothing counted, nothing cached


def test_a_leading_slash_row_of_another_dataset_is_not_taken(dataset, monkeypatch, tmp_path):
    """``/code/shard_00.arrow`` names code's file, not web's file of the same name."""
    root, sizes = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    (root.parent / "meta").mkdir()
    rows = ["dataset/filename,documents,tokens", "/code/shard_00.arrow,999,9990"]
    (root.parent / "meta" / "counts.csv").write_text("\n".join(rows) + "\n")
    assert DatasetIndex.build(str(root)).doc_counts.tolist() == sizes


def test_the_loader_writes_nothing_into_the_data_folder_and_reuses_cached_counts(
    dataset, monkeypatch, tmp_path
) -> None:
    from torchdata_ext import ShardReader, World

    root, sizes = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    before = _tree(tmp_path / "data")
    opens = _CountingOpens(monkeypatch)
    index = DatasetIndex.build(str(root))
    assert opens.n == 4 and index.doc_counts.tolist() == sizes
    docs = sum(len(b) for b in ShardReader(index, 4, world=World(), epochs=1))
    assert docs == sum(sizes)
    assert _tree(tmp_path / "data") == before  # no meta/ folder, no counts file
    assert len(list((tmp_path / "cache" / "counts").iterdir())) == 1
    opens.n = 0
    again = DatasetIndex.build(str(root))
    assert opens.n == 0  # the cached counts, no file opened
    assert again.doc_counts.tolist() == sizes
    assert again.token_counts.tolist() == index.token_counts.tolist()
    assert again.fingerprint() == index.fingerprint()
    # a subset of the folder reads the same cache; a rewritten file is counted again
    assert DatasetIndex.build(str(root / "shard_0[13].arrow")).doc_counts.tolist() == [0, 7]
    assert opens.n == 0
    write_arrow_batches(str(root / "shard_02.arrow"), _docs(3, 5))
    assert DatasetIndex.build(str(root)).doc_counts.tolist() == [5, 0, 3, 7]
    assert opens.n == 1
    assert _tree(tmp_path / "data") == before


def test_write_counts_data_keeps_them_next_to_the_data(dataset, monkeypatch, tmp_path) -> None:
    """What ``prepare`` asks for its output: ``meta/torchdata_ext_counts.csv``, read back by
    any later build (also with another cache folder)."""
    root, sizes = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    DatasetIndex.build(str(root), write_counts="data")
    assert (root / "meta" / COUNTS_FILE).exists() and not (tmp_path / "cache").exists()
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "other"))
    _no_counting(monkeypatch)
    assert DatasetIndex.build(str(root), write_counts=False).doc_counts.tolist() == sizes
    with pytest.raises(ValueError, match="write_counts='meta' must be 'cache', 'data' or False"):
        DatasetIndex.build(str(root), write_counts="meta")  # type: ignore[arg-type]


def test_a_damaged_cache_file_is_counted_again(dataset, monkeypatch, tmp_path) -> None:
    root, sizes = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    DatasetIndex.build(str(root))
    (cached,) = (tmp_path / "cache" / "counts").iterdir()
    cached.write_text("url,documents,tokens,bytes,version\nnot,a,row\n")
    opens = _CountingOpens(monkeypatch)
    assert DatasetIndex.build(str(root)).doc_counts.tolist() == sizes
    assert opens.n == 4


def test_a_file_gone_between_listing_and_stat_is_named(dataset, monkeypatch, tmp_path) -> None:
    """A listed file that cannot be stat'ed (here removed right after the listing) stops the
    build naming it, instead of entering the index with an unknown size."""
    from torchdata_ext.handlers import DataFileError
    from torchdata_ext.sources import index as index_module

    root, _ = dataset
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    real = index_module.file_stat

    def removed_first(url, storage_options=None):
        if url.endswith("shard_01.arrow"):
            os.remove(url)
        return real(url, storage_options)

    monkeypatch.setattr(index_module, "file_stat", removed_first)
    with pytest.raises(DataFileError, match=r"shard_01\.arrow: listed, but its size cannot be read "
                       r"\(FileNotFoundError: .*removed or renamed while the index was built"):  # fmt: skip
        DatasetIndex.build(str(root))
