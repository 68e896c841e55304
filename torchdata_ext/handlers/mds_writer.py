"""Writing Mosaic MDS shards and their ``index.json`` (the layout is described in
:mod:`torchdata_ext.handlers.mds`).

``prepare --format mds`` and ``torchdata_ext.testing.write_mds`` write through these;
``mosaicml-streaming``'s ``StreamingDataset`` reads their output. For the same samples
:func:`encode_mds_shard` gives the bytes ``MDSWriter`` writes (``tests/test_mds.py``), except
that it also stores empty arrays, which ``MDSWriter`` refuses but its reader reads.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from torchdata_ext.handlers.mds import CODE_OF, INDEX_FILE, SCALARS
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import filesystem

__all__ = ["encode_mds_shard", "mds_index", "write_mds_index"]


def _encode_value(encoding: str, value: Any) -> bytes:
    kind, _, rest = encoding.partition(":")
    if kind == "str":
        return str(value).encode("utf-8")
    if kind == "bytes":
        return bytes(value)
    if kind in SCALARS:
        return (
            np.asarray(value, SCALARS[kind])
            .astype(np.dtype(SCALARS[kind]).newbyteorder("<"))
            .tobytes()
        )
    if kind != "ndarray":
        raise ValueError(f"cannot write MDS encoding {encoding!r}: use ndarray, str, bytes, int")
    arr = np.asarray(value)
    dtype_name, _, shape = rest.partition(":")
    out = b""
    if not dtype_name:
        if arr.dtype.name not in CODE_OF:
            raise TypeError(f"an MDS ndarray cannot hold dtype {arr.dtype}")
        out += bytes([CODE_OF[arr.dtype.name]])
    elif arr.dtype != np.dtype(dtype_name):
        arr = arr.astype(dtype_name)  # the caller's values, in the column's dtype
    if not shape:
        dims = np.asarray(arr.shape, np.int64)
        k = next(k for k in range(4) if dims.size == 0 or int(dims.max()) < 1 << (8 << k))
        out += bytes([(arr.ndim << 2) | k]) + dims.astype(f"<u{1 << k}").tobytes()
    elif tuple(int(s) for s in shape.split(",")) != arr.shape:
        raise ValueError(f"an array of shape {arr.shape} does not fit encoding {encoding!r}")
    return out + arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def _fixed_size(encoding: str) -> int | None:
    kind, _, rest = encoding.partition(":")
    if kind in SCALARS:
        return np.dtype(SCALARS[kind]).itemsize
    dtype_name, _, shape = rest.partition(":")
    if kind == "ndarray" and dtype_name and shape:
        return int(np.prod([int(s) for s in shape.split(",")])) * np.dtype(dtype_name).itemsize
    return None


def _config(columns: Mapping[str, str], compression: str | None) -> dict[str, Any]:
    names = sorted(columns)
    return {
        "column_encodings": [columns[c] for c in names],
        "column_names": names,
        "column_sizes": [_fixed_size(columns[c]) for c in names],
        "compression": compression,
        "format": "mds",
        "hashes": [],
        "size_limit": None,
        "version": 2,
    }


def encode_mds_shard(
    samples: Sequence[Mapping[str, Any]],
    columns: Mapping[str, str],
    compression: str | None = None,
) -> bytes:
    """The raw bytes of one MDS shard file holding ``samples``.

    Args:
        samples: one dict per sample, with a value for every column.
        columns: column name -> encoding: ``ndarray[:dtype[:shape]]``, ``str``, ``bytes``,
            ``int`` or a scalar dtype name (``uint32``, ...).
        compression: recorded in the shard's config (e.g. ``"zstd"`` when the caller
            compresses the bytes; the raw bytes are returned either way).
    """
    config = _config(columns, compression)
    names, encodings, sizes = (
        config["column_names"],
        config["column_encodings"],
        config["column_sizes"],
    )
    encoded = []
    for sample in samples:
        values = [_encode_value(e, sample[c]) for c, e in zip(names, encodings)]
        for c, s, v in zip(names, sizes, values):
            if s is not None and len(v) != s:
                raise ValueError(f"column {c!r}: {len(v)} bytes, its encoding fixes {s}")
        table = np.array([len(v) for v, s in zip(values, sizes) if s is None], "<u4")
        encoded.append(table.tobytes() + b"".join(values))
    text = json.dumps(config, sort_keys=True).encode()
    head = 4 + 4 * (len(encoded) + 1) + len(text)
    offsets = head + np.concatenate([[0], np.cumsum([len(s) for s in encoded])])
    if offsets[-1] >= 1 << 32:
        raise ValueError("an MDS shard must be under 4 GiB; write fewer samples per shard")
    return (
        np.array([len(encoded)], "<u4").tobytes()
        + offsets.astype("<u4").tobytes()
        + text
        + b"".join(encoded)
    )


def mds_index(
    shards: Sequence[tuple[str, int, int, int | None]],
    columns: Mapping[str, str],
    compression: str | None = None,
) -> bytes:
    """The ``index.json`` of a folder of MDS shards.

    Args:
        shards: per shard, in order: ``(raw basename, samples, raw bytes, compressed bytes or
            None)``; a compressed shard is stored as the raw basename plus ``.<compression>``.
        columns: the shards' columns (as for :func:`encode_mds_shard`).
        compression: e.g. ``"zstd"`` (the extension of compressed shards), or None.
    """
    entries = []
    for basename, samples, raw_bytes, zip_bytes in shards:
        entry = _config(columns, compression)
        entry["raw_data"] = {"basename": basename, "bytes": raw_bytes, "hashes": {}}
        entry["samples"] = samples
        entry["zip_data"] = None
        if zip_bytes is not None:
            zipped = f"{basename}.{(compression or '').split(':')[0]}"
            entry["zip_data"] = {"basename": zipped, "bytes": zip_bytes, "hashes": {}}
        entries.append(entry)
    return json.dumps({"shards": entries, "version": 2}, sort_keys=True).encode()


def write_mds_index(
    folder: str,
    shard_urls: Sequence[str],
    columns: Mapping[str, str],
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write ``folder/index.json`` listing the raw shards ``shard_urls`` (in that order; each
    one's sample count is read from its first 4 bytes).

    Args:
        folder: the folder holding the shards (fsspec URL).
        shard_urls: the shard files, raw (not compressed).
        columns: their columns (as for :func:`encode_mds_shard`).
        storage_options: fsspec keyword arguments.
    """
    shards = []
    for url in shard_urls:
        fs, path = filesystem(url, storage_options)
        n = int(np.frombuffer(fs.cat_file(path, start=0, end=4), "<u4", count=1)[0])
        shards.append((posixpath.basename(path), n, int(fs.size(path)), None))
    data = mds_index(shards, columns)
    write_bytes_atomic(posixpath.join(folder.rstrip("/"), INDEX_FILE), data, storage_options)
