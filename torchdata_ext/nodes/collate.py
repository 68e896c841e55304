"""The collate node: packed sequences in, batches of ``torch`` tensors out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from torchdata_ext.provenance import LITERAL, PROV_COLUMNS

__all__ = ["Collate"]

DEFAULT_KEYS = ("input_ids", "position_ids", "document_ids", "loss_mask", "labels")
_BOOL_KEYS = frozenset({"loss_mask"})


class Collate(BaseNode[dict[str, torch.Tensor]]):
    """Stack ``batch_size`` packed-sequence dicts (from :class:`~.pack.Pack`) into tensors.

    Each key becomes one ``[B, seq_len]`` tensor made with ``torch.from_numpy`` over one freshly
    allocated, C-contiguous NumPy array the rows are stacked into (zero-copy, ready for
    ``pin_memory``): ``loss_mask`` as ``torch.bool``, every other key in ``dtype``.

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
            ``prov[prov[:, 4] > 0]`` before ``Pack.rebuild``).

    State: ``{"source": <upstream state>}``. A batch is built within one call, so between calls
    the upstream sits at a batch boundary. Resume guarantee: restoring continues with exactly
    the batches the uninterrupted run would have produced.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode,
        batch_size: int,
        *,
        dtype: torch.dtype = torch.int64,
        drop_last: bool = False,
        keys: Sequence[str] = DEFAULT_KEYS,
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
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()

    def next(self) -> dict[str, torch.Tensor]:
        items: list[dict[str, Any]] = []
        for _ in range(self.batch_size):
            try:
                items.append(next(self.source))
            except StopIteration:
                break
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        out: dict[str, Any] = {}
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
                out[key] = torch.from_numpy(_stack_provenance([it[key] for it in items]))
                continue
            out[key] = torch.from_numpy(self._stack(key, [it[key] for it in items]))
        return out

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def _stack(self, key: str, arrays: list[np.ndarray]) -> np.ndarray:
        width = len(arrays[0])
        for i, a in enumerate(arrays):
            if np.ndim(a) != 1 or len(a) != width:
                raise ValueError(
                    f"item {i} has {key!r} of shape {np.shape(a)} but item 0 has ({width},); "
                    "Collate stacks 1-D arrays of one length (the Pack's seq_len)"
                )
        dt = np.dtype(bool) if key in _BOOL_KEYS else self._np_dtype
        buf = np.empty((len(arrays), width), dt)
        np.stack(arrays, out=buf, casting="same_kind")
        return buf


def _stack_provenance(tables: list[np.ndarray]) -> np.ndarray:
    rows = [np.asarray(t, np.int64).reshape(-1, PROV_COLUMNS) for t in tables]
    out = np.zeros((len(rows), max(len(r) for r in rows), PROV_COLUMNS), np.int64)
    out[:, :, 0] = LITERAL
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
