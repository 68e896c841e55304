"""Tokenize text files into token shards the pipeline reads: :func:`prepare` (resumable, in parts).

(Named ``prepare_data`` so that the module does not share its name with the function
``torchdata_ext.prepare``, which would shadow it: ``import torchdata_ext.prepare as m`` would
give the function.) The ``torchdata-ext prepare`` command (:mod:`torchdata_ext.cli`) calls it.

* Inputs: JSONL (``.jsonl``/``.json``, optionally ``.gz``/``.zst``, or as ``compression``
  says; the text in ``text_field``), Parquet (a string column ``text_field``) and plain text
  (``.txt``: **one document per file**, the whole file, decoded as ``encoding``; JSONL and
  Parquet are UTF-8 by their specifications). Local paths or fsspec URLs, with globs and braces;
  folders are searched for those suffixes. Empty texts are skipped; inputs that hold no
  document at all are an error. Bytes of a ``.txt`` file that are not valid ``encoding`` become
  U+FFFD: the documents affected are counted (``undecodable_documents``) and a
  ``UnicodeWarning`` names the first file.
* ``format="arrow"`` (Bamba layout): Arrow IPC files, one record batch per document, one
  integer column ``tokens``. ``format="npy"`` (Bolmo layout): flat ``.npy`` token arrays,
  every document followed by ``eos_token`` (default 0), plus ``data_sources.txt`` listing
  them (by names relative to its folder, so the folder can move). ``format="mds"`` (Mosaic MDS, as ``mosaicml-streaming`` and LLM Foundry read it): one
  sample per document in an ``ndarray:<dtype>`` column ``tokens``, plus ``index.json``. All
  get ``meta/torchdata_ext_counts.csv`` (documents and tokens per file). Tokens are stored as
  the smallest of ``uint16``/``uint32`` that holds the vocabulary and ``eos_token`` (``uint16``
  for the byte tokenizer or an 8,000-token BPE; ``dtype=`` forces one), recorded in the
  metadata.
* ``tokenizer="byte"`` is :class:`~torchdata_ext.tokenizers.load.ByteTokenizer` with
  ``offset=byte_offset`` (default 1, as in the pipeline config and ``inspect``, so id 0 stays
  free for EOS; ids 1..256 are bytes); otherwise the path of a Hugging Face ``tokenizer.json``.
  An ``eos_token`` the tokenizer emits for ordinary text, or outside ``uint32``, is refused.
* ``meta/torchdata_ext_meta.json`` (:mod:`torchdata_ext.sources.prepared_meta`) records the tokenizer
  (a local file as an absolute path, with its hash), its offset, vocabulary size, BOS/EOS ids, dtype, format and package version; the pipeline
  refuses a config that disagrees with it and ``inspect`` decodes with it. A run into a folder
  whose file says otherwise (another part with other settings) is refused.
* ``data_fraction``/``seed`` keep a seeded sample of the documents (the same for a seed
  whatever ``num_proc``/``num_shards``), ``min_length``/``max_length`` a range of token counts
  (without EOS); what they leave out is counted (:mod:`torchdata_ext.prepare_data.filter`).
* Outputs hold at most ``max_tokens_per_file`` tokens (a longer document gets a file of its
  own; documents are never split) and are named ``part{shard_id:05d}_{n:05d}.arrow|npy|mds``.
* ``shard_id=K, num_shards=N`` (e.g. a Slurm array): part K takes the K-th of N contiguous,
  equal slices of the sorted input files (:func:`split_inputs`), so the parts in order hold the
  same documents, in the same order, as one run over everything.
* ``num_proc=P`` tokenizes P input files at a time in a process pool; results are consumed in
  input order, so the output does not depend on P.

This module is 630 lines, over the ~500 of the style guide: it is one resumable state machine
(the progress record, parts, the outputs) whose stages share the run's state (:class:`_PartRun`).
Sampling and length filters live in :mod:`~torchdata_ext.prepare_data.filter`, reading and
tokenizing the inputs in :mod:`~torchdata_ext.prepare_data.tokenize_inputs`, the progress
record's settings and reading in :mod:`~torchdata_ext.prepare_data.progress_record`, and the
output files' bytes, stale temporaries and listings in
:mod:`~torchdata_ext.prepare_data.output_files`.

Kills and restarts: each output file is written atomically
(:func:`torchdata_ext.remote.write_bytes_atomic`), then ``_progress_part{K:05d}.json`` (also
atomic) records the next output number and the input position (file, document, and that
document's record index) where that output starts: inside a large file too, since a file is
read ``chunk_documents`` records at a time (memory bounded by that, not by the file; a
compressed JSONL file, a remote file or a ``.txt`` file is still read whole). A record
without the record index (an earlier version's) resumes by reading that file from its start.
A re-run with the same arguments starts there, so the final shards are byte-identical to an
uninterrupted run. A part that finished is skipped. Each finishing part rewrites
``data_sources.txt`` and the counts file from every complete output in the folder (re-run any
part to refresh them after all parts end).
"""

from __future__ import annotations

import codecs
import logging
import posixpath
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchdata_ext.handlers.base import get_handler, registered_formats
from torchdata_ext.prepare_data import output_files
from torchdata_ext.prepare_data.filter import (
    DocFilter,
    check_same_filter,
    left_out_summary,
    warn_nothing_kept,
)
from torchdata_ext.prepare_data.progress_record import (
    input_stats,
    new_progress,
    other_parts_configs,
    progress_bytes,
    progress_config,
    progress_path,
    saved_progress,
    totals_summary,
)
from torchdata_ext.prepare_data.tokenize_inputs import (
    PARQUET_SUFFIXES,
    FileDocs,
    TokenizeSettings,
    cached_tokenizer,
    file_chunks,
    tokenized_chunks,
)
from torchdata_ext.progress import DELAY_S, Progress
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import expand_urls, filesystem, storage_options_of, unstrip
from torchdata_ext.sources.prepared_meta import PreparedMeta, check_same_settings, write_meta
from torchdata_ext.tokenizers.load import (
    DEFAULT_BYTE_OFFSET,
    check_special_tokens,
    token_ids,
    tokenizer_location,
)

__all__ = ["INPUT_SUFFIXES", "PrepareResult", "prepare", "split_inputs"]

# what prepare reads: the text formats' own suffixes (from the registry, which imports no
# handler module, so no pyarrow), and .txt (one document per file)
INPUT_SUFFIXES = (*registered_formats()["jsonl"], *PARQUET_SUFFIXES, ".txt")
_UINT32_MAX = int(np.iinfo(np.uint32).max)


@dataclass
class PrepareResult:
    """What one :func:`prepare` part did.

    Attributes:
        out: the output folder.
        outputs: this part's output file URLs, in order.
        documents / tokens: written by this call (0 for a part that was already done); a
            resumed call counts only what it added.
        total_documents / total_tokens: what the part's outputs hold, over every run of it
            (this one and the interrupted ones it resumed); None for a part whose progress
            record was started by a version that did not count them.
        resumed: the part continued from an earlier, interrupted run.
        skipped: the part was already complete; nothing was written.
        undecodable_documents: documents (of this call) with bytes that are not valid in
            ``encoding``, written with U+FFFD in their place.
        sampled_out: documents (of this call) left out by ``data_fraction``.
        too_short / too_long: documents (of this call, in the sample) left out by
            ``min_length`` / ``max_length``.
        empty: records (of this call) left out because their text is empty (``""``): they
            are no document.
    """

    out: str
    outputs: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    resumed: bool = False
    skipped: bool = False
    undecodable_documents: int = 0
    sampled_out: int = 0
    too_short: int = 0
    too_long: int = 0
    empty: int = 0
    total_documents: int | None = None
    total_tokens: int | None = None


def split_inputs(files: Sequence[str], shard_id: int, num_shards: int) -> list[str]:
    """Part ``shard_id`` of ``num_shards`` contiguous, near-equal slices of ``files``."""
    n = len(files)
    return list(files[shard_id * n // num_shards : (shard_id + 1) * n // num_shards])


def _refuse_token_files(files: Sequence[str]) -> None:
    """Refuse an input in a format other than the text ``prepare`` reads (an Arrow or ``.npy``
    token shard, a CBOR file...), saying what it is, rather than failing to parse it as JSON."""
    for url in files:
        if url.lower().endswith(INPUT_SUFFIXES):
            continue
        kind = next(
            (k for k, sfx in registered_formats().items() if url.lower().endswith(tuple(sfx))),
            None,
        )
        if kind is not None:
            raise ValueError(
                f"{url} is a {kind!r} file, not text: prepare reads JSONL, Parquet or .txt "
                "text and writes token shards. A token file is already prepared: read it "
                f"directly (DatasetIndex.build / PipelineConfig with file_type={kind!r}), or "
                "pass the text it was made from"
            )


def prepare(
    inputs: str | Sequence[str],
    out: str,
    *,
    format: str = "arrow",
    tokenizer: str = "byte",
    byte_offset: int = DEFAULT_BYTE_OFFSET,
    text_field: str = "text",
    eos_token: int | None = None,
    max_tokens_per_file: int = 100_000_000,
    num_proc: int = 1,
    shard_id: int = 0,
    num_shards: int = 1,
    encoding: str = "utf-8",
    compression: str | None = "infer",
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
    slow_for_tests: float = 0.0,
    data_fraction: float = 1.0,
    seed: int = 0,
    min_length: int | None = None,
    max_length: int | None = None,
    dtype: str | None = None,
    chunk_documents: int = 10_000,
) -> PrepareResult:
    """Tokenize text files into shards in ``out`` (see the module docstring); resumable.

    Args:
        inputs: input URLs (files, folders, globs, braces).
        out: the output folder (fsspec URL).
        format: ``"arrow"``, ``"npy"`` or ``"mds"``.
        tokenizer: ``"byte"`` or the path of a ``tokenizer.json``.
        byte_offset: the byte tokenizer's id offset (ids ``< byte_offset`` stay free;
            default 1, the same as the pipeline config's and ``inspect``'s).
        text_field: the JSONL field / Parquet column holding the text.
        eos_token: appended to every document; for ``npy`` default 0 (it separates documents),
            for ``arrow`` default none (the pipeline adds it). It must be an id the tokenizer
            never emits for ordinary text (one of its own special tokens is allowed).
        max_tokens_per_file: cap of tokens per output file.
        num_proc: tokenizing processes.
        shard_id / num_shards: which part of the inputs this call does.
        encoding: the text encoding of ``.txt`` inputs (e.g. ``"latin-1"``).
        compression: of JSONL inputs: ``"infer"`` (from the content and the name), None,
            ``"gzip"`` or ``"zstd"``.
        storage_options: fsspec options for inputs and outputs.
        progress: how the work is reported on stderr, in input bytes with the time left: a
            tqdm bar when stderr is a terminal, else a line every 10 s (logger
            ``torchdata_ext.prepare_data.tokenize_text.progress``), then a closing summary line. None: once
            the part has run 2 s; True: from the start; False: nothing, not even the summary.
        slow_for_tests: seconds to sleep per range of records tokenized (tests of kills).
        data_fraction: keep a seeded sample of about this share of the documents, in
            ``(0, 1]``: the same documents for the same ``seed`` whatever ``num_proc`` and
            ``num_shards`` (:mod:`torchdata_ext.prepare_data.filter`).
        seed: the sample's seed (used only when ``data_fraction < 1``).
        min_length / max_length: keep only documents of at least / at most this many tokens
            after tokenizing, not counting the appended ``eos_token`` (None: no bound).
        dtype: the stored token dtype, ``"uint16"`` or ``"uint32"``; None (default): the
            smallest that holds the vocabulary and ``eos_token`` (``uint16`` up to 65,536 ids,
            e.g. the byte tokenizer or an 8,000-token BPE), recorded in the metadata.
        chunk_documents: records (JSONL lines, Parquet rows) read and tokenized at a time
            per process: what bounds memory (with ``max_tokens_per_file``, the output being
            filled) instead of the input file's size; the progress record moves with every
            output written, inside a file too. A compressed JSONL, a remote or a ``.txt``
            file is still read whole. Does not change the output.

    Returns:
        What this call did (:class:`PrepareResult`).

    Raises:
        ValueError: bad arguments, inputs with no document, or ``out`` is a file or holds
            progress of a different configuration. Nothing is written before the arguments,
            the tokenizer and ``out`` are checked, nor when the inputs hold no document.
    """
    _check_arguments(format, shard_id, num_shards, max_tokens_per_file, num_proc)
    if (
        isinstance(chunk_documents, bool)
        or not isinstance(chunk_documents, int)
        or (chunk_documents < 1)
    ):
        raise ValueError(
            f"chunk_documents={chunk_documents!r} must be a whole number >= 1 (records "
            "tokenized at a time); pass e.g. chunk_documents=10000"
        )
    _check_tokens(tokenizer, byte_offset, eos_token, encoding, compression)
    doc_filter = DocFilter(data_fraction, seed, min_length, max_length)
    if format == "npy" and eos_token is None:
        eos_token = 0
    storage_options = storage_options_of(storage_options)
    fs, out_path = _output_folder(out, storage_options)
    mine = _part_inputs(inputs, storage_options, shard_id, num_shards)
    # a bad tokenizer or an eos_token it can emit fails here, before anything is written
    meta = _describe_tokens(tokenizer, byte_offset, eos_token, dtype, format, storage_options)
    how = TokenizeSettings(
        tokenizer, byte_offset, text_field, encoding, compression, storage_options, doc_filter
    )
    config = progress_config(how, mine, format, eos_token, max_tokens_per_file, shard_id,
                              num_shards, meta.dtype)  # fmt: skip
    run = _open_part(fs, out, out_path, mine, config, meta, storage_options)
    if run.state["done"]:
        run.result.skipped = True
    else:
        _write_part(run, how, num_proc, progress, slow_for_tests, chunk_documents)
    write_meta(out, meta, storage_options)
    output_files.write_listings(fs, out, out_path, format, eos_token, storage_options, meta.dtype)
    return run.result


def _output_folder(out: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem and path of the output folder ``out``; refuses a file."""
    fs, out_path = filesystem(out, storage_options)
    if fs.isfile(out_path):
        raise ValueError(
            f"{out=} is a file, not a folder; pass a new folder, or one an earlier prepare wrote"
        )
    return fs, out_path


def _part_inputs(
    inputs: str | Sequence[str], storage_options: dict[str, Any], shard_id: int, num_shards: int
) -> list[str]:
    """This part's input files: ``inputs`` expanded, sorted and sliced (:func:`split_inputs`);
    refuses token files, and warns (for the caller of :func:`prepare`) when none is left."""
    raw = [inputs] if isinstance(inputs, str) else list(inputs)
    files = expand_urls(raw, storage_options, suffixes=INPUT_SUFFIXES)
    _refuse_token_files(files)
    mine = split_inputs(files, shard_id, num_shards)
    if not mine:
        warnings.warn(
            f"part {shard_id} of {num_shards} got no input file: the {len(files)} input "
            f"file(s) are split among the parts by file, so parts beyond them have nothing to "
            f"do; use num_shards={len(files)} or fewer, or split the inputs into more files",
            stacklevel=3,  # prepare's caller
        )
    return mine


def _describe_tokens(
    tokenizer: str,
    byte_offset: int,
    eos_token: int | None,
    dtype: str | None,
    format: str,
    storage_options: dict[str, Any],
) -> PreparedMeta:
    """Load the tokenizer, refuse an ``eos_token`` it can emit, and describe the tokens the
    part writes (the metadata file's content, with the stored dtype chosen)."""
    tok = cached_tokenizer(tokenizer, byte_offset, storage_options)
    check_special_tokens({"eos_token": eos_token}, dtype="uint32", ids=token_ids(tok, tokenizer))
    return PreparedMeta.describe(
        tok,
        tokenizer_location(tokenizer),
        bos_token=None,
        eos_token=eos_token,
        dtype=dtype,
        format=format,
    )


@dataclass
class _PartRun:
    """One part's run: where it writes, its progress record, the documents of the next output
    and what it counted. The state :func:`prepare`'s stages share, held in one place."""

    fs: Any
    out_path: str
    files: list[str]  # this part's inputs
    config: dict[str, Any]  # as progress_config gives it
    state: dict[str, Any]  # the progress record: config, next_output, input, doc, done
    result: PrepareResult
    storage_options: dict[str, Any]
    encode: Callable[[Sequence[np.ndarray]], bytes]  # documents -> one output's bytes
    buf: list[np.ndarray] = field(default_factory=list)  # the next output's documents
    buf_tokens: int = 0
    seen: int = 0  # non-empty texts read, kept or not
    undecodable_files: list[str] = field(default_factory=list)

    @property
    def shard_id(self) -> int:
        """Which part of the inputs this is."""
        return int(self.config["shard_id"])

    def output_url(self, n: int) -> str:
        """The URL of this part's output number ``n``."""
        suffix = output_files.SHARD_SUFFIXES[self.config["format"]]
        name = f"part{self.shard_id:05d}_{n:05d}{suffix}"
        return unstrip(self.fs, posixpath.join(self.out_path, name))

    def save_progress(self) -> None:
        """Write the progress record (atomically)."""
        url = unstrip(self.fs, progress_path(self.out_path, self.shard_id))
        write_bytes_atomic(url, progress_bytes(self.state), self.storage_options)

    def add_file(self, i: int, got: FileDocs, base: int = 0) -> None:
        """Count what a range of input file ``i`` held and left out, and add the documents it
        keeps (each with ``eos_token`` appended) to the outputs, writing an output when one is
        full (``base``: the file's non-empty texts before the range's positions)."""
        url, result, eos_token = self.files[i], self.result, self.config["eos_token"]
        if got.undecodable:
            result.undecodable_documents += got.undecodable
            self.undecodable_files.append(url)
        self.seen += got.seen
        result.sampled_out += got.sampled_out
        result.too_short += got.too_short
        result.too_long += got.too_long
        result.empty += got.empty
        eos = None if eos_token is None else np.array([eos_token], np.uint32)
        for doc, pos, rec in zip(got.docs, (got.positions + base).tolist(), got.records.tolist()):
            if eos is not None:
                if eos_token in doc:
                    raise ValueError(
                        f"{url}: document {pos} contains eos_token={eos_token} (the "
                        "tokenizer added it), which would split it when read back; choose "
                        "another eos_token"
                    )
                doc = np.concatenate([doc, eos])
            if self.buf and self.buf_tokens + doc.size > self.config["max_tokens_per_file"]:
                self.write_output((i, pos, rec))
            self.buf.append(doc)
            self.buf_tokens += doc.size
            result.documents += 1
            result.tokens += doc.size

    def write_output(self, next_pos: tuple[int, int, int]) -> None:
        """Write the buffered documents as the next output, then the progress record: the
        output after it starts at input position ``next_pos`` (file, document: its place
        among the file's non-empty texts, record: its record index in the file)."""
        n_out = int(self.state["next_output"])
        data = self.encode(self.buf)
        write_bytes_atomic(self.output_url(n_out), data, self.storage_options)
        self.result.outputs.append(self.output_url(n_out))
        if "documents" in self.state:  # the part's totals (records started before: unknown)
            self.state["documents"] += len(self.buf)
            self.state["tokens"] += self.buf_tokens
        self.buf, self.buf_tokens = [], 0
        self.state.update(
            next_output=n_out + 1, input=next_pos[0], doc=next_pos[1], record=next_pos[2]
        )
        self.save_progress()

    def wrote_nothing(self) -> bool:
        """Whether the part has no output, written or buffered."""
        return not self.buf and int(self.state["next_output"]) == 0

    def finish(self) -> None:
        """Write the buffered documents as the last output and record the part as done."""
        if self.buf:
            self.write_output((len(self.files), 0, 0))
        self.state.update(done=True, input=len(self.files), doc=0, record=0)
        self.save_progress()
        self.result.total_documents = self.state.get("documents")
        self.result.total_tokens = self.state.get("tokens")


def _open_part(
    fs: Any,
    out: str,
    out_path: str,
    files: list[str],
    config: dict[str, Any],
    meta: PreparedMeta,
    storage_options: dict[str, Any],
) -> _PartRun:
    """Start the part, or resume it from its progress record; refuses an ``out`` whose
    metadata or other parts say other settings, and deletes the temporaries a killed run of
    the part left behind."""
    shard_id = int(config["shard_id"])
    result = PrepareResult(out=out)
    stats = input_stats(files, storage_options)  # a changed input is refused on a re-run
    state = saved_progress(fs, progress_path(out_path, shard_id), config, out, shard_id,
                           files, stats)  # fmt: skip
    if state is None:
        state = new_progress(config, stats)
    else:
        result.resumed = True
        result.total_documents = state.get("documents")
        result.total_tokens = state.get("tokens")
    check_same_settings(out, meta, storage_options)
    check_same_filter(other_parts_configs(fs, out_path, shard_id), config, out)
    output_files.remove_stale_temps(fs, out_path, shard_id)
    encode = output_files.shard_encoder(config["format"], meta.dtype)
    run = _PartRun(fs, out_path, files, config, state, result, storage_options, encode)
    result.outputs = [run.output_url(n) for n in range(int(state["next_output"]))]
    return run


def _write_part(
    run: _PartRun,
    how: TokenizeSettings,
    num_proc: int,
    progress: bool | None,
    slow_for_tests: float,
    chunk_documents: int,
) -> None:
    """Tokenize the part's inputs from where its progress record says, write them into
    outputs, record the part as done and report (progress, summary line, warnings)."""
    files, shard_id, num_shards = run.files, run.shard_id, int(run.config["num_shards"])
    sizes = _input_sizes(run.fs, files)
    bar = _progress_of(progress, shard_id, num_shards, sum(sizes[int(run.state["input"]) :]))
    t0 = time.perf_counter()
    first_file, first_doc = int(run.state["input"]), int(run.state["doc"])
    record = run.state.get("record")  # None: a record written before ranges of a file
    chunks = file_chunks(files, first_file, first_doc, record, how, chunk_documents)
    base = 0  # the file's non-empty texts before the range
    for chunk, got in tokenized_chunks(chunks, how, num_proc):
        if chunk.lo == 0 and chunk.start == 0 and chunk.file != first_file:
            base = 0
        elif chunk.file == first_file and chunk.lo == (record or 0) and chunk.start == 0:
            base = first_doc  # the resumed range starts at that document
        run.add_file(chunk.file, got, base)
        base += chunk.start + got.seen
        if bar is not None and chunk.last:
            bar.update(sizes[chunk.file])
        if slow_for_tests:
            time.sleep(slow_for_tests)
    result = run.result
    if run.seen and run.wrote_nothing():
        warn_nothing_kept(how.doc_filter, run.seen, len(files), result.sampled_out,
                          result.too_short, result.too_long, stacklevel=4)  # fmt: skip
    elif files and run.wrote_nothing():
        if bar is not None:
            bar.close(ok=False)
        many = len(files) > 1
        raise ValueError(
            f"no documents: the {len(files)} input file{'s' if many else ''} ({files[0]}"
            f"{', ...) hold' if many else ') holds'} no non-empty text under text_field={how.text_field!r}; check that the inputs are not empty, and "
            "pass the field that holds the text as text_field=..."
        )
    run.finish()
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    if progress is not False:
        print(
            f"part {shard_id}/{num_shards}: {result.documents:,} documents, {result.tokens:,} "
            f"tokens into {len(result.outputs)} files in {elapsed:.1f}s "
            f"({result.tokens / max(elapsed, 1e-9):,.0f} tokens/s)"
            f"{totals_summary(result.resumed, result.total_documents, result.total_tokens)}"
            f"{left_out_summary(result.sampled_out, result.too_short, result.too_long, result.empty)}",
            file=sys.stderr,
        )
    if run.undecodable_files:
        _warn_undecodable(run, how.encoding)


def _warn_undecodable(run: _PartRun, encoding: str) -> None:
    """Warn (for the caller of :func:`prepare`) that some documents were not valid
    ``encoding``, naming the first file."""
    n, k = run.result.undecodable_documents, len(run.undecodable_files)
    first = run.undecodable_files[0]
    where = f"in {k} files, the first {first}" if k > 1 else first
    warnings.warn(
        f"{n} of {run.result.documents} documents ({where}) {'are' if n > 1 else 'is'} not valid "
        f"{encoding}: {'their' if n > 1 else 'its'} undecodable bytes became U+FFFD; if the "
        "files use another encoding, prepare them into a new folder with encoding=... "
        "(e.g. encoding='latin-1' or encoding='cp1252')",
        UnicodeWarning,
        stacklevel=4,  # prepare's caller (this, _write_part, prepare)
    )


def _input_sizes(fs: Any, urls: Sequence[str]) -> list[int]:
    """Each input's size in bytes (0 when the filesystem does not say)."""
    try:
        return [int(x or 0) for x in fs.sizes([fs._strip_protocol(u) for u in urls])]
    except (OSError, NotImplementedError, TypeError):
        return [0] * len(urls)


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is now (a test's capture, a redirect)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _progress_of(
    progress: bool | None, shard_id: int, num_shards: int, total_bytes: int
) -> Progress | None:
    """The report of this part's work, in input bytes (so with a total and an estimate of the
    time left): a tqdm bar on a terminal, else a line on stderr every ``INTERVAL_S``; from the
    start with ``progress=True``, after ``DELAY_S`` seconds with None; nothing with False.
    The lines go through the logger ``torchdata_ext.prepare_data.progress`` (to stderr unless
    the application configured that logger)."""
    if progress is False:
        return None
    # the name users configure (docs/command-line.md), whatever module this code lives in
    log = logging.getLogger("torchdata_ext.prepare_data.progress")
    if not log.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("prepare: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return Progress(
        f"part {shard_id}/{num_shards}: reading inputs",
        log,
        total=total_bytes or None,
        unit="B",
        delay=0.0 if progress else DELAY_S,
    )


def _check_arguments(
    format: str, shard_id: int, num_shards: int, max_tokens_per_file: int, num_proc: int
) -> None:
    """Raise ``ValueError`` naming the first bad argument of :func:`prepare`."""
    if format not in output_files.SHARD_SUFFIXES:
        raise ValueError(f"{format=} must be 'arrow', 'npy' or 'mds'")
    if num_shards < 1:
        raise ValueError(
            f"{num_shards=} must be >= 1 (the number of parts the inputs are split into; 1: one)"
        )
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"{shard_id=} must be in 0..{num_shards=}-1")
    if max_tokens_per_file < 1:
        raise ValueError(f"{max_tokens_per_file=} must be >= 1")
    if num_proc < 1:
        raise ValueError(f"{num_proc=} must be >= 1")


def _check_tokens(
    tokenizer: str,
    byte_offset: int,
    eos_token: int | None,
    encoding: str,
    compression: str | None,
) -> None:
    """Raise ``ValueError`` naming the first bad token id, encoding or compression."""
    check_special_tokens({"eos_token": eos_token}, dtype="uint32")
    if tokenizer == "byte" and not 0 <= byte_offset <= _UINT32_MAX - 255:
        raise ValueError(
            f"{byte_offset=} must be in 0..{_UINT32_MAX - 255} (byte ids must fit uint32)"
        )
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(
            f"{encoding=} is not a known text encoding; e.g. 'utf-8', 'latin-1', 'cp1252'"
        ) from None
    get_handler("jsonl", compression=compression)  # raises naming compression
