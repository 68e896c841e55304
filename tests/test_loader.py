"""TokenLoader under StatefulDataLoader: same-topology resume, folder/DCP checkpoints, rescale."""

from __future__ import annotations

import collections
import functools
import pickle

import numpy as np
import pytest
from harness import item_key

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.testing import write_arrow_batches

N_SHARDS = 24


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader") / "web"
    rng = np.random.default_rng(5)
    docs = [
        np.concatenate([[1_000_000 + i], rng.integers(5, 9000, int(rng.integers(0, 20)))]).astype(
            np.uint32
        )
        for i in range(300)
    ]
    for f in range(3):
        write_arrow_batches(str(root / f"p{f}.arrow"), docs[f * 100 : (f + 1) * 100])
    return str(root), docs


def build_reader(root: str, world: World, *, epochs: int | None = 1, seed: int = 0) -> ShardReader:
    index = DatasetIndex.build(root)
    return ShardReader(index, N_SHARDS, world=world, epochs=epochs, block_docs=4, seed=seed)


def ids(blocks) -> list[int]:
    return [int(d.data[0]) - 1_000_000 for b in blocks for d in b]


def take(it, n):
    out = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_same_topology_restore_is_bit_identical_three_times(corpus, workers) -> None:
    build = functools.partial(build_reader, corpus[0], epochs=None)
    ref = [item_key(b) for b in take(TokenLoader(build, num_workers=workers), 60)]
    got = []
    loader = TokenLoader(build, num_workers=workers)
    it = iter(loader)
    for cycle, stop in enumerate([7, 23, 41]):
        got += [item_key(b) for b in take(it, stop - len(got))]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        assert state["next_worker"] == (stop % workers if workers else 0), cycle
        loader = TokenLoader(build, num_workers=workers)
        loader.load_state_dict(state)
        it = iter(loader)
    got += [item_key(b) for b in take(it, 60 - len(got))]
    assert got == ref


@pytest.mark.multiprocess
def test_checkpoint_between_snapshots_resumes_exactly(corpus, tmp_path) -> None:
    """With snapshot_every_n_steps=3 the workers' states lag up to 2 batches behind: a state
    taken at any step resumes with exactly the uninterrupted stream (the lagging batches are
    made again and dropped), through state_dict and through a folder checkpoint; a folder
    checkpoint taken between snapshots refuses to rescale, saying why."""
    build = functools.partial(build_reader, corpus[0], epochs=None)
    ref = [item_key(b) for b in take(TokenLoader(build, num_workers=2), 30)]
    lags = []
    for stop in (4, 5, 6):
        loader = TokenLoader(build, num_workers=2, snapshot_every_n_steps=3)
        head = [item_key(b) for b in take(iter(loader), stop)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        lags.append(state["skip_batches"])
        ckpt = str(tmp_path / f"ckpt{stop}")
        save_checkpoint(loader, ckpt)
        resumed = TokenLoader(build, num_workers=2, snapshot_every_n_steps=3)
        resumed.load_state_dict(state)
        it = iter(resumed)
        # a checkpoint right after resuming, before the lagging batches were made and dropped
        again = pickle.loads(pickle.dumps(resumed.state_dict()))
        assert again["skip_batches"] == state["skip_batches"]
        assert head + [item_key(b) for b in take(it, 30 - stop)] == ref, stop
        twice = TokenLoader(build, num_workers=2, snapshot_every_n_steps=3)
        twice.load_state_dict(again)
        assert head + [item_key(b) for b in take(iter(twice), 30 - stop)] == ref, stop
        resumed = TokenLoader(build, num_workers=2)
        load_checkpoint(resumed, ckpt)
        assert head + [item_key(b) for b in take(iter(resumed), 30 - stop)] == ref, stop
        if state["skip_batches"]:
            with pytest.raises(ValueError, match="multiples of snapshot_every_n_steps"):
                load_checkpoint(TokenLoader(build, num_workers=3), ckpt)
    assert any(lags) and not all(lags), lags  # between snapshots and at one


@pytest.mark.multiprocess
def test_lagging_worker_state_restores_in_process(corpus) -> None:
    """A 1-worker state taken between snapshots restores into num_workers=0 (one logical
    worker either way); until the lagging batches are dropped, state_dict still counts them."""
    build = functools.partial(build_reader, corpus[0], epochs=None)
    ref = [item_key(b) for b in take(TokenLoader(build), 20)]
    loader = TokenLoader(build, num_workers=1, snapshot_every_n_steps=4)
    head = [item_key(b) for b in take(iter(loader), 6)]
    state = loader.state_dict()
    assert state["skip_batches"] == 2
    local = TokenLoader(build)
    local.load_state_dict(state)
    it = iter(local)
    assert local.state_dict()["skip_batches"] == 2
    first = [item_key(b) for b in take(it, 1)]
    assert local.state_dict()["skip_batches"] == 0
    assert head + first + [item_key(b) for b in take(it, 13)] == ref


def run_rank(build, rank, ranks, workers, steps=None):
    loader = TokenLoader(build, num_workers=workers, rank=rank, world_size=ranks)
    blocks = take(iter(loader), steps) if steps else list(loader)
    return loader, blocks


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "old,new",
    [
        ((2, 2), (1, 0)),
        ((2, 2), (1, 3)),
        ((2, 2), (3, 1)),
        ((3, 1), (4, 2)),
        ((3, 1), (2, 2)),
        ((2, 2), (2, 2)),
    ],
    ids=str,
)
def test_folder_checkpoint_rescale_delivers_exactly_once(corpus, tmp_path, old, new) -> None:
    root, docs = corpus
    build = functools.partial(build_reader, root)
    seen: list[int] = []
    ckpt = str(tmp_path / "ckpt")
    R, W = old
    for r in range(R):
        loader, blocks = run_rank(build, r, R, W, steps=5 + 3 * r)
        seen += ids(blocks)
        save_checkpoint(loader, ckpt)
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(build, num_workers=W2, rank=r, world_size=R2)
        load_checkpoint(loader, ckpt)
        seen += ids(list(loader))
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(300)) and max(counts.values()) == 1


def test_load_after_start_raises_and_mismatch_is_refused(corpus, tmp_path) -> None:
    root, _ = corpus
    build = functools.partial(build_reader, root)
    loader = TokenLoader(build)
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="after iteration started"):
        loader.load_state_dict(loader.state_dict())
    other = TokenLoader(build, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rescales"):
        other.load_state_dict(loader.state_dict())
    ckpt = str(tmp_path / "c")
    save_checkpoint(loader, ckpt)
    reseeded = TokenLoader(functools.partial(build_reader, root, seed=7))
    with pytest.raises(ValueError, match="seed differ"):
        load_checkpoint(reseeded, ckpt)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_checkpoint(TokenLoader(build), str(tmp_path / "nothing"))


def test_dcp_round_trip(corpus, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    build = functools.partial(build_reader, corpus[0], epochs=None)
    ref = [item_key(b) for b in take(TokenLoader(build), 30)]
    loader = TokenLoader(build)
    first = [item_key(b) for b in take(iter(loader), 12)]
    dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "dcp"))
    fresh = TokenLoader(build)
    dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=str(tmp_path / "dcp"))
    assert first + [item_key(b) for b in take(iter(fresh), 18)] == ref


def _as_format_1(graph):
    """A graph state as the previous version wrote it: shuffle-buffer provenance as one
    concatenation per column (``prov_counts`` / ``prov_rows``) instead of groups of blocks."""
    if isinstance(graph, dict):
        out = {k: _as_format_1(v) for k, v in graph.items() if k != "prov_groups"}
        if "prov_groups" in graph:
            blocks = [b for group in graph["prov_groups"] for b in group]
            rows = np.concatenate([np.asarray(r, np.int64) for _, r in blocks])
            out["prov_counts"] = np.concatenate([c for c, _ in blocks])
            out["prov_rows"] = [rows[:, c] for c in range(5)]
        return out
    return graph


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_written_by_the_previous_version_still_restores(tmp_path, workers) -> None:
    """States of the previous format (worker graphs pickled as ``graph_pickle``, shuffle
    provenance concatenated) restore and continue with exactly the uninterrupted stream."""
    cfg = _two_datasets(tmp_path, 1, output_keys="input_ids,labels,position_ids,loss_mask")
    build = functools.partial(_pipeline, cfg)
    ref = [_batch_key(b) for b in take(TokenLoader(build, num_workers=workers), 24)]
    loader = TokenLoader(build, num_workers=workers)
    head = [_batch_key(b) for b in take(iter(loader), 9)]
    state = loader.state_dict()
    old = dict(state)
    old["workers"] = {
        g: {
            "world": st["world"],
            "graph_pickle": pickle.dumps(_as_format_1(st["graph"])),
            "io": st["io"],
        }
        for g, st in state["workers"].items()
    }
    resumed = TokenLoader(build, num_workers=workers)
    resumed.load_state_dict(pickle.loads(pickle.dumps(old)))
    assert head + [_batch_key(b) for b in take(iter(resumed), 15)] == ref


def _two_datasets(root, seed: int, **kw):
    """A small full-pipeline config over two datasets of random documents under ``root``."""
    from torchdata_ext.pipeline.config import PipelineConfig

    rng = np.random.default_rng(seed)
    for name in ("web", "code"):
        docs = [rng.integers(5, 900, int(rng.integers(1, 60)), dtype=np.uint32) for _ in range(80)]
        write_arrow_batches(str(root / name / "a.arrow"), docs)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=24,
        logical_shards=8, batch_size=2, shuffle_buffer=9, block_docs=4, seed=3, **kw,
    )  # fmt: skip


def _pipeline(cfg, world):
    from torchdata_ext.pipeline.build import build_pipeline

    return build_pipeline(cfg, world)


def _batch_key(batch) -> tuple:
    return tuple((k, tuple(v.reshape(-1).tolist())) for k, v in batch.items())


@pytest.mark.multiprocess
def test_a_worker_state_is_the_in_process_state_value_for_value_and_type(tmp_path) -> None:
    """What the training process assembles from a worker's deltas is the graph's own state:
    same values and same types (NumPy arrays stay arrays across the process boundary)."""
    from test_state_delta import plain, same

    cfg = _two_datasets(tmp_path, 2)
    build = functools.partial(_pipeline, cfg)
    local, remote = TokenLoader(build, num_workers=0), TokenLoader(build, num_workers=1)
    a, b = iter(local), iter(remote)
    for step in range(13):
        next(a), next(b)
        if step % 4 == 0:
            sa, sb = local.state_dict(), remote.state_dict()
            # each as it is saved: the shuffle buffer's provenance is built when read, on both sides
            assert same(plain(sa["workers"]["0"]["graph"]), plain(sb["workers"]["0"]["graph"])), (
                step
            )


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop", ["loader-and-iterator", "loop-broken"])
def test_a_loader_dropped_mid_stream_without_close_leaves_nothing_running(
    corpus, workers, drop
) -> None:
    """A loader left mid-stream and dropped without close() (an evaluation loader, a loop
    broken out of) is freed, its background thread stopped and its worker processes ended: its
    own thread must not keep it alive. Before, each such loader kept its thread, its pipeline
    and its 2 workers until the process exited (a test process had 100 threads by the end)."""
    import gc
    import multiprocessing
    import threading
    import time
    import weakref

    def running() -> set[object]:
        """This process's loader threads and child processes (another test's may be live)."""
        threads = {t for t in threading.enumerate() if t.name == "TokenLoader"}
        return threads | {p.pid for p in multiprocessing.active_children()}

    before = running()
    build = functools.partial(build_reader, corpus[0], epochs=None)
    loader = TokenLoader(build, num_workers=workers)
    if drop == "loop-broken":
        assert len(take(loader, 3)) == 3
    else:
        it = iter(loader)
        next(it), next(it)
        del it
    assert len(running() - before) == 1 + workers  # its thread and its workers
    ref = weakref.ref(loader)
    del loader
    gc.collect()
    assert ref() is None, "the dropped loader is still referenced"
    deadline = time.monotonic() + 20
    while running() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running() - before, "a dropped loader left its thread or workers running"


@pytest.mark.multiprocess
@pytest.mark.parametrize("consumed", ["to-the-end", "mid-stream"])
def test_a_loader_freed_by_the_cyclic_collector_ends_its_workers_at_once(corpus, consumed) -> None:
    """A loader held only by a reference cycle is freed by the cyclic collector, with all it
    alone holds (an exception caught anywhere below ``iter(loader)`` makes such a cycle: its
    frames keep their callers' up to the loader's). Its workers are told to exit while their
    queues still deliver: the collection takes a fraction of a second. Before, the queues were
    closed first and torch waited 5 s per worker before killing it: random stalls of 5-15 s
    in the middle of later work (the test suite's slowest "tests" were such collections)."""
    import gc
    import multiprocessing
    import time
    import weakref

    before = {p.pid for p in multiprocessing.active_children()}
    loader = TokenLoader(functools.partial(build_reader, corpus[0], epochs=1), num_workers=2)
    it = iter(loader)
    batches = [next(it)]
    workers = {p.pid for p in multiprocessing.active_children()} - before
    assert len(workers) == 2  # (a worker whose share ends exits: seen while both run)
    if consumed == "to-the-end":
        batches += list(it)
        assert sorted(ids(batches)) == list(range(300))  # the whole epoch
    else:
        batches.append(next(it))
    del it
    loader.cycle = loader  # what a caught exception's frames make
    ref = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert ref() is not None  # only the collector can free it
        start = time.monotonic()
        gc.collect()
        took = time.monotonic() - start
    finally:
        gc.enable()
    assert ref() is None
    assert took < 4.0, f"freeing the loader took {took:.1f} s (torch's 5 s wait per worker)"
    assert not workers & {p.pid for p in multiprocessing.active_children()}


def test_closing_from_the_background_thread_itself_does_not_raise() -> None:
    """The last reference to a loader can be dropped inside its own background thread (the
    thread runs the loader's generator, and the loader's finalizer closes it): closing must then
    not try to join that thread ("cannot join current thread")."""
    import threading

    from torchdata_ext.loader.background import Background

    errors: list[BaseException] = []
    ready = threading.Event()

    def source():
        yield 1
        ready.wait(5)
        try:
            holder.close()
        except BaseException as exc:  # the failure under test
            errors.append(exc)

    holder = Background(source(), depth=1)
    ready.set()
    assert next(holder) == 1
    holder._thread.join(timeout=5)
    assert not holder._thread.is_alive()
    assert errors == []


def test_background_hands_over_in_order_in_batches_and_ends_cleanly() -> None:
    """The background thread's hand-over: every item in order, at most ``depth`` prepared
    ahead, a waiting consumer woken only when ``wake`` items are ready (the cost this batching
    saves is one thread hand-over per item), a stream shorter than ``wake`` still delivered
    whole, and the source's exception raised after the items before it."""
    import threading
    import time

    from torchdata_ext.loader.background import Background

    made: list[int] = []
    lock = threading.Lock()

    def slow(n: int):
        for i in range(n):
            time.sleep(0.002)
            with lock:
                made.append(i)
            yield i

    bg = Background(slow(40), depth=8, wake=4, linger=1.0)
    waits = 0
    wait = bg._ready.wait

    def counted(timeout=None):
        nonlocal waits
        waits += 1
        return wait(timeout)

    bg._ready.wait = counted  # type: ignore[method-assign]
    got = []
    for item in bg:
        with lock:
            ahead = len(made) - len(got)
        assert ahead <= 8 + 1  # depth ahead, plus the one the consumer holds
        got.append(item)
    assert got == list(range(40))
    # woken once per `wake` items, not once per item (the producer ends only at 40)
    assert 0 < waits <= 40 // 4 + 1, waits
    with pytest.raises(StopIteration):
        next(bg)

    assert list(Background(iter(range(3)), depth=16, wake=8)) == [0, 1, 2]

    def failing():
        yield from range(5)
        raise OSError("disk gone")

    bg = Background(failing(), depth=4, wake=2)
    assert [next(bg) for _ in range(5)] == list(range(5))
    with pytest.raises(OSError, match="disk gone"):
        next(bg)
    with pytest.raises(StopIteration):
        next(bg)


def test_background_close_stops_the_producer_and_frees_a_waiting_consumer() -> None:
    import threading
    import time

    from torchdata_ext.loader.background import Background

    def endless():
        i = 0
        while True:
            yield i
            i += 1

    bg = Background(endless(), depth=4, wake=2)
    assert [next(bg) for _ in range(10)] == list(range(10))
    bg.close()
    assert not bg._thread.is_alive()

    release = threading.Event()

    def stalled():
        time.sleep(0.05)  # the consumer is waiting before the first item is ready
        yield 0
        release.wait(10)
        yield 1

    bg = Background(stalled(), depth=4, wake=2)
    t0 = time.monotonic()
    assert next(bg) == 0  # ready: not held back waiting for a second item the source stalls on
    assert time.monotonic() - t0 < 1
    outcome: list[list[int]] = []
    waiter = threading.Thread(target=lambda: outcome.append(list(bg)))
    waiter.start()
    time.sleep(0.05)
    bg.close()  # the consumer is waiting; the producer is inside its source
    release.set()
    waiter.join(5)
    assert not waiter.is_alive() and outcome == [[]]


def test_next_after_close_ends_the_stream_even_when_the_source_had_ended() -> None:
    """close() drops what the thread prepared, the end of the stream included when the source
    had already ended (a short stream that fits in the prefetch depth, or an iterator of a
    TokenLoader started again with iter()): the consumer's next call then ends the stream
    rather than popping from an empty hand-over (IndexError)."""
    from torchdata_ext.loader.background import Background

    bg = Background(iter(range(3)), depth=8, wake=4)
    bg._thread.join(5)  # the source ended: 0, 1, 2 and the end are waiting
    assert not bg._thread.is_alive()
    bg.close()
    with pytest.raises(StopIteration):
        next(bg)
    with pytest.raises(StopIteration):
        next(bg)
