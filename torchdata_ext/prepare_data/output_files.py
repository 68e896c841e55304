"""The files a :func:`~torchdata_ext.prepare_data.tokenize_text.prepare` part leaves in its folder.

Besides its progress record, a part writes token shards (:func:`shard_encoder` gives the bytes
of one: an Arrow IPC file, a flat ``.npy`` array or an MDS shard, named with
:data:`SHARD_SUFFIXES`), deletes the temporary files a killed run of it left behind
(:func:`remove_stale_temps`), and when it ends writes the folder's listings from every complete
output (:func:`write_listings`: ``data_sources.txt`` or ``index.json``, the counts file and the
index file).
"""

from __future__ import annotations

import functools
import io
import logging
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import unstrip
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.sources.index_file import write_index_file

__all__ = ["SHARD_SUFFIXES", "remove_stale_temps", "shard_encoder", "write_listings"]

SHARD_SUFFIXES = {"arrow": ".arrow", "npy": ".npy", "mds": ".mds"}  # by format
_PREPARE_LOGGER = "torchdata_ext.prepare_data.tokenize_text"  # prepare's logger, as before


def _mds_columns(dtype: str) -> dict[str, str]:
    return {"tokens": f"ndarray:{dtype}"}


def _arrow_bytes(docs: Sequence[np.ndarray], dtype: np.dtype) -> bytes:
    """An Arrow IPC file: one record batch per document, one ``dtype`` column ``tokens``."""
    import pyarrow as pa

    kind = pa.from_numpy_dtype(dtype)
    schema = pa.schema([("tokens", kind)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for doc in docs:
            column = pa.array(doc.astype(dtype, copy=False), type=kind)
            writer.write_batch(pa.record_batch([column], schema=schema))
    return bytes(sink.getvalue())


def _npy_bytes(docs: Sequence[np.ndarray], dtype: np.dtype) -> bytes:
    """A ``.npy`` file: the documents concatenated into one flat ``dtype`` array."""
    buf = io.BytesIO()
    flat = np.concatenate(list(docs)) if docs else np.zeros(0, dtype)
    np.save(buf, flat.astype(dtype), allow_pickle=False)
    return buf.getvalue()


def _mds_bytes(docs: Sequence[np.ndarray], dtype: np.dtype) -> bytes:
    """An MDS shard: one sample per document, one ``ndarray:<dtype>`` column ``tokens``."""
    from torchdata_ext.handlers.mds_writer import encode_mds_shard

    columns = _mds_columns(dtype.name)
    return encode_mds_shard([{"tokens": d.astype(dtype, copy=False)} for d in docs], columns)


def shard_encoder(format: str, dtype: str) -> Callable[[Sequence[np.ndarray]], bytes]:
    """The function giving the bytes of one ``format`` shard holding some documents, their
    tokens stored as ``dtype``."""
    encoder = {"npy": _npy_bytes, "arrow": _arrow_bytes, "mds": _mds_bytes}[format]
    return functools.partial(encoder, dtype=np.dtype(dtype))


def _is_stale_temp(name: str, shard_id: int) -> bool:
    """Whether ``name`` is a temporary file a killed run of part ``shard_id`` left behind:
    ``write_bytes_atomic``'s ``.<name>.tmp-<hex>`` or the ``.tmp-<name>-<hex>`` of earlier
    versions, for this part's outputs or progress file."""
    ours = (f"part{shard_id:05d}_", f"_progress_part{shard_id:05d}.")
    if name.startswith(".tmp-"):
        return name[len(".tmp-") :].startswith(ours)
    return name.startswith(".") and ".tmp-" in name and name[1:].startswith(ours)


def remove_stale_temps(fs: Any, out_path: str, shard_id: int) -> None:
    """Delete temporary files a killed run of this part left behind."""
    try:
        names = fs.ls(out_path, detail=False)
    except FileNotFoundError:
        return
    for p in names:
        if _is_stale_temp(posixpath.basename(p), shard_id):
            fs.rm(p)


def write_listings(
    fs: Any,
    out: str,
    out_path: str,
    format: str,
    eos_token: int | None,
    storage_options: dict[str, Any],
    dtype: str,
) -> None:
    """Write ``data_sources.txt`` (npy) or ``index.json`` (mds) and the counts file from every
    complete output (of tokens of ``dtype``)."""
    suffix = SHARD_SUFFIXES[format]
    names = sorted(
        p
        for p in fs.ls(out_path, detail=False)
        if posixpath.basename(p).startswith("part") and p.endswith(suffix)
    )
    if not names:
        return
    if format == "npy":
        listed = [posixpath.basename(p) for p in names]  # relative: the folder may move
        data = ("\n".join(listed) + "\n").encode()
        write_bytes_atomic(
            unstrip(fs, posixpath.join(out_path, "data_sources.txt")), data, storage_options
        )
        index = DatasetIndex.build(
            out,
            file_type="flat",
            storage_options=storage_options,
            handler_options={"eos_token": eos_token},
            write_counts="data",  # prepare's own output: the counts go next to it
        )
    else:
        if format == "mds":
            from torchdata_ext.handlers.mds_writer import write_mds_index

            write_mds_index(
                out, [unstrip(fs, p) for p in names], _mds_columns(dtype), storage_options
            )
        index = DatasetIndex.build(
            out, file_type=format, storage_options=storage_options, write_counts="data"
        )
    try:  # a job's ranks then start without a LIST; without it they list, as before
        write_index_file(out, index)
    except OSError as exc:
        logging.getLogger(_PREPARE_LOGGER).warning(
            "could not write the index file of %s (%s); ranks will list it", out, exc
        )
