"""FileAccess on its own: the current file, prefetch holds, the fetch_document files, discards.

The reader's tests (test_reader.py, test_remote.py) cover it end to end; these pin down the
interface the reader relies on, on local files and on ``memory://`` through a ShardCache.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from torchdata_ext import DatasetIndex
from torchdata_ext.remote import ShardCache
from torchdata_ext.sources.file_access import FileAccess, make_cache
from torchdata_ext.testing import write_arrow_batches


def _doc(file: int, doc: int) -> np.ndarray:
    return np.arange(1000 * file + 10 * doc, 1000 * file + 10 * doc + 5, dtype=np.uint32)


def _dataset(root: str, n_files: int) -> DatasetIndex:
    """``n_files`` Arrow files; file f holds f + 3 documents, ``_doc(f, d)``."""
    for f in range(n_files):
        write_arrow_batches(f"{root}/p{f:02d}.arrow", [_doc(f, d) for d in range(f + 3)])
    return DatasetIndex.build(root)


def _never_read() -> Iterator[int]:
    raise AssertionError("upcoming was read although nothing is prefetched")
    yield 0


@pytest.fixture
def remote() -> DatasetIndex:
    return _dataset(f"memory://file-access-{uuid.uuid4().hex[:8]}", 4)


def _wait_cached(cache: ShardCache, url: str) -> None:
    deadline = time.monotonic() + 10
    while not os.path.exists(cache.local_path(url)):
        assert time.monotonic() < deadline, f"{url} was never downloaded"
        time.sleep(0.01)


def test_open_reads_the_current_file_until_closed(tmp_path) -> None:
    files = FileAccess(_dataset(str(tmp_path), 3), None, prefetch=2)
    assert files.cache is None and files.current_file is None
    assert files.open(2, _never_read()) == 5  # local files: nothing to prefetch
    assert files.current_file == 2 and files.prefetching == []
    got = files.get_many(np.array([4, 0, 2]))
    assert [d.tolist() for d in got] == [_doc(2, d).tolist() for d in (4, 0, 2)]
    assert files.get(1).tolist() == _doc(2, 1).tolist()
    assert files.open(0, iter([])) == 3 and files.current_file == 0  # closes file 2
    files.close()
    assert files.current_file is None
    with pytest.raises(RuntimeError, match="no file is open"):
        files.get(0)
    stats = files.io_stats()
    assert stats["files_opened"] == 2 and stats["wait_seconds"] == stats["open_seconds"]


def test_prefetch_holds_the_first_distinct_remote_files_of_upcoming(remote, tmp_path) -> None:
    url = remote.files
    files = FileAccess(remote, ShardCache(tmp_path / "c"), prefetch=2)
    files.open(0, iter([0, 1, 1, 3, 2]))  # the open file and repeats do not count
    assert files.prefetching == [url[1], url[3]]
    files.open(1, iter([3, 2, 0]))
    assert files.prefetching == [url[3], url[2]]
    assert files.get(3).tolist() == _doc(1, 3).tolist()
    files.stop_prefetching()
    assert files.prefetching == [] and files.current_file == 1
    files.close_all()

    off = FileAccess(remote, ShardCache(tmp_path / "c"), prefetch=0)
    assert off.open(2, _never_read()) == 5 and off.prefetching == []
    off.close_all()


def test_close_all_drops_every_hold(remote, tmp_path) -> None:
    """Held files (open, prefetched, kept for fetch_document) cannot be evicted; after
    close_all they can."""
    cache = ShardCache(tmp_path / "c", max_bytes=None)
    files = FileAccess(remote, cache, prefetch=1)
    files.open(0, iter([1]))
    _wait_cached(cache, remote.files[1])
    assert files.fetch_document(2, 0).tolist() == _doc(2, 0).tolist()
    tight = ShardCache(tmp_path / "c", max_bytes=1)  # evicts every file nobody holds

    def cached() -> list[bool]:  # after downloading file 3 again, which makes room
        tight.discard(remote.files[3])
        tight.acquire(remote.files[3])
        tight.release(remote.files[3])
        return [os.path.exists(cache.local_path(u)) for u in remote.files]

    assert cached() == [True, True, True, True]
    files.close_all()
    assert cached() == [False, False, False, True]


def test_fetch_document_keeps_the_last_files_open(tmp_path) -> None:
    files = FileAccess(_dataset(str(tmp_path), 10), None, prefetch=0)
    files.open(9, iter([]))
    assert files.fetch_document(9, 11).tolist() == _doc(9, 11).tolist()  # the current file
    assert files.io_stats()["files_opened"] == 1
    for f in range(9):
        assert files.fetch_document(f, 2).tolist() == _doc(f, 2).tolist()
    assert files.io_stats()["files_opened"] == 10  # 8 kept open: file 0 was closed
    files.fetch_document(8, 0)
    files.fetch_document(1, 0)
    assert files.io_stats()["files_opened"] == 10
    files.fetch_document(0, 0)
    assert files.io_stats()["files_opened"] == 11
    files.close_all()


def test_close_with_discard_drops_the_cached_copy(remote, tmp_path) -> None:
    cache = ShardCache(tmp_path / "c")
    files = FileAccess(remote, cache, prefetch=0)
    files.open(1, iter([]))
    local = cache.local_path(remote.files[1])
    assert os.path.exists(local)
    files.close(discard=True)
    assert not os.path.exists(local) and files.current_file is None
    files.open(1, iter([]))  # fetched again
    assert files.get(0).tolist() == _doc(1, 0).tolist() and os.path.exists(local)
    files.close_all()


def test_make_cache(remote, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "default"))
    local = _dataset(str(tmp_path / "local"), 1)
    shared = ShardCache(tmp_path / "shared")
    assert make_cache(shared, remote) is shared
    assert make_cache(False, remote) is None
    assert make_cache(None, local) is None and make_cache(True, local) is None
    made = make_cache(tmp_path / "here", remote)
    assert made is not None and made.cache_dir == str(tmp_path / "here")
    default = make_cache(None, remote)
    assert default is not None and default.cache_dir == str(tmp_path / "default")


def test_a_local_file_the_walk_comes_back_to_is_not_opened_again(tmp_path) -> None:
    """A walk over logical shards switches files at almost every block: a local file read a
    moment ago stays open (with its parsed index) among the last 8 files, and reads the same;
    close_all closes them all."""
    files = FileAccess(_dataset(str(tmp_path), 12), None, prefetch=0)
    for f in (0, 1, 0, 2, 1, 0):
        files.open(f, iter([]))
        assert files.get(f % 3).tolist() == _doc(f, f % 3).tolist()
    assert files.io_stats()["files_opened"] == 3
    files.open(9, iter([]))  # file 0 is kept: 8 files were left since
    files.open(0, iter([]))
    assert files.io_stats()["files_opened"] == 4
    for f in range(3, 12):  # 9 more distinct files: file 0 is among the oldest, closed
        files.open(f, iter([]))
    assert sorted(files._stamps) == sorted([*files._fetch_cache, 11])  # the kept and current
    files.open(0, iter([]))
    assert files.io_stats()["files_opened"] == 4 + 8 + 1
    assert files.get(2).tolist() == _doc(0, 2).tolist()
    files.close_all()
    files.open(0, iter([]))
    assert files.io_stats()["files_opened"] == 14
    files.close_all()


def test_a_kept_local_file_replaced_or_rewritten_since_is_read_anew(tmp_path) -> None:
    """A local file kept open is taken back only while it is the file on disk: one replaced
    (written aside and renamed, as the writers of this package do) or rewritten in place
    since it was left is opened again and read as it is now, never from the old mapping."""
    files = FileAccess(_dataset(str(tmp_path), 3), None, prefetch=0)
    url = files.dataset.files[1]
    files.open(1, iter([]))
    files.open(0, iter([]))  # file 1 is kept
    new = [_doc(7, d) for d in range(4)]  # the same document count and lengths: other tokens
    write_arrow_batches(url, new)  # replaced: a new inode
    assert files.open(1, iter([])) == 4 and files.get(3).tolist() == _doc(7, 3).tolist()
    assert files.io_stats()["files_opened"] == 3
    files.open(0, iter([]))  # reopened from the kept handle: unchanged since
    assert files.io_stats()["files_opened"] == 3
    with open(url, "r+b") as f:  # rewritten in place, same size: the mtime moves
        data = f.read()
        f.seek(0)
        f.write(data)
    os.utime(url, ns=(time.time_ns(), time.time_ns() + 10**9))
    files.open(1, iter([]))
    assert files.io_stats()["files_opened"] == 4 and files.get(3).tolist() == _doc(7, 3).tolist()
    files.close_all()


def test_a_remote_file_is_closed_when_the_walk_leaves_it(remote, tmp_path) -> None:
    """Remote files are not kept open after the walk leaves them: their cached copies stay
    free to evict, and the next open goes through the cache again."""
    files = FileAccess(remote, ShardCache(tmp_path / "c"), prefetch=0)
    files.open(0, iter([]))
    files.open(1, iter([]))
    files.open(0, iter([]))
    assert files.io_stats()["files_opened"] == 3
    files.close_all()
