"""Folder checkpoints that were damaged after the save are refused before anything is restored,
with the file named; checkpoints written before checksums existed still load."""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import item_key
from torch.distributed.checkpoint.api import CheckpointException

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.testing import write_arrow_batches


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("integrity") / "web"
    rng = np.random.default_rng(3)
    docs = [rng.integers(5, 9000, int(rng.integers(1, 20))).astype(np.uint32) for _ in range(120)]
    for f in range(2):
        write_arrow_batches(str(folder / f"p{f}.arrow"), docs[f * 60 : (f + 1) * 60])
    return str(folder)


def build(root: str, world: World) -> ShardReader:
    return ShardReader(DatasetIndex.build(root), 8, world=world, block_docs=4, seed=1)


def take(it, n: int) -> list:
    return [x for _, x in zip(range(n), it)]


def saved(root: str, folder: Path, ranks: int = 1) -> Path:
    """A checkpoint of ``ranks`` ranks (in-process) after 3 batches each."""
    for r in range(ranks):
        loader = TokenLoader(functools.partial(build, root), rank=r, world_size=ranks)
        take(iter(loader), 3)
        save_checkpoint(loader, str(folder))
    return folder


def restore(root: str, folder: Path, ranks: int = 1, rank: int = 0) -> TokenLoader:
    loader = TokenLoader(functools.partial(build, root), rank=rank, world_size=ranks)
    load_checkpoint(loader, str(folder))
    return loader


def test_every_file_has_a_checksum(root: str, tmp_path: Path) -> None:
    ckpt = saved(root, tmp_path / "c", ranks=2)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["checksums"] == "sha256" and len(manifest["sha256"]) == 64
    meta = json.loads((ckpt / "rank_00001.json").read_text())
    assert sorted(meta["files"]) == ["worker_000001.pkl"] and len(meta["sha256"]) == 64


def test_a_truncated_worker_file_is_named(root: str, tmp_path: Path) -> None:
    ckpt = saved(root, tmp_path / "c")
    pkl = ckpt / "worker_000000.pkl"
    pkl.write_bytes(pkl.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"worker_000000\.pkl is corrupt.*sha256"):
        restore(root, ckpt)


def test_a_flipped_byte_is_caught_though_the_pickle_still_loads(root: str, tmp_path: Path) -> None:
    ckpt = saved(root, tmp_path / "c")
    pkl = ckpt / "worker_000000.pkl"
    data = bytearray(pkl.read_bytes())
    data[-2] ^= 0x01  # inside the last opcodes' data, not the STOP opcode
    pkl.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"worker_000000\.pkl is corrupt"):
        restore(root, ckpt)


def test_a_corrupt_rank_file_or_manifest_is_named(root: str, tmp_path: Path) -> None:
    ckpt = saved(root, tmp_path / "c")
    rank = ckpt / "rank_00000.json"
    good = rank.read_text()
    rank.write_text(good.replace('"next_worker": 0', '"next_worker": 1'))
    with pytest.raises(ValueError, match=r"rank_00000\.json is corrupt"):
        restore(root, ckpt)
    rank.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"rank_00000\.json is corrupt \(not valid JSON"):
        restore(root, ckpt)
    rank.write_text(good)
    manifest = ckpt / "manifest.json"
    manifest.write_text(manifest.read_text()[:-30])
    with pytest.raises(ValueError, match=r"manifest\.json is corrupt \(not valid JSON"):
        restore(root, ckpt)


def test_a_corrupt_file_of_another_rank_is_named_when_rescaling(root: str, tmp_path: Path) -> None:
    """2 ranks -> 1: the new rank reads rank 1's files too, and checks them."""
    ckpt = saved(root, tmp_path / "c", ranks=2)
    pkl = ckpt / "worker_000001.pkl"
    pkl.write_bytes(pkl.read_bytes()[:10])
    with pytest.raises(ValueError, match=r"worker_000001\.pkl is corrupt"):
        restore(root, ckpt)
    restore(root, ckpt, ranks=2, rank=0)  # rank 0 on 2 ranks reads only its own files


def _strip_checksums(ckpt: Path) -> None:
    """Make ``ckpt`` look like a checkpoint written before checksums (no sha256 anywhere)."""
    for name in ("manifest.json", *(p.name for p in ckpt.glob("rank_*.json"))):
        obj = json.loads((ckpt / name).read_text())
        for key in ("sha256", "checksums", "files"):
            obj.pop(key, None)
        (ckpt / name).write_text(json.dumps(obj, indent=1, sort_keys=True))


def test_a_checkpoint_without_checksums_still_loads(root: str, tmp_path: Path) -> None:
    ref = [item_key(b) for b in take(iter(TokenLoader(functools.partial(build, root))), 10)]
    ckpt = saved(root, tmp_path / "c")
    _strip_checksums(ckpt)
    assert [item_key(b) for b in take(iter(restore(root, ckpt)), 7)] == ref[3:]
    pkl = ckpt / "worker_000000.pkl"
    pkl.write_bytes(pkl.read_bytes()[:-20])  # no checksum to compare: unpickling names it
    with pytest.raises(ValueError, match=r"worker_000000\.pkl cannot be unpickled"):
        restore(root, ckpt)


def test_nothing_is_restored_from_a_corrupt_checkpoint(root: str, tmp_path: Path) -> None:
    """The loader that refused a corrupt checkpoint starts fresh, as if never loaded."""
    ref = [item_key(b) for b in take(iter(TokenLoader(functools.partial(build, root))), 5)]
    ckpt = saved(root, tmp_path / "c", ranks=2)
    (ckpt / "worker_000001.pkl").write_bytes(b"")
    loader = TokenLoader(functools.partial(build, root))
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(loader, str(ckpt))
    assert [item_key(b) for b in take(iter(loader), 5)] == ref


# -- DCP (issue 44 item 10) ----------------------------------------------------------------------
def _dcp_cfg(root: Path) -> Any:
    from harness import write_random_arrow_datasets

    from torchdata_ext.pipeline.config import PipelineConfig

    write_random_arrow_datasets(str(root), (("web", 30, 10), ("code", 20, 10)), seed=2)
    return PipelineConfig(data_path=str(root), datasets="web,code", seq_length=16,
                          logical_shards=4, batch_size=2, shuffle_buffer=3, epochs=1)  # fmt: skip


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list, list]:
    """A DCP checkpoint after 3 batches (model and loader), the batches after it, and the
    byte ranges of the loader's entries in its data file."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState
    from torchdata_ext.pipeline.build import build_pipeline

    tmp = tmp_path_factory.mktemp("dcp_integrity")
    cfg = _dcp_cfg(tmp / "data")
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    it = iter(loader)
    take(it, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        dcp.save({"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)},
                 checkpoint_id=str(tmp / "good"))  # fmt: skip
    after = [b["input_ids"].tolist() for b in it]
    loader.close()
    metadata = dcp.FileSystemReader(str(tmp / "good")).read_metadata()
    spans = [(i.offset, i.offset + i.length) for k, i in metadata.storage_data.items()
             if k.fqn.startswith("data.")]  # fmt: skip
    return cfg, tmp / "good", after, spans


def _dcp_load(cfg: Any, folder: Path) -> list:
    """The batches a loader restored from DCP checkpoint ``folder`` delivers."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState
    from torchdata_ext.pipeline.build import build_pipeline

    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": {"w": torch.zeros(4)}, "data": DCPLoaderState(loader)},
                 checkpoint_id=str(folder))  # fmt: skip
    return [b["input_ids"].tolist() for b in loader]


def _damaged_copy(good: Path, to: Path, how: str, at: int = 0) -> Path:
    shutil.copytree(good, to)
    (data,) = to.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    if how == "flip":
        raw[at] ^= 0x10
        data.write_bytes(bytes(raw))
    elif how == "truncated .distcp":
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    elif how == "truncated .metadata":
        meta = to / ".metadata"
        meta.write_bytes(meta.read_bytes()[:100])
    elif how == "missing .metadata":
        (to / ".metadata").unlink()
    return to


def _in_payload(good: Path, last: bool) -> int:
    """A byte inside the first (manifest) or last (a worker's) sealed pickle of ``good``: an
    ASCII one, so a flip leaves it ASCII. torch pickles the entry's bytes as a UTF-8 string, so
    a flipped byte >= 0x80 can fail in torch's own unpickling (a UnicodeEncodeError, seen when
    the temporary paths held in the state moved the payload), before the entry reaches us."""
    (data,) = good.glob("*.distcp")
    raw = data.read_bytes()
    at = (raw.rfind if last else raw.find)(b"TDXSEAL1") + 8 + 32 + 60
    while raw[at] >= 0x80:
        at += 1
    return at


def test_a_bit_flip_in_the_loader_entries_never_restores_another_position(
    dcp_run: tuple[Any, Path, list, list], tmp_path: Path
) -> None:
    """Every 41st byte of the loader's entries flipped in turn: the load refuses or restores
    exactly the same position (a flip in torch's own framing that changes nothing)."""
    cfg, good, after, spans = dcp_run
    assert _dcp_load(cfg, good) == after
    wrong, refused = [], 0
    for a, b in spans:
        for at in range(a, b, 41):
            folder = _damaged_copy(good, tmp_path / f"flip_{at}", "flip", at)
            try:
                got = _dcp_load(cfg, folder)
            except (Exception, CheckpointException):
                refused += 1
                continue
            finally:
                shutil.rmtree(folder)
            if got != after:
                wrong.append(at)
    assert not wrong, f"flips at {wrong} restored another position"
    assert refused > 0


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated .distcp", "DCP checkpoint {d} is damaged: reading __0_0.distcp failed "
                              "(RuntimeError: PytorchStreamReader failed reading zip archive: "
                              "failed finding central directory); restore from another checkpoint"),
        ("truncated .metadata", "DCP checkpoint {d} is damaged: its .metadata cannot be read "
                                "(UnpicklingError: pickle data was truncated); restore from "
                                "another checkpoint"),
        ("missing .metadata", "DCP checkpoint {d} has no .metadata (it holds .distcp data files): "
                              "its save did not finish or the file was removed; restore from "
                              "another checkpoint"),
        ("flip", "entry data.manifest (in __0_0.distcp) of DCP checkpoint {d} is damaged (its "
                 "content does not match its sha256): restore from another checkpoint"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("tool", ["audit_checkpoint", "show_batches"])
def test_a_damaged_dcp_checkpoint_is_named_with_its_file(
    dcp_run: tuple[Any, Path, list, list], tmp_path: Path, how: str, message: str, tool: str
) -> None:
    from torchdata_ext.audit import audit_checkpoint
    from torchdata_ext.forensics import show_batches

    cfg, good, _, spans = dcp_run
    folder = _damaged_copy(good, tmp_path / "damaged", how, _in_payload(good, last=False))
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        if tool == "audit_checkpoint":
            audit_checkpoint(str(folder), cfg)
        else:
            show_batches(str(folder), cfg, 5)
    assert str(e.value) == message.format(d=folder)


def test_dcp_load_names_a_damaged_metadata_or_entry(
    dcp_run: tuple[Any, Path, list, list], tmp_path: Path
) -> None:
    """The user's own dcp.load: what reaches DCPLoaderState is named (a damaged data file that
    torch fails to read first stays torch's CheckpointException)."""
    cfg, good, _, spans = dcp_run
    cases = {
        "truncated .metadata": "is damaged: its .metadata cannot be read (UnpicklingError: pickle "
                               "data was truncated); restore from another checkpoint",
        "missing .metadata": "has no .metadata: its save did not finish or the file was removed; "
                             "restore from another checkpoint",
    }  # fmt: skip
    for how, tail in cases.items():
        folder = _damaged_copy(good, tmp_path / how.replace(" ", "_"), how)
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            _dcp_load(cfg, folder)
        assert str(e.value) == f"DCP checkpoint {folder} {tail}"
    folder = _damaged_copy(good, tmp_path / "flip", "flip", _in_payload(good, last=True))
    with pytest.raises(ValueError) as e:
        _dcp_load(cfg, folder)
    assert str(e.value) == (
        f"entry data.worker_000000 (in __0_0.distcp) of DCP checkpoint {folder} is damaged "
        "(its content does not match its sha256): restore from another checkpoint"
    )


def test_a_dcp_checkpoint_saved_before_the_checksum_still_loads(
    dcp_run: tuple[Any, Path, list, list], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint import dcp as dcp_module
    from torchdata_ext.checkpoint.dcp import DCPLoaderState
    from torchdata_ext.pipeline.build import build_pipeline

    cfg, _, after, _ = dcp_run
    monkeypatch.setattr(dcp_module, "seal", lambda obj: io.BytesIO(pickle.dumps(obj)))
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    take(iter(loader), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)},
                 checkpoint_id=str(tmp_path / "old"))  # fmt: skip
    loader.close()
    monkeypatch.undo()
    raw = (tmp_path / "old" / "__0_0.distcp").read_bytes()
    assert b"TDXSEAL1" not in raw
    assert _dcp_load(cfg, tmp_path / "old") == after


def _load_dcp(cfg: Any, folder: Path) -> list:
    """:func:`_dcp_load` through ``torchdata_ext.checkpoint.load_dcp``."""
    import torch

    from torchdata_ext.checkpoint import DCPLoaderState, load_dcp
    from torchdata_ext.pipeline.build import build_pipeline

    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_dcp({"model": {"w": torch.zeros(4)}, "data": DCPLoaderState(loader)}, str(folder))
    return [b["input_ids"].tolist() for b in loader]


def test_load_dcp_names_a_data_file_torch_cannot_read(
    dcp_run: tuple[Any, Path, list, list], tmp_path: Path
) -> None:
    """Issue 44 item 10: where the user's own dcp.load raises torch's CheckpointException
    before the loader's code runs, load_dcp (and check_dcp, without loading) names the
    checkpoint, the file and what is wrong with it; an intact checkpoint loads as dcp.load."""
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint import check_dcp

    cfg, good, after, _ = dcp_run
    assert _load_dcp(cfg, good) == after
    check_dcp(str(good))
    metadata = dcp.FileSystemReader(str(good)).read_metadata()
    need = max(i.offset + i.length for i in metadata.storage_data.values())
    (name,) = [p.name for p in good.glob("*.distcp")]
    size = (good / name).stat().st_size
    cut = _damaged_copy(good, tmp_path / "cut", "truncated .distcp")
    with pytest.raises(CheckpointException):
        _dcp_load(cfg, cut)  # what the user's own dcp.load gives
    want = (
        f"DCP checkpoint {cut} is damaged: {name} is truncated ({size // 2:,} bytes; the "
        f"metadata needs {need:,}); restore from another checkpoint"
    )
    for call in (lambda: _load_dcp(cfg, cut), lambda: check_dcp(str(cut))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == want
    gone = _damaged_copy(good, tmp_path / "gone", "none")
    (gone / name).unlink()
    with pytest.raises(ValueError) as e:
        _load_dcp(cfg, gone)
    assert str(e.value) == (
        f"DCP checkpoint {gone} is damaged: {name} is missing; restore from another checkpoint"
    )
    # the right size, but torch cannot read it: torch's failure, reworded
    zeroed = _damaged_copy(good, tmp_path / "zeroed", "none")
    (zeroed / name).write_bytes(bytes(size))
    with pytest.raises(ValueError) as e:
        _load_dcp(cfg, zeroed)
    assert str(e.value).startswith(f"DCP checkpoint {zeroed} is damaged: reading {name} failed (")
    assert str(e.value).endswith("); restore from another checkpoint")
