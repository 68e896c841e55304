"""How a token dataset was prepared: ``meta/torchdata_ext_meta.json`` next to the counts file.

``prepare`` writes it (atomically) into its output's ``meta`` folder; the pipeline reads it per
dataset when present and refuses a config that disagrees with it (:func:`check_config`), and
``inspect`` decodes with the tokenizer it names. Data without the file (older ``prepare`` runs,
data from elsewhere) loads as before, unchecked. Example::

    {"meta_version": 1, "tokenizer": "byte", "byte_offset": 1, "tokenizer_sha256": null,
     "vocab_size": 257, "ordinary_ids": [[1, 257]], "special_ids": [],
     "bos_token": null, "eos_token": 0, "dtype": "uint16", "format": "npy",
     "package_version": "0.1.0"}

``ordinary_ids`` are the half-open id ranges the tokenizer emits for ordinary text (no special
token may be one of them); ``vocab_size`` is one more than the largest id the data can hold
(tokenizer ids and the special tokens written into it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdata_ext.remote import with_retries, write_bytes_atomic
from torchdata_ext.remote.urls import filesystem, join, one_request
from torchdata_ext.tokenizers.load import TokenIds, check_special_tokens, token_ids, tokenizer_hash

__all__ = [
    "META_FILE",
    "PreparedMeta",
    "check_config",
    "check_same_settings",
    "meta_url",
    "other_tokenizer",
    "read_meta",
    "read_side_file",
    "write_meta",
]

META_FILE = "torchdata_ext_meta.json"
TOKEN_DTYPES = ("uint16", "uint32")
"""The dtypes ``prepare`` stores tokens as, smallest first (no vocabulary fits ``uint8``)."""
META_VERSION = 1


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchdata-ext")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


@dataclass(frozen=True)
class PreparedMeta:
    """How a token dataset was prepared (the fields of the metadata file).

    Attributes:
        tokenizer: the tokenizer given to ``prepare``: ``"byte"``, a model name, a URL, or a
            local tokenizer.json as an absolute path (so ``inspect`` finds it from anywhere).
        byte_offset: the byte tokenizer's offset (None for a tokenizer.json).
        tokenizer_sha256: short hash of the tokenizer.json's content (None for ``"byte"``).
        vocab_size: one more than the largest id in the data (tokenizer and special ids).
        ordinary_ids: half-open ``[lo, hi)`` ranges of the ids ordinary text produces.
        special_ids: the tokenizer's own special-token ids.
        bos_token / eos_token: written at each document's start / end (None: none).
        dtype: the NumPy dtype of the stored tokens (``"uint16"`` or ``"uint32"``: by
            default the smallest that holds ``vocab_size``).
        format: ``"arrow"`` or ``"npy"``.
        package_version: the torchdata-ext version that wrote it.
        meta_version: the layout of this file.
    """

    tokenizer: str
    byte_offset: int | None
    tokenizer_sha256: str | None
    vocab_size: int
    ordinary_ids: tuple[tuple[int, int], ...]
    special_ids: tuple[int, ...]
    bos_token: int | None
    eos_token: int | None
    dtype: str
    format: str
    package_version: str = dataclasses.field(default_factory=_package_version)
    meta_version: int = META_VERSION

    @classmethod
    def describe(
        cls,
        tokenizer: Any,
        spec: str,
        *,
        bos_token: int | None,
        eos_token: int | None,
        dtype: str | None,
        format: str,
    ) -> PreparedMeta:
        """The metadata of data written with ``tokenizer`` (loaded from ``spec``) as ``dtype``
        (None: the smallest of :data:`TOKEN_DTYPES` that holds its ids).

        Raises:
            ValueError: ``dtype`` is not one of :data:`TOKEN_DTYPES` or cannot hold the ids.
        """
        ids = token_ids(tokenizer, spec)
        written = [t + 1 for t in (bos_token, eos_token) if t is not None]
        vocab_size = max([ids.vocab_size, *written])
        fits = [d for d in TOKEN_DTYPES if vocab_size - 1 <= np.iinfo(d).max]
        if dtype is None:
            dtype = fits[0] if fits else TOKEN_DTYPES[-1]
        elif dtype not in TOKEN_DTYPES or dtype not in fits:
            raise ValueError(
                f"dtype={dtype!r} cannot store the tokens: ids go up to {vocab_size - 1} "
                f"(vocab_size={vocab_size}); use one of {fits or list(TOKEN_DTYPES)}, or "
                "dtype=None for the smallest"
            )
        return cls(
            tokenizer=spec,
            byte_offset=ids.byte_offset,
            tokenizer_sha256=tokenizer_hash(tokenizer),
            vocab_size=vocab_size,
            ordinary_ids=ids.ordinary,
            special_ids=ids.specials,
            bos_token=bos_token,
            eos_token=eos_token,
            dtype=dtype,
            format=format,
        )

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer for messages: ``'byte' (byte_offset=1)`` or ``'tok.json' (sha256 ...)``."""
        if self.byte_offset is not None:
            return f"{self.tokenizer!r} (byte_offset={self.byte_offset})"
        return f"{self.tokenizer!r} (sha256 {self.tokenizer_sha256})"

    def token_ids(self) -> TokenIds:
        """What the tokenizer that prepared the data emits (for special-token checks)."""
        return TokenIds(
            name=self.tokenizer_name,
            ordinary=self.ordinary_ids,
            specials=self.special_ids,
            vocab_size=self.vocab_size,
            byte_offset=self.byte_offset,
        )

    def settings(self) -> dict[str, Any]:
        """The fields that say what the tokens mean: all but the versions and where the
        tokenizer was found (its hash and offset say which it is; parts prepared on two
        machines may find it at two paths)."""
        out = dataclasses.asdict(self)
        del out["package_version"], out["meta_version"], out["tokenizer"]
        return out

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["ordinary_ids"] = [list(r) for r in self.ordinary_ids]
        d["special_ids"] = list(self.special_ids)
        return (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, url: str) -> PreparedMeta:
        """Parse the file's bytes (``url`` names it in errors)."""
        try:
            d = json.loads(raw)
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(
                **{
                    **{k: v for k, v in d.items() if k in known},
                    "ordinary_ids": tuple((int(a), int(b)) for a, b in d["ordinary_ids"]),
                    "special_ids": tuple(int(i) for i in d["special_ids"]),
                }
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(
                f"{url}: not a torchdata-ext metadata file ({type(exc).__name__}: {exc}); "
                "re-run prepare on the data to rewrite it, or delete it to load unchecked"
            ) from None


def meta_url(folder: str) -> str:
    """The metadata file of the data in ``folder``."""
    return join(folder, "meta", META_FILE)


def write_meta(folder: str, meta: PreparedMeta, storage_options: dict[str, Any] | None) -> None:
    """Write ``meta`` into ``folder/meta/`` atomically."""
    write_bytes_atomic(meta_url(folder), meta.to_json(), storage_options)


def read_meta(
    folder: str,
    storage_options: dict[str, Any] | None = None,
    known: Mapping[str, bytes | None] | None = None,
) -> tuple[PreparedMeta, str] | None:
    """The metadata of the data in ``folder`` and its URL, or None when there is none.

    Args:
        folder: the data folder.
        storage_options: fsspec options.
        known: files already read, by URL (None: known to be absent), e.g. a
            :class:`~torchdata_ext.sources.index.DatasetIndex`'s ``side_files``; the store is asked only
            for a file not in it.
    """
    url = meta_url(folder)
    if known is not None and url in known:
        raw = known[url]
        return None if raw is None else (PreparedMeta.from_json(raw, url), url)
    raw = read_side_file(url, storage_options)
    return None if raw is None else (PreparedMeta.from_json(raw, url), url)


def read_side_file(url: str, storage_options: dict[str, Any] | None = None) -> bytes | None:
    """The bytes of small file ``url``, or None when there is no such file: one GET on an
    object store (s3fs asks an object's size first, a HEAD, unless told to read it in one
    request)."""
    fs, path = filesystem(url, storage_options)
    whole = one_request(fs)
    try:
        return bytes(with_retries(lambda: fs.cat_file(path, **whole), url, what="read"))
    except FileNotFoundError:
        return None


def other_tokenizer(meta: PreparedMeta, tokenizer: Any, spec: str | None) -> str | None:
    """None if ``tokenizer`` (loaded from ``spec``) is the one ``meta`` says prepared the data
    (same byte offset, same tokenizer.json hash); else what it is, for a message
    (``"byte_offset=2"`` or ``"sha256 ..."``)."""
    mine = token_ids(tokenizer, spec)
    digest = tokenizer_hash(tokenizer)
    if (mine.byte_offset, digest) == (meta.byte_offset, meta.tokenizer_sha256):
        return None
    return f"byte_offset={mine.byte_offset}" if mine.byte_offset is not None else f"sha256 {digest}"


def check_config(
    meta: PreparedMeta,
    url: str,
    dataset: str,
    *,
    tokenizer: Any | None,
    tokenizer_spec: str | None,
    specials: dict[str, int | None],
    dtype: str,
) -> None:
    """Refuse pipeline settings that disagree with how ``dataset`` was prepared.

    Args:
        meta / url: the dataset's metadata and its file.
        dataset: the dataset's name, for messages.
        tokenizer / tokenizer_spec: the config's tokenizer (loaded) and its spec, or None.
        specials: the config's special ids by name (``bos_token``, ``eos_token``, ...).
        dtype: the config's output dtype (``"int32"``/``"int64"``).

    Raises:
        ValueError: naming the config's value, the data's value and ``url``.
    """
    head = f"dataset {dataset!r} was prepared"
    if tokenizer is not None:
        ours = other_tokenizer(meta, tokenizer, tokenizer_spec)
        if ours is not None:
            raise ValueError(
                f"tokenizer={tokenizer_spec!r} ({ours}) but {head} with the tokenizer "
                f"{meta.tokenizer_name} ({url}); use that tokenizer (and byte_offset), or "
                "prepare the data again with this one"
            )
    for name in ("bos_token", "eos_token"):
        theirs = getattr(meta, name)
        if theirs is not None and specials.get(name) != theirs:
            raise ValueError(
                f"{name}={specials.get(name)} but {head} with {name}={theirs} ({url}), which "
                f"its documents already carry; set {name}={theirs}"
            )
    top = int(np.iinfo(np.dtype(dtype)).max)
    if meta.vocab_size - 1 > top:
        raise ValueError(
            f"dtype={dtype!r} cannot hold the ids of dataset {dataset!r}: it was prepared as "
            f"{meta.dtype} with vocab_size={meta.vocab_size} ({url}); set dtype='int64'"
        )
    check_special_tokens(specials, dtype=dtype, ids=meta.token_ids(), source=url)


def check_same_settings(
    folder: str, meta: PreparedMeta, storage_options: dict[str, Any] | None
) -> None:
    """Refuse to add data described by ``meta`` to ``folder`` when the metadata file there says
    its tokens mean something else (another part of a prepare run with other settings).

    Raises:
        ValueError: naming each differing setting with both values, and the file.
    """
    found = read_meta(folder, storage_options)
    if found is None:
        return
    old, url = found
    theirs, ours = old.settings(), meta.settings()
    diff = [f"{k}={ours[k]!r} here, {theirs[k]!r} there" for k in ours if ours[k] != theirs[k]]
    if diff:
        raise ValueError(
            f"{folder} holds data prepared with other token settings ({'; '.join(diff)}; "
            f"{url}); prepare into another out folder, or delete the folder to start over"
        )
