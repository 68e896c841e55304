"""A dataset's document counts kept between builds: the counts files and the local counts cache.

Counts files (``meta/*counts*.csv`` next to the data or in its parent, rows
``dataset/filename,documents,tokens[,bytes]``) are read with :func:`read_counts`; the counts
an index computed itself are kept in the local cache folder with each file's size and version
(:func:`cache_path`, :func:`read_cached`). :class:`~torchdata_ext.sources.index.DatasetIndex`
decides which counts it trusts and writes both (see :mod:`torchdata_ext.sources.index`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import posixpath
from collections.abc import Iterable
from functools import partial
from typing import Any

from torchdata_ext.remote import RemoteError, default_cache_dir, with_retries
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.sources.fingerprint import Stat

__all__ = [
    "CACHE_HEADER",
    "COUNTS_FILE",
    "HEADER",
    "Counts",
    "KnownCounts",
    "cache_path",
    "csv_text",
    "read_cached",
    "read_counts",
]

logger = logging.getLogger(__name__)

COUNTS_FILE = "torchdata_ext_counts.csv"
"""The counts file ``write_counts="data"`` (and ``prepare``) writes into ``meta/``."""
HEADER = ["dataset/filename", "documents", "tokens", "bytes"]
"""The columns of a counts file this package writes."""
CACHE_HEADER = ["url", "documents", "tokens", "bytes", "version"]
"""The columns of a cached counts file."""

Counts = tuple[int, int, int]
"""``(documents, tokens or -1, bytes or -1)`` of one file."""


def csv_text(header: list[str], rows: Iterable[Iterable[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def cache_path(root: str) -> str:
    """The cached counts file of data folder ``root`` (its name, then a hash of its URL)."""
    digest = hashlib.sha256(root.encode()).hexdigest()[:24]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in posixpath.basename(root))
    return os.path.join(default_cache_dir(), "counts", f"{name[:40]}-{digest}.csv")


def read_cached(root: str) -> dict[str, tuple[Counts, Stat]]:
    """Counts kept in the local cache for files of ``root``: URL -> (counts, (size, version))."""
    path = cache_path(root)
    try:
        with open(path, encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError:
        return {}
    out: dict[str, tuple[Counts, Stat]] = {}
    for row in rows[1:]:
        try:
            url, n, t, b, version = row
            out[url] = ((int(n), int(t), int(b)), (int(b), version))
        except ValueError:  # a damaged cache file: its counts are computed again
            logger.warning("ignoring the damaged cached counts file %s", path)
            return {}
    return out


class KnownCounts:
    """Rows of counts files. A relative row names the file at that path from the folder holding
    its ``meta``; a row with a leading slash, an absolute path or a URL names the file whose path
    from that folder is a trailing part of the row's path (whole components; of several such
    rows the last read wins)."""

    def __init__(self) -> None:
        self._exact: dict[str, Counts] = {}
        # folder holding meta -> file name -> [("/" + the row's path, counts)]
        self._tails: dict[str, dict[str, list[tuple[str, Counts]]]] = {}

    def add(self, base: str, name: str, rec: Counts) -> None:
        if not (name.startswith("/") or "://" in name):
            self._exact[posixpath.join(base, name)] = rec
            return
        path = "/" + name.split("://", 1)[-1].strip("/")
        by_name = self._tails.setdefault(base.rstrip("/"), {})
        by_name.setdefault(posixpath.basename(path), []).append((path, rec))

    def get(self, url: str) -> Counts | None:
        rec = self._exact.get(url)
        if rec is not None or not self._tails:
            return rec
        for base, by_name in self._tails.items():
            if not url.startswith(base + "/"):
                continue
            tail = url[len(base) :]  # "/" + the file's path from base
            for path, counts in reversed(by_name.get(posixpath.basename(url), [])):
                if path.endswith(tail):
                    return counts
        return None


def read_counts(root: str, counts_url: str | None, storage_options: dict[str, Any]) -> KnownCounts:
    """The counts in the counts files found for ``root`` (or in ``counts_url``)."""
    out = KnownCounts()
    candidates: list[tuple[str, str]] = []  # (csv url, folder its names are relative to)
    if counts_url is not None:
        parent = posixpath.dirname(posixpath.dirname(counts_url.rstrip("/")))
        candidates.append((counts_url, parent))
    else:
        for base in (root, posixpath.dirname(root.rstrip("/"))):
            if not base:
                continue
            meta = posixpath.join(base, "meta")
            try:
                fs, path = filesystem(meta, storage_options)
                pattern = posixpath.join(path, "*counts*.csv")
                found = sorted(with_retries(partial(fs.glob, pattern), meta, what="list"))
            except RemoteError as exc:
                if exc.transient:  # an outage: do not open every file to count it instead
                    raise
                continue  # e.g. no right to list the parent folder
            except Exception:
                continue
            # our own file last, so it wins over others on conflicts
            found.sort(key=lambda p: p.endswith(COUNTS_FILE))
            candidates.extend(
                (posixpath.join(base, "meta", posixpath.basename(p)), base) for p in found
            )
    for url, base in candidates:
        try:
            fs, path = filesystem(url, storage_options)
            text = with_retries(partial(fs.cat_file, path), url, what="read")
            rows = list(csv.reader(io.StringIO(text.decode())))
        except FileNotFoundError:
            if counts_url is not None:
                raise FileNotFoundError(f"counts file {counts_url!r} not found") from None
            continue
        for row in rows[1:]:
            if len(row) < 2:
                continue
            try:
                docs = int(row[1])
                toks = int(row[2]) if len(row) > 2 and row[2] != "" else -1
                nbytes = int(row[3]) if len(row) > 3 and row[3] != "" else -1
            except ValueError:
                raise ValueError(
                    f"{url}: bad row {row!r}; expected dataset/filename,documents,tokens[,bytes]"
                ) from None
            out.add(base, row[0], (docs, toks, nbytes))
    return out
