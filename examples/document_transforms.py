"""Document transforms: a quality filter on text plus token filters, resumed and rescaled.

Writes a small JSONL text dataset (some documents are "spam" of repeated words), builds the
pipeline with a tokenizer (the byte tokenizer) and ``transforms``:

* a text filter (``quality``: enough distinct words) and a text map (``normalize``: collapse
  whitespace), run on the texts before tokenizing;
* the built-ins ``{"min_length": 24}`` and ``{"drop_tokens": [HASH]}`` on the tokens (``HASH``
  is the id of ``#``: the byte tokenizer maps byte ``b`` to id ``b + 1``, id 0 is EOS).

Then it checks what a user relies on: the documents delivered in one epoch are exactly the
reference set (the same functions applied to the raw texts), a resume on the same topology
continues with the same batches, and a checkpoint taken at 2 ranks restored at 3 ranks
delivers every kept document's tokens exactly once. Run with no arguments (a few seconds)::

    python examples/document_transforms.py
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import tempfile

import numpy as np

from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_jsonl
from torchdata_ext.tokenizers.load import DEFAULT_BYTE_OFFSET
from torchdata_ext.transforms import Filter

WORDS = [
    "data",
    "loader",
    "shard",
    "token",
    "epoch",
    "rescale",
    "batch",
    "sequence",
    "worker",
    "rank",
]


def quality(text: str, meta) -> bool:
    """Keep texts of at least 4 distinct words (the spam repeats one word)."""
    return len(set(text.split())) >= 4


def normalize(text: str, meta) -> str:
    """Collapse runs of whitespace: a length-changing map."""
    return re.sub(r"\s+", " ", text).strip()


def make_dataset(root: str) -> list[str]:
    rng = np.random.default_rng(0)
    texts = []
    for i in range(240):
        if i % 5 == 0:
            text = " ".join(["buy"] * int(rng.integers(3, 30)))  # spam
        else:
            words = rng.choice(WORDS, int(rng.integers(2, 40)))
            text = "  ".join(words) if i % 3 else " ".join(words)
            if i % 7 == 0:
                text += " #tag"  # dropped by drop_tokens
        texts.append(f"doc{i}  {text}")
    for f in range(3):
        write_jsonl(os.path.join(root, "web", f"part{f}.jsonl"), texts[f::3])
    return texts


BYTE_OFFSET = DEFAULT_BYTE_OFFSET  # what tokenizer="byte" means: byte b is id b + 1
HASH = ord("#") + BYTE_OFFSET


def config(root: str) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets="web", file_type="jsonl", col_name="text", tokenizer="byte",
        seq_length=64, eos_token=0, logical_shards=12, batch_size=2, shuffle_buffer=8,
        block_docs=8, epochs=1, seed=3, output_keys="input_ids,labels,provenance",
        transforms=[Filter(quality, on="text"), normalize, {"min_length": 24},
                    {"drop_tokens": [HASH]}],
    )  # fmt: skip


def build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world)


def reference(texts: list[str]) -> dict[tuple[int, int], bytes]:
    """(file, doc) -> the bytes of each document the transforms keep."""
    out = {}
    for i, text in enumerate(texts):
        if not quality(text, None):
            continue
        data = normalize(text, None).encode()
        if len(data) >= 24 and b"#" not in data:
            out[(i % 3, i // 3)] = data
    return out


def cover(coverage: dict, batches, want) -> None:
    """Add each batch's document token ranges to ``coverage``, checking every token is the
    transformed document's token its provenance names."""
    for batch in batches:
        for row, prov in enumerate(batch["provenance"]):
            x = np.concatenate([batch["input_ids"][row].numpy(), batch["labels"][row, -1:].numpy()])
            at = 0
            for ds, f, d, start, length in np.asarray(prov).tolist():
                if ds not in (LITERAL, PAD) and length:
                    assert (
                        bytes((x[at : at + length] - BYTE_OFFSET).astype(np.uint8))
                        == want[(f, d)][start : start + length]
                    ), (f, d)
                    coverage.setdefault((f, d), []).append((start, start + length))
                at += length


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="batches before each checkpoint")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="transforms_") as tmp:
        texts = make_dataset(tmp)
        cfg = config(tmp)
        want = reference(texts)
        make = functools.partial(build, cfg)

        full = list(TokenLoader(make, rank=0, world_size=1))
        coverage: dict = {}
        cover(coverage, full, want)
        assert set(coverage) == set(want), "delivered documents differ from the reference"
        print(f"{len(want)} of {len(texts)} documents kept, exactly the reference set")

        # resume on the same topology: the same batches
        loader = TokenLoader(make, rank=0, world_size=1)
        it = iter(loader)
        first = [next(it) for _ in range(args.steps)]
        save_checkpoint(loader, os.path.join(tmp, "ckpt_same"))
        resumed = TokenLoader(make, rank=0, world_size=1)
        load_checkpoint(resumed, os.path.join(tmp, "ckpt_same"))
        again = first + list(resumed)
        same = len(again) == len(full) and all(
            (a["input_ids"] == b["input_ids"]).all() for a, b in zip(again, full)
        )
        assert same, "the resumed run differs from the uninterrupted one"
        print(f"resumed after {args.steps} batches: the same {len(full)} batches")

        # rescale: 2 ranks -> checkpoint -> 3 ranks; every kept token exactly once
        ckpt = os.path.join(tmp, "ckpt_rescale")
        coverage = {}
        for rank in range(2):
            loader = TokenLoader(make, rank=rank, world_size=2)
            it = iter(loader)
            cover(coverage, [next(it) for _ in range(args.steps)], want)
            save_checkpoint(loader, ckpt)
        for rank in range(3):
            loader = TokenLoader(make, rank=rank, world_size=3)
            load_checkpoint(loader, ckpt)
            cover(coverage, list(loader), want)
        repeated = missing = 0
        for key, data in want.items():
            ranges = sorted(coverage.get(key, []))
            pos = 0
            for a, b in ranges:
                repeated += a < pos
                missing += a > pos
                pos = max(pos, b)
            missing += pos < len(data)
        assert not (repeated or missing), f"{repeated} repeated, {missing} missing"
        print("rescaled 2 -> 3 ranks: every kept document's tokens delivered once, 0 repeated")
        print("OK: document transforms exact under resume and rescale")


if __name__ == "__main__":
    main()
