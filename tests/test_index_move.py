"""Prepared data moves: a folder written by ``prepare`` (with its index file) trains the same
after a copy, an upload to S3, through a symlink and by a relative path, with no listing but
rank 0's one check of the index file; old index files with absolute names are read where the
files are below the folder and refused clearly where the data has moved; a checkpoint saved on
the original folder restores on the moved one (file names in checkpoints are relative)."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import item_key

from torchdata_ext import PipelineConfig, World, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_datasets
from torchdata_ext.remote.counting import count_s3_requests
from torchdata_ext.sources import index as index_module
from torchdata_ext.sources import index_file as index_file_module
from torchdata_ext.sources.index_file import (
    INDEX_FILE,
    StaleIndexError,
    index_file_url,
    load_index_file,
)
from torchdata_ext.testing import write_arrow_batches

NAMES = ("web", "code")
ITEMS = 40  # more sequences than the corpus holds: the stream runs into its second epoch


def _prepared(tmp_path: Path, format: str = "arrow") -> str:
    """Two datasets prepared with ``prepare`` (several files each, of ``format``) under
    ``tmp_path/orig/data``."""
    from torchdata_ext import prepare

    root = tmp_path / "orig" / "data"
    for k, name in enumerate(NAMES):
        src = tmp_path / f"{name}.jsonl"
        src.write_text(
            "".join(
                json.dumps({"text": f"{name} document {i} " * (1 + (i * 7 + k) % 5)}) + "\n"
                for i in range(12)
            )
        )
        prepare([str(src)], str(root / name), tokenizer="byte", max_tokens_per_file=200,
                format=format)  # fmt: skip
    assert len(list((root / "web").glob(f"*.{format}"))) > 1
    return str(root)


def _cfg(root: str, so: dict[str, Any] | None = None) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets=",".join(NAMES), seq_length=16, logical_shards=8, batch_size=2,
        shuffle_buffer=3, block_docs=4, seed=1, tokenizer="byte", storage_options=dict(so or {}),
    )  # fmt: skip


def _stream(cfg: PipelineConfig) -> list[Any]:
    node = build_pipeline(cfg, World(), collate=False)
    return [item_key(x) for x, _ in zip(node, range(ITEMS))]


def _documents(cfg: PipelineConfig) -> dict[str, list[bytes]]:
    """Every document of every dataset, read through the indexes the pipeline builds."""
    out = {}
    for name, index in build_datasets(cfg, World()).items():
        handler = index.handler()
        docs = []
        for f in index.files:
            reader = handler.open(f)
            docs += [
                np.asarray(handler.get(reader, i)).tobytes() for i in range(handler.length(reader))
            ]
            handler.close(reader)
        assert len(docs) == index.total_docs
        out[name] = docs
    return out


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the listings: ``"check"`` (rank 0's check of an index file) and ``"build"`` (an
    index built by listing, as without an index file)."""
    seen: Counter = Counter()
    for module, kind in ((index_file_module, "check"), (index_module, "build")):
        real = module.list_data_files

        def counted(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
            seen[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "list_data_files", counted)
    return seen


def _upload(root: str, s3: Any) -> str:
    """Every file under ``root`` (``meta/`` too) put under ``s3://<bucket>/up``; its URL."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
    for dirpath, _, names in os.walk(root):
        for n in names:
            local = os.path.join(dirpath, n)
            fs.put_file(local, f"{s3.bucket}/up/{os.path.relpath(local, root)}")
    return str(s3.url("up"))


def _reference(root: str, make_cfg: Any = _cfg) -> tuple[list[Any], dict[str, list[bytes]]]:
    cfg = make_cfg(root)
    return _stream(cfg), _documents(cfg)


def _trains_the_same(root: str, reference: tuple[list[Any], dict[str, list[bytes]]],
                     listings: Counter, so: dict[str, Any] | None = None,
                     make_cfg: Any = _cfg) -> None:  # fmt: skip
    """``root`` gives the reference's documents and stream, from its index files: one check
    listing per dataset on rank 0, none on another rank, never a build by listing
    (``make_cfg(root, so)``: the config, :func:`_cfg` by default)."""
    cfg = make_cfg(root, so)
    listings.clear()
    index_file_module._verified.clear()  # a new job: rank 0 checks the index files again
    assert sorted(build_datasets(cfg, World(1, 2))) == sorted(NAMES)
    assert listings == Counter()
    assert _documents(cfg) == reference[1]
    assert listings == Counter({"check": len(NAMES)})
    assert _stream(cfg) == reference[0]
    assert listings == Counter({"check": len(NAMES)})


def test_a_copied_folder_trains_the_same(tmp_path: Path, listings: Counter) -> None:
    root = _prepared(tmp_path)
    reference = _reference(root)
    shutil.copytree(tmp_path / "orig", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "orig")  # nothing can be read from the original any more
    copy = str(tmp_path / "elsewhere" / "copy" / "data")
    _trains_the_same(copy, reference, listings)
    files = build_datasets(_cfg(copy), World())["web"].files
    assert all(f.startswith(f"{copy}/web/") for f in files)


def test_a_symlinked_folder_trains_the_same(tmp_path: Path, listings: Counter) -> None:
    root = _prepared(tmp_path)
    reference = _reference(root)
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    _trains_the_same(str(tmp_path / "link"), reference, listings)
    (tmp_path / "web_link").symlink_to(f"{root}/web", target_is_directory=True)
    index = load_index_file(str(tmp_path / "web_link"), name="web", file_type="arrow")
    assert index is not None and index.files[0].startswith(f"{tmp_path}/web_link/")


def test_a_relative_data_path_trains_the_same(tmp_path: Path, monkeypatch, listings) -> None:
    root = _prepared(tmp_path)
    reference = _reference(root)
    monkeypatch.chdir(tmp_path / "orig")
    _trains_the_same("data", reference, listings)
    # the index command run with a relative path records names relative to the folder
    assert main(["index", "data", "--datasets", "web,code", "--col-name", "tokens"]) == 0
    body = json.loads(Path(index_file_url(f"{root}/web")).read_text())
    assert body["files"] and all(not f.startswith("/") for f in body["files"])
    assert all(f.startswith("part") for f in body["files"])
    _trains_the_same("data", reference, listings)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")  # and so the copy needs no new one
    monkeypatch.chdir(tmp_path / "copy")
    _trains_the_same("data", reference, listings)


def test_an_uploaded_folder_trains_the_same_and_its_fix_names_storage_options(
    tmp_path: Path, s3, listings: Counter
) -> None:
    root = _prepared(tmp_path)
    reference = _reference(root)
    so = s3.storage_options
    remote = _upload(root, s3)
    _trains_the_same(remote, reference, listings, so)
    with count_s3_requests() as other:  # another rank: the index files, no LIST
        build_datasets(_cfg(remote, so), World(1, 4))
    assert other["LIST"] == 0 and other["GET"] == 2 * len(NAMES)
    write_arrow_batches(f"{remote}/web/part-extra.arrow", [np.arange(5, 9, dtype=np.uint32)],
                        storage_options=so)  # fmt: skip
    index_file_module._verified.clear()
    with pytest.raises(StaleIndexError) as e:
        build_datasets(_cfg(remote, so), World(0, 4))
    assert "part-extra.arrow (not in the recorded files)" in str(e.value)
    assert (
        f"write it again before starting the job with `torchdata-ext index {remote}/web "
        "--storage-options JSON` (JSON: the config's storage_options as a JSON object; and "
        "the config's --file-type, --col-name, --eos-token)"
    ) in str(e.value)


def test_a_local_stale_index_names_no_storage_options(tmp_path: Path) -> None:
    root = _prepared(tmp_path)
    write_arrow_batches(f"{root}/web/part-extra.arrow", [np.arange(5, 9, dtype=np.uint32)])
    with pytest.raises(StaleIndexError) as e:
        load_index_file(f"{root}/web", name="web", file_type="arrow")
    assert f"`torchdata-ext index {root}/web` (and the config's --file-type" in str(e.value)
    assert "--storage-options" not in str(e.value)


def _absolute_names(folder: str) -> None:
    """Rewrite ``folder``'s index file as earlier versions wrote it from another spelling of
    the folder: absolute names."""
    path = Path(index_file_url(folder))
    body = json.loads(path.read_text())
    body["files"] = [f"{folder}/{f}" for f in body["files"]]
    path.write_text(json.dumps(body))


def test_old_index_files_with_absolute_names(tmp_path: Path, monkeypatch, listings) -> None:
    root = _prepared(tmp_path)
    reference = _reference(root)
    for name in NAMES:
        _absolute_names(f"{root}/{name}")
    _trains_the_same(root, reference, listings)  # the files are there: read as they are
    monkeypatch.chdir(tmp_path / "orig")
    _trains_the_same("data", reference, listings)  # the same folder by another spelling
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    copy = str(tmp_path / "copy" / "data")
    for verify in (True, False):  # every rank refuses it, not only the one that lists
        with pytest.raises(StaleIndexError) as e:
            load_index_file(f"{copy}/web", name="web", file_type="arrow", verify=verify)
        assert str(e.value).startswith(
            f"the index file {copy}/web/meta/{INDEX_FILE} names the file {root}/web/part"
        )
        assert (
            f"which is not in {copy}/web: it was written (by an earlier version) with absolute "
            f"paths, and the data has moved since. Write it again with `torchdata-ext index "
            f"{copy}/web`"
        ) in str(e.value)


def test_a_checkpoint_restores_on_the_moved_folder(tmp_path: Path, s3) -> None:
    """File names in checkpoints are relative to the dataset folder and the files are the same
    bytes: a checkpoint of the original folder restores on a copy and on an upload."""
    root = _prepared(tmp_path)
    build = functools.partial(build_pipeline, _cfg(root), collate=False)
    loader = TokenLoader(build)
    it = iter(loader)
    [next(it) for _ in range(5)]
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(loader, ckpt)
    rest = [item_key(next(it)) for _ in range(5)]
    so = s3.storage_options
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    remote = _upload(root, s3)
    shutil.rmtree(tmp_path / "orig")
    for data, options in ((str(tmp_path / "copy" / "data"), None), (remote, so)):
        moved = TokenLoader(functools.partial(build_pipeline, _cfg(data, options), collate=False))
        load_checkpoint(moved, ckpt)
        assert [item_key(x) for x, _ in zip(moved, range(5))] == rest


def test_a_copy_without_modification_times_trains_the_same(
    tmp_path: Path, listings: Counter
) -> None:
    """``cp -r`` (modification times not kept): the index file's sampled sha256 of each local
    file recognises the copy, which trains the same with no listing but rank 0's check."""
    import subprocess

    reference = _reference(_prepared(tmp_path))
    orig = sorted((tmp_path / "orig" / "data" / "web").glob("*.arrow"))[0]
    os.utime(orig, (1e9, 1e9))  # cp -r below gives the copy its own time, never this one
    subprocess.run(["cp", "-r", str(tmp_path / "orig"), str(tmp_path / "copy")], check=True)
    copy = tmp_path / "copy" / "data"
    assert (copy / "web" / orig.name).stat().st_mtime != 1e9
    shutil.rmtree(tmp_path / "orig")
    _trains_the_same(str(copy), reference, listings)


def test_a_same_size_rewrite_is_refused_and_an_old_index_says_how_to_copy(tmp_path: Path) -> None:
    """Modification times and sampled bytes both changed: a rewrite, refused naming the file.
    An index file written before sampled bytes were recorded cannot tell a copy without
    modification times from a rewrite: refused, saying how to copy."""
    _prepared(tmp_path)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy", copy_function=shutil.copyfile)
    copy = tmp_path / "copy" / "data"
    first = sorted((copy / "web").glob("*.arrow"))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF  # same size, other last byte (inside the sampled tail)
    first.write_bytes(bytes(data))
    with pytest.raises(StaleIndexError, match=rf"{first.name} \(first/last 64 KiB differ\)") as e:
        load_index_file(str(copy / "web"), name="web", file_type="arrow")
    assert "Only modification times changed" not in str(e.value)

    index_url = copy / "code" / "meta" / INDEX_FILE
    body = json.loads(index_url.read_text())
    assert len(body.pop("sha256")) == len(body["files"])
    index_url.write_text(json.dumps(body))
    with pytest.raises(StaleIndexError, match=r"part\S*\.arrow \(version mtime=") as e:
        load_index_file(str(copy / "code"), name="code", file_type="arrow")
    assert str(e.value).endswith(
        "Only modification times changed: if the folder was copied without keeping them "
        "(cp -r without -p), copy it with cp -a, rsync -a or shutil.copytree instead"
    )
