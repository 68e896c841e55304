"""``graph``: walking a node graph and its state tree (pure helpers, no I/O)."""

from __future__ import annotations

from torchdata.nodes import Batcher, IterableWrapper

from torchdata_ext.state.graph import (
    graph_nodes,
    graph_summary,
    reader_states,
    set_at,
    token_counters,
    walk_state,
)


def _reader(name: str, seed: int = 1) -> dict:
    return {"dataset": name, "fingerprint": f"fp-{name}", "seed": seed, "n_logical_shards": 4,
            "shards": {"0": {"pos": 3}}}  # fmt: skip


GRAPH = {
    "buffer": [[1, 2]],
    "source": {
        "tokens_delivered": {"web": 10, "code": 5},
        "weights": {"web": 2, "code": 1},
        "sources": {"web": {"source": _reader("web")}, "code": _reader("code", seed=7)},
    },
}


def test_walk_state_visits_every_value_with_its_path() -> None:
    paths = [p for p, _ in walk_state({"a": [1, {"b": 2}], "c": 3})]
    assert paths == [(), ("a",), ("a", 0), ("a", 1), ("a", 1, "b"), ("c",)]


def test_finders() -> None:
    assert reader_states(GRAPH) == {
        ("source", "sources", "web", "source"): _reader("web"),
        ("source", "sources", "code"): _reader("code", seed=7),
    }
    assert token_counters(GRAPH) == {("source", "tokens_delivered"): {"web": 10, "code": 5}}
    assert graph_summary(GRAPH) == {
        "web": {
            "fingerprint": "fp-web",
            "seed": 1,
            "n_logical_shards": 4,
            "split": None,
            "weight": 2.0,
        },
        "code": {
            "fingerprint": "fp-code",
            "seed": 7,
            "n_logical_shards": 4,
            "split": None,
            "weight": 1.0,
        },
    }
    assert graph_summary({"source": _reader("web")})["web"]["weight"] is None  # no interleave


def test_set_at_replaces_in_place() -> None:
    tree = {"a": [0, {"b": 1}]}
    set_at(tree, ("a", 1, "b"), 5)
    set_at(tree, ("a", 0), 4)
    assert tree == {"a": [4, {"b": 5}]}


def test_graph_nodes_root_first_each_once() -> None:
    leaf = IterableWrapper(range(4))
    root = Batcher(leaf, batch_size=2)
    root.extra = [leaf, {"again": leaf}]  # reachable along three paths: listed once
    assert graph_nodes(root) == [root, leaf]
