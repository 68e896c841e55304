"""Read :func:`~torchdata_ext.prepare_data.tokenize_text.prepare`'s input files and tokenize them.

One input file at a time (:func:`tokenized_files`, in a process pool with ``num_proc > 1``):
its texts are read (JSONL, Parquet, or a ``.txt`` file as one document), the non-empty ones in
the seeded sample are tokenized, the length filter is applied, and what is left comes back as
:class:`FileDocs` with each kept document's position in the file (what the progress record
stores) and the counts of what was left out. The tokenizer is loaded once per process
(:func:`cached_tokenizer`), also for the checks ``prepare`` makes before writing anything.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdata_ext.handlers.base import get_handler, registered_formats
from torchdata_ext.prepare_data.filter import DocFilter
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.tokenizers.load import Encoder, as_encoder, load_tokenizer

__all__ = [
    "PARQUET_SUFFIXES",
    "FileDocs",
    "TokenizeSettings",
    "cached_tokenizer",
    "tokenized_files",
]

# the Parquet suffixes (from the registry, which imports no handler module, so no pyarrow)
PARQUET_SUFFIXES = tuple(registered_formats()["parquet"])
_TOKENIZE_BATCH = 256  # texts per encode_batch call


@dataclass(frozen=True)
class TokenizeSettings:
    """How to read and tokenize an input file (sent to the tokenizing processes)."""

    tokenizer: str
    byte_offset: int
    text_field: str
    encoding: str
    compression: str | None
    storage_options: dict[str, Any]
    doc_filter: DocFilter = DocFilter()


def _read_texts(url: str, how: TokenizeSettings) -> tuple[list[str], set[int]]:
    """All texts of one input file, in order, and which of them had bytes that are not valid
    ``how.encoding`` (replaced by U+FFFD)."""
    lower = url.lower()
    if lower.endswith(".txt"):
        fs, path = filesystem(url, how.storage_options)
        with fs.open(path, "rb") as f:
            data = f.read()
        try:
            return [data.decode(how.encoding)], set()
        except UnicodeDecodeError:
            return [data.decode(how.encoding, errors="replace")], {0}
    kind = "parquet" if lower.endswith(PARQUET_SUFFIXES) else "jsonl"
    options: dict[str, Any] = {"compression": how.compression} if kind == "jsonl" else {}
    handler = get_handler(
        kind, col_name=how.text_field, storage_options=how.storage_options, **options
    )
    reader = handler.open(url)
    try:
        if handler.produces_for(reader) != "text":
            raise ValueError(
                f"{url}: column {how.text_field!r} holds tokens, not text; it is already "
                "tokenized (read it directly) or pass text_field=... naming the text column"
            )
        return [str(handler.get(reader, i)) for i in range(handler.length(reader))], set()
    finally:
        handler.close(reader)


_TOKENIZERS: dict[tuple[str, int], Any] = {}  # per process (pool workers too)


def cached_tokenizer(
    spec: str, byte_offset: int, storage_options: dict[str, Any] | None = None
) -> Any:
    """The tokenizer ``spec`` (a ``tokenizer.json`` URL read with ``storage_options``, the
    call's), loaded once per process."""
    key = (spec, byte_offset)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(
            spec, byte_offset=byte_offset, storage_options=storage_options
        )
    return _TOKENIZERS[key]


def _encoder(how: TokenizeSettings) -> Encoder:
    """The tokenizer of ``how`` as an :class:`~torchdata_ext.tokenizers.load.Encoder`."""
    return as_encoder(cached_tokenizer(how.tokenizer, how.byte_offset, how.storage_options))


@dataclass
class FileDocs:
    """The documents of one input file that ``prepare`` keeps, and what it left out."""

    docs: list[np.ndarray]  # kept documents (uint32), in order
    positions: np.ndarray  # each one's position among the file's non-empty texts (progress "doc")
    undecodable: int  # kept documents with bytes that were not valid ``encoding``
    seen: int  # non-empty texts read (from ``start``), kept or not
    sampled_out: int = 0
    too_short: int = 0
    too_long: int = 0
    empty: int = 0  # empty texts (from ``start``), never documents


def _tokenize_file(task: tuple[str, int, TokenizeSettings]) -> FileDocs:
    """Tokens (``uint32``) of the non-empty texts of one input file, from non-empty text
    ``start`` on, that ``how.doc_filter`` keeps (the sample is drawn before tokenizing)."""
    url, start, how = task
    encoder = _encoder(how)
    all_texts, undecodable = _read_texts(url, how)
    every_nonempty = np.flatnonzero([bool(t) for t in all_texts])  # record indexes
    nonempty = every_nonempty[start:]
    first_record = int(every_nonempty[start - 1]) + 1 if start else 0  # where this call reads
    in_sample = how.doc_filter.sampled(url, nonempty)
    records = nonempty[in_sample]
    positions = np.arange(start, start + nonempty.size)[in_sample]
    texts = [all_texts[i] for i in records.tolist()]
    tokenized = []
    for lo in range(0, len(texts), _TOKENIZE_BATCH):
        for ids in encoder.encode_batch(texts[lo : lo + _TOKENIZE_BATCH]):
            arr = np.asarray(ids)
            if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint32).max):
                raise ValueError(f"{url}: token ids out of the uint32 range")
            tokenized.append(arr.astype(np.uint32))
    lengths = np.fromiter(map(len, tokenized), dtype=np.int64, count=len(tokenized))
    short, long = how.doc_filter.too_short(lengths), how.doc_filter.too_long(lengths)
    ok = ~(short | long)
    return FileDocs(
        docs=[d for d, keep in zip(tokenized, ok.tolist()) if keep],
        positions=positions[ok],
        undecodable=len(undecodable.intersection(records[ok].tolist())),
        seen=int(nonempty.size),
        sampled_out=int(nonempty.size - records.size),
        too_short=int(short.sum()),
        too_long=int(long.sum()),
        empty=len(all_texts) - first_record - int(nonempty.size),
    )


def tokenized_files(
    files: Sequence[str],
    first_file: int,
    first_doc: int,
    how: TokenizeSettings,
    num_proc: int,
) -> Iterator[FileDocs]:
    """Each input file's kept documents (from ``first_file``, non-empty text ``first_doc``),
    in order (:class:`FileDocs`); ``num_proc > 1`` tokenizes that many files at a time in a
    process pool, its results still consumed in input order."""
    tasks = [
        (files[i], first_doc if i == first_file else 0, how) for i in range(first_file, len(files))
    ]
    if num_proc <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _tokenize_file(task)
        return
    import multiprocessing as mp

    with mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(num_proc) as pool:
        yield from pool.imap(_tokenize_file, tasks)
