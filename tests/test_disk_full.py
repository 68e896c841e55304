"""A full disk (or any failed write) during ``save_checkpoint`` or ``prepare``: the error names
the file, no temporary file is left behind, a failed save never leaves a folder that could be
taken for a complete checkpoint (even over an earlier checkpoint in the same folder), and a
re-run after space was freed finishes as if nothing happened.

The disk is a small tmpfs (needs root; skipped elsewhere) filled to the page; the save-over-a-
checkpoint logic is also checked everywhere with a write that fails on the n-th file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import subprocess
from collections.abc import Callable, Iterator

import pytest
from test_remote_pipeline import _cfg, _write_corpus, build

import torchdata_ext.checkpoint.folder as checkpoint_module
import torchdata_ext.prepare_data.output_files as output_files
from torchdata_ext import prepare
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.testing import write_jsonl

PAGE = 4096


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[str, int], str]]:
    """``make(name, pages)``: a tmpfs of ``pages`` pages mounted at ``tmp_path/name``."""
    mounted: list[str] = []

    def make(name: str, pages: int) -> str:
        path = str(tmp_path / name)
        os.makedirs(path)
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", path]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", path], check=True)


def _fill(folder: str, leave_pages: int) -> str:
    """Fill ``folder``'s filesystem, leaving ``leave_pages`` free pages; the filler's path."""
    filler = os.path.join(folder, "filler")
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * PAGE):
            pass
    size = os.path.getsize(filler) - leave_pages * PAGE
    os.truncate(filler, max(0, size))
    return filler


def _hidden(folder: str) -> list[str]:
    """Temporary (hidden) files anywhere below ``folder``."""
    return [
        os.path.join(d, n)
        for d, _, names in os.walk(folder)
        for n in names
        if n.startswith(".") or ".tmp-" in n
    ]


def _loader(data: str, workers: int, steps: int) -> TokenLoader:
    loader = TokenLoader(functools.partial(build, _cfg(data)), num_workers=workers)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("data") / "data")
    _write_corpus(root)
    return root


def _refused(ckpt: str, data: str) -> None:
    """``ckpt`` is not taken for a complete checkpoint."""
    assert not os.path.exists(os.path.join(ckpt, "manifest.json"))
    with pytest.raises(FileNotFoundError, match=r"no manifest\.json.*save did not finish"):
        load_checkpoint(TokenLoader(functools.partial(build, _cfg(data))), ckpt)


@pytest.mark.multiprocess
def test_disk_full_during_a_save_leaves_an_incomplete_folder_and_no_temporary(
    small_disk, data
) -> None:
    disk = small_disk("ckpt_disk", 16)
    filler = _fill(disk, leave_pages=1)  # room for one worker file of two
    ckpt = os.path.join(disk, "step_5")
    loader = _loader(data, workers=2, steps=5)
    with pytest.raises(OSError, match=r"cannot write .*worker_00000\d\.pkl \(No space left") as e:
        save_checkpoint(loader, ckpt)
    assert e.value.errno == errno.ENOSPC
    assert _hidden(disk) == []
    _refused(ckpt, data)
    os.unlink(filler)  # space freed: the same save now completes and restores
    save_checkpoint(loader, ckpt)
    load_checkpoint(TokenLoader(functools.partial(build, _cfg(data)), num_workers=2), ckpt)


@pytest.mark.multiprocess
def test_disk_full_during_a_save_over_a_checkpoint_leaves_no_manifest(small_disk, data) -> None:
    """The old manifest would name 1 worker whose file was replaced by a 2-worker save's: it
    is removed before the first file changes."""
    disk = small_disk("ckpt_disk", 16)
    ckpt = os.path.join(disk, "latest")
    save_checkpoint(_loader(data, workers=1, steps=4), ckpt)
    _fill(disk, leave_pages=0)
    with pytest.raises(OSError, match=r"cannot write .*rank_00000\.json \(No space left"):
        save_checkpoint(_loader(data, workers=2, steps=7), ckpt)
    assert _hidden(disk) == []
    _refused(ckpt, data)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_save_failing_at_any_file_over_a_checkpoint_is_never_taken_for_complete(
    request, monkeypatch, tmp_path, data, where
) -> None:
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        so, ckpt = s3.storage_options, s3.url("latest")
    else:
        so, ckpt = None, str(tmp_path / "latest")
    first, second = _loader(data, workers=0, steps=3), _loader(data, workers=0, steps=8)
    real = checkpoint_module.write_bytes_atomic
    files = ["worker_000000.pkl", "rank_00000.json", "manifest.json"]
    for n in range(len(files)):
        save_checkpoint(first, ckpt, storage_options=so)
        calls: list[str] = []

        def failing(url, payload, storage_options=None, n=n, calls=calls):
            calls.append(url)
            if len(calls) > n:
                raise OSError(errno.EIO, f"cannot write {url} (injected)")
            real(url, payload, storage_options)

        monkeypatch.setattr(checkpoint_module, "write_bytes_atomic", failing)
        with pytest.raises(OSError, match=f"cannot write .*{files[n]} \\(injected\\)"):
            save_checkpoint(second, ckpt, storage_options=so)
        monkeypatch.setattr(checkpoint_module, "write_bytes_atomic", real)
        if where == "local":
            _refused(ckpt, data)
            assert _hidden(str(tmp_path)) == []
        else:
            with pytest.raises(FileNotFoundError, match=r"no manifest\.json"):
                load_checkpoint(
                    TokenLoader(functools.partial(build, _cfg(data))), ckpt, storage_options=so
                )


def _texts(n: int) -> list[str]:
    return [f"document {i} " + "lorem ipsum " * (i % 37) for i in range(n)]


def test_disk_full_during_prepare_leaves_no_temporary_and_resumes(small_disk, tmp_path) -> None:
    inputs = str(tmp_path / "in")
    for k in range(4):
        write_jsonl(f"{inputs}/t{k}.jsonl", _texts(300)[k::4])
    reference = str(tmp_path / "reference")
    prepare(inputs, reference, max_tokens_per_file=4000, progress=False)
    names = sorted(n for n in os.listdir(reference) if n.startswith("part"))
    pages = sum(-(-os.path.getsize(os.path.join(reference, n)) // PAGE) for n in names)
    out = small_disk("prepare_disk", pages + 8)
    filler = _fill(out, leave_pages=pages // 2)  # half the outputs fit
    with pytest.raises(OSError, match=r"cannot write .*part00000_\d+\.arrow \(No space left"):
        prepare(inputs, out, max_tokens_per_file=4000, progress=False)
    assert _hidden(out) == []
    os.unlink(filler)
    done = prepare(inputs, out, max_tokens_per_file=4000, progress=False)
    assert done.resumed and _hidden(out) == []
    for n in names:
        with open(os.path.join(out, n), "rb") as a, open(os.path.join(reference, n), "rb") as b:
            assert a.read() == b.read(), n


def test_disk_full_while_prepare_writes_the_counts_leaves_no_temporary(
    small_disk, tmp_path, monkeypatch
) -> None:
    """The last write of ``prepare`` is the counts file of ``meta/``: it fails too."""
    inputs = str(tmp_path / "in")
    write_jsonl(f"{inputs}/t.jsonl", _texts(50))
    out = small_disk("prepare_disk", 64)
    finalize = output_files.write_listings

    def finalize_on_a_full_disk(*args):
        _fill(out, leave_pages=0)
        return finalize(*args)

    monkeypatch.setattr(output_files, "write_listings", finalize_on_a_full_disk)
    prepare(inputs, out, progress=False)
    assert _hidden(out) == []
