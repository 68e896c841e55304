"""Megatron indexed datasets (``file_type: megatron``): a ``.bin`` of tokens and its ``.idx``.

The layout, as megatron-core's ``megatron/core/datasets/indexed_dataset.py`` writes it
(``IndexedDatasetBuilder``, used by Megatron-LM's ``tools/preprocess_data.py``), all
little-endian::

    .idx: b"MMIDIDX\\x00\\x00"  uint64 version (1)  uint8 dtype code
          uint64 S (sequences)  uint64 D (document indices: documents + 1)
          int32[S] sequence lengths (tokens)   int64[S] sequence pointers (bytes into .bin)
          int64[D] document indices (sequence numbers: document d is sequences
                   idx[d] .. idx[d+1], idx[0] == 0, idx[-1] == S)
          int8[S]  sequence modes (multimodal datasets only; not read here)
    .bin: the sequences' tokens, back to back, in the dtype of the code:
          1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6 float64 and 7 float32 hold
          no token ids and are refused)

A *document* here is what the index's document indices say, not a sequence: a dataset
written with ``--split-sentences`` has one sequence per sentence and one document per input
document. A document's tokens are its sequences' tokens in order, one zero-copy slice of the
``.bin`` (the builder writes a document's sequences back to back; an index whose pointers are
not contiguous is refused).

A dataset lists a pair by either file (``corpus_text_document.idx`` or ``.bin``; listing a
folder lists each pair once, by its ``.idx``). Local files are memory-mapped (``memory://``
ones read whole). Files on object stores are read by range, never whole: the ``.idx`` header and arrays when the file is opened (two
requests), then each document's bytes when it is read
(:attr:`~torchdata_ext.handlers.base.FileHandler.range_reads_always`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from torchdata_ext.handlers.base import DataFileError
from torchdata_ext.handlers.numpy_tokens import TokenArrayHandler, TokenArrayReader, read_source
from torchdata_ext.handlers.ranged import (
    FsRanges,
    OpenRanges,
    RangedTokens,
    read_exact,
    reads_by_range,
)
from torchdata_ext.remote.urls import filesystem

__all__ = ["INDEX_MAGIC", "MegatronHandler", "megatron_pair"]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
# Megatron's DType codes (megatron.core.datasets.indexed_dataset.DType)
_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def megatron_pair(url: str) -> tuple[str, str]:
    """``(idx_url, bin_url)`` of the pair ``url`` names (by its ``.idx`` or its ``.bin``).

    Raises:
        DataFileError: ``url`` ends in neither.
    """
    for suffix in (".idx", ".bin"):
        if url.endswith(suffix):
            prefix = url[: -len(suffix)]
            return prefix + ".idx", prefix + ".bin"
    raise DataFileError(
        url,
        "a Megatron indexed dataset is listed by its .idx or .bin file; list "
        "'<prefix>.idx' (or '<prefix>.bin')",
    )


@dataclass(frozen=True)
class _Header:
    dtype: np.dtype
    sequences: int
    doc_indices: int

    @property
    def arrays_bytes(self) -> int:
        """Bytes of the lengths, pointers and document indices after the header."""
        return 12 * self.sequences + 8 * self.doc_indices


def _parse_header(url: str, data: bytes) -> _Header:
    fix = "check that this is a Megatron .idx file (IndexedDatasetBuilder), or re-create it"
    if len(data) < _HEADER.size:
        raise DataFileError(url, f"truncated: {len(data)} bytes, not a Megatron index; {fix}")
    magic, version, code, sequences, doc_indices = _HEADER.unpack(data[: _HEADER.size])
    if magic != INDEX_MAGIC:
        raise DataFileError(url, f"not a Megatron index (no {INDEX_MAGIC!r} magic); {fix}")
    if version != 1:
        raise DataFileError(url, f"Megatron index version {version} is not supported (only 1)")
    if code not in _DTYPES:
        raise DataFileError(url, f"unknown Megatron dtype code {code}; {fix}")
    dtype = np.dtype(_DTYPES[code])
    if dtype.kind == "f":
        raise DataFileError(
            url,
            f"the dataset holds {dtype} values (Megatron dtype code {code}), not token ids; "
            "tokenized datasets use an integer dtype (preprocess_data.py writes uint16 or int32)",
        )
    return _Header(dtype, int(sequences), int(doc_indices))


def _document_offsets(url: str, header: _Header, arrays: Any) -> np.ndarray:
    """Token offsets of the documents in the ``.bin`` (``documents + 1`` int64 values) from the
    index's arrays (``arrays``: the bytes after the header)."""
    s, d = header.sequences, header.doc_indices
    fix = "re-create it with megatron-core's IndexedDatasetBuilder (or preprocess_data.py)"
    if len(arrays) < header.arrays_bytes:
        raise DataFileError(
            url,
            f"truncated: the index header declares {s} sequences and {d} document indices "
            f"({header.arrays_bytes} bytes) but {len(arrays)} bytes follow; {fix}",
        )
    lengths = np.frombuffer(arrays, "<i4", count=s, offset=0).astype(np.int64)
    pointers = np.frombuffer(arrays, "<i8", count=s, offset=4 * s)
    docs = np.frombuffer(arrays, "<i8", count=d, offset=12 * s)
    if d == 0 or docs[0] != 0 or docs[-1] != s or bool((np.diff(docs) < 0).any()):
        raise DataFileError(
            url,
            f"corrupt index: the document indices must rise from 0 to the sequence count {s}; {fix}",
        )
    if s and int(lengths.min()) < 0:
        raise DataFileError(url, f"corrupt index: a negative sequence length; {fix}")
    ends = np.cumsum(lengths)  # token offset of each sequence's end
    item = header.dtype.itemsize
    base, rest = divmod(int(pointers[0]), item) if s else (0, 0)
    if rest or base < 0 or (s and not np.array_equal(pointers[1:], (base + ends[:-1]) * item)):
        raise DataFileError(
            url,
            "the index's sequence pointers are not back to back in the .bin, so a document is "
            f"not one slice of it; {fix}",
        )
    starts = np.concatenate([np.zeros(1, np.int64), ends])
    return base + starts[docs]


def _check_bin_size(bin_url: str, size: int, offsets: np.ndarray, dtype: np.dtype) -> None:
    need = int(offsets[-1]) * dtype.itemsize
    if size != need:
        raise DataFileError(
            bin_url,
            f"holds {size} bytes but its index says {need} ({int(offsets[-1])} {dtype} tokens): "
            "the .bin is truncated or belongs to another .idx; re-create or re-copy the pair",
        )


class MegatronHandler(TokenArrayHandler):
    """Megatron-LM / megatron-core indexed datasets: ``<prefix>.bin`` + ``<prefix>.idx``.

    Args:
        col_name: unused (the files have no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.

    Documents are the index's documents, in the file's token dtype (zero-copy slices of the
    memory-mapped ``.bin`` locally; one range request each on other filesystems). Already
    tokenized with EOD where ``preprocess_data.py --append-eod`` put it: no EOS is needed.
    """

    name: ClassVar[str] = "megatron"
    suffixes: ClassVar[tuple[str, ...]] = (".idx",)
    range_reads_always: ClassVar[bool] = True

    def __init__(
        self, col_name: str = "tokens", storage_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(col_name, storage_options)

    def open(self, url: str) -> TokenArrayReader:
        idx_url, bin_url = megatron_pair(url)
        fs, _ = filesystem(idx_url, self.storage_options)
        if reads_by_range(fs):
            return self.open_ranged(url, lambda u: FsRanges(u, self.storage_options))
        idx = read_source(idx_url, self.storage_options)
        header = _parse_header(idx_url, bytes(idx[: _HEADER.size]))
        offsets = _document_offsets(idx_url, header, memoryview(idx)[_HEADER.size :])
        data = read_source(bin_url, self.storage_options)
        _check_bin_size(bin_url, len(data), offsets, header.dtype)
        tokens = np.frombuffer(data, dtype=header.dtype) if len(data) else np.zeros(0, header.dtype)
        return TokenArrayReader(url, tokens, offsets, "megatron")

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> TokenArrayReader:
        """Open the pair by range: the index's header, then its arrays (two requests), and the
        ``.bin``'s size; documents are read when asked for."""
        idx_url, bin_url = megatron_pair(url)
        idx = open_ranges(idx_url)
        header = _parse_header(idx_url, read_exact(idx, 0, min(idx.size, _HEADER.size), "header"))
        end = _HEADER.size + header.arrays_bytes
        arrays = read_exact(idx, _HEADER.size, end, "the index's arrays")
        offsets = _document_offsets(idx_url, header, arrays)
        data = open_ranges(bin_url)
        _check_bin_size(bin_url, data.size, offsets, header.dtype)
        tokens = RangedTokens(data, header.dtype, 0, int(offsets[-1]))
        return TokenArrayReader(url, tokens, offsets, "megatron")

    def __repr__(self) -> str:
        return "MegatronHandler()"
