"""The epoch of each document piece a ``skip_steps`` range dropped, for the audit.

A skipped piece is recorded as ``[dataset, file, doc, start, length, epoch]``: ``epoch`` is
the latest epoch in which its document had been consumed when the range ended, from the
producing worker's consistent cut (:func:`~torchdata_ext.nodes.graph_cut.live_cut`: its
readers' live cursors, after everything they handed out). That is the rule the audit uses
for a piece in flight (:mod:`torchdata_ext.audit.report`), so the audit can tell a document
skipped in epoch 1 and in flight again in epoch 2 from one whose other pieces of the same
pass are still in flight. A piece recorded before this (five fields) has no epoch: the audit
reads it as of the pass in flight, as it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.nodes.graph_cut import live_cut
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.order.shard_walk import latest_epochs
from torchdata_ext.order.shards import file_offsets
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.state.reader_state import reader_cursors

__all__ = ["UNKNOWN_EPOCH", "piece_epochs", "stamp_epochs"]

UNKNOWN_EPOCH = -2
"""The epoch of a skipped piece whose shard the producing worker no longer reads."""


def stamp_epochs(root: BaseNode, graph_state: dict[str, Any], pieces: list[list[Any]]) -> None:
    """Append its epoch to each piece ``[dataset, file, doc, start, length]`` (in place), from
    one worker's freshly built graph ``root`` restored to its ``graph_state`` and cut."""
    readers, _, _ = live_cut(root, graph_state)
    nodes: dict[str, ShardReader] = {}
    for n in graph_nodes(root):
        if isinstance(n, ShardReader):
            nodes.setdefault(n.dataset.name, n)
    for name in {p[0] for p in pieces}:
        mine = [p for p in pieces if p[0] == name]
        node, state = nodes.get(name), readers.get(name)
        if node is None or state is None:
            epochs = [UNKNOWN_EPOCH] * len(mine)
        else:
            view = reader_cursors(state)
            offsets = file_offsets(node.dataset.doc_counts)
            ids = offsets[[int(p[1]) for p in mine]] + np.asarray([int(p[2]) for p in mine])
            epochs = latest_epochs(
                offsets,
                node.n_logical_shards,
                node.seed,
                (view.ids, view.epoch, view.pos, view.offset),
                ids,
            ).tolist()
        for p, e in zip(mine, epochs, strict=True):
            p.append(int(e))


def piece_epochs(pieces: Sequence[Sequence[Any]]) -> np.ndarray:
    """The epoch of each recorded skipped piece (:data:`UNKNOWN_EPOCH` for one recorded
    without: five fields)."""
    return np.asarray(
        [int(p[5]) if len(p) > 5 else UNKNOWN_EPOCH for p in pieces], np.int64
    ).reshape(-1)
