"""At scale, on paper: the state per worker, and what one new rank pays to plan a rescale.

Synthetic counts, no data: 3 datasets (10,000 files each, 20,000-60,000 documents a file),
each cut into N logical shards, and R ranks x 8 workers (default 4,096 x 8 = 32,768 global
workers). Each old worker's graph state is laid out as the pipeline lays it out (shuffle buffer
> pack > interleave > one reader per dataset with its owned shards' cursors as
column arrays, reader state format 2 of ``reader_state.py``), with synthetic walk positions and a synthetic shuffle-buffer
provenance table (``--buffer`` sequences of about ``--rows-per-seq`` rows, half document pieces
inside the worker's own shards, half EOS rows, each column narrowed to the smallest integer
dtype as ``ShuffleBuffer`` stores it). Pickled, these stand in for the checkpoint's
``worker_*.pkl`` files.

It prints:

* the pickled state per worker, with and without the shuffle buffer;
* for one new rank (one of those reading the most old states) rescaling R x 8 -> 0.75R x 8 and
  -> 1.25R x 8: how many old worker states it reads, and the CPU time and peak memory
  (``tracemalloc``) of its plan: find the old workers (``shards.old_workers_to_read``, O(1)),
  unpickle their states, keep the cursors of its own shards, hand the buffered pieces of its
  shards back to their cursors (``returned``), split the interleave token counters
  (``shards.count_new_readers``). Next to it, for one new worker, the brute-force lookup (a
  scan over every old worker, as the rescale code's ``old_workers_needed`` did) and the
  library's ``old_workers_needed``, timed in the same run and checked equal;
* a sweep over ranks (N fixed) and over shards (ranks fixed), with ``--sweep-buffer``
  sequences (tracing every allocation of a 10,000-sequence plan costs ~10 s; the buffer's cost
  is linear, fitted per handed-back piece over all runs), and a statement of how each cost
  grows, from log-log slopes fitted on the sweeps.

Times are CPU time of this process (``time.process_time``), so other jobs on a shared machine
do not inflate them. On paper means: no graph is restored, so the pieces held by the
interleave and pack remainders (at most one block per source, re-read from data by the real
rescale) are not handed back; the shuffle buffer's pieces, the bulk, are. If N is smaller than
the largest number of global workers, the shard maths refuses it (every worker owns at least
one shard); the benchmark prints the refusal and uses N = that number of workers instead.

    python benchmarks/scale_restore.py [--quick] [--ranks 4096] [--shards 30720] [--buffer 10000]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import pickle
import time
import timeit
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchdata_ext.nodes.interleave import Interleave
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.order.shards import count_new_readers, old_workers_to_read, worker_shards
from torchdata_ext.state.reader_state import (
    ReaderCursors,
    cursor_state,
    merge_reader_states,
    reader_cursors,
)
from torchdata_ext.world import World


def _library_lookup() -> Callable[[int, int, World], list[int]]:
    """The rescale code's ``old_workers_needed`` wherever it lives (it is moving from
    ``checkpoint.py`` to ``rescale.py``)."""
    for module in ("torchdata_ext.checkpoint.rescale", "torchdata_ext.checkpoint.folder"):
        try:
            return importlib.import_module(module).old_workers_needed
        except (ImportError, AttributeError):
            continue
    raise ImportError(
        "old_workers_needed not found in torchdata_ext.checkpoint.rescale or .checkpoint"
    )


old_workers_needed = _library_lookup()


def scan_old_workers(n: int, old_total: int, new_world: World) -> list[int]:
    """The brute-force lookup, fixed here as the reference: every old worker whose shards
    overlap the new worker's, by a scan over all old workers (``old_workers_needed`` of the
    rescale code before it used ``old_workers_to_read``)."""
    mine = worker_shards(n, new_world.total_workers, new_world.global_worker)
    out = []
    for g in range(old_total):
        theirs = worker_shards(n, old_total, g)
        if theirs.start < mine.stop and mine.start < theirs.stop:
            out.append(g)
    return out


DATASETS = ("web", "code", "books")
WEIGHTS = (3.0, 1.0, 1.0)
SEQ_LEN = 4096
EOS = 0
PHASES = ("find", "read", "cursors", "hand back", "counters")


# -- synthetic checkpoint --------------------------------------------------------------------------
def corpus(n_files: int, seed: int) -> dict[str, np.ndarray]:
    """Per dataset, the global index of each file's first document (``file_offsets``)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in DATASETS:
        counts = rng.integers(20_000, 60_000, n_files, dtype=np.int64)
        out[name] = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    return out


def _narrow(a: np.ndarray) -> np.ndarray:
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for dt in (np.int8, np.int16, np.int32):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype(np.int64)


def _provenance(
    rng: np.random.Generator,
    shards: range,
    n: int,
    offsets: dict[str, np.ndarray],
    buffer: int,
    rows_per_seq: int,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """``buffer`` sequences' provenance: rows ``[dataset, file, doc, start, length]``, every
    other one a document piece from this worker's shards, the others EOS rows."""
    counts = rng.integers(max(1, rows_per_seq // 2), rows_per_seq * 3 // 2 + 1, buffer)
    rows = int(counts.sum())
    is_doc = np.arange(rows) % 2 == 0
    ds = np.full(rows, -1, np.int64)  # LITERAL
    file = np.full(rows, EOS, np.int64)
    doc = np.zeros(rows, np.int64)
    start = np.zeros(rows, np.int64)
    length = np.ones(rows, np.int64)
    n_doc = int(is_doc.sum())
    ds[is_doc] = rng.choice(len(DATASETS), n_doc, p=np.array(WEIGHTS) / sum(WEIGHTS))
    for k, name in enumerate(DATASETS):
        sel = np.flatnonzero(is_doc & (ds == k))
        off = offsets[name]
        total = int(off[-1])
        s = rng.integers(shards.start, shards.stop, sel.size)
        lo, hi = s * total // n, (s + 1) * total // n
        g = lo + (rng.random(sel.size) * (hi - lo)).astype(np.int64)
        f = np.searchsorted(off, g, side="right") - 1
        file[sel], doc[sel] = f, g - off[f]
        start[sel] = rng.integers(0, 8192, sel.size) * (rng.random(sel.size) < 0.2)
        length[sel] = rng.integers(1, SEQ_LEN, sel.size)
    return _narrow(counts), [_narrow(c) for c in (ds, file, doc, start, length)]


def worker_state(
    g: int,
    total: int,
    n: int,
    offsets: dict[str, np.ndarray],
    *,
    buffer: int,
    rows_per_seq: int,
    seed: int = 0,
) -> dict[str, Any]:
    """A synthetic graph state of global worker ``g`` of ``total``, laid out as the pipeline's."""
    rng = np.random.default_rng((seed, g))
    shards = worker_shards(n, total, g)
    sources = {}
    ids = np.arange(shards.start, shards.stop, dtype=np.int64)
    for name in DATASETS:
        total = int(offsets[name][-1])
        sizes = (ids + 1) * total // n - ids * total // n
        k = len(ids)
        cursors = ReaderCursors(
            ids,
            rng.integers(0, 2, k),
            (rng.random(k) * sizes).astype(np.int64),
            np.where(rng.random(k) < 0.1, rng.integers(0, 50_000, k), 0),
            np.zeros(k, np.int64),
            {},
        )
        header = {
            "dataset": name,
            "fingerprint": f"synthetic-{name}",  # the same in every worker: one dataset
            "seed": seed,
            "n_logical_shards": n,
            "split": None,
        }
        reader = cursor_state(header, cursors)
        sources[name] = {
            Interleave.SOURCE_KEY: reader,
            Interleave.CONSUMED_KEY: int(rng.integers(0, 256)),
            Interleave.ENDED_KEY: False,
        }
    interleave = {
        Interleave.SOURCES_KEY: sources,
        Interleave.TOKENS_KEY: {name: int(rng.integers(10**9, 10**10)) for name in DATASETS},
        "weights": dict(zip(DATASETS, WEIGHTS)),
        Interleave.COUNTER_KEY: int(rng.integers(0, 10**6)),
    }
    pack = {
        "format": 1,
        "mode": "concat",
        "seq_len": SEQ_LEN,
        "shift": True,
        Pack.SOURCE_KEY: interleave,
        "consumed": int(rng.integers(0, 10**6)),
        "bins": 0,
        "open_docs": [],
        "dataset_names": list(DATASETS),
    }
    state: dict[str, Any] = {
        ShuffleBuffer.SOURCE_KEY: pack,
        "draws": int(rng.integers(10**5, 10**7)),
        "exhausted": False,
    }
    if buffer:
        state["prov_counts"], state["prov_rows"] = _provenance(
            rng, shards, n, offsets, buffer, rows_per_seq
        )
    return state


def _interleave(state: dict[str, Any]) -> dict[str, Any]:
    return state[ShuffleBuffer.SOURCE_KEY][Pack.SOURCE_KEY]


def _readers(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    sources = _interleave(state)[Interleave.SOURCES_KEY]
    return {name: src[Interleave.SOURCE_KEY] for name, src in sources.items()}


def _size(state: dict[str, Any]) -> int:
    return len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))


# -- the plan of one new rank ----------------------------------------------------------------------
@dataclass
class Plan:
    """What one new rank read and built."""

    states_read: int = 0
    bytes_read: int = 0
    cursors: int = 0
    returned: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    new_states: list[dict[str, Any]] = field(default_factory=list)


def plan_rank(
    rank: int,
    workers: int,
    n: int,
    old_total: int,
    new_total: int,
    offsets: dict[str, np.ndarray],
    read: Callable[[int], bytes],
) -> Plan:
    """The new graph states of new rank ``rank``'s ``workers`` workers, from the old worker
    states ``read(g)`` returns (pickled), reading each needed one once."""
    plan = Plan()
    states: dict[int, dict[str, Any]] = {}
    clock = time.process_time
    for w in range(workers):
        new_worker = rank * workers + w
        t0 = clock()
        needed = old_workers_to_read(n, old_total, new_total, new_worker)
        mine = worker_shards(n, new_total, new_worker)
        t1 = clock()
        for g in needed:
            if g not in states:
                blob = read(g)
                plan.bytes_read += len(blob)
                states[g] = pickle.loads(blob)
        t2 = clock()
        merged: dict[str, ReaderCursors] = {}
        ids = np.arange(mine.start, mine.stop, dtype=np.int64)
        for name in DATASETS:  # the library's merge, then my shards: an array selection
            whole = reader_cursors(
                merge_reader_states([_readers(states[g])[name] for g in needed], complete=False)
            )
            rows = whole.rows(ids)
            if (rows < 0).any():
                raise AssertionError(f"{name}: {int((rows >= 0).sum())} of {len(mine)} found")
            merged[name] = whole.take(rows)
            plan.cursors += len(rows)
        t3 = clock()
        for g in needed:  # the buffered pieces of my shards go back to their cursors
            old = states[g]
            if "prov_rows" not in old:
                continue
            ds, file, doc, start, length = (np.asarray(c, np.int64) for c in old["prov_rows"])
            for k, name in enumerate(DATASETS):
                off = offsets[name]
                total = int(off[-1])
                sel = np.flatnonzero((ds == k) & (length > 0))
                gdoc = off[file[sel]] + doc[sel]
                bounds = np.array([s * total // n for s in range(mine.start, mine.stop + 1)])
                keep = (gdoc >= bounds[0]) & (gdoc < bounds[-1])
                sel, gdoc = sel[keep], gdoc[keep]
                if not sel.size:
                    continue
                sids = mine.start + np.searchsorted(bounds, gdoc, side="right") - 1
                cols = (file[sel], doc[sel], start[sel], start[sel] + length[sel])
                order = np.lexsort((*cols[::-1], sids))  # by shard, then as with_returned sorts
                sids, rows = sids[order], np.stack(cols, axis=1)[order].tolist()
                cuts = [0, *(np.flatnonzero(np.diff(sids)) + 1).tolist(), len(rows)]
                extras = merged[name].extras
                for a, b in zip(cuts, cuts[1:]):
                    ex = extras.setdefault(int(sids[a]), {})
                    returned = ex.setdefault("returned", [])
                    unsorted = bool(returned)
                    returned.extend(rows[a:b])
                    if unsorted:
                        returned.sort()
                plan.returned += len(rows)
        t4 = clock()
        tokens = dict.fromkeys(DATASETS, 0)
        for g in needed:
            split = count_new_readers(n, old_total, new_total, g)
            for name, v in _interleave(states[g])[Interleave.TOKENS_KEY].items():
                tokens[name] += int(v) // split
        t5 = clock()
        first = _readers(states[needed[0]])
        plan.new_states.append(
            {
                ShuffleBuffer.SOURCE_KEY: {
                    "format": 1,
                    "mode": "concat",
                    "seq_len": SEQ_LEN,
                    "shift": True,
                    Pack.SOURCE_KEY: {
                        Interleave.SOURCES_KEY: {
                            name: {
                                Interleave.SOURCE_KEY: cursor_state(first[name], merged[name]),
                                Interleave.CONSUMED_KEY: 0,
                                Interleave.ENDED_KEY: False,
                            }
                            for name in DATASETS
                        },
                        Interleave.TOKENS_KEY: tokens,
                        "weights": dict(zip(DATASETS, WEIGHTS)),
                        Interleave.COUNTER_KEY: 0,
                    },
                    "consumed": 0,
                    "bins": 0,
                    "open_docs": [],
                    "dataset_names": list(DATASETS),
                },
                "draws": 0,
                "exhausted": False,
            }
        )
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            plan.phases[phase] += dt
    plan.states_read = len(states)
    return plan


def rank_needs(n: int, old_total: int, new_total: int, workers: int, rank: int) -> range:
    """The old workers new rank ``rank`` reads: its workers' ranges are consecutive, so the
    union is one range from its first worker's first to its last worker's last."""
    first = old_workers_to_read(n, old_total, new_total, rank * workers)
    last = old_workers_to_read(n, old_total, new_total, rank * workers + workers - 1)
    return range(first.start, last.stop)


@dataclass
class Point:
    """One measured rescale of one new rank (times in CPU seconds)."""

    old_ranks: int
    new_ranks: int
    n: int
    buffer: int
    rank: int
    states_read: int
    mb_read: float
    seconds: float
    seconds_no_buffer: float
    peak_mb: float
    peak_no_buffer_mb: float
    cursors: int
    returned: int
    planned_mb: float
    phases: dict[str, float]
    old_fn: float
    lib_fn: float
    new_fn: float


def measure(
    old_ranks: int,
    new_ranks: int,
    workers: int,
    n: int,
    offsets: dict[str, np.ndarray],
    *,
    buffer: int,
    rows_per_seq: int,
    repeat: int,
) -> Point:
    """Plan the rescale for the new rank that reads the most old states, with and without the
    buffer; check and time the brute-force scan of the rescale code for its first worker."""
    old_total, new_total = old_ranks * workers, new_ranks * workers
    reads = [len(rank_needs(n, old_total, new_total, workers, r)) for r in range(new_ranks)]
    rank = int(np.argmax(reads))
    needed = rank_needs(n, old_total, new_total, workers, rank)
    full = {
        g: worker_state(g, old_total, n, offsets, buffer=buffer, rows_per_seq=rows_per_seq)
        for g in needed
    }
    bare = {g: {k: v for k, v in st.items() if not k.startswith("prov_")} for g, st in full.items()}
    blobs = {g: pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL) for g, st in full.items()}
    bare_blobs = {g: pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL) for g, st in bare.items()}
    del full, bare

    def run(blobs: dict[int, bytes]) -> tuple[float, Plan]:
        gc.disable()  # as timeit does: a collection's cost depends on the whole heap
        try:
            t0 = time.process_time()
            plan = plan_rank(rank, workers, n, old_total, new_total, offsets, blobs.__getitem__)
            return time.process_time() - t0, plan
        finally:
            gc.enable()

    def peak(blobs: dict[int, bytes]) -> float:
        tracemalloc.start()
        try:
            run(blobs)
            return tracemalloc.get_traced_memory()[1] / 1e6
        finally:
            tracemalloc.stop()

    seconds, plan = min((run(blobs) for _ in range(repeat)), key=lambda r: r[0])
    seconds_bare = min(run(bare_blobs)[0] for _ in range(repeat))
    planned = sum(_size(st) for st in plan.new_states) / len(plan.new_states) / 1e6
    if plan.states_read != len(needed):
        raise AssertionError(f"read {plan.states_read} states, expected {len(needed)}")
    del plan.new_states[:]
    peak_mb, peak_bare = peak(blobs), peak(bare_blobs)
    # the O(1) lookup equals the scan over every old worker (and the library's lookup)
    world = World(rank, new_ranks, 0, workers)
    fast = list(old_workers_to_read(n, old_total, new_total, rank * workers))
    timed = {}
    for name, lookup in (("scan", scan_old_workers), ("library", old_workers_needed)):
        t0 = time.process_time()
        found = lookup(n, old_total, world)
        timed[name] = time.process_time() - t0
        if found != fast:
            raise AssertionError(f"old_workers_to_read disagrees with the {name} for rank {rank}")
        if timed[name] < 0.05:  # else one call is long enough to time
            timed[name] = _per_call(functools.partial(lookup, n, old_total, world))
    new_fn = _per_call(lambda: old_workers_to_read(n, old_total, new_total, rank * workers))
    return Point(
        old_ranks, new_ranks, n, buffer, rank, plan.states_read, plan.bytes_read / 1e6, seconds,
        seconds_bare, peak_mb, peak_bare, plan.cursors, plan.returned, planned, plan.phases,
        timed["scan"], timed["library"], new_fn,
    )  # fmt: skip


def _per_call(f: Callable[[], Any], budget: float = 0.02, repeat: int = 5) -> float:
    """CPU seconds per call of ``f``: the best of ``repeat`` runs of at least ``budget`` s."""
    timer = timeit.Timer(f, timer=time.process_time)
    single = timer.timeit(1)
    number = max(1, int(budget / max(single, 1e-7)))
    return min(timer.repeat(repeat if single * number < 0.05 else 2, number)) / number


# -- report -------------------------------------------------------------------------------------------
def _slope(xs: list[int], ys: list[float]) -> float:
    """The exponent e of ys ~ xs^e, fitted in log-log."""
    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1e-12)), 1)[0])


def _order(e: float, x: str) -> str:
    if abs(e) < 0.25:  # flat within this shared machine's timing noise
        return f"O(1) (slope {e:+.2f})"
    if 0.75 <= e <= 1.25:
        return f"O({x}) (slope {e:+.2f})"
    return f"~{x}^{e:.2f}"


def _table(points: list[Point]) -> None:
    print(
        f"  {'old ranks':>9} {'new ranks':>9} {'shards':>7} {'states':>6} {'MB read':>7} "
        f"{'pieces':>8} {'plan ms':>7} {'peak MB':>7} {'cursors':>7} {'no-buf ms':>9} "
        f"{'no-buf MB':>9} {'scan ms':>8} {'O(1) us':>7}"
    )
    for p in points:
        print(
            f"  {p.old_ranks:>9,} {p.new_ranks:>9,} {p.n:>7,} {p.states_read:>6} "
            f"{p.mb_read:>7.1f} {p.returned:>8,} {p.seconds * 1e3:>7.1f} {p.peak_mb:>7.1f} "
            f"{p.cursors:>7,} {p.seconds_no_buffer * 1e3:>9.2f} {p.peak_no_buffer_mb:>9.3f} "
            f"{p.old_fn * 1e3:>8.2f} {p.new_fn * 1e6:>7.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--shards", type=int, default=30_720, help="logical shards per dataset")
    p.add_argument("--buffer", type=int, default=10_000, help="shuffle-buffer sequences")
    p.add_argument("--sweep-buffer", type=int, default=1_000, help="the buffer in the sweeps")
    p.add_argument("--rows-per-seq", type=int, default=10, help="provenance rows a sequence")
    p.add_argument("--files", type=int, default=10_000, help="files per dataset")
    p.add_argument("--repeat", type=int, default=2, help="best of this many timings")
    p.add_argument("--quick", action="store_true", help="a fast smoke run at a small scale")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.buffer, args.sweep_buffer, args.files = 256, 1000, 500, 1000
    t_start, c_start = time.perf_counter(), time.process_time()
    W, R = args.workers, args.ranks
    targets = (R * 3 // 4, R * 5 // 4)
    n = args.shards
    most = max(R, *targets) * W
    if n < most:
        for ranks in (R, *targets):
            try:
                worker_shards(n, ranks * W, 0)
            except ValueError as e:
                print(f"{ranks:,} x {W} is refused: {e}")
        n = most
        print(f"-> using {n:,} logical shards per dataset, the least that serves {most:,} workers")
    offsets = corpus(args.files, seed=1)
    docs = sum(int(o[-1]) for o in offsets.values())
    print(
        f"synthetic corpus: {len(DATASETS)} datasets x {args.files:,} files, {docs:,} documents, "
        f"{n:,} logical shards per dataset; buffers of ~{args.rows_per_seq} provenance rows a "
        "sequence; times are CPU time of this process (time.process_time: the machine is shared)"
    )

    # -- state per worker ------------------------------------------------------------------------
    total = R * W
    sample = np.linspace(0, total - 1, 16).astype(int).tolist()
    kw = {"buffer": args.buffer, "rows_per_seq": args.rows_per_seq}
    with_buf = [_size(worker_state(g, total, n, offsets, **kw)) for g in sample]
    no_buf = [_size(worker_state(g, total, n, offsets, buffer=0, rows_per_seq=0)) for g in sample]
    print(
        f"\nstate per worker at {R:,} x {W} ({len(worker_shards(n, total, 0))}-{-(-n // total)} "
        f"shards of each dataset), pickled, mean (max) of {len(sample)} workers:"
    )
    print(f"  without a buffer: {np.mean(no_buf) / 1e3:.2f} KB ({max(no_buf) / 1e3:.2f})")
    print(
        f"  with a {args.buffer:,}-sequence buffer: {np.mean(with_buf) / 1e6:.2f} MB "
        f"({max(with_buf) / 1e6:.2f}); the whole checkpoint ~{np.mean(with_buf) * total / 1e9:.1f} GB"
    )

    cache: dict[tuple[int, int, int, int], Point] = {}

    def point(old_ranks: int, new_ranks: int, shards: int, buffer: int) -> Point:
        key = (old_ranks, new_ranks, shards, buffer)
        if key not in cache:
            cache[key] = measure(
                old_ranks, new_ranks, W, shards, offsets, buffer=buffer,
                rows_per_seq=args.rows_per_seq, repeat=args.repeat,
            )  # fmt: skip
        return cache[key]

    # -- one new rank, at full scale ---------------------------------------------------------------
    for new in targets:
        pt = point(R, new, n, args.buffer)
        new_total = new * W
        calls = sum(
            len(old_workers_to_read(n, total, new_total, pt.rank * W + w)) for w in range(W)
        )
        print(
            f"\nrescale {R:,} x {W} -> {new:,} x {W}: new rank {pt.rank:,} (one of those reading "
            f"the most old states), {args.buffer:,}-sequence buffers"
        )
        print(
            f"  reads {pt.states_read} of {total:,} old worker states ({pt.mb_read:.1f} MB, "
            f"{pt.states_read / total:.3%})"
        )
        print(
            f"  plan: {pt.seconds * 1e3:.0f} ms ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in pt.phases.items())
            + f"), peak memory {pt.peak_mb:.1f} MB; without the buffers "
            f"{pt.seconds_no_buffer * 1e3:.2f} ms, {pt.peak_no_buffer_mb:.2f} MB"
        )
        print(
            f"  result: {pt.cursors} cursors, {pt.returned:,} buffered pieces handed back to them; "
            f"{pt.planned_mb:.2f} MB pickled per new worker"
        )
        kind = "a scan" if pt.lib_fn > 20 * pt.new_fn else "O(1)"
        print(
            f"  one new worker's old workers: old_workers_to_read {pt.new_fn * 1e6:.2f} us, the "
            f"scan over every old worker {pt.old_fn * 1e3:.1f} ms (ratio "
            f"{pt.old_fn / pt.new_fn:,.0f}); the library's old_workers_needed "
            f"{pt.lib_fn * 1e3:.3f} ms ({kind})"
        )
        print(
            f"  a readers_of that scans calls it {calls} x {new_total:,} times for this rank: "
            f"~{calls * new_total * pt.old_fn / 3600:,.1f} h CPU (extrapolated from the scan above)"
        )

    # -- sweeps ---------------------------------------------------------------------------------
    rank_sweep = [r for r in (256, 512, 1024, 2048, 4096) if r <= R] or [R]
    if args.quick:
        rank_sweep = [32, 64, 128, 256]
    base = rank_sweep[0]
    shard_sweep = [s for s in (3072, 6144, 12288, 30720) if s >= base * W]
    if args.quick:
        shard_sweep = [512, 1024, 2048, 3072]
    sb = args.sweep_buffer
    print(
        f"\nsweep over ranks: R x {W} -> 0.75R x {W}, {n:,} shards, {sb:,}-sequence buffers "
        "(pieces: handed back; no-buf: the same plan without buffers)"
    )
    by_ranks = [point(r, r * 3 // 4, n, sb) for r in rank_sweep]
    _table(by_ranks)
    print(
        f"\nsweep over shards: {base:,} x {W} -> {base * 3 // 4:,} x {W}, {sb:,}-sequence buffers"
    )
    by_shards = [point(base, base * 3 // 4, s, sb) for s in shard_sweep]
    _table(by_shards)

    # -- growth, fitted ------------------------------------------------------------------------------
    def slopes(key: Callable[[Point], float]) -> tuple[float, float]:
        return (
            _slope(rank_sweep, [key(p) for p in by_ranks]),
            _slope(shard_sweep, [key(p) for p in by_shards]),
        )

    every = list(cache.values())
    reads, plan_t, peak = (
        slopes(lambda p: p.states_read),
        slopes(lambda p: p.seconds),
        slopes(lambda p: p.peak_mb),
    )
    bare_t, bare_m = slopes(lambda p: p.seconds_no_buffer), slopes(lambda p: p.peak_no_buffer_mb)
    scan, o1 = slopes(lambda p: p.old_fn), slopes(lambda p: p.new_fn)
    us_piece, _ = np.polyfit([p.returned for p in every], [p.seconds * 1e6 for p in every], 1)
    b_piece, mb_0 = np.polyfit([p.returned for p in every], [p.peak_mb for p in every], 1)
    cursors = [p.cursors for p in every]
    us_cursor, us_0 = np.polyfit(cursors, [p.seconds_no_buffer * 1e6 for p in every], 1)
    b_cursor, mb_bare = np.polyfit(cursors, [p.peak_no_buffer_mb for p in every], 1)
    topologies = sorted({(r, n) for r in rank_sweep} | {(base, s) for s in shard_sweep})
    per_worker = [s / (r * W) for r, s in topologies]
    state = [
        np.mean(
            [
                _size(worker_state(g, r * W, s, offsets, buffer=0, rows_per_seq=0))
                for g in range(0, r * W, max(1, r * W // 8))
            ]
        )
        for r, s in topologies
    ]
    state_b, state_a = np.polyfit(per_worker, state, 1)
    reads_at = {
        f: sorted({p.states_read for p in every if p.new_ranks * 4 == p.old_ranks * f})
        for f in (3, 5)
    }
    dominant = max(PHASES, key=lambda k: by_ranks[-1].phases[k])
    print(
        "\ngrowth, from log-log slopes over the sweeps (ranks at fixed shards, shards at fixed ranks):"
    )
    print(
        f"  One new rank reads {reads_at[3]} old worker states going to 0.75x and {reads_at[5]} "
        f"going to 1.25x, {_order(reads[0], 'ranks')} in ranks and {_order(reads[1], 'shards')} in "
        f"shards: the count depends on the ratio of old to new workers only (each new worker "
        f"needs at most ceil(old/new) + 1). Its plan takes {_order(plan_t[0], 'ranks')} CPU time in "
        f"ranks and {_order(plan_t[1], 'shards')} in shards, and {_order(peak[0], 'ranks')} / "
        f"{_order(peak[1], 'shards')} peak memory; '{dominant}' dominates, fitted over all runs "
        f"at {us_piece:.2f} us and {b_piece * 1e6:.0f} B per buffered piece handed back (+ "
        f"{mb_0:.1f} MB), and the pieces are the states read x their buffers' document rows: "
        f"O((old/new workers) x buffer) per rank. Without buffers the plan is "
        f"{_order(bare_t[0], 'ranks')} in ranks and {_order(bare_t[1], 'shards')} in shards in "
        f"time and {_order(bare_m[0], 'ranks')} / {_order(bare_m[1], 'shards')} in memory: "
        f"{us_0 / 1e3:.2f} ms + {us_cursor:.1f} us and {mb_bare:.2f} MB + {b_cursor * 1e6:.0f} B "
        f"per cursor merged, and a rank merges 3 x N / (new ranks) cursors. A worker's "
        f"state is {state_a / 1e3:.2f} KB + {state_b:.0f} B per logical shard it owns in each "
        f"dataset (fitted over {min(per_worker):.2f}..{max(per_worker):.0f} shards per worker: "
        f"O(N/G)), plus its buffer's provenance, which does not depend on ranks or shards. "
        f"Finding one new worker's old workers is {_order(o1[0], 'ranks')} in ranks with "
        f"old_workers_to_read against {_order(scan[0], 'ranks')} for the brute-force scan "
        f"({_order(scan[1], 'shards')} in shards); the rescale code's readers_of runs that scan "
        f"(states read) x (new workers) times per new worker: {_order(scan[0] + 1, 'ranks')}."
    )
    print(
        f"\ntotal run time {time.perf_counter() - t_start:.0f} s wall, "
        f"{time.process_time() - c_start:.0f} s CPU"
    )


if __name__ == "__main__":
    main()
