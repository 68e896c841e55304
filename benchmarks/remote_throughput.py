"""Remote throughput: ShardReader tokens/s over s3:// with background prefetch off and on.

Starts a local S3 endpoint (moto's server, in a subprocess on 127.0.0.1), uploads a generated
Arrow dataset (Bamba layout: one document per record batch, uint32 tokens, lognormal document
lengths with a median of ~600 tokens), and reads one epoch with ``prefetch_shards=0`` and
``prefetch_shards=2``, each time from a cold cache (a new cache folder): first the reader alone
(as fast as it can go), then feeding a simulated consumer that takes ``--consumer-mtps`` million
tokens/s (a training step; it sleeps, so downloads can overlap it). It reports tokens/s, the time
the reader waited on I/O (``io_stats()["wait_seconds"]``) as a share of the wall time, and the
same epoch read from local disk as the ceiling.

Moto on loopback answers in well under a millisecond, far faster than a real object store, so
``--latency-ms`` (default 30) adds that many milliseconds before every request (HEAD, GET, range
GET) and ``--bandwidth-mbps`` (default 200) caps each transfer at that many MB/s, by wrapping the
``s3fs`` coroutines (``_info``, ``_get_file``, ``_cat_file``) with ``asyncio.sleep``: concurrent
requests overlap as they would against S3. Pass ``--latency-ms 0 --bandwidth-mbps 0`` to measure
the raw loopback.

    python benchmarks/remote_throughput.py [--tokens 40_000_000] [--files 16]
        [--logical-shards 16] [--latency-ms 30] [--bandwidth-mbps 200] [--consumer-mtps 25]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.remote import ShardCache
from torchdata_ext.testing import write_arrow_batches


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a subprocess (so it does not share the reader's GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import logging, sys; logging.getLogger('werkzeug').setLevel(logging.ERROR);"
        "from moto.server import ThreadedMotoServer;"
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); s.start();"
        "sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def add_latency(latency_s: float, bandwidth_bps: float) -> None:
    """Make every s3fs request take ``latency_s`` longer, and transfers at most
    ``bandwidth_bps`` bytes/s each (asyncio sleeps: concurrent requests overlap)."""
    import s3fs

    cls = s3fs.S3FileSystem

    def slowed(name: str, size_of: Any) -> None:
        orig = getattr(cls, name)

        @functools.wraps(orig)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(latency_s)
            t0 = time.perf_counter()
            out = await orig(self, *args, **kwargs)
            if bandwidth_bps > 0:
                nbytes = size_of(out, args, kwargs)
                await asyncio.sleep(max(0.0, nbytes / bandwidth_bps - (time.perf_counter() - t0)))
            return out

        setattr(cls, name, wrapper)

    slowed("_info", lambda out, a, k: 0)
    slowed("_cat_file", lambda out, a, k: len(out))
    slowed("_get_file", lambda out, a, k: os.path.getsize(a[1] if len(a) > 1 else k["lpath"]))


def generate(root: str, so: dict[str, Any] | None, total_tokens: int, n_files: int) -> int:
    rng = np.random.default_rng(0)
    per_file = total_tokens // n_files
    tokens = 0
    for f in range(n_files):
        lengths: list[int] = []
        while sum(lengths) < per_file:
            chunk = np.clip(rng.lognormal(np.log(600), 1.0, 4096), 16, 100_000).astype(np.int64)
            lengths.extend(chunk.tolist())
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), per_file)) + 1]
        flat = rng.integers(0, 128_000, size=sum(lengths), dtype=np.uint32)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        docs = [flat[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
        write_arrow_batches(
            f"{root}/shard_{f:04d}.arrow", docs, storage_options=so, dtype=np.uint32
        )
        tokens += int(flat.size)
    return tokens


def one_epoch(
    index: DatasetIndex, args: argparse.Namespace, consumer_tps: float = 0.0, **kw: Any
) -> dict[str, float]:
    """Read one epoch; with ``consumer_tps`` > 0, sleep after each block as a training step
    consuming that many tokens/s would take (the reader's I/O can overlap it)."""
    reader = ShardReader(
        index, args.logical_shards, world=World(), epochs=1, block_docs=args.block_docs, **kw
    )
    t0 = time.perf_counter()
    tokens = 0
    for block in reader:
        tokens += block.num_tokens
        if consumer_tps > 0:
            time.sleep(block.num_tokens / consumer_tps)
    wall = time.perf_counter() - t0
    stats = reader.io_stats()
    return {"tokens": tokens, "wall": wall, **stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=40_000_000)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--logical-shards", type=int, default=16)
    p.add_argument("--block-docs", type=int, default=256)
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--bandwidth-mbps", type=float, default=200.0)
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 2])
    p.add_argument(
        "--consumer-mtps",
        type=float,
        default=25.0,
        help="also run with a simulated consumer of this many M tokens/s (0: skip)",
    )
    args = p.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    proc, endpoint = start_moto()
    work = tempfile.mkdtemp(prefix="remote_throughput_")
    try:
        import s3fs

        so = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        s3fs.S3FileSystem(**so).call_s3("create_bucket", Bucket="bench")
        t0 = time.perf_counter()
        local_root = os.path.join(work, "local", "web")
        total = generate(local_root, None, args.tokens, args.files)
        fs = s3fs.S3FileSystem(**so)
        fs.put(local_root, "bench/data/web", recursive=True)
        size = sum(os.path.getsize(os.path.join(local_root, f)) for f in os.listdir(local_root))
        print(
            f"dataset: {total / 1e6:.1f}M tokens, {args.files} Arrow files, {size / 1e6:.0f} MB; "
            f"generated and uploaded in {time.perf_counter() - t0:.1f}s"
        )
        local = DatasetIndex.build(local_root)
        remote = DatasetIndex.build("s3://bench/data/web", storage_options=so)
        add_latency(args.latency_ms / 1e3, args.bandwidth_mbps * 1e6)
        print(
            f"endpoint: moto on 127.0.0.1, +{args.latency_ms:g} ms per request, "
            f"{args.bandwidth_mbps:g} MB/s per transfer (0 = unlimited); "
            f"{args.logical_shards} logical shards, 1 worker"
        )
        ref = one_epoch(local, args)
        print(f"local disk (ceiling): {ref['tokens'] / ref['wall'] / 1e6:.1f}M tokens/s")
        print(
            f"{'s3://, cold cache':<34} {'tokens/s':>9} {'wall s':>7} {'I/O wait':>9} "
            f"{'downloads':>9} {'prefetched':>10} {'MB':>6}"
        )
        consumers = [0.0] + ([args.consumer_mtps * 1e6] if args.consumer_mtps > 0 else [])
        for consumer in consumers:
            for n in args.prefetch:
                cache_dir = os.path.join(work, f"cache_{n}")  # cold cache
                cache = ShardCache(cache_dir, max_bytes=None)
                r = one_epoch(remote, args, consumer, cache=cache, prefetch_shards=n)
                cache.close()
                shutil.rmtree(cache_dir, ignore_errors=True)
                assert r["tokens"] == ref["tokens"]
                what = f"prefetch_shards={n}" + (
                    f", consumer {consumer / 1e6:g}M tok/s" if consumer else ", reader alone"
                )
                print(
                    f"{what:<34} {r['tokens'] / r['wall'] / 1e6:8.1f}M "
                    f"{r['wall']:7.2f} {r['wait_seconds'] / r['wall']:8.0%} "
                    f"{int(r['downloads']):9d} {int(r['prefetched']):10d} "
                    f"{r['bytes_downloaded'] / 1e6:6.0f}"
                )
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
