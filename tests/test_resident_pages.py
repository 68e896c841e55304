"""Local files kept open between blocks do not keep what was read in the process's resident
memory: a file's pages leave it when the walk moves on (they stay in the page cache), and
documents already handed out, and those read later, keep their tokens."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from torchdata_ext import DatasetIndex
from torchdata_ext.sources.file_access import FileAccess
from torchdata_ext.testing import write_arrow_batches, write_flat_tokens

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads smaps")


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                current = parts[5] if len(parts) > 5 else None
            elif parts[0] == "Rss:" and current == path:
                total += int(parts[1])
    return total


def _docs(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(1, 60_000, int(rng.integers(500, 3000)), dtype=np.uint32) for _ in range(n)
    ]


@pytest.mark.parametrize("form", ["arrow", "flat"])
def test_a_file_kept_open_gives_back_its_pages(tmp_path: Path, form: str) -> None:
    docs = _docs(800)  # ~5 MB of tokens
    if form == "arrow":
        path = str(tmp_path / "d" / "p0.arrow")
        write_arrow_batches(path, docs)
        index = DatasetIndex.build(str(tmp_path / "d"))
    else:
        path = str(tmp_path / "d" / "p0.bin")
        os.makedirs(tmp_path / "d")
        write_flat_tokens(path, docs, eos_token=0)
        index = DatasetIndex.build(str(tmp_path / "d"), eos_token=0)
    access = FileAccess(index, cache=None, prefetch=0)
    assert access.open(0, []) == len(docs)
    early = [access.get(i) for i in range(0, len(docs), 7)]
    got = [np.asarray(d) for d in access.get_many(np.arange(len(docs)))]
    assert sum(int(d.sum(dtype=np.int64)) for d in got) > 0  # every token read
    resident = _resident_kib(path)
    assert resident > 4_000, resident  # every page was read
    access.close()  # kept open for the walk's return, its pages given back
    assert _resident_kib(path) < resident // 20, (_resident_kib(path), resident)
    for i, d in zip(range(0, len(docs), 7), early):  # handed out before: the same tokens
        np.testing.assert_array_equal(np.asarray(d)[: len(docs[i])], docs[i])
    assert access.open(0, []) == len(docs)  # taken back open: the same documents
    for i, d in enumerate(access.get_many(np.arange(len(docs)))):
        np.testing.assert_array_equal(np.asarray(d)[: len(docs[i])], docs[i])
        np.testing.assert_array_equal(got[i][: len(docs[i])], docs[i])
    access.close_all()
