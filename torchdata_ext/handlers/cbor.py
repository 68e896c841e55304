"""CBOR record files (``.cbor``, and ``.cbor.gz`` / ``.cbor.zst``), epochraft's second format.

A file is CBOR data items written one after another (``cbor2.dump(record, f)`` per record, as
epochraft reads them back with ``cbor2.load`` until the end of the file); each record is a map
whose field ``col_name`` (default ``"text"``) holds the document: a string (text) or an array
of integers (tokens). Needs the optional ``cbor2`` package (``pip install
'torchdata-ext[cbor]'``).

``open`` reads the file (decompressed as its name says), decodes every record once to find
where each one starts and ends, checks its field and notes its length; ``get`` decodes one
record again from those bytes, so an opened file holds its bytes, not its decoded records.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.jsonl import gunzip, unzstd
from torchdata_ext.handlers.numpy_tokens import Source, check_index, check_indices, read_source

__all__ = ["CborHandler", "CborReader"]


def _cbor2() -> Any:
    try:
        import cbor2
    except ImportError:
        raise ImportError(
            "reading .cbor files needs the cbor2 package: pip install cbor2 "
            "(or pip install 'torchdata-ext[cbor]')"
        ) from None
    return cbor2


class CborReader:
    """An opened CBOR record file.

    Attributes:
        url: the file.
        data: its (decompressed) bytes.
        starts, ends: int64 byte range of each record.
        lengths: int64 length of each document (characters of text, or tokens).
        produces: ``"text"`` or ``"tokens"`` (from the first record).
    """

    def __init__(
        self, url: str, data: bytes, starts: np.ndarray, ends: np.ndarray, lengths: np.ndarray,
        produces: str,
    ) -> None:  # fmt: skip
        self.url = url
        self.data = data
        self.starts = starts
        self.ends = ends
        self.lengths = lengths
        self.produces = produces

    def __len__(self) -> int:
        return int(self.starts.size)

    def close(self) -> None:
        self.data = b""
        self.starts = self.ends = self.lengths = np.zeros(0, np.int64)

    def __repr__(self) -> str:
        return f"CborReader({self.url!r}, docs={len(self)}, {self.produces})"


class CborHandler(FileHandler):
    """CBOR record files; one document per record, in field ``col_name``.

    Args:
        col_name: the record field holding the document (a string, or an array of integer
            token ids), default ``"text"``.
        storage_options: fsspec keyword arguments.
    """

    name: ClassVar[str] = "cbor"
    suffixes: ClassVar[tuple[str, ...]] = (".cbor", ".cbor.gz", ".cbor.zst")
    produces: ClassVar[str] = "text"

    def __init__(
        self, col_name: str = "text", storage_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(col_name, storage_options)

    def open(self, url: str) -> CborReader:
        cbor2 = _cbor2()
        raw: Source = read_source(url, self.storage_options)
        lower = url.lower()
        if lower.endswith(".gz"):
            data = gunzip(url, raw)
        elif lower.endswith((".zst", ".zstd")):
            data = unzstd(url, raw)
        else:
            data = bytes(raw)
        fp = io.BytesIO(data)
        decoder = cbor2.CBORDecoder(fp)
        starts: list[int] = []
        lengths: list[int] = []
        kinds: set[str] = set()
        while fp.tell() < len(data):
            starts.append(fp.tell())
            try:
                record = decoder.decode()
            except (cbor2.CBORDecodeError, EOFError) as exc:
                raise DataFileError(
                    url,
                    f"record {len(starts) - 1} (byte {starts[-1]}) is not valid CBOR ({exc}); "
                    "the file is truncated or corrupt",
                ) from exc
            value = self._field(url, len(starts) - 1, record)
            kinds.add("text" if isinstance(value, str) else "tokens")
            lengths.append(len(value))
        if len(kinds) > 1:
            raise DataFileError(
                url, f"field {self.col_name!r} holds text in some records and tokens in others"
            )
        bounds = np.asarray([*starts, len(data)], np.int64)
        produces = kinds.pop() if kinds else "text"
        return CborReader(
            url, data, bounds[:-1], bounds[1:], np.asarray(lengths, np.int64), produces
        )

    def _field(self, url: str, i: int, record: Any) -> str | list[int]:
        """Record ``i``'s document, checked: a string, or a list of integers."""
        if not isinstance(record, dict):
            raise DataFileError(
                url,
                f"record {i} is a CBOR {type(record).__name__}, not a map with a "
                f"{self.col_name!r} field; write one map per record",
            )
        try:
            value = record[self.col_name]
        except KeyError:
            raise DataFileError(
                url,
                f"record {i} has no field {self.col_name!r}; its fields are "
                f"{list(record)[:20]}; pass col_name=...",
            ) from None
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            return list(value)
        raise DataFileError(
            url,
            f"record {i}: field {self.col_name!r} is a {type(value).__name__}, neither text "
            "nor a list of token ids; pass col_name=... naming the document field",
        )

    def produces_for(self, reader: CborReader) -> str:
        return reader.produces

    def length(self, reader: CborReader) -> int:
        return int(reader.starts.size)

    def get(self, reader: CborReader, index: int) -> np.ndarray | str:
        i = check_index(reader.url, index, int(reader.starts.size))
        record = _cbor2().loads(reader.data[int(reader.starts[i]) : int(reader.ends[i])])
        value = self._field(reader.url, i, record)
        if isinstance(value, str):
            return value
        return np.asarray(value, np.int64).reshape(-1)

    def get_many(
        self, reader: CborReader, indices: Sequence[int] | np.ndarray
    ) -> list[np.ndarray | str]:
        idx = check_indices(reader.url, indices, int(reader.starts.size))
        return [self.get(reader, i) for i in idx.tolist()]

    def doc_lengths(self, reader: CborReader) -> np.ndarray | None:
        return reader.lengths.copy()

    def close(self, reader: CborReader) -> None:
        reader.close()
