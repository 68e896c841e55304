"""Text through dataloader workers: tokens per second tokenized on the fly, 0 / 1 / 2 workers,
side by side with epochraft on the same text and the same tokenizer, in one run.

The text is generated locally (a Zipf vocabulary of made-up words, lognormal document lengths,
JSONL); a byte-level BPE is trained on it with Hugging Face ``tokenizers`` (no download), both
kept in ``--data-dir``. Reported:

* the tokenizer's limit: ``encode_batch_fast`` over the texts in this process (its own threads);
* torchdata-ext: ``TokenLoader`` over the text pipeline (3:1:1 mix, seq ``--seq-length`` + 1,
  batch 8, a small shuffle buffer, a state at every step) with 0, 1 and 2 workers; workers get
  ``cores // workers`` tokenizer threads each (``tokenizers.limit_tokenizer_threads``), and a
  row with ``RAYON_NUM_THREADS`` set to all cores in every worker shows what that avoids;
* epochraft (if installed: ``pip install epochraft``, a benchmark-only dependency):
  ``from_files(...).tokenize(...).concat_chunk(...).batch(8)`` per worker over its share of
  the files, in a ``torch.utils.data.DataLoader`` with 0 and 2 workers.

Rates are taken from the first batch to ``--tokens`` tokens (process start and the first batch
left out; ``benchmarks/time_to_data.py`` measures those), each with its ratio to the tokenizer's
limit measured in the same run, and with the CPU seconds per million tokens of the whole
process tree (workers included), which a shared machine disturbs less than wall time.

    python benchmarks/text_workers.py [--text-bytes 8_000_000] [--tokens 3_000_000]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cpu import tree_cpu  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402
from torchdata_ext.testing import write_jsonl  # noqa: E402

SHARES = {"web": 0.6, "code": 0.2, "books": 0.2}


def make_text(root: str, total_bytes: int, seed: int = 0) -> list[str]:
    """JSONL files of made-up words (4 per dataset), made once; returns their paths."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(
        ["".join(rng.choice(letters, int(n))) for n in rng.integers(2, 11, 20_000)], dtype=object
    )
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    paths = []
    for name, share in SHARES.items():
        for f in range(4):
            path = os.path.join(root, name, f"part_{f}.jsonl")
            paths.append(path)
            if os.path.exists(path):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            texts, size = [], 0
            while size < total_bytes * share / 4:
                n = int(np.clip(rng.lognormal(np.log(300), 1.0), 5, 20_000))
                words = vocab[rng.choice(len(vocab), n, p=p)]
                text = " ".join(words) + "."
                texts.append(text)
                size += len(text)
            write_jsonl(path + ".tmp.jsonl", texts)
            os.replace(path + ".tmp.jsonl", path)
    return paths


def train_bpe(paths: list[str], out: str, vocab: int) -> str:
    if not os.path.exists(out):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"])
        tok.train_from_iterator((t for p in paths for t in _texts(p)), trainer)
        tok.save(out)
    return out


def _texts(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


def tokenizer_limit(tok_path: str, paths: list[str], max_tokens: int) -> tuple[float, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = [t for p in paths for t in _texts(p)]
    t0, c0 = time.perf_counter(), tree_cpu()
    total, i = 0, 0
    while total < max_tokens and i < len(texts):
        out = tok.encode_batch_fast(texts[i : i + 64])
        total += sum(len(e.ids) for e in out)
        i += 64
    return total / (time.perf_counter() - t0), (tree_cpu() - c0) / total * 1e6


def _build(cfg: PipelineConfig, datasets: Any, world: World) -> Any:
    return build_pipeline(cfg, world, datasets)


def ours(cfg: PipelineConfig, workers: int, max_tokens: int) -> tuple[float, float]:
    from torchdata_ext.loader.token_loader import TokenLoader

    loader = TokenLoader(functools.partial(_build, cfg, build_datasets(cfg)), num_workers=workers)
    it = iter(loader)
    next(it)
    t0, c0 = time.perf_counter(), tree_cpu()
    total = 0
    for batch in it:
        total += batch["input_ids"].numel()
        loader.state_dict()
        if total >= max_tokens:
            break
    return total / (time.perf_counter() - t0), (tree_cpu() - c0) / total * 1e6


class _EpochraftShare(torch.utils.data.IterableDataset):
    """Epochraft's pipeline over this worker's share of the files."""

    def __init__(self, paths: list[str], tok_path: str, seq: int, batch: int) -> None:
        super().__init__()
        self.paths, self.tok_path, self.seq, self.batch = paths, tok_path, seq, batch

    def __iter__(self) -> Any:
        from epochraft import CheckpointableDataset
        from transformers import PreTrainedTokenizerFast

        info = torch.utils.data.get_worker_info()
        mine = self.paths if info is None else self.paths[info.id :: info.num_workers]
        tok = PreTrainedTokenizerFast(tokenizer_file=self.tok_path, eos_token="<eos>")
        ds = (
            CheckpointableDataset.from_files(mine, repeat=True, shuffle_shards=True)
            .tokenize(tok)
            .add_bos_eos(None, tok.eos_token_id)
            .concat_chunk(self.seq + 1)
            .batch(self.batch)
        )
        return iter(ds)


def theirs(
    paths: list[str], tok_path: str, seq: int, workers: int, max_tokens: int
) -> tuple[float, float]:
    data = _EpochraftShare(paths, tok_path, seq, 8)
    it = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers))
    next(it)
    t0, c0 = time.perf_counter(), tree_cpu()
    total = 0
    for batch in it:
        total += batch["input_ids"].numel()
        if total >= max_tokens:
            break
    return total / (time.perf_counter() - t0), (tree_cpu() - c0) / total * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text-bytes", type=int, default=8_000_000)
    p.add_argument("--tokens", type=int, default=500_000, help="tokens timed per row")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--data-dir", default="bench_data/text_workers")
    p.add_argument("--row", help=argparse.SUPPRESS)  # one row in a child process
    a = p.parse_args()
    root = os.path.join(a.data_dir, f"text_{a.text_bytes}")
    paths = make_text(root, a.text_bytes)
    tok_path = train_bpe(paths, os.path.join(root, f"bpe_{a.vocab}.json"), a.vocab)
    cfg = PipelineConfig(
        data_path=root, datasets=",".join(SHARES), weights="3,1,1", file_type="jsonl",
        col_name="text", tokenizer=tok_path, seq_length=a.seq_length, eos_token=0,
        logical_shards=64, batch_size=8, shuffle_buffer=64, seed=1,
    )  # fmt: skip
    if a.row:  # each row in a fresh process: a tokenizer's thread pool is made once
        system, workers = a.row.split(":")
        rate, cpu = (
            ours(cfg, int(workers), a.tokens)
            if system == "ours"
            else theirs(paths, tok_path, a.seq_length, int(workers), a.tokens)
        )
        print(rate, cpu)
        return
    cores = os.cpu_count()
    limit, limit_cpu = tokenizer_limit(tok_path, paths, a.tokens)
    print(f"{a.text_bytes:,} bytes of text, BPE of {a.vocab} (trained here), {cores} cores")
    print(
        f"tokenizer limit (encode_batch_fast, this process): {limit / 1e6:.3f}M tokens/s, "
        f"{limit_cpu:.1f} CPU s per M tokens"
    )
    rows = [("torchdata-ext", "ours", w, {}) for w in (0, 1, 2)]
    rows.append(
        ("torchdata-ext, RAYON_NUM_THREADS=all cores in each worker", "ours", 2, {"RAYON_NUM_THREADS": str(cores)})
    )  # fmt: skip
    try:
        import epochraft  # noqa: F401
        import transformers  # noqa: F401

        rows += [("epochraft", "theirs", w, {}) for w in (0, 2)]
    except ImportError:
        print("epochraft rows left out: pip install epochraft transformers (benchmark only)")
    for label, system, workers, env in rows:
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--row", f"{system}:{workers}"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        rate, cpu = map(float, out.stdout.strip().splitlines()[-1].split())
        print(
            f"{label}, {workers} workers: {rate / 1e6:.3f}M tokens/s "
            f"({rate / limit:.2f}x the tokenizer limit); {cpu:.1f} CPU s per M tokens "
            f"({cpu / limit_cpu:.2f}x the tokenizer's)"
        )


if __name__ == "__main__":
    main()
