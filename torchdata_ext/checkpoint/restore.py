"""The restore both kinds of checkpoint share (a folder, :mod:`torchdata_ext.checkpoint.folder`;
inside a DCP checkpoint, :mod:`torchdata_ext.checkpoint.dcp`): :func:`restore_loader` and the checks
it makes before anything is restored.

A checkpoint reaches :func:`restore_loader` as its manifest and two readers (old rank ``r``'s
``next_worker`` / ``skip_batches``, old global worker ``g``'s graph state), so this module does
no I/O of its own. It refuses a checkpoint of other data, seed, logical shards or split (one
description each: :func:`dataset_differs`, also used by :mod:`torchdata_ext.audit.report`), of
other weights or datasets unless accepted, and curriculum phases listed in another order; then it
restores the rank's own states (same topology) or plans new ones
(:mod:`torchdata_ext.checkpoint.rescale`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode

from torchdata_ext.checkpoint.rescale import old_workers_needed, rescale_worker_states
from torchdata_ext.loader.mix_history import MixHistory
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.order.shards import shards_files, worker_shards
from torchdata_ext.pipeline.build import with_indexes
from torchdata_ext.pipeline.config import step_ranges
from torchdata_ext.sources.fingerprint import describe, listed_changes
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import (
    budget_states,
    graph_nodes,
    graph_summary,
    is_reader_state,
    phase_datasets,
    reader_states,
    shuffle_states,
    walk_state,
)
from torchdata_ext.state.settings import SETTINGS_KEY, check_graph_settings
from torchdata_ext.world import World

__all__ = [
    "CHECKPOINT_FORMAT",
    "dataset_differs",
    "loader_config",
    "loader_datasets",
    "restore_loader",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
"""The format of a loader checkpoint's manifest (a folder's ``manifest.json``, a DCP
checkpoint's ``manifest`` entry)."""


def restore_loader(
    loader: TokenLoader,
    manifest: dict[str, Any],
    where: str,
    *,
    rank_meta: Callable[[int], dict[str, Any]],
    worker: Callable[[int, dict[str, Any]], dict[str, Any]],
    check_files: Callable[[dict[str, DatasetIndex], dict[str, list[int]], float], Any],
    allow_weight_changes: bool,
    allow_new_datasets: bool,
) -> None:
    """Restore ``loader`` from a checkpoint, folder or DCP (``where`` names it in messages):
    ``manifest`` (topology, datasets), ``rank_meta(r)`` (old rank ``r``'s ``next_worker`` and
    ``skip_batches``) and ``worker(g, rank_meta)`` (old global worker ``g``'s graph state) read
    only what this rank needs; ``check_files(datasets, reads, listed_since)`` refuses changed
    data files (``reads``: the files this rank's shards read, :func:`files_read`;
    ``listed_since``: this restore's start, so a listing made before it is asked again). The
    same topology restores the rank's own states; another one is planned by
    :mod:`torchdata_ext.checkpoint.rescale`."""
    began = time.time()
    old_ranks, old_workers = int(manifest["world_size"]), int(manifest["num_workers"])
    W = loader.logical_workers
    changes = manifest.get("weight_changes", [])
    # the trainer's set_weights calls of the run: build with the weights in force at its step
    loader.adopt_weight_changes(
        changes, int(manifest.get("step", 0)), manifest.get("weight_schedule", [])
    )
    root, mine = _configured(loader)
    _reuse_indexes(loader, _datasets_of(root))
    rank_meta, worker = _read_once(rank_meta), _read_once(worker)
    # curriculum phases added or removed first: the datasets' weights differ then too, and
    # the phases are what to name (this graph is read again below from the cache)
    g0 = loader.rank * W
    if (old_ranks, old_workers) != (loader.world_size, W):  # an entry this rank reads anyway
        n0 = next(iter(manifest["datasets"].values()))["n_logical_shards"]
        first = World(loader.rank, loader.world_size, 0, W)
        g0 = min(old_workers_needed(n0, old_ranks * old_workers, first))
    _check_phases(where, root, worker(g0, rank_meta(g0 // old_workers)))
    added, reweighted = _check_datasets(
        root, mine, manifest, allow_weight_changes, allow_new_datasets
    )
    datasets = _datasets_of(root)
    check_files(datasets, files_read(loader, manifest, datasets), began)
    if (old_ranks, old_workers) == (loader.world_size, W) and not added:
        meta = rank_meta(loader.rank)
        _check_weight_changes(where, loader.rank, meta, changes)
        graphs = {w: worker(loader.rank * W + w, meta) for w in range(W)}
        _check_graph(where, root, graphs[0], added)
        if reweighted and int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"{where} was taken {meta['skip_batches']} batches after the workers' "
                f"last state snapshot; those batches are made again on restore, which needs the "
                f"weights they were made with, so the weights of {reweighted} cannot change here: "
                "restore with the checkpoint's weights, or change them at a checkpoint taken at a "
                "multiple of snapshot_every_n_steps"
            )
        step = int(meta.get("step", 0))
        loader.load_worker_states(
            graphs,
            next_worker=meta["next_worker"],
            skip_batches=int(meta.get("skip_batches", 0)),
            step=step,
            skip_steps=_skip_steps(where, root, meta.get("skip_steps", []), step),
            skipped_documents=meta.get("skipped_documents", []),
            dataset_names=_names(root),
        )
        loader.adopt_mix_history(MixHistory.restored(meta.get("mix_history"), step))
        return
    old_total = old_ranks * old_workers
    n = next(iter(manifest["datasets"].values()))["n_logical_shards"]
    worlds = [World(loader.rank, loader.world_size, w, W) for w in range(W)]
    needed = {w.worker_id: old_workers_needed(n, old_total, w) for w in worlds}
    # every entry this rank needs is read (and checked) before any state is planned
    metas = {
        r: rank_meta(r) for r in sorted({g // old_workers for gs in needed.values() for g in gs})
    }
    for r, meta in metas.items():  # each old rank that owned a needed worker must be at a snapshot
        _check_weight_changes(where, r, meta, changes)
        if int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"{where}: rank {r} saved its state {meta['skip_batches']} batches after "
                "its workers' last snapshot (snapshot_every_n_steps > 1), so the checkpoint "
                f"restores only on the same {old_ranks} ranks x {old_workers} workers; to "
                "rescale, take checkpoints at multiples of snapshot_every_n_steps (or use "
                "snapshot_every_n_steps=1)"
            )
    cache = {
        g: worker(g, metas[g // old_workers])
        for g in sorted({g for gs in needed.values() for g in gs})
    }
    _check_graph(where, root, next(iter(cache.values())), added)
    new_graphs = {
        w.worker_id: rescale_worker_states(
            cache, (old_ranks, old_workers), w, loader.build, allow_new_datasets=bool(added)
        )
        for w in worlds
    }
    logger.info(
        "rescaled loader %s from %dx%d to %dx%d (read %d of %d worker states)",
        where, old_ranks, old_workers, loader.world_size, W, len(cache), old_total,
    )  # fmt: skip
    step = int(manifest.get("step", 0))
    skipped = []  # old rank r's skipped pieces go on with new rank r % world_size: listed once
    if manifest.get("skip_steps"):
        old = range(loader.rank, old_ranks, loader.world_size)  # the entries it reads anyway
        skipped = [p for r in old for p in rank_meta(r).get("skipped_documents", [])]
    loader.load_worker_states(
        new_graphs,
        next_worker=0,
        step=step,
        skip_steps=_skip_steps(where, root, manifest.get("skip_steps", []), step),
        skipped_documents=skipped,
        dataset_names=_names(root),
    )
    # the fresh workers count from 0; old rank r's totals go on with new rank r % world_size
    carried = range(loader.rank, old_ranks, loader.world_size)
    loader.adopt_mix_history(
        MixHistory.rescaled([rank_meta(r).get("mix_history") for r in carried], step)
    )


def files_read(
    loader: TokenLoader, manifest: dict[str, Any], datasets: dict[str, DatasetIndex]
) -> dict[str, list[int]]:
    """The files this rank reads after restoring ``manifest`` (by dataset, file numbers):
    those of its logical shards and, at another topology, of the old workers' shards whose
    in-flight data it takes over. Datasets the checkpoint does not have are left out."""
    W, old_total = (
        loader.logical_workers,
        int(manifest["world_size"]) * int(manifest["num_workers"]),
    )
    # the rank's workers, and the old workers they take over from, hold contiguous shards
    first, last = (World(loader.rank, loader.world_size, w, W) for w in (0, W - 1))
    out: dict[str, list[int]] = {}
    for name, index in datasets.items():
        recorded = manifest["datasets"].get(name)
        if recorded is None or not len(index.files):
            continue
        n = int(recorded["n_logical_shards"])
        old_first = old_workers_needed(n, old_total, first)[0]
        old_last = old_workers_needed(n, old_total, last)[-1]
        shards = range(
            min(worker_shards(n, first.total_workers, first.global_worker).start,
                worker_shards(n, old_total, old_first).start),
            max(worker_shards(n, last.total_workers, last.global_worker).stop,
                worker_shards(n, old_total, old_last).stop),
        )  # fmt: skip
        out[name] = shards_files(index.doc_counts, n, shards)
    return out


def _reuse_indexes(loader: TokenLoader, datasets: dict[str, DatasetIndex]) -> None:
    """Let every later graph of ``loader`` (old workers' graphs at a rescale, the graphs built
    at ``iter()``, a save's) use ``datasets``, the indexes the restore's own graph read
    (:func:`~torchdata_ext.pipeline.build.with_indexes`): so each rank reads its index and
    metadata files (or lists) once per restore."""
    if datasets:
        loader.replace_build(lambda build: with_indexes(build, datasets))


def _check_weight_changes(where: str, rank: int, meta: dict[str, Any], changes: list[Any]) -> None:
    """Refuse a checkpoint whose rank ``rank`` recorded other ``set_weights`` calls than rank
    0 (every rank must change the mix at the same steps, or the ranks' mixes differ)."""
    mine = meta.get("weight_changes", changes)
    if mine != changes:
        raise ValueError(
            f"{where}: rank {rank} recorded the weight changes {mine} but rank 0 {changes}; "
            "every rank must make the same set_weights calls (same weights, same from_step); "
            "restore from a checkpoint saved before they differed"
        )


def _names(root: BaseNode) -> list[str]:
    """The dataset names the provenance ids of ``root``'s batches index."""
    packs = [n for n in graph_nodes(root) if isinstance(n, Pack)]
    return list(packs[0].dataset_names) if packs else []


def _skip_steps(
    where: str, root: BaseNode, recorded: list[list[int]], step: int
) -> list[list[int]]:
    """The step ranges to skip from here: those the state recorded and the config's
    ``skip_steps`` (read off the configured root); a new range the checkpoint is past is
    refused, naming its step."""
    recorded = [list(map(int, r)) for r in recorded]
    new = [r for r in getattr(root, "skip_steps", []) if r not in recorded]
    past = [r for r in new if r[0] <= step]
    if past:
        a, b = past[0]
        raise ValueError(
            f"skip_steps: the range [{a}, {b}] starts at step {a}, but {where} was saved "
            f"after step {step}, so step {a} is already past; restore from a checkpoint saved "
            f"before step {a}, or remove the range from skip_steps"
        )
    return step_ranges(recorded + new)


def _read_once(read: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``read`` (a checkpoint entry by its first argument, an old rank or global worker)
    remembered, so an entry a check reads early is not read again."""
    seen: dict[int, dict[str, Any]] = {}

    def once(key: int, *args: Any) -> dict[str, Any]:
        if key not in seen:
            seen[key] = read(key, *args)
        return seen[key]

    return once


def _configured(loader: TokenLoader) -> tuple[BaseNode, dict[str, Any]]:
    """A fresh graph of ``loader``'s pipeline (this rank, worker 0) and its summary: the
    datasets, seeds, shard counts and target weights as configured now."""
    root = loader.build(World(loader.rank, loader.world_size, 0, loader.logical_workers))
    root.reset(None)
    return root, graph_summary(root.state_dict())


def _check_datasets(
    root: BaseNode,
    mine: dict[str, Any],
    manifest: dict[str, Any],
    allow_weight_changes: bool = False,
    allow_new_datasets: bool = False,
) -> tuple[list[str], list[str]]:
    """Refuse a checkpoint of other data than graph ``root`` (summary ``mine``, from
    :func:`_configured`); return the names of the accepted added datasets and of those whose
    weight changed (accepted)."""
    theirs = manifest["datasets"]
    problems = []
    added: list[str] = []
    reweighted: list[str] = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            problems.append(
                f"dataset {name!r} is in the checkpoint but not in this pipeline (its "
                f"datasets: checkpoint {sorted(theirs)}, now {sorted(mine)})"
            )
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
                        f"dataset {name!r}: weight differs (weights: checkpoint {old_w}, now "
                        f"{new_w}; pass allow_weight_changes=True to accept it)"
                    )
            for key in ("fingerprint", "seed", "n_logical_shards", "split"):
                if mine[name].get(key) != theirs[name].get(key):
                    index = _datasets_of(root).get(name) if key == "fingerprint" else None
                    problems.append(
                        dataset_differs(
                            name, key, theirs[name].get(key), mine[name].get(key), manifest, index
                        )  # fmt: skip
                    )
    if problems:
        raise ValueError(
            "cannot restore this loader checkpoint: "
            + "; ".join(problems)
            + ". Restore with the same data, seed and logical shards as the checkpoint"
        )
    if (added or reweighted) and any(
        isinstance(x, Pack) and x.mode == "best_fit" for x in graph_nodes(root)
    ):
        raise ValueError(
            f"cannot change the mix on restore (weights of {reweighted}, added {added}) with "
            "pack_mode='best_fit': its window is rebuilt from many interleave blocks, which "
            "must come out as they did under the checkpoint's weights; restore with the "
            "checkpoint's datasets and weights, or use pack_mode 'concat' or 'pad'"
        )
    return added, reweighted


def _check_graph(where: str, root: BaseNode, graph: dict[str, Any], added: list[str]) -> None:
    """Refuse a saved worker graph state ``graph`` that does not fit this pipeline (graph
    ``root``), before anything is restored: curriculum phases in other places
    (:func:`_check_phases`), a node present on one side only (:func:`_check_shape`: a shuffle
    buffer, a budget, transforms), a setting its state depends on changed
    (:func:`~torchdata_ext.state.settings.check_graph_settings`: the mix, BOS/EOS, the
    tokenizer..., and block_docs with pack_mode best_fit). ``added``: datasets added since the checkpoint (accepted)."""
    _check_phases(where, root, graph)
    mine = root.state_dict()
    _check_shape(where, graph, mine, added)
    if any(isinstance(x, Pack) and x.mode == "best_fit" for x in graph_nodes(root)):
        note = {"block_docs": "with pack_mode='best_fit', whose window replays several blocks"}
        check_graph_settings(graph, mine, where, notes=note)
    else:  # the readers read the replayed block at the saved size, then at the new one
        check_graph_settings(graph, mine, where, may_differ={"block_docs"})


def _shape(graph: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    """What of a graph state's shape a restore needs to find again, by the config field that
    decides it (paths through a dataset in ``skip`` are left out)."""

    def kept(paths: Any) -> list[tuple]:
        return sorted((p for p in paths if not skip & {str(k) for k in p}), key=str)

    nodes = list(walk_state(graph, prune=is_reader_state))
    return {
        "shuffle_buffer": len(shuffle_states(graph)),
        "max_tokens / max_documents (the budgets, by name)": sorted(
            str(st["name"]) for p, st in budget_states(graph).items() if p in kept([p])
        ),
        "transforms": len(
            kept(p for p, x in nodes if isinstance(x, dict) and set(x) >= {"source", "skip"})
        ),
        "tokenizer (Tokenize nodes)": len(kept(p for p, x in nodes if _tokenizes(x))),
        "the pipeline's graph (the places of its readers)": kept(reader_states(graph)),
    }


def _tokenizes(state: Any) -> bool:
    """Whether ``state`` is a Tokenize node's (its settings name a tokenizer)."""
    settings = state.get(SETTINGS_KEY) if isinstance(state, dict) else None
    return isinstance(settings, dict) and "tokenizer" in settings


_SHAPE_HINT = {
    "shuffle_buffer": "a shuffle buffer is in the graph when shuffle_buffer > 1",
    "max_tokens / max_documents (the budgets, by name)": "a budget (Take) is in the graph "
    "when max_tokens / max_documents (or a phase's) is set",
    "transforms": "a TransformDocuments node is in the graph for each dataset with transforms",
    "tokenizer (Tokenize nodes)": "a Tokenize node is in the graph for each dataset when "
    "tokenizer is set, for token data too",
    "the pipeline's graph (the places of its readers)": "the nodes between the loader and "
    "the readers differ",
}


def _check_shape(where: str, graph: dict[str, Any], mine: dict[str, Any], added: list[str]) -> None:
    """Refuse a saved graph state whose nodes are not this pipeline's (a node on one side
    only), naming the config field that put it there; without this the first node whose
    child differs fails reading its child's state with a bare KeyError."""
    theirs, ours = _shape(graph, set(added)), _shape(mine, set(added))
    for field, then in theirs.items():
        if then != ours[field]:
            raise ValueError(
                f"cannot restore {where}: the checkpoint's pipeline has other nodes than this "
                f"one: {field} differs (checkpoint {_shown(then)}, now {_shown(ours[field])}; "
                f"{_SHAPE_HINT[field]}). A node cannot be added or removed across a "
                f"checkpoint: restore with the checkpoint's {field.split(' (')[0]}, or start a "
                "new run"
            )


def _shown(value: Any) -> str:
    """A shape value as a message shows it (node counts, budget names, reader places)."""
    if isinstance(value, int):
        return f"{value} node{'s' * (value != 1)}"
    if value and isinstance(value[0], tuple):
        return "readers at " + ", ".join("/".join(map(str, p)) for p in value[:3])
    return repr(value)


def _check_phases(url: str, root: BaseNode, graph: dict[str, Any]) -> None:
    """Refuse a checkpoint whose curriculum phases read other datasets than this pipeline's
    phases in the same places: a phase's state and budget are matched by its place, so
    phases listed in another order would restore one phase's state into another (the
    readers and mixes would refuse it, but a rescale would hand one phase's budget to another)."""
    theirs = phase_datasets(graph)
    now = phase_datasets(root.state_dict())
    if bool(theirs) != bool(now):
        raise ValueError(
            f"cannot restore {url}: phases differ: the checkpoint's pipeline has "
            f"{len(theirs)} curriculum phases, this one {len(now)}; a curriculum cannot be "
            "added or removed across a checkpoint: restore with the checkpoint's phases, or "
            "start a new run"
        )
    saved = {n for names in theirs.values() for n in names}  # datasets added since: not matched
    mine = {
        k: kept
        for k, names in phase_datasets(root.state_dict()).items()
        if (kept := [n for n in names if n in saved])
    }
    differ = [
        f"phase {k[-1]}: checkpoint {theirs.get(k)}, now {mine.get(k)}"
        for k in sorted(set(mine) | set(theirs), key=str)
        if mine.get(k) != theirs.get(k)
    ]
    if differ:
        raise ValueError(
            f"cannot restore {url}: its curriculum phases read other datasets "
            f"({'; '.join(differ)}); list the phases in the checkpoint's order"
        )


def dataset_differs(
    name: str,
    key: str,
    saved: Any,
    now: Any,
    manifest: dict[str, Any],
    index: DatasetIndex | None = None,
) -> str:
    """The one description of dataset ``name`` differing from a checkpoint in ``key``
    (``"fingerprint"``, ``"seed"``, ``"n_logical_shards"``, ``"split"``), used by
    :func:`restore_loader` (folder and DCP checkpoints) and
    :func:`~torchdata_ext.audit.report.audit_checkpoint`: for the fingerprint, the files
    missing, added or resized since the save are named (from the listing of ``index``, the
    dataset now, against the manifest's recorded file fingerprints)."""
    what = {"fingerprint": "files or document counts", "split": "held-out split"}.get(key, key)
    listed = ""
    recorded = manifest.get("file_fingerprints", {}).get("datasets", {}).get(name)
    if key == "fingerprint" and recorded is not None and index is not None:
        changes = listed_changes(recorded, index)
        listed = f"; changed files: {describe({name: changes})}" if changes else ""
    return f"dataset {name!r}: {what} differ (checkpoint {key}={saved!r}, now {now!r}{listed})"


def _datasets_of(root: BaseNode) -> dict[str, DatasetIndex]:
    """The datasets a graph reads, by name."""
    return {n.dataset.name: n.dataset for n in graph_nodes(root) if isinstance(n, ShardReader)}


_config_by_loader: weakref.WeakKeyDictionary[
    TokenLoader, tuple[dict[str, DatasetIndex], dict[str, Any]]
] = weakref.WeakKeyDictionary()


def loader_config(loader: TokenLoader) -> tuple[dict[str, DatasetIndex], dict[str, Any]]:
    """The datasets ``loader``'s pipeline reads, by name, and its summary as configured (see
    :func:`_configured`): found once per loader (building its graph lists the data, a request
    per folder on an object store), not at every checkpoint. Only the weights change during
    a run (``set_weights``, ``weight_schedule``): the summary gives the weights in force."""
    found = _config_by_loader.get(loader)
    if found is None:
        root, summary = _configured(loader)
        found = _config_by_loader[loader] = (_datasets_of(root), summary)
        _reuse_indexes(loader, found[0])  # a restart (set_weights) reads them no more
    cfg = loader.built_config()
    if cfg is None or not loader.weight_points():
        return found
    now = cfg.dataset_weights
    return found[0], {n: {**s, "weight": now.get(n, s["weight"])} for n, s in found[1].items()}


def loader_datasets(loader: TokenLoader) -> dict[str, DatasetIndex]:
    """The datasets ``loader``'s pipeline reads, by name (see :func:`loader_config`)."""
    return loader_config(loader)[0]
