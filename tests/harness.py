"""The checkpoint harness every stateful node's tests call.

``check_restore_at_every_step`` runs a node to the end (or ``max_steps``), saving its state
before every step, then for every step ``k`` builds a fresh node, restores the saved state and
checks the rest of the stream is identical to the uninterrupted run. States go through
``pickle`` first, as they do between dataloader workers and into checkpoints.
"""

from __future__ import annotations

import collections
import json
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode, Loader

from torchdata_ext.document import DocumentBlock
from torchdata_ext.pipeline.build import build_datasets
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_arrow_batches, write_jsonl


def item_key(item: Any) -> Any:
    """A hashable, comparable value for anything a node yields."""
    if isinstance(item, DocumentBlock):
        return (
            "block",
            item.dataset,
            None if item.tokens is None else (item.tokens.dtype.str, item.tokens.tobytes()),
            None if item.texts is None else tuple(item.texts),
            item.offsets.tobytes(),
            item.file.tobytes(),
            item.doc.tobytes(),
            item.start.tobytes(),
            item.last.tobytes(),
            item.shard,
            item.epoch,
        )
    if isinstance(item, np.ndarray):
        return ("array", item.dtype.str, item.shape, item.tobytes())
    if hasattr(item, "numpy") and hasattr(item, "dtype"):  # torch tensor
        return item_key(item.numpy())
    if isinstance(item, dict):
        return tuple(sorted((k, item_key(v)) for k, v in item.items()))
    if isinstance(item, (list, tuple)):
        return tuple(item_key(v) for v in item)
    return item


def run(node: BaseNode, max_steps: int | None = None) -> list[Any]:
    out = []
    for item in node:
        out.append(item)
        if max_steps is not None and len(out) >= max_steps:
            break
    return out


def check_restore_at_every_step(
    make_node: Callable[[], BaseNode],
    max_steps: int | None = None,
    steps: Iterable[int] | None = None,
) -> list[Any]:
    """Restore at every step k and check the rest of the stream equals the reference.

    Returns the reference items (so callers can assert on content too).
    """
    node = make_node()
    node.reset()
    states: list[bytes] = []
    items: list[Any] = []
    while max_steps is None or len(items) < max_steps:
        states.append(pickle.dumps(node.state_dict()))
        try:
            items.append(next(node))
        except StopIteration:
            break
    keys = [item_key(x) for x in items]
    check = range(len(states)) if steps is None else steps
    for k in check:
        fresh = make_node()
        fresh.reset(pickle.loads(states[k]))
        rest = run(fresh, len(items) - k)
        assert [item_key(x) for x in rest] == keys[k:], f"stream differs after restore at {k=}"
        if max_steps is None:  # the finite stream also ends at the same place
            try:
                next(fresh)
            except StopIteration:
                pass
            else:
                raise AssertionError(f"restored stream at {k=} is longer than the reference")
    return items


def check_loader_restore(make_node: Callable[[], BaseNode], steps: int, at: Iterable[int]) -> None:
    """The same through ``torchdata.nodes.Loader.state_dict`` / ``load_state_dict``."""
    loader = Loader(make_node())
    ref: list[Any] = []
    states: list[bytes] = []
    it = iter(loader)
    for _ in range(steps):
        states.append(pickle.dumps(loader.state_dict()))
        try:
            ref.append(item_key(next(it)))
        except StopIteration:
            break
    for k in at:
        if k >= len(states):
            continue
        fresh = Loader(make_node())
        fresh.load_state_dict(pickle.loads(states[k]))
        got = [item_key(x) for x in _take(iter(fresh), len(ref) - k)]
        assert got == ref[k:], f"Loader stream differs after restore at {k=}"


def _take(it, n):
    out = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out


def check_exactly_once(coverage: dict, lengths: dict) -> None:
    """Every document of ``lengths`` (key -> tokens) is covered by its delivered token ranges
    (``coverage``: key -> [(start, stop), ...]) exactly once: no gap, no overlap, no extra."""
    assert set(coverage) == set(lengths), "documents missing or unknown"
    for key, ranges in coverage.items():
        ranges.sort()
        pos = 0
        for a, b in ranges:
            assert a == pos, f"{key}: tokens {pos}..{a} missing or repeated (ranges {ranges})"
            pos = b
        assert pos == lengths[key], f"{key}: covered {pos} of {lengths[key]} tokens"


def write_random_arrow_datasets(
    root: str,
    datasets: Iterable[tuple[str, int, float]],
    seed: int,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The small two-file corpus the pipeline tests use: per ``(name, documents, mean)``,
    random ``uint32`` token documents of ``1 + exponential(mean)`` tokens, the even ones in
    ``root/name/p0.arrow`` and the odd ones in ``p1.arrow`` (Bamba layout); one generator of
    ``seed`` over all datasets in order."""
    rng = np.random.default_rng(seed)
    for name, n_docs, mean in datasets:
        docs = [
            rng.integers(5, 30_000, 1 + int(rng.exponential(mean)), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        for f in range(2):
            write_arrow_batches(
                f"{root}/{name}/p{f}.arrow", docs[f::2], storage_options=storage_options
            )


def write_random_text_datasets(
    root: str, datasets: Iterable[tuple[str, int, float]], words: list[str], seed: int
) -> None:
    """The text twin of :func:`write_random_arrow_datasets`: per ``(name, documents, mean)``,
    texts of ``1 + exponential(mean)`` words drawn from ``words``, the even ones in
    ``root/name/p0.jsonl`` and the odd ones in ``p1.jsonl``; one generator of ``seed``."""
    rng = np.random.default_rng(seed)
    for name, n_docs, mean in datasets:
        texts = [" ".join(rng.choice(words, 1 + int(rng.exponential(mean)))) for _ in range(n_docs)]
        for f in range(2):
            write_jsonl(f"{root}/{name}/p{f}.jsonl", texts[f::2])


def text_config(root: str, **extra: Any) -> PipelineConfig:
    """The small text pipeline the rescale and transform tests run over
    :func:`write_random_text_datasets`' ``web`` and ``code`` (byte tokenizer, 32-token
    sequences, 12 logical shards, one epoch), with ``extra`` fields."""
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="2,1", file_type="jsonl",
        col_name="text", tokenizer="byte", seq_length=32, eos_token=0, logical_shards=12,
        batch_size=2, seed=9, shuffle_buffer=5, block_docs=4, epochs=1, mix_quantum_tokens=0,
        **extra,
    )  # fmt: skip


def document_lengths(cfg: PipelineConfig) -> dict[tuple[str, int, int], int]:
    """Tokens per document of ``cfg``'s datasets, keyed ``(dataset, file number, doc)``, as
    the datasets' own index reads them (``DatasetIndex.doc_lengths``)."""
    out = {}
    for name, index in build_datasets(cfg).items():
        lengths = index.doc_lengths().tolist()
        at = 0
        for f, n_docs in enumerate(index.doc_counts.tolist()):
            for d in range(n_docs):
                out[(name, f, d)] = lengths[at + d]
            at += n_docs
    return out


def text_document_lengths(cfg: PipelineConfig) -> dict[tuple[str, int, int], int]:
    """Byte-tokenizer tokens of every document of ``cfg``'s JSONL datasets (two files each,
    ``p0.jsonl`` and ``p1.jsonl``, as :func:`write_random_text_datasets` writes them), keyed
    ``(dataset, file number, doc)``: text datasets have no token counts before tokenizing."""
    out = {}
    for name in cfg.datasets:
        for f in range(2):
            with open(f"{cfg.data_path}/{name}/p{f}.jsonl", encoding="utf-8") as fh:
                for d, line in enumerate(fh):
                    out[(name, f, d)] = len(json.loads(line)["text"].encode())
    return out


def counted_fingerprint_reads(monkeypatch: Any = None) -> list[str]:
    """From now on (in this test with ``monkeypatch``, else in this process: a spawned rank),
    the name of each data file whose bytes are fingerprinted, in order."""
    from torchdata_ext.sources import fingerprint

    read: list[str] = []
    real = fingerprint._sampled_sha256

    def counting(url: str, size: int, storage_options: Any) -> str:
        read.append(url.rsplit("/", 1)[-1])
        return real(url, size, storage_options)

    if monkeypatch is not None:
        monkeypatch.setattr(fingerprint, "_sampled_sha256", counting)
    else:
        fingerprint._sampled_sha256 = counting  # type: ignore[assignment]
    return read


def two_dataset_config(root: str, **extra: Any) -> PipelineConfig:
    """The weight-change tests' pipeline: ``web`` and ``code`` (160 documents of ~30 tokens
    each, written under ``root``), 1:1, 32-token rows, batches of 4, one epoch."""
    write_random_arrow_datasets(root, (("web", 160, 30), ("code", 160, 30)), seed=11)
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="1,1", seq_length=32, eos_token=0,
        logical_shards=12, batch_size=4, seed=3, shuffle_buffer=1, block_docs=4, epochs=1,
        output_keys="input_ids,labels,dataset_ids,provenance", **extra,
    )  # fmt: skip


def take_batches(
    loader: Any, stop: int | None, states: dict | None = None, start: int = 0
) -> list[Any]:
    """A ``TokenLoader``'s batches ``start + 1 .. stop`` (None: to the end), then closed;
    ``states[k]``: its state after step k (and at ``start``)."""
    out = []
    if states is not None:
        states[start] = loader.state_dict()
    for step, batch in enumerate(loader, start + 1):
        out.append(batch)
        if states is not None:
            states[step] = loader.state_dict()
        if step == stop:
            break
    loader.close()
    return out


def same_input_ids(a: list[Any], b: list[Any]) -> bool:
    """Whether two lists of batches hold the same ``input_ids``, batch by batch."""
    return len(a) == len(b) and all(
        np.array_equal(x["input_ids"].numpy(), y["input_ids"].numpy()) for x, y in zip(a, b)
    )


def dataset_share(batches: list[Any], dataset: int = 1) -> float:
    """Dataset number ``dataset``'s share of the data tokens of ``batches`` (``dataset_ids``)."""
    ids = np.concatenate([x["dataset_ids"].numpy().ravel() for x in batches])
    return float((ids == dataset).sum() / (ids >= 0).sum())


def delivered_documents(node: BaseNode) -> dict[str, collections.Counter]:
    """Each dataset's documents as the packed sequences of ``node`` (a pipeline built with
    ``collate=False`` and ``shuffle_buffer=1``: the packer last) hold them, pieces joined by
    start, as a multiset of token tuples per dataset name."""
    pieces: dict[tuple, dict[int, np.ndarray]] = collections.defaultdict(dict)
    for seq in run(node):
        full = np.concatenate([seq["input_ids"], seq["labels"][-1:]])
        pos = 0
        for ds, f, d, start, length in seq["provenance"].tolist():
            if ds not in (LITERAL, PAD):
                pieces[(node.dataset_names[ds], f, d)][start] = full[pos : pos + length]
            pos += length
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (name, _, _), parts in pieces.items():
        doc = np.concatenate([parts[s] for s in sorted(parts)])
        out[name][tuple(doc.tolist())] += 1
    return out
