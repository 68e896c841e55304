"""Provenance: where every token of a packed sequence came from, so it can be read again.

Buffering nodes (the packer's remainder, the shuffle buffer) do not keep token copies in their
state. A packed sequence carries a provenance table instead: an ``int64`` array of shape
``(k, 5)``, one row per run of tokens, in order::

    [dataset_id, file, doc, start, length]

* ``dataset_id >= 0``: tokens ``start .. start + length`` of document ``doc`` of file number
  ``file`` of the dataset whose name is ``names[dataset_id]``, as the source chain delivers the
  whole document (``DocumentSource.fetch_document``: after ``strip_tokens``, after tokenizing
  and BOS/EOS placement for text);
* ``dataset_id == -1`` (:data:`LITERAL`): ``length`` copies of the token id in the ``file``
  column (a BOS, EOS or separator token the packer placed);
* ``dataset_id == -2`` (:data:`PAD`): ``length`` copies of the token id in the ``file`` column,
  placed as padding (kept apart from :data:`LITERAL` so padding stays recognisable when the pad
  token id equals another special token, e.g. Bamba's ``eos_token = 0 = pad_token``).

A BOS or EOS the packer placed names the document it opens or closes: its ``doc`` column is
the document number and its ``start`` column ``literal_code(dataset_id, file)`` (negative), so
a row that ends with a BOS, or starts with an EOS, still says whose it is
(:func:`literal_owner`). Other literal rows (line specials, separators of old checkpoints) and
pad rows have ``doc`` and ``start`` 0.

The rows' lengths add up to the sequence length. :func:`resolve` rebuilds the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from torchdata_ext.handlers.base import DocData

__all__ = [
    "LITERAL",
    "PAD",
    "PROV_COLUMNS",
    "DocumentSource",
    "literal_code",
    "literal_owner",
    "remap_ids",
    "resolve",
    "row_datasets",
]

LITERAL = -1
PAD = -2
PROV_COLUMNS = 5
_DATASET_BITS = 16  # dataset ids below 2**16 fit a literal's owner code


def literal_code(dataset_id: np.ndarray | int, file: np.ndarray | int) -> np.ndarray | int:
    """The ``start`` column of a BOS/EOS row owned by a document of ``file`` of dataset
    ``dataset_id`` (negative, so 0 still means "owned by nobody")."""
    return -1 - ((np.asarray(file, np.int64) << _DATASET_BITS) | dataset_id)


def literal_owner(row: Sequence[int]) -> tuple[int, int, int] | None:
    """``(dataset_id, file, doc)`` of the document a BOS/EOS provenance row belongs to, or
    None (a line special, padding, a data row, or a literal written before literals were
    named)."""
    if row[0] != LITERAL or row[3] >= 0:
        return None
    code = -1 - int(row[3])
    return code & ((1 << _DATASET_BITS) - 1), code >> _DATASET_BITS, int(row[2])


def row_datasets(rows: np.ndarray) -> np.ndarray:
    """Per provenance row (``(k, 5)``), the dataset id of the document its tokens belong to
    (int64): the ``dataset_id`` of a document row, the owner's (:func:`literal_owner`) of a
    BOS/EOS that names its document, -1 for the rest (line specials, padding, separators that
    name no document)."""
    rows = np.asarray(rows, np.int64).reshape(-1, PROV_COLUMNS)
    ds, code = rows[:, 0], rows[:, 3]
    named = (ds == LITERAL) & (code < 0)
    owner = np.where(named, (-1 - code) & ((1 << _DATASET_BITS) - 1), -1)
    return np.where(ds >= 0, ds, owner)


@runtime_checkable
class DocumentSource(Protocol):
    """A node that can read one whole document again, as it delivered it."""

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` of ``dataset``, whole."""
        ...


def resolve(
    provenance: np.ndarray,
    names: Sequence[str],
    source: DocumentSource,
    dtype: np.dtype | type = np.int32,
) -> np.ndarray:
    """The tokens a provenance table describes, read again through ``source``.

    Args:
        provenance: ``(k, 5)`` integer array as described in this module.
        names: dataset names indexed by ``dataset_id``.
        source: the node to fetch documents from (usually the packer's upstream).
        dtype: the dtype of the result.
    """
    prov = np.asarray(provenance, dtype=np.int64).reshape(-1, PROV_COLUMNS)
    total = int(prov[:, 4].sum()) if len(prov) else 0
    out = np.empty(total, dtype=dtype)
    pos = 0
    cache: dict[tuple[int, int, int], np.ndarray] = {}
    for ds, file, doc, start, length in prov.tolist():
        if ds in (LITERAL, PAD):
            out[pos : pos + length] = file
        else:
            key = (ds, file, doc)
            data = cache.get(key)
            if data is None:
                fetched = source.fetch_document(names[ds], file, doc)
                if isinstance(fetched, str):
                    raise TypeError(
                        f"provenance row for dataset {names[ds]!r} file {file} doc {doc} resolved "
                        "to text; fetch through the tokenizing node, not the reader"
                    )
                data = np.asarray(fetched)
                cache[key] = data
            if start + length > len(data):
                raise ValueError(
                    f"provenance asks for tokens {start}..{start + length} of document {doc} of "
                    f"file {file} of dataset {names[ds]!r}, which has {len(data)}: the data "
                    "changed since the checkpoint was taken"
                )
            out[pos : pos + length] = data[start : start + length]
        pos += length
    return out


def remap_ids(rows: np.ndarray, saved: Sequence[str], names: Sequence[str]) -> np.ndarray:
    """Provenance ``rows`` whose dataset ids index ``saved``, with the ids of ``names`` instead
    (the same rows when both orders agree): provenance saved under one order of the dataset
    names (a checkpoint) read under another (the config it is restored with).

    Raises:
        ValueError: a row names a dataset ``names`` does not have.
    """
    saved, names = [str(n) for n in saved], [str(n) for n in names]
    if names[: len(saved)] == saved or not len(rows):
        return rows
    at = {n: i for i, n in enumerate(names)}
    table = np.array([at.get(n, -3) for n in saved] or [-3], np.int64)
    out = np.array(rows, dtype=np.int64).reshape(-1, PROV_COLUMNS)
    data = out[:, 0] >= 0
    new = table[out[data, 0]]
    if (new < 0).any():
        missing = sorted({saved[i] for i in np.unique(out[data, 0][new < 0]).tolist()})
        raise ValueError(
            f"the saved provenance holds documents of datasets {missing}, which this pipeline "
            f"does not read (it reads {names}); restore with the checkpoint's datasets"
        )
    out[data, 0] = new
    named = (out[:, 0] == LITERAL) & (out[:, 3] < 0)  # a BOS/EOS names its document
    if named.any():
        code = -1 - out[named, 3]
        low = (1 << _DATASET_BITS) - 1
        out[named, 3] = literal_code(table[code & low], code >> _DATASET_BITS)
    return out
