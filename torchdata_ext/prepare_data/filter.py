"""Which documents :func:`~torchdata_ext.prepare_data.tokenize_text.prepare` keeps: a seeded sample and a
length range (Bolmo's ``--data-fraction``/``--seed``, CEPED's length filtering).

* **Sample** (``data_fraction=F``, ``seed=S``): a document is kept when a seeded hash of
  ``(S, input file name, record index in that file)`` mapped to ``[0, 1)`` is below ``F``,
  the same SplitMix64 hash as the held-out split (:mod:`torchdata_ext.order.split`). The file *name*
  is its last path component and the record index counts every record of the file (a JSONL
  line, a Parquet row; empty texts too; a ``.txt`` file is record 0), so the sample depends on
  nothing else: the same documents whatever ``num_proc``, ``num_shards`` and ``shard_id``,
  after a resume, and when the inputs move (local to a bucket). Each document is kept
  independently, so about ``F x`` the documents are kept (not exactly, as in Bolmo's streaming
  sample). Two inputs with the same name in different folders get the same pattern of kept
  record indexes. Sampled-out documents are never tokenized.
* **Lengths** (``min_length``/``max_length``): a document is kept when its token count after
  tokenizing, **without** the ``eos_token`` that ``prepare`` appends (but with any special
  tokens the tokenizer itself adds), is in ``[min_length, max_length]`` (both inclusive).

Both are evaluated with NumPy over all the documents of a batch at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdata_ext.checks import check_int
from torchdata_ext.order.split import file_key, heldout_mask

__all__ = [
    "FILTER_DEFAULTS",
    "DocFilter",
    "check_same_filter",
    "left_out_summary",
    "warn_nothing_kept",
]

# the settings as a prepare progress file records them, at the values of a run without them
# (progress files written before these options resume as such a run)
FILTER_DEFAULTS: dict[str, Any] = {
    "data_fraction": 1.0,
    "seed": None,
    "min_length": None,
    "max_length": None,
}
_NAMESPACE = "prepare:data_fraction"  # keeps the sample independent of a held-out split's hash


@dataclass(frozen=True)
class DocFilter:
    """The documents ``prepare`` keeps (see the module docstring).

    Args:
        data_fraction: the share of documents kept, in ``(0, 1]``; 1 keeps all.
        seed: the sample's seed (any integer); another seed samples other documents.
        min_length: the fewest tokens a kept document has (without EOS), or None.
        max_length: the most tokens a kept document has (without EOS), or None.

    Raises:
        ValueError / TypeError: an argument is out of range or of the wrong type, named.
    """

    data_fraction: float = 1.0
    seed: int = 0
    min_length: int | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        f = self.data_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(
                f"data_fraction={f!r} must be a number in (0, 1], e.g. 0.01 to keep about 1% "
                "of the documents (1 keeps all)"
            )
        check_int("seed", self.seed, None)
        if self.min_length is not None:
            check_int("min_length", self.min_length, 0)
        if self.max_length is not None:
            check_int("max_length", self.max_length, 1)
        lo, hi = self.min_length, self.max_length
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"min_length={lo} > max_length={hi}: no document could be kept; lower "
                "min_length or raise max_length"
            )

    @property
    def samples(self) -> bool:
        """Whether some documents may be sampled out (``data_fraction < 1``)."""
        return self.data_fraction < 1.0

    def as_config(self) -> dict[str, Any]:
        """The settings as the progress file records them (keys of :data:`FILTER_DEFAULTS`;
        the seed only when it matters)."""
        return {
            "data_fraction": float(self.data_fraction),
            "seed": int(self.seed) if self.samples else None,
            "min_length": self.min_length,
            "max_length": self.max_length,
        }

    def sampled(self, file: str, records: np.ndarray) -> np.ndarray:
        """Whether each record index of ``records`` of input ``file`` (URL or path: only its
        name counts) is in the sample; all True when ``data_fraction == 1``."""
        records = np.asarray(records, dtype=np.int64)
        if not self.samples:
            return np.ones(records.shape, dtype=bool)
        return heldout_mask(file_key(self.seed, _NAMESPACE, file), records, self.data_fraction)

    def too_short(self, lengths: np.ndarray) -> np.ndarray:
        """Whether each token count of ``lengths`` is below ``min_length``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.min_length is None:
            return np.zeros(lengths.shape, dtype=bool)
        return lengths < self.min_length

    def too_long(self, lengths: np.ndarray) -> np.ndarray:
        """Whether each token count of ``lengths`` is above ``max_length``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.max_length is None:
            return np.zeros(lengths.shape, dtype=bool)
        return lengths > self.max_length


def check_same_filter(others: dict[str, dict[str, Any]], config: dict[str, Any], out: str) -> None:
    """Refuse a part whose sample or length range differs from another part's in ``out``.

    Args:
        others: the settings other parts' progress files record, by file name.
        config: this part's settings (holding the keys of :data:`FILTER_DEFAULTS`).
        out: the output folder, for the message.

    Raises:
        ValueError: naming the other part's file and the settings that differ.
    """
    for name, other in sorted(others.items()):
        diff = [k for k in FILTER_DEFAULTS if other.get(k) != config[k]]
        if diff:
            theirs = ", ".join(f"{k}={other.get(k)!r}" for k in diff)
            raise ValueError(
                f"{out} holds parts prepared with other settings ({name}: {theirs}); every part "
                "of one folder must keep the same sample and length range: pass the same "
                f"{', '.join(diff)} or use another out folder"
            )


def left_out_summary(sampled_out: int, too_short: int, too_long: int, empty: int = 0) -> str:
    """The summary line's account of the documents left out, by the filters or for their empty
    text ("" when none)."""
    parts = [
        f"{n:,} {what}"
        for n, what in (
            (empty, "empty"),
            (sampled_out, "not in the sample"),
            (too_short, "too short"),
            (too_long, "too long"),
        )
        if n
    ]
    return f"; left out: {', '.join(parts)}" if parts else ""


def warn_nothing_kept(
    doc_filter: DocFilter,
    seen: int,
    files: int,
    sampled_out: int,
    too_short: int,
    too_long: int,
    stacklevel: int = 3,
) -> None:
    """Warn (for the caller of ``prepare``) that a part's inputs held ``seen`` documents but
    the filters kept none of them; ``stacklevel`` as ``warnings.warn``'s, counted from here
    (3: the caller of the function that calls this one)."""
    f = doc_filter
    warnings.warn(
        f"none of the {seen} documents of this part's {files} input file(s) was kept "
        f"({sampled_out} sampled out by data_fraction={f.data_fraction}, {too_short} shorter "
        f"than min_length={f.min_length}, {too_long} longer than max_length={f.max_length}); "
        "the part wrote no file. Raise data_fraction or widen the length range if that is not "
        "what you meant",
        UserWarning,
        stacklevel=stacklevel,
    )
