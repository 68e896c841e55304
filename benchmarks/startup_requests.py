"""Start-up and restore requests to object storage, per rank, as the job grows.

Starts a local S3 endpoint (moto's server, in a subprocess on 127.0.0.1), uploads ``--datasets``
datasets of F small Arrow files each (with the counts file ``prepare`` writes next to them),
then runs R ranks as processes (forked from this one, each with its own local cache folder, as
separate machines) and counts every request each rank sends, by kind
(:mod:`torchdata_ext.remote.counting`: LIST, GET, RANGE_GET, HEAD, PUT, ...). Per rank:

* ``start``: build the pipeline (``build_pipeline`` from a ``PipelineConfig``) and take the
  first batch through a ``TokenLoader``; every rank then saves a folder checkpoint (``save``),
  takes another batch and saves again (``save2``: what every later save of the job costs);
* ``restore``: new processes, same topology: build, ``load_checkpoint``, first batch;
* ``rescale``: new processes on 2R ranks: the same from the R-rank checkpoint.

Three ways to start, each a mode:

* ``list`` (the reference: what every rank paid before index files and broadcasting): no index
  file, no process group, ranks given as ``rank=``/``world_size=``: every rank lists every
  dataset folder and reads its counts and metadata files;
* ``index``: the same launch with an index file per dataset (``torchdata-ext index``): a rank
  reads one object per dataset and lists nothing; rank 0 lists once to refuse a stale index;
* ``dist``: ``torch.distributed`` (gloo) initialised, ``build_datasets(cfg)`` on every rank,
  over the same index files: rank 0 reads them and lists to check them, the indexes (and the
  index files' digests) are broadcast, the other ranks ask the store for nothing before
  reading data.

``--workers N`` runs every rank's ``TokenLoader`` with N dataloader workers (forked; 0, the
default, runs the graph in the rank's process) and counts each worker's requests too (a
file per worker, which its rank reads at the end of each phase; a save's are what the worker
sent while the save ran): each phase then has a line for the workers (the busiest, the
fewest, their total), and the extrapolation takes each of ``--at-workers`` workers per rank
as the busiest measured instead of as a rank other than 0.

Each mode sets up its folders itself (:func:`set_up`), so ``--modes dist`` alone, or
``--modes index,list``, measures what the full run does.

It prints per-rank counts (rank 0, and the most any other rank sent) and the job's total per
phase, the fitted growth of the total in R and in F and of a rank other than 0 in F (log-log
slopes), and extrapolates each mode to ``--at-ranks`` x ``--at-files`` (8,192 x 100,000) with
a model linear in F per rank (rank 0 and the others apart), against S3's documented
per-prefix rates (5,500 GET/HEAD and 3,500 PUT/COPY/POST/DELETE requests per second; a LIST is
a GET of the bucket): the seconds one prefix needs to serve a start at that size.

    python benchmarks/startup_requests.py                       # R in 1,2,4,8; F in 30,300
    python benchmarks/startup_requests.py --ranks 1,8,32,128 --files 300,3000   # ~10 min
    python benchmarks/startup_requests.py --modes index,dist --ranks 2 --workers 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from remote_throughput import start_moto  # noqa: E402

from torchdata_ext.testing import write_arrow_batches  # noqa: E402

MODES = ("list", "index", "dist")
PHASES = ("start", "save", "save2", "restore", "rescale")
GET_CLASS = ("LIST", "GET", "RANGE_GET", "HEAD")  # S3: 5,500 requests/s per prefix
PUT_CLASS = ("PUT", "POST", "DELETE")  # S3: 3,500 requests/s per prefix
GET_RATE, PUT_RATE = 5_500, 3_500


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def upload(endpoint: str, bucket: str, prefix: str, datasets: int, files: int) -> list[str]:
    """``datasets`` folders of ``files`` Arrow files (4 documents each) and their counts file;
    return the dataset names."""
    import s3fs

    from torchdata_ext import DatasetIndex

    so = _options(endpoint)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        blobs = []
        for k in range(8):  # a few distinct files, reused under many names
            path = os.path.join(tmp, f"f{k}.arrow")
            write_arrow_batches(
                path, [rng.integers(5, 900, 24).astype(np.uint32) for _ in range(4)]
            )
            with open(path, "rb") as f:
                blobs.append(f.read())
    names = [f"ds{d}" for d in range(datasets)]
    for name in names:
        fs.pipe(
            {
                f"{bucket}/{prefix}/{name}/p{f:06d}.arrow": blobs[f % len(blobs)]
                for f in range(files)
            }
        )
    s3fs.S3FileSystem.clear_instance_cache()
    for name in names:  # prepare's counts file, so no rank opens files to count them
        DatasetIndex.build(
            f"s3://{bucket}/{prefix}/{name}", storage_options=so, write_counts="data"
        )
    s3fs.S3FileSystem.clear_instance_cache()
    return names


def set_up(mode: str, url: str, names: list[str], so: dict[str, Any]) -> None:
    """The data folders as ``mode`` measures them, whichever modes ran before it on them:
    ``list`` without index files (removed if an earlier mode wrote them), ``index`` and
    ``dist`` with one per dataset (``dist``'s rank 0 reads them, checks them against a
    listing and broadcasts the indexes and their digests, as every published ``dist`` row,
    measured after ``index`` wrote them, did)."""
    import s3fs

    from torchdata_ext.sources.index_file import index_file_url, write_index_files

    if mode in ("index", "dist"):
        write_index_files(url, names, storage_options=so)
        return
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    for name in names:
        path = index_file_url(f"{url}/{name}").removeprefix("s3://")
        if fs.exists(path):
            fs.rm(path)
    s3fs.S3FileSystem.clear_instance_cache()


def _config(endpoint: str, url: str, names: list[str], ranks: int, workers: int = 0) -> Any:
    """The job's config; its logical shards leave every worker one or more at the rescale to
    2R ranks (``workers`` per rank: as many shards as without workers when they are enough)."""
    from torchdata_ext import PipelineConfig

    shards = max(16, 4 * ranks, 2 * ranks * workers)
    return PipelineConfig(
        data_path=url, datasets=",".join(names), seq_length=32, logical_shards=shards,
        batch_size=2, shuffle_buffer=4, block_docs=4, storage_options=_options(endpoint),
    )  # fmt: skip


def _rank_main(
    rank: int,
    ranks: int,
    mode: str,
    phase: str,
    cfg: Any,
    ckpt: str,
    port: int,
    out: str,
    workers: int = 0,
) -> None:
    """One rank's ``phase``; writes its request counts to ``out/<rank>.json`` (with
    ``workers``, each dataloader worker's too, under ``"workers <phase>"``: a list, one
    per worker, of what it sent by the end of each phase)."""
    os.environ["TORCHDATA_EXT_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"rank{rank}-")
    from torchdata_ext.remote.process_state import PROBED_STORES
    from torchdata_ext.sources import fingerprint, index_file

    # a rank is a machine of its own: it probes the store itself and knows no digest (this
    # process computed them writing the index files) and no index file checked
    PROBED_STORES.items.clear()
    fingerprint._digests.clear()
    index_file._verified.clear()
    import torch.distributed as dist

    from torchdata_ext import TokenLoader, build_pipeline
    from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
    from torchdata_ext.pipeline.build import build_datasets

    if mode == "dist":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
        )
    if workers:
        _count_in_workers(os.path.join(out, f"{rank}-w"))
    counts: dict[str, Any] = {}
    try:
        with _counting() as c:
            datasets = build_datasets(cfg) if mode == "dist" else None
            build = functools.partial(build_pipeline, cfg, datasets=datasets, collate=False)
            loader = TokenLoader(build, rank=rank, world_size=ranks, num_workers=workers)
            if phase != "start":
                load_checkpoint(loader, ckpt, storage_options=cfg.storage_options)
            it = iter(loader)
            next(it)
        counts[phase] = c
        if workers:
            seen = counts[f"workers {phase}"] = _worker_counts(out, rank)
        if phase == "start":
            for save in ("save", "save2"):  # the second writes the checkpoint the others load
                with _counting() as c:
                    save_checkpoint(loader, ckpt, storage_options=cfg.storage_options)
                counts[save] = c
                if workers:  # what each worker sent meanwhile (its prefetch goes on)
                    now = _worker_counts(out, rank)
                    counts[f"workers {save}"] = [_minus(a, b) for a, b in zip(now, seen)]
                    seen = now
                next(it)
        if workers:
            loader.close()
    finally:
        if mode == "dist":
            dist.destroy_process_group()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({k: v if k.startswith("workers") else dict(v) for k, v in counts.items()}, f)


class _FileCounter(Counter):  # type: ignore[type-arg]
    """A ``Counter`` that writes itself to ``path`` (JSON) at every change: a dataloader
    worker's counts, read by its rank while the worker runs and after it is gone."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        with open(self.path + ".tmp", "w") as f:
            json.dump(dict(self), f)
        os.replace(self.path + ".tmp", self.path)


def _count_in_workers(prefix: str) -> None:
    """Make every process forked from this rank from now on (its dataloader workers) count
    its own S3 requests, by kind and by object as :func:`_counting` does, into
    ``<prefix><pid>.json``, from its fork to its end."""
    from torchdata_ext.remote import counting

    def child() -> None:
        counting._lock = counting.threading.Lock()  # held by no thread of the new process
        counter = _FileCounter(f"{prefix}{os.getpid()}.json")
        # counted as the rank's own blocks count: the inherited blocks' copies are never read
        with counting._lock:
            if not counting._active:
                counting._install()
            counting._active.append((counter, True))

    os.register_at_fork(after_in_child=child)


def _worker_counts(out: str, rank: int) -> list[dict[str, int]]:
    """What each dataloader worker of ``rank`` has sent so far, by kind and by
    ``"<kind> <what>"`` (as :func:`_counting`), in the order of their process ids."""
    found = []
    for name in os.listdir(out):
        if name.startswith(f"{rank}-w") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                raw = json.load(f)
            by: Counter[str] = Counter()
            for key, n in raw.items():
                kind, path = key.split(" ", 1)
                by[kind] += n
                by[f"{kind} {_what(path)}"] += n
            found.append((int(name[len(f"{rank}-w") : -5]), dict(by)))
    return [c for _, c in sorted(found)]


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """``a - b`` by key, without the zeros."""
    return {k: n - b.get(k, 0) for k, n in a.items() if n - b.get(k, 0)}


@contextlib.contextmanager
def _counting() -> Iterator[Counter[str]]:
    """This process's S3 requests in the block by kind, and by ``"<kind> <what>"`` too where
    the code measured counts by object (``count_s3_objects``; an older tree counts kinds)."""
    from torchdata_ext.remote import counting

    by_object = getattr(counting, "count_s3_objects", None)
    if by_object is None:
        with counting.count_s3_requests() as c:
            yield c
        return
    out: Counter[str] = Counter()
    with by_object() as c:
        yield out
    for key, n in c.items():
        kind, path = key.split(" ", 1)
        out[kind] += n
        out[f"{kind} {_what(path)}"] += n


def _what(path: str) -> str:
    """What an object of the benchmark's bucket is (the store probe, an index file, ...)."""
    name = path.rsplit("/", 1)[-1]
    if "probe" in path:
        return "probe"
    if name == "torchdata_ext_index.json":
        return "index"
    if name == "torchdata_ext_meta.json":
        return "meta"
    if "/meta/" in path:
        return "counts"
    if "/ckpt/" in path:
        return "ckpt"
    if name.endswith(".arrow"):
        return "data"
    return "bucket" if "/" not in path else "other"


def run_ranks(
    ranks: int, mode: str, phase: str, cfg: Any, ckpt: str, workers: int = 0
) -> list[dict[str, Any]]:
    """``ranks`` forked processes running ``phase`` (each with ``workers`` dataloader
    workers); each rank's counts by phase."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(
                target=_rank_main, args=(r, ranks, mode, phase, cfg, ckpt, port, out, workers)
            )
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"{mode} {phase}: ranks {bad} failed")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(ranks)]


def total(c: dict[str, int]) -> int:
    """All requests in counts ``c`` (its kinds; the ``"<kind> <what>"`` keys split them)."""
    return sum(v for k, v in c.items() if " " not in k)


def show(c: dict[str, int], detail: bool = False) -> str:
    """``c`` by kind (``detail``: each kind split by what it asked for, where counted)."""
    order = ("LIST", "GET", "RANGE_GET", "HEAD", "PUT", "POST", "DELETE")
    out = []
    for k in order:
        if not c.get(k):
            continue
        parts = sorted((w.split(" ", 1)[1], n) for w, n in c.items() if w.startswith(k + " "))
        what = f" ({', '.join(f'{w} {n}' for w, n in parts)})" if detail and parts else ""
        out.append(f"{k}={c[k]}{what}")
    return " ".join(out) or "0"


def slope(xs: list[float], ys: list[float]) -> float:
    """Log-log slope (growth exponent); 0 for a flat or empty series."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return 0.0
    return float(np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)[0])


def linear(fs: list[int], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b F`` (least squares; b >= 0)."""
    if len(set(fs)) < 2:
        return float(np.mean(ys)), 0.0
    b, a = np.polyfit(fs, ys, 1)
    return float(a), max(0.0, float(b))


ALL = GET_CLASS + PUT_CLASS


def _row(mode: str, F: int, R: int, phase: str, per: list[dict[str, int]]) -> str:
    """One line of the table: rank 0, the busiest other rank, the job's total."""
    others = show(max(per[1:], key=total)) if len(per) > 1 else "-"
    return (
        f"{mode:5s} {F:>6,} {R:>4} {phase:8s} {show(per[0]):38s} {others:38s} "
        f"{sum(map(total, per)):>7,}"
    )


def _worker_row(mode: str, F: int, R: int, phase: str, per: list[dict[str, int]]) -> str:
    """One line of the table for the dataloader workers: the busiest worker (split by what it
    asked for), the fewest, and all workers' total (a worker that sent nothing yet has no
    file: it is not counted, nor is the fewest 0)."""
    busiest = show(max(per, key=total), True) if per else "-"
    least = show(min(per, key=total)) if per else "-"
    return (
        f"{mode:5s} {F:>6,} {R:>4} {phase:8s} workers ({len(per)} sent any): busiest {busiest}; "
        f"fewest {least}; total {sum(map(total, per)):,}"
    )


def _job(res: Any, F: int, R: int, kinds: tuple[str, ...]) -> int:
    """The job's requests of ``kinds`` at start and restore."""
    return sum(c.get(k, 0) for ph in ("start", "restore") for c in res[F][R][ph] for k in kinds)


def _rank(res: Any, F: int, R: int, first: int, kinds: tuple[str, ...]) -> int:
    """The most requests of ``kinds`` any rank from ``first`` on sent at start and restore."""
    per = [
        sum(res[F][R][ph][r].get(k, 0) for ph in ("start", "restore") for k in kinds)
        for r in range(first, R)
    ]
    return max(per, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4,8", help="R values (processes), comma-separated")
    ap.add_argument("--files", default="30,300", help="F values (files per dataset)")
    ap.add_argument("--datasets", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--at-ranks", type=int, default=8192)
    ap.add_argument("--at-files", type=int, default=100_000)
    ap.add_argument("--at-workers", type=int, default=8, help="dataloader workers per rank")
    ap.add_argument("--workers", type=int, default=0, help="dataloader workers per rank run "
                    "(0: the graph in the rank's process); each worker's requests counted")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="R in 1,2,4 and F in 30,120 (~1 min)")
    ap.add_argument("--json", help="write the counts to this file instead of the report")
    ap.add_argument(
        "--compare",
        help="NAME=SOURCE_DIR,NAME=SOURCE_DIR: run this script on each source tree (as "
        "PYTHONPATH, e.g. main exported with git archive, and this checkout), same arguments, "
        "one after the other, and print their per-rank counts side by side",
    )
    ap.add_argument("--budget", type=float, default=3600.0, help="--compare: stop after "
                    "this many seconds and report the rows measured on every tree")  # fmt: skip
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    if args.quick:
        args.ranks, args.files = "1,2,4", "30,120"
    ranks = [int(r) for r in args.ranks.split(",")]
    file_counts = [int(f) for f in args.files.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    # imported once here: every forked rank has them, as a long-running launcher's would
    import torch.distributed  # noqa: F401

    import torchdata_ext.checkpoint.folder  # noqa: F401
    import torchdata_ext.pipeline.build  # noqa: F401
    import torchdata_ext.remote.counting  # noqa: F401

    proc, endpoint = start_moto()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    # results[mode][F][R][phase] = list of per-rank counts
    results: dict[str, dict[int, dict[int, dict[str, list[dict[str, int]]]]]] = {
        m: {} for m in modes
    }
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **_options(endpoint)).call_s3(
            "create_bucket", Bucket="startup"
        )
        for F in file_counts:
            names = upload(endpoint, "startup", f"F{F}", args.datasets, F)
            url = f"s3://startup/F{F}"
            for mode in modes:
                set_up(mode, url, names, _options(endpoint))
                results[mode][F] = {}
                for R in ranks:
                    ckpt = f"s3://startup/ckpt/{mode}/F{F}/R{R}"
                    cfg = _config(endpoint, url, names, R, args.workers)
                    rows: dict[str, list[dict[str, int]]] = {}
                    W = args.workers
                    started = run_ranks(R, mode, "start", cfg, ckpt, W)
                    restored = run_ranks(R, mode, "restore", cfg, ckpt, W)
                    cfg2 = _config(endpoint, url, names, R, args.workers)  # same shards: a rescale
                    rescaled = run_ranks(2 * R, mode, "rescale", cfg2, ckpt, W)
                    for phase, per_rank in (
                        ("start", started), ("save", started), ("save2", started),
                        ("restore", restored), ("rescale", rescaled),
                    ):  # fmt: skip
                        rows[phase] = [r[phase] for r in per_rank]
                        if W:  # every worker of every rank, rank 0's first
                            rows[f"workers {phase}"] = [
                                w for r in per_rank for w in r[f"workers {phase}"]
                            ]
                    results[mode][F][R] = rows
                    if args.json:  # as it goes: a run stopped by --budget keeps its rows
                        with open(args.json, "w") as f:
                            json.dump(results, f)
                    for phase in PHASES:  # as it goes: a long run shows its rows early
                        print(_row(mode, F, R, phase, rows[phase]), flush=True)
                        if W:
                            print(_worker_row(mode, F, R, phase, rows[f"workers {phase}"]))
    finally:
        proc.kill()
    if args.json:
        return
    report(results, ranks, file_counts, modes, args)


def compare(args: Any) -> None:
    """Run this script on each ``--compare`` tree with the same arguments (at once, each with
    its own S3 server) and print the per-rank counts of every phase side by side, then each
    tree's extrapolation."""
    started = time.time()
    trees = dict(t.split("=", 1) for t in args.compare.split(","))
    if "--compare" in sys.argv:
        raise SystemExit("pass --compare=NAME=DIR,NAME=DIR (one argument)")
    passed = [a for a in sys.argv[1:] if not a.startswith("--compare=")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as logs:
        procs = {}
        for name, tree in trees.items():  # at once: a run cut by --budget has both sides
            out = os.path.join(tmp, f"{name}.json")
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            log = logs.enter_context(open(os.path.join(tmp, f"{name}.log"), "w"))
            procs[name] = (
                subprocess.Popen([sys.executable, __file__, *passed, "--json", out], env=env,
                                 stdout=log, stderr=subprocess.STDOUT),
                out, log,
            )  # fmt: skip
        try:
            for proc, _, _ in procs.values():
                proc.wait(timeout=max(1.0, args.budget - (time.time() - started)))
        except subprocess.TimeoutExpired:
            print(f"# --budget {args.budget:.0f} s reached: the rows measured so far", flush=True)
        finally:
            for proc, _, log in procs.values():
                if proc.poll() is None:
                    proc.kill()
                log.close()
        for name, (proc, out, _) in procs.items():
            print(f"# {name} ({trees[name]}): exit {proc.returncode}")
            if proc.returncode not in (0, None, -9):
                with open(os.path.join(tmp, f"{name}.log")) as f:
                    print(f.read()[-3000:])
            raw = {}
            if os.path.exists(out):
                with open(out) as f:
                    raw = json.load(f)
            results[name] = {  # JSON keys are strings: F and R back to ints
                m: {int(F): {int(R): ph for R, ph in byR.items()} for F, byR in byF.items()}
                for m, byF in raw.items()
            }
    modes = [m for m in args.modes.split(",") if m]
    names = list(trees)
    done = [  # (mode, F, R) measured on every tree
        (m, F, R)
        for m in modes
        for F in map(int, args.files.split(","))
        for R in map(int, args.ranks.split(","))
        if all(R in results[n].get(m, {}).get(F, {}) for n in names)
    ]
    file_counts = sorted({F for _, F, _ in done})
    ranks = sorted({R for _, _, R in done})
    print(f"\nrequests per rank, {' / '.join(names)} (rank 0; the busiest other rank; "
          f"{args.datasets} datasets of F files; restore: same R; rescale: R -> 2R ranks)")  # fmt: skip
    for mode, F, R in done:
        if True:
            if True:
                for phase in PHASES:
                    print(f"\n{mode} F={F:,} R={R} {phase}:")
                    for name in names:
                        per = results[name][mode][F][R][phase]
                        other = max(per[1:], key=total) if len(per) > 1 else {}
                        print(f"  {name:7s} rank 0: {show(per[0], True)}")
                        print(f"  {name:7s} other:  {show(other, True) if other else '-'}")
    # the extrapolation from the largest R measured at every F (all modes)
    full = [R for R in ranks if all((m, F, R) in done for m in modes for F in file_counts)]
    if not full:
        print("no R measured at every F: nothing to extrapolate")
        return
    for name in names:
        print(f"\n== {name} ==")
        report(results[name], full, file_counts, modes, args)


def report(
    results: Any, ranks: list[int], file_counts: list[int], modes: list[str], args: Any
) -> None:
    out = io.StringIO()
    p = functools.partial(print, file=out)
    p(f"\nrequests to S3 per rank and per job ({args.datasets} datasets of F files; "
      "restore = same ranks, rescale = R -> 2R ranks)\n")  # fmt: skip
    p(
        f"{'mode':5s} {'F':>6s} {'R':>4s} {'phase':8s} {'rank 0':38s} {'max other rank':38s} {'total':>7s}"
    )
    for mode in modes:
        for F in file_counts:
            for R in ranks:
                for phase in PHASES:
                    p(_row(mode, F, R, phase, results[mode][F][R][phase]))
    p("\ngrowth of the job's total (log-log slope; 1 = linear, 0 = flat), start + restore:")
    big_f, big_r = file_counts[-1], ranks[-1]
    at: dict[str, float] = {}
    for mode in modes:
        res = results[mode]
        in_r = slope(ranks, [_job(res, big_f, R, ALL) for R in ranks])
        in_f = slope(file_counts, [_job(res, F, big_r, ALL) for F in file_counts])
        other_f = slope(file_counts, [_rank(res, F, big_r, 1, ALL) for F in file_counts])
        p(f"  {mode:5s}: total ~ R^{in_r:.2f} (F={big_f:,}), ~ F^{in_f:.2f} (R={big_r}); "
          f"the busiest rank other than 0 ~ F^{other_f:.2f}")  # fmt: skip
        # extrapolation: per rank linear in F (rank 0 and the others apart), by request class
        seconds = 0.0
        # a listing is one LIST per 1,000 files: scale the LISTs measured at the largest F
        # by the pages at --at-files (an upper bound: the meta/ and folder checks do not grow)
        pages = math.ceil(args.at_files / 1000) / math.ceil(big_f / 1000)
        lists = _rank(res, big_f, big_r, 0, ("LIST",))
        lists += (args.at_ranks - 1) * (
            _rank(res, big_f, big_r, 1, ("LIST",)) if big_r > 1 else lists
        )
        at[f"{mode} LIST"] = lists * pages
        seconds = lists * pages / GET_RATE
        for cls, rate in ((GET_CLASS[1:], GET_RATE), (PUT_CLASS, PUT_RATE)):
            a0, b0 = linear(file_counts, [_rank(res, F, big_r, 0, cls) for F in file_counts])
            a1, b1 = (a0, b0)
            if big_r > 1:
                a1, b1 = linear(file_counts, [_rank(res, F, big_r, 1, cls) for F in file_counts])
            reqs = (a0 + b0 * args.at_files) + (args.at_ranks - 1) * (a1 + b1 * args.at_files)
            seconds += reqs / rate
            at[f"{mode} {cls[0]}"] = reqs
        at[mode] = seconds
    p(f"\nextrapolated to {args.at_ranks:,} ranks x {args.at_files:,} files per dataset "
      f"(start + restore, one prefix; S3: {GET_RATE:,} GET/HEAD/LIST and {PUT_RATE:,} "
      "PUT/POST/DELETE per second):")  # fmt: skip
    for mode in modes:
        p(f"  {mode:5s}: {at[f'{mode} LIST']:>14,.0f} LIST + {at[f'{mode} GET']:>12,.0f} "
          f"GET/RANGE_GET/HEAD + {at[f'{mode} PUT']:,.0f} PUT/POST/DELETE requests = "
          f"{at[mode]:>10,.1f} s of one prefix's capacity")  # fmt: skip
    if "list" in modes:
        for mode in modes:
            if mode != "list" and at[mode] > 0:
                p(f"  {mode} needs 1/{at['list'] / at[mode]:,.0f} of the reference (list)")
    W = args.at_workers
    measured = all("workers start" in results[m][big_f][big_r] for m in modes)
    p(f"\nthe job's requests per phase at {args.at_ranks:,} ranks x {args.at_files:,} files per "
      "dataset (rank 0, and every other rank as the busiest measured; RANGE_GET linear in F, "
      "LIST by listing pages, the rest as at the largest F), and with "
      f"{W} dataloader workers per rank (" + (
          f"each worker as the busiest of the {args.workers} a rank ran, kind by kind"
          if measured else "each worker process counted as a rank other than 0 at start: its "
          "probe, its index reads, its first data; an upper bound") + "):")  # fmt: skip
    for mode in modes:
        res = results[mode]
        per_phase = []
        for ph in PHASES:
            n = _extrapolate(res, file_counts, big_r, ph, ALL, args)
            ranged = _extrapolate(res, file_counts, big_r, ph, ("RANGE_GET",), args)
            lists = _extrapolate(res, file_counts, big_r, ph, ("LIST",), args)
            per_phase.append(f"{ph} {n:,.0f} (LIST {lists:,.0f}, RANGE_GET {ranged:,.0f})")
        if measured:
            per_worker = [_extrapolate_worker(res, file_counts, big_r, ph, args) for ph in PHASES]
            workers = "; ".join(
                f"{ph} {args.at_ranks * W * n:,.0f} ({n:,.1f} a worker)"
                for ph, n in zip(PHASES, per_worker)
            )
            p(f"  {mode:5s}: ranks: " + "; ".join(per_phase) + f"; workers: {workers}")
            continue
        workers_at_start = (
            args.at_ranks * W * _extrapolate_other(res, file_counts, big_r, "start", args)
        )
        p(f"  {mode:5s}: " + "; ".join(per_phase) + f"; workers at start {workers_at_start:,.0f}")
    print(out.getvalue())


def _phase_rank(res: Any, F: int, R: int, phase: str, rank: int, kinds: tuple[str, ...]) -> int:
    """Requests of ``kinds`` rank ``rank`` (0) or the busiest other rank (1) sent in ``phase``."""
    per = [sum(c.get(k, 0) for k in kinds) for c in res[F][R][phase]]
    return per[0] if rank == 0 else max(per[1:], default=per[0])


def _extrapolate_worker(res: Any, file_counts: list[int], R: int, phase: str, args: Any) -> float:
    """One dataloader worker's requests in ``phase`` at ``--at-files``: the busiest worker
    measured, kind by kind, scaled in F as :func:`_extrapolate` scales a rank's."""
    big = file_counts[-1]
    pages = math.ceil(args.at_files / 1000) / math.ceil(big / 1000)
    out = 0.0
    for kind in ALL:
        ys = [max((c.get(kind, 0) for c in res[F][R][f"workers {phase}"]), default=0)
              for F in file_counts]  # fmt: skip
        if kind == "RANGE_GET":
            a, b = linear(file_counts, ys)
            out += a + b * args.at_files
        else:
            out += ys[-1] * (pages if kind == "LIST" else 1)
    return out


def _extrapolate_other(res: Any, file_counts: list[int], R: int, phase: str, args: Any) -> float:
    """One process other than rank 0 in ``phase`` at ``--at-files`` (as :func:`_extrapolate`)."""
    one = argparse.Namespace(at_ranks=2, at_files=args.at_files)
    rank0 = _extrapolate(
        res, file_counts, R, phase, ALL, argparse.Namespace(at_ranks=1, at_files=args.at_files)
    )
    return _extrapolate(res, file_counts, R, phase, ALL, one) - rank0


def _extrapolate(
    res: Any, file_counts: list[int], R: int, phase: str, kinds: tuple[str, ...], args: Any
) -> float:
    """The job's requests of ``kinds`` in ``phase`` at ``--at-ranks`` x ``--at-files``, for rank
    0 and every other rank: RANGE_GET (fingerprint reads, one per file) linear in F; LISTs
    scaled by listing pages (one per 1,000 files); the rest as at the largest F (checkpoint
    files, first data: they do not grow with F, and a line fitted through their noise would)."""
    big = file_counts[-1]
    pages = math.ceil(args.at_files / 1000) / math.ceil(big / 1000)
    out = 0.0
    for rank, times in ((0, 1), (1, args.at_ranks - 1)):
        for kind in kinds:
            ys = [_phase_rank(res, F, R, phase, rank, (kind,)) for F in file_counts]
            if kind == "RANGE_GET":
                a, b = linear(file_counts, ys)
                n = a + b * args.at_files
            else:
                n = ys[-1] * (pages if kind == "LIST" else 1)
            out += times * n
    return out


if __name__ == "__main__":
    main()
