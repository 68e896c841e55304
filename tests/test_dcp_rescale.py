"""Rescale through ``torch.distributed.checkpoint`` alone: ``dcp.save`` at R x W, ``dcp.load``
at R' x W' with the same ``DCPLoaderState(loader)``, exactly once over the epoch.

Real gloo ranks are spawned per phase; each rank records the sequences it delivered (their
provenance) and the DCP entries its load read, so the test checks every token of every document
was delivered exactly once and that each rank read only the old workers it needed.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from _gloo import init_gloo, rendezvous, run_ranks
from harness import check_exactly_once, document_lengths, write_random_arrow_datasets
from torch.distributed.checkpoint.stateful import Stateful

from torchdata_ext import World
from torchdata_ext.checkpoint import dcp_entries
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.dcp_entries import LoadInProgress
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.sources.fingerprint import ChangedFilesError

NAMES = ["web", "code"]


def _config(root: str, **extra: Any) -> PipelineConfig:
    fields: dict[str, Any] = dict(
        data_path=root, datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip
    return PipelineConfig(**{**fields, **extra})


def _build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world, collate=False)


def _pieces(seqs: list[dict]) -> list[list[int]]:
    """Each delivered sequence's document pieces ``[dataset, file, doc, start, stop]``."""
    out = []
    for seq in seqs:
        for ds, f, d, start, length in np.asarray(seq["provenance"]).tolist():
            if ds not in (LITERAL, PAD):
                out.append([ds, f, d, start, start + length])
    return out


def _recording(base: type) -> type:
    """A DCP storage reader class that records the keys of the entries it reads."""

    class Recording(base):  # type: ignore[misc, valid-type]
        read: list[str] = []

        def read_data(self, plan, planner):
            Recording.read.extend(item.storage_index.fqn for item in plan.items)
            return super().read_data(plan, planner)

    return Recording


def _storage(url: str, options: dict | None, write: bool) -> Any:
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        return FsspecWriter(url, **options) if write else _recording(FsspecReader)(url, **options)
    return dcp.FileSystemWriter(url) if write else _recording(dcp.FileSystemReader)(url)


def _phase_main(
    rank: int,
    ranks: int,
    init: str,
    root: str,
    workers: int,
    load_from: str | None,
    steps: int | None,
    save_to: str | None,
    options: dict | None,
    out: str,
) -> None:
    """One rank of a phase: restore (from DCP), deliver ``steps`` sequences (None: to the end
    of the epoch), save (to DCP); writes what it delivered and read to ``out``."""
    warnings.simplefilter("ignore")
    init_gloo(init, rank, ranks)
    try:
        loader = TokenLoader(functools.partial(_build, _config(root)), num_workers=workers)
        read: list[str] = []
        if load_from is not None:
            reader = _storage(load_from, options, write=False)
            dcp.load({"data": DCPLoaderState(loader)}, storage_reader=reader)
            read = sorted(type(reader).read)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if steps is not None and len(seqs) >= steps:
                break
        if save_to is not None:
            dcp.save(
                {"data": DCPLoaderState(loader)}, storage_writer=_storage(save_to, options, True)
            )
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"pieces": _pieces(seqs), "read": read})
        )
    finally:
        dist.destroy_process_group()


def _run_phase(
    tmp: Path, name: str, ranks: int, workers: int, root: str, load_from: str | None,
    steps: int | None, save_to: str | None, options: dict | None = None,
) -> list[dict]:  # fmt: skip

    out = tmp / name
    out.mkdir()
    init = rendezvous(tmp)
    args = (ranks, init, root, workers, load_from, steps, save_to, options, str(out))
    run_ranks(_phase_main, args, ranks)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _coverage(phases: list[list[dict]]) -> dict:
    coverage: dict = {}
    for ranks in phases:
        for got in ranks:
            for ds, f, d, start, stop in got["pieces"]:
                coverage.setdefault((NAMES[ds], f, d), []).append((start, stop))
    return coverage


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("dcp_rescale"))
    write_random_arrow_datasets(root, (("web", 160, 20), ("code", 80, 45)), seed=3)
    return root


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dcp_alone_rescales_2x1_to_3x2_to_1x0_exactly_once(data: str, tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = _run_phase(tmp_path, "p1", 2, 1, data, None, 5, a)
    second = _run_phase(tmp_path, "p2", 3, 2, data, a, 4, b)
    third = _run_phase(tmp_path, "p3", 1, 0, data, b, None, None)
    check_exactly_once(_coverage([first, second, third]), document_lengths(_config(data)))
    # 24 logical shards: old workers 0 (shards 0-11) and 1 (12-23); new rank 0 owns shards
    # 0-7, rank 1 8-15, rank 2 16-23: each reads the manifest and only the workers it succeeds
    assert [g["read"] for g in second] == [
        ["data.manifest", "data.rank_00000", "data.worker_000000"],
        ["data.manifest", "data.rank_00000", "data.rank_00001", "data.worker_000000",
         "data.worker_000001"],
        ["data.manifest", "data.rank_00001", "data.worker_000001"],
    ]  # fmt: skip
    assert third[0]["read"] == [
        "data.manifest", *(f"data.rank_0000{r}" for r in range(3)),
        *(f"data.worker_00000{g}" for g in range(6)),
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dcp_on_s3_rescales_3x2_to_2x1_exactly_once(data: str, tmp_path: Path, s3) -> None:
    url = s3.url("ckpt", "step-4")
    first = _run_phase(tmp_path, "p1", 3, 2, data, None, 4, url, s3.storage_options)
    second = _run_phase(tmp_path, "p2", 2, 1, data, url, None, None, s3.storage_options)
    check_exactly_once(_coverage([first, second]), document_lengths(_config(data)))
    # new rank 0 owns shards 0-11 (old workers 0-2 of rank 0 and 1), rank 1 12-23 (3-5)
    assert [sorted(k for k in g["read"] if "worker" in k) for g in second] == [
        ["data.worker_000000", "data.worker_000001", "data.worker_000002"],
        ["data.worker_000003", "data.worker_000004", "data.worker_000005"],
    ]


# -- refusals, in one process (a rescale from 1 x 1 to 1 x 2 workers) ----------------------------
def _saved(root: str, folder: Path, steps: int = 5) -> None:
    loader = TokenLoader(functools.partial(_build, _config(root)))
    it = iter(loader)
    for _ in range(steps):
        next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(folder))


def _load(cfg: PipelineConfig, folder: Path, workers: int = 2, **kw: Any) -> TokenLoader:
    loader = TokenLoader(functools.partial(_build, cfg), num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"data": DCPLoaderState(loader, **kw)}, checkpoint_id=str(folder))
    return loader


def test_a_checkpoint_of_another_seed_or_shard_count_is_refused_saying_why(
    data: str, tmp_path: Path
) -> None:
    _saved(data, tmp_path / "c")
    with pytest.raises(ValueError, match=r"dataset 'web': seed differ \(checkpoint seed=5, now 6"):
        _load(_config(data, seed=6), tmp_path / "c")
    with pytest.raises(
        ValueError,
        match=r"dataset 'code': n_logical_shards differ \(checkpoint n_logical_shards=24, now 12",
    ):
        _load(_config(data, logical_shards=12), tmp_path / "c")


def test_a_changed_data_file_is_refused_on_a_rescale(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    write_random_arrow_datasets(root, (("web", 160, 20), ("code", 80, 45)), seed=3)
    _saved(root, tmp_path / "c")
    p1 = Path(root, "web", "p1.arrow")
    # the same bytes, a new mtime: caught, named (replaced, as a writer does: the saving
    # loader's threads may still map the old file, which an in-place rewrite would truncate)
    write_bytes_atomic(str(p1), p1.read_bytes(), durable=False)
    with pytest.raises(ChangedFilesError, match=r"dataset 'web': 1 file\(s\): p1\.arrow \("):
        _load(_config(root), tmp_path / "c")
    loader = _load(_config(root), tmp_path / "c", allow_changed_files=True)
    assert len(list(loader)) > 0


@pytest.mark.slow
def test_a_rescale_from_1x1_to_1x0_and_1x2_finishes_the_epoch_exactly_once(
    data: str, tmp_path: Path
) -> None:
    cfg = _config(data)
    loader = TokenLoader(functools.partial(_build, cfg))
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "c"))
    for workers in (0, 2):
        rest = list(_load(cfg, tmp_path / "c", workers=workers))
        coverage: dict = {}
        for ds, f, d, start, stop in _pieces(head + rest):
            coverage.setdefault((NAMES[ds], f, d), []).append((start, stop))
        check_exactly_once(coverage, document_lengths(cfg))


# -- how a load lists the checkpoint's keys: the frame lookup, or the checkpoint given --------
def _stream(items: list[dict]) -> list[tuple[list[int], list[list[int]]]]:
    """Each delivered sequence's tokens and provenance, to compare streams exactly."""
    return [
        (np.asarray(s["input_ids"]).tolist(), np.asarray(s["provenance"]).tolist()) for s in items
    ]


def _save_at(root: str, folder: Path, workers: int, steps: int = 5) -> list[dict]:
    """Save a loader of ``workers`` workers after ``steps`` sequences, next to a model tensor;
    return what it delivered."""
    loader = TokenLoader(functools.partial(_build, _config(root)), num_workers=workers)
    it = iter(loader)
    head = [next(it) for _ in range(steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)},
            checkpoint_id=str(folder),
        )
    loader.close()
    return head


def _restore(root: str, reader: Any, workers: int, **kw: Any) -> TokenLoader:
    loader = TokenLoader(functools.partial(_build, _config(root)), num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"model": {"w": torch.zeros(4)}, "data": DCPLoaderState(loader, **kw)},
            storage_reader=reader,
        )
    return loader


@pytest.fixture(scope="module")
def saved_at_2(data: str, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A DCP checkpoint of 1 rank x 2 workers after 5 sequences, and those 5."""
    folder = tmp_path_factory.mktemp("dcp_2_workers") / "c"
    return folder, _save_at(data, folder, workers=2)


def test_the_frame_lookup_finds_the_storage_reader_of_dcp_load_under_this_torch(
    tmp_path: Path,
) -> None:
    """loading_from reads torch's dcp.load frame: this fails when a torch release moves what
    it reads (then loads at another topology need DCPLoaderState(loader, checkpoint_id=...))."""

    class Probe(Stateful):
        def __init__(self) -> None:
            self.found: list[LoadInProgress | None] = []

        def state_dict(self) -> dict[str, Any]:
            self.found.append(dcp_entries.loading_from(self))
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    folder = str(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(3.0)}, checkpoint_id=folder)
        probe, reader = Probe(), dcp.FileSystemReader(folder)
        dcp.load({"w": torch.zeros(3), "probe": probe}, storage_reader=reader)
        dcp.load({"w": torch.zeros(3), "probe": probe}, checkpoint_id=folder)
        dcp.save({"w": torch.arange(3.0), "probe": probe}, checkpoint_id=str(tmp_path / "d"))
    by_reader, by_id, saving = probe.found
    assert by_reader is not None and by_reader.reader is reader and by_reader.key == "probe"
    assert by_id is not None and by_id.key == "probe"  # the reader dcp.load made for the path
    assert isinstance(by_id.reader, dcp.FileSystemReader) and str(by_id.reader.path) == folder
    assert saving is None and dcp_entries.loading_from(probe) is None


@pytest.mark.slow
def test_a_restore_at_3_workers_through_the_checkpoint_given_delivers_the_same_stream(
    data: str, saved_at_2: tuple[Path, list[dict]], monkeypatch
) -> None:
    """Saved at 2 workers, restored at 3 through the frame lookup (which must find the reader
    dcp.load was given), then through checkpoint_id= and storage_reader= (which must not walk
    the frames): the same entries read, the same stream delivered, each document once."""
    folder, head = saved_at_2
    found: list[LoadInProgress | None] = []
    lookup = dcp_entries.loading_from

    def recorded(owner: object) -> LoadInProgress | None:
        found.append(lookup(owner))
        return found[-1]

    monkeypatch.setattr(dcp_entries, "loading_from", recorded)
    reader = _recording(dcp.FileSystemReader)(str(folder))
    implicit = _stream(list(_restore(data, reader, workers=3)))
    assert found == [LoadInProgress(reader, "data")]
    data_keys = ["data.manifest", "data.rank_00000", "data.worker_000000", "data.worker_000001"]
    assert sorted(k for k in type(reader).read if k.startswith("data.")) == data_keys

    def no_walk(owner: object) -> None:
        raise AssertionError("the checkpoint was given: no frame walk")

    monkeypatch.setattr(dcp_entries, "loading_from", no_walk)
    for given in ("checkpoint_id", "storage_reader"):
        reader = _recording(dcp.FileSystemReader)(str(folder))
        kw = (
            {"checkpoint_id": str(folder)}
            if given == "checkpoint_id"
            else {"storage_reader": reader}
        )
        assert _stream(list(_restore(data, reader, workers=3, **kw))) == implicit, given
        assert sorted(k for k in type(reader).read if k.startswith("data.")) == data_keys
    coverage: dict = {}
    for ds, f, d, start, stop in _pieces(head) + [
        [ds, f, d, start, start + n]
        for _, prov in implicit
        for ds, f, d, start, n in prov
        if ds not in (LITERAL, PAD)
    ]:
        coverage.setdefault((NAMES[ds], f, d), []).append((start, stop))
    check_exactly_once(coverage, document_lengths(_config(data)))


def test_a_load_at_another_topology_without_the_reader_says_so_and_the_way_out(
    data: str, saved_at_2: tuple[Path, list[dict]], monkeypatch, caplog
) -> None:
    """Saved at 1 x 2, loaded at 1 x 0 (one graph in this process) while the lookup finds no
    dcp.load, or finds one without its reader: refused naming the installed torch and the
    explicit way, not restored from this rank's own entries."""
    folder = str(saved_at_2[0])
    message = (
        r"saved at 1 ranks x 2 workers on 1 ranks x 1 workers.*"
        rf"torch {re.escape(torch.__version__)}.*"
        r"DCPLoaderState\(loader, checkpoint_id=\.\.\.\)"
    )
    monkeypatch.setattr(dcp_entries, "loading_from", lambda owner: None)
    with pytest.raises(ValueError, match=message):
        _restore(data, dcp.FileSystemReader(folder), workers=0)
    monkeypatch.setattr(dcp_entries, "loading_from", lambda owner: LoadInProgress(None, "data"))
    with (
        caplog.at_level("WARNING", logger="torchdata_ext.checkpoint.dcp"),
        pytest.raises(ValueError, match=message),
    ):
        _restore(data, dcp.FileSystemReader(folder), workers=0)
    assert "found no storage reader of a dcp.load in progress" in caplog.text
    assert f"torch {torch.__version__}" in caplog.text
    # the explicit way restores there
    monkeypatch.undo()
    loader = _restore(data, dcp.FileSystemReader(folder), workers=0, checkpoint_id=folder)
    assert len(list(loader)) > 0


def test_a_load_on_the_same_topology_without_the_reader_still_restores(
    data: str, tmp_path: Path, monkeypatch
) -> None:
    """The lookup failing costs nothing on the same topology (1 x 0 here): this rank's own
    entries are all it reads, the same stream as with the lookup."""
    _save_at(data, tmp_path / "c", workers=0)
    with_lookup = _stream(list(_restore(data, dcp.FileSystemReader(str(tmp_path / "c")), 0)))
    for lookup in (lambda owner: None, lambda owner: LoadInProgress(None, None)):
        monkeypatch.setattr(dcp_entries, "loading_from", lookup)
        loader = _restore(data, dcp.FileSystemReader(str(tmp_path / "c")), 0)
        assert _stream(list(loader)) == with_lookup


def test_the_key_of_the_loader_state_is_found_or_asked_for(data: str, tmp_path: Path) -> None:
    """Given the checkpoint, the state's key in dcp.load's state dict is the one key holding a
    loader state; with two (a train and an eval loader), key= says which."""
    train = TokenLoader(functools.partial(_build, _config(data)))
    other = TokenLoader(functools.partial(_build, _config(data, seed=6)))
    it = iter(train)
    head = [next(it) for _ in range(3)]
    folder = str(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"train": DCPLoaderState(train), "eval": DCPLoaderState(other)}, checkpoint_id=folder
        )
        expected = _stream(list(it))
        fresh = TokenLoader(functools.partial(_build, _config(data)))
        with pytest.raises(
            ValueError, match=r"holds 2 loader states \(under \['eval', 'train'\]\)"
        ):
            dcp.load({"train": DCPLoaderState(fresh, checkpoint_id=folder)}, checkpoint_id=folder)
        dcp.load(
            {"train": DCPLoaderState(fresh, checkpoint_id=folder, key="train")},
            checkpoint_id=folder,
        )
    assert len(head) == 3 and _stream(list(fresh)) == expected
