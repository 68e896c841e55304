"""Folder checkpoints that were damaged after the save are refused before anything is restored,
with the file named; checkpoints written before checksums existed still load."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from harness import item_key

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
