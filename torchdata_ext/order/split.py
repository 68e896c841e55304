"""The held-out evaluation split: which documents of a dataset are kept for evaluation.

A document is held out when a seeded hash of ``(seed, dataset name, file name, document index)``
mapped to ``[0, 1)`` is below ``eval_fraction``. The file *name* is its last path component
(``part-00003.arrow``), not its URL, so the split stays the same when the data is mounted
elsewhere or copied to a bucket; and it depends on nothing else, so the same documents are
held out whatever the topology, the logical shard count, the training seed, and when files are
added to the dataset (the documents of the files already there keep their side). Two files with
the same name in different folders of one dataset get the same pattern of held-out indexes.

The split is a pure function, evaluated for a whole run of documents of one file at once with
NumPy (:func:`heldout_mask`). The reader (:class:`~torchdata_ext.nodes.reader.ShardReader`)
applies it per block: ``subset="train"`` skips held-out documents the way it skips filtered
ones (their walk positions are consumed, so exactly-once and rescale hold), ``subset="eval"``
delivers only them. The split's parameters are part of the reader state, and a restore with
another split is refused.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from torchdata_ext.checks import check_int

__all__ = ["EvalSplit", "Subset", "heldout_documents", "heldout_mask"]

Subset = Literal["train", "eval"]
_SUBSETS = ("train", "eval")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MAX_WINDOW = 64  # a reader's walk window is at most this many blocks (bounds its arrays)


@dataclass(frozen=True)
class EvalSplit:
    """A deterministic held-out split of every dataset it is given to.

    Args:
        eval_fraction: the share of documents held out for evaluation, in ``[0, 1]`` (e.g.
            0.01); each document is held out independently with this probability, so a
            dataset of ``n`` documents holds out about ``eval_fraction * n``.
        seed: the split's own seed (keep it fixed for the life of a project: another seed
            holds out other documents). Independent of the shuffling seed.
    """

    eval_fraction: float
    seed: int = 0

    def __post_init__(self) -> None:
        f = self.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(
                f"eval_fraction={f!r} must be a number in [0, 1] (e.g. 0.01 to hold out 1% of "
                "the documents)"
            )
        check_int("seed", self.seed, None)

    def as_state(self) -> dict[str, Any]:
        """The split as recorded in reader states and checkpoints."""
        return {"eval_fraction": float(self.eval_fraction), "seed": int(self.seed)}

    def mask(self, dataset: str, file: str, docs: np.ndarray) -> np.ndarray:
        """Whether each of documents ``docs`` of file ``file`` of ``dataset`` is held out
        (see :func:`heldout_mask`)."""
        return heldout_mask(file_key(self.seed, dataset, file), docs, self.eval_fraction)


def file_key(seed: int, dataset: str, file: str) -> int:
    """The 64-bit hash key of one file of a dataset under a split seed; ``file`` may be a URL
    or a path: only its last component counts."""
    name = posixpath.basename(str(file).rstrip("/"))
    digest = hashlib.sha256(f"{int(seed)}\0{dataset}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def heldout_mask(key: int, docs: np.ndarray, eval_fraction: float) -> np.ndarray:
    """Whether each document index of ``docs`` is held out, for the file of hash ``key``
    (:func:`file_key`): a SplitMix64 hash of ``key`` and the index, as a uniform number in
    ``[0, 1)``, below ``eval_fraction``. Vectorised: one NumPy pass over ``docs``."""
    x = np.asarray(docs, dtype=np.int64).astype(np.uint64) * _GOLDEN
    x ^= np.uint64(key)
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    uniform = (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return uniform < eval_fraction


def heldout_documents(index: Any, split: EvalSplit) -> list[tuple[int, int]]:
    """Every held-out document of a dataset, as ``(file number, document index)`` in file
    order: what an evaluation reader over all ranks and workers delivers.

    Args:
        index: the dataset (a :class:`~torchdata_ext.sources.index.DatasetIndex`).
        split: the split.
    """
    out: list[tuple[int, int]] = []
    for f, (url, n) in enumerate(zip(index.files, index.doc_counts.tolist())):
        docs = np.flatnonzero(split.mask(index.name, url, np.arange(n)))
        out.extend((f, int(d)) for d in docs.tolist())
    return out


class SplitFilter:
    """The split as one reader applies it: per file key, which documents it delivers.

    Args:
        split: the split.
        subset: ``"train"`` (everything but the held-out documents) or ``"eval"`` (only them).
        dataset: the dataset name.
        files: the dataset's file URLs, by file number.
    """

    def __init__(self, split: EvalSplit, subset: Subset, dataset: str, files: Sequence[str]):
        if subset not in _SUBSETS:
            raise ValueError(f"{subset=} must be 'train' or 'eval'")
        self.split = split
        self.subset = subset
        self.keys = [file_key(split.seed, dataset, f) for f in files]
        rate = split.eval_fraction if subset == "eval" else 1.0 - split.eval_fraction
        self._stretch = _MAX_WINDOW if rate <= 0 else min(_MAX_WINDOW, math.ceil(1 / rate))

    def window(self, block_docs: int) -> int:
        """Walk positions to look at for a block of ``block_docs`` delivered documents."""
        return block_docs * self._stretch

    def keep(self, file: int, docs: np.ndarray) -> np.ndarray:
        """Whether each of ``docs`` of file number ``file`` is delivered."""
        held = heldout_mask(self.keys[file], docs, self.split.eval_fraction)
        return held if self.subset == "eval" else ~held

    def state(self) -> dict[str, Any]:
        return {**self.split.as_state(), "subset": self.subset}
