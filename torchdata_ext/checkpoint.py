"""Checkpoints of the loader: a folder on any fsspec URL, or inside a DCP checkpoint; rescaling.

Folder layout (``url/``)::

    manifest.json            format, topology (ranks, workers), logical shards, fingerprints
    rank_00000.json          per rank: which logical worker produces the next batch
    worker_000000.pkl        per global worker: its graph state (pickled plain data)

Every file is written under a temporary name and renamed, so a kill never leaves a half-written
file; the manifest is written last (after a barrier when ``torch.distributed`` is initialised),
so a folder without a manifest is an incomplete checkpoint and is refused.

Restoring onto another number of ranks x workers (:func:`load_checkpoint`): each new worker
reads only the old workers' files it needs (the old owners of its logical shards), merges the
reader cursors of its shards, and re-splits the interleave token counters, so the epoch goes
on with nothing repeated and nothing lost.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import pickle
import posixpath
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from torchdata.nodes import BaseNode

from torchdata_ext.loader import STATE_FORMAT, TokenLoader
from torchdata_ext.shards import worker_shards
from torchdata_ext.urls import filesystem
from torchdata_ext.world import World

__all__ = [
    "CHECKPOINT_FORMAT",
    "DCPLoaderState",
    "load_checkpoint",
    "rescale_worker_states",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_MANIFEST = "manifest.json"


# -- atomic file I/O -----------------------------------------------------------------------------
def _write_atomic(url: str, data: bytes, storage_options: dict[str, Any] | None) -> None:
    fs, path = filesystem(url, storage_options)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def _read(url: str, storage_options: dict[str, Any] | None) -> bytes:
    fs, path = filesystem(url, storage_options)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint file {url} is missing: the checkpoint is incomplete or from another "
            "topology; pass the folder of a complete checkpoint"
        ) from None


# -- finding reader states inside a graph state ----------------------------------------------------
def _is_reader_state(x: Any) -> bool:
    return isinstance(x, dict) and {"fingerprint", "shards", "n_logical_shards", "dataset"} <= set(
        x
    )


def _walk(x: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _walk(v, (*path, i))


def _reader_states(graph: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    return {p: x for p, x in _walk(graph) if _is_reader_state(x)}


def _token_counters(graph: dict[str, Any]) -> dict[tuple, dict[str, int]]:
    return {
        (*p, "tokens_delivered"): x["tokens_delivered"]
        for p, x in _walk(graph)
        if isinstance(x, dict) and isinstance(x.get("tokens_delivered"), dict)
    }


def _set(tree: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def graph_summary(graph: dict[str, Any]) -> dict[str, Any]:
    """Dataset fingerprints, seeds, shard counts and mixing weights found in a graph state
    (for the manifest)."""
    weights: dict[str, float] = {}
    for _, x in _walk(graph):
        if isinstance(x, dict) and isinstance(x.get("weights"), dict) and "tokens_delivered" in x:
            weights.update({str(k): float(v) for k, v in x["weights"].items()})
    return {
        st["dataset"]: {
            "fingerprint": st["fingerprint"],
            "seed": st["seed"],
            "n_logical_shards": st["n_logical_shards"],
            "weight": weights.get(st["dataset"]),
        }
        for st in _reader_states(graph).values()
    }


# -- rescaling -------------------------------------------------------------------------------------
def old_workers_needed(n_logical_shards: int, old_total: int, new_world: World) -> list[int]:
    """Old global workers whose logical shards the new worker owns (the files it must read)."""
    mine = worker_shards(n_logical_shards, new_world.total_workers, new_world.global_worker)
    out = []
    for g in range(old_total):
        theirs = worker_shards(n_logical_shards, old_total, g)
        if theirs.start < mine.stop and mine.start < theirs.stop:
            out.append(g)
    return out


def graph_nodes(root: BaseNode) -> list[BaseNode]:
    """Every node of a graph, root first (children found through node attributes)."""
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


def _holds_nothing(node: BaseNode) -> bool:
    from torchdata_ext.nodes.collate import Collate
    from torchdata_ext.nodes.reader import ShardReader

    return isinstance(node, (ShardReader, Collate))


def _live_cut(
    graph_state: dict[str, Any], world: World, build: Callable[[World], BaseNode]
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, int, int, int, int]]]:
    """Restore an old worker's graph and return a consistent cut: each reader's live state
    (after everything it handed out) and every piece held in flight above it."""
    from torchdata_ext.nodes.reader import ShardReader

    root = build(world)
    graph_state = _with_added_sources(graph_state, root)
    root.reset(graph_state)
    readers: dict[str, dict[str, Any]] = {}
    pieces: list[tuple[str, int, int, int, int]] = []
    nodes = graph_nodes(root)
    for node in nodes:  # first every node's held data (a node may pull while reporting) ...
        if hasattr(node, "inflight"):
            pieces.extend(node.inflight())
        elif not _holds_nothing(node):
            raise ValueError(
                f"cannot rescale: node {type(node).__name__} does not report the data it holds "
                "(give it an inflight() method returning (dataset, file, doc, start, stop) "
                "pieces), so a rescale could lose or repeat data"
            )
    for node in nodes:  # ... then the readers' cursors after everything they handed out
        if isinstance(node, ShardReader):
            readers[node.dataset.name] = node.state_dict()
    for node in nodes:
        close = getattr(node, "close", None)
        if callable(close):
            close()
    return readers, pieces


def _with_added_sources(graph_state: dict[str, Any], root: BaseNode) -> dict[str, Any]:
    """``graph_state`` with a fresh entry for each interleave source that ``root``'s graph has
    and the state lacks (a sub-dataset added since the checkpoint). Its saved weight is 0, so
    the restored interleave replays its first block as it was decided, without the new source.
    """
    root.reset(None)
    fresh = {"graph": root.state_dict()}
    box = {"graph": copy.deepcopy(graph_state)}
    for path in _token_counters(fresh):
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
    counters divided evenly among the new workers that read it).
    """
    old_ranks, old_workers = old_topology
    old_total = old_ranks * old_workers
    root = build(new_world)
    root.reset(None)
    box = {"graph": root.state_dict()}  # a container, so even the root state can be replaced
    targets = _reader_states(box)
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
    for g in needed:
        old_world = World(g // old_workers, old_ranks, g % old_workers, old_workers)
        readers, pieces = _live_cut(old_graphs[g], old_world, build)
        for name, st in readers.items():
            if name not in in_checkpoint:
                continue  # an added dataset: its reader state stays fresh
            by_dataset.setdefault(name, []).append(st)
        for ds, file, doc, start, stop in pieces:
            returned.setdefault(ds, []).append((file, doc, start, stop))
    live = {r.dataset.name: r for r in graph_nodes(root) if _is_reader_node(r)}
    for path, st in targets.items():
        name = st["dataset"]
        old = by_dataset.get(name)
        if not old:
            if allow_new_datasets:
                continue  # an added dataset starts fresh
            raise ValueError(f"the checkpoint has no state for dataset {name!r}")
        merged = _merge_partial(old)
        if returned.get(name):
            merged = live[name].with_returned(merged, returned[name])
        _set(box, path, merged)
    # token counters: each old worker's share split among the new workers that read it
    new_total = new_world.total_workers
    readers_of = {
        g: sum(
            1
            for w in range(new_total)
            if g in old_workers_needed(n, old_total, _nth_world(new_world, w))
        )
        for g in needed
    }
    for path, counters in _token_counters(box).items():
        summed = dict.fromkeys(counters, 0)
        for g in needed:
            counted = _token_counters({"graph": old_graphs[g]}).get(path)
            if counted is None:
                continue
            for name, v in counted.items():
                if name in summed:
                    summed[name] += int(v) // readers_of[g]
        new = [k for k in summed if k not in in_checkpoint]
        if new:  # an added dataset starts at its target share, so the mix does not lurch to it
            weights = _weights_at(box, path)
            total_w = sum(weights.values())
            total = sum(v for k, v in summed.items() if k not in new)
            old_w = sum(w for k, w in weights.items() if k not in new) or 1.0
            for k in new:
                summed[k] = int(total / old_w * weights.get(k, 0.0)) if total_w else 0
        _set(box, path, summed)
    return box["graph"]


def _weights_at(box: dict[str, Any], counters_path: tuple) -> dict[str, float]:
    node: Any = box
    for k in counters_path[:-1]:
        node = node[k]
    return {str(k): float(v) for k, v in node.get("weights", {}).items()}


def _is_reader_node(node: BaseNode) -> bool:
    from torchdata_ext.nodes.reader import ShardReader

    return isinstance(node, ShardReader)


def _nth_world(like: World, g: int) -> World:
    return World(g // like.num_workers, like.world_size, g % like.num_workers, like.num_workers)


def _merge_partial(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge reader states that may cover only part of the shards (no completeness check)."""
    first = states[0]
    shards: dict[str, Any] = {}
    for st in states:
        for key in ("format", "fingerprint", "seed", "n_logical_shards"):
            if st[key] != first[key]:
                raise ValueError(
                    f"old worker states disagree on {key} ({st[key]!r} vs {first[key]!r}); "
                    "the checkpoint mixes runs"
                )
        shards.update(st["shards"])
    return {**first, "shards": shards}


# -- folder checkpoints -------------------------------------------------------------------------------
def save_checkpoint(
    loader: TokenLoader, url: str, *, storage_options: dict[str, Any] | None = None
) -> None:
    """Write this rank's part of the loader checkpoint into folder ``url`` (atomically).

    Call on every rank at the same step. Rank 0 writes the manifest last.
    """
    state = loader.state_dict()
    for g, st in state["workers"].items():
        _write_atomic(
            posixpath.join(url, f"worker_{int(g):06d}.pkl"),
            pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL),
            storage_options,
        )
    _write_atomic(
        posixpath.join(url, f"rank_{loader.rank:05d}.json"),
        json.dumps(
            {"next_worker": state["next_worker"], "skip_batches": state["skip_batches"]}
        ).encode(),
        storage_options,
    )
    _barrier()
    if loader.rank == 0:
        any_graph = next(iter(state["workers"].values()))["graph"]
        datasets = graph_summary(any_graph)
        # the weights are the pipeline's targets (a state restored with new weights and not
        # yet run still holds the old ones)
        _, configured = _configured(loader)
        for name, summary in configured.items():
            if name in datasets:
                datasets[name]["weight"] = summary["weight"]
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "loader_format": STATE_FORMAT,
            "world_size": loader.world_size,
            "num_workers": loader.logical_workers,
            "datasets": datasets,
        }
        _write_atomic(
            posixpath.join(url, _MANIFEST),
            json.dumps(manifest, indent=1, sort_keys=True).encode(),
            storage_options,
        )
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        manifest = json.loads(_read(posixpath.join(url, _MANIFEST), storage_options))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{url} has no {_MANIFEST}: not a loader checkpoint, or one whose save did not finish "
            "(a kill during save); restore from an earlier checkpoint"
        ) from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{url}: checkpoint format {manifest.get('format')!r} is not supported "
            f"(this version reads format {CHECKPOINT_FORMAT})"
        )
    return manifest


def load_checkpoint(
    loader: TokenLoader,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_weight_changes: bool = False,
    allow_new_datasets: bool = False,
) -> None:
    """Restore ``loader`` (not yet iterating) from folder ``url``, rescaling if the number of
    ranks or workers changed. Reads only the files this rank needs.

    Args:
        loader: a new loader with the same pipeline builder.
        url: the checkpoint folder (any fsspec URL).
        storage_options: fsspec options for ``url``.
        allow_weight_changes: accept sub-dataset weights that differ from the checkpoint's
            (the token counters carry on; the mix moves to the new targets).
        allow_new_datasets: accept sub-datasets that the checkpoint does not have; they start
            their first epoch, at their target share of the tokens so far. Documents of the
            other datasets already delivered stay delivered.
    """
    manifest = read_manifest(url, storage_options)
    old_ranks, old_workers = int(manifest["world_size"]), int(manifest["num_workers"])
    W = loader.logical_workers
    added, reweighted = _check_datasets(loader, manifest, allow_weight_changes, allow_new_datasets)
    if (old_ranks, old_workers) == (loader.world_size, W) and not added:
        graphs = {}
        for w in range(W):
            g = loader.rank * W + w
            st = pickle.loads(_read(posixpath.join(url, f"worker_{g:06d}.pkl"), storage_options))
            graphs[w] = st["graph"]
        meta = json.loads(
            _read(posixpath.join(url, f"rank_{loader.rank:05d}.json"), storage_options)
        )
        if reweighted and int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"checkpoint {url} was taken {meta['skip_batches']} batches after the workers' "
                f"last state snapshot; those batches are made again on restore, which needs the "
                f"weights they were made with, so the weights of {reweighted} cannot change here: "
                "restore with the checkpoint's weights, or change them at a checkpoint taken at a "
                "multiple of snapshot_every_n_steps"
            )
        loader.load_worker_states(
            graphs,
            next_worker=meta["next_worker"],
            skip_batches=int(meta.get("skip_batches", 0)),
        )
        return
    old_total = old_ranks * old_workers
    cache: dict[int, dict[str, Any]] = {}
    new_graphs = {}
    n = next(iter(manifest["datasets"].values()))["n_logical_shards"]
    needed_ranks = sorted(
        {
            g // old_workers
            for w in range(W)
            for g in old_workers_needed(n, old_total, World(loader.rank, loader.world_size, w, W))
        }
    )
    for r in needed_ranks:  # each old rank that owned a needed worker must be at a snapshot
        meta = json.loads(_read(posixpath.join(url, f"rank_{r:05d}.json"), storage_options))
        if int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"checkpoint {url}: rank {r} saved its state {meta['skip_batches']} batches after "
                "its workers' last snapshot (snapshot_every_n_steps > 1), so the checkpoint "
                f"restores only on the same {old_ranks} ranks x {old_workers} workers; to "
                "rescale, take checkpoints at multiples of snapshot_every_n_steps (or use "
                "snapshot_every_n_steps=1)"
            )
    for w in range(W):
        world = World(loader.rank, loader.world_size, w, W)
        for g in old_workers_needed(n, old_total, world):
            if g not in cache:
                raw = _read(posixpath.join(url, f"worker_{g:06d}.pkl"), storage_options)
                cache[g] = pickle.loads(raw)["graph"]
        new_graphs[w] = rescale_worker_states(
            cache,
            (old_ranks, old_workers),
            world,
            loader.build,
            allow_new_datasets=bool(added),
        )
    logger.info(
        "rescaled loader checkpoint %s from %dx%d to %dx%d (read %d of %d worker states)",
        url, old_ranks, old_workers, loader.world_size, W, len(cache), old_total,
    )  # fmt: skip
    loader.load_worker_states(new_graphs, next_worker=0)


def _configured(loader: TokenLoader) -> tuple[BaseNode, dict[str, Any]]:
    """A fresh graph of ``loader``'s pipeline (this rank, worker 0) and its summary: the
    datasets, seeds, shard counts and target weights as configured now."""
    root = loader.build(World(loader.rank, loader.world_size, 0, loader.logical_workers))
    root.reset(None)
    return root, graph_summary(root.state_dict())


def _check_datasets(
    loader: TokenLoader,
    manifest: dict[str, Any],
    allow_weight_changes: bool = False,
    allow_new_datasets: bool = False,
) -> tuple[list[str], list[str]]:
    """Refuse a checkpoint of other data; return the names of the accepted added datasets and
    of those whose weight changed (accepted)."""
    root, mine = _configured(loader)
    theirs = manifest["datasets"]
    problems = []
    added: list[str] = []
    reweighted: list[str] = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            problems.append(f"dataset {name!r} is in the checkpoint but not in this pipeline")
        elif name not in theirs:
            if allow_new_datasets:
                added.append(name)
            else:
                problems.append(
                    f"dataset {name!r} is in this pipeline but not in the checkpoint "
                    "(pass allow_new_datasets=True to add it)"
                )
        else:
            old_w, new_w = theirs[name].get("weight"), mine[name].get("weight")
            if old_w is not None and new_w is not None and old_w != new_w:
                if allow_weight_changes:
                    reweighted.append(name)
                else:
                    problems.append(
                        f"dataset {name!r}: weight differs (checkpoint {old_w}, now {new_w}; "
                        "pass allow_weight_changes=True to accept it)"
                    )
            for key in ("fingerprint", "seed", "n_logical_shards"):
                if mine[name][key] != theirs[name][key]:
                    what = "files or document counts" if key == "fingerprint" else key
                    problems.append(
                        f"dataset {name!r}: {what} differ (checkpoint {key}="
                        f"{theirs[name][key]!r}, now {mine[name][key]!r})"
                    )
    if problems:
        raise ValueError(
            "cannot restore this loader checkpoint: "
            + "; ".join(problems)
            + ". Restore with the same data, seed and logical shards as the checkpoint"
        )
    if added or reweighted:
        from torchdata_ext.nodes.pack import Pack

        if any(isinstance(x, Pack) and x.mode == "best_fit" for x in graph_nodes(root)):
            raise ValueError(
                f"cannot change the mix on restore (weights of {reweighted}, added {added}) with "
                "pack_mode='best_fit': its window is rebuilt from many interleave blocks, which "
                "must come out as they did under the checkpoint's weights; restore with the "
                "checkpoint's datasets and weights, or use pack_mode 'concat' or 'pad'"
            )
    return added, reweighted


# -- torch.distributed.checkpoint -------------------------------------------------------------------
class DCPLoaderState:
    """Put the loader state into the same ``torch.distributed.checkpoint`` as the model.

    ``dcp.save({"model": ..., "optim": ..., "data": DCPLoaderState(loader)}, checkpoint_id=...)``
    stores each rank's state under its own key (``rank_00003``), so ranks never overwrite each
    other, and ``dcp.load`` restores it on the same topology. (To change the number of ranks or
    workers, save a folder checkpoint with :func:`save_checkpoint` too, and restore with
    :func:`load_checkpoint`.)
    """

    def __init__(self, loader: TokenLoader) -> None:
        self.loader = loader

    def _key(self) -> str:
        return f"rank_{self.loader.rank:05d}"

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO(pickle.dumps(self.loader.state_dict(), protocol=pickle.HIGHEST_PROTOCOL))
        return {self._key(): buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            raw = state[self._key()]
        except KeyError:
            raise ValueError(
                f"the checkpoint has no loader state for {self._key()}; it was saved with "
                "another number of ranks: restore with load_checkpoint from a folder checkpoint"
            ) from None
        data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
        self.loader.load_state_dict(pickle.loads(data))
