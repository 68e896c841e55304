"""The collate node: packed sequences in, batches of ``torch`` tensors out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torchdata.nodes import BaseNode

from torchdata_ext.batch import (
    BOUNDARY_KEYS,
    DATASET_KEY,
    PackedBatch,
    boundaries,
    dataset_ids,
    position_starts,
    segment_starts,
)
from torchdata_ext.nodes.pack import PackedSequence
from torchdata_ext.provenance import LITERAL, PAD, PROV_COLUMNS, row_datasets

__all__ = ["Collate"]

DEFAULT_KEYS = ("input_ids", "position_ids", "document_ids", "loss_mask", "labels")
_PACKED_PROTOCOL = ("next_packed", "materialize", "materialize_batch_into")
_BOOL_KEYS = frozenset({"loss_mask"})
_MAX_DATASET_ID = int(np.iinfo(np.int16).max)


class Collate(BaseNode[dict[str, torch.Tensor]]):
    """Stack ``batch_size`` packed-sequence dicts (from :class:`~.pack.Pack`) into tensors.

    Each key becomes one C-contiguous ``[B, seq_len]`` tensor: ``loss_mask`` as ``torch.bool``,
    every other key in ``dtype`` (``provenance``: ``[B, rows, 5]`` int64), freshly allocated
    and written in place through NumPy. Inside a dataloader worker all tensors of a batch are
    views of one storage, so the worker hands the batch to the main process as one
    shared-memory segment instead of one per tensor (~0.4 ms saved per tensor per batch).

    Args:
        source: a node yielding dicts of equal-length 1-D NumPy arrays.
        batch_size: sequences per batch.
        dtype: the integer ``torch`` dtype of the token-like keys.
        drop_last: at the end of a finite source, drop a last batch smaller than
            ``batch_size`` (default: emit it).
        keys: the keys to stack. A key missing from every item of a batch is left out (so
            ``labels`` is simply absent when Pack has ``shift=False``); a key present in some
            items of a batch but not others is an error. ``"provenance"`` (dropped unless
            listed) comes out as ``int64`` ``[B, k_max, 5]``, shorter tables filled with rows of
            length 0 (``[LITERAL, 0, 0, 0, 0]``, which read as no tokens: drop them with
            ``prov[prov[:, 4] > 0]`` before ``Pack.rebuild``). The document boundaries for
            variable-length attention, ``seq_lens`` / ``cu_seqlens`` / ``max_seqlen``
            (int32, see :func:`~torchdata_ext.batch.boundaries`), come from the runs Pack
            emitted (a source of dicts: from their ``position_ids``, a segment starting where
            they are 0); they cost nothing when not listed. ``"dataset_ids"`` (int16
            ``[B, seq_len]``, see :func:`~torchdata_ext.batch.dataset_ids`): each token's
            dataset, from the items' provenance (following ``labels`` with ``shift``; -1 on
            padding and line specials), for a loss per dataset.
        dataset_names: the names the items' provenance dataset ids index (``Pack``'s
            ``dataset_names``); given, Collate counts the document tokens it delivered per
            dataset (document rows of the provenance; BOS/EOS and padding left out, as the
            audit counts tokens) in its state, which the loader and the audit read for the
            mix per segment of a weight schedule (:mod:`torchdata_ext.loader.mix_history`).

    State: ``{"source": <upstream state>}``, with ``dataset_names`` also ``"delivered"``:
    ``{name: tokens}`` delivered by this node since it started fresh (None: items came without
    provenance, so the count stopped; a state without the key, saved before this count
    existed, restores with the count at 0). A batch is built within one call, so between calls
    the upstream sits at a batch boundary. Resume guarantee: restoring continues with exactly
    the batches the uninterrupted run would have produced.

    A source with ``next_packed`` / ``materialize`` / ``materialize_batch_into`` (a
    :class:`~.pack.Pack`, or a :class:`~.shuffle.ShuffleBuffer` over one) is read in its
    packed form and each sequence is written straight into the batch arrays (the same batch,
    without making each sequence's dict first).
    """

    SOURCE_KEY = "source"
    DELIVERED_KEY = "delivered"

    def __init__(
        self,
        source: BaseNode,
        batch_size: int,
        *,
        dtype: torch.dtype = torch.int64,
        drop_last: bool = False,
        keys: Sequence[str] = DEFAULT_KEYS,
        dataset_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(
                f"source must be a torchdata.nodes.BaseNode (got {type(source).__name__}); "
                "pass the Pack node"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"batch_size={batch_size!r} must be an integer")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"dtype={dtype!r} must be an integer torch dtype such as torch.int64")
        if dtype == torch.bool:
            raise TypeError(f"dtype={dtype!r} must be an integer torch dtype such as torch.int64")
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys) or not keys:
            raise TypeError(f"keys={keys!r} must be a non-empty sequence of key names")
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last={drop_last!r} must be True or False")
        self.source = source
        self.batch_size = int(batch_size)
        self.dtype = dtype
        self.drop_last = bool(drop_last)
        self.keys = tuple(keys)
        self.dataset_names = None if dataset_names is None else [str(n) for n in dataset_names]
        self._delivered: np.ndarray | None = np.zeros(len(self.dataset_names or ()), np.int64)
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        protocol = [getattr(source, m, None) for m in _PACKED_PROTOCOL]
        self._fused = all(callable(m) for m in protocol)
        self._pull: Callable[[], Any] = (
            protocol[0] if self._fused else self._next_source  # type: ignore[assignment]
        )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._delivered = np.zeros(len(self.dataset_names or ()), np.int64)
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            # by name; a state saved before the count existed has none: counted from here
            saved = initial_state.get(self.DELIVERED_KEY, {})
            if saved is None:  # the count had stopped (items without provenance)
                self._delivered = None
            else:
                for i, name in enumerate(self.dataset_names or ()):
                    self._delivered[i] = int(saved.get(name, 0))
        else:
            self.source.reset()

    def _count(self, tables: list[Any]) -> None:
        """Add the document tokens of a batch's provenance ``tables`` to the count (per row,
        NumPy: never per token)."""
        if self.dataset_names is None or self._delivered is None:
            return
        if any(t is None for t in tables):  # items without provenance: the count stops
            self._delivered = None
            return
        try:
            rows = np.concatenate(tables)  # Pack's tables: (k, PROV_COLUMNS) int64 each
        except ValueError:
            rows = np.empty((0, 0))
        if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape[1] != PROV_COLUMNS:
            rows = np.concatenate(
                [np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS) for t in tables]
            )
        n = len(self._delivered)  # a batch's sums are far below 2**53: exact in float64
        ds = rows[:, 0] - PAD  # the specials' rows (LITERAL, PAD < 0) count in bins 0 .. -PAD
        try:
            counts = np.bincount(ds, rows[:, 4], n - PAD)
        except ValueError:  # a code below PAD: none is written, but count documents only
            keep = ds >= -PAD
            counts = np.bincount(ds[keep], rows[keep, 4], n - PAD)
        self._delivered += counts[-PAD : n - PAD].astype(np.int64)

    def next(self) -> dict[str, torch.Tensor]:
        items = self._take()
        if self._fused and all(isinstance(it, PackedSequence) for it in items):
            return self._fill(items)
        return self._from_items(items)

    def _from_items(self, items: list[Any]) -> dict[str, torch.Tensor]:
        """The batch of items that are dicts (or, from a packed source, anything it
        materializes)."""
        if self._fused:
            items = [self.source.materialize(it) for it in items]
        if self.dataset_names is not None:
            self._count([it.get("provenance") if isinstance(it, dict) else None for it in items])
        out: dict[str, np.ndarray] = {}
        for key in self.keys:
            present = [key in item for item in items]
            if not any(present):
                continue
            if not all(present):
                raise KeyError(
                    f"item {present.index(False)} of the batch has no {key!r} but item "
                    f"{present.index(True)} has; all items of a batch must have the same keys"
                )
            if key == "provenance":
                out[key] = _stack_provenance([it[key] for it in items])
                continue
            if key not in BOUNDARY_KEYS:
                out[key] = self._stack(key, [it[key] for it in items])
        if any(k in self.keys for k in BOUNDARY_KEYS):
            out.update(self._boundaries_of_dicts(items))
        if DATASET_KEY in self.keys:
            out[DATASET_KEY] = self._datasets_of_dicts(items)
        if get_worker_info() is None:
            return {k: torch.from_numpy(a) for k, a in out.items()}
        arrays, tensors = _one_storage({k: (a.shape, a.dtype) for k, a in out.items()})
        for k, a in out.items():  # into one storage, to leave the worker as one segment
            arrays[k][...] = a
        return tensors

    def get_state(self) -> dict[str, Any]:
        state = {self.SOURCE_KEY: self.source.state_dict()}
        if self.dataset_names is not None:  # a new dict each time: states are never mutated
            counts = self._delivered
            state[self.DELIVERED_KEY] = (
                None
                if counts is None
                else dict(zip(self.dataset_names, counts.tolist(), strict=True))
            )
        return state

    def next_packed_batch(
        self, out: torch.Tensor | None = None
    ) -> PackedBatch | dict[str, torch.Tensor]:
        """The next batch in its compact form (:class:`~torchdata_ext.batch.PackedBatch`: one
        token tensor plus the document runs), which ``to_tensors()`` turns into exactly what
        :meth:`next` returns. What a dataloader worker sends: the training process builds the
        keys. A source without the packed protocol gives :meth:`next`'s dict.

        ``out``: a ``[batch_size, size]`` tensor of this node's dtype to write the tokens into
        (the worker's shared-memory ring slot, saving a copy); a batch of another shape (the
        short last batch) gets a new tensor instead."""
        if not self._fused:
            return self.next()
        items = self._take()
        if not all(isinstance(it, PackedSequence) for it in items):
            return self._from_items(items)
        size = len(items[0].tokens)
        for i, item in enumerate(items):
            if len(item.tokens) != size:
                raise ValueError(
                    f"item {i} packs {len(item.tokens)} tokens but item 0 packs {size}; "
                    "Collate stacks sequences of one length"
                )
        if out is not None and tuple(out.shape) == (len(items), size) and out.dtype == self.dtype:
            held = out
        else:
            held = torch.from_numpy(np.empty((len(items), size), self._np_dtype))
        tokens = held.numpy()
        for i, item in enumerate(items):
            tokens[i] = item.tokens
        counts = np.fromiter((len(it.cuts) for it in items), np.int32, len(items))
        row_runs = np.zeros(len(items) + 1, np.int32)
        np.cumsum(counts, out=row_runs[1:])
        produced = tuple(self.source.output_keys)
        keys = tuple(k for k in self.keys if k in produced or k in _BUILT_KEYS)
        tables = [it.provenance for it in items]
        self._count(tables)
        return PackedBatch(
            held,
            np.fromiter(
                (c + i * size for i, it in enumerate(items) for c in it.cuts),
                np.int32,
                int(row_runs[-1]),
            ),
            np.fromiter((d for it in items for d in it.ids), np.int32, int(row_runs[-1])),
            row_runs,
            np.array([it.pad for it in items], np.int32).reshape(len(items), 2),
            size - ("labels" in produced),
            "labels" in produced,
            keys,
            _stack_provenance(tables) if "provenance" in keys else None,
            _dataset_runs(tables) if DATASET_KEY in keys else None,
        )

    def _take(self) -> list[Any]:
        """The next batch's items from the source (``StopIteration`` when there is none)."""
        items: list[Any] = []
        for _ in range(self.batch_size):
            try:
                items.append(self._pull())
            except StopIteration:
                break
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        return items

    def _next_source(self) -> Any:
        return next(self.source)

    def _fill(self, items: list[PackedSequence]) -> dict[str, torch.Tensor]:
        """The batch of packed sequences, each written straight into the batch arrays."""
        produced = tuple(self.source.output_keys)
        width = len(items[0].tokens) - ("labels" in produced)
        for i, item in enumerate(items):
            if len(item.tokens) - ("labels" in produced) != width:
                raise ValueError(
                    f"item {i} packs {len(item.tokens)} tokens but item 0 packs "
                    f"{len(items[0].tokens)}; Collate stacks sequences of one length"
                )
        bounds: dict[str, np.ndarray] = {}
        if any(k in self.keys for k in BOUNDARY_KEYS):
            size = len(items[0].tokens)
            cuts = np.fromiter(
                (c + i * size for i, it in enumerate(items) for c in it.cuts), np.int64
            )
            bounds = boundaries(segment_starts(cuts, size, width), len(items), width, self.keys)
        specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for key in self.keys:
            if key == "provenance" and key in produced:
                rows = max(len(it.provenance) for it in items)
                specs[key] = ((len(items), rows, PROV_COLUMNS), np.dtype(np.int64))
            elif key in bounds:
                specs[key] = (bounds[key].shape, bounds[key].dtype)
            elif key == DATASET_KEY:
                specs[key] = ((len(items), width), np.dtype(np.int16))
            elif key in produced:
                dt = np.dtype(bool) if key in _BOOL_KEYS else self._np_dtype
                specs[key] = ((len(items), width), dt)
        arrays, tensors = _one_storage(specs)
        self._count([it.provenance for it in items])
        built = {"provenance", DATASET_KEY, *bounds}
        self.source.materialize_batch_into(
            items, {k: a for k, a in arrays.items() if k not in built}
        )
        if DATASET_KEY in arrays:
            runs = _dataset_runs([it.provenance for it in items])
            size = len(items[0].tokens)
            dataset_ids(runs, len(items), size, width, "labels" in produced, arrays[DATASET_KEY])
        if "provenance" in arrays:
            _stack_provenance([it.provenance for it in items], out=arrays["provenance"])
        for key, a in bounds.items():
            arrays[key][...] = a
        return tensors

    def _boundaries_of_dicts(self, items: list[Any]) -> dict[str, np.ndarray]:
        """The boundary keys of a batch of dicts, from their ``position_ids``."""
        if not all("position_ids" in it for it in items):
            raise KeyError(
                f"keys={self.keys!r} asks for document boundaries, which Collate reads from "
                "each item's 'position_ids' (0 where a document starts); this source gives "
                "items without it: collate Pack's output"
            )
        pos = self._stack("position_ids", [it["position_ids"] for it in items])
        return boundaries(position_starts(pos), len(pos), pos.shape[1], self.keys)

    def _datasets_of_dicts(self, items: list[Any]) -> np.ndarray:
        """The ``dataset_ids`` of a batch of dicts, from their ``provenance``."""
        if not all("provenance" in it and "input_ids" in it for it in items):
            raise KeyError(
                f"keys={self.keys!r} asks for 'dataset_ids', which Collate reads from each "
                "item's 'provenance' (and 'input_ids'); this source gives items without them: "
                "collate Pack's output"
            )
        tables = [np.asarray(it["provenance"], np.int64).reshape(-1, PROV_COLUMNS) for it in items]
        sizes = {int(t[:, 4].sum()) for t in tables}
        if len(sizes) != 1:
            raise ValueError(
                f"the items' provenance covers {sorted(sizes)} tokens; Collate stacks "
                "sequences of one length"
            )
        n = len(items[0]["input_ids"])
        shift = "labels" in items[0]
        return dataset_ids(_dataset_runs(tables), len(items), sizes.pop(), n, shift)

    def _stack(self, key: str, arrays: list[np.ndarray]) -> np.ndarray:
        width = len(arrays[0])
        dt = np.dtype(bool) if key in _BOOL_KEYS else self._np_dtype
        buf = np.empty((len(arrays), width), dt)
        checked = dt  # a source dtype already found castable
        for i, a in enumerate(arrays):
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            if a.ndim != 1 or len(a) != width:
                raise ValueError(
                    f"item {i} has {key!r} of shape {np.shape(a)} but item 0 has ({width},); "
                    "Collate stacks 1-D arrays of one length (the Pack's seq_len)"
                )
            if a.dtype != checked:
                if not np.can_cast(a.dtype, dt, "same_kind"):
                    raise TypeError(
                        f"item {i} has {key!r} of dtype {a.dtype}, which cannot be cast to "
                        f"{dt} with casting='same_kind'"
                    )
                checked = a.dtype
            buf[i] = a  # a row copy each: cheaper than np.stack for a few long rows
        return buf


def _one_storage(
    specs: dict[str, tuple[tuple[int, ...], np.dtype]],
) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """New arrays of the given shapes and dtypes: the NumPy arrays to write them through, and
    the tensors sharing their memory. Inside a dataloader worker they are laid out in one
    ``torch`` storage (each 8-byte aligned), sent to the main process as one shared-memory
    segment; in the main process each is its own array (cheaper to make)."""
    if get_worker_info() is None:
        arrays = {key: np.empty(shape, dt) for key, (shape, dt) in specs.items()}
        return arrays, {key: torch.from_numpy(a) for key, a in arrays.items()}
    starts, end = {}, 0
    for key, (shape, dt) in specs.items():
        starts[key] = end
        end += -(-int(np.prod(shape, dtype=np.int64)) * dt.itemsize // 8) * 8
    flat = torch.empty(end, dtype=torch.uint8)
    raw = flat.numpy()
    arrays, tensors = {}, {}
    for key, (shape, dt) in specs.items():
        a = starts[key]
        b = a + int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        arrays[key] = raw[a:b].view(dt).reshape(shape)
        tensors[key] = flat[a:b].view(_TORCH_DTYPES[dt]).view(shape)
    return arrays, tensors


_TORCH_DTYPES = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    **{
        np.dtype(f"uint{bits}"): getattr(torch, f"uint{bits}")
        for bits in (16, 32, 64)
        if hasattr(torch, f"uint{bits}")
    },
}


_BUILT_KEYS = frozenset({*BOUNDARY_KEYS, DATASET_KEY})  # built from the runs, not Pack's keys


def _dataset_runs(tables: list[np.ndarray]) -> np.ndarray:
    """``[R, 2]`` int32 ``(dataset id, tokens)``, one per provenance row of ``tables`` laid
    end to end (what :func:`~torchdata_ext.batch.dataset_ids` spreads over the tokens)."""
    rows = np.concatenate([np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS) for t in tables])
    owner = row_datasets(rows)
    if len(owner) and int(owner.max()) > _MAX_DATASET_ID:
        raise ValueError(
            f"dataset id {int(owner.max())} does not fit 'dataset_ids' (int16, at most "
            f"{_MAX_DATASET_ID} datasets); drop 'dataset_ids' from output_keys"
        )
    runs = np.empty((len(rows), 2), np.int32)
    runs[:, 0] = owner
    runs[:, 1] = rows[:, 4]
    return runs


def _stack_provenance(tables: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    rows = [np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS) for t in tables]
    if out is None:
        out = np.empty((len(rows), max(len(r) for r in rows), PROV_COLUMNS), np.int64)
    out[...] = 0
    out[:, :, 0] = LITERAL
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
