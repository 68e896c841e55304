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
  them. ``format="mds"`` (Mosaic MDS, as ``mosaicml-streaming`` and LLM Foundry read it): one
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

At ~640 lines this module is over the ~500 of the style guide: it is one resumable state machine
(progress files, parts, the output writers per format) whose pieces share the progress record;
sampling and length filters already live in ``prepare_filter.py``, and the output writers
(Arrow, npy, MDS) are the next cut.

Kills and restarts: each output file is written atomically
(:func:`torchdata_ext.remote.write_bytes_atomic`), then ``_progress_part{K:05d}.json`` (also
atomic) records the next output number and the input position (file, document) where that
output starts. A re-run with the same arguments starts there, so the final shards are
byte-identical to an uninterrupted run. A part that finished is skipped. Each finishing part
rewrites ``data_sources.txt`` and the counts file from every complete output in the folder
(re-run any part to refresh them after all parts end).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import io
import json
import logging
import os
import posixpath
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchdata_ext.handlers.base import get_handler, registered_formats
from torchdata_ext.prepare_data.filter import (
    FILTER_DEFAULTS,
    DocFilter,
    check_same_filter,
    left_out_summary,
    warn_nothing_kept,
)
from torchdata_ext.progress import DELAY_S, Progress
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import expand_urls, filesystem, is_local, unstrip
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.sources.index_file import write_index_file
from torchdata_ext.sources.prepared_meta import PreparedMeta, check_same_settings, write_meta
from torchdata_ext.tokenizers.load import (
    DEFAULT_BYTE_OFFSET,
    Encoder,
    as_encoder,
    check_special_tokens,
    load_tokenizer,
    token_ids,
    tokenizer_location,
)

__all__ = ["INPUT_SUFFIXES", "PrepareResult", "prepare", "split_inputs"]

# what prepare reads: the text formats' own suffixes (from the registry, which imports no
# handler module, so no pyarrow), and .txt (one document per file)
_PARQUET_SUFFIXES = tuple(registered_formats()["parquet"])
INPUT_SUFFIXES = (*registered_formats()["jsonl"], *_PARQUET_SUFFIXES, ".txt")
PROGRESS_VERSION = 1
# settings added after PROGRESS_VERSION 1, at the values every earlier run used
_PROGRESS_DEFAULTS = {"encoding": "utf-8", "compression": "infer", "dtype": "uint32"}
_PROGRESS_DEFAULTS.update(FILTER_DEFAULTS)  # data_fraction, seed, min_length, max_length
_TOKENIZE_BATCH = 256  # texts per encode_batch call
_UINT32_MAX = int(np.iinfo(np.uint32).max)
_SUFFIX = {"arrow": ".arrow", "npy": ".npy", "mds": ".mds"}


def _mds_columns(dtype: str) -> dict[str, str]:
    return {"tokens": f"ndarray:{dtype}"}


@dataclass
class PrepareResult:
    """What one :func:`prepare` part did.

    Attributes:
        out: the output folder.
        outputs: this part's output file URLs, in order.
        documents / tokens: written by this call (0 for a part that was already done).
        resumed: the part continued from an earlier, interrupted run.
        skipped: the part was already complete; nothing was written.
        undecodable_documents: documents (of this call) with bytes that are not valid in
            ``encoding``, written with U+FFFD in their place.
        sampled_out: documents (of this call) left out by ``data_fraction``.
        too_short / too_long: documents (of this call, in the sample) left out by
            ``min_length`` / ``max_length``.
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
        slow_for_tests: seconds to sleep per input file (tests of kills).
        data_fraction: keep a seeded sample of about this share of the documents, in
            ``(0, 1]``: the same documents for the same ``seed`` whatever ``num_proc`` and
            ``num_shards`` (:mod:`torchdata_ext.prepare_data.filter`).
        seed: the sample's seed (used only when ``data_fraction < 1``).
        min_length / max_length: keep only documents of at least / at most this many tokens
            after tokenizing, not counting the appended ``eos_token`` (None: no bound).
        dtype: the stored token dtype, ``"uint16"`` or ``"uint32"``; None (default): the
            smallest that holds the vocabulary and ``eos_token`` (``uint16`` up to 65,536 ids,
            e.g. the byte tokenizer or an 8,000-token BPE), recorded in the metadata.

    Returns:
        What this call did (:class:`PrepareResult`).

    Raises:
        ValueError: bad arguments, inputs with no document, or ``out`` is a file or holds
            progress of a different configuration. Nothing is written before the arguments,
            the tokenizer and ``out`` are checked, nor when the inputs hold no document.
    """
    _check_arguments(format, shard_id, num_shards, max_tokens_per_file, num_proc)
    _check_tokens(tokenizer, byte_offset, eos_token, encoding, compression)
    doc_filter = DocFilter(data_fraction, seed, min_length, max_length)
    if format == "npy" and eos_token is None:
        eos_token = 0
    storage_options = dict(storage_options or {})
    fs, out_path = filesystem(out, storage_options)
    if fs.isfile(out_path):
        raise ValueError(
            f"{out=} is a file, not a folder; pass a new folder, or one an earlier prepare wrote"
        )
    raw = [inputs] if isinstance(inputs, str) else list(inputs)
    files = expand_urls(raw, storage_options, suffixes=INPUT_SUFFIXES)
    _refuse_token_files(files)
    mine = split_inputs(files, shard_id, num_shards)
    if not mine:
        warnings.warn(
            f"part {shard_id} of {num_shards} got no input file: the {len(files)} input "
            f"file(s) are split among the parts by file, so parts beyond them have nothing to "
            f"do; use num_shards={len(files)} or fewer, or split the inputs into more files",
            stacklevel=2,
        )
    # a bad tokenizer or an eos_token it can emit fails here, before anything is written
    tok = _tokenizer(tokenizer, byte_offset)
    check_special_tokens({"eos_token": eos_token}, dtype="uint32", ids=token_ids(tok, tokenizer))
    meta = PreparedMeta.describe(
        tok,
        tokenizer_location(tokenizer),
        bos_token=None,
        eos_token=eos_token,
        dtype=dtype,
        format=format,
    )
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
        "encoding": codecs.lookup(encoding).name,
        "compression": compression,
        "dtype": meta.dtype,
    }
    config.update(doc_filter.as_config())
    ppath = posixpath.join(out_path, f"_progress_part{shard_id:05d}.json")
    result = PrepareResult(out=out)
    state = _saved_progress(fs, ppath, config, out, shard_id)
    if state is None:
        state = {"config": config, "next_output": 0, "input": 0, "doc": 0, "done": False}
    else:
        result.resumed = True
    check_same_settings(out, meta, storage_options)
    check_same_filter(_other_parts_configs(fs, out_path, shard_id), config, out)
    _remove_stale_temps(fs, out_path, shard_id)
    suffix = _SUFFIX[format]

    def out_url(n: int) -> str:
        return unstrip(fs, posixpath.join(out_path, f"part{shard_id:05d}_{n:05d}{suffix}"))

    def put(url: str, data: bytes) -> None:
        write_bytes_atomic(url, data, storage_options)

    result.outputs = [out_url(n) for n in range(int(state["next_output"]))]
    if state["done"]:
        result.skipped = True
        write_meta(out, meta, storage_options)
        _finalize(fs, out, out_path, format, eos_token, storage_options, meta.dtype)
        return result

    encoder = {"npy": _npy_bytes, "arrow": _arrow_bytes, "mds": _mds_bytes}[format]
    encode = functools.partial(encoder, dtype=np.dtype(meta.dtype))
    eos = None if eos_token is None else np.array([eos_token], np.uint32)
    buf: list[np.ndarray] = []
    buf_tokens = 0
    sizes = _input_sizes(fs, mine)
    bar = _progress_of(progress, shard_id, num_shards, sum(sizes[int(state["input"]) :]))

    def flush(next_pos: tuple[int, int]) -> None:
        nonlocal buf, buf_tokens
        n_out = int(state["next_output"])
        put(out_url(n_out), encode(buf))
        result.outputs.append(out_url(n_out))
        buf, buf_tokens = [], 0
        state.update(next_output=n_out + 1, input=next_pos[0], doc=next_pos[1])
        put(unstrip(fs, ppath), json.dumps(state, indent=1, sort_keys=True).encode())

    t0 = time.perf_counter()
    first_file, first_doc = int(state["input"]), int(state["doc"])
    tokenize = _Tokenize(
        tokenizer, byte_offset, text_field, encoding, compression, storage_options, doc_filter
    )
    undecodable_files: list[str] = []
    seen = 0  # non-empty texts read, kept or not
    for i, got in enumerate(
        _tokenized(mine, first_file, first_doc, tokenize, num_proc), start=first_file
    ):
        if got.undecodable:
            result.undecodable_documents += got.undecodable
            undecodable_files.append(mine[i])
        seen += got.seen
        result.sampled_out += got.sampled_out
        result.too_short += got.too_short
        result.too_long += got.too_long
        for doc, pos in zip(got.docs, got.positions.tolist()):
            if eos is not None:
                if eos_token in doc:
                    raise ValueError(
                        f"{mine[i]}: document {pos} contains eos_token={eos_token} (the "
                        "tokenizer added it), which would split it when read back; choose "
                        "another eos_token"
                    )
                doc = np.concatenate([doc, eos])
            if buf and buf_tokens + doc.size > max_tokens_per_file:
                flush((i, pos))
            buf.append(doc)
            buf_tokens += doc.size
            result.documents += 1
            result.tokens += doc.size
        if bar is not None:
            bar.update(sizes[i])
        if slow_for_tests:
            time.sleep(slow_for_tests)
    if seen and not buf and int(state["next_output"]) == 0:
        warn_nothing_kept(doc_filter, seen, len(mine), result.sampled_out, result.too_short,
                          result.too_long)  # fmt: skip
    elif mine and not buf and int(state["next_output"]) == 0:
        if bar is not None:
            bar.close(ok=False)
        many = len(mine) > 1
        raise ValueError(
            f"no documents: the {len(mine)} input file{'s' if many else ''} ({mine[0]}"
            f"{', ...) hold' if many else ') holds'} no non-empty text under {text_field=}; check that the inputs are not empty, and "
            "pass the field that holds the text as text_field=..."
        )
    if buf:
        flush((len(mine), 0))
    state.update(done=True, input=len(mine), doc=0)
    put(unstrip(fs, ppath), json.dumps(state, indent=1, sort_keys=True).encode())
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    if progress is not False:
        print(
            f"part {shard_id}/{num_shards}: {result.documents:,} documents, {result.tokens:,} "
            f"tokens into {len(result.outputs)} files in {elapsed:.1f}s "
            f"({result.tokens / max(elapsed, 1e-9):,.0f} tokens/s)"
            f"{left_out_summary(result.sampled_out, result.too_short, result.too_long)}",
            file=sys.stderr,
        )
    if undecodable_files:
        n, k = result.undecodable_documents, len(undecodable_files)
        where = f"in {k} files, the first {undecodable_files[0]}" if k > 1 else undecodable_files[0]
        warnings.warn(
            f"{n} of {result.documents} documents ({where}) {'are' if n > 1 else 'is'} not valid "
            f"{encoding}: {'their' if n > 1 else 'its'} undecodable bytes became U+FFFD; if the "
            "files use another encoding, prepare them into a new folder with encoding=... "
            "(e.g. encoding='latin-1' or encoding='cp1252')",
            UnicodeWarning,
            stacklevel=2,
        )
    write_meta(out, meta, storage_options)
    _finalize(fs, out, out_path, format, eos_token, storage_options, meta.dtype)
    return result


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
    The lines go through the logger ``torchdata_ext.prepare_data.tokenize_text.progress`` (to stderr unless
    the application configured that logger)."""
    if progress is False:
        return None
    log = logging.getLogger(f"{__name__}.progress")
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
    if format not in _SUFFIX:
        raise ValueError(f"{format=} must be 'arrow', 'npy' or 'mds'")
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ValueError(f"{shard_id=} must be in 0..{num_shards=}-1 and num_shards >= 1")
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


def _other_parts_configs(fs: Any, out_path: str, shard_id: int) -> dict[str, dict[str, Any]]:
    """The settings the other parts' progress files in ``out`` record, by file name."""
    try:
        names = fs.glob(posixpath.join(out_path, "_progress_part*.json"))
    except FileNotFoundError:
        return {}
    out = {}
    for p in names:
        name = posixpath.basename(p)
        if name != f"_progress_part{shard_id:05d}.json":
            out[name] = {**_PROGRESS_DEFAULTS, **json.loads(fs.cat_file(p)).get("config", {})}
    return out


def _saved_progress(
    fs: Any, ppath: str, config: dict[str, Any], out: str, shard_id: int
) -> dict[str, Any] | None:
    """The progress an earlier run of this part saved, or None; refuses other settings."""
    if not fs.exists(ppath):
        return None
    saved = json.loads(fs.cat_file(ppath))
    if "config" in saved:
        saved["config"] = {**_PROGRESS_DEFAULTS, **saved["config"]}
    if saved.get("config") != config:
        diff = sorted(k for k in config if saved.get("config", {}).get(k) != config[k])
        raise ValueError(
            f"{out} holds an earlier prepare of part {shard_id} with different settings "
            f"({', '.join(diff)}); use another out folder, or delete "
            f"{posixpath.basename(ppath)} and its part{shard_id:05d}_* files to start over"
        )
    return dict(saved)


# -- reading and tokenizing inputs -----------------------------------------------------------------
@dataclass(frozen=True)
class _Tokenize:
    """How to read and tokenize an input file (sent to the tokenizing processes)."""

    tokenizer: str
    byte_offset: int
    text_field: str
    encoding: str
    compression: str | None
    storage_options: dict[str, Any]
    doc_filter: DocFilter = DocFilter()


def _read_texts(url: str, how: _Tokenize) -> tuple[list[str], set[int]]:
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
    kind = "parquet" if lower.endswith(_PARQUET_SUFFIXES) else "jsonl"
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


def _tokenizer(spec: str, byte_offset: int) -> Any:
    """The tokenizer ``spec``, loaded once per process."""
    key = (spec, byte_offset)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(spec, byte_offset=byte_offset)
    return _TOKENIZERS[key]


def _encoder(spec: str, byte_offset: int) -> Encoder:
    """The tokenizer ``spec`` as an :class:`~torchdata_ext.tokenizers.load.Encoder`."""
    return as_encoder(_tokenizer(spec, byte_offset))


@dataclass
class _FileDocs:
    """The documents of one input file that :func:`prepare` keeps, and what it left out."""

    docs: list[np.ndarray]  # kept documents (uint32), in order
    positions: np.ndarray  # each one's position among the file's non-empty texts (progress "doc")
    undecodable: int  # kept documents with bytes that were not valid ``encoding``
    seen: int  # non-empty texts read (from ``start``), kept or not
    sampled_out: int = 0
    too_short: int = 0
    too_long: int = 0


def _tokenize_file(task: tuple[str, int, _Tokenize]) -> _FileDocs:
    """Tokens (``uint32``) of the non-empty texts of one input file, from non-empty text
    ``start`` on, that ``how.doc_filter`` keeps (the sample is drawn before tokenizing)."""
    url, start, how = task
    encoder = _encoder(how.tokenizer, how.byte_offset)
    all_texts, undecodable = _read_texts(url, how)
    nonempty = np.flatnonzero([bool(t) for t in all_texts])[start:]  # record indexes
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
    return _FileDocs(
        docs=[d for d, keep in zip(tokenized, ok.tolist()) if keep],
        positions=positions[ok],
        undecodable=len(undecodable.intersection(records[ok].tolist())),
        seen=int(nonempty.size),
        sampled_out=int(nonempty.size - records.size),
        too_short=int(short.sum()),
        too_long=int(long.sum()),
    )


def _tokenized(
    files: Sequence[str],
    first_file: int,
    first_doc: int,
    tokenize: _Tokenize,
    num_proc: int,
) -> Iterator[_FileDocs]:
    """Each input file's kept documents (from ``first_file``, non-empty text ``first_doc``),
    in order (:class:`_FileDocs`)."""
    tasks = [
        (files[i], first_doc if i == first_file else 0, tokenize)
        for i in range(first_file, len(files))
    ]
    if num_proc <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _tokenize_file(task)
        return
    import multiprocessing as mp

    with mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(num_proc) as pool:
        yield from pool.imap(_tokenize_file, tasks)


# -- writing outputs -------------------------------------------------------------------------------
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


def _is_stale_temp(name: str, shard_id: int) -> bool:
    """Whether ``name`` is a temporary file a killed run of part ``shard_id`` left behind:
    ``write_bytes_atomic``'s ``.<name>.tmp-<hex>`` or the ``.tmp-<name>-<hex>`` of earlier
    versions, for this part's outputs or progress file."""
    ours = (f"part{shard_id:05d}_", f"_progress_part{shard_id:05d}.")
    if name.startswith(".tmp-"):
        return name[len(".tmp-") :].startswith(ours)
    return name.startswith(".") and ".tmp-" in name and name[1:].startswith(ours)


def _remove_stale_temps(fs: Any, out_path: str, shard_id: int) -> None:
    """Delete temporary files a killed run of this part left behind."""
    try:
        names = fs.ls(out_path, detail=False)
    except FileNotFoundError:
        return
    for p in names:
        if _is_stale_temp(posixpath.basename(p), shard_id):
            fs.rm(p)


def _finalize(
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
    suffix = _SUFFIX[format]
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
        logging.getLogger(__name__).warning(
            "could not write the index file of %s (%s); ranks will list it", out, exc
        )
