"""A batch log for training logs: which documents each row of a step held, one JSON line a step.

A trainer that asks for the ``provenance`` key (``PipelineConfig(output_keys=[...,
"provenance"])``) can log, next to its loss, what each row held, without running
``torchdata-ext batches`` later::

    log = BatchLog("batches_rank0.jsonl", cfg.datasets)
    for step, batch in enumerate(loader, 1):
        loss = train_step(batch)
        log.write(step, batch, rank=rank, loss=float(loss))

Each line is ``{"step", "rank", "rows": [[[dataset, file, doc, start, stop], ...], ...], ...}``
(the extra keyword fields as given): per row, its document pieces in row order, ``start`` ..
``stop`` the token range of document ``doc`` of file number ``file``; the specials the packer
placed are left out (``torchdata-ext batches`` shows them). :func:`batch_documents` gives the
record alone. Its cost per step is in ``docs/forensics.md`` (``benchmarks/batch_log.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

__all__ = ["BatchLog", "batch_documents"]


def batch_documents(batch: dict[str, Any], names: Sequence[str]) -> list[list[list[Any]]]:
    """Per row of ``batch``, its document pieces ``[dataset, file, doc, start, stop]``.

    Args:
        batch: a batch from the loader with its ``provenance`` (``[B, k, 5]``, tensor or array).
        names: the dataset names its provenance ids index (the config's ``datasets``, in
            order; ``Pack.dataset_names``).

    Raises:
        KeyError: the batch has no ``provenance``: add it to the config's ``output_keys``.
        ValueError: ``names`` lists fewer datasets than the provenance ids index.
    """
    if "provenance" not in batch:
        raise KeyError(
            "the batch has no 'provenance': add 'provenance' to the config's output_keys to "
            "log which documents each row holds"
        )
    prov = batch["provenance"]
    prov = np.asarray(prov.numpy() if hasattr(prov, "numpy") else prov)
    if prov.ndim == 2:  # one row (a packed sequence, not a batch)
        prov = prov[None]
    keep = (prov[..., 0] >= 0) & (prov[..., 4] > 0)
    sel = prov[keep]  # the data pieces of all rows, row after row
    label = list(names)
    if sel.size and int(sel[:, 0].max()) >= len(label):
        raise ValueError(
            f"names={label} lists {len(label)} dataset(s), but the batch's provenance holds "
            f"dataset id {int(sel[:, 0].max())}: pass every dataset of the config, in its order "
            "(cfg.datasets)"
        )
    pieces = [[label[ds], f, d, s, s + n] for ds, f, d, s, n in sel.tolist()]
    ends = np.cumsum(keep.sum(axis=1)).tolist()
    return [pieces[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


class BatchLog:
    """Append one JSON line per step to a local file: the step, the rank, each row's
    document pieces (:func:`batch_documents`) and any fields given (the loss...).

    Args:
        path: the JSONL file (appended to, so a restarted job goes on in the same file).
        names: the dataset names the batches' provenance ids index (the config's
            ``datasets``).
        flush_every: steps between flushes of the file (1: every step).
    """

    def __init__(self, path: str, names: Sequence[str], *, flush_every: int = 100) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"{flush_every=} must be an integer >= 1")
        if isinstance(names, str):  # "web,code", as the config takes them
            names = [n.strip() for n in names.split(",") if n.strip()]
        self.names = list(names)
        self.flush_every = flush_every
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._since = 0

    def write(self, step: int, batch: dict[str, Any], rank: int = 0, **fields: Any) -> None:
        """Log ``batch`` as training step ``step`` of ``rank``, with ``fields``."""
        record = {"step": int(step), "rank": int(rank), **fields}
        record["rows"] = batch_documents(batch, self.names)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._since += 1
        if self._since >= self.flush_every:
            self._file.flush()
            self._since = 0

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()

    def __enter__(self) -> BatchLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
