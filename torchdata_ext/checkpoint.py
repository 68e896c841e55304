"""Checkpoints of the loader: a folder on any fsspec URL, or inside a DCP checkpoint.

Folder layout (``url/``)::

    manifest.json            format, topology (ranks, workers), logical shards, fingerprints
    rank_00000.json          per rank: which logical worker produces the next batch
    worker_000000.pkl        per global worker: its graph state (pickled plain data)

Every file is written atomically (:func:`torchdata_ext.remote.write_bytes_atomic`), so a kill
never leaves a half-written file; the manifest is written last (after a barrier when
``torch.distributed`` is initialised), so a folder without a manifest is an incomplete
checkpoint and is refused. A save into a folder that holds a checkpoint first removes its
manifest, so a save that fails or is killed half-way never leaves the old manifest over a mix
of old and new files (the old checkpoint is lost then: save each step into its own folder to
always keep the last complete one).

Restoring onto another number of ranks x workers (:func:`load_checkpoint`): each new worker
reads only the old workers' files it needs (the old owners of its logical shards) and
:mod:`torchdata_ext.rescale` plans its state from them (merged reader cursors of its shards,
in-flight data handed back, interleave token counters re-split), so the epoch goes on with
nothing repeated and nothing lost.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import posixpath
from typing import Any

from torchdata.nodes import BaseNode

# graph_nodes, _reader_states and _token_counters are imported from here by examples and tests
from torchdata_ext.graph import graph_nodes as graph_nodes
from torchdata_ext.graph import graph_summary
from torchdata_ext.graph import reader_states as _reader_states  # noqa: F401
from torchdata_ext.graph import token_counters as _token_counters  # noqa: F401
from torchdata_ext.loader import STATE_FORMAT, TokenLoader
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.remote import remove_file, write_bytes_atomic
from torchdata_ext.rescale import old_workers_needed, rescale_worker_states
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


# -- file I/O -----------------------------------------------------------------------------------
def _read(url: str, storage_options: dict[str, Any] | None) -> bytes:
    """The bytes of checkpoint file ``url``; a missing file says the checkpoint is incomplete."""
    fs, path = filesystem(url, storage_options)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint file {url} is missing: the checkpoint is incomplete or from another "
            "topology; pass the folder of a complete checkpoint"
        ) from None


# -- folder checkpoints -------------------------------------------------------------------------------
def save_checkpoint(
    loader: TokenLoader, url: str, *, storage_options: dict[str, Any] | None = None
) -> None:
    """Write this rank's part of the loader checkpoint into folder ``url`` (atomically).

    Call on every rank at the same step. Rank 0 removes the manifest of an earlier checkpoint
    in ``url`` first and writes the new one last, so ``url`` is a complete checkpoint only once
    every rank's files are written.

    Args:
        loader: the loader, at the step to checkpoint.
        url: the checkpoint folder (any fsspec URL; created if missing).
        storage_options: fsspec options for ``url``.
    """
    state = loader.state_dict()
    _start_save(url, loader.rank, storage_options)
    for g, st in state["workers"].items():
        write_bytes_atomic(
            posixpath.join(url, f"worker_{int(g):06d}.pkl"),
            pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL),
            storage_options,
        )
    write_bytes_atomic(
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
        write_bytes_atomic(
            posixpath.join(url, _MANIFEST),
            json.dumps(manifest, indent=1, sort_keys=True).encode(),
            storage_options,
        )
    _barrier()


def _start_save(url: str, rank: int, storage_options: dict[str, Any] | None) -> None:
    """Mark folder ``url`` incomplete before any of its files changes: rank 0 removes the
    manifest of an earlier save there, then every rank waits for that."""
    if rank == 0:
        remove_file(posixpath.join(url, _MANIFEST), storage_options)
    _barrier()


def _barrier() -> None:
    """Wait for every rank when ``torch.distributed`` is initialised (else return at once)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint folder ``url``.

    Raises:
        FileNotFoundError: no manifest (not a checkpoint, or its save did not finish).
        ValueError: a checkpoint format this version does not read.
    """
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


# -- torch.distributed.checkpoint -------------------------------------------------------------------
class DCPLoaderState:
    """Put the loader state into the same ``torch.distributed.checkpoint`` as the model.

    ``dcp.save({"model": ..., "optim": ..., "data": DCPLoaderState(loader)}, checkpoint_id=...)``
    stores each rank's state under its own key (``rank_00003``), so ranks never overwrite each
    other, and ``dcp.load`` restores it on the same topology. (To change the number of ranks or
    workers, save a folder checkpoint with :func:`save_checkpoint` too, and restore with
    :func:`load_checkpoint`.)

    Args:
        loader: the loader whose state is saved and restored (restore before iterating).
    """

    def __init__(self, loader: TokenLoader) -> None:
        self.loader = loader

    def _key(self) -> str:
        """This rank's key in the DCP state."""
        return f"rank_{self.loader.rank:05d}"

    def state_dict(self) -> dict[str, Any]:
        """``{"rank_NNNNN": the pickled loader state}`` (a ``BytesIO``, which DCP stores as is)."""
        buf = io.BytesIO(pickle.dumps(self.loader.state_dict(), protocol=pickle.HIGHEST_PROTOCOL))
        return {self._key(): buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader from what :meth:`state_dict` saved for this rank.

        Raises:
            ValueError: the state has no entry for this rank (saved on other ranks).
        """
        try:
            raw = state[self._key()]
        except KeyError:
            raise ValueError(
                f"the checkpoint has no loader state for {self._key()}; it was saved with "
                "another number of ranks: restore with load_checkpoint from a folder checkpoint"
            ) from None
        data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
        self.loader.load_state_dict(pickle.loads(data))
