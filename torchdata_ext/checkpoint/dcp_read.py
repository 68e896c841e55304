"""A loader state inside a ``torch.distributed.checkpoint`` (DCP) read whole, for tools that
look at a whole checkpoint (the audit): the same manifest and worker states a checkpoint
folder gives (:func:`~torchdata_ext.checkpoint.folder.read_manifest`,
:func:`~torchdata_ext.checkpoint.folder.read_worker_states`), read from the entries
:mod:`torchdata_ext.checkpoint.dcp_entries` describes with torch's own reader (``dcp.load`` of
a state dict of those entries, ``no_dist``: this process alone, never a collective).

The manifest is the DCP manifest entry, with the data files' fingerprints every rank recorded
(its share) merged under ``"file_fingerprints"``, as a folder's manifest holds them. A state
saved before entries per worker (one whole loader state per ``rank_*`` entry, no manifest) is
not read: it is refused, saying so.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from torch.distributed.checkpoint.api import CheckpointException

from torchdata_ext.checkpoint import dcp_entries
from torchdata_ext.checkpoint.dcp_seal import damaged, unseal
from torchdata_ext.checkpoint.folder import checked_format, worker_states
from torchdata_ext.world import World

__all__ = [
    "entry_name",
    "loader_key",
    "merged_shares",
    "read_dcp_manifest",
    "read_dcp_worker_states",
]


def entry_name(url: str | None, key: str | None, name: str, files: dict[str, str]) -> str:
    """Entry ``name`` of the loader state under ``key`` as errors name it, with its data file
    and checkpoint where known."""
    out = f"entry {key}.{name}" if key else f"entry {name}"
    if name in files:
        out += f" (in {files[name]})"
    return out + (f" of DCP checkpoint {url}" if url else " of the DCP checkpoint")


def merged_shares(shares: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rank shares of file fingerprints (``{dataset: {file: fingerprint}}``) as one."""
    out: dict[str, dict[str, Any]] = {}
    for share in shares:
        for name, files in share.items():
            out.setdefault(name, {}).update(files)
    return out


def loader_key(metadata: Any, key: str | None, url: str) -> str:
    """The key of the loader state to read in DCP checkpoint ``url`` (its ``Metadata``):
    ``key``, or the one key holding a loader state when ``key`` is None.

    Raises:
        ValueError: no loader state there, ``key`` not one of them, or several and no ``key``
            (the keys listed).
    """
    held = dcp_entries.loader_keys(metadata)
    if not held:
        raise ValueError(
            f"DCP checkpoint {url} holds no loader state (no entry saved by "
            "DCPLoaderState): pass a checkpoint saved with dcp.save({..., key: "
            "DCPLoaderState(loader)})"
        )
    if key is None:
        if len(held) > 1:
            raise ValueError(
                f"DCP checkpoint {url} holds {len(held)} loader states, under the keys {held}: "
                "pick one with key=... (the audit command's --key)"
            )
        return held[0]
    if key not in held:
        raise ValueError(
            f"DCP checkpoint {url} holds no loader state under key={key!r}: its loader keys "
            f"are {held}; pass one of them"
        )
    return key


class _Entries:
    """The entries of the loader state under one key of a DCP checkpoint, read on demand."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, key: str | None):
        self.url = url
        self.storage_options = storage_options
        metadata = dcp_entries.read_metadata(dcp_entries.reader_for(url, None, storage_options))
        self.key = loader_key(metadata, key, url)
        self.names = set(dcp_entries.keys_under(metadata, self.key))
        self.files = dcp_entries.entry_files(metadata, self.key)
        self.where = f"the loader state under {self.key!r} in DCP checkpoint {url}"

    def read(self, names: list[str]) -> dict[str, Any]:
        """The objects of entries ``names`` (unpickled)."""
        missing = [n for n in names if n not in self.names]
        if missing:
            raise ValueError(
                f"{self.where} has no entries {missing}: its save did not finish or it was "
                "damaged; audit another checkpoint"
            )
        state = {self.key: {n: io.BytesIO() for n in names}}
        reader = dcp_entries.reader_for(self.url, None, self.storage_options)
        try:
            with warnings.catch_warnings():  # this process alone, as intended: no warning
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=reader, no_dist=True)
        except CheckpointException as exc:  # a truncated or damaged data file
            raise damaged(self.url, exc, sorted({self.files.get(n, n) for n in names})) from None
        return {
            name: unseal(raw, entry_name(self.url, self.key, name, self.files))
            for name, raw in state[self.key].items()
        }

    def manifest(self) -> dict[str, Any]:
        """The manifest, with every rank's share of file fingerprints merged in (None when a
        rank recorded none: saved before fingerprints)."""
        if dcp_entries.MANIFEST not in self.names:
            raise ValueError(
                f"{self.where} was saved by an earlier version (one whole loader state per rank, "
                "no manifest), which cannot be audited: restore it with dcp.load({..., key: "
                "DCPLoaderState(loader)}) and save it again"
            )
        ranks, _ = dcp_entries.topology_of(sorted(self.names)) or (0, 0)
        rank_keys = [dcp_entries.rank_key(r) for r in range(ranks)]
        got = self.read([dcp_entries.MANIFEST, *rank_keys])
        manifest = checked_format(dict(got[dcp_entries.MANIFEST]), self.where)
        shares = [got[k].get("file_fingerprints") for k in rank_keys]
        manifest["file_fingerprints"] = (
            None
            if any(s is None for s in shares)
            else {
                "sample_bytes": shares[0]["sample_bytes"],
                "datasets": merged_shares(s["datasets"] for s in shares),
            }
        )
        return manifest


def read_dcp_manifest(
    url: str, storage_options: dict[str, Any] | None = None, *, key: str | None = None
) -> dict[str, Any]:
    """The manifest of the loader state in DCP checkpoint ``url``, as
    :func:`~torchdata_ext.checkpoint.folder.read_manifest` gives a folder's (with the ranks'
    file fingerprints merged under ``"file_fingerprints"``).

    Args:
        url: the DCP checkpoint folder (a path or an fsspec URL).
        storage_options: fsspec options for ``url``.
        key: the loader state's key in the state dict it was saved with; default: the one
            loader state there.

    Raises:
        ValueError: no loader state (or several and no ``key``, listed), a state saved
            before manifests, an unsupported format, or a corrupt entry.
    """
    return _Entries(url, storage_options, key).manifest()


def read_dcp_worker_states(
    url: str, storage_options: dict[str, Any] | None = None, *, key: str | None = None
) -> Iterator[tuple[World, dict[str, Any], dict[str, Any]]]:
    """Every worker's state of the loader state in DCP checkpoint ``url``, rank by rank (one
    ``dcp.load`` per rank), as :func:`~torchdata_ext.checkpoint.folder.read_worker_states`
    yields a folder's: ``(world, rank_meta, graph)``. Arguments as :func:`read_dcp_manifest`."""
    entries = _Entries(url, storage_options, key)
    manifest = entries.manifest()
    workers = int(manifest["num_workers"])
    graphs: dict[int, dict[str, Any]] = {}

    def rank_meta(r: int) -> dict[str, Any]:
        own = {dcp_entries.worker_key(r * workers + w): r * workers + w for w in range(workers)}
        got = entries.read([dcp_entries.rank_key(r), *own])
        graphs.clear()
        graphs.update({g: got[k]["graph"] for k, g in own.items()})
        meta: dict[str, Any] = got[dcp_entries.rank_key(r)]
        return meta

    yield from worker_states(manifest, rank_meta, lambda g, _meta: graphs.pop(g))
