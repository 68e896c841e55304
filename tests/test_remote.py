"""Object storage: the reader over s3:// (a real moto endpoint) equals local disk, with a shared
local cache, prefetch, retries under injected faults, a size limit, and clear errors.

Still to do for the full pipeline over s3:// (its nodes and checkpoint folder are being built
elsewhere): run tokenize -> interleave -> pack -> shuffle -> collate over these s3:// datasets
through ``StatefulDataLoader`` with 1 and 2 workers, compare with the same files on local disk,
and checkpoint / rescale-restore through a checkpoint folder on ``s3://`` (written with
``torchdata_ext.remote.write_bytes_atomic``, one object per rank).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import gc
import logging
import multiprocessing
import os
import pickle
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import S3Endpoint, credentials_checked
from harness import check_restore_at_every_step, item_key, run

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.handlers import DataFileError
from torchdata_ext.nodes import merge_reader_states
from torchdata_ext.remote import (
    RemoteError,
    RetryPolicy,
    ShardCache,
    disk,
    is_transient,
    read_bytes,
    with_retries,
    write_bytes_atomic,
)
from torchdata_ext.testing import (
    write_arrow_batches,
    write_flat_tokens,
    write_jsonl,
    write_parquet,
)

FAST = RetryPolicy(max_attempts=12, base_delay_s=0.01, max_delay_s=0.05, total_timeout_s=30)


def make_docs(n: int, seed: int, base: int) -> list[np.ndarray]:
    """Documents whose first token is a unique id, so content identifies them."""
    rng = np.random.default_rng(seed)
    return [
        np.concatenate(
            [[base + i], rng.integers(10, 50_000, int(rng.integers(0, 60)), dtype=np.uint32)]
        ).astype(np.uint32)
        for i in range(n)
    ]


# dataset name -> (file names, writer); each writer takes (url, docs, storage_options)
CORPUS = {
    "web": ([f"part_{i}.arrow" for i in range(4)], "arrow"),
    "books": ([f"book_{i}.parquet" for i in range(3)], "parquet"),
    "code": ([f"code_{i}.bin" for i in range(3)], "flat"),
    "chat": ([f"chat_{i}.jsonl.gz" for i in range(2)], "jsonl"),
}


def _write(kind: str, url: str, docs: list, so) -> None:
    if kind == "arrow":
        write_arrow_batches(url, docs, storage_options=so)
    elif kind == "parquet":
        write_parquet(url, docs, row_group_size=16, storage_options=so)
    elif kind == "flat":  # offsets in a side file, fetched into the cache with the data
        write_flat_tokens(url, docs, offsets=True, storage_options=so)
    else:
        write_jsonl(url, [" ".join(map(str, d.tolist())) for d in docs], storage_options=so)


def write_corpus(root: str, so=None) -> dict[str, list]:
    """The multi-dataset corpus under ``root`` (a local folder or an s3:// prefix)."""
    out = {}
    for k, (name, (files, kind)) in enumerate(CORPUS.items()):
        docs = make_docs(60 * len(files), k, base=(k + 1) * 1_000_000)
        for f, fname in enumerate(files):
            _write(kind, f"{root}/{name}/{fname}", docs[f * 60 : (f + 1) * 60], so)
        out[name] = docs
    return out


def build(root: str, name: str, so=None) -> DatasetIndex:
    kind = CORPUS[name][1]
    pattern = f"{root}/{name}/*.bin" if kind == "flat" else f"{root}/{name}"
    return DatasetIndex.build(pattern, storage_options=so, file_type=kind)


@pytest.fixture(scope="module")
def local_corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("local"))
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def s3_corpus(s3_server: str) -> str:
    """The same corpus in a bucket of its own, uploaded once for the module (tests only read
    it; each test still gets the ``s3`` fixture for its environment and a bucket to write)."""
    import s3fs

    so = S3Endpoint(s3_server, "").options_via(s3_server)
    bucket = f"corpus-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **so).call_s3("create_bucket", Bucket=bucket)
    write_corpus(f"s3://{bucket}/corpus", so)
    s3fs.S3FileSystem.clear_instance_cache()
    return f"s3://{bucket}/corpus"


def keys(blocks) -> list:
    return [item_key(b) for b in blocks]


def read_all(index, world, n_shards=8, **kw):
    return run(ShardReader(index, n_shards, world=world, epochs=1, block_docs=7, seed=3, **kw))


# ------------------------------------------------------------------------- equality with local
@pytest.mark.parametrize("workers", [1, 2])
def test_reader_over_s3_equals_local_disk(s3, s3_corpus, local_corpus, tmp_path, workers) -> None:
    root, _ = local_corpus
    cache = ShardCache(tmp_path / "cache", retry=FAST)
    for name in CORPUS:
        remote = build(s3_corpus, name, s3.storage_options)
        local = build(root, name)
        assert remote.files[0].startswith("s3://") and remote.fingerprint() == local.fingerprint()
        for w in range(workers):
            world = World(0, 1, w, workers)
            got = read_all(remote, world, cache=cache, prefetch_shards=2)
            assert keys(got) == keys(read_all(local, world)), (name, w)
    stats = cache.stats()
    n_files = sum(len(f) for f, _ in CORPUS.values())
    # each file was downloaded once, whatever the number of workers reading it
    assert stats["downloads"] == n_files and stats["bytes_downloaded"] > 0
    assert stats["prefetched"] > 0 and stats["cache_hits"] + stats["prefetch_waits"] > 0
    code = [p for p in _cached_files(cache) if "code_" in p]
    assert any(p.endswith(".offsets.npy") for p in code)  # the side files came along
    cache.close()


def test_default_cache_and_no_cache_read_the_same(
    s3, s3_corpus, local_corpus, tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHDATA_EXT_CACHE_DIR", str(tmp_path / "default"))
    remote = build(s3_corpus, "web", s3.storage_options)
    ref = keys(read_all(build(local_corpus[0], "web"), World()))
    reader = ShardReader(remote, 8, world=World(), epochs=1, block_docs=7, seed=3)
    assert reader.cache is not None and reader.cache.cache_dir == str(tmp_path / "default")
    assert keys(run(reader)) == ref
    assert reader.io_stats()["downloads"] == 4
    assert keys(read_all(remote, World(), cache=False)) == ref
    # a local dataset is read in place, with no cache
    assert ShardReader(build(local_corpus[0], "web"), 8).cache is None


def test_restore_at_every_step_over_s3(s3, s3_corpus, tmp_path) -> None:
    index = build(s3_corpus, "web", s3.storage_options)
    cache = ShardCache(tmp_path / "cache", retry=FAST)
    for world in (World(), World(0, 1, 1, 2)):
        items = check_restore_at_every_step(
            lambda world=world: ShardReader(
                index, 6, world=world, epochs=2, block_docs=16, cache=cache, prefetch_shards=2
            )
        )
        assert {b.epoch for b in items} == {0, 1}
    assert cache.stats()["downloads"] == 4  # restores read from the cache


def test_rescale_with_states_saved_on_s3(s3, s3_corpus, local_corpus, tmp_path) -> None:
    """2 workers save mid-epoch to s3://, then 1 and 3 workers restore the merged state."""
    index = build(s3_corpus, "books", s3.storage_options)
    cache = ShardCache(tmp_path / "cache", retry=FAST)
    all_docs = collections.Counter(tuple(d.tolist()) for d in local_corpus[1]["books"])

    def doc_keys(blocks):
        return [tuple(d.data.tolist()) for b in blocks for d in b]

    before: list[tuple] = []
    for w, steps in ((0, 5), (1, 9)):
        reader = ShardReader(index, 12, world=World(0, 1, w, 2), epochs=1, cache=cache)
        before += doc_keys(run(reader, steps))
        write_bytes_atomic(
            s3.url("ckpt", f"reader_{w}.pkl"), pickle.dumps(reader.state_dict()), s3.storage_options
        )
    states = [
        pickle.loads(read_bytes(s3.url("ckpt", f"reader_{w}.pkl"), s3.storage_options))
        for w in range(2)
    ]
    merged = merge_reader_states(states)
    for workers in (1, 3):
        after: list[tuple] = []
        for w in range(workers):
            reader = ShardReader(index, 12, world=World(0, 1, w, workers), epochs=1, cache=cache)
            reader.reset(merged)
            after += doc_keys(run(reader))
        assert collections.Counter(before + after) == all_docs


def test_index_over_s3_with_counts_opens_no_data_object(s3, s3_proxy, s3_corpus) -> None:
    first = build(s3_corpus, "web", s3.storage_options)  # counts every file, in the local cache
    so = s3.options_via(s3_proxy.endpoint_url)
    again = build(s3_corpus, "web", so)
    assert again.doc_counts.tolist() == first.doc_counts.tolist() == [60] * 4
    assert again.fingerprint() == first.fingerprint()
    assert s3_proxy.gets(".arrow") == 0  # no GET or HEAD of any data object
    assert s3_proxy.gets("torchdata_ext_counts.csv") == 0  # nothing was written to the bucket


def test_fms_fsdp_counts_in_a_bucket_are_used_and_nothing_is_written(s3, s3_proxy) -> None:
    """Counts rows as fms-fsdp writes them (``/web/part_0.arrow``, or absolute paths) match the
    objects: none is downloaded to count it, and nothing is written into the bucket."""
    import s3fs

    so = s3.storage_options
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    for i in range(3):
        docs = [np.arange(i, i + 4 + j) for j in range(5 + i)]
        write_arrow_batches(s3.url("data", "web", f"part_{i}.arrow"), docs, storage_options=so)
    rows = ["dataset/filename,documents,tokens", "/web/part_0.arrow,5,30"]
    rows += ["/lustre/datasets/web/part_1.arrow,6,39", f"{s3.url('data', 'web')}/part_2.arrow,7,49"]
    fs.pipe(s3.url("data", "meta", "combined_counts.csv"), ("\n".join(rows) + "\n").encode())
    objects = sorted(fs.find(s3.url("data")))
    index = build(s3.url("data"), "web", s3.options_via(s3_proxy.endpoint_url))
    assert index.doc_counts.tolist() == [5, 6, 7] and index.token_counts.tolist() == [30, 39, 49]
    assert s3_proxy.gets(".arrow") == 0
    fs.invalidate_cache()
    assert sorted(fs.find(s3.url("data"))) == objects


# ------------------------------------------------------------------------------------ faults
def test_faults_are_retried_and_delivery_is_exactly_once(
    s3, s3_proxy, s3_corpus, local_corpus, tmp_path
):
    s3_proxy.share = 0.3  # 503 SlowDown, connection resets and cut bodies, on any request
    so = s3.options_via(s3_proxy.endpoint_url, config_kwargs={"retries": {"total_max_attempts": 1}})
    for name in ("web", "code"):
        remote = build(s3_corpus, name, so)
        s3_proxy.restart_faults()  # the reader meets faults of its own
        cache = ShardCache(tmp_path / name, retry=FAST)
        got = []
        for w in range(2):
            got += read_all(remote, World(0, 1, w, 2), cache=cache, prefetch_shards=2)
        ref = [
            b for w in range(2) for b in read_all(build(local_corpus[0], name), World(0, 1, w, 2))
        ]
        assert keys(got) == keys(ref)
        assert cache.stats()["retries"] > 0
    assert s3_proxy.faults["503"] and s3_proxy.faults["reset"] and s3_proxy.faults["truncate"]


def test_a_permanently_failing_object_fails_clearly_within_the_bound(
    s3, s3_proxy, s3_corpus, tmp_path
):
    index = build(s3_corpus, "web", s3.options_via(s3_proxy.endpoint_url))
    s3_proxy.always_fail.add("web/part_2.arrow")
    # 0.5 s: the bound stops the retries as well as a longer one (1 s before, each case
    # waited it out)
    bound = RetryPolicy(max_attempts=100, base_delay_s=0.02, max_delay_s=0.2, total_timeout_s=0.5)
    for on_error in ("raise", "skip"):  # an outage is never a file to skip
        cache = ShardCache(tmp_path / on_error, retry=bound)
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=r"part_2\.arrow.*transient errors.*total_timeout_s"):
            read_all(index, World(), cache=cache, on_error=on_error, prefetch_shards=0)
        # the 0.5 s bound, plus reading the other files on a machine the tests share (they run
        # in parallel): far below the ~20 s that 100 attempts would take without the bound
        assert time.monotonic() - t0 < 0.5 + 5.0
        leftovers = [p for p in _all_files(tmp_path / on_error) if "part_2" in p]
        assert [p for p in leftovers if not p.endswith(".lock")] == []  # no partial file


def test_missing_bucket_object_and_bad_credentials_fail_at_once(s3, s3_corpus, tmp_path) -> None:
    so = s3.storage_options
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="no-such-bucket.*bucket does not exist.*endpoint_url"):
        DatasetIndex.build("s3://no-such-bucket/data/", storage_options=so)
    with pytest.raises(FileNotFoundError, match="no data files match"):
        DatasetIndex.build(s3.url("no-such-prefix"), storage_options=so)
    cache = ShardCache(tmp_path / "cache", retry=RetryPolicy(total_timeout_s=60))
    with pytest.raises(FileNotFoundError):
        cache.acquire(s3.url("no-such-object.arrow"), so)
    with pytest.raises(RemoteError, match="bucket does not exist"):
        cache.acquire("s3://no-such-bucket/x.arrow", so)
    # an object deleted after the index was built: a file error naming it (skippable)
    import s3fs

    for i in range(4):
        docs = [np.arange(10 * i + j, 10 * i + j + 3) for j in range(5)]
        write_arrow_batches(s3.url("own", "web", f"part_{i}.arrow"), docs, storage_options=so)
    index = build(s3.url("own"), "web", so)
    s3fs.S3FileSystem(skip_instance_cache=True, **so).rm(index.files[1])
    with pytest.raises(DataFileError, match=r"part_1\.arrow: not found.*rebuild the index"):
        read_all(index, World(), cache=cache)
    skipped = ShardReader(index, 8, world=World(), epochs=1, cache=cache, on_error="skip")
    assert sum(len(b) for b in run(skipped)) == 15 and skipped.skipped == 5
    assert time.monotonic() - t0 < 10  # no retries on any of these

    with credentials_checked(s3.endpoint_url):  # the endpoint now checks credentials
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=r"s3://.*access denied.*AWS_ACCESS_KEY_ID.*endpoint"):
            build(s3_corpus, "books", so)
        with pytest.raises(RemoteError, match=r"part_0\.arrow: stat failed: access denied"):
            ShardCache(tmp_path / "c2").acquire(index.files[0], so)
        assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------- cache size and safety
def test_cache_limit_holds_with_a_limit_smaller_than_the_data(
    s3, s3_corpus, local_corpus, tmp_path
):
    index = build(s3_corpus, "web", s3.storage_options)
    sizes = [
        os.path.getsize(os.path.join(local_corpus[0], "web", f"part_{i}.arrow")) for i in range(4)
    ]
    limit = int(2.5 * max(sizes))  # room for about two of the four files
    cache = ShardCache(tmp_path / "cache", max_bytes=limit, retry=FAST)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:  # watch the folder while downloads run in the background
        while not stop.is_set():
            peak[0] = max(peak[0], _disk_usage(tmp_path / "cache"))
            time.sleep(0.0005)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        got = []
        for w in range(2):
            reader = ShardReader(
                index, 16, world=World(0, 1, w, 2), epochs=2, block_docs=7, seed=3,
                cache=cache, prefetch_shards=2,
            )  # fmt: skip
            for block in reader:
                got.append(block)
                peak[0] = max(peak[0], _disk_usage(tmp_path / "cache"))
    finally:
        stop.set()
        watcher.join()
    ref = [
        b
        for w in range(2)
        for b in ShardReader(
            build(local_corpus[0], "web"),
            16,
            world=World(0, 1, w, 2),
            epochs=2,
            block_docs=7,
            seed=3,
        )
    ]
    assert keys(got) == keys(ref)
    assert 0 < peak[0] <= limit + max(sizes), (peak[0], limit)
    stats = cache.stats()
    assert stats["evictions"] > 0 and stats["downloads"] >= 4


def test_processes_sharing_a_cache_never_download_a_file_twice(s3, s3_corpus, tmp_path) -> None:
    """Four processes acquire the same files at once: each file is downloaded exactly once, and
    nobody ever sees a partial file."""
    index = build(s3_corpus, "web", s3.storage_options)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=_acquire_all, args=(str(tmp_path / "cache"), index, go, queue, k))
        for k in range(4)
    ]
    gc.freeze()  # else each child's garbage collector copies the parent's whole heap
    for p in procs:
        p.start()
    gc.unfreeze()
    go.set()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r["error"] is None for r in results), results
    assert sum(r["downloads"] for r in results) == 4  # one download per file in all
    assert all(r["sizes_ok"] for r in results)


def _acquire_all(cache_dir, index, go, queue, k) -> None:
    result = {"error": None, "downloads": 0, "sizes_ok": True}
    try:
        cache = ShardCache(cache_dir, retry=FAST)
        go.wait()
        for url in index.files[k % 4 :] + index.files[: k % 4]:
            path = cache.acquire(url, index.storage_options)
            size = os.path.getsize(path)
            result["sizes_ok"] &= size == _remote_size(url, index.storage_options)
        result["downloads"] = int(cache.stats()["downloads"])
        cache.close()
    except Exception as exc:  # reported to the parent
        result["error"] = repr(exc)
    queue.put(result)


def test_a_file_another_reader_holds_is_a_hit_not_a_wait_for_its_lock(tmp_path) -> None:
    """A process that finds a file missing must not wait for its exclusive lock: one that
    downloaded it meanwhile holds it shared for as long as it reads it (its lock turned from
    exclusive into shared, a conversion that can pass a waiting request). Three gloo ranks on
    one cache hung so in the suite (one rank waiting for the lock, the others in a collective
    waiting for it). Here: a reader's shared lock while the file is still missing, then the
    file lands; the fetch must find it, without downloading it again."""
    entry = disk.Entry.of(str(tmp_path), "s3://bucket/web/p1.arrow", None, ())
    os.makedirs(os.path.dirname(entry.lock))
    reader = os.open(entry.lock, os.O_RDWR | os.O_CREAT, 0o644)  # its own open file: flock
    fcntl.flock(reader, fcntl.LOCK_SH)  # conflicts with this one as another process's would
    downloads: list[int] = []
    got: dict[str, tuple[int | None, str]] = {}

    def download() -> bool:
        downloads.append(1)
        return True

    def fetch() -> None:
        got["fetch"] = disk.fetch(entry, download)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)  # it found the file missing and is after the exclusive lock
        with open(entry.local, "wb") as f:  # the other reader's download lands
            f.write(b"tokens")
        thread.join(5)
        assert not thread.is_alive(), "fetch waits for the lock a reader holds"
    finally:
        os.close(reader)  # (lets a waiting fetch go, so the thread ends either way)
        thread.join(5)
    fd, outcome = got["fetch"]
    assert (outcome, downloads) == ("hit", [])
    assert fd is not None
    os.close(fd)


def test_partial_downloads_are_never_visible_and_are_cleaned_up(s3, s3_proxy, s3_corpus, tmp_path):
    so = s3.options_via(s3_proxy.endpoint_url, config_kwargs={"retries": {"total_max_attempts": 1}})
    index = build(s3_corpus, "web", so)
    s3_proxy.share, s3_proxy.kinds, s3_proxy.max_faults = 1.0, ("truncate",), 100
    s3_proxy.methods = ("GET",)  # every download is cut short
    cache = ShardCache(tmp_path / "cache", retry=RetryPolicy(max_attempts=3, base_delay_s=0.01))
    with pytest.raises(RemoteError, match="part_0.arrow: download failed 3 time"):
        cache.acquire(index.files[0], so)
    assert not os.path.exists(cache.local_path(index.files[0], so))
    assert not [p for p in _all_files(tmp_path / "cache") if ".part-" in p]
    s3_proxy.share = 0.0
    path = cache.acquire(index.files[0], so)
    assert os.path.getsize(path) == _remote_size(index.files[0], so)


def test_corrupt_cached_copy_names_the_url_and_is_fetched_again(s3, s3_corpus, tmp_path) -> None:
    index = build(s3_corpus, "web", s3.storage_options)
    cache = ShardCache(tmp_path / "cache")
    ref = keys(read_all(index, World(), cache=cache))
    path = cache.local_path(index.files[2], s3.storage_options)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataFileError, match=r"s3://.*part_2\.arrow: .*cached copy"):
        read_all(index, World(), cache=cache)
    assert not os.path.exists(path)  # thrown away ...
    assert keys(read_all(index, World(), cache=cache)) == ref  # ... and downloaded again


# ------------------------------------------------------------------------- range reads, stats
def test_range_reads_equal_local_and_download_nothing(s3, s3_corpus, local_corpus, tmp_path):
    cache = ShardCache(tmp_path / "cache", range_reads=True, block_size=4096, retry=FAST)
    # Arrow, Parquet and flat token files with an offsets sidecar (tests/test_range_reads.py)
    for name in ("web", "books", "code"):
        remote = build(s3_corpus, name, s3.storage_options)
        got = read_all(remote, World(), cache=cache)
        assert keys(got) == keys(read_all(build(local_corpus[0], name), World())), name
    stats = cache.stats()
    assert stats["downloads"] == 0 and stats["range_requests"] > 0
    assert not _all_files(tmp_path / "cache")
    # formats without random access are still downloaded
    chat = build(s3_corpus, "chat", s3.storage_options)
    assert keys(read_all(chat, World(), cache=cache)) == keys(
        read_all(build(local_corpus[0], "chat"), World())
    )
    assert cache.stats()["downloads"] == 2


def test_io_stats_and_a_debug_line_per_download(s3, s3_corpus, tmp_path, caplog) -> None:
    index = build(s3_corpus, "web", s3.storage_options)
    reader = ShardReader(
        index, 8, world=World(), epochs=1, cache=ShardCache(tmp_path / "c"), prefetch_shards=0
    )
    with caplog.at_level(logging.DEBUG, logger="torchdata_ext.remote"):
        run(reader)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("downloaded")]
    assert len(lines) == 4 and all("s3://" in ln and "bytes in" in ln for ln in lines)
    stats = reader.io_stats()
    assert stats["downloads"] == stats["misses"] == 4 and stats["prefetched"] == 0
    assert stats["bytes_downloaded"] == sum(
        _remote_size(f, index.storage_options) for f in index.files
    )
    assert 0 < stats["wait_seconds"] <= stats["open_seconds"] <= stats["reader_seconds"]
    assert stats["files_opened"] >= 4


def test_cache_and_reader_pickle(s3, s3_corpus, tmp_path) -> None:
    index = build(s3_corpus, "web", s3.storage_options)
    cache = ShardCache(tmp_path / "c", max_bytes=10**9)
    reader = ShardReader(index, 8, world=World(), epochs=1, cache=cache, prefetch_shards=2)
    clone = pickle.loads(pickle.dumps(reader))  # as sent to a worker process
    assert keys(run(reader, 3)) == keys(run(clone, 3))
    assert clone.cache is not None and clone.cache.cache_dir == cache.cache_dir
    assert clone.cache.stats()["downloads"] == 0  # its own counters; the files were cached
    err = pickle.loads(pickle.dumps(RemoteError("s3://b/k", "boom", transient=True)))
    assert str(err) == "s3://b/k: boom" and err.url == "s3://b/k" and err.transient


# ------------------------------------------------------------------------------ retry helpers
def test_retry_policy_checks_its_arguments_and_bounds_delays() -> None:
    with pytest.raises(ValueError, match="max_attempts=0 must be >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="total_timeout_s=-1"):
        RetryPolicy(total_timeout_s=-1)
    p = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0)
    assert all(0 <= p.delay(k) <= min(1.0, 0.1 * 2 ** (k - 1)) for k in range(1, 30))
    with pytest.raises(ValueError, match="max_bytes=-1"):
        ShardCache(max_bytes=-1)
    with pytest.raises(ValueError, match="prefetch_shards=-1"):
        ShardReader(
            DatasetIndex("d", ("a",), np.array([5]), np.array([5]), "arrow"), 1, prefetch_shards=-1
        )


def test_transient_and_permanent_errors_are_told_apart() -> None:
    from aiohttp import ClientPayloadError, ServerDisconnectedError
    from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError
    from s3fs.errors import translate_boto_error

    def client_error(code: str, status: int) -> ClientError:
        return ClientError(
            {
                "Error": {"Code": code, "Message": code},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "GetObject",
        )

    def wrapped(exc: BaseException) -> BaseException:  # as a handler reports a read error
        try:
            try:
                raise exc
            except BaseException as inner:
                raise DataFileError("s3://b/k", "cannot read the file") from inner
        except DataFileError as outer:
            return outer

    transient = [
        client_error("SlowDown", 503),
        client_error("InternalError", 500),
        client_error("Whatever", 502),
        translate_boto_error(client_error("SlowDown", 503)),
        translate_boto_error(client_error("503", 503)),
        OSError(errno.ECONNRESET, "reset"),
        ConnectionResetError(),
        TimeoutError(),
        ClientPayloadError("cut short"),
        ServerDisconnectedError(),
        ConnectionClosedError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        wrapped(OSError(errno.ECONNRESET, "reset")),
    ]
    permanent = [
        client_error("NoSuchKey", 404),
        client_error("AccessDenied", 403),
        translate_boto_error(client_error("NoSuchBucket", 404)),
        translate_boto_error(client_error("InvalidAccessKeyId", 403)),
        FileNotFoundError("x"),
        PermissionError("x"),
        wrapped(FileNotFoundError("x")),
        ValueError("bad"),
        RemoteError("s3://b/k", "gave up", transient=True),
    ]
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)


def test_with_retries_retries_then_gives_up_naming_the_url() -> None:
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert with_retries(flaky, "s3://b/k", FAST) == "ok" and len(calls) == 3
    t0 = time.monotonic()
    policy = RetryPolicy(
        max_attempts=1000, base_delay_s=0.01, max_delay_s=0.05, total_timeout_s=0.3
    )
    with pytest.raises(RemoteError, match=r"^s3://b/k: read failed \d+ time\(s\) over") as info:
        with_retries(lambda: (_ for _ in ()).throw(TimeoutError("slow")), "s3://b/k", policy)
    assert time.monotonic() - t0 < 0.5 and info.value.transient
    with pytest.raises(FileNotFoundError):  # permanent: no retry
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "s3://b/k", policy)


def test_write_bytes_atomic_local(tmp_path) -> None:
    target = tmp_path / "ckpt" / "state.pkl"
    write_bytes_atomic(str(target), b"one")
    write_bytes_atomic(str(target), b"two")
    assert target.read_bytes() == b"two" and os.listdir(target.parent) == ["state.pkl"]
    assert read_bytes(str(target)) == b"two"


# --------------------------------------------------------------------------------- helpers
def _all_files(folder) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]


def _cached_files(cache: ShardCache) -> list[str]:
    return [p for p in _all_files(cache.cache_dir) if not os.path.basename(p).startswith(".")]


def _disk_usage(folder) -> int:
    total = 0
    for path in _all_files(folder):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(path)
    return total


def _remote_size(url: str, so) -> int:
    import s3fs

    return int(s3fs.S3FileSystem(skip_instance_cache=True, **so).size(url))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_prefetch_asks_for_exactly_the_next_files_opened(tmp_path, n) -> None:
    """At every file open, the files held as prefetched are the next distinct files the reader
    goes on to open, in order (memory:// stands in for a remote store)."""
    root = f"memory://prefetch-{uuid.uuid4().hex[:8]}/web"
    docs = make_docs(200, 9, base=0)
    for f in range(5):
        write_arrow_batches(f"{root}/p{f}.arrow", docs[f * 40 : (f + 1) * 40])
    index = DatasetIndex.build(root)
    for world in (World(), World(0, 1, 1, 2)):
        cache = ShardCache(tmp_path / f"c{n}{world.global_worker}")
        reader = ShardReader(index, 12, world=world, epochs=1, cache=cache, prefetch_shards=n)
        opens, wanted = _record_opens(reader, cache)
        assert len(opens) >= 5
        for k, current in enumerate(opens):
            future: list[str] = []
            for url in opens[k + 1 :]:
                if url != current and url not in future:
                    future.append(url)
            assert wanted[k] == future[:n], k
        assert cache.stats()["downloads"] == len(set(opens))


def test_partial_download_of_a_dead_process_is_cleaned_up(tmp_path) -> None:
    import fcntl

    cache = ShardCache(tmp_path / "c", max_bytes=10**6)
    local = cache.local_path("s3://b/data/x.arrow")
    os.makedirs(os.path.dirname(local))
    folder = os.path.dirname(local)
    dead = os.path.join(folder, ".x.arrow.0.part-5000-999999-abcd")
    alive = os.path.join(folder, ".y.arrow.0.part-7000-1-abcd")
    for path in (dead, alive):
        open(path, "wb").close()
    lock = os.open(os.path.join(folder, ".y.arrow.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # y's downloader is still at work
    try:
        assert cache.disk_usage() == 7000  # its reservation counts; x's leftover is gone
        assert not os.path.exists(dead) and os.path.exists(alive)
    finally:
        os.close(lock)


def _record_opens(reader: ShardReader, cache: ShardCache) -> tuple[list[str], list[list[str]]]:
    """Run ``reader``; the URLs it opened, and what it held as prefetched after each open."""
    opens: list[str] = []
    wanted: list[list[str]] = []
    open_prefetching = reader._open_prefetching

    def spy(file, upcoming):
        out = open_prefetching(file, upcoming)
        opens.append(reader.dataset.files[file])
        wanted.append(list(reader._prefetching))
        return out

    reader._open_prefetching = spy  # type: ignore[method-assign]
    run(reader)
    return opens, wanted


def test_credentials_and_endpoint_from_the_environment(s3, s3_corpus, monkeypatch, tmp_path):
    """No storage_options at all: the usual AWS variables name the endpoint and credentials."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    index = build(s3_corpus, "web")
    assert index.storage_options == {} and index.total_docs == 240
    got = read_all(index, World(), cache=ShardCache(tmp_path / "c"))
    assert keys(got) == keys(read_all(build(s3_corpus, "web", s3.storage_options), World()))


def test_eviction_takes_the_least_recently_used_file_nobody_holds(tmp_path) -> None:
    root = f"memory://lru-{uuid.uuid4().hex[:8]}"
    for name in "abcd":
        write_arrow_batches(f"{root}/{name}.arrow", [np.arange(1000)])
    size = len(read_bytes(f"{root}/a.arrow"))
    cache = ShardCache(tmp_path / "c", max_bytes=int(2.5 * size))
    url = {name: f"{root}/{name}.arrow" for name in "abcd"}

    def cached() -> set[str]:
        return {n for n in "abcd" if os.path.exists(cache.local_path(url[n]))}

    for name in "aba":  # a was used last
        cache.acquire(url[name])
        cache.release(url[name])
        time.sleep(0.01)
    cache.acquire(url["c"])  # held from here on
    assert cached() == {"a", "c"}  # b went: least recently used
    cache.acquire(url["d"])
    cache.release(url["d"])
    assert cached() == {"c", "d"}  # a went; c is held
    cache.acquire(url["b"])
    assert cached() == {"b", "c"} and cache.stats()["evictions"] == 3
    # both held: a prefetch does not fit and is skipped; a file needed now still comes
    cache.prefetch(url["a"])
    deadline = time.monotonic() + 10
    while not cache.stats()["prefetch_skipped"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.stats()["prefetch_skipped"] == 1 and cached() == {"b", "c"}
    cache.acquire(url["a"])
    assert cached() == {"a", "b", "c"} and cache.disk_usage() <= int(2.5 * size) + size


class _Ticks:
    """A clock for torchdata_ext.progress that advances ``step`` seconds per reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_slow_listing_counting_and_downloads_log_progress(s3, tmp_path, monkeypatch, caplog):
    so = s3.storage_options
    docs = make_docs(90, 7, base=5_000_000)
    for f in range(3):
        write_arrow_batches(
            s3.url("slow", f"p{f}.arrow"), docs[f * 30 : (f + 1) * 30], storage_options=so
        )
    patterns = [s3.url("slow", "p0.arrow"), s3.url("slow", "p{1,2}.arrow")]
    caplog.set_level(logging.INFO, logger="torchdata_ext")
    fast = DatasetIndex.build(patterns, storage_options=so, write_counts=False)
    assert [r.getMessage() for r in caplog.records] == []  # a short wait says nothing
    monkeypatch.setattr("torchdata_ext.progress._clock", _Ticks(1.0))
    index = DatasetIndex.build(patterns, storage_options=so, write_counts=False)
    assert index.files == fast.files and index.total_docs == 90
    lines = [r.getMessage() for r in caplog.records]
    where = ", ".join(patterns)
    assert lines == [
        f"listing {where}: 2 of 2 patterns (3 files) after 2 s",  # not a TTY: log lines
        f"listing {where}: done, 2 of 2 patterns (3 files) in 3.0 s",
        "counting the documents of 'slow': 2 of 3 files after 2 s, about 1 s left",
        "counting the documents of 'slow': done, 3 of 3 files in 4.0 s",
    ]
    caplog.clear()
    cache = ShardCache(tmp_path / "c")
    local = cache.acquire(index.files[0], so)
    size = os.path.getsize(local)
    lines = [r.getMessage() for r in caplog.records if "downloading" in r.getMessage()]
    assert lines[0].startswith(f"downloading {index.files[0]}: ")
    assert lines[-1].startswith(f"downloading {index.files[0]}: done, {size:,} of {size:,} B in")
    cache.release(index.files[0], so)
    cache.close()


def test_a_release_from_a_finalizer_under_the_cache_lock_is_deferred(s3, s3_corpus, tmp_path):
    """The garbage collector can run a dropped reader's finalizer (which releases its holds) at
    any allocation, including one made while this thread holds the cache's lock (acquire
    builds a Future under it): that release must not wait for the lock (it hung the test
    suite once). It is deferred, and the next call of the cache drops the hold exactly once."""
    index = build(s3_corpus, "web", s3.storage_options)
    cache = ShardCache(tmp_path / "cache", retry=FAST)
    url = index.files[0]
    cache.acquire(url, s3.storage_options)
    cache.acquire(url, s3.storage_options)
    rt = cache._runtime()
    (slot,) = rt.slots.values()
    assert slot.refs == 2

    done = threading.Event()

    def finalizer_under_the_lock() -> None:
        with rt.mu:  # as acquire holds it when the collector runs a finalizer
            cache.release(url, s3.storage_options)
        done.set()

    worker = threading.Thread(target=finalizer_under_the_lock, daemon=True)
    worker.start()
    assert done.wait(10), "a release under the cache lock waited for the lock"
    assert slot.refs == 2 and rt.deferred == [(url, s3.storage_options)]
    cache.release(url, s3.storage_options)  # drains the deferred release, then its own
    assert slot.refs == 0 and rt.deferred == []


def test_a_download_takes_its_size_from_the_index_without_a_head(s3, s3_corpus, tmp_path) -> None:
    """A data file the reader downloads is one GET: its size is the one its dataset index
    lists (a download sent a HEAD for it first). Without listed sizes (an index made by hand)
    the store is asked, a HEAD a file. A listed size the object no longer has is refused,
    naming the index and what to do."""
    import dataclasses

    from torchdata_ext.remote.counting import count_s3_objects

    so = s3.storage_options
    index = build(s3_corpus, "web", so)
    assert len(index.file_stats) == len(index.files)

    def data_requests(counts, kind: str) -> dict[str, int]:
        return {k: n for k, n in counts.items() if k.startswith(f"{kind} ") and "/web/" in k}

    with count_s3_objects() as listed:
        got = keys(read_all(index, World(), cache=ShardCache(tmp_path / "a")))
    assert data_requests(listed, "HEAD") == {}
    gets = data_requests(listed, "GET")
    assert len(gets) == len(index.files) and set(gets.values()) == {1}, gets
    bare = dataclasses.replace(index, file_stats=())
    with count_s3_objects() as asked:
        assert keys(read_all(bare, World(), cache=ShardCache(tmp_path / "b"))) == got
    heads = data_requests(asked, "HEAD")
    assert len(heads) == len(index.files) and set(heads.values()) == {1}, heads
    cache = ShardCache(tmp_path / "c", retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
    size = index.file_stats[0][0]
    with pytest.raises(
        RemoteError, match=r"part_0\.arrow.*dataset index lists.*torchdata-ext index"
    ):
        cache.acquire(index.files[0], so, size=size + 1)
    assert not os.path.exists(cache.local_path(index.files[0], so))


def test_a_range_read_open_takes_its_size_from_the_index_without_a_head(
    s3, s3_corpus, local_corpus, tmp_path
) -> None:
    """Range reads open an Arrow or Parquet file with no HEAD when its dataset index lists its
    size (an open stat-ed the object for it), and deliver the same tokens as a read from disk.
    Without listed sizes the store is asked, a HEAD an open. A listed size the object does not
    have (larger, smaller, or far larger) is refused at the first read of the file's end,
    naming the file and `torchdata-ext index`."""
    import dataclasses

    from torchdata_ext.remote.counting import count_s3_objects

    so = s3.storage_options

    def data_requests(counts, kind: str, name: str) -> dict[str, int]:
        return {k: n for k, n in counts.items() if k.startswith(f"{kind} ") and f"/{name}/" in k}

    for name in ("web", "books"):
        index = build(s3_corpus, name, so)
        assert len(index.file_stats) == len(index.files)
        ref = keys(read_all(build(local_corpus[0], name), World()))
        cache = ShardCache(tmp_path / name, range_reads=True, block_size=4096, retry=FAST)
        with count_s3_objects() as listed:
            assert keys(read_all(index, World(), cache=cache)) == ref, name
        assert data_requests(listed, "HEAD", name) == {}, name
        assert len(data_requests(listed, "RANGE_GET", name)) == len(index.files), name
        assert cache.stats()["downloads"] == 0 and not _all_files(tmp_path / name)
        bare = dataclasses.replace(index, file_stats=())
        with count_s3_objects() as asked:
            assert keys(read_all(bare, World(), cache=cache)) == ref, name
        heads = data_requests(asked, "HEAD", name)  # one an open (a file split in shards: more)
        assert len(heads) == len(index.files) and min(heads.values()) >= 1, (name, heads)

    index = build(s3_corpus, "web", so)
    cache = ShardCache(tmp_path / "wrong", range_reads=True, block_size=4096, retry=FAST)
    size = index.file_stats[0][0]
    for wrong in (size + 1, size - 1, 4 * size):
        stats = list(index.file_stats)
        stats[0] = (wrong, stats[0][1])
        bad = dataclasses.replace(index, file_stats=tuple(stats))
        with pytest.raises(
            RemoteError, match=rf"part_0\.arrow: the dataset index lists {wrong} bytes.*"
            r"rebuild it with `torchdata-ext index`"
        ):  # fmt: skip
            read_all(bad, World(), n_shards=1, cache=cache)
    assert cache.stats()["downloads"] == 0
