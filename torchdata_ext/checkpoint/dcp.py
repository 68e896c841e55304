"""The loader state inside a ``torch.distributed.checkpoint`` (DCP): :class:`DCPLoaderState`.

``dcp.save`` stores it as entries next to the model's (a manifest, one per rank, one per worker:
:mod:`torchdata_ext.checkpoint.dcp_entries` says how they lie and which a rank reads back);
``dcp.load`` restores it at any number of ranks x workers through the restore folder checkpoints
use (:func:`~torchdata_ext.checkpoint.restore.restore_loader`: the same checks, the same rescale).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

from torchdata_ext.checkpoint import dcp_entries
from torchdata_ext.checkpoint.restore import (
    CHECKPOINT_FORMAT,
    loader_config,
    loader_datasets,
    restore_loader,
)
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader
from torchdata_ext.sources.fingerprint import SAMPLE_BYTES, check_share, fingerprint_share

__all__ = ["DCPLoaderState"]


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

    Args:
        loader: the loader whose state is saved and restored (restore before iterating).
        allow_weight_changes / allow_new_datasets / allow_changed_files: as for
            :func:`~torchdata_ext.checkpoint.folder.load_checkpoint`.
    """

    def __init__(
        self,
        loader: TokenLoader,
        *,
        allow_weight_changes: bool = False,
        allow_new_datasets: bool = False,
        allow_changed_files: bool = False,
    ) -> None:
        self.loader = loader
        self.allow_weight_changes = allow_weight_changes
        self.allow_new_datasets = allow_new_datasets
        self.allow_changed_files = allow_changed_files

    def state_dict(self, owner: object | None = None) -> dict[str, Any]:
        """The entries to save (each a ``BytesIO`` of a pickle, which DCP stores as is); inside
        ``dcp.load``, the entries this rank reads (see the class).

        Args:
            owner: the object the user's state dict holds, when this one works for it (the
                torchtitan data loader); default: this object.
        """
        found = dcp_entries.loading_from(self if owner is None else owner)
        if found is not None:
            reader, prefix = found
            return dict.fromkeys(self._entries_to_read(reader, prefix), io.BytesIO())
        loader = self.loader
        state = loader.state_dict()
        datasets, summary = loader_config(loader)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "loader_format": STATE_FORMAT,
            "world_size": loader.world_size,
            "num_workers": loader.logical_workers,
            "datasets": summary,
        }
        meta = {
            "next_worker": state["next_worker"],
            "skip_batches": state["skip_batches"],
            "file_fingerprints": fingerprint_share(
                datasets, rank=loader.rank, world_size=loader.world_size
            ),
        }
        out = {
            dcp_entries.MANIFEST: _pickled(manifest),
            dcp_entries.rank_key(loader.rank): _pickled(meta),
        }
        for g, st in state["workers"].items():
            out[dcp_entries.worker_key(int(g))] = _pickled(st)
        return out

    def _entries_to_read(self, reader: Any, prefix: str) -> list[str]:
        """The keys this rank asks ``dcp.load`` for, from the checkpoint's list of keys."""
        loader = self.loader
        keys = dcp_entries.keys_under(reader.read_metadata(), prefix)
        old = dcp_entries.topology_of(keys)
        if old is None:  # saved before entries per worker: this rank's entry, same topology
            return [dcp_entries.rank_key(loader.rank)]
        shards = {d["n_logical_shards"] for d in loader_config(loader)[1].values()}
        return dcp_entries.entries_to_read(
            old, min(shards), loader.rank, loader.world_size, loader.logical_workers
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader from the entries ``dcp.load`` read (see :meth:`state_dict`).

        Raises:
            ChangedFilesError: a data file changed since the save (see the class).
            ValueError: a checkpoint of other data, seed or logical shards (saying which), or
                entries this rank needs are missing.
        """
        if dcp_entries.MANIFEST not in state:
            self._load_single(state)
            return
        entries = {k: _unpickled(v) for k, v in state.items()}
        where = "the loader state in the DCP checkpoint"
        loader = self.loader

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
             "datasets": _merged_shares(s["datasets"] for s in shares)}
            if shares
            else {"sample_bytes": SAMPLE_BYTES, "datasets": {}}
        )  # fmt: skip
        restore_loader(
            loader,
            {**entry(dcp_entries.MANIFEST), "file_fingerprints": recorded},
            where,
            rank_meta=lambda r: entry(dcp_entries.rank_key(r)),
            worker=lambda g, _meta: entry(dcp_entries.worker_key(g))["graph"],
            check_files=lambda datasets: check_share(
                recorded,
                datasets,
                world_size=loader.world_size,
                allow_changed_files=self.allow_changed_files,
                where=where,
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
        payload = _unpickled(raw)
        if "loader" not in payload:  # saved before fingerprints: the loader state alone
            payload = {"loader": payload, "file_fingerprints": None}
        loader = self.loader
        check_share(
            payload["file_fingerprints"],
            loader_datasets(loader),
            world_size=loader.world_size,
            allow_changed_files=self.allow_changed_files,
            where=f"the loader state of {key} in the DCP checkpoint",
        )
        loader.load_state_dict(payload["loader"])


def _pickled(obj: Any) -> io.BytesIO:
    return io.BytesIO(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _unpickled(raw: Any) -> Any:
    data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
    return pickle.loads(data)


def _merged_shares(shares: Iterator[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rank shares of file fingerprints (``{dataset: {file: fingerprint}}``) as one."""
    out: dict[str, dict[str, Any]] = {}
    for share in shares:
        for name, files in share.items():
            out.setdefault(name, {}).update(files)
    return out
