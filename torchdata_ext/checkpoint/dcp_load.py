"""``dcp.load`` with a damaged checkpoint named: :func:`load_dcp` and :func:`check_dcp`.

A ``.distcp`` data file that torch itself cannot read (truncated, removed) makes ``dcp.load``
raise torch's ``CheckpointException`` (a ``BaseException``, with each rank's traceback) before
any ``Stateful`` of the state dict, :class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`
included, is called: the loader cannot name the problem from inside the load. So a training
script calls :func:`load_dcp` instead of ``dcp.load`` (same arguments, the same load): the
``.metadata`` is read first (a missing or damaged one named), every data file it lists is
checked to exist and to hold the bytes the metadata points into (one size query a file, no
data read), and whatever torch still fails on is reported as a one-line ``ValueError`` naming
the checkpoint, the file and that it is damaged, with what to do. :func:`check_dcp` makes the
same checks without loading (e.g. to pick the newest intact checkpoint before a restart).

A bit flip inside a model tensor's bytes is not detectable (DCP stores no checksum of tensor
data); the loader's own entries carry one (:mod:`torchdata_ext.checkpoint.dcp_seal`).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from torch.distributed.checkpoint.api import CheckpointException

from torchdata_ext.checkpoint.dcp_entries import checkpoint_name, read_metadata, reader_for
from torchdata_ext.checkpoint.dcp_seal import damaged

__all__ = ["check_dcp", "load_dcp"]


def load_dcp(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_reader: dcp.StorageReader | None = None,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """``torch.distributed.checkpoint.load(state_dict, ...)``, a damaged checkpoint refused
    with its file named (:func:`check_dcp` first, then torch's failures reworded).

    Args:
        state_dict: what to load into, as for ``dcp.load`` (e.g. ``{"model": ...,
            "data": DCPLoaderState(loader)}``).
        checkpoint_id: the checkpoint (a local path or an fsspec URL).
        storage_reader: a storage reader instead (or as well: moved to ``checkpoint_id``).
        storage_options: fsspec options for an fsspec URL.
        **kwargs: passed on to ``dcp.load`` (``planner``, ``process_group``, ``no_dist``).

    Raises:
        ValueError: the checkpoint is damaged (a data file missing, truncated or unreadable,
            a damaged ``.metadata``, a loader entry whose checksum fails): names it and says
            to restore from another checkpoint.
        FileNotFoundError: no ``.metadata`` (its save did not finish).
    """
    reader = reader_for(checkpoint_id, storage_reader, storage_options)
    check_dcp(storage_reader=reader)
    try:
        dcp.load(state_dict, storage_reader=reader, **kwargs)
    except CheckpointException as exc:  # what the checks could not see (a damaged zip, ...)
        raise damaged(_where(reader), exc, _data_files(read_metadata(reader))) from None


def check_dcp(
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_reader: dcp.StorageReader | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Refuse a DCP checkpoint whose ``.metadata`` cannot be read or whose data files are
    missing or shorter than the metadata says, without loading it (one size query per data
    file).

    Raises:
        ValueError: naming the checkpoint and each damaged file (missing; truncated, with its
            size and the bytes needed).
        FileNotFoundError: no ``.metadata``.
    """
    reader = reader_for(checkpoint_id, storage_reader, storage_options)
    metadata = read_metadata(reader)
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    fs, path = getattr(reader, "fs", None), getattr(reader, "path", None)
    if fs is None or path is None:  # another storage reader: torch's own errors are named
        return
    problems = []
    for name, need in sorted(needed.items()):
        file = fs.concat_path(path, name)
        if not fs.exists(file):
            problems.append(f"{name} is missing")
            continue
        with fs.create_stream(file, "rb") as stream:
            size = stream.seek(0, os.SEEK_END)
        if size < need:
            problems.append(f"{name} is truncated ({size:,} bytes; the metadata needs {need:,})")
    if problems:
        raise ValueError(
            f"{checkpoint_name(reader)} is damaged: {'; '.join(problems)}; restore from another "
            "checkpoint"
        )


def _where(reader: dcp.StorageReader) -> str:
    """The checkpoint's path as :func:`damaged` names it."""
    return str(getattr(reader, "path", "") or "")


def _data_files(metadata: Any) -> list[str]:
    """The data files a DCP ``Metadata`` lists."""
    storage = getattr(metadata, "storage_data", None) or {}
    return sorted({str(info.relative_path) for info in storage.values()})
