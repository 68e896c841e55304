"""Look into a dataset: :func:`inspect_dataset` summarizes it or shows one document.

(Named ``inspect_data`` rather than ``inspect``, which would shadow the standard library's
``inspect`` for any script run from inside the package folder.) The ``torchdata-ext inspect``
command (:mod:`torchdata_ext.cli`) calls it.

Works on any dataset :class:`~torchdata_ext.sources.index.DatasetIndex` reads (arrow, parquet, npy
CEPED/flat, jsonl) and never writes into it (no counts file). The summary counts files,
documents, tokens (characters for text) and a histogram of document lengths; one document is
shown by global index, or by index within one file, decoded (tokens) or encoded (text) with a
tokenizer on request; its report shows the first 1,000 tokens and 10,000 characters unless
``full``, and the returned document is always whole. Data that ``prepare``
wrote carries how it was tokenized (:mod:`torchdata_ext.sources.prepared_meta`): the summary shows it,
and documents are decoded with that tokenizer (found by the absolute path or URL recorded; and
flat ``.npy`` split on that EOS); a tokenizer other than the recorded one (another
``tokenizer.json`` hash or byte offset) is refused, as it would show the wrong text.
"""

from __future__ import annotations

import dataclasses
import posixpath
import sys
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from torchdata_ext.handlers.base import format_for_url, registered_formats
from torchdata_ext.handlers.mds import drop_mds_side_files
from torchdata_ext.remote.urls import expand_urls, filesystem, join, storage_options_of
from torchdata_ext.sources.index import DatasetIndex, read_data_sources
from torchdata_ext.sources.prepared_meta import PreparedMeta, other_tokenizer, read_meta
from torchdata_ext.tokenizers.load import DEFAULT_BYTE_OFFSET, as_encoder, load_tokenizer

__all__ = ["histogram", "inspect_dataset", "open_index"]

_HIST_EDGES = (16, 128, 1024, 8192, 65536)
_BAR_WIDTH = 40  # characters of the longest histogram bar
_SHOWN_TOKENS = 1_000  # of a document, unless full
_SHOWN_CHARS = 10_000
MORE_HINT = "(full=True shows all)"  # the command line shows its own flag (cli.py)


def inspect_dataset(
    path: str,
    *,
    file_type: str | None = None,
    col_name: str | None = None,
    eos_token: int | None = None,
    doc: int | None = None,
    file: str | None = None,
    tokenizer: str | None = None,
    byte_offset: int | None = None,
    compression: str | None = "infer",
    full: bool = False,
    storage_options: dict[str, Any] | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Print a summary of the dataset at ``path`` (or one document with ``doc``); return it.

    Args:
        path: a folder, file, glob or ``data_sources.txt`` (fsspec URL).
        file_type / col_name: as in :meth:`DatasetIndex.build`.
        eos_token: for flat ``.npy`` files (default: the one ``prepare`` recorded, else 0).
        doc: print this document: a global index over all files, or within ``file``.
        file: a file of the dataset, by position in the sorted list or by (end of) its name.
        tokenizer: ``"byte"`` or a ``tokenizer.json`` to decode tokens (or encode text);
            default: the one ``prepare`` recorded in the data's metadata file, else none. For
            such data it must be the recorded one (``ValueError`` otherwise).
        byte_offset: the byte tokenizer's offset (default: the one ``prepare`` recorded, else
            1, as everywhere).
        compression: of JSONL files: ``"infer"``, None, ``"gzip"`` or ``"zstd"``.
        full: print the whole document (default: its first 1,000 tokens and 10,000
            characters).
        storage_options: fsspec options.
        out: a text stream for the report (default ``sys.stdout``).

    Returns:
        The summary: ``{"dataset", "format", "files", "documents", "tokens", "characters",
        "histogram", "prepared"}`` (``tokens`` None for text, ``characters`` None for tokens;
        ``histogram`` as :func:`histogram`; ``prepared`` the metadata file's fields, or None);
        or, with ``doc`` or ``file``, the document: ``{"file", "doc"}``
        (its file URL and index within it) plus ``"tokens"`` (list of ints) and/or ``"text"``
        (what is stored, and the other one when ``tokenizer`` is given).

    Raises:
        ValueError: ``doc`` is out of range, or ``file`` matches no file or several.
    """
    from torchdata_ext.checkpoint.dcp_entries import is_dcp_checkpoint  # (torch; only here)
    from torchdata_ext.checkpoint.folder import is_checkpoint_folder

    if is_dcp_checkpoint(path, storage_options):
        raise ValueError(
            f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not a dataset: inspect "
            "the data it was taken of, or audit the loader state in it to see what the run "
            "consumed (torchdata_ext.audit_checkpoint, or the audit command; --key picks the "
            "loader state when it holds several)"
        )
    if is_checkpoint_folder(path, storage_options):
        raise ValueError(
            f"{path} is a loader checkpoint folder (written by save_checkpoint), not a dataset: "
            "inspect the data it was taken of, or audit the checkpoint to see what the run "
            "consumed (torchdata_ext.audit_checkpoint, or the audit command)"
        )
    found = read_meta(_folder_of(path, storage_options), storage_options)
    meta = None if found is None else found[0]
    recorded = meta is not None and tokenizer is None  # decode with what prepare recorded
    if meta is not None:
        eos_token = meta.eos_token if eos_token is None else eos_token
        if tokenizer is None:
            tokenizer = meta.tokenizer
        if byte_offset is None and tokenizer == meta.tokenizer:
            byte_offset = meta.byte_offset
    index = open_index(
        path,
        file_type=file_type,
        col_name=col_name,
        eos_token=eos_token,
        compression=compression,
        storage_options=storage_options,
    )
    byte_offset = DEFAULT_BYTE_OFFSET if byte_offset is None else byte_offset
    if doc is None and file is None:
        result, lines = _summary(index, meta)
    else:
        shown = None if full else (_SHOWN_TOKENS, _SHOWN_CHARS)
        tok = None
        if tokenizer is not None:
            try:
                tok = load_tokenizer(
                    tokenizer, byte_offset=byte_offset, storage_options=storage_options
                )
            except (OSError, ValueError, ImportError) as exc:
                if not recorded or found is None:
                    raise
                warnings.warn(
                    f"{found[1]} names the tokenizer {tokenizer!r}, which cannot be loaded "
                    f"here ({exc}); showing tokens only: pass tokenizer=... to decode",
                    stacklevel=2,
                )
            if tok is not None and found is not None and meta is not None:
                ours = other_tokenizer(meta, tok, tokenizer)
                if ours is not None:
                    raise ValueError(
                        f"tokenizer={tokenizer!r} ({ours}) is not the tokenizer the data was "
                        f"prepared with, {meta.tokenizer_name} ({found[1]}): it would decode "
                        "the tokens into the wrong text; pass that tokenizer (and byte_offset), "
                        "or none to use the recorded one"
                    )
        result, lines = _document(index, doc if doc is not None else 0, file, tok, shown)
    out = out or sys.stdout
    for line in lines:
        print(line, file=out)
    return result


def open_index(
    path: str,
    *,
    file_type: str | None = None,
    col_name: str | None = None,
    eos_token: int | None = None,
    compression: str | None = "infer",
    storage_options: dict[str, Any] | None = None,
) -> DatasetIndex:
    """The :class:`DatasetIndex` of ``path`` (read-only: no counts file is written).

    For ``.npy`` data, a ``data_sources.txt`` in the folder is used when present, and
    ``eos_token`` (default 0) splits flat token files into documents. ``compression`` is that
    of JSONL files (``"infer"``: from the content and the name).
    """
    storage_options = storage_options_of(storage_options)
    kind = _file_type_of(path, file_type, storage_options)
    options: dict[str, Any] = {}
    if compression != "infer":
        if kind != "jsonl":
            raise ValueError(f"{compression=} applies to JSONL files only; {path} is {kind}")
        options["compression"] = compression
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


def histogram(lengths: np.ndarray, edges: Sequence[int] = _HIST_EDGES) -> list[tuple[str, int]]:
    """``(bucket label, documents)`` for the buckets ``[0, e0), [e0, e1), ..., [e_last, inf)``."""
    bounds = [0, *edges]
    counts = np.bincount(np.searchsorted(edges, lengths, side="right"), minlength=len(bounds))
    labels = [f"[{lo}, {hi})" for lo, hi in zip(bounds, [*edges])] + [f">= {bounds[-1]}"]
    return list(zip(labels, counts.tolist()))


def _file_type_of(path: str, file_type: str | None, storage_options: dict[str, Any]) -> str:
    """``file_type``, or the format of the first file of ``path`` by its suffix."""
    if file_type is not None:
        return file_type
    urls = read_data_sources(path, storage_options) if path.endswith(".txt") else [path]
    suffixes = tuple(s for sfx in registered_formats().values() for s in sfx)
    files = drop_mds_side_files(expand_urls(urls, storage_options, suffixes=suffixes))
    return format_for_url(files[0])


def _doc_lengths(index: DatasetIndex) -> np.ndarray:
    """Every document's length: tokens, or characters for text files."""
    lengths = index.doc_lengths(read_documents=True)  # never None when reading documents
    return np.zeros(0, np.int64) if lengths is None else lengths


def _folder_of(path: str, storage_options: dict[str, Any] | None) -> str:
    """The folder of the data at ``path`` (a folder, or the folder of a file or pattern)."""
    fs, p = filesystem(path, storage_options)
    return path if fs.isdir(p) else path.rstrip("/").rsplit("/", 1)[0] if "/" in path else "."


def _summary(index: DatasetIndex, meta: PreparedMeta | None) -> tuple[dict[str, Any], list[str]]:
    """The dataset's summary and its report lines."""
    lengths = _doc_lengths(index)
    text = index.handler().produces == "text" or index.total_tokens < 0
    total = int(lengths.sum())
    summary: dict[str, Any] = {
        "dataset": index.name,
        "format": index.file_type,
        "files": len(index.files),
        "documents": index.total_docs,
        "tokens": None if text else total,
        "characters": total if text else None,
        "histogram": histogram(lengths),
        "prepared": None if meta is None else dataclasses.asdict(meta),
    }
    lines = [
        f"dataset:   {index.name} ({index.file_type})",
        f"files:     {len(index.files):,}",
        f"documents: {index.total_docs:,}",
        f"tokens:    unknown (text); characters: {total:,}" if text else f"tokens:    {total:,}",
    ]
    if meta is not None:
        lines.append(
            f"prepared:  tokenizer {meta.tokenizer_name}, vocab_size {meta.vocab_size:,}, "
            f"bos_token {meta.bos_token}, eos_token {meta.eos_token}, {meta.dtype} "
            f"(torchdata-ext {meta.package_version})"
        )
    if lengths.size:
        lines.append(
            f"document length ({'characters' if text else 'tokens'}): min {lengths.min():,}, "
            f"median {int(np.median(lengths)):,}, mean {lengths.mean():,.1f}, "
            f"max {lengths.max():,}"
        )
    width = max(int(c) for _, c in summary["histogram"]) or 1
    for label, count in summary["histogram"]:
        bar = "#" * round(_BAR_WIDTH * count / width)
        lines.append(f"  {label:>16} {count:>10,} {bar}")
    return summary, lines


def _document(
    index: DatasetIndex,
    doc: int,
    file: str | None,
    tok: Any | None,
    shown: tuple[int, int] | None,
) -> tuple[dict[str, Any], list[str]]:
    """Document ``doc`` (global, or within ``file``) and its report lines, which show at most
    ``shown`` = (tokens, characters) of it (None: all)."""
    f, local = _locate(index, doc, file)
    handler = index.handler()
    reader = handler.open(index.files[f])
    try:
        value = handler.get(reader, local)
    finally:
        handler.close(reader)
    info: dict[str, Any] = {"file": index.files[f], "doc": local}
    lines = [f"file: {index.files[f]} (file {f}), document {local}"]
    max_tokens, max_chars = shown or (None, None)
    if isinstance(value, str):
        info["text"] = value
        lines += [f"text ({len(value)} characters):", _cut_text(value, max_chars)]
        if tok is not None:
            info["tokens"] = [int(t) for t in as_encoder(tok).encode_batch([value])[0]]
            lines.append(f"tokens ({len(info['tokens'])}): {_cut_list(info['tokens'], max_tokens)}")
        return info, lines
    info["tokens"] = [int(t) for t in np.asarray(value).tolist()]
    lines.append(f"tokens ({len(info['tokens'])}): {_cut_list(info['tokens'], max_tokens)}")
    if tok is not None:
        info["text"] = tok.decode(info["tokens"])
        lines += ["text:", _cut_text(info["text"], max_chars)]
    return info, lines


def _cut_list(tokens: list[int], limit: int | None) -> str:
    """``str(tokens)``, cut after ``limit`` items with a count of the rest."""
    if limit is None or len(tokens) <= limit:
        return str(tokens)
    return f"{str(tokens[:limit])[:-1]}, ... {len(tokens) - limit:,} more {MORE_HINT}]"


def _cut_text(text: str, limit: int | None) -> str:
    """``text``, cut after ``limit`` characters with a count of the rest."""
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit:,} more characters {MORE_HINT}]"


def _locate(index: DatasetIndex, doc: int, file: str | None) -> tuple[int, int]:
    """``(file position, document within it)`` of document ``doc`` (global, or in ``file``)."""
    counts = index.doc_counts.tolist()
    if file is not None:
        f = _find_file(index, file)
        if not 0 <= doc < counts[f]:
            raise ValueError(f"doc={doc} is out of range: {index.files[f]} has {counts[f]} docs")
        return f, doc
    if not 0 <= doc < index.total_docs:
        raise ValueError(f"doc={doc} is out of range: the dataset has {index.total_docs}")
    starts = np.cumsum([0, *counts])
    f = int(np.searchsorted(starts, doc, side="right") - 1)
    return f, doc - int(starts[f])


def _find_file(index: DatasetIndex, file: str) -> int:
    """The position of ``file`` (a position, a name or the end of one) in ``index.files``."""
    if file.isdigit() and int(file) < len(index.files):
        return int(file)
    hits = [i for i, f in enumerate(index.files) if f == file or f.endswith("/" + file)]
    if len(hits) != 1:
        raise ValueError(
            f"file={file!r} matches {len(hits)} of the dataset's files; give its position "
            f"(0..{len(index.files) - 1}) or a unique name, e.g. {index.files[0]!r}"
        )
    return hits[0]
