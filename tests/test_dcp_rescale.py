"""Rescale through ``torch.distributed.checkpoint`` alone: ``dcp.save`` at R x W, ``dcp.load``
at R' x W' with the same ``DCPLoaderState(loader)``, exactly once over the epoch.

Real gloo ranks are spawned per phase; each rank records the sequences it delivered (their
provenance) and the DCP entries its load read, so the test checks every token of every document
was delivered exactly once and that each rank read only the old workers it needed.
"""

from __future__ import annotations

import functools
import json
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from harness import check_exactly_once, document_lengths, write_random_arrow_datasets

from torchdata_ext import World
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import PipelineConfig, build_pipeline
from torchdata_ext.provenance import LITERAL, PAD
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
    port: int,
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
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
    )
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
    import torch.multiprocessing as mp

    out = tmp / name
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (ranks, port, root, workers, load_from, steps, save_to, options, str(out))
    mp.spawn(_phase_main, args=args, nprocs=ranks)
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
    p1.write_bytes(p1.read_bytes())  # the same bytes, a new mtime: caught, named
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
