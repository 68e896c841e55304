"""A consistent cut of a node graph: what each node holds in flight and where the readers are.

:func:`cut` restores a freshly built graph from a state and asks every node what it holds
(``held()`` / ``inflight()``: ``(dataset, file, doc, start, stop)`` pieces), then the readers
for their live cursors (after everything they handed out). A rescale
(:mod:`torchdata_ext.checkpoint.rescale`) hands the pieces back to the new owners of their
shards; the audit (:mod:`torchdata_ext.audit.report`) and the loader's record of skipped steps
(:mod:`torchdata_ext.loader.skip_epochs`) count from the live cursors (:func:`live_cut`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.nodes.take import Take
from torchdata_ext.state.graph import graph_nodes

__all__ = ["Budget", "Cut", "Piece", "cut", "live_cut"]

Piece = tuple[str, int, int, int, int]  # (dataset, file, doc, start, stop)
Budget = tuple[int | None, int | None]  # (tokens, documents) left; None: not budgeted


class Cut(NamedTuple):
    """A consistent cut of one worker's graph (see :func:`cut`).

    Attributes:
        readers: each reader's live state (after everything it handed out), by dataset.
        pieces: the document pieces held in flight above the readers, to hand back,
            ``(dataset, file, doc, start, stop)``.
        budgets: each budget's live remaining share plus what was held in flight above its
            ``Take``, by budget name.
        rows: rows a shuffle buffer holds, to hand on whole: ``(names, tables)``, each table a
            row's provenance with dataset ids indexing ``names``.
        bos_done: ``(dataset, file, doc)`` of handed-back documents whose BOS was delivered.
    """

    readers: dict[str, dict[str, Any]]
    pieces: list[Piece]
    budgets: dict[str, Budget]
    rows: tuple[list[str], list[np.ndarray]]
    bos_done: list[tuple[str, int, int]]


def _holds_nothing(node: BaseNode) -> bool:
    """Nodes that hold no data between items, so need no ``inflight()``."""
    return isinstance(node, (ShardReader, Collate))


def live_cut(
    root: BaseNode, state: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], list[Piece], dict[str, Budget]]:
    """:func:`cut` with every held item as pieces (a shuffle buffer's rows too): the live
    reader states, the pieces held above them, and the budgets left. What an audit reads."""
    got = cut(root, state, rows=False)
    return got.readers, got.pieces, got.budgets


def cut(root: BaseNode, state: dict[str, Any], *, rows: bool = True) -> Cut:
    """Restore the graph under ``root`` from ``state`` and take a consistent cut: the live
    state of each reader (after everything it handed out, by dataset), every piece the nodes
    above it hold in flight, ``(dataset, file, doc, start, stop)``, each budget's live
    remaining share plus what was held in flight above its ``Take`` (by budget name), and
    (``rows``) the rows of the graph's shuffle buffer, handed on whole (a graph with several
    buffers hands all of them back as pieces).

    Args:
        root: a freshly built graph (or a subgraph, e.g. a Pack and what feeds it).
        state: the state of ``root`` to restore.
        rows: hand a shuffle buffer's rows on whole instead of as pieces.

    Raises:
        ValueError: a node holds data and cannot report it (no ``inflight()``).
    """
    root.reset(state)
    readers: dict[str, dict[str, Any]] = {}
    pieces: list[Piece] = []
    held: list[tuple[BaseNode, list[Piece]]] = []
    nodes = graph_nodes(root)
    buffers = [n for n in nodes if isinstance(n, ShuffleBuffer)]
    whole: tuple[list[str], list[np.ndarray]] = ([], [])
    bos_done: list[tuple[str, int, int]] = []
    for node in nodes:  # first every node's held data (a node may pull while reporting) ...
        if rows and len(buffers) == 1 and node is buffers[0]:
            whole = node.held_rows()
        elif hasattr(node, "held"):
            got, done = node.held()
            pieces.extend(got)
            held.append((node, got))
            bos_done.extend((str(d), int(f), int(k)) for d, f, k in done)
        elif hasattr(node, "inflight"):
            got = node.inflight()
            pieces.extend(got)
            held.append((node, got))
        elif not _holds_nothing(node):
            raise ValueError(
                f"cannot rescale: node {type(node).__name__} does not report the data it holds "
                "(give it an inflight() method returning (dataset, file, doc, start, stop) "
                "pieces), so a rescale could lose or repeat data"
            )
    for node in nodes:  # ... then the readers' cursors after everything they handed out
        if isinstance(node, ShardReader):
            readers[node.dataset.name] = node.state_dict()
    budgets = _budgets_left(nodes, held)
    for node in nodes:
        close = getattr(node, "close", None)
        if callable(close):
            close()
    return Cut(readers, pieces, budgets, whole, bos_done)


def _budgets_left(
    nodes: list[BaseNode], held: list[tuple[BaseNode, list[Piece]]]
) -> dict[str, Budget]:
    """Each ``Take``'s remaining share plus the tokens (documents started) of its datasets held
    in flight by nodes above it: those pass it again after the hand-back."""
    out: dict[str, Budget] = {}
    for take in nodes:
        if not isinstance(take, Take):
            continue
        if take.name in out:
            raise ValueError(
                f"cannot rescale: two Take nodes are named {take.name!r}; give each budget "
                "its own name (it matches the budget across workers)"
            )
        below = graph_nodes(take)  # the Take and its sources
        ids = {id(n) for n in below}
        datasets = {n.dataset.name for n in below if isinstance(n, ShardReader)}
        tokens, docs = take.remaining
        for node, got in held:
            if id(node) in ids:
                continue
            for ds, _f, _d, start, stop in got:
                if ds not in datasets:
                    continue
                if tokens is not None:
                    if stop < 0:
                        raise ValueError(
                            f"cannot rescale budget {take.name!r}: {type(node).__name__} holds "
                            f"text of dataset {ds!r} above it, whose tokens are not known "
                            "(put the Take after Tokenize)"
                        )
                    tokens += stop - start
                if docs is not None and start == 0:
                    docs += 1
        out[take.name] = (tokens, docs)
    return out
