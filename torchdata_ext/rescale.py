"""Rescale planning: a new worker's graph state from the states of the old workers it succeeds.

Restoring onto another number of ranks x workers is a re-partition of the logical shards, with
three steps (no file I/O here: :mod:`torchdata_ext.checkpoint` reads the states and calls in):

1. **Which old workers** (:func:`old_workers_needed`): those whose logical shards overlap the new
   worker's; only their states are read.
2. **The cut** (``_live_cut``): each needed old worker's graph is restored in this process; every
   node reports what it holds in flight (``inflight()``: ``(dataset, file, doc, start, stop)``
   pieces), then the readers report their live cursors. A node that holds data and cannot report
   it makes the rescale refuse.
3. **The hand-back** (:func:`rescale_worker_states`): the new worker's readers start from the
   merged old cursors of its shards, with the in-flight pieces of those shards returned to them
   (delivered first), and the interleave token counters are the old ones re-split.

Budgets (:class:`~torchdata_ext.nodes.take.Take`) are per run, each worker holding its share:
the cut reads each old worker's live remaining budget and adds back what the nodes above the
``Take`` held in flight (it goes back to the readers and passes the ``Take`` again); each old
worker's sum is then split exactly among the new workers that read it, so the new shares add
up to exactly what the run had left.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode

from torchdata_ext.graph import (
    budget_states,
    graph_nodes,
    graph_summary,
    reader_states,
    set_at,
    token_counters,
)
from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.reader import ShardReader, merge_reader_states
from torchdata_ext.nodes.take import Take
from torchdata_ext.shards import (
    count_new_readers,
    old_workers_to_read,
    shard_owner,
    worker_shards,
)
from torchdata_ext.world import World

__all__ = ["live_cut", "old_workers_needed", "rescale_worker_states"]

Piece = tuple[str, int, int, int, int]  # (dataset, file, doc, start, stop)
Budget = tuple[int | None, int | None]  # (tokens, documents) left; None: not budgeted


def old_workers_needed(n_logical_shards: int, old_total: int, new_world: World) -> list[int]:
    """Old global workers whose logical shards the new worker owns (the files it must read).

    Args:
        n_logical_shards: logical shards per dataset (the same before and after).
        old_total: the number of global workers when the checkpoint was taken.
        new_world: the new worker's place.

    Returns:
        The old global worker ids, ascending.
    """
    return list(
        old_workers_to_read(
            n_logical_shards, old_total, new_world.total_workers, new_world.global_worker
        )
    )


def _holds_nothing(node: BaseNode) -> bool:
    """Nodes that hold no data between items, so need no ``inflight()``."""
    return isinstance(node, (ShardReader, Collate))


def _live_cut(
    graph_state: dict[str, Any], world: World, build: Callable[[World], BaseNode]
) -> tuple[dict[str, dict[str, Any]], list[Piece], dict[str, Budget]]:
    """Restore an old worker's graph and return a consistent cut: each reader's live state
    (after everything it handed out), every piece held in flight above it, and each budget's
    live remaining share plus what was held in flight above its ``Take`` (by budget name)."""
    root = build(world)
    graph_state = _with_added_sources(graph_state, root)
    return live_cut(root, graph_state)


def live_cut(
    root: BaseNode, state: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], list[Piece], dict[str, Budget]]:
    """Restore the graph under ``root`` from ``state`` and take a consistent cut: the live
    state of each reader (after everything it handed out, by dataset), every piece the nodes
    above it hold in flight, ``(dataset, file, doc, start, stop)``, and each budget's live
    remaining share plus what was held in flight above its ``Take`` (by budget name).

    Args:
        root: a freshly built graph (or a subgraph, e.g. a Pack and what feeds it).
        state: the state of ``root`` to restore.

    Raises:
        ValueError: a node holds data and cannot report it (no ``inflight()``).
    """
    root.reset(state)
    readers: dict[str, dict[str, Any]] = {}
    pieces: list[Piece] = []
    held: list[tuple[BaseNode, list[Piece]]] = []
    nodes = graph_nodes(root)
    for node in nodes:  # first every node's held data (a node may pull while reporting) ...
        if hasattr(node, "inflight"):
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
    return readers, pieces, budgets


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


def _with_added_sources(graph_state: dict[str, Any], root: BaseNode) -> dict[str, Any]:
    """``graph_state`` with a fresh entry for each interleave source that ``root``'s graph has
    and the state lacks (a sub-dataset added since the checkpoint). Its saved weight is 0, so
    the restored interleave replays its first block as it was decided, without the new source.
    """
    root.reset(None)
    fresh = {"graph": root.state_dict()}
    box = {"graph": copy.deepcopy(graph_state)}
    for path in token_counters(fresh):
        mixer, old_node = path[:-1], box
        fresh_node: Any = fresh
        for k in mixer:
            fresh_node = fresh_node[k]
            if not isinstance(old_node, dict) or k not in old_node:
                break
            old_node = old_node[k]
        else:
            for name, entry in fresh_node["sources"].items():
                if name not in old_node["sources"]:
                    old_node["sources"][name] = entry
                    old_node["tokens_delivered"][name] = 0
                    old_node.setdefault("weights", {})[name] = 0.0
    return box["graph"]


def rescale_worker_states(
    old_graphs: dict[int, dict[str, Any]],
    old_topology: tuple[int, int],
    new_world: World,
    build: Callable[[World], BaseNode],
    *,
    allow_new_datasets: bool = False,
) -> dict[str, Any]:
    """The graph state for ``new_world`` from the states of old global workers.

    Args:
        old_graphs: graph states of (at least) the old workers returned by
            :func:`old_workers_needed`, by old global worker id.
        old_topology: ``(ranks, workers per rank)`` when the checkpoint was taken.
        new_world: the new worker's place.
        build: the graph builder (the same function the loader uses).
        allow_new_datasets: datasets the graph has and the checkpoint lacks start fresh (their
            interleave token counter at its target share of the tokens so far) instead of
            raising.

    Each needed old worker's graph is restored in this process to take a consistent cut: its
    readers' cursors after everything they handed out, plus every piece held in flight by the
    nodes above (interleave remainders, packing remainders, shuffle-buffer contents). The new
    worker starts from a fresh graph whose reader cursors are the merged old cursors of its
    shards, with the in-flight pieces of its shards handed back to those shards (delivered
    first), and whose interleave token counters are the old ones re-split (each old worker's
    counters divided evenly among the new workers that read it). Budgets (``Take``) are split
    the same way: each old worker's remaining share, plus what nodes above its ``Take`` held
    in flight (it passes the ``Take`` again), divided exactly among the new workers that read
    it, so the new shares sum to exactly what the run had left.

    Raises:
        ValueError: the graph has no reader, its datasets use different logical shard counts,
            a needed old state is missing, a dataset has no state in the checkpoint (unless
            ``allow_new_datasets``), or a node cannot report the data it holds.
    """
    old_ranks, old_workers = old_topology
    old_total = old_ranks * old_workers
    root = build(new_world)
    root.reset(None)
    box = {"graph": root.state_dict()}  # a container, so even the root state can be replaced
    targets = reader_states(box)
    if not targets:
        raise ValueError("the graph has no ShardReader state to rescale")
    n_shards = {st["n_logical_shards"] for st in targets.values()}
    if len(n_shards) != 1:
        raise ValueError(
            f"all datasets must use the same n_logical_shards to rescale, got {n_shards}"
        )
    n = n_shards.pop()
    needed = old_workers_needed(n, old_total, new_world)
    missing = [g for g in needed if g not in old_graphs]
    if missing:
        raise ValueError(f"rescaling needs the states of old workers {missing}")
    in_checkpoint = {name for g in needed for name in graph_summary(old_graphs[g])}
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    returned: dict[str, list[tuple[int, int, int, int]]] = {}
    budgets: dict[int, dict[str, Budget]] = {}
    for g in needed:
        old_world = World(g // old_workers, old_ranks, g % old_workers, old_workers)
        readers, pieces, budgets[g] = _live_cut(old_graphs[g], old_world, build)
        for name, st in readers.items():
            if name not in in_checkpoint:
                continue  # an added dataset: its reader state stays fresh
            by_dataset.setdefault(name, []).append(st)
        for ds, file, doc, start, stop in pieces:
            returned.setdefault(ds, []).append((file, doc, start, stop))
    live = {r.dataset.name: r for r in graph_nodes(root) if isinstance(r, ShardReader)}
    for path, st in targets.items():
        name = st["dataset"]
        old = by_dataset.get(name)
        if not old:
            if allow_new_datasets:
                continue  # an added dataset starts fresh
            raise ValueError(f"the checkpoint has no state for dataset {name!r}")
        merged = merge_reader_states(old, complete=False)
        if returned.get(name):
            merged = live[name].with_returned(merged, returned[name])
        set_at(box, path, merged)
    # token counters: each old worker's share split among the new workers that read it
    new_total = new_world.total_workers
    # (O(1) each: a pass over every new worker's needs is hours at 4,096 ranks x 8 workers)
    readers_of = {g: count_new_readers(n, old_total, new_total, g) for g in needed}
    # this worker's place among an old worker's readers: the first (v % readers) get one more
    first_reader = {
        g: shard_owner(n, new_total, worker_shards(n, old_total, g).start) for g in needed
    }
    for path, counters in token_counters(box).items():
        summed = dict.fromkeys(counters, 0)
        for g in needed:
            counted = token_counters({"graph": old_graphs[g]}).get(path)
            if counted is None:
                continue
            for name, v in counted.items():
                if name in summed:  # split exactly: the parts add up to v
                    parts, i = readers_of[g], new_world.global_worker - first_reader[g]
                    summed[name] += int(v) // parts + (i < int(v) % parts)
        new = [k for k in summed if k not in in_checkpoint]
        if new:  # an added dataset starts at its target share, so the mix does not lurch to it
            weights = _weights_at(box, path)
            total_w = sum(weights.values())
            total = sum(v for k, v in summed.items() if k not in new)
            old_w = sum(w for k, w in weights.items() if k not in new) or 1.0
            for k in new:
                summed[k] = int(total / old_w * weights.get(k, 0.0)) if total_w else 0
        set_at(box, path, summed)
    for path, st in budget_states(box).items():  # budgets: the same exact split
        for idx, key in enumerate((Take.TOKENS_KEY, Take.DOCUMENTS_KEY)):
            if st[key] is None:
                continue
            share = 0
            for g in needed:
                pair = budgets[g].get(st[Take.NAME_KEY])
                left = None if pair is None else pair[idx]
                if left is None:
                    raise ValueError(
                        f"budget {st[Take.NAME_KEY]!r} ({key}) is in this pipeline but not in "
                        "the checkpoint; a budget cannot be added across a checkpoint"
                    )
                parts, i = readers_of[g], new_world.global_worker - first_reader[g]
                share += left // parts + (i < left % parts)
            set_at(box, (*path, key), share)
    return box["graph"]


def _weights_at(box: dict[str, Any], counters_path: tuple) -> dict[str, float]:
    """The mixing weights of the interleave whose token counters are at ``counters_path``."""
    node: Any = box
    for k in counters_path[:-1]:
        node = node[k]
    return {str(k): float(v) for k, v in node.get("weights", {}).items()}
