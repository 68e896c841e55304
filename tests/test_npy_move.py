"""Prepared ``.npy`` data moves (issue 28): ``prepare(format="npy")`` lists its shards in
``data_sources.txt`` by names relative to the folder, so a prepared folder trains the same
after ``cp -r``, through a symlink and after an upload to S3, from its index files and from the
list; an old list of absolute paths is still read where its files are."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from test_index_move import (
    NAMES,
    _cfg,
    _documents,
    _prepared,
    _reference,
    _trains_the_same,
    _upload,
    listings,  # noqa: F401 (the fixture)
)

from torchdata_ext import PipelineConfig, World
from torchdata_ext.pipeline.build import build_datasets


def _npy_cfg(root: str, so: dict[str, Any] | None = None) -> PipelineConfig:
    """The arrow tests' config on the ``.npy`` shards (flat tokens, EOS 0 after each document)."""
    return dataclasses.replace(_cfg(root, so), file_type="flat", eos_token=0)


def _listed(folder: Path) -> list[str]:
    return (folder / "data_sources.txt").read_text().splitlines()


def test_data_sources_lists_names_relative_to_its_folder(tmp_path: Path) -> None:
    root = Path(_prepared(tmp_path, "npy"))
    for name in NAMES:
        shards = sorted(p.name for p in (root / name).glob("*.npy"))
        assert len(shards) > 1 and _listed(root / name) == shards


def test_a_copied_npy_folder_trains_the_same(
    tmp_path: Path,
    listings: Counter,  # noqa: F811
) -> None:
    """``cp -r`` (modification times not kept), the original deleted: from the index files,
    and from the copied ``data_sources.txt`` (a data_path naming the list)."""
    root = _prepared(tmp_path, "npy")
    reference = _reference(root, _npy_cfg)
    subprocess.run(["cp", "-r", str(tmp_path / "orig"), str(tmp_path / "copy")], check=True)
    shutil.rmtree(tmp_path / "orig")
    copy = str(tmp_path / "copy" / "data")
    _trains_the_same(copy, reference, listings, make_cfg=_npy_cfg)
    listed = dataclasses.replace(_npy_cfg(f"{copy}/web/data_sources.txt"), datasets="")
    index = build_datasets(listed, World())["data_sources.txt"]
    assert [f.rsplit("/", 1)[1] for f in index.files] == _listed(Path(copy, "web"))
    assert all(f.startswith(f"{copy}/web/") for f in index.files)
    assert _documents(listed)["data_sources.txt"] == reference[1]["web"]


def test_a_symlinked_npy_folder_trains_the_same(
    tmp_path: Path,
    listings: Counter,  # noqa: F811
) -> None:
    root = _prepared(tmp_path, "npy")
    reference = _reference(root, _npy_cfg)
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    _trains_the_same(str(tmp_path / "link"), reference, listings, make_cfg=_npy_cfg)


def test_an_uploaded_npy_folder_trains_the_same(
    tmp_path: Path,
    s3,
    listings: Counter,  # noqa: F811
) -> None:
    root = _prepared(tmp_path, "npy")
    reference = _reference(root, _npy_cfg)
    so = s3.storage_options
    remote = _upload(root, s3)
    _trains_the_same(remote, reference, listings, so, make_cfg=_npy_cfg)
    listed = dataclasses.replace(_npy_cfg(f"{remote}/web/data_sources.txt", so), datasets="")
    assert _documents(listed)["data_sources.txt"] == reference[1]["web"]


def test_an_old_list_of_absolute_paths_still_reads_where_its_files_are(tmp_path: Path) -> None:
    root = _prepared(tmp_path, "npy")
    web = Path(root, "web")
    (web / "data_sources.txt").write_text("".join(f"{web}/{n}\n" for n in _listed(web)))
    listed = dataclasses.replace(_npy_cfg(f"{web}/data_sources.txt"), datasets="")
    assert _documents(listed)["data_sources.txt"] == _documents(_npy_cfg(root))["web"]
