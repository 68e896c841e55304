"""Start-up and restore requests that do not grow with the job: index files (two GETs per
dataset, no LIST; a stale one refused), the index broadcast under torch.distributed, and
fingerprint checks shared by ranks without a process group and skipped for unchanged objects.
Requests are counted by kind (``count_s3_requests``) against the moto S3 server."""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _gloo import init_gloo, rendezvous, run_ranks
from harness import counted_fingerprint_reads, item_key, write_random_arrow_datasets

from torchdata_ext import DatasetIndex, PipelineConfig, World, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_datasets
from torchdata_ext.remote import remove_file
from torchdata_ext.remote.counting import count_s3_objects, count_s3_requests, request_kind
from torchdata_ext.sources import fingerprint, index_file
from torchdata_ext.sources.fingerprint import ChangedFilesError
from torchdata_ext.sources.index_file import (
    INDEX_FILE,
    StaleIndexError,
    index_file_url,
    load_index_file,
    write_index_files,
)
from torchdata_ext.sources.prepared_meta import read_side_file
from torchdata_ext.testing import write_arrow_batches

NAMES = ("web", "code")


def _corpus(root: str, so=None) -> None:
    write_random_arrow_datasets(root, (("web", 40, 20), ("code", 30, 30)), seed=4,
                                storage_options=so)  # fmt: skip
    for name in NAMES:  # prepare's counts file next to the data, as a prepared corpus has
        DatasetIndex.build(f"{root}/{name}", storage_options=so, write_counts="data")


def _cfg(root: str, so=None) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets=",".join(NAMES), seq_length=16, logical_shards=8, batch_size=2,
        shuffle_buffer=3, block_docs=4, seed=1, storage_options=dict(so or {}),
    )  # fmt: skip


def _same(a: DatasetIndex, b: DatasetIndex) -> None:
    assert a.files == b.files and a.file_type == b.file_type and a.name == b.name
    assert a.doc_counts.tolist() == b.doc_counts.tolist()
    assert a.token_counts.tolist() == b.token_counts.tolist()
    assert a.file_stats == b.file_stats and a.handler_options == b.handler_options


# -- index files --------------------------------------------------------------------------------
def test_the_index_command_writes_what_a_listing_finds(tmp_path: Path, capsys) -> None:
    root = str(tmp_path / "data")
    _corpus(root)
    assert main(["index", root, "--datasets", "web,code"]) == 0
    assert capsys.readouterr().out.split() == [
        f"{root}/web/meta/{INDEX_FILE}",
        f"{root}/code/meta/{INDEX_FILE}",
    ]
    listed = build_datasets(_cfg(root), World(1, 2))  # rank 1: reads the index files
    for name in NAMES:
        built = DatasetIndex.build(f"{root}/{name}", name=name, col_name="tokens", eos_token=0)
        _same(listed[name], built)
        assert listed[name].fingerprint() == built.fingerprint()


def test_a_stale_index_file_is_refused_naming_the_files(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    _corpus(root)
    write_index_files(root, NAMES)
    write_arrow_batches(f"{root}/web/p2.arrow", [np.arange(5, 9, dtype=np.uint32)])  # added
    write_arrow_batches(f"{root}/code/p1.arrow", [np.arange(5, 60, dtype=np.uint32)])  # resized
    cfg = _cfg(root)
    with pytest.raises(StaleIndexError) as e:  # rank 0 lists and refuses
        build_datasets(cfg, World(0, 4))
    assert str(e.value).startswith(
        f"the index file {root}/web/meta/{INDEX_FILE} is stale: 1 file(s) of {root}/web "
        "changed since it was written: p2.arrow (not in the recorded files). It is not rebuilt "
        "here (the other ranks read it without listing and must see the same files): write it "
        f"again before starting the job with `torchdata-ext index {root}/web`"
    )
    with pytest.raises(StaleIndexError, match=r"p1\.arrow \(size \d+ -> \d+; version mtime="):
        load_index_file(f"{root}/code", name="code", file_type="arrow")
    # another rank trusts the index file (it lists nothing): rank 0's refusal stops the job
    assert len(build_datasets(cfg, World(2, 4))["web"].files) == 2
    write_index_files(root, NAMES)  # written again: every rank sees the new files
    for rank in (0, 2):
        got = build_datasets(cfg, World(rank, 4))
        assert [f.rsplit("/", 1)[1] for f in got["web"].files] == [
            "p0.arrow",
            "p1.arrow",
            "p2.arrow",
        ]


def test_an_index_file_counted_otherwise_is_not_used(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    _corpus(root)
    write_index_files(root, NAMES)
    folder = f"{root}/web"
    assert load_index_file(folder, name="web", file_type="arrow", col_name="tokens") is not None
    assert load_index_file(folder, name="web", file_type="parquet") is None
    assert load_index_file(folder, name="web", file_type="arrow", col_name="text") is None
    Path(index_file_url(folder)).write_text('{"index_version": 99}')
    with pytest.raises(ValueError, match=r"index file version 99 is not supported"):
        load_index_file(folder, name="web", file_type="arrow")


def test_prepare_writes_the_index_file(tmp_path: Path) -> None:
    from torchdata_ext import prepare

    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"document {i} " * (i + 1)}) + "\n" for i in range(9))
    )
    out = str(tmp_path / "data" / "web")
    prepare([str(src)], out, tokenizer="byte")
    index = load_index_file(out, name="web", file_type="arrow")
    assert index is not None
    _same(index, DatasetIndex.build(out, name="web"))
    assert index.total_docs == 9
    # the prepared metadata is read as it is now (not copied into the index file)
    meta = Path(out, "meta", "torchdata_ext_meta.json")
    assert build_datasets(_cfg_of(out), World(1, 2))["web"].side_files == {
        str(meta): meta.read_bytes()
    }
    meta.unlink()
    assert build_datasets(_cfg_of(out), World(1, 2))["web"].side_files == {str(meta): None}


def _cfg_of(folder: str) -> PipelineConfig:
    return PipelineConfig(data_path=folder, seq_length=16, logical_shards=8, tokenizer="byte")


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_reads_the_index_files_once_for_its_workers_and_saves(
    tmp_path, monkeypatch, workers
) -> None:
    """``TokenLoader(partial(build_pipeline, cfg))`` reads the dataset indexes once, in the
    training process, before its graphs are built: no dataloader worker nor the first save
    reads them again (each worker read them before, and a save's graph once more)."""
    from torchdata_ext.pipeline import build as pipeline_build

    root = str(tmp_path / "data")
    _corpus(root)
    log = tmp_path / "reads.txt"
    read = pipeline_build._datasets_here

    def logged(cfg: PipelineConfig, verify: bool) -> dict[str, DatasetIndex]:
        with open(log, "a") as f:  # the workers are forked: the patch and the file go with them
            f.write(f"{os.getpid()}\n")
        return read(cfg, verify)

    monkeypatch.setattr(pipeline_build, "_datasets_here", logged)
    loader = TokenLoader(functools.partial(build_pipeline, _cfg(root)), num_workers=workers)
    got = [item_key(b) for b, _ in zip(loader, range(4))]
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    assert log.read_text().split() == [str(os.getpid())]
    assert len(set(got)) == 4  # 4 batches came, each other than the others


# -- requests on S3 -----------------------------------------------------------------------------
def test_request_kinds() -> None:
    url = "http://127.0.0.1:1/b"
    assert request_kind("GET", f"{url}?list-type=2&prefix=d%2F", {}) == "LIST"
    assert request_kind("GET", f"{url}/d/p0.arrow", {"Range": "bytes=0-9"}) == "RANGE_GET"
    assert request_kind("GET", f"{url}/d/p0.arrow", {}) == "GET"
    assert request_kind("head", f"{url}/d/p0.arrow", {}) == "HEAD"


def test_counting_patches_send_only_while_a_block_is_open(s3) -> None:
    """The wrapper is in place inside the blocks only: nested blocks each count what they saw,
    and the last block to close, by an exception too, puts aiobotocore's method back."""
    import s3fs
    from aiobotocore.httpsession import AIOHTTPSession

    original = AIOHTTPSession.send
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
    fs.pipe(f"{s3.bucket}/counting/a", b"x")
    with pytest.raises(RuntimeError, match="stop"), count_s3_requests() as outer:
        assert AIOHTTPSession.send is not original
        fs.cat(f"{s3.bucket}/counting/a")
        with count_s3_requests() as inner:
            fs.cat(f"{s3.bucket}/counting/a")
        assert AIOHTTPSession.send is not original  # the outer block is still open
        raise RuntimeError("stop")
    assert AIOHTTPSession.send is original
    assert inner["GET"] == 1 and outer["GET"] == 2
    fs.cat(f"{s3.bucket}/counting/a")  # sent after the blocks: nobody counts it
    assert outer["GET"] == 2


def test_a_rank_starts_with_one_get_per_dataset_and_no_list(s3) -> None:
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    cfg = _cfg(root, so)
    with count_s3_requests() as listing:
        reference = build_datasets(cfg, World(1, 4))
    assert listing["LIST"] >= 2 * len(NAMES)  # without index files: every rank lists
    write_index_files(root, NAMES, storage_options=so)
    with count_s3_requests() as other:
        got = build_datasets(cfg, World(1, 4))
    # per dataset one GET of its index file and one of its prepared metadata, nothing else
    assert other == Counter({"GET": 2 * len(NAMES)})
    with count_s3_requests() as first:
        build_datasets(cfg, World(0, 4))
    assert first["LIST"] >= len(NAMES) and first["GET"] == 2 * len(NAMES)  # rank 0 checks it
    for name in NAMES:
        _same(got[name], reference[name])
    with count_s3_requests() as built:  # a worker's graph from the shared indexes: no request
        build_pipeline(cfg, World(1, 4, 1, 2), got)
    assert built == Counter()


def test_a_loader_given_its_rank_checks_the_index_files_on_rank_0_alone(s3, monkeypatch) -> None:
    """``TokenLoader(partial(build_pipeline, cfg), rank=, world_size=)`` without a process
    group or ``RANK`` reads the index files at ``iter()`` as the rank it was given: rank 1
    sends no LIST, rank 0 lists to check them (every rank listed, each taking itself for
    rank 0, when the loader read them without its rank)."""
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    write_index_files(root, NAMES, storage_options=so)
    monkeypatch.delenv("RANK", raising=False)
    build = functools.partial(build_pipeline, _cfg(root, so), collate=False)
    for rank in (1, 0):
        monkeypatch.setattr(index_file, "_verified", set())  # a new process: nothing checked
        loader = TokenLoader(build, rank=rank, world_size=2)
        with count_s3_requests() as c:
            next(iter(loader))
        loader.close()
        assert ("LIST" in c) == (rank == 0), (rank, c)


def test_an_unchanged_restore_reads_no_data_file_to_check_it(s3) -> None:
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    cfg = _cfg(root, so)
    build = functools.partial(build_pipeline, cfg, collate=False)
    loader = TokenLoader(build)
    it = iter(loader)
    [item_key(next(it)) for _ in range(3)]
    ckpt = s3.url("ckpt")
    save_checkpoint(loader, ckpt, storage_options=so)
    rest = [item_key(next(it)) for _ in range(3)]
    fingerprint._digests.clear()  # a new process: nothing known
    with count_s3_requests() as restore:
        again = TokenLoader(build)
        load_checkpoint(again, ckpt, storage_options=so)
    assert restore["RANGE_GET"] == 0  # the listed ETags are the recorded ones
    assert [item_key(x) for x, _ in zip(again, range(3))] == rest
    # a rewritten object (same size, another ETag) is read and refused, naming it
    write_arrow_batches(f"{root}/code/p1.arrow", [np.arange(40, 60, dtype=np.uint32)] * 15,
                        storage_options=so)  # fmt: skip
    with count_s3_requests() as changed, pytest.raises(ChangedFilesError, match=r"code.*p1\.arrow"):
        load_checkpoint(TokenLoader(build), ckpt, storage_options=so)
    assert changed["RANGE_GET"] in (1, 2)  # that file only (1 read when <= 128 KiB)


# -- saves read no data file once the job has its digests -----------------------------------------
def _saved(loader: TokenLoader, ckpt: str, so: dict, monkeypatch) -> tuple[Counter, list[str]]:
    """The requests of one ``save_checkpoint`` and the data files it fingerprinted."""
    reads = counted_fingerprint_reads(monkeypatch)
    with count_s3_requests() as c:
        save_checkpoint(loader, ckpt, storage_options=so)
    return c, sorted(reads)


# one save of one rank, one worker on S3: the old manifest's DELETE, the worker's and the rank's
# files and the manifest (a PUT each), their folder checks; nothing else
SAVE = Counter({"PUT": 3, "DELETE": 1})


def _save_counts(c: Counter) -> Counter:
    return Counter({k: v for k, v in c.items() if k in ("PUT", "DELETE", "RANGE_GET")})


def test_a_second_save_reads_no_data_file(s3, monkeypatch) -> None:
    """Without index files the first save of a process fingerprints every data file (one
    range read each: they are <= 128 KiB); every later save reads none of them."""
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    monkeypatch.setattr(fingerprint, "_digests", {})
    loader = TokenLoader(functools.partial(build_pipeline, _cfg(root, so), collate=False))
    it = iter(loader)
    next(it)
    first, read = _saved(loader, s3.url("c1"), so, monkeypatch)
    assert read == ["p0.arrow", "p0.arrow", "p1.arrow", "p1.arrow"]  # web's and code's
    assert _save_counts(first) == SAVE + Counter({"RANGE_GET": 4})
    next(it)
    second, read = _saved(loader, s3.url("c2"), so, monkeypatch)
    assert read == [] and _save_counts(second) == SAVE
    assert "LIST" not in second


def test_a_save_takes_the_digests_of_the_index_file(s3, monkeypatch) -> None:
    """The index file records every object's sampled sha256 with its ETag: a new process that
    read it saves without reading a data file; a restore then reads none either, nor does the
    save after it (the checkpoint's digests of the objects listed unchanged are kept)."""
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    write_index_files(root, NAMES, storage_options=so)
    body = json.loads(read_side_file(index_file_url(f"{root}/web"), so) or b"")
    assert len(body["sha256"]) == 2 and all(len(d) == 32 for d in body["sha256"])
    build = functools.partial(build_pipeline, _cfg(root, so), collate=False)
    monkeypatch.setattr(fingerprint, "_digests", {})  # a new process
    loader = TokenLoader(build)
    it = iter(loader)
    next(it)
    first, read = _saved(loader, s3.url("c1"), so, monkeypatch)
    assert read == [] and _save_counts(first) == SAVE
    rest = [item_key(next(it)) for _ in range(2)]
    monkeypatch.setattr(fingerprint, "_digests", {})  # a new process restores
    again = TokenLoader(build)
    load_checkpoint(again, s3.url("c1"), storage_options=so)
    assert [item_key(x) for x, _ in zip(again, range(2))] == rest
    after, read = _saved(again, s3.url("c2"), so, monkeypatch)
    assert read == [] and _save_counts(after) == SAVE
    # an object rewritten under the checkpoint (a new ETag) is still refused: by a new
    # process's rank 0, which lists the folder against the index file
    write_arrow_batches(f"{root}/code/p1.arrow", [np.arange(40, 60, dtype=np.uint32)] * 15,
                        storage_options=so)  # fmt: skip
    monkeypatch.setattr(fingerprint, "_digests", {})
    monkeypatch.setattr(index_file, "_verified", set())
    with pytest.raises(StaleIndexError, match=r"code changed since it was written: p1\.arrow"):
        load_checkpoint(TokenLoader(build), s3.url("c2"), storage_options=so)
    # without the index file the checkpoint's own check reads that object and refuses it
    monkeypatch.setattr(fingerprint, "_digests", {})
    for name in NAMES:
        remove_file(index_file_url(f"{root}/{name}"), so)
    with pytest.raises(ChangedFilesError, match=r"'code': 1 file\(s\): p1\.arrow \(size \d+ -> \d+; first/last 64 KiB "
                       r"differ; version ETag="):  # fmt: skip
        load_checkpoint(TokenLoader(build), s3.url("c2"), storage_options=so)


def test_digests_are_kept_only_for_content_versions() -> None:
    """A modification time can stay while the bytes change: only an ETag or a generation
    (which change with every rewrite) lets a digest computed elsewhere stand for the file."""
    fp = {"size": 10, "sha256": "ab" * 16}
    kept = fingerprint.remember_digests(
        ["s3://b/x", "gs://b/y", "/d/z", "s3://b/w", "s3://b/v"],
        [{**fp, "version": 'ETag="1"'}, {**fp, "version": "generation=7"},
         {**fp, "version": "mtime=17.5"}, {**fp, "version": 'ETag="2"', "sha256": ""},
         {**fp, "version": 'ETag="3"', "size": -1}],
    )  # fmt: skip
    assert kept == 2
    assert ("s3://b/x", 10, 'ETag="1"') in fingerprint._digests
    assert ("/d/z", 10, "mtime=17.5") not in fingerprint._digests
    with pytest.raises(ValueError, match="1 fingerprints for 2 urls; pass one fingerprint each"):
        fingerprint.remember_digests(["a", "b"], [fp])


# -- ranks without a process group share the fingerprint reads ---------------------------------
def test_ranks_without_a_process_group_check_their_share(tmp_path: Path, monkeypatch) -> None:
    """Ranks given as rank=/world_size= (no torch.distributed) each check every world_size-th
    file and the files their own shards read (test_changed_files_ranks.py); the rank that
    reads or checks a changed file raises, naming itself and the file."""
    root = str(tmp_path / "data")
    write_random_arrow_datasets(root, (("web", 40, 20),), seed=4)
    for k in (2, 3):
        write_arrow_batches(f"{root}/web/p{k}.arrow", [np.arange(5, 9 + k, dtype=np.uint32)] * 3)
    cfg = PipelineConfig(data_path=root, datasets="web", seq_length=16, logical_shards=8,
                         batch_size=2, shuffle_buffer=3, block_docs=4, seed=1)  # fmt: skip
    build = functools.partial(build_pipeline, cfg, collate=False)
    for r in range(2):
        loader = TokenLoader(build, rank=r, world_size=2)
        next(iter(loader))
        save_checkpoint(loader, str(tmp_path / "c"))
    reads = counted_fingerprint_reads(monkeypatch)
    per_rank = []
    for r in range(2):  # each rank a process of its own: nothing known from the other
        monkeypatch.setattr(fingerprint, "_digests", {})
        reads.clear()
        load_checkpoint(TokenLoader(build, rank=r, world_size=2), str(tmp_path / "c"))
        per_rank.append(sorted(reads))
    # shares p0, p2 and p1, p3; 8 shards over 46 documents (20, 20, 3, 3): rank 0's read
    # documents 0-22 (p0, p1), rank 1's 23-45 (p1, p2, p3)
    assert per_rank == [["p0.arrow", "p1.arrow", "p2.arrow"], ["p1.arrow", "p2.arrow", "p3.arrow"]]
    before = (Path(root) / "web" / "p3.arrow").stat()
    write_arrow_batches(f"{root}/web/p3.arrow", [np.arange(6, 13, dtype=np.uint32)] * 3)
    assert (Path(root) / "web" / "p3.arrow").stat().st_size == before.st_size
    monkeypatch.setattr(fingerprint, "_digests", {})
    load_checkpoint(TokenLoader(build, rank=0, world_size=2), str(tmp_path / "c"))  # not read
    with pytest.raises(ChangedFilesError) as e:
        load_checkpoint(TokenLoader(build, rank=1, world_size=2), str(tmp_path / "c"))
    assert "(rank 1 of 2 checks every 2-th file and those its shards read)" in str(e.value)
    assert "dataset 'web': 1 file(s): p3.arrow (first/last 64 KiB differ; version" in str(e.value)


# -- torch.distributed: rank 0 lists, the indexes are broadcast ---------------------------------
def _dist_rank(rank: int, init: str, root: str, ckpt: str, so: dict, out: str) -> None:
    import torch.distributed as dist

    init_gloo(init, rank, 3)
    try:
        cfg = _cfg(root, so)
        with count_s3_requests() as listing:
            datasets = build_datasets(cfg)
        build = functools.partial(build_pipeline, cfg, datasets=datasets, collate=False)
        with count_s3_requests() as graphs:
            for w in range(2):
                build(World(rank, 3, w, 2))
        loader = TokenLoader(build)
        next(iter(loader))
        with count_s3_requests() as save:
            save_checkpoint(loader, ckpt, storage_options=so)
        fingerprint._digests.clear()
        with count_s3_requests() as restore:
            load_checkpoint(TokenLoader(build), ckpt, storage_options=so)
        Path(out, f"{rank}.json").write_text(json.dumps({
            "files": {n: len(ix.files) for n, ix in datasets.items()},
            "listing": dict(listing), "graphs": dict(graphs), "restore": dict(restore),
            "save": dict(save),
        }))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torch_distributed_rank_0_lists_and_the_index_is_broadcast(s3, tmp_path) -> None:

    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    init = rendezvous(tmp_path)
    run_ranks(_dist_rank, (init, root, s3.url("ckpt"), so, str(tmp_path)), 3)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert all(g["files"] == {"web": 2, "code": 2} for g in got)
    assert got[0]["listing"]["LIST"] >= 2 * len(NAMES)  # rank 0 lists and reads the counts
    for g in got[1:]:
        assert g["listing"] == {}  # the others ask the store for nothing
    for g in got:
        assert g["graphs"] == {}  # nor does any worker's graph (prepared metadata included)
        assert "LIST" not in g["restore"] and "RANGE_GET" not in g["restore"]
    # no index files: each data file (<= 128 KiB: one range read) is read once in the job,
    # by the rank whose share it is
    assert sum(g["save"].get("RANGE_GET", 0) for g in got) == 2 * len(NAMES)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torch_distributed_the_index_file_digests_reach_every_rank(s3, tmp_path) -> None:
    """Rank 0 reads the index files, which record every object's sampled sha256: those digests
    are broadcast with the indexes, so no rank reads a data file at a save."""

    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    write_index_files(root, NAMES, storage_options=so)
    init = rendezvous(tmp_path)
    run_ranks(_dist_rank, (init, root, s3.url("ckpt"), so, str(tmp_path)), 3)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert all(g["files"] == {"web": 2, "code": 2} for g in got)
    for g in got[1:]:  # rank 0 reads the index files (and lists to check them), no other rank
        assert g["listing"] == {}
    for g in got:
        assert "RANGE_GET" not in g["save"] and "LIST" not in g["save"], g["save"]
        assert "LIST" not in g["restore"] and "RANGE_GET" not in g["restore"], g["restore"]


# -- a restore and a rescale read each index file once per rank ---------------------------------
def _side_reads(c: Counter) -> dict[str, int]:
    """GETs of the index and prepared-metadata files in counts by object, by file name."""
    return {
        k.split(" ", 1)[1].split("/", 2)[2]: n
        for k, n in c.items()
        if k.startswith("GET ") and k.endswith((INDEX_FILE, "torchdata_ext_meta.json"))
    }


def test_a_restore_and_a_rescale_read_each_index_file_once_per_rank(s3, monkeypatch) -> None:
    """Ranks without a process group over index files: a restore (same 2 ranks) and a rescale
    (2 -> 3 ranks) read each dataset's index file and prepared metadata once per rank (the
    graphs built at load_checkpoint and at iter() share the indexes), and deliver the rest of
    the stream exactly."""
    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    write_index_files(root, NAMES, storage_options=so)
    build = functools.partial(build_pipeline, _cfg(root, so), collate=False)
    ckpt, once = (
        s3.url("ckpt"),
        {f"{name}/meta/{f}": 1 for name in NAMES for f in (INDEX_FILE, "torchdata_ext_meta.json")},
    )
    loaders = [TokenLoader(build, rank=r, world_size=2) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for loader, it in zip(loaders, its):
        next(it)
        save_checkpoint(loader, ckpt, storage_options=so)
    rest = [[item_key(next(it)) for _ in range(2)] for it in its]
    for world_size in (2, 3):  # each rank a new process: nothing known, index files unchecked
        for r in range(world_size):
            monkeypatch.setattr(fingerprint, "_digests", {})
            monkeypatch.setattr(index_file, "_verified", set())
            with count_s3_objects() as c:
                again = TokenLoader(build, rank=r, world_size=world_size)
                load_checkpoint(again, ckpt, storage_options=so)
                got = [item_key(x) for x, _ in zip(again, range(2))]
            assert _side_reads(c) == once, (world_size, r, c)
            if world_size == 2:
                assert got == rest[r]


def test_a_rank_other_than_0_restores_with_gets_alone(s3, monkeypatch) -> None:
    """Over index files, a new process of rank 1 of 2 restores with: the store probe (a GET
    of an absent key, never a LIST), its index and metadata files and the checkpoint's
    manifest, rank and worker files, one GET each and no HEAD; then the data it reads (a
    HEAD and a GET per file). Nothing else, no LIST."""
    from torchdata_ext.remote.probe import PROBE_KEY
    from torchdata_ext.remote.process_state import PROBED_STORES

    root, so = s3.url("data"), s3.storage_options
    _corpus(root, so)
    write_index_files(root, NAMES, storage_options=so)
    build = functools.partial(build_pipeline, _cfg(root, so), collate=False)
    ckpt = s3.url("ckpt")
    for r in range(2):
        loader = TokenLoader(build, rank=r, world_size=2)
        next(iter(loader))
        save_checkpoint(loader, ckpt, storage_options=so)
    monkeypatch.setattr(fingerprint, "_digests", {})  # a new process
    monkeypatch.setattr(index_file, "_verified", set())
    monkeypatch.setattr(PROBED_STORES, "items", {})
    with count_s3_objects() as c:
        load_checkpoint(TokenLoader(build, rank=1, world_size=2), ckpt, storage_options=so)
    bucket = s3.bucket
    files = [f"ckpt/{f}" for f in ("manifest.json", "rank_00001.json", "worker_000001.pkl")]
    files += [f"data/{n}/meta/{f}" for n in NAMES for f in (INDEX_FILE, "torchdata_ext_meta.json")]
    expected = Counter({f"GET {bucket}/{f}": 1 for f in [PROBE_KEY, *files]})
    assert Counter({k: n for k, n in c.items() if not k.endswith(".arrow")}) == expected
