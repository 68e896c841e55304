"""Writers for every supported file format, for tests and examples.

Each writer takes a list of documents - 1-D integer arrays (or lists of ints) for token
formats, ``str`` for text formats - writes them to any fsspec URL (local path, ``memory://``,
``s3://`` ...; parent folders are created), and returns the documents **as the matching
handler will read them back** (NumPy arrays in the stored dtype, with an appended EOS token
where the format adds one), so a test can compare ``handler.get(reader, i)`` with
``written[i]`` directly::

    docs = write_parquet("memory://t/a.parquet", [[1, 2], [], [3]], row_group_size=2)
    h = ParquetHandler()
    r = h.open("memory://t/a.parquet")
    assert all(np.array_equal(h.get(r, i), d) for i, d in enumerate(docs))

Writers raise ``ValueError`` / ``TypeError`` for documents the format cannot hold.
"""

from __future__ import annotations

import gzip
import io
import json
import posixpath
import struct
from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Any

import numpy as np

from torchdata_ext.remote.files import write_bytes_atomic
from torchdata_ext.remote.urls import filesystem, is_local

__all__ = [
    "write_arrow_batches",
    "write_arrow_rows",
    "write_cbor",
    "write_ceped_npy",
    "write_flat_tokens",
    "write_jsonl",
    "write_mds",
    "write_megatron",
    "write_parquet",
]

Docs = Sequence[Any]


def _write_bytes(url: str, data: bytes, storage_options: dict[str, Any] | None) -> None:
    """Write ``data`` to ``url`` whole. A local file is replaced (written aside, then renamed),
    never truncated in place: a loader still mapping the old file (a test's earlier loader, its
    background threads alive) keeps reading the old bytes instead of dying of SIGBUS."""
    fs, path = filesystem(url, storage_options)
    if is_local(fs):
        write_bytes_atomic(path, data, durable=False)
        return
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)


def _token_arrays(docs: Docs, dtype: Any = None) -> tuple[list[np.ndarray], np.dtype]:
    """Documents as 1-D integer arrays of one dtype (``dtype``, else their common type)."""
    arrays = []
    for k, doc in enumerate(docs):
        if isinstance(doc, (str, bytes)):
            raise TypeError(
                f"document {k} is a {type(doc).__name__}; token documents are int arrays"
            )
        arr = np.asarray(doc)
        if arr.ndim != 1:
            raise ValueError(f"document {k} has shape {arr.shape}; documents must be 1-D")
        if arr.size == 0 and arr.dtype.kind not in "iu":
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"document {k} has dtype {arr.dtype}; tokens must be integers")
        arrays.append(arr)
    dt: np.dtype[Any]
    if dtype is None:
        # the common type of the documents (starting from int8 would turn uint32 into int64)
        dt = reduce(np.promote_types, [a.dtype for a in arrays]) if arrays else np.dtype(np.int64)
        if dt.kind not in "iu":  # e.g. uint64 mixed with int64
            dt = np.dtype(np.int64)
    else:
        dt = np.dtype(dtype)
        if dt.kind not in "iu":
            raise TypeError(f"dtype={dtype!r} must be an integer dtype")
    out = []
    for k, arr in enumerate(arrays):
        cast = arr.astype(dt)
        if not np.array_equal(cast, arr):
            raise ValueError(f"document {k} has values that do not fit dtype {dt}")
        out.append(cast)
    return out, dt


def _is_text(docs: Docs, text: bool | None) -> bool:
    kinds = {isinstance(d, str) for d in docs}
    if kinds == {True, False}:
        raise TypeError("documents mix str and token arrays; pass one kind")
    if text is None:
        return kinds == {True}
    if kinds and (kinds == {True}) != text:
        raise TypeError(f"{text=} but the documents are {'str' if kinds == {True} else 'tokens'}")
    return text


def _arrow_column(docs: Docs, dtype: Any, large: bool, text: bool | None) -> tuple[Any, list[Any]]:
    """An Arrow array of ``docs`` (string or list<int>) and the documents as read back."""
    import pyarrow as pa

    if _is_text(docs, text):
        return pa.array(list(docs), type=pa.large_string() if large else pa.string()), list(docs)
    arrays, dt = _token_arrays(docs, dtype)
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dt)
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(
        pa.array(offsets), pa.array(values, type=pa.from_numpy_dtype(dt))
    ), arrays


def _ipc_bytes(batches: list[Any], schema: Any, stream: bool) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, schema) if stream else pa.ipc.new_file(sink, schema)
    with writer:
        for batch in batches:
            writer.write_batch(batch)
    return bytes(sink.getvalue())


def write_arrow_batches(
    url: str,
    docs: Docs,
    col_name: str = "tokens",
    storage_options: dict[str, Any] | None = None,
    *,
    dtype: Any = None,
    stream: bool = False,
) -> list[np.ndarray]:
    """Write the Bamba layout: an Arrow IPC file, one record batch per document.

    Each record batch has one integer column ``col_name`` holding one document (an empty
    document is a batch of 0 rows).

    Args:
        url: destination (any fsspec URL).
        docs: token documents.
        col_name: the column name.
        storage_options: fsspec keyword arguments.
        dtype: token dtype; default the documents' common integer type (int64 if none).
        stream: write the IPC stream format instead of the file format.

    Returns:
        The documents as ``ArrowHandler`` reads them.
    """
    import pyarrow as pa

    arrays, dt = _token_arrays(docs, dtype)
    schema = pa.schema([(col_name, pa.from_numpy_dtype(dt))])
    batches = [
        pa.record_batch([pa.array(a, type=schema.field(0).type)], schema=schema) for a in arrays
    ]
    _write_bytes(url, _ipc_bytes(batches, schema, stream), storage_options)
    return arrays


def write_arrow_rows(
    url: str,
    docs: Docs,
    col_name: str = "tokens",
    stream: bool = False,
    storage_options: dict[str, Any] | None = None,
    *,
    batch_size: int | None = None,
    dtype: Any = None,
    large: bool = False,
    text: bool | None = None,
    extra_columns: Mapping[str, Sequence[Any]] | None = None,
) -> list[Any]:
    """Write one document per row: a ``list<int>`` column for token documents, a ``string``
    column for ``str`` documents (the layout of Hugging Face ``datasets`` Arrow files).

    Args:
        url: destination (any fsspec URL).
        docs: token documents, or ``str`` documents.
        col_name: the document column name.
        stream: write the IPC stream format (as ``datasets.save_to_disk`` does) instead of the
            IPC file format.
        storage_options: fsspec keyword arguments.
        batch_size: rows per record batch (default: all rows in one batch; no batch when there
            are no documents).
        dtype: token dtype; default the documents' common integer type (int64 if none).
        large: use ``large_list`` / ``large_string`` instead of ``list`` / ``string``.
        text: write a string column (True) or a list<int> column (False); default: string
            when the documents are ``str``, list<int> otherwise (also for no documents).
        extra_columns: more columns (name -> one value per document), e.g. ``{"id": [...]}``.

    Returns:
        The documents as ``ArrowHandler`` reads them.
    """
    import pyarrow as pa

    column, read_back = _arrow_column(docs, dtype, large, text)
    table = pa.table({col_name: column, **{k: list(v) for k, v in (extra_columns or {}).items()}})
    if len(table) == 0:
        batches: list[Any] = []
    else:
        batches = table.to_batches(max_chunksize=batch_size or len(table))
    _write_bytes(url, _ipc_bytes(batches, table.schema, stream), storage_options)
    return read_back


def write_parquet(
    url: str,
    docs: Docs,
    col_name: str = "tokens",
    row_group_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    dtype: Any = None,
    text: bool | None = None,
    extra_columns: Mapping[str, Sequence[Any]] | None = None,
) -> list[Any]:
    """Write a Parquet file, one document per row (``list<int>`` tokens or ``string`` text).

    Args:
        url: destination (any fsspec URL).
        docs: token documents, or ``str`` documents.
        col_name: the document column name.
        row_group_size: rows per row group (default: pyarrow's, i.e. one group for small files).
        storage_options: fsspec keyword arguments.
        dtype: token dtype; default the documents' common integer type (int64 if none).
        text: write a string column (True) or a list<int> column (False); default: string
            when the documents are ``str``, list<int> otherwise (also for no documents).
        extra_columns: more columns (name -> one value per document), e.g. ``{"text": [...]}``.

    Returns:
        The documents as ``ParquetHandler`` reads them.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    column, read_back = _arrow_column(docs, dtype, False, text)
    table = pa.table({col_name: column, **{k: list(v) for k, v in (extra_columns or {}).items()}})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_size)
    _write_bytes(url, bytes(sink.getvalue()), storage_options)
    return read_back


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_ceped_npy(
    url: str,
    docs: Docs,
    storage_options: dict[str, Any] | None = None,
    *,
    dtype: Any = np.int64,
) -> list[np.ndarray]:
    """Write a CEPED ``.npy``: one 1-D array ``[n] [len(d1) .. len(dn)] [d1] .. [dn]``.

    Args:
        url: destination (any fsspec URL).
        docs: token documents.
        storage_options: fsspec keyword arguments.
        dtype: the array's integer dtype; it must hold ``n``, the lengths and the tokens.

    Returns:
        The documents as ``CepedHandler`` reads them (in ``dtype``).
    """
    arrays, dt = _token_arrays(docs, dtype)
    header = np.array([len(arrays), *(a.size for a in arrays)], dtype=np.int64)
    if header.size and not np.array_equal(header.astype(dt), header):
        raise ValueError(f"the document count or a length does not fit dtype {dt}")
    flat = np.concatenate([header.astype(dt), *arrays])
    _write_bytes(url, _npy_bytes(flat), storage_options)
    return arrays


def write_flat_tokens(
    url: str,
    docs: Docs,
    eos_token: int | None = None,
    offsets: bool = False,
    dtype: Any = np.uint32,
    storage_options: dict[str, Any] | None = None,
) -> list[np.ndarray]:
    """Write a flat token file: all documents concatenated into one array.

    A URL ending in ``.npy`` gets a 1-D ``.npy`` array; any other name a raw native-endian
    array (read it with ``FlatTokenHandler(dtype=...)``).

    Args:
        url: destination (any fsspec URL).
        docs: token documents.
        eos_token: if given, appended to every document (a document that already contains it
            is a ``ValueError``, since reading would split it there). ``FlatTokenHandler``
            with the same ``eos_token`` then reads back ``doc + [eos_token]``.
        offsets: also write the sidecar ``<url>.offsets.npy`` (int64, ``n + 1`` offsets).
        dtype: token dtype, default ``uint32``.
        storage_options: fsspec keyword arguments.

    Returns:
        The documents as the flat handler reads them (with the EOS token appended).
    """
    arrays, dt = _token_arrays(docs, dtype)
    if eos_token is not None:
        eos = np.array([eos_token], dtype=np.int64)
        if not np.array_equal(eos.astype(dt), eos):
            raise ValueError(f"eos_token={eos_token} does not fit dtype {dt}")
        for k, arr in enumerate(arrays):
            if np.any(arr == eos_token):
                raise ValueError(
                    f"document {k} contains eos_token={eos_token}; reading would split it there"
                )
        arrays = [np.append(arr, eos.astype(dt)) for arr in arrays]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dt)
    if url.lower().endswith(".npy"):
        _write_bytes(url, _npy_bytes(flat), storage_options)
    else:
        _write_bytes(url, flat.tobytes(), storage_options)
    if offsets:
        bounds = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=bounds[1:])
        _write_bytes(url + ".offsets.npy", _npy_bytes(bounds), storage_options)
    return arrays


def write_megatron(
    url: str,
    docs: Docs,
    dtype: Any = np.int32,
    sentences: int = 1,
    storage_options: dict[str, Any] | None = None,
) -> list[np.ndarray]:
    """Write a Megatron indexed dataset pair, ``<prefix>.bin`` + ``<prefix>.idx``, in the layout
    megatron-core's ``IndexedDatasetBuilder`` writes (see :mod:`torchdata_ext.handlers.megatron`).

    Args:
        url: ``<prefix>.idx`` or ``<prefix>.bin`` (both files are written; a bare prefix too).
        docs: token documents.
        dtype: token dtype: ``uint8``, ``int8``, ``int16``, ``int32``, ``int64`` or ``uint16``.
        sentences: each document is stored as up to this many sequences of near-equal length
            (``preprocess_data.py --split-sentences`` writes one per sentence); an empty
            document as none. Its tokens read back the same.
        storage_options: fsspec keyword arguments.

    Returns:
        The documents as ``MegatronHandler`` reads them (in ``dtype``).
    """
    codes = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}
    dt = np.dtype(dtype)
    if dt.name not in codes:
        raise ValueError(f"{dtype=} must be one of {sorted(codes)} (Megatron's integer dtypes)")
    if sentences < 1:
        raise ValueError(f"{sentences=} must be >= 1")
    arrays, _ = _token_arrays(docs)
    arrays = [a.astype(dt) for a in arrays]
    seqs: list[np.ndarray] = []
    doc_idx = [0]
    for arr in arrays:
        if arr.size:
            seqs.extend(np.array_split(arr, min(sentences, arr.size)))
        doc_idx.append(len(seqs))
    lengths = np.array([len(s) for s in seqs], "<i4")
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * dt.itemsize
    prefix = url[:-4] if url.endswith((".idx", ".bin")) else url
    _write_bytes(prefix + ".bin", b"".join(s.tobytes() for s in seqs), storage_options)
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, codes[dt.name], len(seqs), len(doc_idx))
    body = lengths.tobytes() + pointers.astype("<i8").tobytes()
    _write_bytes(
        prefix + ".idx", header + body + np.array(doc_idx, "<i8").tobytes(), storage_options
    )
    return arrays


def write_jsonl(
    url: str,
    texts: Sequence[str],
    field: str = "text",
    compression: str | None = "infer",
    storage_options: dict[str, Any] | None = None,
    *,
    extra_fields: Mapping[str, Sequence[Any]] | None = None,
) -> list[str]:
    """Write JSON Lines: one ``{field: text}`` object per line (UTF-8, ``ensure_ascii=False``).

    Args:
        url: destination (any fsspec URL).
        texts: the documents.
        field: the JSON field holding each text.
        compression: ``"infer"`` (default: gzip for names ending ``.gz``, zstd for ``.zst``,
            else none), ``None`` (plain), ``"gz"``/``"gzip"`` or ``"zst"``/``"zstd"``.
        storage_options: fsspec keyword arguments.
        extra_fields: more fields per line (name -> one JSON value per text).

    Returns:
        The texts as ``JsonlHandler`` reads them.
    """
    texts = list(texts)
    for k, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {k} is a {type(text).__name__}, not a str")
    extra = {k: list(v) for k, v in (extra_fields or {}).items()}
    lines = []
    for k, text in enumerate(texts):
        obj = {field: text, **{name: values[k] for name, values in extra.items()}}
        lines.append(json.dumps(obj, ensure_ascii=False) + "\n")
    data = "".join(lines).encode("utf-8")
    if compression == "infer":
        lower = url.lower()
        compression = "gz" if lower.endswith(".gz") else "zst" if lower.endswith(".zst") else None
    if compression in ("gz", "gzip"):
        data = gzip.compress(data)
    elif compression in ("zst", "zstd"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    elif compression not in (None, "none"):
        raise ValueError(f"{compression=} must be 'infer', None, 'gz' or 'zst'")
    _write_bytes(url, data, storage_options)
    return texts


def write_mds(
    folder: str,
    docs: Docs | Sequence[str],
    *,
    col_name: str = "tokens",
    encoding: str = "ndarray:uint32",
    docs_per_shard: int | None = None,
    compression: str | None = None,
    extra_columns: Mapping[str, tuple[str, Sequence[Any]]] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[Any]:
    """Write a Mosaic MDS folder: ``shard.NNNNN.mds`` files (``.mds.zstd`` / ``.mds.gz`` when
    compressed) and ``index.json``, one sample per document (see
    :mod:`torchdata_ext.handlers.mds`).

    Args:
        folder: destination folder (any fsspec URL).
        docs: token documents (an ``ndarray`` or ``bytes`` column), or texts (``str``).
        col_name: the document column.
        encoding: its MDS encoding: ``ndarray``, ``ndarray:<dtype>``, ``str``, or ``bytes``
            (tokens written as ``int64`` bytes, as LLM Foundry did).
        docs_per_shard: samples per shard file (default: all in one).
        compression: None, ``"zstd"`` or ``"gz"`` (the shards are stored compressed only).
        extra_columns: more columns: name -> (encoding, one value per document).
        storage_options: fsspec keyword arguments.

    Returns:
        The documents as ``MdsHandler`` reads them (``bytes`` columns with
        ``bytes_dtype="int64"``).
    """
    from torchdata_ext.handlers.mds_writer import encode_mds_shard, mds_index

    kind, _, rest = encoding.partition(":")
    if kind == "str":
        out: list[Any] = list(docs)
        for k, text in enumerate(out):
            if not isinstance(text, str):
                raise TypeError(f"document {k} is a {type(text).__name__}, not a str")
        values: list[Any] = out
    else:
        dtype = np.int64 if kind == "bytes" else (rest.split(":")[0] or None)
        out, _ = _token_arrays(docs, dtype)
        values = [a.astype("<i8").tobytes() for a in out] if kind == "bytes" else out
    columns = {col_name: encoding, **{c: e for c, (e, _) in (extra_columns or {}).items()}}
    extra = {c: list(v) for c, (_, v) in (extra_columns or {}).items()}
    step = docs_per_shard or max(1, len(values))
    shards = []
    for n, lo in enumerate(range(0, max(1, len(values)), step)):
        samples = [
            {col_name: values[i], **{c: v[i] for c, v in extra.items()}}
            for i in range(lo, min(lo + step, len(values)))
        ]
        raw = encode_mds_shard(samples, columns, compression)
        name = f"shard.{n:05d}.mds"
        zipped = None
        if compression in ("zstd", "zst"):
            import zstandard

            zipped = zstandard.ZstdCompressor().compress(raw)
        elif compression in ("gz", "gzip"):
            zipped = gzip.compress(raw)
        elif compression is not None:
            raise ValueError(f"{compression=} must be None, 'zstd' or 'gz'")
        ext = {"zst": "zstd", "gzip": "gz"}.get(compression or "", compression)
        stored = f"{name}.{ext}" if zipped is not None else name
        _write_bytes(posixpath.join(folder, stored), zipped or raw, storage_options)
        shards.append((name, len(samples), len(raw), None if zipped is None else len(zipped)))
    ext = {"zst": "zstd", "gzip": "gz"}.get(compression or "", compression)
    index = mds_index(shards, columns, ext)
    _write_bytes(posixpath.join(folder, "index.json"), index, storage_options)
    return out


def write_cbor(
    url: str,
    docs: Sequence[str] | Docs,
    field: str = "text",
    storage_options: dict[str, Any] | None = None,
    *,
    extra_fields: Mapping[str, Sequence[Any]] | None = None,
) -> list[Any]:
    """Write CBOR records one after another (epochraft's layout): one map ``{field: doc}`` per
    document, a text or a list of token ids; gzip or zstd compressed for names ending ``.gz``
    / ``.zst``. Needs ``cbor2``.

    Args:
        url: destination (any fsspec URL).
        docs: texts, or token documents (stored as CBOR arrays of integers).
        field: the record field holding each document.
        storage_options: fsspec keyword arguments.
        extra_fields: more fields per record (name -> one value per document).

    Returns:
        The documents as ``CborHandler`` reads them (tokens as ``int64`` arrays).
    """
    import cbor2

    docs = list(docs)
    text = bool(docs) and isinstance(docs[0], str)
    out: list[Any] = docs if text else [a.astype(np.int64) for a in _token_arrays(docs)[0]]
    extra = {k: list(v) for k, v in (extra_fields or {}).items()}
    records = []
    for k, doc in enumerate(out):
        value = doc if text else doc.tolist()
        records.append(cbor2.dumps({field: value, **{n: v[k] for n, v in extra.items()}}))
    data = b"".join(records)
    if url.lower().endswith(".gz"):
        data = gzip.compress(data)
    elif url.lower().endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    _write_bytes(url, data, storage_options)
    return out
