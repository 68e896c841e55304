"""Pieces handed back by a rescale: recorded in a reader state, then delivered as blocks.

When a job is rescaled, the documents in flight downstream of the readers (in a shuffle buffer
or a pack, cut at some token offset) are handed back to the logical shards holding them as
pieces ``(file, doc, start, stop)``. :func:`with_returned` records them in a
:class:`~torchdata_ext.nodes.reader.ShardReader` state (a shard's ``returned`` list);
the worker that then owns the shard delivers them before anything else, one file per block,
built by :func:`returned_block` (the mix downstream still cuts a long rest at row ends, so the
shares follow the weights: see :mod:`torchdata_ext.nodes.interleave`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import DocData
from torchdata_ext.order.shards import shard_bounds
from torchdata_ext.state.reader_state import cursor_state, reader_cursors

__all__ = ["returned_block", "with_returned"]


def with_returned(
    state: dict[str, Any],
    pieces: Sequence[tuple[int, int, int, int]],
    offsets: np.ndarray,
    n_logical_shards: int,
) -> dict[str, Any]:
    """A copy of reader ``state`` with ``pieces`` ``(file, doc, start, stop)`` handed back to
    the logical shards holding them; pieces of shards the state does not own are left out
    (another worker's state gets them).

    Args:
        state: a reader state.
        pieces: the in-flight pieces, by file number and document of the file.
        offsets: the dataset's first global document id per file, then the total.
        n_logical_shards: the reader's number of logical shards.
    """
    bounds = shard_bounds(int(offsets[-1]), n_logical_shards)
    view = reader_cursors(state)
    added: dict[int, list[list[int]]] = {}
    for file, doc, start, stop in pieces:
        g = int(offsets[file]) + int(doc)
        sid = int(np.searchsorted(bounds, g, side="right")) - 1
        added.setdefault(sid, []).append([int(file), int(doc), int(start), int(stop)])
    held = view.rows(np.fromiter(added, np.int64, len(added)))
    for sid, row in zip(list(added), held.tolist()):
        if row < 0:
            continue  # another new worker's shard; it reads the same old state
        ex = dict(view.extras.get(sid, {}))
        ex["returned"] = sorted([list(x) for x in ex.get("returned", [])] + added[sid])
        view.extras[sid] = ex
    return cursor_state(state, view)


def returned_block(
    dataset: str,
    file: int,
    take: Sequence[Sequence[int]],
    fetch: Callable[[int], DocData],
    *,
    shard: int,
    epoch: int,
    dtype: Any,
) -> DocumentBlock:
    """The block delivering handed-back pieces ``take`` (``[file, doc, start, stop]``, all of
    file number ``file``), each document read again with ``fetch(doc)``.

    A token piece is cut out of its document; a text piece keeps the whole text (offsets count
    the tokens of the tokenized text, and the tokenize node cuts the piece out after encoding).
    The block's ``stop`` marks the pieces as handed back, so a transform node downstream, whose
    coordinates these are, cuts them again from the transformed document.
    """
    pieces: list[Any] = []
    docs: list[int] = []
    starts: list[int] = []
    lasts: list[bool] = []
    stops: list[int] = []
    for _, doc, start, stop in take:
        data = fetch(doc)
        if isinstance(data, str):
            pieces.append(data)
            lasts.append(stop < 0)
        else:
            end = len(data) if stop < 0 else stop
            pieces.append(data[start:end])
            lasts.append(end == len(data))
        stops.append(stop)
        docs.append(doc)
        starts.append(start)
    block = DocumentBlock.from_pieces(
        dataset,
        pieces,
        [file] * len(take),
        docs,
        starts,
        lasts,
        shard=shard,
        epoch=epoch,
        dtype=dtype,
    )
    if stops:
        block.stop = np.asarray(stops, np.int64)
    return block
