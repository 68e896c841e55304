"""Generated benchmark corpora (kept in bench_data/, git-ignored, reused between runs)."""

from __future__ import annotations

import os

import numpy as np

from torchdata_ext.testing import write_arrow_batches, write_jsonl


def lognormal_lengths(
    total_tokens: int, rng: np.random.Generator, median: float = 600
) -> np.ndarray:
    """Document lengths, lognormal around ``median`` with a long tail (16 .. 100k tokens)."""
    out: list[int] = []
    while sum(out) < total_tokens:
        out.extend(
            np.clip(rng.lognormal(np.log(median), 1.0, 4096), 16, 100_000).astype(int).tolist()
        )
    cut = int(np.searchsorted(np.cumsum(out), total_tokens)) + 1
    return np.asarray(out[:cut], np.int64)


def arrow_dataset(
    folder: str, total_tokens: int, n_files: int, seed: int, median: float = 600
) -> None:
    """Bamba layout: one document per record batch, uint32 ``tokens``."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in range(n_files):
        path = os.path.join(folder, f"shard_{f:04d}.arrow")
        if os.path.exists(path):
            continue
        lengths = lognormal_lengths(total_tokens // n_files, rng, median)
        flat = rng.integers(0, 128_000, size=int(lengths.sum()), dtype=np.uint32)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        write_arrow_batches(
            path + ".tmp", [flat[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
        )
        os.replace(path + ".tmp", path)


def jsonl_dataset(folder: str, total_bytes: int, n_files: int, seed: int) -> None:
    """Text documents of lognormal length (bytes), ASCII words."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(
        ["data", "loader", "token", "shard", "epoch", "random", "walk", "pack", "the", "of"]
    )
    for f in range(n_files):
        path = os.path.join(folder, f"part_{f:04d}.jsonl")
        if os.path.exists(path):
            continue
        lengths = lognormal_lengths(total_bytes // n_files, rng, 2000) // 5
        texts = [" ".join(words[rng.integers(0, len(words), n)]) for n in lengths]
        write_jsonl(path + ".tmp.jsonl", texts)
        os.replace(path + ".tmp.jsonl", path)


BAMBA_SHARES = {"web": 0.6, "code": 0.2, "books": 0.2}  # weighted 3:1:1


def bamba_corpus(data_dir: str, total_tokens: int) -> str:
    """The benchmark corpus of three sub-datasets (``BAMBA_SHARES`` of ``total_tokens``, 4
    uint32 Arrow files each), made once under ``data_dir``; returns its folder."""
    root = os.path.join(data_dir, f"arrow_{total_tokens}")
    for i, (name, share) in enumerate(BAMBA_SHARES.items()):
        arrow_dataset(os.path.join(root, name), int(total_tokens * share), 4, seed=i)
    return root
