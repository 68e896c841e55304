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
nothing goes through rank 0. The metadata comes from a storage reader: the one given to
``DCPLoaderState(loader, checkpoint_id=...)`` or ``storage_reader=...`` (:func:`reader_for`; the
key from the metadata, :func:`loader_keys`), else the one of the ``dcp.load`` call that is loading
(:func:`loading_from`, a walk up the stack to torch's ``dcp.load`` frame): DCP gives a state
dict's objects no other way to it, and the same call must work as users (and torchtitan's
``CheckpointManager``) write it. The walk reads torch's local variables, so a torch release
may move them; ``tests/test_dcp_rescale.py`` fails then, and a load that needs them raises
saying so (:class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`).
"""

from __future__ import annotations

import inspect
import os
import posixpath
import re
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from torchdata_ext.checkpoint.rescale import old_workers_needed
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.world import World

__all__ = [
    "DCP_METADATA",
    "MANIFEST",
    "LoadInProgress",
    "Topology",
    "checkpoint_name",
    "dcp_loader_call",
    "entries_to_read",
    "entry_files",
    "is_dcp_checkpoint",
    "keys_under",
    "loader_keys",
    "loading_from",
    "read_metadata",
    "reader_for",
    "rank_key",
    "rank_of",
    "topology_of",
    "worker_key",
    "worker_of",
]

MANIFEST = "manifest"
DCP_METADATA = ".metadata"
"""The file of a DCP checkpoint folder that lists its entries (written last by ``dcp.save``)."""
_RANK = re.compile(r"rank_(\d{5})")
_WORKER = re.compile(r"worker_(\d{6})")
_LOAD_CODE = inspect.unwrap(state_dict_loader.load).__code__
_LOADER_MODULE = state_dict_loader.__name__

Topology = tuple[int, int]
"""``(ranks, workers per rank)`` when a checkpoint was taken."""


def rank_key(r: int) -> str:
    """Rank ``r``'s entry."""
    return f"rank_{r:05d}"


def worker_key(g: int) -> str:
    """Global worker ``g``'s entry."""
    return f"worker_{g:06d}"


@dataclass(frozen=True)
class LoadInProgress:
    """A ``dcp.load`` that :func:`loading_from` found on the stack."""

    reader: dcp.StorageReader | None
    """Its storage reader; None when its frame does not hold it where torch kept it (a torch
    release that renamed its local variables)."""
    key: str | None
    """The key of the state object in its state dict; None when that is not a top-level value
    (or the state dict was not found either)."""


def loading_from(owner: object) -> LoadInProgress | None:
    """When called (at any depth) from a ``dcp.load``: what that call's frame shows of its
    storage reader and of ``owner``'s key in its state dict (``owner``: a top-level value of
    it); else None (``dcp.save``, ``dcp.async_save``, or a direct call).

    The frame is torch's ``dcp.load`` (its code object), or failing that any frame of its
    module (a release that wraps it otherwise); its local variables ``storage_reader`` and
    ``state_dict`` are read, as the installed torch lays them out (which
    ``tests/test_dcp_rescale.py`` checks)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LOAD_CODE or frame.f_globals.get("__name__") == _LOADER_MODULE:
            local = frame.f_locals
            reader, state = local.get("storage_reader"), local.get("state_dict")
            key = (
                next((str(k) for k, v in state.items() if v is owner), None)
                if isinstance(state, dict)
                else None
            )
            return LoadInProgress(reader if isinstance(reader, dcp.StorageReader) else None, key)
        frame = frame.f_back
    return None


def reader_for(
    checkpoint_id: str | os.PathLike[str] | None,
    storage_reader: dcp.StorageReader | None,
    storage_options: dict[str, Any] | None = None,
) -> dcp.StorageReader:
    """The storage reader ``dcp.load(checkpoint_id=..., storage_reader=...)`` would use: the
    one given (moved to ``checkpoint_id`` when both are), else a ``FileSystemReader`` for a
    local path or an ``FsspecReader`` for an fsspec URL (given ``storage_options``: an
    ``FsspecReader`` with them, to pass to ``dcp.load`` as ``storage_reader=`` alone, since a
    ``checkpoint_id`` there would reset it without them)."""
    if storage_reader is not None:
        if checkpoint_id is not None:
            storage_reader.reset(checkpoint_id)
        return storage_reader
    if checkpoint_id is None:
        raise ValueError("pass the checkpoint to read: checkpoint_id=... or storage_reader=...")
    if storage_options:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(checkpoint_id, **storage_options)
    targets: list[type[dcp.StorageReader]] = [dcp.FileSystemReader]
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        targets.append(FsspecReader)
    except ImportError:  # pragma: no cover - fsspec is a dependency
        pass
    for target in targets:
        if target.validate_checkpoint_id(checkpoint_id):
            reader = target(checkpoint_id)  # type: ignore[call-arg]
            reader.reset(checkpoint_id)
            return reader
    raise ValueError(
        f"no DCP storage reader reads {str(checkpoint_id)!r}: pass storage_reader=... instead"
    )


def checkpoint_name(reader: dcp.StorageReader) -> str:
    """The checkpoint ``reader`` reads, as errors name it (its path, where it has one)."""
    path = getattr(reader, "path", None)
    return f"DCP checkpoint {path}" if path else "the DCP checkpoint"


def read_metadata(reader: dcp.StorageReader) -> Any:
    """``reader.read_metadata()``, a missing or damaged ``.metadata`` named.

    Raises:
        FileNotFoundError: no ``.metadata`` (a save that did not finish, a file removed).
        ValueError: a ``.metadata`` that cannot be read (truncated, damaged).
    """
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{checkpoint_name(reader)} has no {DCP_METADATA}: its save did not finish or the "
            "file was removed; restore from another checkpoint"
        ) from None
    except Exception as exc:  # a damaged pickle fails in many ways
        raise ValueError(
            f"{checkpoint_name(reader)} is damaged: its {DCP_METADATA} cannot be read "
            f"({type(exc).__name__}: {exc}); restore from another checkpoint"
        ) from None


def entry_files(metadata: Any, key: str) -> dict[str, str]:
    """Per entry under ``key`` of a DCP ``Metadata``, the data file (``.distcp``) holding it,
    where the metadata says."""
    out = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        fqn, path = str(getattr(index, "fqn", "")), getattr(info, "relative_path", None)
        if fqn.startswith(key + ".") and path:
            out[fqn[len(key) + 1 :]] = str(path)
    return out


def loader_keys(metadata: Any) -> list[str]:
    """The keys under which a DCP checkpoint (its ``Metadata``) holds loader states: those of a
    ``manifest`` entry, or of ``rank_*`` entries for states saved before manifests."""
    found = set()
    for fqn, meta in metadata.state_dict_metadata.items():
        head, _, tail = fqn.rpartition(".")
        is_loader_entry = tail == MANIFEST or _RANK.fullmatch(tail)
        if head and is_loader_entry and isinstance(meta, BytesStorageMetadata):
            found.add(head)
    return sorted(found)


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


def no_loader_state(metadata: Any, key: str | None) -> str:
    """Why a ``dcp.load`` cannot restore a loader from the checkpoint of ``metadata``: it holds
    no loader state under ``key`` (None: under any key), with what it does hold."""
    held = loader_keys(metadata)
    tops = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
    shown = ", ".join(map(repr, tops[:8])) + (", ..." if len(tops) > 8 else "")
    where = f"under the key {key!r}" if key is not None else "under any key"
    if held:
        fix = f"its loader state is under {held}: give DCPLoaderState that key in dcp.load's state dict"
    else:
        fix = (
            "it was saved without DCPLoaderState(loader) in dcp.save's state dict; start the "
            "loader fresh (leave DCPLoaderState out of this load) or load a checkpoint saved with it"
        )
    return f"the DCP checkpoint holds no loader state {where} (its keys: {shown or 'none'}); {fix}"


def keys_under(metadata: Any, prefix: str) -> list[str]:
    """The keys of a DCP ``Metadata`` under ``prefix`` (without it)."""
    head = prefix + "."
    return [k[len(head) :] for k in metadata.state_dict_metadata if k.startswith(head)]


def is_dcp_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a ``torch.distributed.checkpoint`` folder (it holds DCP's
    ``.metadata``), e.g. to name it when a loader checkpoint folder was expected."""
    fs, path = filesystem(url, storage_options)
    try:
        return bool(fs.isfile(posixpath.join(path, DCP_METADATA)))
    except OSError:
        return False


def dcp_loader_call(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """The ``dcp.load`` call that restores a loader from DCP checkpoint ``url``, under the key
    its loader state has there (``"loader"`` when it cannot be listed; several are listed)."""
    try:
        keys = loader_keys(read_metadata(reader_for(url, None, storage_options)))
    except Exception:  # an unreadable listing: the call is still the way out
        keys = []
    key = keys[0] if len(keys) == 1 else "loader"
    several = f" (under one of its loader keys {keys})" if len(keys) > 1 else ""
    return f"dcp.load({{{key!r}: DCPLoaderState(loader)}}, checkpoint_id={url!r}){several}"
