"""Range reads of a big flat token file on S3: bytes read and time to the first batch.

Starts moto's S3 server on 127.0.0.1 (in a subprocess), writes one flat ``uint32`` ``.bin``
token file of ``--size-mb`` MB (lognormal document lengths, median ~600 tokens) with its
``.offsets.npy`` sidecar, uploads both, then times the first batch (``--seq-length`` x
``--batch-size`` tokens, through ``build_pipeline``: reader, pack, collate) from a cold cache:

* **by range**: the default :class:`~torchdata_ext.remote.ShardCache`, whose
  ``range_reads_above`` (1 GiB) the file passes: the sidecar and the documents the batch needs;
* **downloaded whole**: the same with ``range_reads_above=None`` (as before range reads of
  token files): the batch waits for the whole file.

Each prints the bytes read from the store, the requests, and the time from building the
pipeline to its first batch. Moto answers a range GET in a time that grows with the object's
size (it reads the whole object for each request: ~8 ms at 1 MB, ~75 ms at 64 MB here), unlike
S3, so the by-range time is an upper bound; the bytes and requests are exact. ``--latency-ms`` (default 30) and ``--bandwidth-mbps`` (default
200) make moto behave like a remote store (see ``remote_throughput.py``).

    python benchmarks/range_reads.py [--size-mb 1200] [--latency-ms 30] [--bandwidth-mbps 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any
from unittest import mock

import numpy as np
from remote_throughput import add_latency, start_moto

from torchdata_ext import PipelineConfig, World, build_pipeline
from torchdata_ext.remote import ShardCache
from torchdata_ext.testing import write_flat_tokens


def generate(path: str, size_mb: int) -> tuple[int, int]:
    """A flat uint32 token file of about ``size_mb`` MB and its sidecar; (tokens, documents)."""
    rng = np.random.default_rng(0)
    total = size_mb * (1 << 20) // 4
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, total // 300), 16, 100_000).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), total)) + 1]
    flat = rng.integers(1, 128_000, size=int(lengths.sum()), dtype=np.uint32)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    docs = [flat[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
    write_flat_tokens(path, docs, offsets=True)
    return int(flat.size), len(docs)


def first_batch(cfg: PipelineConfig, cache: ShardCache) -> dict[str, float]:
    """Seconds from building the pipeline to its first batch, and the cache's counters."""
    with mock.patch("torchdata_ext.sources.file_access.make_cache", lambda *_: cache):
        t0 = time.perf_counter()
        node = build_pipeline(cfg, World())
        batch = next(iter(node))
        seconds = time.perf_counter() - t0
    assert batch["input_ids"].shape == (cfg.batch_size, cfg.seq_length)
    return {"seconds": seconds, **cache.stats()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=1200)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--bandwidth-mbps", type=float, default=200.0)
    args = p.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    proc, endpoint = start_moto()
    work = tempfile.mkdtemp(prefix="range_reads_")
    try:
        import s3fs

        so: dict[str, Any] = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        fs = s3fs.S3FileSystem(**so)
        fs.call_s3("create_bucket", Bucket="bench")
        t0 = time.perf_counter()
        local = os.path.join(work, "web", "shard_0000.bin")
        os.makedirs(os.path.dirname(local))
        tokens, n_docs = generate(local, args.size_mb)
        fs.put(os.path.dirname(local), "bench/data/web", recursive=True)
        size = os.path.getsize(local)
        print(
            f"file: {size / 1e6:.0f} MB, {tokens / 1e6:.0f}M uint32 tokens, {n_docs:,} documents "
            f"(sidecar {os.path.getsize(local + '.offsets.npy') / 1e6:.1f} MB); made and uploaded "
            f"in {time.perf_counter() - t0:.1f}s"
        )
        t0 = time.perf_counter()
        for k in range(5):
            fs.cat_file("bench/data/web/shard_0000.bin", start=k << 20, end=(k << 20) + 4096)
        print(
            f"moto's own time for one 4 KiB range GET of this object, before the added latency: "
            f"{(time.perf_counter() - t0) / 5 * 1e3:.0f} ms (moto reads the whole object per "
            "request, so it grows with the object; S3's does not)"
        )
        add_latency(args.latency_ms / 1e3, args.bandwidth_mbps * 1e6)
        print(
            f"endpoint: moto on 127.0.0.1, +{args.latency_ms:g} ms per request, "
            f"{args.bandwidth_mbps:g} MB/s per transfer; batch {args.batch_size} x "
            f"{args.seq_length} tokens, 1 worker"
        )
        cfg = PipelineConfig(
            data_path="s3://bench/data", datasets="web", file_type="flat", eos_token=None,
            seq_length=args.seq_length, batch_size=args.batch_size, logical_shards=64,
            shuffle_buffer=1, storage_options=so, block_docs=64,
        )  # fmt: skip
        print(f"{'mode':<20} {'first batch s':>13} {'MB read':>8} {'of file':>8} {'requests':>8}")
        default = ShardCache.__init__.__kwdefaults__["range_reads_above"]  # type: ignore[index]
        if size < default:
            print(f"(smaller than the default range_reads_above {default:,}: set to 0)")
        for mode, above in (("by range", min(default, size)), ("downloaded whole", None)):
            cache = ShardCache(os.path.join(work, f"cache-{mode}"), range_reads_above=above)
            try:
                r = first_batch(cfg, cache)
            finally:
                cache.close()
            requests = int(r["range_requests"] + r["downloads"])
            print(
                f"{mode:<20} {r['seconds']:13.2f} {r['bytes_downloaded'] / 1e6:8.2f} "
                f"{r['bytes_downloaded'] / size:8.2%} {requests:8d}"
            )
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
