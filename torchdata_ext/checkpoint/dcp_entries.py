"""How a loader's state lies in a ``torch.distributed.checkpoint`` (DCP), and which entries a
rank reads back: the pure part of :class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`.

Entries under the loader's key (``"data"`` in ``dcp.save({"data": DCPLoaderState(loader)})``)::

    data.manifest          topology (ranks, workers) and datasets (fingerprint, seed, logical
                           shards, split, weight): the same on every rank (DCP stores it once)
    data.rank_00003        per rank: next worker, batches since the last snapshot, the rank's
                           share of the data files' fingerprints
    data.worker_000007     per global worker: its graph state

``dcp.load`` reads only the entries its state dict names, so the entries a rank asks for are
its whole read. Inside ``dcp.load`` a rank cannot know them from its own state (another number
of ranks saved other keys), so it reads the checkpoint's metadata (the list of keys), which
gives the old topology (``rank_*`` and ``worker_*`` keys counted), and asks for the manifest,
the old workers that owned its logical shards and the rank entries it checks: nothing else, and
nothing goes through rank 0. The metadata comes from the storage reader of the ``dcp.load`` call
that is loading (:func:`loading_from`): DCP gives a state dict's objects no other way to it, and
the same call must work as users (and torchtitan's ``CheckpointManager``) write it.
"""

from __future__ import annotations

import inspect
import re
import sys
from types import FrameType
from typing import Any

import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from torch.distributed.checkpoint import state_dict_loader

from torchdata_ext.checkpoint.rescale import old_workers_needed
from torchdata_ext.world import World

__all__ = [
    "MANIFEST",
    "Topology",
    "entries_to_read",
    "keys_under",
    "loading_from",
    "rank_key",
    "rank_of",
    "topology_of",
    "worker_key",
    "worker_of",
]

MANIFEST = "manifest"
_RANK = re.compile(r"rank_(\d{5})")
_WORKER = re.compile(r"worker_(\d{6})")
_LOAD_CODE = inspect.unwrap(state_dict_loader.load).__code__

Topology = tuple[int, int]
"""``(ranks, workers per rank)`` when a checkpoint was taken."""


def rank_key(r: int) -> str:
    """Rank ``r``'s entry."""
    return f"rank_{r:05d}"


def worker_key(g: int) -> str:
    """Global worker ``g``'s entry."""
    return f"worker_{g:06d}"


def loading_from(owner: object) -> tuple[dcp.StorageReader, str] | None:
    """When called (at any depth) from a ``dcp.load`` whose state dict holds ``owner`` as a
    top-level value: that call's storage reader and ``owner``'s key; else None (``dcp.save``,
    ``dcp.async_save``, or a direct call)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LOAD_CODE:
            local = frame.f_locals
            reader, state = local.get("storage_reader"), local.get("state_dict")
            if reader is None or not isinstance(state, dict):
                return None
            return next(((reader, str(k)) for k, v in state.items() if v is owner), None)
        frame = frame.f_back
    return None


def topology_of(keys: list[str]) -> Topology | None:
    """The old topology from the entries' keys (under the loader's key), or None when there is
    no manifest (a state saved before entries per worker: one ``rank_*`` entry each)."""
    if MANIFEST not in keys:
        return None
    ranks = sum(1 for k in keys if _RANK.fullmatch(k))
    workers = sum(1 for k in keys if _WORKER.fullmatch(k))
    if ranks == 0 or workers % ranks:
        raise ValueError(
            f"the loader entries of this DCP checkpoint are incomplete ({ranks} rank and "
            f"{workers} worker entries): restore from another checkpoint"
        )
    return ranks, workers // ranks


def entries_to_read(
    old: Topology, n_logical_shards: int, rank: int, world_size: int, num_workers: int
) -> list[str]:
    """The entries new rank ``rank`` (of ``world_size``, ``num_workers`` workers each) reads:
    the manifest, the workers of the same rank on the same topology or else the old workers that
    owned its workers' logical shards, their ranks' entries, and the rank entries whose file
    fingerprints it checks (old rank ``r`` is checked by new rank ``r % world_size``)."""
    old_ranks, old_workers = old
    if old == (world_size, num_workers):
        workers = [rank * num_workers + w for w in range(num_workers)]
    else:
        try:
            workers = sorted(
                {
                    g
                    for w in range(num_workers)
                    for g in old_workers_needed(
                        n_logical_shards,
                        old_ranks * old_workers,
                        World(rank, world_size, w, num_workers),
                    )
                }
            )
        except ValueError:  # other logical shards: the manifest check refuses, saying why
            workers = []
    ranks = {g // old_workers for g in workers} | set(range(rank, old_ranks, world_size))
    return [MANIFEST, *(rank_key(r) for r in sorted(ranks)), *(worker_key(g) for g in workers)]


def rank_of(key: str) -> int | None:
    """The rank of a ``rank_*`` key, else None."""
    m = _RANK.fullmatch(key)
    return int(m.group(1)) if m else None


def worker_of(key: str) -> int | None:
    """The global worker of a ``worker_*`` key, else None."""
    m = _WORKER.fullmatch(key)
    return int(m.group(1)) if m else None


def keys_under(metadata: Any, prefix: str) -> list[str]:
    """The keys of a DCP ``Metadata`` under ``prefix`` (without it)."""
    head = prefix + "."
    return [k[len(head) :] for k in metadata.state_dict_metadata if k.startswith(head)]
