"""Rescale planning: a new worker's graph state from the states of the old workers it succeeds.

Restoring onto another number of ranks x workers is a re-partition of the logical shards, with
three steps (no file I/O here: :mod:`torchdata_ext.checkpoint.restore` calls in with the states
that a folder or DCP checkpoint read):

1. **Which old workers** (:func:`old_workers_needed`): those whose logical shards overlap the new
   worker's; only their states are read.
2. **The cut** (``_live_cut``, :mod:`torchdata_ext.nodes.graph_cut`): each needed old
   worker's graph is restored in this process; every node reports what it holds in flight
   (``inflight()``: ``(dataset, file, doc, start, stop)`` pieces), then the readers report their
   live cursors. A node that holds data and cannot report it makes the rescale refuse.
3. **The hand-back** (:func:`rescale_worker_states`): the new worker's readers start from the
   merged old cursors of its shards, with the in-flight pieces of those shards returned to them
   (delivered first), and the interleave token counters are the old ones re-split.

The rows a model trains on stay rows an uninterrupted run could have made:

* **Buffered rows go on whole.** A shuffle buffer's rows are not cut back into document
  pieces (a piece whose document went on in a row already delivered would be packed against
  the next document): each row goes, as its provenance table, into the shuffle buffer of one
  new worker (old worker ``g``'s row ``i`` to the ``i mod k``-th of the ``k`` new workers that
  read ``g``), which delivers it again exactly as it was, BOS/EOS included.
* **Specials exactly once.** The packer's remainder is handed back with its specials:
  a document whose EOS is held without any of its tokens goes back as its empty last piece
  (it gets just the EOS); a document whose BOS ended a delivered row goes back from 0 with
  the new owner's Pack told not to place the BOS again (its ``bos_done`` state key).

Budgets (:class:`~torchdata_ext.nodes.take.Take`) are per run, each worker holding its share:
the cut reads each old worker's live remaining budget and adds back what the nodes above the
``Take`` held in flight (it goes back to the readers and passes the ``Take`` again); each old
worker's sum is then split exactly among the new workers that read it, so the new shares add
up to exactly what the run had left.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.nodes.graph_cut import Budget, Cut, cut, live_cut
from torchdata_ext.nodes.reader import ShardReader, merge_reader_states
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.nodes.take import Take
from torchdata_ext.order.shards import (
    count_new_readers,
    old_workers_to_read,
    shard_owner,
    worker_shards,
)
from torchdata_ext.provenance import remap_ids
from torchdata_ext.state.graph import (
    budget_states,
    graph_nodes,
    graph_summary,
    pack_states,
    reader_states,
    set_at,
    shuffle_states,
    token_counters,
)
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.world import World

__all__ = ["Cut", "cut", "live_cut", "old_workers_needed", "rescale_worker_states"]


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


def _live_cut(graph_state: dict[str, Any], world: World, build: Callable[[World], BaseNode]) -> Cut:
    """Restore an old worker's graph and take its consistent cut (:func:`cut`)."""
    root = build(world)
    graph_state = _with_added_sources(graph_state, root)
    return cut(root, graph_state)


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
    root, box, targets, n = _fresh_state(build, new_world)
    needed = old_workers_needed(n, old_total, new_world)
    missing = [g for g in needed if g not in old_graphs]
    if missing:
        raise ValueError(f"rescaling needs the states of old workers {missing}")
    in_checkpoint = {name for g in needed for name in graph_summary(old_graphs[g])}
    split = _Split.of(n, old_total, new_world, needed)
    old = _cut_old_workers(old_graphs, old_topology, build, needed, in_checkpoint, split)
    no_bos = _set_reader_states(box, root, targets, old, allow_new_datasets)
    _hand_on(box, old.rows, sorted(no_bos))
    _split_token_counters(box, old_graphs, needed, in_checkpoint, split)
    _split_budgets(box, old.budgets, needed, split)
    return box["graph"]


def _fresh_state(
    build: Callable[[World], BaseNode], new_world: World
) -> tuple[BaseNode, dict[str, Any], dict[tuple, dict[str, Any]], int]:
    """The new worker's fresh graph, its state in a box (so even the root state can be
    replaced), its reader states by path, and their logical shard count.

    Raises:
        ValueError: the graph has no reader, or its datasets use different shard counts.
    """
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
    return root, box, targets, n_shards.pop()


class _Split(NamedTuple):
    """This new worker's part of what each needed old worker ``g`` holds, split exactly among
    the ``readers_of[g]`` new workers that read ``g``: it is their ``place(g)``-th."""

    readers_of: dict[int, int]
    first_reader: dict[int, int]
    global_worker: int

    @classmethod
    def of(cls, n: int, old_total: int, new_world: World, needed: list[int]) -> _Split:
        new_total = new_world.total_workers
        # (O(1) each: a pass over every new worker's needs is hours at 4,096 ranks x 8 workers)
        readers_of = {g: count_new_readers(n, old_total, new_total, g) for g in needed}
        first_reader = {
            g: shard_owner(n, new_total, worker_shards(n, old_total, g).start) for g in needed
        }
        return cls(readers_of, first_reader, new_world.global_worker)

    def place(self, g: int) -> int:
        """This worker's place among ``g``'s readers."""
        return self.global_worker - self.first_reader[g]

    def share(self, g: int, value: int) -> int:
        """This worker's part of ``value``: the parts add up to ``value`` (the first
        ``value % readers`` get one more)."""
        parts, i = self.readers_of[g], self.place(g)
        return value // parts + (i < value % parts)


class _OldCuts(NamedTuple):
    """What the needed old workers' cuts give this new worker (see :func:`_cut_old_workers`)."""

    by_dataset: dict[str, list[dict[str, Any]]]
    returned: dict[str, list[tuple[int, int, int, int]]]
    budgets: dict[int, dict[str, Budget]]
    rows: list[tuple[list[str], np.ndarray]]
    bos_done: set[tuple[str, int, int]]


def _cut_old_workers(
    old_graphs: dict[int, dict[str, Any]],
    old_topology: tuple[int, int],
    build: Callable[[World], BaseNode],
    needed: list[int],
    in_checkpoint: set[str],
    split: _Split,
) -> _OldCuts:
    """Restore each needed old worker's graph and take its cut: the reader states by dataset
    (of datasets in the checkpoint), the pieces held in flight by dataset, each worker's
    budgets left, the buffered rows this worker delivers (its every ``readers``-th) and the
    documents whose BOS was delivered."""
    old_ranks, old_workers = old_topology
    out = _OldCuts({}, {}, {}, [], set())
    for g in needed:
        old_world = World(g // old_workers, old_ranks, g % old_workers, old_workers)
        got = _live_cut(old_graphs[g], old_world, build)
        out.budgets[g] = got.budgets
        for name, st in got.readers.items():
            if name not in in_checkpoint:
                continue  # an added dataset: its reader state stays fresh
            out.by_dataset.setdefault(name, []).append(st)
        for ds, file, doc, start, stop in got.pieces:
            out.returned.setdefault(ds, []).append((file, doc, start, stop))
        out.bos_done.update(got.bos_done)
        names, tables = got.rows
        out.rows.extend((names, t) for t in tables[split.place(g) :: split.readers_of[g]])
    return out


def _set_reader_states(
    box: dict[str, Any],
    root: BaseNode,
    targets: dict[tuple, dict[str, Any]],
    old: _OldCuts,
    allow_new_datasets: bool,
) -> list[list[Any]]:
    """Set each reader's state in ``box`` to the merged old cursors of its dataset with the
    pieces held in flight handed back; returns the handed-back documents whose BOS was
    delivered (``[dataset, file, doc]``).

    Raises:
        ValueError: a dataset has no state in the checkpoint (unless ``allow_new_datasets``:
            it starts fresh).
    """
    live = {r.dataset.name: r for r in graph_nodes(root) if isinstance(r, ShardReader)}
    no_bos: list[list[Any]] = []  # this worker's handed-back documents whose BOS was delivered
    for path, st in targets.items():
        name = st["dataset"]
        states = old.by_dataset.get(name)
        if not states:
            if allow_new_datasets:
                continue  # an added dataset starts fresh
            raise ValueError(f"the checkpoint has no state for dataset {name!r}")
        merged = merge_reader_states(states, complete=False)
        if old.returned.get(name):
            merged = live[name].with_returned(merged, old.returned[name])
        # every returned piece, also one an old worker got back at an earlier rescale and had
        # not read yet (it is in its reader's state, not among the pieces held)
        for extras in reader_cursors(merged).extras.values():
            for file, doc, start, _stop in extras.get("returned", []):
                if start == 0 and (name, int(file), int(doc)) in old.bos_done:
                    no_bos.append([name, int(file), int(doc)])
        set_at(box, path, merged)
    return no_bos


def _split_token_counters(
    box: dict[str, Any],
    old_graphs: dict[int, dict[str, Any]],
    needed: list[int],
    in_checkpoint: set[str],
    split: _Split,
) -> None:
    """Set each interleave's token counters in ``box``: every old worker's share split among
    the new workers that read it; a dataset added since the checkpoint starts at its target
    share of the tokens so far, so the mix does not lurch to it. Weights changed since the
    checkpoint (a ``set_weights`` or schedule step at the restore) are recorded as the old
    ones in force, so the interleave counts the tokens so far at the new weights after its
    first block, as a restore does, instead of first making up for the old mix."""
    for path, counters in token_counters(box).items():
        summed = dict.fromkeys(counters, 0)
        old_weights: dict[str, float] = {}
        for g in needed:
            counted = token_counters({"graph": old_graphs[g]}).get(path)
            if counted is None:
                continue
            old_weights = old_weights or _weights_at({"graph": old_graphs[g]}, path)
            for name, v in counted.items():
                if name in summed:  # split exactly: the parts add up to v
                    summed[name] += split.share(g, int(v))
        new = [k for k in summed if k not in in_checkpoint]
        if new:  # an added dataset starts at its target share, so the mix does not lurch to it
            weights = _weights_at(box, path)
            total_w = sum(weights.values())
            total = sum(v for k, v in summed.items() if k not in new)
            old_w = sum(w for k, w in weights.items() if k not in new) or 1.0
            for k in new:
                summed[k] = int(total / old_w * weights.get(k, 0.0)) if total_w else 0
        set_at(box, path, summed)
        weights = _weights_at(box, path)
        saved = {k: old_weights.get(k, w) for k, w in weights.items()}
        if old_weights and saved != weights:
            set_at(box, (*path[:-1], "weights"), saved)


def _split_budgets(
    box: dict[str, Any], budgets: dict[int, dict[str, Budget]], needed: list[int], split: _Split
) -> None:
    """Set each budget's share in ``box``: every old worker's budget left split exactly among
    the new workers that read it.

    Raises:
        ValueError: a budget of this pipeline is not in the checkpoint.
    """
    for path, st in budget_states(box).items():
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
                share += split.share(g, left)
            set_at(box, (*path, key), share)


def _hand_on(
    box: dict[str, Any], rows: list[tuple[list[str], np.ndarray]], no_bos: list[list[Any]]
) -> None:
    """Put the buffered ``rows`` this worker delivers into its shuffle buffer's state (their
    dataset ids re-keyed by name to its Pack's names) and ``no_bos`` into its Pack's state."""
    if no_bos:
        packs = pack_states(box)
        if len(packs) != 1:
            raise ValueError(
                f"cannot rescale: {len(packs)} Pack nodes in the graph; a rescale that hands "
                "back documents whose BOS was delivered needs exactly one"
            )
        ((path, st),) = packs.items()
        set_at(box, path, {**st, "bos_done": no_bos})
    if not rows:
        return
    buffers = shuffle_states(box)
    if len(buffers) != 1:
        raise ValueError(f"cannot hand on buffered rows to {len(buffers)} shuffle buffers")
    ((path, buf),) = buffers.items()
    inner = pack_states({"b": buf})
    if len(inner) != 1:
        raise ValueError("cannot hand on buffered rows: the shuffle buffer is not on one Pack")
    ((ppath, pack),) = inner.items()
    names = [str(x) for x in pack["dataset_names"]]
    ids = {x: i for i, x in enumerate(names)}
    tables = []
    for old_names, table in rows:
        for x in old_names:
            if x not in ids:
                ids[x] = len(names)
                names.append(x)
        tables.append(remap_ids(table, old_names, names))
    buf = ShuffleBuffer.state_with_rows(buf, tables)
    set_at(buf, ppath[1:], {**pack, "dataset_names": names})
    set_at(box, path, buf)


def _weights_at(box: dict[str, Any], counters_path: tuple) -> dict[str, float]:
    """The mixing weights of the interleave whose token counters are at ``counters_path``."""
    node: Any = box
    for k in counters_path[:-1]:
        node = node[k]
    return {str(k): float(v) for k, v in node.get("weights", {}).items()}
