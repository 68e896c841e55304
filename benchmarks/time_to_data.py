"""Time to data: the first batch fresh, the first batch after a restore, and the buffer's fill.

For token data (Arrow, Bamba layout) and text (JSONL through a tokenizer), through
``TokenLoader`` in this process (0 workers) and in 2 dataloader worker processes, each timed
from building the loader to its first batch:

* **bufferless** (``shuffle_buffer=1``): the reference, what the rest of the pipeline costs;
* **fresh** (``shuffle_fill="stream"``, the default): the buffer delivers while it fills;
* **full fill first** (``shuffle_fill="full"``): the first batch waits for the whole buffer;
* **until the buffer is full** (streaming): batches until every worker's buffer holds
  ``shuffle_buffer`` sequences;
* **after a restore** of the state taken then (a full buffer per worker): ``load_state_dict``
  and the first batch (the buffer is restored as provenance, rows rebuilt when drawn).

First batches (bufferless, fresh, after a restore) are the least of 3 tries; the fill and the
full-fill first batch are timed once. Each figure is printed with its ratio to the bufferless first batch of the same data and
workers, measured in the same run. The default config is small (about a minute on 2 shared
cores); ``--full`` is the issue's config: 3 datasets 3:1:1, seq 4096 (+1), batch 8, a
10,000-row buffer, 64 logical shards (generates ~400M tokens of data once, slow).

    python benchmarks/time_to_data.py [--full] [--workers 0 2] [--tokenizer tokenizer.json]
        [--first-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pickle
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus, jsonl_dataset  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.loader.token_loader import TokenLoader  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402

REPEAT = 3  # first batches (bufferless, fresh, restored): the least of 3 tries


def text_corpus(data_dir: str, total_bytes: int) -> str:
    """Three JSONL sub-datasets (``BAMBA_SHARES`` of ``total_bytes``), made once."""
    root = os.path.join(data_dir, f"jsonl_{total_bytes}")
    for i, (name, share) in enumerate(BAMBA_SHARES.items()):
        jsonl_dataset(os.path.join(root, name), int(total_bytes * share), 4, seed=10 + i)
    return root


def _build(cfg: PipelineConfig, datasets: Any, world: World) -> Any:
    return build_pipeline(cfg, world, datasets)


def _loader(cfg: PipelineConfig, workers: int) -> TokenLoader:
    return TokenLoader(functools.partial(_build, cfg, build_datasets(cfg)), num_workers=workers)


def first_batch(cfg: PipelineConfig, workers: int, repeat: int = 1) -> float:
    """Seconds from building the loader to its first batch (the least of ``repeat`` tries:
    a shared machine adds stalls, never removes work)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        loader = _loader(cfg, workers)
        next(iter(loader))
        best = min(best, time.perf_counter() - t0)
        loader.close()  # its workers stop now, not while the next try runs
    return best


def fill_and_restore(cfg: PipelineConfig, workers: int) -> tuple[float, float, float]:
    """Streaming: seconds to the first batch and until every worker's buffer is full; then
    seconds from a new loader's ``load_state_dict`` of the state taken there (pickled and
    loaded, as a checkpoint holds it) to its first batch."""
    t0 = time.perf_counter()
    loader = _loader(cfg, workers)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    full_after = -(-cfg.shuffle_buffer * max(1, workers) // cfg.batch_size)
    for _ in range(full_after - 1):
        next(it)
    filled = time.perf_counter() - t0
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint file holds it
    loader.close()
    del it, loader
    restored = float("inf")
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        again = _loader(cfg, workers)
        again.load_state_dict(state)
        next(iter(again))
        restored = min(restored, time.perf_counter() - t0)
        again.close()
    return min(first, first_batch(cfg, workers, REPEAT - 1)), filled, restored


def report(kind: str, cfg: PipelineConfig, workers: int, first_only: bool = False) -> None:
    bufferless = dataclasses.replace(cfg, shuffle_buffer=1)
    first_batch(bufferless, workers)  # warm up (imports, file metadata, page cache): left out
    ref = first_batch(bufferless, workers, REPEAT)
    label = f"{kind}, {workers} workers"
    print(f"{label}: bufferless first batch {ref:.3f} s (the reference)")
    if first_only:  # a buffer too large to fill in a benchmark (text with 10,000 rows)
        rows = [("first batch, fresh (streaming fill)", first_batch(cfg, workers, REPEAT))]
    else:
        full = first_batch(dataclasses.replace(cfg, shuffle_fill="full"), workers)
        first, filled, restored = fill_and_restore(cfg, workers)
        rows = [
            ("first batch, fresh (streaming fill)", first),
            ("first batch after a restore (full buffer)", restored),
            (f"until the buffer is full ({cfg.shuffle_buffer} rows per worker)", filled),
            ("first batch, full fill first (shuffle_fill='full')", full),
        ]
    for what, secs in rows:
        print(f"{label}: {what} {secs:.3f} s ({secs / ref:.1f}x the reference)")


def shuffle_quality(buffer: int, batch: int, seed: int = 1) -> None:
    """What streaming the fill costs the shuffle, on an endless in-order source (item ``i`` is
    ``i``): over the first ``buffer`` draws (the fill) and over ``buffer`` draws of the steady
    state after it, with ``fill="full"``'s first draws as the comparison. Printed: the draws'
    slot uniformity (the slot index over the items held, in 8 bins: min and max count over
    the mean, the statistic of ``tests/test_shuffle.py::test_draws_are_uniform_over_the_
    buffer``), how far apart neighbouring rows were in the source (median ``|src[t+1] -
    src[t]|``, in buffers), the spread of a batch (median of max - min source index of its
    rows, in buffers) and the lag-1 correlation of the rows' ages (``t - src[t]``)."""
    from torchdata.nodes import IterableWrapper

    from torchdata_ext.nodes.shuffle import DRAW_TAG, ShuffleBuffer
    from torchdata_ext.order.walk import mix_seed

    print(f"shuffle quality, {buffer}-row buffer, batches of {batch}, in-order source:")
    for fill in ("stream", "full"):
        node = ShuffleBuffer(IterableWrapper(range(10**9)), buffer, seed=seed, fill=fill)
        node.reset()
        src = np.array([next(node) for _ in range(3 * buffer)], np.int64)
        for label, lo in (("fill", 0), ("steady", 2 * buffer)):
            if fill == "full" and label == "steady":
                continue
            part = src[lo : lo + buffer]
            t = np.arange(lo, lo + buffer)
            held = np.minimum(t + 1, buffer) if fill == "stream" else np.full(buffer, buffer)
            slots = np.array([mix_seed(seed, DRAW_TAG, int(i)) for i in t], np.uint64)
            rel = (slots % held.astype(np.uint64)).astype(np.float64) / held
            bins = np.bincount(np.minimum((rel * 8).astype(int), 7), minlength=8)
            age = t - part
            spread = np.ptp(part[: len(part) // batch * batch].reshape(-1, batch), axis=1)
            print(
                f"  fill={fill!r}, {'first' if label == 'fill' else 'steady-state'} {buffer} "
                f"draws ({buffer // batch} batches): slot bins min/max over mean "
                f"{bins.min() / bins.mean():.2f}/{bins.max() / bins.mean():.2f}; neighbours "
                f"{np.median(np.abs(np.diff(part))) / buffer:.3f} buffers apart; batch spread "
                f"{np.median(spread) / buffer:.2f} buffers; lag-1 correlation of ages "
                f"{np.corrcoef(age[:-1], age[1:])[0, 1]:.2f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="the issue's config (slow)")
    p.add_argument("--tokens", type=int, help="token corpus size (default 6M; --full 400M)")
    p.add_argument("--text-bytes", type=int, help="text corpus size (default 6M; --full 60M)")
    p.add_argument("--seq-length", type=int, help="default 1024; --full 4096")
    p.add_argument("--shuffle-buffer", type=int, help="default 1000; --full 10000")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--logical-shards", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    p.add_argument("--data-dir", default="bench_data/time_to_data")
    p.add_argument("--kinds", nargs="+", default=["tokens", "text"], choices=["tokens", "text"])
    p.add_argument("--quality-only", action="store_true", help="only the shuffle statistics")
    p.add_argument(
        "--first-only", action="store_true",
        help="only the first batches, fresh (no fill, no restore: for buffers too large to fill)",
    )  # fmt: skip
    a = p.parse_args()
    tokens = a.tokens or (400_000_000 if a.full else 6_000_000)
    text_bytes = a.text_bytes or (60_000_000 if a.full else 6_000_000)
    seq = a.seq_length or (4096 if a.full else 1024)
    buffer = a.shuffle_buffer or (10_000 if a.full else 1000)
    base = dict(
        datasets=",".join(BAMBA_SHARES),
        weights="3,1,1",
        seq_length=seq,
        batch_size=a.batch_size,
        logical_shards=a.logical_shards,
        shuffle_buffer=buffer,
        eos_token=0,
        seed=1,
    )
    shuffle_quality(buffer, a.batch_size)
    if a.quality_only:
        return
    print(
        f"config: 3 datasets 3:1:1, seq {seq} (+1), batch {a.batch_size}, {buffer}-row "
        f"buffer, {a.logical_shards} logical shards; {tokens:,} tokens, {text_bytes:,} bytes "
        f"of text ({a.tokenizer} tokenizer); {os.cpu_count()} cores"
    )
    for kind in a.kinds:
        if kind == "tokens":
            cfg = PipelineConfig(data_path=bamba_corpus(a.data_dir, tokens), **base)  # type: ignore[arg-type]
        else:
            cfg = PipelineConfig(
                data_path=text_corpus(a.data_dir, text_bytes),
                file_type="jsonl",
                col_name="text",
                tokenizer=a.tokenizer,
                **base,  # type: ignore[arg-type]
            )
        for workers in a.workers:
            report(kind, cfg, workers, a.first_only)


if __name__ == "__main__":
    main()
