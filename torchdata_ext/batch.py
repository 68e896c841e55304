"""The packed batch: what crosses from a dataloader worker to the training process.

A batch of packed sequences is fully described by its tokens and where its documents start:
``position_ids``, ``document_ids`` and ``loss_mask`` are functions of the document runs, and
``input_ids`` / ``labels`` are the first and last ``L`` columns of one ``[B, L + 1]`` token array
(with ``shift``). So a worker ships a :class:`PackedBatch`: one token tensor plus the runs (a few hundred
int32s), about a quarter of the bytes of the five ``[B, L]`` tensors, and the training
process builds only the keys it was asked for (:meth:`PackedBatch.to_tensors`).

Several batches travel as one :class:`BatchGroup` (one token tensor ``[G, B, L + 1]``): a
dataloader message costs ~1 ms (a shared-memory segment and a file descriptor), so grouping
spreads it over ``G`` batches.

Runs: row ``i``'s runs are ``cuts[row_runs[i]:row_runs[i + 1]]`` (offsets into the batch's
tokens laid end to end, ``i * size`` where row ``i`` starts, where a run starts) with the run's document index ``ids[...]`` in the sequence (-1 for
padding and line specials); ``pad[i] = (lo, hi)`` is the padding of row ``i`` (``lo == hi``:
none). See :class:`~torchdata_ext.nodes.pack.Pack` for what the keys mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "ALL_KEYS",
    "BOUNDARY_KEYS",
    "DATASET_KEY",
    "HF_KEYS",
    "BatchGroup",
    "PackedBatch",
    "boundaries",
    "dataset_ids",
    "layout_runs",
    "loss_mask",
    "position_starts",
    "segment_starts",
]

BOUNDARY_KEYS = ("seq_lens", "cu_seqlens", "max_seqlen")
"""The document-boundary keys (see :func:`boundaries`), built only when asked for."""
DATASET_KEY = "dataset_ids"
"""The key of each token's dataset (see :func:`dataset_ids`), built only when asked for."""
ALL_KEYS = (
    "input_ids",
    "position_ids",
    "document_ids",
    "loss_mask",
    "labels",
    *BOUNDARY_KEYS,
    DATASET_KEY,
)
HF_KEYS = ("input_ids", "labels", "position_ids")  # a causal LM with packed attention


def layout_runs(
    cuts: np.ndarray,
    ids: np.ndarray,
    rows: int,
    size: int,
    n: int,
    out: dict[str, np.ndarray],
    arange: np.ndarray | None = None,
) -> None:
    """Write ``position_ids`` / ``document_ids`` (whichever ``out`` has, ``[rows, n]``) of
    ``rows`` packed rows of ``size`` tokens laid end to end.

    Args:
        cuts: flat token offsets (int32, into the ``rows * size`` tokens) where runs start;
            row ``i``'s first run starts at ``i * size``.
        ids: each run's document index in its row (-1: padding or a line special).
        rows: the number of rows.
        size: tokens packed per row (``seq_len + 1`` with shift).
        n: the output width (``seq_len``): the first ``n`` of each row's ``size`` tokens.
        out: the arrays to fill.
        arange: ``np.arange(>= rows * size, dtype=np.int32)`` if the caller keeps one.
    """
    total = rows * size
    if arange is None:
        arange = _arange(total)
    lens = np.empty(len(cuts), np.int32)
    np.subtract(cuts[1:], cuts[:-1], out=lens[:-1])
    lens[-1] = total - cuts[-1]
    if "position_ids" in out:
        flat = cuts.repeat(lens)
        np.subtract(arange[:total], flat, out=flat)
        out["position_ids"][...] = flat.reshape(rows, size)[:, :n]
    if "document_ids" in out:
        flat = ids.repeat(lens)
        out["document_ids"][...] = flat.reshape(rows, size)[:, :n]


def boundaries(flat: np.ndarray, rows: int, n: int, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The document boundaries of a batch, for variable-length attention: the keys of
    :data:`BOUNDARY_KEYS` that ``keys`` names.

    A row is cut into *segments*, the runs Pack emitted: each document's run in the row (what
    one ``document_ids`` value covers, where ``position_ids`` count from 0), and, each a segment
    of its own, the line specials ``bol`` / ``eol`` and the padding (``document_ids`` -1). The
    segments of a row tile its ``L`` input tokens; with ``shift`` the boundaries are those of
    ``input_ids`` (``labels[t]`` at a segment's last token is the first token of the next
    segment, as ``loss_mask`` has always left it).

    * ``seq_lens``: int32 ``[B, S]``, row ``i``'s segment lengths in order, then zeros
      (``S``: the most segments of a row in this batch); each row's lengths sum to ``L``;
    * ``cu_seqlens``: int32 ``[N + 1]``, the cumulative lengths of all ``N`` segments of the
      batch flattened row by row (``0 .. B * L``), flash-attention's varlen layout;
    * ``max_seqlen``: int32 0-d, the longest segment (``int(batch["max_seqlen"])``).

    Args:
        flat: where the segments start: increasing offsets into the ``rows * n`` tokens laid
            end to end, every ``i * n`` among them (:func:`segment_starts`,
            :func:`position_starts`).
        rows: ``B``, the rows of the batch.
        n: ``L``, tokens per row.
        keys: the keys wanted (others are ignored).
    """
    cu = np.empty(len(flat) + 1, np.int32)
    cu[:-1] = flat
    cu[-1] = rows * n
    lens = np.diff(cu)
    out: dict[str, np.ndarray] = {}
    if "seq_lens" in keys:
        counts = np.bincount(cu[:-1] // max(n, 1), minlength=rows)
        width = int(counts.max()) if rows else 0
        seq = np.zeros((rows, width), np.int32)
        seq[np.arange(width) < counts[:, None]] = lens
        out["seq_lens"] = seq
    if "cu_seqlens" in keys:
        out["cu_seqlens"] = cu
    if "max_seqlen" in keys:
        out["max_seqlen"] = np.array(lens.max() if len(lens) else 0, np.int32)
    return out


def dataset_ids(
    runs: np.ndarray,
    rows: int,
    size: int,
    n: int,
    shift: bool,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``dataset_ids``: int16 ``[B, L]``, the dataset of each token, for a loss per dataset.

    The value is an index into the datasets in the config's order
    (``TokenLoader.dataset_names``); -1 where the token belongs to no dataset: padding, the
    line specials ``bol`` / ``eol``, and separators that name no document. A BOS / EOS the
    packer placed counts for the document it opens or closes.

    With ``shift`` the ids follow ``labels``: ``dataset_ids[b, t]`` is the dataset of
    ``labels[b, t]``, the token the model predicts at position ``t``, so
    ``loss[dataset_ids == k]`` is dataset ``k``'s loss (-1 wherever ``labels`` is padding,
    so ``dataset_ids >= 0`` implies ``loss_mask``). Without ``shift`` they follow
    ``input_ids`` (each token's own dataset): a loss on next-token predictions uses
    ``dataset_ids[:, 1:]``, shifted like the labels.

    Args:
        runs: ``[R, 2]`` integer ``(dataset id, tokens)`` pairs that tile the ``rows * size``
            packed tokens laid end to end (one per provenance row, in order).
        rows: ``B``, the rows of the batch.
        size: tokens packed per row (``L + 1`` with ``shift``).
        n: ``L``, tokens per output row.
        shift: whether ``labels`` are the packed tokens ``[1:]``.
        out: an int16 ``[rows, n]`` array to write into (default: a new one).
    """
    runs = np.asarray(runs).reshape(-1, 2)
    flat = runs[:, 0].astype(np.int16).repeat(runs[:, 1])
    if len(flat) != rows * size:
        raise ValueError(
            f"the dataset runs cover {len(flat)} tokens but the batch packs {rows} x {size}; "
            "give one (dataset id, tokens) pair per provenance row of every sequence"
        )
    grid = flat.reshape(rows, size)
    part = grid[:, size - n :] if shift else grid[:, :n]
    if out is None:
        return np.ascontiguousarray(part)
    out[...] = part
    return out


def segment_starts(cuts: np.ndarray, size: int, n: int) -> np.ndarray:
    """Where the segments of :func:`boundaries` start, from run starts ``cuts`` (increasing
    offsets into rows of ``size`` tokens laid end to end, see :func:`layout_runs`): the runs
    that start in a row's first ``n`` tokens, as offsets into rows of ``n`` laid end to end."""
    row, at = np.divmod(np.asarray(cuts, np.int64), size)
    keep = at < n
    return row[keep] * n + at[keep]


def position_starts(position_ids: np.ndarray) -> np.ndarray:
    """Where the segments of :func:`boundaries` start, from Pack's ``position_ids``
    ``[B, L]`` (a run's positions count from 0 at its start; column 0 always starts one), as
    offsets into the ``B * L`` tokens laid end to end."""
    starts = np.asarray(position_ids) == 0
    starts[:, 0] = True
    return np.flatnonzero(starts)


def loss_mask(pad: np.ndarray, n: int, shift: bool) -> np.ndarray:
    """``[B, n]`` bool: False on padding (with ``shift``: where the input or the label is)."""
    mask = np.ones((len(pad), n), bool)
    for i in np.flatnonzero(pad[:, 1] > pad[:, 0]):
        lo, hi = int(pad[i, 0]), int(pad[i, 1])
        mask[i, max(lo - 1, 0) if shift else lo : hi] = False
    return mask


_NUMPY_DTYPES = {
    t: torch.empty(0, dtype=t).numpy().dtype
    for t in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
}
_ARANGE = np.arange(0, dtype=np.int32)


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int32) from a shared array grown as needed (read-only use)."""
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int32)
    return _ARANGE[:n]


@dataclass
class PackedBatch:
    """One batch of packed sequences in its compact form.

    Attributes:
        tokens: ``[B, size]`` token tensor (``size = seq_len + 1`` with shift).
        cuts: run starts (int32, flat over rows): offsets into the rows laid end to end.
        ids: each run's document index in its row (int32, flat).
        row_runs: ``[B + 1]`` offsets of each row's runs in ``cuts`` / ``ids``.
        pad: ``[B, 2]`` padding range per row.
        seq_len: output width ``L``.
        shift: ``labels`` are ``tokens[:, 1:]``.
        keys: the keys :meth:`to_tensors` builds.
        provenance: ``[B, k, 5]`` int64 provenance, when asked for.
        datasets: ``[R, 2]`` int32 ``(dataset id, tokens)`` runs tiling the batch's tokens
            (see :func:`dataset_ids`), when ``dataset_ids`` is asked for.
    """

    tokens: torch.Tensor
    cuts: np.ndarray
    ids: np.ndarray
    row_runs: np.ndarray
    pad: np.ndarray
    seq_len: int
    shift: bool
    keys: tuple[str, ...]
    provenance: np.ndarray | None = None
    datasets: np.ndarray | None = None

    def to_tensors(self, *, own: bool = False, pin: bool = False) -> dict[str, torch.Tensor]:
        """The batch as the model consumes it, only the keys in :attr:`keys`, each a
        C-contiguous ``[B, L]`` tensor as on every other path (``labels.view(-1)`` works):
        ``input_ids`` and ``labels`` are copied out of :attr:`tokens` (views of it would have
        stride ``L + 1``), the other keys are built here.

        Args:
            own: copy ``input_ids`` / ``labels`` even where a view would be contiguous (a
                one-row batch): :attr:`tokens` is memory that will be written again (a
                ring slot).
            pin: put ``input_ids`` / ``labels`` in pinned memory (also done when
                :attr:`tokens` is pinned).
        """
        n, keys = self.seq_len, self.keys
        rows, size = self.tokens.shape
        out: dict[str, torch.Tensor] = {}
        if "input_ids" in keys:
            out["input_ids"] = _contiguous(self.tokens[:, :n], own, pin)
        if "labels" in keys and self.shift:
            out["labels"] = _contiguous(self.tokens[:, 1:], own, pin)
        arrays: dict[str, np.ndarray] = {}
        dt = _NUMPY_DTYPES.get(self.tokens.dtype)
        if dt is None:
            dt = torch.empty(0, dtype=self.tokens.dtype).numpy().dtype
        for key in ("position_ids", "document_ids"):
            if key in keys:
                arrays[key] = np.empty((rows, n), dt)
        if arrays:
            layout_runs(self.cuts, self.ids, rows, size, n, arrays)
        if "loss_mask" in keys:
            arrays["loss_mask"] = loss_mask(self.pad, n, self.shift)
        for key in keys:
            if key in arrays:
                out[key] = torch.from_numpy(arrays[key])
        if self.provenance is not None and "provenance" in keys:
            out["provenance"] = torch.from_numpy(self.provenance)
        if self.datasets is not None and DATASET_KEY in keys:
            ids = dataset_ids(self.datasets, rows, size, n, self.shift)
            out[DATASET_KEY] = torch.from_numpy(ids)
        if any(k in keys for k in BOUNDARY_KEYS):
            flat = segment_starts(self.cuts, size, n)
            for key, a in boundaries(flat, rows, n, keys).items():
                out[key] = torch.from_numpy(a)
        return {k: out[k] for k in keys if k in out}


def _contiguous(part: torch.Tensor, own: bool = False, pin: bool = False) -> torch.Tensor:
    """``part`` (columns of a token tensor) as a C-contiguous tensor, pinned if its base is
    (or ``pin``): a NumPy copy (no intra-op threads next to the training step) unless it
    already is contiguous and not ``own`` (always copy)."""
    if part.is_contiguous() and not own and (part.is_pinned() or not pin):
        return part
    out = torch.empty(part.shape, dtype=part.dtype, pin_memory=pin or part.is_pinned())
    try:
        np.copyto(out.numpy(), part.numpy())
    except TypeError:  # a dtype NumPy does not have
        out.copy_(part)
    return out


@dataclass
class BatchGroup:
    """Several :class:`PackedBatch` es of one shape sent together: ``tokens`` is
    ``[G, B, size]`` (one shared-memory segment), the runs are concatenated."""

    tokens: torch.Tensor
    cuts: list[np.ndarray]
    ids: list[np.ndarray]
    row_runs: list[np.ndarray]
    pad: list[np.ndarray]
    provenance: list[np.ndarray | None]
    seq_len: int
    shift: bool
    keys: tuple[str, ...]
    slot: int | None = None  # the worker's TokenRing slot holding ``tokens`` (see loader)
    datasets: list[np.ndarray | None] | None = None  # per batch, PackedBatch.datasets

    @staticmethod
    def can_group(items: Sequence[Any]) -> bool:
        """Whether ``items`` are packed batches of one token shape and dtype."""
        if not items or not all(isinstance(x, PackedBatch) for x in items):
            return False
        t = items[0].tokens
        return all(x.tokens.shape == t.shape and x.tokens.dtype == t.dtype for x in items)

    @classmethod
    def of(
        cls, items: Sequence[PackedBatch], out: torch.Tensor | None = None, slot: int | None = None
    ) -> BatchGroup:
        """The batches' tokens copied into one tensor: ``out`` (``[len(items), B, size]``,
        e.g. a :class:`~torchdata_ext.loader.ring.TokenRing` view, then ``slot`` names it) or a
        new one. A batch whose tokens already are ``out[i]`` (Collate wrote them there) is not
        copied."""
        first = items[0]
        if out is None:
            out = torch.empty((len(items), *first.tokens.shape), dtype=first.tokens.dtype)
        dest = out.numpy()  # NumPy copies: no intra-op threads in a worker's hot path
        for i, x in enumerate(items):
            if x.tokens.data_ptr() != out[i].data_ptr():
                dest[i] = x.tokens.numpy()
        return cls(
            out,
            [x.cuts for x in items],
            [x.ids for x in items],
            [x.row_runs for x in items],
            [x.pad for x in items],
            [x.provenance for x in items],
            first.seq_len,
            first.shift,
            first.keys,
            slot,
            [x.datasets for x in items],
        )

    def __getstate__(self) -> dict[str, Any]:
        # the tokens cross a process boundary as a NumPy array, in the message's bytes: a
        # torch tensor would go through a shared-memory segment whose file descriptor the
        # receiver fetches over a socket from the sender (~1 ms a message, on both sides)
        # tokens in a ring slot do not travel at all: the receiver reads them from the slot
        state = dict(self.__dict__)
        state["tokens"] = None if self.slot is not None else self.tokens.numpy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.setdefault("slot", None)
        state.setdefault("datasets", None)
        if state["tokens"] is not None:
            state["tokens"] = torch.from_numpy(state["tokens"])
        self.__dict__.update(state)

    def pin_memory(self) -> BatchGroup:
        """The group with its token tensor in pinned memory (what the dataloader's
        ``pin_memory=True`` calls); a group whose tokens are in a ring slot is pinned when
        its batches are copied out of it (see ``TokenLoader``)."""
        if self.tokens is None:
            return self
        return dataclasses.replace(self, tokens=self.tokens.pin_memory())

    def split(self) -> list[PackedBatch]:
        """The batches again; their tokens are views of :attr:`tokens`."""
        if self.tokens is None:  # received with its tokens in a ring slot, not attached yet
            raise RuntimeError(
                f"this group's tokens are in ring slot {self.slot} of the worker that sent it; "
                "set group.tokens from that TokenRing (TokenLoader does) before split()"
            )
        return [
            PackedBatch(
                self.tokens[i],
                self.cuts[i],
                self.ids[i],
                self.row_runs[i],
                self.pad[i],
                self.seq_len,
                self.shift,
                self.keys,
                self.provenance[i],
                None if self.datasets is None else self.datasets[i],
            )
            for i in range(len(self.cuts))
        ]
