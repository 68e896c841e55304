"""Walking a node graph and its state tree: the helpers the loader, rescaling and checkpoints share.

Two kinds of walk:

* :func:`graph_nodes` visits the live nodes of a graph (children found through node
  attributes), e.g. to collect the readers' I/O counters or to take a rescale cut.
* :func:`walk_state` visits a graph *state* (nested dicts and lists of plain data), and the
  finders built on it pick out what rescaling and checkpoints need: the reader states
  (:func:`reader_states`), the interleave token counters (:func:`token_counters`), the
  budgets of ``Take`` nodes (:func:`budget_states`), the datasets of each curriculum phase
  (:func:`phase_datasets`) and the
  per-dataset summary a checkpoint manifest records (:func:`graph_summary`).

Nothing here imports the loader, rescaling or checkpoint modules, so all of them can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torchdata.nodes import BaseNode

__all__ = [
    "budget_states",
    "graph_nodes",
    "graph_summary",
    "is_reader_state",
    "pack_states",
    "phase_datasets",
    "reader_states",
    "set_at",
    "shuffle_states",
    "token_counters",
    "walk_state",
]

_READER_STATE_KEYS = frozenset({"fingerprint", "n_logical_shards", "dataset"})
_SHUFFLE_STATE_KEYS = frozenset({"source", "draws", "exhausted"})
_PACK_STATE_KEYS = frozenset({"mode", "seq_len", "consumed", "open_docs", "dataset_names"})


def graph_nodes(root: BaseNode) -> list[BaseNode]:
    """Every node of a graph, root first (children found through node attributes).

    Args:
        root: the graph's root node.

    Returns:
        Each node once, ``root`` first; a node reachable along several paths is listed once.
    """
    out: list[BaseNode] = []
    stack = [root]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        for value in vars(node).values():
            items = value.values() if isinstance(value, dict) else value
            if isinstance(value, BaseNode):
                stack.append(value)
            elif isinstance(value, (list, tuple, dict)):
                stack.extend(v for v in items if isinstance(v, BaseNode))
    return out


def walk_state(
    x: Any, path: tuple = (), prune: Callable[[Any], bool] | None = None
) -> Iterable[tuple[tuple, Any]]:
    """Every value of a state tree with its path (dict keys and list indices), ``x`` first.

    Args:
        x: a state tree: nested dicts and lists of plain values.
        path: the path of ``x`` itself (prefixed to every path yielded).
        prune: values for which this is true are yielded but not walked into (e.g.
            :func:`is_reader_state`: a reader's per-shard cursors, tens of thousands of
            dicts, hold no other node's state).
    """
    yield path, x
    if prune is not None and prune(x):
        return
    if isinstance(x, dict):
        for k, v in x.items():
            yield from walk_state(v, (*path, k), prune)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from walk_state(v, (*path, i), prune)


def is_reader_state(x: Any) -> bool:
    """Whether ``x`` is the state of a :class:`~torchdata_ext.nodes.reader.ShardReader`."""
    # format 2 holds its cursors in "cursors", format 1 (written by tests only) in "shards"
    return (
        isinstance(x, dict) and set(x) >= _READER_STATE_KEYS and ("cursors" in x or "shards" in x)
    )


def reader_states(graph: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The reader states inside a graph state, by path."""
    return {p: x for p, x in walk_state(graph, prune=is_reader_state) if is_reader_state(x)}


def token_counters(graph: dict[str, Any]) -> dict[tuple, dict[str, int]]:
    """The interleave token counters (``tokens_delivered``: tokens by dataset) inside a graph
    state, by path (ending in ``"tokens_delivered"``)."""
    return {
        (*p, "tokens_delivered"): x["tokens_delivered"]
        for p, x in walk_state(graph, prune=is_reader_state)
        if isinstance(x, dict) and isinstance(x.get("tokens_delivered"), dict)
    }


_BUDGET_STATE_KEYS = frozenset({"name", "remaining_tokens", "remaining_documents", "source", "cut"})


def budget_states(graph: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The states of the budget (``Take``) nodes inside a graph state, by path."""
    return {
        p: x
        for p, x in walk_state(graph, prune=is_reader_state)
        if isinstance(x, dict) and set(x) >= _BUDGET_STATE_KEYS
    }


def shuffle_states(graph: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The states of the shuffle buffers inside a graph state, by path."""
    return {
        p: x
        for p, x in walk_state(graph, prune=is_reader_state)
        if isinstance(x, dict) and set(x) >= _SHUFFLE_STATE_KEYS
    }


def pack_states(graph: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The states of the packers (``Pack``) inside a graph state, by path."""
    return {
        p: x
        for p, x in walk_state(graph, prune=is_reader_state)
        if isinstance(x, dict) and set(x) >= _PACK_STATE_KEYS
    }


def phase_datasets(graph: dict[str, Any]) -> dict[tuple, list[str]]:
    """The datasets each curriculum phase of a graph state reads (sorted), by the phase's path
    (ending in ``"phases", index``: a ``Concat`` state, :mod:`torchdata_ext.nodes.concat`)."""
    out: dict[tuple, list[str]] = {}
    for path, st in reader_states(graph).items():
        at = [i for i, k in enumerate(path[:-1]) if k == "phases"]
        if at:
            out.setdefault(path[: at[-1] + 2], []).append(st["dataset"])
    return {k: sorted(v) for k, v in out.items()}


def set_at(tree: Any, path: tuple, value: Any) -> None:
    """Replace the value at ``path`` (non-empty) inside ``tree``, in place."""
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def graph_summary(graph: dict[str, Any]) -> dict[str, Any]:
    """Per dataset of a graph state: its fingerprint, seed, logical shard count, held-out split
    and mixing weight (None without an interleave), as a checkpoint manifest records them.

    Args:
        graph: a graph state (``root.state_dict()``).

    Returns:
        ``{dataset: {"fingerprint", "seed", "n_logical_shards", "split", "weight"}}`` (``split``:
        the reader's held-out split and subset, or None).
    """
    weights: dict[str, float] = {}
    for _, x in walk_state(graph):
        if isinstance(x, dict) and isinstance(x.get("weights"), dict) and "tokens_delivered" in x:
            weights.update({str(k): float(v) for k, v in x["weights"].items()})
    return {
        st["dataset"]: {
            "fingerprint": st["fingerprint"],
            "seed": st["seed"],
            "n_logical_shards": st["n_logical_shards"],
            "split": st.get("split"),
            "weight": weights.get(st["dataset"]),
        }
        for st in reader_states(graph).values()
    }
