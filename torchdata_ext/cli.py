"""The ``torchdata-ext`` command: ``prepare`` text into token shards, ``inspect`` a dataset.

``torchdata-ext prepare IN... --out DIR`` tokenizes text files into shard files the pipeline
reads:

* inputs: JSONL (``.jsonl``/``.json``, optionally ``.gz``/``.zst``; the text in
  ``--text-field``), Parquet (a string column ``--text-field``) and plain text (``.txt``: **one
  document per file**, the whole file). Local paths or fsspec URLs, with globs and braces;
  folders are searched for those suffixes. Empty texts are skipped.
* ``--format arrow`` (Bamba layout): Arrow IPC files, one record batch per document, one
  ``uint32`` column ``tokens``. ``--format npy`` (Bolmo layout): flat ``uint32`` ``.npy`` token
  arrays, every document followed by ``--eos-token`` (default 0), plus ``data_sources.txt``
  listing them. Both get ``meta/torchdata_ext_counts.csv`` (documents and tokens per file).
* ``--tokenizer byte`` is :class:`~torchdata_ext.tokenizers.ByteTokenizer` with
  ``offset=--byte-offset`` (default 1, so id 0 stays free for EOS; ids 1..256 are bytes);
  otherwise the path of a Hugging Face ``tokenizer.json``.
* Outputs hold at most ``--max-tokens-per-file`` tokens (a longer document gets a file of its
  own; documents are never split) and are named ``part{shard_id:05d}_{n:05d}.arrow|npy``.
* ``--shard-id K --num-shards N`` (e.g. a Slurm array): part K takes the K-th of N contiguous,
  equal slices of the sorted input files, so the parts in order hold the same documents, in the
  same order, as one run over everything.
* ``--num-proc P`` tokenizes P input files at a time in a process pool; results are consumed in
  input order, so the output does not depend on P.

Kills and restarts: each output file is written under a hidden temporary name and renamed, then
``_progress_part{K:05d}.json`` (also atomic) records the next output number and the input
position (file, document) where that output starts. A re-run with the same arguments starts
there, so the final shards are byte-identical to an uninterrupted run. A part that finished is
skipped. Each finishing part rewrites ``data_sources.txt`` and the counts file from every
complete output in the folder (re-run any part to refresh them after all parts end).

``torchdata-ext inspect PATH`` prints files, documents, tokens and a length histogram of any
dataset :class:`~torchdata_ext.index.DatasetIndex` reads (arrow, parquet, npy CEPED/flat, jsonl);
``--doc N`` prints document N (global index, or ``--file F --doc N``), decoded with
``--tokenizer``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import posixpath
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["PrepareResult", "inspect_dataset", "main", "prepare"]

INPUT_SUFFIXES = (
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".json.gz",
    ".jsonl.zst",
    ".json.zst",
    ".parquet",
    ".txt",
)
PROGRESS_VERSION = 1
_HIST_EDGES = (16, 128, 1024, 8192, 65536)


# -- tokenizers ------------------------------------------------------------------------------------
def load_tokenizer(spec: str, byte_offset: int = 1) -> Any:
    """``"byte"`` -> ``ByteTokenizer(offset=byte_offset)``; else a ``tokenizer.json`` path."""
    from torchdata_ext.tokenizers import ByteTokenizer, as_encoder
    from torchdata_ext.urls import filesystem

    if spec == "byte":
        return ByteTokenizer(offset=byte_offset)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "--tokenizer PATH needs the tokenizers package: pip install tokenizers"
        ) from None
    fs, path = filesystem(spec)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"--tokenizer {spec!r}: no such file; pass 'byte' or the path of a tokenizer.json"
        )
    with fs.open(path, "rt") as f:
        return as_encoder(Tokenizer.from_str(f.read()))


def _decoder(spec: str, byte_offset: int) -> Any:
    tok = load_tokenizer(spec, byte_offset)
    inner = getattr(tok, "tokenizer", tok)
    return lambda ids: inner.decode([int(t) for t in ids])


# -- reading inputs ----------------------------------------------------------------------------------
def _read_texts(url: str, text_field: str, storage_options: dict[str, Any]) -> list[str]:
    """All texts of one input file, in order."""
    from torchdata_ext.handlers.base import get_handler
    from torchdata_ext.urls import filesystem

    lower = url.lower()
    if lower.endswith(".txt"):
        fs, path = filesystem(url, storage_options)
        with fs.open(path, "rb") as f:
            return [f.read().decode("utf-8", errors="replace")]
    kind = "parquet" if lower.endswith(".parquet") else "jsonl"
    handler = get_handler(kind, col_name=text_field, storage_options=storage_options)
    reader = handler.open(url)
    try:
        if handler.produces_for(reader) != "text":
            raise ValueError(
                f"{url}: column {text_field!r} holds tokens, not text; it is already tokenized "
                "(read it directly) or pass --text-field with the text column"
            )
        return [str(handler.get(reader, i)) for i in range(handler.length(reader))]
    finally:
        handler.close(reader)


_TOKENIZER_CACHE: dict[tuple[str, int], Any] = {}


def _tokenize_file(task: tuple[str, int, str, int, str, dict[str, Any]]) -> list[np.ndarray]:
    """Tokens (``uint32``) of the non-empty texts of one input file, from text ``start`` on."""
    url, start, spec, byte_offset, text_field, storage_options = task
    key = (spec, byte_offset)
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = load_tokenizer(spec, byte_offset)
    from torchdata_ext.tokenizers import as_encoder

    encoder = as_encoder(_TOKENIZER_CACHE[key])
    texts = [t for t in _read_texts(url, text_field, storage_options) if t][start:]
    out = []
    for lo in range(0, len(texts), 256):
        for ids in encoder.encode_batch(texts[lo : lo + 256]):
            arr = np.asarray(ids)
            if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint32).max):
                raise ValueError(f"{url}: token ids out of the uint32 range")
            out.append(arr.astype(np.uint32))
    return out


# -- writing outputs ---------------------------------------------------------------------------------
def _write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` under a hidden temporary name, then rename it into place."""
    from torchdata_ext.urls import is_local

    parent, name = posixpath.split(path)
    tmp = posixpath.join(parent, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    if is_local(fs):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)


def _arrow_bytes(docs: Sequence[np.ndarray]) -> bytes:
    import pyarrow as pa

    schema = pa.schema([("tokens", pa.uint32())])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for doc in docs:
            writer.write_batch(pa.record_batch([pa.array(doc, type=pa.uint32())], schema=schema))
    return bytes(sink.getvalue())


def _npy_bytes(docs: Sequence[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    flat = np.concatenate(list(docs)) if docs else np.zeros(0, np.uint32)
    np.save(buf, flat.astype(np.uint32), allow_pickle=False)
    return buf.getvalue()


# -- prepare -----------------------------------------------------------------------------------------
@dataclass
class PrepareResult:
    """What one ``prepare`` part did.

    Attributes:
        out: the output folder.
        outputs: this part's output file URLs, in order.
        documents / tokens: written by this call (0 for a part that was already done).
        resumed: the part continued from an earlier, interrupted run.
        skipped: the part was already complete; nothing was written.
    """

    out: str
    outputs: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    resumed: bool = False
    skipped: bool = False


def split_inputs(files: Sequence[str], shard_id: int, num_shards: int) -> list[str]:
    """Part ``shard_id`` of ``num_shards`` contiguous, near-equal slices of ``files``."""
    n = len(files)
    return list(files[shard_id * n // num_shards : (shard_id + 1) * n // num_shards])


def _progress_path(out_path: str, shard_id: int) -> str:
    return posixpath.join(out_path, f"_progress_part{shard_id:05d}.json")


def prepare(
    inputs: str | Sequence[str],
    out: str,
    *,
    format: str = "arrow",
    tokenizer: str = "byte",
    byte_offset: int = 1,
    text_field: str = "text",
    eos_token: int | None = None,
    max_tokens_per_file: int = 100_000_000,
    num_proc: int = 1,
    shard_id: int = 0,
    num_shards: int = 1,
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
    slow_for_tests: float = 0.0,
) -> PrepareResult:
    """Tokenize text files into shards in ``out`` (see the module docstring); resumable.

    Args:
        inputs: input URLs (files, folders, globs, braces).
        out: the output folder (fsspec URL).
        format: ``"arrow"`` or ``"npy"``.
        tokenizer: ``"byte"`` or the path of a ``tokenizer.json``.
        byte_offset: the byte tokenizer's id offset (ids ``< byte_offset`` stay free).
        text_field: the JSONL field / Parquet column holding the text.
        eos_token: appended to every document; for ``npy`` default 0 (it separates documents),
            for ``arrow`` default none (the pipeline adds it).
        max_tokens_per_file: cap of tokens per output file.
        num_proc: tokenizing processes.
        shard_id / num_shards: which part of the inputs this call does.
        storage_options: fsspec options for inputs and outputs.
        progress: show a tqdm bar (None: only on a terminal).
        slow_for_tests: seconds to sleep per input file (tests of kills).

    Raises:
        ValueError: bad arguments, or ``out`` holds progress of a different configuration.
    """
    from torchdata_ext.urls import expand_urls, filesystem, unstrip

    if format not in ("arrow", "npy"):
        raise ValueError(f"{format=} must be 'arrow' or 'npy'")
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ValueError(f"{shard_id=} must be in 0..{num_shards=}-1 and num_shards >= 1")
    if max_tokens_per_file < 1:
        raise ValueError(f"{max_tokens_per_file=} must be >= 1")
    if num_proc < 1:
        raise ValueError(f"{num_proc=} must be >= 1")
    if format == "npy" and eos_token is None:
        eos_token = 0
    storage_options = dict(storage_options or {})
    raw = [inputs] if isinstance(inputs, str) else list(inputs)
    files = expand_urls(raw, storage_options, suffixes=INPUT_SUFFIXES)
    mine = split_inputs(files, shard_id, num_shards)
    fs, out_path = filesystem(out, storage_options)
    fs.makedirs(out_path, exist_ok=True)
    config = {
        "version": PROGRESS_VERSION,
        "inputs": hashlib.sha256("\n".join(mine).encode()).hexdigest()[:16],
        "num_inputs": len(mine),
        "format": format,
        "tokenizer": tokenizer,
        "byte_offset": byte_offset if tokenizer == "byte" else None,
        "text_field": text_field,
        "eos_token": eos_token,
        "max_tokens_per_file": max_tokens_per_file,
        "shard_id": shard_id,
        "num_shards": num_shards,
    }
    ppath = _progress_path(out_path, shard_id)
    state: dict[str, Any] = {
        "config": config,
        "next_output": 0,
        "input": 0,
        "doc": 0,
        "done": False,
    }
    result = PrepareResult(out=out)
    if fs.exists(ppath):
        saved = json.loads(fs.cat_file(ppath))
        if saved.get("config") != config:
            diff = sorted(k for k in config if saved.get("config", {}).get(k) != config[k])
            raise ValueError(
                f"{out} holds an earlier prepare of part {shard_id} with different settings "
                f"({', '.join(diff)}); use another --out folder, or delete "
                f"{posixpath.basename(ppath)} and its part{shard_id:05d}_* files to start over"
            )
        state = saved
        result.resumed = True
    _remove_stale_temps(fs, out_path, shard_id)
    suffix = ".arrow" if format == "arrow" else ".npy"

    def out_name(n: int) -> str:
        return posixpath.join(out_path, f"part{shard_id:05d}_{n:05d}{suffix}")

    result.outputs = [unstrip(fs, out_name(n)) for n in range(int(state["next_output"]))]
    if state["done"]:
        result.skipped = True
        _finalize(fs, out, out_path, format, eos_token, storage_options)
        return result

    from tqdm import tqdm

    encode = _npy_bytes if format == "npy" else _arrow_bytes
    eos = None if eos_token is None else np.array([eos_token], np.uint32)
    n_out = int(state["next_output"])
    buf: list[np.ndarray] = []
    buf_tokens = 0
    buf_start = (int(state["input"]), int(state["doc"]))
    bar = tqdm(
        total=None,
        unit="tok",
        unit_scale=True,
        desc=f"prepare part {shard_id}/{num_shards}",
        disable=None if progress is None else not progress,
        file=sys.stderr,
    )

    def flush(next_pos: tuple[int, int]) -> None:
        nonlocal n_out, buf, buf_tokens, buf_start
        _write_atomic(fs, out_name(n_out), encode(buf))
        result.outputs.append(unstrip(fs, out_name(n_out)))
        n_out += 1
        buf, buf_tokens, buf_start = [], 0, next_pos
        state.update(next_output=n_out, input=next_pos[0], doc=next_pos[1])
        _write_atomic(fs, ppath, json.dumps(state, indent=1, sort_keys=True).encode())

    t0 = time.perf_counter()
    first_file, first_doc = buf_start
    for i, docs in enumerate(
        _tokenized(
            mine,
            first_file,
            first_doc,
            tokenizer,
            byte_offset,
            text_field,
            storage_options,
            num_proc,
        ),  # fmt: skip
        start=first_file,
    ):
        j0 = first_doc if i == first_file else 0
        for k, doc in enumerate(docs):
            j = j0 + k
            if eos is not None:
                if eos_token in doc:
                    raise ValueError(
                        f"{mine[i]}: document {j} contains eos_token={eos_token}, which would "
                        "split it when read back; choose another --eos-token (or --byte-offset "
                        ">= 1 for the byte tokenizer)"
                    )
                doc = np.concatenate([doc, eos])
            if buf and buf_tokens + doc.size > max_tokens_per_file:
                flush((i, j))
            buf.append(doc)
            buf_tokens += doc.size
            result.documents += 1
            result.tokens += doc.size
            bar.update(doc.size)
        bar.set_postfix(files=f"{i + 1}/{len(mine)}")
        if slow_for_tests:
            time.sleep(slow_for_tests)
    if buf:
        flush((len(mine), 0))
    state.update(done=True, input=len(mine), doc=0)
    _write_atomic(fs, ppath, json.dumps(state, indent=1, sort_keys=True).encode())
    bar.close()
    elapsed = time.perf_counter() - t0
    if progress is not False:
        print(
            f"part {shard_id}/{num_shards}: {result.documents:,} documents, {result.tokens:,} "
            f"tokens into {len(result.outputs)} files in {elapsed:.1f}s "
            f"({result.tokens / max(elapsed, 1e-9):,.0f} tokens/s)",
            file=sys.stderr,
        )
    _finalize(fs, out, out_path, format, eos_token, storage_options)
    return result


def _tokenized(
    files: Sequence[str],
    first_file: int,
    first_doc: int,
    tokenizer: str,
    byte_offset: int,
    text_field: str,
    storage_options: dict[str, Any],
    num_proc: int,
) -> Iterator[list[np.ndarray]]:
    """Each input file's documents (from ``first_file``, document ``first_doc``), in order."""
    tasks = [
        (
            files[i],
            first_doc if i == first_file else 0,
            tokenizer,
            byte_offset,
            text_field,
            storage_options,
        )  # fmt: skip
        for i in range(first_file, len(files))
    ]
    if num_proc <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _tokenize_file(task)
        return
    import multiprocessing as mp

    with mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(num_proc) as pool:
        yield from pool.imap(_tokenize_file, tasks)


def _remove_stale_temps(fs: Any, out_path: str, shard_id: int) -> None:
    """Delete temporary files a killed run of this part left behind."""
    prefixes = (f".tmp-part{shard_id:05d}_", f".tmp-_progress_part{shard_id:05d}")
    try:
        names = fs.ls(out_path, detail=False)
    except FileNotFoundError:
        return
    for p in names:
        if posixpath.basename(p).startswith(prefixes):
            fs.rm(p)


def _finalize(
    fs: Any,
    out: str,
    out_path: str,
    format: str,
    eos_token: int | None,
    storage_options: dict[str, Any],
) -> None:
    """Write ``data_sources.txt`` (npy) and the counts file from every complete output."""
    from torchdata_ext.index import DatasetIndex
    from torchdata_ext.urls import is_local, unstrip

    suffix = ".arrow" if format == "arrow" else ".npy"
    names = sorted(
        p
        for p in fs.ls(out_path, detail=False)
        if posixpath.basename(p).startswith("part") and p.endswith(suffix)
    )
    if not names:
        return
    if format == "npy":
        listed = [os.path.abspath(p) if is_local(fs) else unstrip(fs, p) for p in names]
        data = ("\n".join(listed) + "\n").encode()
        _write_atomic(fs, posixpath.join(out_path, "data_sources.txt"), data)
        DatasetIndex.build(
            out,
            file_type="flat",
            storage_options=storage_options,
            handler_options={"eos_token": eos_token},
        )
    else:
        DatasetIndex.build(out, file_type="arrow", storage_options=storage_options)


# -- inspect -----------------------------------------------------------------------------------------
def _file_type_of(path: str, file_type: str | None, storage_options: dict[str, Any]) -> str:
    from torchdata_ext.handlers.base import format_for_url, registered_formats
    from torchdata_ext.index import read_data_sources
    from torchdata_ext.urls import expand_urls

    if file_type is not None:
        return file_type
    urls = read_data_sources(path, storage_options) if path.endswith(".txt") else [path]
    suffixes = tuple(s for sfx in registered_formats().values() for s in sfx)
    files = expand_urls(urls, storage_options, suffixes=suffixes)
    return format_for_url(files[0])


def open_index(
    path: str,
    *,
    file_type: str | None = None,
    col_name: str | None = None,
    eos_token: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """The :class:`DatasetIndex` of ``path`` (read-only: no counts file is written).

    For ``.npy`` data, a ``data_sources.txt`` in the folder is used when present, and
    ``eos_token`` (default 0) splits flat token files into documents.
    """
    from torchdata_ext.index import DatasetIndex
    from torchdata_ext.urls import filesystem, join

    storage_options = dict(storage_options or {})
    kind = _file_type_of(path, file_type, storage_options)
    options: dict[str, Any] = {}
    urls = path
    if kind in ("npy", "flat"):
        options["eos_token"] = 0 if eos_token is None else eos_token
        fs, p = filesystem(path, storage_options)
        sources = join(path, "data_sources.txt")
        if fs.isdir(p) and fs.exists(posixpath.join(p, "data_sources.txt")):
            urls = sources
    return DatasetIndex.build(
        urls,
        file_type=kind,
        col_name=col_name,
        storage_options=storage_options,
        handler_options=options,
        write_counts=False,
    )


def _doc_lengths(index: Any) -> np.ndarray:
    """Every document's length: tokens, or characters for text files."""
    handler = index.handler()
    out = []
    for url in index.files:
        reader = handler.open(url)
        try:
            lengths = handler.doc_lengths(reader)
            if lengths is None or handler.produces_for(reader) == "text":
                lengths = [len(handler.get(reader, i)) for i in range(handler.length(reader))]
            out.append(np.asarray(lengths, dtype=np.int64))
        finally:
            handler.close(reader)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def histogram(lengths: np.ndarray, edges: Sequence[int] = _HIST_EDGES) -> list[tuple[str, int]]:
    """``(bucket label, documents)`` for the buckets ``[0, e0), [e0, e1), ..., [e_last, inf)``."""
    bounds = [0, *edges]
    counts = np.bincount(np.searchsorted(edges, lengths, side="right"), minlength=len(bounds))
    labels = [f"[{lo}, {hi})" for lo, hi in zip(bounds, [*edges])] + [f">= {bounds[-1]}"]
    return list(zip(labels, counts.tolist()))


def inspect_dataset(
    path: str,
    *,
    file_type: str | None = None,
    col_name: str | None = None,
    eos_token: int | None = None,
    doc: int | None = None,
    file: str | None = None,
    tokenizer: str | None = None,
    byte_offset: int = 1,
    storage_options: dict[str, Any] | None = None,
    out: Any = None,
) -> dict[str, Any]:
    """Print a summary of the dataset at ``path`` (or one document with ``doc``); return it.

    Args:
        path: a folder, file, glob or ``data_sources.txt`` (fsspec URL).
        file_type / col_name: as in :meth:`DatasetIndex.build`.
        eos_token: for flat ``.npy`` files (default 0).
        doc: print this document: a global index over all files, or within ``file``.
        file: a file of the dataset, by position in the sorted list or by (end of) its name.
        tokenizer: ``"byte"`` or a ``tokenizer.json`` to decode tokens (or encode text).
        byte_offset: the byte tokenizer's offset (as given to ``prepare``).
        storage_options: fsspec options.
        out: a text stream (default ``sys.stdout``).
    """
    out = out or sys.stdout
    index = open_index(
        path,
        file_type=file_type,
        col_name=col_name,
        eos_token=eos_token,
        storage_options=storage_options,
    )
    if doc is None and file is None:
        lengths = _doc_lengths(index)
        text = index.handler().produces == "text" or index.total_tokens < 0
        unit = "characters" if text else "tokens"
        summary: dict[str, Any] = {
            "dataset": index.name,
            "format": index.file_type,
            "files": len(index.files),
            "documents": index.total_docs,
            "tokens": None if text else int(lengths.sum()),
            "characters": int(lengths.sum()) if text else None,
            "histogram": histogram(lengths),
        }
        print(f"dataset:   {index.name} ({index.file_type})", file=out)
        print(f"files:     {len(index.files):,}", file=out)
        print(f"documents: {index.total_docs:,}", file=out)
        if text:
            print(f"tokens:    unknown (text); characters: {int(lengths.sum()):,}", file=out)
        else:
            print(f"tokens:    {int(lengths.sum()):,}", file=out)
        if lengths.size:
            print(
                f"document length ({unit}): min {lengths.min():,}, median "
                f"{int(np.median(lengths)):,}, mean {lengths.mean():,.1f}, max {lengths.max():,}",
                file=out,
            )
        width = max(int(c) for _, c in summary["histogram"]) or 1
        for label, count in summary["histogram"]:
            bar = "#" * round(40 * count / width)
            print(f"  {label:>16} {count:>10,} {bar}", file=out)
        return summary
    return _print_doc(index, doc if doc is not None else 0, file, tokenizer, byte_offset, out)


def _print_doc(
    index: Any, doc: int, file: str | None, tokenizer: str | None, byte_offset: int, out: Any
) -> dict[str, Any]:
    counts = index.doc_counts.tolist()
    if file is not None:
        f = _find_file(index, file)
        if not 0 <= doc < counts[f]:
            raise ValueError(f"--doc {doc} is out of range: {index.files[f]} has {counts[f]} docs")
        local = doc
    else:
        if not 0 <= doc < index.total_docs:
            raise ValueError(f"--doc {doc} is out of range: the dataset has {index.total_docs}")
        starts = np.cumsum([0, *counts])
        f = int(np.searchsorted(starts, doc, side="right") - 1)
        local = doc - int(starts[f])
    handler = index.handler()
    reader = handler.open(index.files[f])
    try:
        value = handler.get(reader, local)
    finally:
        handler.close(reader)
    info: dict[str, Any] = {"file": index.files[f], "doc": local}
    print(f"file: {index.files[f]} (file {f}), document {local}", file=out)
    if isinstance(value, str):
        info["text"] = value
        print(f"text ({len(value)} characters):", file=out)
        print(value, file=out)
        if tokenizer is not None:
            from torchdata_ext.tokenizers import as_encoder

            ids = as_encoder(load_tokenizer(tokenizer, byte_offset)).encode_batch([value])[0]
            info["tokens"] = [int(t) for t in ids]
            print(f"tokens ({len(ids)}): {info['tokens']}", file=out)
        return info
    tokens = [int(t) for t in np.asarray(value).tolist()]
    info["tokens"] = tokens
    print(f"tokens ({len(tokens)}): {tokens}", file=out)
    if tokenizer is not None:
        info["text"] = _decoder(tokenizer, byte_offset)(tokens)
        print("text:", file=out)
        print(info["text"], file=out)
    return info


def _find_file(index: Any, file: str) -> int:
    if file.isdigit() and int(file) < len(index.files):
        return int(file)
    hits = [i for i, f in enumerate(index.files) if f == file or f.endswith("/" + file)]
    if len(hits) != 1:
        raise ValueError(
            f"--file {file!r} matches {len(hits)} of the dataset's files; give its position "
            f"(0..{len(index.files) - 1}) or a unique name, e.g. {index.files[0]!r}"
        )
    return hits[0]


# -- command line ------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchdata-ext", description="Prepare and inspect torchdata-ext datasets."
    )
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser(
        "prepare",
        help="tokenize text files into shard files",
        description="Tokenize JSONL/Parquet/.txt text into Arrow or flat .npy token shards "
        "(resumable; see python -m pydoc torchdata_ext.cli).",
    )
    pp.add_argument("inputs", nargs="+", help="input files, folders, globs or braces (URLs)")
    pp.add_argument("--out", "-o", required=True, help="output folder (URL)")
    pp.add_argument("--format", choices=("arrow", "npy"), default="arrow")
    pp.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    pp.add_argument("--byte-offset", type=int, default=1, help="byte tokenizer id offset")
    pp.add_argument("--text-field", default="text", help="JSONL field / Parquet text column")
    pp.add_argument("--eos-token", type=int, default=None, help="appended to each document")
    pp.add_argument("--max-tokens-per-file", type=int, default=100_000_000)
    pp.add_argument("--num-proc", type=int, default=1, help="tokenizing processes")
    pp.add_argument("--shard-id", type=int, default=None, help="this part (default SLURM id)")
    pp.add_argument("--num-shards", type=int, default=None, help="number of parts")
    pp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    pp.add_argument("--slow-for-tests", type=float, default=0.0, help=argparse.SUPPRESS)

    ip = sub.add_parser("inspect", help="summarize a dataset or print one document")
    ip.add_argument("path", help="dataset folder, file, glob or data_sources.txt (URL)")
    ip.add_argument("--file-type", default=None, help="format name (default: by suffix)")
    ip.add_argument("--col-name", default=None, help="token column or text field")
    ip.add_argument("--eos-token", type=int, default=None, help="flat .npy EOS (default 0)")
    ip.add_argument("--doc", type=int, default=None, help="print this document")
    ip.add_argument("--file", default=None, help="with --doc: index within this file")
    ip.add_argument("--tokenizer", default=None, help="'byte' or tokenizer.json, to decode")
    ip.add_argument("--byte-offset", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``torchdata-ext`` / ``python -m torchdata_ext``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            shard_id, num_shards = args.shard_id, args.num_shards
            if shard_id is None and num_shards is None and "SLURM_ARRAY_TASK_ID" in os.environ:
                shard_id = int(os.environ["SLURM_ARRAY_TASK_ID"])
                num_shards = int(os.environ.get("SLURM_ARRAY_TASK_COUNT", "1"))
            res = prepare(
                args.inputs,
                args.out,
                format=args.format,
                tokenizer=args.tokenizer,
                byte_offset=args.byte_offset,
                text_field=args.text_field,
                eos_token=args.eos_token,
                max_tokens_per_file=args.max_tokens_per_file,
                num_proc=args.num_proc,
                shard_id=shard_id or 0,
                num_shards=num_shards or 1,
                progress=args.progress,
                slow_for_tests=args.slow_for_tests,
            )
            what = "already complete" if res.skipped else "resumed" if res.resumed else "done"
            print(json.dumps({"status": what, **asdict(res)}, indent=1))
        else:
            inspect_dataset(
                args.path,
                file_type=args.file_type,
                col_name=args.col_name,
                eos_token=args.eos_token,
                doc=args.doc,
                file=args.file,
                tokenizer=args.tokenizer,
                byte_offset=args.byte_offset,
            )
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"torchdata-ext {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
