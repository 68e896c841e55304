"""The loader state inside a ``torch.distributed.checkpoint`` (DCP): :class:`DCPLoaderState`.

``dcp.save`` stores it as entries next to the model's (a manifest, one per rank, one per worker:
:mod:`torchdata_ext.checkpoint.dcp_entries` says how they lie and which a rank reads back);
``dcp.load`` restores it at any number of ranks x workers through the restore folder checkpoints
use (:func:`~torchdata_ext.checkpoint.restore.restore_loader`: the same checks, the same rescale).
"""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torchdata_ext.checkpoint import dcp_entries
from torchdata_ext.checkpoint.dcp_read import entry_name, merged_shares
from torchdata_ext.checkpoint.dcp_seal import seal, unseal
from torchdata_ext.checkpoint.restore import (
    CHECKPOINT_FORMAT,
    loader_config,
    loader_datasets,
    restore_loader,
)
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader
from torchdata_ext.sources.fingerprint import SAMPLE_BYTES, check_share, fingerprint_share

__all__ = ["DCPLoaderState"]

logger = logging.getLogger(__name__)


class DCPLoaderState:
    """Put the loader state into the same ``torch.distributed.checkpoint`` as the model, and
    restore it from there at any number of ranks x workers.

    ``dcp.save({"model": ..., "optim": ..., "data": DCPLoaderState(loader)}, checkpoint_id=...)``
    stores a manifest (topology and datasets, once), an entry per rank and an entry per worker
    (see :mod:`torchdata_ext.checkpoint.dcp_entries`); ranks never overwrite each other.
    ``dcp.load({..., "data": DCPLoaderState(loader)}, checkpoint_id=...)`` restores it, on the
    same topology or another (more or fewer ranks, other workers, 0 included), with the
    guarantees of :func:`~torchdata_ext.checkpoint.folder.load_checkpoint`: each rank reads
    only the manifest, the entries of the old workers that owned its logical shards and a share
    of the rank entries; the old workers' in-flight data is handed on
    (:mod:`torchdata_ext.checkpoint.rescale`), and a checkpoint of other data, seed or logical
    shards is refused, saying why. Works with any DCP storage
    (``FileSystemWriter``/``Reader``, ``FsspecWriter``/``Reader`` on ``s3://``...).

    Each rank also records the fingerprints of its share of the data files (every
    ``world_size``-th file: :func:`~torchdata_ext.sources.fingerprint.fingerprint_share`); a load refuses
    a data file changed in place since, naming it, on every rank (new rank ``r`` checks the
    shares of old ranks ``r, r + world_size, ...``). A state saved before fingerprints were
    recorded loads unchecked; one saved before entries per worker (one ``rank_*`` entry per
    rank) restores on the same topology only.

    To know which entries to ask ``dcp.load`` for, a rank needs the checkpoint's list of keys
    (its old topology). By default it takes it from the storage reader of the ``dcp.load`` in
    progress, found up the stack (:func:`~torchdata_ext.checkpoint.dcp_entries.loading_from`),
    so the call stays the one users and torchtitan write. Given ``checkpoint_id`` or
    ``storage_reader``, it reads the list from there instead, before ``dcp.load`` reads the
    entries, with no look at torch's frames:
    ``dcp.load({"data": DCPLoaderState(loader, checkpoint_id=path)}, checkpoint_id=path)``.
    Such an object is for loading only (its :meth:`state_dict` is the load template).

    Args:
        loader: the loader whose state is saved and restored (restore before iterating).
        allow_weight_changes / allow_new_datasets / allow_changed_files: as for
            :func:`~torchdata_ext.checkpoint.folder.load_checkpoint`.
        checkpoint_id: the checkpoint ``dcp.load`` reads (a path or an fsspec URL): list its
            keys from there (``FileSystemReader`` / ``FsspecReader``, as ``dcp.load`` picks).
        storage_reader: the same with a reader of your own (S3 credentials...); the one given
            to ``dcp.load`` may be passed.
        key: this object's key in the state dict given to ``dcp.load``; default: the one key
            under which the checkpoint holds a loader state (needed when it holds several).
    """

    def __init__(
        self,
        loader: TokenLoader,
        *,
        allow_weight_changes: bool = False,
        allow_new_datasets: bool = False,
        allow_changed_files: bool = False,
        checkpoint_id: str | os.PathLike[str] | None = None,
        storage_reader: dcp.StorageReader | None = None,
        key: str | None = None,
    ) -> None:
        self.loader = loader
        self.allow_weight_changes = allow_weight_changes
        self.allow_new_datasets = allow_new_datasets
        self.allow_changed_files = allow_changed_files
        self.key = key
        self.reader = (
            dcp_entries.reader_for(checkpoint_id, storage_reader)
            if checkpoint_id is not None or storage_reader is not None
            else None
        )
        self._listed = False  # the last state_dict() listed the checkpoint's keys
        # the checkpoint, key and data files the entries come from (errors name them)
        self._source: tuple[str | None, str | None, dict[str, str]] = (None, None, {})

    def state_dict(self, owner: object | None = None) -> dict[str, Any]:
        """What DCP stores, or fills in, by who asks: the load template (:meth:`load_template`)
        when this object was given its checkpoint (``checkpoint_id`` / ``storage_reader``) or
        is asked from inside ``dcp.load`` (found by
        :func:`~torchdata_ext.checkpoint.dcp_entries.loading_from`); else the save payload
        (:meth:`save_payload`). A ``dcp.load`` whose storage reader the lookup cannot find
        gets this rank's own entries, with a warning: they restore on the same topology, and
        :meth:`load_state_dict` refuses another one, saying so.

        Args:
            owner: the object the user's state dict holds, when this one works for it (the
                torchtitan data loader); default: this object.
        """
        if self.reader is not None:
            return self.load_template(self.reader, self.key)
        found = dcp_entries.loading_from(self if owner is None else owner)
        if found is None:
            return self.save_payload()
        if found.reader is not None and found.key is not None:
            return self.load_template(found.reader, found.key)
        logger.warning("%s", self._no_reader(None))
        self._listed = False
        W = self.loader.logical_workers
        own = range(self.loader.rank * W, (self.loader.rank + 1) * W)
        return dict.fromkeys(
            [
                dcp_entries.MANIFEST,
                dcp_entries.rank_key(self.loader.rank),
                *map(dcp_entries.worker_key, own),
            ],
            io.BytesIO(),
        )

    def save_payload(self) -> dict[str, Any]:
        """The entries ``dcp.save`` stores for this rank, each a ``BytesIO`` of a pickle (which
        DCP stores as is): the manifest, this rank's entry and one per worker of this rank."""
        self._listed = False
        loader = self.loader
        state = loader.state_dict()
        datasets, summary = loader_config(loader)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "loader_format": STATE_FORMAT,
            "world_size": loader.world_size,
            "num_workers": loader.logical_workers,
            "step": state["step"],
            "skip_steps": state["skip_steps"],
            "weight_changes": state["weight_changes"],
            "weight_schedule": state["weight_schedule"],
            "datasets": summary,
        }
        meta = {
            "next_worker": state["next_worker"],
            "skip_batches": state["skip_batches"],
            "step": state["step"],
            "skip_steps": state["skip_steps"],
            "weight_changes": state["weight_changes"],
            "weight_schedule": state["weight_schedule"],
            "skipped_documents": state["skipped_documents"],
            "mix_history": state["mix_history"],
            "file_fingerprints": fingerprint_share(
                datasets, rank=loader.rank, world_size=loader.world_size
            ),
        }
        out = {
            dcp_entries.MANIFEST: seal(manifest),
            dcp_entries.rank_key(loader.rank): seal(meta),
        }
        for g, st in state["workers"].items():
            out[dcp_entries.worker_key(int(g))] = seal(st)
        return out

    def load_template(self, reader: dcp.StorageReader, key: str | None) -> dict[str, Any]:
        """The entries this rank asks ``dcp.load`` for (empty ``BytesIO`` values it fills in),
        from the list of keys of the checkpoint ``reader`` reads, under ``key`` (None: the one
        key holding a loader state): on the same topology its own, else the manifest, the old
        workers that owned its logical shards and the rank entries it checks."""
        loader = self.loader
        metadata = dcp_entries.read_metadata(reader)
        if key is None:
            held = dcp_entries.loader_keys(metadata)
            if not held:
                raise ValueError(dcp_entries.no_loader_state(metadata, None))
            if len(held) != 1:
                raise ValueError(
                    f"the DCP checkpoint holds {len(held)} loader states (under {held}): pass "
                    "DCPLoaderState(loader, ..., key=...), the key it has in dcp.load's state dict"
                )
            key = held[0]
        keys = dcp_entries.keys_under(metadata, key)
        path = getattr(reader, "path", None)
        self._source = (str(path) if path else None, key, dcp_entries.entry_files(metadata, key))
        if not any(k == dcp_entries.MANIFEST or dcp_entries.rank_of(k) is not None for k in keys):
            raise ValueError(dcp_entries.no_loader_state(metadata, key))
        old = dcp_entries.topology_of(keys)
        self._listed = True
        if old is None:  # saved before entries per worker: this rank's entry, same topology
            return {dcp_entries.rank_key(loader.rank): io.BytesIO()}
        shards = {d["n_logical_shards"] for d in loader_config(loader)[1].values()}
        entries = dcp_entries.entries_to_read(
            old, min(shards), loader.rank, loader.world_size, loader.logical_workers
        )
        return dict.fromkeys(entries, io.BytesIO())

    def _no_reader(self, saved: tuple[int, int] | None) -> str:
        """Why this rank cannot list the checkpoint's keys, and the way out."""
        loader = self.loader
        now = f"{loader.world_size} ranks x {loader.logical_workers} workers"
        what = (
            f"cannot restore the loader state saved at {saved[0]} ranks x {saved[1]} workers "
            f"on {now}: that needs the entries of the old workers this rank succeeds"
            if saved is not None
            else f"dcp.load is loading the loader state on {now}"
        )
        return (
            f"{what}, but DCPLoaderState found no storage reader of a dcp.load in progress to "
            "list the checkpoint's keys (the lookup reads the local variables of torch's "
            f"dcp.load frame, which torch {torch.__version__} may no longer lay out as "
            "torchdata_ext.checkpoint.dcp_entries.loading_from expects; or its state_dict() was "
            "not called by dcp.load, or not as a top-level value of its state dict), so it "
            "asked for this rank's own entries, which restore on the same topology only. "
            "Pass the checkpoint explicitly: dcp.load({..., key: DCPLoaderState(loader, "
            "checkpoint_id=...)}, checkpoint_id=...), or storage_reader=... for a reader of "
            "your own"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader from the entries ``dcp.load`` read (see :meth:`state_dict`).

        Raises:
            ChangedFilesError: a data file changed since the save (see the class).
            ValueError: a checkpoint of other data, seed or logical shards (saying which),
                entries this rank needs are missing, or a checkpoint of another topology whose
                keys :meth:`state_dict` could not list (no storage reader found: the message
                names the installed torch and the way out, ``checkpoint_id=``).
        """
        if dcp_entries.MANIFEST not in state:
            self._load_single(state)
            return
        entries = {
            k: unseal(v, entry_name(*self._source[:2], k, self._source[2]))
            for k, v in state.items()
        }
        where = "the loader state in the DCP checkpoint"
        loader = self.loader
        manifest = entries[dcp_entries.MANIFEST]
        saved = (int(manifest["world_size"]), int(manifest["num_workers"]))
        if not self._listed and saved != (loader.world_size, loader.logical_workers):
            raise ValueError(self._no_reader(saved))

        def entry(key: str) -> dict[str, Any]:
            try:
                return entries[key]
            except KeyError:
                raise ValueError(
                    f"{where} was loaded without its entry {key!r}: restore through "
                    "dcp.load({..., key: DCPLoaderState(loader)}), which reads the entries this "
                    "rank needs"
                ) from None

        shares = [
            m["file_fingerprints"]
            for k, m in entries.items()
            if (r := dcp_entries.rank_of(k)) is not None and r % loader.world_size == loader.rank
        ]
        recorded = (
            {"sample_bytes": shares[0]["sample_bytes"],
             "datasets": merged_shares(s["datasets"] for s in shares)}
            if shares
            else {"sample_bytes": SAMPLE_BYTES, "datasets": {}}
        )  # fmt: skip
        restore_loader(
            loader,
            {**entry(dcp_entries.MANIFEST), "file_fingerprints": recorded},
            where,
            rank_meta=lambda r: entry(dcp_entries.rank_key(r)),
            worker=lambda g, _meta: entry(dcp_entries.worker_key(g))["graph"],
            check_files=lambda datasets, _reads, listed_since: check_share(
                recorded,
                datasets,
                world_size=loader.world_size,
                allow_changed_files=self.allow_changed_files,
                where=where,
                listed_since=listed_since,
            ),
            allow_weight_changes=self.allow_weight_changes,
            allow_new_datasets=self.allow_new_datasets,
        )

    def _load_single(self, state: dict[str, Any]) -> None:
        """A state saved before entries per worker: the whole loader state of each rank under
        its ``rank_*`` key (with its file fingerprints, or alone before those)."""
        key = dcp_entries.rank_key(self.loader.rank)
        try:
            raw = state[key]
        except KeyError:
            raise ValueError(
                f"the checkpoint has no loader state for {key}; it was saved by an earlier "
                "version with another number of ranks, which restores on its own topology only"
            ) from None
        payload = unseal(raw, entry_name(*self._source[:2], key, self._source[2]))
        if "loader" not in payload:  # saved before fingerprints: the loader state alone
            payload = {"loader": payload, "file_fingerprints": None}
        loader = self.loader
        began = time.time()
        check_share(
            payload["file_fingerprints"],
            loader_datasets(loader),
            world_size=loader.world_size,
            allow_changed_files=self.allow_changed_files,
            where=f"the loader state of {key} in the DCP checkpoint",
            listed_since=began,
        )
        loader.load_state_dict(payload["loader"])
