"""A data file changed in place under a checkpoint is caught, naming it; the override works;
unchanged data restores exactly; each file is read (128 KiB, range reads) once per process."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from _gloo import init_gloo, rendezvous, run_ranks
from harness import counted_fingerprint_reads, item_key

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.checkpoint.folder import _sealed_json, load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.sources import fingerprint
from torchdata_ext.sources.fingerprint import (
    SAMPLE_BYTES,
    ChangedFilesError,
    FileChange,
    compare,
    file_fingerprint,
)
from torchdata_ext.testing import write_arrow_batches

LENGTHS = np.random.default_rng(5).integers(1, 30, 120)


def _docs(seed: int) -> list[np.ndarray]:
    """120 documents of LENGTHS with tokens drawn from ``seed``: another seed gives the same
    document lengths (the same file size) with other tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 9000, n).astype(np.uint32) for n in LENGTHS]


def _write(root: str, name: str, docs: list[np.ndarray]) -> None:
    write_arrow_batches(f"{root}/{name}", docs)


def _size(url: str) -> int:
    fs, path = fsspec.core.url_to_fs(url)
    return int(fs.info(path)["size"])


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A dataset of two Arrow files, on local disk or on ``memory://``."""
    base = (
        str(tmp_path / "web") if request.param == "local" else f"memory://fp-{uuid.uuid4().hex}/web"
    )
    docs = _docs(1)
    _write(base, "p0.arrow", docs[:60])
    _write(base, "p1.arrow", docs[60:])
    return base


def build(root: str, world: World) -> ShardReader:
    return ShardReader(DatasetIndex.build(root), 8, world=world, block_docs=4, seed=1)


def take(it, n: int) -> list:
    return [item_key(x) for _, x in zip(range(n), it)]


def loader_of(root: str, rank: int = 0, ranks: int = 1) -> TokenLoader:
    return TokenLoader(functools.partial(build, root), rank=rank, world_size=ranks)


def saved(root: str, folder: Path) -> tuple[Path, list]:
    """A checkpoint after 3 batches, and the 6 batches the run delivers after it."""
    loader = loader_of(root)
    it = iter(loader)
    take(it, 3)
    save_checkpoint(loader, str(folder))
    return folder, take(it, 6)


def rewrite_p1(root: str) -> None:
    """p1.arrow rewritten in place: same name, size and document lengths, other tokens."""
    before = _size(f"{root}/p1.arrow")
    _write(root, "p1.arrow", _docs(2)[60:])
    assert _size(f"{root}/p1.arrow") == before


def test_unchanged_data_restores_exactly(root: str, tmp_path: Path) -> None:
    ckpt, rest = saved(root, tmp_path / "c")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    recorded = manifest["file_fingerprints"]
    assert recorded["sample_bytes"] == SAMPLE_BYTES == 65536
    files = recorded["datasets"]["web"]
    assert sorted(files) == ["p0.arrow", "p1.arrow"]
    assert files["p1.arrow"]["size"] == _size(f"{root}/p1.arrow")
    loader = loader_of(root)
    load_checkpoint(loader, str(ckpt))
    assert take(iter(loader), 6) == rest


def test_a_file_rewritten_in_place_is_refused_naming_it(root: str, tmp_path: Path) -> None:
    ckpt, _ = saved(root, tmp_path / "c")
    rewrite_p1(root)
    # same names and document counts: the dataset fingerprint alone does not see it
    assert (
        DatasetIndex.build(root).fingerprint()
        == json.loads((ckpt / "manifest.json").read_text())["datasets"]["web"]["fingerprint"]
    )
    with pytest.raises(ChangedFilesError, match=r"dataset 'web': 1 file\(s\): p1\.arrow \(") as e:
        load_checkpoint(loader_of(root), str(ckpt))
    assert "first/last 64 KiB" in str(e.value) and "allow_changed_files=True" in str(e.value)
    [change] = e.value.changes["web"]
    assert change.file == "p1.arrow" and "sha256" in change.what and "size" not in change.what
    # a restore onto another topology (2 ranks) is refused the same way, before any state is read
    with pytest.raises(ChangedFilesError, match=r"p1\.arrow"):
        load_checkpoint(loader_of(root, rank=1, ranks=2), str(ckpt))


def test_a_file_with_other_document_counts_is_named(root: str, tmp_path: Path) -> None:
    ckpt, _ = saved(root, tmp_path / "c")
    _write(root, "p1.arrow", _docs(1)[60:100])  # 40 documents instead of 60
    with pytest.raises(ValueError, match=r"document counts differ.*changed files: dataset 'web': "
                       r"1 file\(s\): p1\.arrow \(size \d+ -> \d+\)") as e:  # fmt: skip
        load_checkpoint(loader_of(root), str(ckpt), allow_changed_files=True)
    assert "p0.arrow" not in str(e.value)


def test_the_override_restores_with_a_warning_naming_the_file(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, _ = saved(root, tmp_path / "c")
    rewrite_p1(root)
    loader = loader_of(root)
    with caplog.at_level(logging.WARNING, logger="torchdata_ext.sources.fingerprint"):
        load_checkpoint(loader, str(ckpt), allow_changed_files=True)
    assert "p1.arrow" in caplog.text and "p0.arrow" not in caplog.text
    # the positions apply to the new tokens: the stream goes on as a run over the new data would
    fresh = iter(loader_of(root))
    take(fresh, 3)
    assert take(iter(loader), 6) == take(fresh, 6)


def test_each_file_is_read_once_per_process(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fingerprint, "_digests", {})
    reads = counted_fingerprint_reads(monkeypatch)
    loader = loader_of(root)
    it = iter(loader)
    take(it, 2)
    save_checkpoint(loader, str(tmp_path / "a"))
    take(it, 2)
    save_checkpoint(loader, str(tmp_path / "b"))
    load_checkpoint(loader_of(root), str(tmp_path / "b"))
    assert sorted(reads) == ["p0.arrow", "p1.arrow"]
    rewrite_p1(root)  # a new version is read again, and caught
    with pytest.raises(ChangedFilesError, match=r"p1\.arrow"):
        load_checkpoint(loader_of(root), str(tmp_path / "b"))
    assert sorted(reads) == ["p0.arrow", "p1.arrow", "p1.arrow"]


def test_in_memory_datasets_have_no_files_to_fingerprint(tmp_path: Path) -> None:
    docs = _docs(1)

    def build_memory(world: World) -> ShardReader:
        return ShardReader(DatasetIndex.from_documents("mem", docs), 8, world=world, seed=1)

    loader = TokenLoader(build_memory, rank=0, world_size=1)
    it = iter(loader)
    take(it, 2)
    save_checkpoint(loader, str(tmp_path / "c"))
    rest = take(it, 3)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["file_fingerprints"]["datasets"] == {"mem": {}}
    again = TokenLoader(build_memory, rank=0, world_size=1)
    load_checkpoint(again, str(tmp_path / "c"))
    assert take(iter(again), 3) == rest


def test_a_checkpoint_without_file_fingerprints_still_loads(root: str, tmp_path: Path) -> None:
    ckpt, rest = saved(root, tmp_path / "c")
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["sha256"], manifest["file_fingerprints"]  # as the previous version wrote it
    path.write_bytes(_sealed_json(manifest))
    loader = loader_of(root)
    load_checkpoint(loader, str(ckpt))
    assert take(iter(loader), 6) == rest


# -- the fingerprint itself --------------------------------------------------------------------
def _expected_digest(data: bytes) -> str:
    head, tail = data[:SAMPLE_BYTES], data[max(SAMPLE_BYTES, len(data) - SAMPLE_BYTES) :]
    return hashlib.sha256(head + tail).hexdigest()[:32]


@pytest.mark.parametrize("size", [0, 10, SAMPLE_BYTES + 7, 3 * SAMPLE_BYTES + 1])
def test_digest_is_of_the_first_and_last_64_kib(size: int, tmp_path: Path) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for url in (str(tmp_path / "f.bin"), f"memory://fp-{uuid.uuid4().hex}/f.bin"):
        fs, path = fsspec.core.url_to_fs(url)
        fs.pipe_file(path, data)
        fp = file_fingerprint(url)
        assert fp["size"] == size and fp["sha256"] == _expected_digest(data)
        assert fp["version"].startswith("mtime=" if url.startswith("/") else "created=")


def test_a_change_in_the_middle_shows_in_the_version_only(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 4 * SAMPLE_BYTES, np.uint8))
    path.write_bytes(data)
    os.utime(path, (1_700_000_000, 1_700_000_000))
    before = file_fingerprint(str(path))
    with open(path, "r+b") as f:  # in place, past the first 64 KiB and before the last
        f.seek(2 * SAMPLE_BYTES)
        f.write(b"changed")
    os.utime(path, (1_700_000_100, 1_700_000_100))
    after = file_fingerprint(str(path))
    [change] = compare({"big.bin": before}, {"big.bin": after})
    assert change.what == ("version",)
    assert "version mtime=1700000000.0 -> mtime=1700000100.0" in str(change)


def test_compare_names_what_differs() -> None:
    fp = {"size": 10, "version": "mtime=1.0", "sha256": "aa"}
    assert compare({"a": fp}, {"a": dict(fp)}) == []
    got = compare(
        {"a": fp, "gone": fp, "b": fp, "c": fp},
        {
            "a": {**fp, "size": 11, "sha256": "bb"},
            "b": {**fp, "version": 'ETag="x"'},  # copied to another store: not comparable
            "c": {**fp, "size": -1, "sha256": ""},  # unknown: not compared
            "new": fp,
        },
    )
    assert [(c.file, c.what) for c in got] == [
        ("a", ("size", "sha256")),
        ("gone", ("missing",)),
        ("new", ("new",)),
    ]
    assert str(got[0]) == "a (size 10 -> 11; first/last 64 KiB differ)"
    assert isinstance(got[1], FileChange) and str(got[1]) == "gone (missing now)"


def test_copies_match_when_times_are_kept(tmp_path: Path) -> None:
    root = str(tmp_path / "web")
    _write(root, "p0.arrow", _docs(1)[:60])
    _write(root, "p1.arrow", _docs(1)[60:])
    kept, lost = tmp_path / "kept", tmp_path / "lost"
    kept.mkdir(), lost.mkdir()
    for name in ("p0.arrow", "p1.arrow"):
        shutil.copy2(f"{root}/{name}", kept / name)  # keeps the modification time
        shutil.copy(f"{root}/{name}", lost / name)
        os.utime(lost / name, (1_600_000_000, 1_600_000_000))
    original = DatasetIndex.build(root).file_fingerprints()
    assert compare(original, DatasetIndex.build(str(kept)).file_fingerprints()) == []
    changed = compare(original, DatasetIndex.build(str(lost)).file_fingerprints())
    assert [(c.file, c.what) for c in changed] == [
        ("p0.arrow", ("version",)),
        ("p1.arrow", ("version",)),
    ]


def test_remote_files_are_sampled_with_range_reads(s3, monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(1).integers(0, 256, 5 * SAMPLE_BYTES, np.uint8).tobytes()
    url = s3.url("big.bin")
    fs, path = filesystem(url, s3.storage_options)  # the instance the fingerprint uses
    fs.pipe_file(path, data)
    ranges: list[tuple] = []
    real = fs.cat_file

    def recording(path, start=None, end=None, **kw):
        ranges.append((start, end))
        return real(path, start=start, end=end, **kw)

    monkeypatch.setattr(fs, "cat_file", recording)
    fp = file_fingerprint(url, s3.storage_options)
    assert fp["size"] == len(data) and fp["version"].startswith("ETag=")
    assert fp["sha256"] == _expected_digest(data)
    assert ranges == [(0, SAMPLE_BYTES), (4 * SAMPLE_BYTES, 5 * SAMPLE_BYTES)]
    # many files: read on a thread pool through the same client, each digest its own file's
    blobs = [data[k * 1000 : k * 1000 + 70_000 + k] for k in range(5)]
    urls = [s3.url(f"f{k}.bin") for k in range(5)]
    for u, b in zip(urls, blobs):
        fs.pipe_file(filesystem(u, s3.storage_options)[1], b)
    got = fingerprint.file_fingerprints(urls, s3.storage_options)
    assert [g["sha256"] for g in got] == [_expected_digest(b) for b in blobs]


# -- torch.distributed: each rank reads a share, every rank gets every file ---------------------
def _counted_reads() -> list[str]:
    """The fingerprint reads of this spawned rank (see ``harness.counted_fingerprint_reads``)."""
    return counted_fingerprint_reads()


def _rank_main(rank: int, init: str, root: str, folder: str, out: str) -> None:
    import torch.distributed as dist

    init_gloo(init, rank, 2)
    try:
        read = _counted_reads()
        loader = loader_of(root, rank=rank, ranks=2)
        take(iter(loader), 2)
        save_checkpoint(loader, folder)
        load_checkpoint(loader_of(root, rank=rank, ranks=2), folder)  # unchanged: loads
        dist.barrier()
        if rank == 0:
            rewrite_p1(root)
        dist.barrier()
        try:
            load_checkpoint(loader_of(root, rank=rank, ranks=2), folder)
            error = ""
        except ChangedFilesError as exc:
            error = str(exc)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"read": read, "error": error}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_share_the_reads_and_all_refuse_a_changed_file(tmp_path: Path) -> None:

    root = str(tmp_path / "web")
    _write(root, "p0.arrow", _docs(1)[:60])
    _write(root, "p1.arrow", _docs(1)[60:])
    init = rendezvous(tmp_path)
    run_ranks(_rank_main, (init, root, str(tmp_path / "c"), str(tmp_path)), 2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 0 fingerprinted p0 and rank 1 p1, once each before the change; p1's new version once
    assert got[0]["read"] == ["p0.arrow"]
    assert got[1]["read"] == ["p1.arrow", "p1.arrow"]
    for g in got:  # every rank refuses, naming the file another rank read
        assert "dataset 'web': 1 file(s): p1.arrow (" in g["error"]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert sorted(manifest["file_fingerprints"]["datasets"]["web"]) == ["p0.arrow", "p1.arrow"]


# -- torch.distributed.checkpoint: each rank records and checks its share of the files ---------
def _dcp_saved(root: str, folder: Path) -> list:
    """A DCP checkpoint of a loader after 3 batches; the 6 batches the run delivers after it."""
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    loader = loader_of(root)
    it = iter(loader)
    take(it, 3)
    dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(folder))
    return take(it, 6)


def _dcp_load(root: str, folder: Path, **kw) -> TokenLoader:
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    loader = loader_of(root)
    dcp.load({"data": DCPLoaderState(loader, **kw)}, checkpoint_id=str(folder))
    return loader


def test_dcp_refuses_a_file_rewritten_in_place_and_the_override_loads(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rest = _dcp_saved(root, tmp_path / "dcp")
    assert take(iter(_dcp_load(root, tmp_path / "dcp")), 6) == rest  # unchanged: exact
    rewrite_p1(root)
    with pytest.raises(ChangedFilesError, match=r"dataset 'web': 1 file\(s\): p1\.arrow \("):
        _dcp_load(root, tmp_path / "dcp")
    with caplog.at_level(logging.WARNING, logger="torchdata_ext.sources.fingerprint"):
        loader = _dcp_load(root, tmp_path / "dcp", allow_changed_files=True)
    assert "p1.arrow" in caplog.text and "allow_changed_files=True" in caplog.text
    assert len(take(iter(loader), 6)) == 6


def test_a_dcp_state_saved_before_fingerprints_still_loads(root: str, tmp_path: Path) -> None:
    """What DCPLoaderState stored before it recorded fingerprints: the pickled loader state
    alone under the rank's key. It restores exactly, unchecked."""
    import io
    import pickle

    import torch.distributed.checkpoint as dcp

    class Earlier:
        def __init__(self, loader: TokenLoader) -> None:
            self.loader = loader

        def state_dict(self) -> dict:
            return {"rank_00000": io.BytesIO(pickle.dumps(self.loader.state_dict()))}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("not used")

    loader = loader_of(root)
    it = iter(loader)
    take(it, 3)
    dcp.save({"data": Earlier(loader)}, checkpoint_id=str(tmp_path / "dcp"))
    rest = take(it, 6)
    assert take(iter(_dcp_load(root, tmp_path / "dcp")), 6) == rest
    rewrite_p1(root)  # nothing recorded, nothing to compare with: loads (the data is new)
    assert len(take(iter(_dcp_load(root, tmp_path / "dcp")), 6)) == 6


def _dcp_rank_main(rank: int, init: str, root: str, folder: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    init_gloo(init, rank, 2)
    try:
        read = _counted_reads()
        loader = loader_of(root, rank=rank, ranks=2)
        take(iter(loader), 2)
        dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=folder)
        fresh = loader_of(root, rank=rank, ranks=2)
        dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=folder)  # unchanged: loads
        dist.barrier()
        if rank == 0:
            rewrite_p1(root)
        dist.barrier()
        try:
            again = loader_of(root, rank=rank, ranks=2)
            dcp.load({"data": DCPLoaderState(again)}, checkpoint_id=folder)
            error = ""
        except ChangedFilesError as exc:
            error = str(exc)
        Path(out, f"dcp{rank}.json").write_text(json.dumps({"read": read, "error": error}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dcp_ranks_record_their_share_and_all_refuse_a_changed_file(tmp_path: Path) -> None:

    root = str(tmp_path / "web")
    _write(root, "p0.arrow", _docs(1)[:60])
    _write(root, "p1.arrow", _docs(1)[60:])
    init = rendezvous(tmp_path)
    run_ranks(_dcp_rank_main, (init, root, str(tmp_path / "dcp"), str(tmp_path)), 2)
    got = [json.loads((tmp_path / f"dcp{r}.json").read_text()) for r in range(2)]
    # rank 0 records and checks p0, rank 1 p1 (and p1's new version): no rank reads every file
    assert got[0]["read"] == ["p0.arrow"]
    assert got[1]["read"] == ["p1.arrow", "p1.arrow"]
    for g in got:  # every rank refuses, naming the file another rank found changed
        assert "dataset 'web': 1 file(s): p1.arrow (" in g["error"], g


def test_saves_after_the_first_build_no_graph(root: str, tmp_path: Path) -> None:
    """The datasets and weights a checkpoint records are found once per loader: a later save
    (folder or DCP) builds no graph, so it lists no folder (a request per folder on S3)."""
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    builds: list[World] = []

    def counting(world: World) -> ShardReader:
        builds.append(world)
        return build(root, world)

    loader = TokenLoader(counting)
    it = iter(loader)
    take(it, 2)
    save_checkpoint(loader, str(tmp_path / "c1"))
    before = len(builds)
    take(it, 2)
    save_checkpoint(loader, str(tmp_path / "c2"))
    dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "dcp"))
    assert len(builds) == before
    again = loader_of(root)
    load_checkpoint(again, str(tmp_path / "c2"))
    assert take(iter(again), 3) == take(it, 3)


class _UnreadableOnRank1:
    """A dataset whose files rank 1 cannot read (a store down, a file gone from its index)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def file_names(self) -> list[str]:
        return ["p0.arrow", "p1.arrow"]

    def file_fingerprints(self, which: list[int]) -> dict:
        if self.rank == 1:
            raise OSError("the store cannot be reached")
        return {self.file_names()[i]: {"size": 1, "version": "v", "sha256": "ab"} for i in which}


def _check_share_rank_main(rank: int, init: str, out: str) -> None:
    import datetime
    import time

    import torch.distributed as dist

    from torchdata_ext.sources.fingerprint import SAMPLE_BYTES, check_share

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S),
    )
    try:
        recorded = {
            "sample_bytes": SAMPLE_BYTES,
            "datasets": {"web": {f"p{rank}.arrow": {"size": 1, "version": "v", "sha256": "ab"}}},
        }
        try:
            check_share(recorded, {"web": _UnreadableOnRank1(rank)}, world_size=2)
            outcome = ""
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        Path(out, f"share{rank}.txt").write_text(outcome)
        # rank 1 stays (as a process that caught the error would) until rank 0 has its answer
        deadline = time.monotonic() + 40
        while rank == 1 and not Path(out, "share0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dist.destroy_process_group()


_GROUP_TIMEOUT_S = 120


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_that_cannot_read_its_share_fails_every_rank_at_once(tmp_path: Path) -> None:
    """check_share is a collective: a rank that cannot read its share of the files must still
    take part, so the other ranks learn of its error (naming the rank) instead of waiting in
    the gather until the process group times out."""
    import time

    init = rendezvous(tmp_path)
    t0 = time.monotonic()
    run_ranks(_check_share_rank_main, (init, str(tmp_path)), 2)
    got = [(tmp_path / f"share{r}.txt").read_text() for r in range(2)]
    assert got[1] == "OSError: the store cannot be reached"
    assert got[0].startswith("RuntimeError: rank 1 could not check"), got[0]
    assert "the store cannot be reached" in got[0]
    # no rank waited for the group's timeout (the margin covers two processes importing torch on
    # a loaded 2-core machine, which alone took 21 s once)
    assert time.monotonic() - t0 < _GROUP_TIMEOUT_S / 2
