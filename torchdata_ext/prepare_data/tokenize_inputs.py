"""Read :func:`~torchdata_ext.prepare_data.tokenize_text.prepare`'s input files and tokenize them.

A range of ``chunk_documents`` records of an input at a time (:func:`file_chunks`; a whole
file when it cannot be read a range at a time: compressed JSONL, a remote file, ``.txt``),
tokenized by :func:`tokenized_chunks` (in a process pool with ``num_proc > 1``): its texts are
read (JSONL, Parquet, or a ``.txt`` file as one document), the non-empty ones in the seeded
sample are tokenized, the length filter is applied, and what is left comes back as
:class:`FileDocs` with each kept document's position in the file (what the progress record
stores, with its record index) and the counts of what was left out. Memory is bounded by the
range, not the file. The tokenizer is loaded once per process (:func:`cached_tokenizer`), also
for the checks ``prepare`` makes before writing anything.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from torchdata_ext.handlers.base import get_handler, registered_formats
from torchdata_ext.handlers.jsonl import release_pages
from torchdata_ext.prepare_data.filter import DocFilter
from torchdata_ext.remote.urls import filesystem, is_local
from torchdata_ext.tokenizers.load import Encoder, as_encoder, load_tokenizer

__all__ = [
    "PARQUET_SUFFIXES",
    "FileDocs",
    "TokenizeSettings",
    "Chunk",
    "cached_tokenizer",
    "file_chunks",
    "tokenized_chunks",
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


_OPEN: dict[tuple[str, str, str | None], tuple[Any, Any]] = {}  # per process: the last file


def _open_texts(url: str, how: TokenizeSettings) -> tuple[Any, Any]:
    """The handler and open reader of a JSONL or Parquet input (its texts by record), kept
    open for the next range of the same file (one file per process)."""
    key = (url, how.text_field, how.compression)
    if key in _OPEN:
        return _OPEN[key]
    close_inputs()
    kind = "parquet" if url.lower().endswith(PARQUET_SUFFIXES) else "jsonl"
    # a Parquet file read a range at a time keeps one decoded row group, not all of them
    options: dict[str, Any] = (
        {"compression": how.compression} if kind == "jsonl" else {"max_cached_row_groups": 1}
    )
    handler = get_handler(
        kind, col_name=how.text_field, storage_options=how.storage_options, **options
    )
    reader = handler.open(url)
    if handler.produces_for(reader) != "text":
        handler.close(reader)
        raise ValueError(
            f"{url}: column {how.text_field!r} holds tokens, not text; it is already "
            "tokenized (read it directly) or pass text_field=... naming the text column"
        )
    _OPEN[key] = handler, reader
    return handler, reader


def close_inputs() -> None:
    """Close the input this process keeps open (:func:`_open_texts`)."""
    while _OPEN:
        _, (handler, reader) = _OPEN.popitem()
        handler.close(reader)


def _read_texts(
    url: str, how: TokenizeSettings, lo: int = 0, hi: int | None = None
) -> tuple[list[str], set[int]]:
    """The texts of records ``lo .. hi`` (None: to the end) of one input file, in order, and
    which of them (indexes into the list) had bytes that are not valid ``how.encoding``
    (replaced by U+FFFD). A ``.txt`` file is one record."""
    if url.lower().endswith(".txt"):
        fs, path = filesystem(url, how.storage_options)
        with fs.open(path, "rb") as f:
            data = f.read()
        try:
            return [data.decode(how.encoding)], set()
        except UnicodeDecodeError:
            return [data.decode(how.encoding, errors="replace")], {0}
    handler, reader = _open_texts(url, how)
    n = handler.length(reader)
    stop = n if hi is None else min(hi, n)
    texts = [str(handler.get(reader, i)) for i in range(lo, stop)]
    release_pages(getattr(reader, "data", None))  # a memory-mapped JSONL file's range read
    if stop >= n:
        close_inputs()
    return texts, set()


def _chunkable(url: str, how: TokenizeSettings) -> bool:
    """Whether records of ``url`` can be read a range at a time without reading the whole
    file again for each range: local Parquet, and local JSONL that is not compressed (both
    memory-mapped). A compressed or remote file is read whole on open (by each process that
    opens it: read once, in one range), a ``.txt`` file is one document."""
    lower = url.lower()
    if lower.endswith((".gz", ".zst", ".zstd", ".txt")):
        return False
    fs, _ = filesystem(url, how.storage_options)
    if not is_local(fs):
        return False
    return lower.endswith(PARQUET_SUFFIXES) or str(how.compression).lower() in ("none", "infer")


def _record_count(url: str, how: TokenizeSettings) -> int:
    """The records of a chunkable input (JSONL lines with a document, Parquet rows)."""
    handler, reader = _open_texts(url, how)
    return int(handler.length(reader))


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
    """The documents of a range of one input file's records that ``prepare`` keeps, and what
    it left out."""

    docs: list[np.ndarray]  # kept documents (uint32), in order
    positions: np.ndarray  # each one's position among the range's non-empty texts (+ start)
    records: np.ndarray  # each one's record index in the file
    undecodable: int  # kept documents with bytes that were not valid ``encoding``
    seen: int  # non-empty texts read (from ``start``), kept or not
    sampled_out: int = 0
    too_short: int = 0
    too_long: int = 0
    empty: int = 0  # empty texts (from ``start``), never documents


class Chunk(NamedTuple):
    """Records ``lo .. hi`` (None: to the end) of input file ``file`` to tokenize, from its
    non-empty text ``start`` within the range on."""

    file: int
    url: str
    lo: int
    hi: int | None
    start: int
    last: bool  # the file's last range


def _tokenize_chunk(task: tuple[Chunk, TokenizeSettings]) -> FileDocs:
    """Tokens (``uint32``) of the non-empty texts of one range of an input file's records, from
    non-empty text ``start`` of the range on, that ``how.doc_filter`` keeps (the sample is
    drawn before tokenizing, by record index, so it does not depend on the ranges)."""
    chunk, how = task
    url, start = chunk.url, chunk.start
    encoder = _encoder(how)
    all_texts, undecodable = _read_texts(url, how, chunk.lo, chunk.hi)
    every_nonempty = np.flatnonzero([bool(t) for t in all_texts])  # indexes in the range
    nonempty = every_nonempty[start:]
    first_record = int(every_nonempty[start - 1]) + 1 if start else 0  # where this call reads
    in_sample = how.doc_filter.sampled(url, nonempty + chunk.lo)
    records = nonempty[in_sample]
    positions = np.arange(start, start + nonempty.size)[in_sample]
    texts = [all_texts[i] for i in records.tolist()]
    n_texts = len(all_texts)
    del all_texts  # the range's texts: only those to tokenize stay
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
        records=records[ok] + chunk.lo,
        undecodable=len(undecodable.intersection(records[ok].tolist())),
        seen=int(nonempty.size),
        sampled_out=int(nonempty.size - records.size),
        too_short=int(short.sum()),
        too_long=int(long.sum()),
        empty=n_texts - first_record - int(nonempty.size),
    )


def file_chunks(
    files: Sequence[str],
    first_file: int,
    first_doc: int,
    first_record: int | None,
    how: TokenizeSettings,
    chunk_documents: int,
) -> Iterator[Chunk]:
    """The ranges of records to tokenize, from input ``first_file``'s non-empty text
    ``first_doc`` (at record ``first_record``; None: not recorded, so that file is read from
    its start and the first ``first_doc`` non-empty texts skipped) on: ``chunk_documents``
    records a range for the inputs that can be read a range at a time, else whole files."""
    for i in range(first_file, len(files)):
        url = files[i]
        resume = i == first_file and (first_doc > 0 or bool(first_record))
        if not _chunkable(url, how) or (resume and first_record is None):
            yield Chunk(i, url, 0, None, first_doc if resume else 0, True)
            continue
        lo = int(first_record or 0) if i == first_file else 0
        n = _record_count(url, how)
        while True:
            hi = min(lo + chunk_documents, n)
            yield Chunk(i, url, lo, hi, 0, hi >= n)
            if hi >= n:
                break
            lo = hi


def tokenized_chunks(
    chunks: Iterator[Chunk], how: TokenizeSettings, num_proc: int
) -> Iterator[tuple[Chunk, FileDocs]]:
    """Each range's kept documents (:class:`FileDocs`), in order; ``num_proc > 1`` tokenizes
    that many ranges at a time in a process pool, at most ``2 * num_proc`` ranges ahead (so
    memory is bounded by the range size, not the input), still consumed in order."""
    if num_proc <= 1:
        try:
            for c in chunks:
                yield c, _tokenize_chunk((c, how))
        finally:
            close_inputs()
        return
    import collections
    import multiprocessing as mp

    close_inputs()  # not inherited open by the forked pool
    context = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    try:
        with context.Pool(num_proc) as pool:
            pending: collections.deque[tuple[Chunk, Any]] = collections.deque()
            for c in chunks:  # this process opens each file once, to count its records
                pending.append((c, pool.apply_async(_tokenize_chunk, ((c, how),))))
                if len(pending) >= 2 * num_proc:
                    done, res = pending.popleft()
                    yield done, res.get()
            while pending:
                done, res = pending.popleft()
                yield done, res.get()
    finally:
        close_inputs()
