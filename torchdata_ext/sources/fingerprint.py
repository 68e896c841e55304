"""Per-file fingerprints: catch a data file that was changed in place under a checkpoint.

A dataset's fingerprint (:meth:`~torchdata_ext.sources.index.DatasetIndex.fingerprint`) covers its file
names and document counts, so a file rewritten under the same name with the same number of
documents would pass it and silently change the stream. A *file fingerprint* is cheap and
catches that::

    {"size": 1048576, "version": "mtime=1732519431.52", "sha256": "9f2c..."}

* ``size``: bytes, and ``version``: ``"<key>=<value>"`` of the first of the fsspec ``info``
  fields that change when an object is rewritten (``ETag``, ``generation``, ``mtime``,
  ``LastModified``, ``created``...; ``""`` when the filesystem has none). Both come from the
  listing on object stores (no request per file). :func:`file_stat` is the one definition,
  used by the index's counts cache too.
* ``sha256``: of the first and last :data:`SAMPLE_BYTES` (64 KiB) of the file (the whole file
  when it is at most 128 KiB): two range reads, never a download.

:func:`compare` says which files differ between a recorded set and the current one.
Versions of different kinds (an ``mtime`` recorded on local disk, an ``ETag`` now on S3: the
data was copied) are not compared; size and sampled bytes still are. A version that changed
while size and sampled bytes did not is reported too (the middle of the file may have
changed), so a copy that did not keep modification times (``cp`` without ``-p``) is reported:
keep them (``rsync -a``, ``cp -p``) or accept the files explicitly.

Cost: digests are kept per process by ``(url, size, version)``, so each file is read once per
process whatever the number of indexes, saves and loads; reads run :data:`THREADS` at a time.
Digests this process did not compute are kept too when the object's version names its content
(:data:`CONTENT_VERSIONS`, :func:`remember_digests`): those an index file records
(:mod:`~torchdata_ext.sources.index_file`), those a checkpoint recorded for objects listed
unchanged at a restore, and those other ranks computed for a save under ``torch.distributed``.
So a save reads no data file once the job has its digests: the first save of a job over index
files, and every save after a restore or an earlier save, reads none.
A check against recorded fingerprints reads no file that is listed with its recorded size and
content version (ETag, generation: :func:`current_fingerprints`), so a restore over unchanged
objects reads nothing; the other files are shared among the ranks, with or without a process
group (:func:`check_data_files`). The request budget is in ``docs/object-storage-at-scale.md``.

This module is 817 lines: the checkpoint and audit code import the stat, compare and check names
from here, and the sharing of checks among ranks reads the per-process digests it keeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from torchdata_ext.remote import with_retries
from torchdata_ext.remote.urls import filesystem

if TYPE_CHECKING:
    from torchdata_ext.sources.index import DatasetIndex

__all__ = [
    "CONTENT_VERSIONS",
    "SAMPLE_BYTES",
    "ChangedFilesError",
    "FileChange",
    "check_data_files",
    "check_share",
    "compare",
    "compared",
    "current_fingerprints",
    "dataset_fingerprints",
    "describe",
    "file_fingerprint",
    "file_fingerprints",
    "file_stat",
    "fingerprint_share",
    "fresh_stats",
    "is_collective",
    "listed_changes",
    "remember_digests",
    "known_digests",
    "stat_from_info",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

SAMPLE_BYTES = 64 * 1024
"""Bytes hashed at each end of a file."""
THREADS = 16
"""Files fingerprinted at a time."""
# fsspec info fields that change when an object is rewritten, most specific first
VERSION_KEYS = ("ETag", "etag", "generation", "mtime", "LastModified", "last_modified", "created")
CONTENT_VERSIONS = ("ETag", "etag", "generation")
"""Version kinds that change whenever an object's content is rewritten: an object listed with
the recorded size and one of these is not read again to check it."""
_DIGEST_CHARS = 32  # 128 bits of the sha256: plenty to tell two versions of a file apart

Stat = tuple[int, str]
"""``(size in bytes or -1, version or "")``."""

_digests: dict[tuple[str, int, str], str] = {}  # (url, size, version) -> sampled sha256
_lock = threading.Lock()


def stat_from_info(info: Mapping[str, Any]) -> Stat:
    """A file's ``(size, version)`` from its fsspec ``info`` (``-1`` / ``""`` where unknown).

    Args:
        info: what ``fs.info(path)`` (or a listing with ``detail=True``) returned for the file.
    """
    size = info.get("size")
    key = next((k for k in VERSION_KEYS if info.get(k) is not None), None)
    version = "" if key is None else f"{key}={info[key]}"
    return (-1 if size is None else int(size)), version


def file_stat(
    url: str, storage_options: dict[str, Any] | None = None, *, fresh: bool = False
) -> Stat:
    """``(size, version)`` of file ``url`` from fsspec ``info`` (see :func:`stat_from_info`).

    Args:
        url: the file (any fsspec URL).
        storage_options: fsspec options (credentials, endpoint).
        fresh: ask the store now (``info(refresh=True)``: a HEAD on S3) instead of taking
            what a listing of this process cached.

    Raises:
        FileNotFoundError: no such file.
        RemoteError: the store cannot be reached or refuses access (after retries).
    """
    fs, path = filesystem(url, storage_options)
    info = partial(fs.info, path, refresh=True) if fresh else partial(fs.info, path)
    return stat_from_info(with_retries(info, url, what="stat"))


def file_fingerprint(
    url: str, storage_options: dict[str, Any] | None = None, *, stat: Stat | None = None
) -> dict[str, Any]:
    """The fingerprint of file ``url``: ``{"size", "version", "sha256"}`` (see the module doc).

    Args:
        url: the file (any fsspec URL).
        storage_options: fsspec options (credentials, endpoint).
        stat: its ``(size, version)`` when already known (e.g. from a listing); default: asked
            with :func:`file_stat`.

    The sampled digest is computed once per process for each ``(url, size, version)``; a file
    without a version is read every time.

    Raises:
        FileNotFoundError: no such file.
        RemoteError: the store cannot be reached or refuses access (after retries).
    """
    size, version = file_stat(url, storage_options) if stat is None else stat
    key = (url, size, version)
    with _lock:
        digest = _digests.get(key) if version else None
    if digest is None:
        digest = _sampled_sha256(url, size, storage_options)
        if version:
            with _lock:
                _digests[key] = digest
    return {"size": size, "version": version, "sha256": digest}


def file_fingerprints(
    urls: Sequence[str],
    storage_options: dict[str, Any] | None = None,
    *,
    stats: Sequence[Stat] | None = None,
) -> list[dict[str, Any]]:
    """:func:`file_fingerprint` of every URL, :data:`THREADS` files at a time, in order.

    Args:
        urls: the files.
        storage_options: fsspec options for all of them.
        stats: their ``(size, version)`` when known (same length as ``urls``).
    """
    if stats is not None and len(stats) != len(urls):
        raise ValueError(f"{len(stats)} stats for {len(urls)} urls; pass one (size, version) each")
    out: list[dict[str, Any] | None] = [None] * len(urls)
    if stats is not None:  # digests this process already has: no thread, no request
        with _lock:
            for i, (u, (size, version)) in enumerate(zip(urls, stats)):
                digest = _digests.get((u, size, version)) if version else None
                if digest is not None:
                    out[i] = {"size": size, "version": version, "sha256": digest}
    todo = [i for i, fp in enumerate(out) if fp is None]
    jobs = [
        partial(
            file_fingerprint, urls[i], storage_options, stat=None if stats is None else stats[i]
        )
        for i in todo
    ]
    done = _threaded(jobs, "fingerprint")
    for i, fp in zip(todo, done):
        out[i] = fp
    return [fp for fp in out if fp is not None]


def _threaded(jobs: Sequence[Callable[[], T]], name: str) -> list[T]:
    """Each job's result, in order, :data:`THREADS` at a time (in this thread when one)."""
    if len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(min(THREADS, len(jobs)), thread_name_prefix=name) as pool:
        return list(pool.map(lambda job: job(), jobs))


def remember_digests(urls: Sequence[str], fingerprints: Sequence[Mapping[str, Any]]) -> int:
    """Keep digests computed elsewhere (an index file, a checkpoint, another rank) for this
    process, so :func:`file_fingerprint` does not read those files again; return how many
    were kept.

    Only a fingerprint whose version names the content (:data:`CONTENT_VERSIONS`: an S3
    ``ETag``, a GCS ``generation``, which change whenever the object is rewritten) with a
    known size and digest is kept: its key ``(url, size, version)`` can only be met again by
    the same bytes. A modification time can stay while the bytes change, so those are not.

    Args:
        urls: the files, as :func:`file_fingerprint` names them.
        fingerprints: one ``{"size", "version", "sha256"}`` per URL (of
            :data:`SAMPLE_BYTES` samples).
    """
    if len(urls) != len(fingerprints):
        raise ValueError(
            f"{len(fingerprints)} fingerprints for {len(urls)} urls; pass one fingerprint each"
        )
    kept = 0
    with _lock:
        for url, fp in zip(urls, fingerprints):
            size, version, digest = int(fp["size"]), str(fp["version"]), str(fp["sha256"])
            if version.partition("=")[0] in CONTENT_VERSIONS and size >= 0 and digest:
                _digests[(url, size, version)] = digest
                kept += 1
    return kept


def known_digests(urls: Sequence[str], stats: Sequence[Stat]) -> list[dict[str, Any]]:
    """The fingerprints this process already holds (:func:`remember_digests`, or read) of
    ``urls`` as listed with ``stats`` (``(size, version)`` each), for another process's
    :func:`remember_digests`; files without one are left out (nothing is read)."""
    with _lock:
        held = [(u, s, v, _digests.get((u, s, v))) for u, (s, v) in zip(urls, stats)]
    return [
        {"url": u, "size": s, "version": v, "sha256": d} for u, s, v, d in held if d is not None
    ]


def _sampled_sha256(url: str, size: int, storage_options: dict[str, Any] | None) -> str:
    """sha256 of the first and last SAMPLE_BYTES of ``url`` (two range reads at most)."""
    fs, path = filesystem(url, storage_options)

    def read(start: int, end: int) -> bytes:
        return bytes(
            with_retries(partial(fs.cat_file, path, start=start, end=end), url, what="read")
        )

    h = hashlib.sha256()
    if size < 0:  # size unknown: the first bytes only
        h.update(read(0, SAMPLE_BYTES))
    elif size > 0:
        h.update(read(0, min(size, SAMPLE_BYTES)))
        if size > SAMPLE_BYTES:
            h.update(read(max(SAMPLE_BYTES, size - SAMPLE_BYTES), size))
    return h.hexdigest()[:_DIGEST_CHARS]


# -- comparing -----------------------------------------------------------------------------------
_SAMPLED = f"first/last {SAMPLE_BYTES // 1024} KiB"


def compared(recorded: Mapping[str, Any], names: Iterable[str]) -> str:
    """What :func:`check_data_files` compares for datasets ``names`` of ``recorded`` (a
    manifest's ``"file_fingerprints"``), in words for a report: how many files, and which parts
    of each (the bytes between the sampled ends are not read)."""
    theirs = recorded["datasets"]
    n = sum(len(theirs[name]) for name in names if name in theirs)
    what = (
        f"the sha256 of its first and last {SAMPLE_BYTES // 1024} KiB (the bytes between are "
        "not read)"
        if recorded.get("sample_bytes") == SAMPLE_BYTES
        else "none of its bytes (the checkpoint sampled another byte range)"
    )
    return (
        f"{n:,} data file(s), each by its size, its version (modification time or ETag, as "
        f"the filesystem lists it) and {what}"
    )


@dataclass(frozen=True)
class FileChange:
    """One file whose fingerprint differs from the recorded one.

    Attributes:
        file: the file's name as recorded (relative to its dataset's folder).
        what: what differs, out of ``"missing"`` (recorded, not there now), ``"new"`` (there
            now, not recorded), ``"size"``, ``"sha256"`` (the sampled bytes), ``"version"``.
        recorded: the recorded fingerprint (None for a new file).
        current: the current fingerprint (None for a missing file).
    """

    file: str
    what: tuple[str, ...]
    recorded: Mapping[str, Any] | None
    current: Mapping[str, Any] | None

    def __str__(self) -> str:
        if "missing" in self.what:
            return f"{self.file} (missing now)"
        if "new" in self.what:
            return f"{self.file} (not in the recorded files)"
        old, new = self.recorded or {}, self.current or {}
        parts = [
            f"{_SAMPLED} differ" if key == "sha256" else f"{key} {old[key]} -> {new[key]}"
            for key in self.what
        ]
        return f"{self.file} ({'; '.join(parts)})"


def compare(
    recorded: Mapping[str, Mapping[str, Any]], current: Mapping[str, Mapping[str, Any]]
) -> list[FileChange]:
    """The files whose fingerprints differ between two sets, sorted by name.

    Args:
        recorded: file name -> fingerprint (``{"size", "version", "sha256"}``) as recorded, e.g.
            in a checkpoint (``manifest["file_fingerprints"]["datasets"][name]``).
        current: file name -> fingerprint of the data now, e.g.
            :meth:`DatasetIndex.file_fingerprints() <torchdata_ext.sources.index.DatasetIndex.file_fingerprints>`.
            Names must be relative the same way on both sides (the index names files relative
            to the dataset's common folder, so moving the data keeps them).

    Returns:
        One :class:`FileChange` per file that is missing, new, or differs in size, sampled
        bytes or version. A size of -1 or an empty version or digest means unknown and is not
        compared; versions of different kinds (``mtime=`` against ``ETag=``) are not compared.
        Empty when everything matches.
    """
    out: list[FileChange] = []
    for name in sorted(set(recorded) | set(current)):
        old, new = recorded.get(name), current.get(name)
        if old is None:
            out.append(FileChange(name, ("new",), None, new))
            continue
        if new is None:
            out.append(FileChange(name, ("missing",), old, None))
            continue
        what = []
        if old["size"] >= 0 and new["size"] >= 0 and old["size"] != new["size"]:
            what.append("size")
        if old["sha256"] and new["sha256"] and old["sha256"] != new["sha256"]:
            what.append("sha256")
        v_old, v_new = str(old["version"]), str(new["version"])
        same_kind = v_old.partition("=")[0] == v_new.partition("=")[0]
        if v_old and v_new and same_kind and v_old != v_new:
            what.append("version")
        if what:
            out.append(FileChange(name, tuple(what), old, new))
    return out


def listed_changes(
    recorded: Mapping[str, Mapping[str, Any]], index: DatasetIndex
) -> list[FileChange]:
    """:func:`compare` on what the index's listing says (names and sizes), reading no file:
    the files missing, added or resized since ``recorded``.

    Args:
        recorded: file name -> fingerprint, as for :func:`compare`.
        index: the dataset now; an index built by hand (no ``file_stats``) gives ``[]``.
    """
    if not index.file_stats:
        return []
    listed = {
        f: {"size": size, "version": "", "sha256": ""}
        for f, (size, _) in zip(index.file_names(), index.file_stats)
    }
    return compare(recorded, listed)


class ChangedFilesError(ValueError):
    """Data files differ from the fingerprints recorded with a checkpoint.

    Attributes:
        changes: dataset name -> its changed files.
    """

    def __init__(self, message: str, changes: Mapping[str, Sequence[FileChange]]) -> None:
        super().__init__(message)
        self.changes = {k: list(v) for k, v in changes.items()}


def describe(changes: Mapping[str, Sequence[FileChange]], limit: int = 10) -> str:
    """``changes`` (dataset -> changed files) as one line for a message, at most ``limit``
    files named per dataset."""
    parts = []
    for name, files in changes.items():
        shown = "; ".join(str(c) for c in files[:limit])
        more = f"; and {len(files) - limit} more" if len(files) > limit else ""
        parts.append(f"dataset {name!r}: {len(files)} file(s): {shown}{more}")
    return " | ".join(parts)


# -- datasets -------------------------------------------------------------------------------------
def is_collective(world_size: int) -> bool:
    """Whether :func:`dataset_fingerprints` shares its work among ``world_size`` (> 1)
    ``torch.distributed`` ranks, a collective that every rank must call."""
    import torch.distributed as dist

    return (
        world_size > 1
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == world_size
    )


def dataset_fingerprints(
    datasets: Mapping[str, DatasetIndex],
    *,
    rank: int = 0,
    world_size: int = 1,
    recorded: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
    listed_since: float | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every data file's fingerprint now: ``{dataset: {file name: fingerprint}}``.

    Args:
        datasets: the datasets by name.
        rank / world_size: this process's rank among the loader's ranks. When
            :func:`is_collective` (``torch.distributed`` runs those ranks), each rank
            fingerprints every ``world_size``-th file and the shares are gathered: every rank
            must call this, and gets every file. Otherwise this process does all the files.
        recorded: fingerprints recorded earlier, by dataset and file: a file listed with the
            recorded size and content version (ETag, generation) is not read
            (:func:`current_fingerprints`).
        listed_since: as for :func:`current_fingerprints` (a check: listings older than it
            are asked again).

    Each file is read once per process (see :func:`file_fingerprint`).

    Raises:
        FileNotFoundError, RemoteError: a file cannot be read (on the rank that read it; the
            other ranks raise ``RuntimeError`` naming that rank and the error).
    """
    names = sorted(datasets)
    shared = is_collective(world_size)
    mine = _share(datasets, rank, world_size) if shared else _share(datasets, 0, 1)
    out: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in names}
    recorded = recorded or {}

    def fingerprints(name: str, which: list[int]) -> dict[str, dict[str, Any]]:
        return current_fingerprints(
            datasets[name], which, recorded.get(name, {}), listed_since=listed_since
        )

    if not shared:
        for name, which in mine.items():
            out[name] = fingerprints(name, which)
        return out
    parts = _gather(
        lambda: {name: fingerprints(name, which) for name, which in mine.items()},
        world_size,
        "fingerprint the data files",
    )
    for part in parts:
        for name, files in part.items():
            out[name].update(files)
    for name in names:  # the other ranks' shares: this process need not read them at a save
        _remember_named(datasets[name], out[name])
    return out


def _remember_named(index: DatasetIndex, fingerprints: Mapping[str, Mapping[str, Any]]) -> None:
    """:func:`remember_digests` of ``fingerprints`` (file name -> fingerprint) of ``index``'s
    files; names it does not hold are skipped."""
    urls = dict(zip(index.file_names(), index.files))
    known = [(urls[f], fp) for f, fp in fingerprints.items() if f in urls]
    remember_digests([u for u, _ in known], [fp for _, fp in known])


def _remember_recorded(
    theirs: Mapping[str, Mapping[str, Any]], datasets: Mapping[str, DatasetIndex]
) -> None:
    """Keep the recorded digests of every file listed now as the recorded object (same size
    and content version: :func:`current_fingerprints` takes those as they are), whoever's
    share it is: reading nothing, so this process's next save reads none of them."""
    for name, index in datasets.items():
        stats = getattr(index, "file_stats", ())
        recorded = theirs.get(name, {})
        if stats and recorded:
            same = {
                f: recorded[f]
                for f, stat in zip(index.file_names(), stats)
                if f in recorded and _same_object(recorded[f], stat)
            }
            _remember_named(index, same)


def current_fingerprints(
    index: DatasetIndex,
    which: Sequence[int],
    recorded: Mapping[str, Mapping[str, Any]],
    *,
    listed_since: float | None = None,
) -> dict[str, dict[str, Any]]:
    """The fingerprints now of files ``which`` (positions) of ``index``, by name.

    A file whose listed size and version (``index.file_stats``) equal the recorded ones, and
    whose version names the content (:data:`CONTENT_VERSIONS`: an S3 ``ETag``, a GCS
    ``generation``, which change whenever the object is rewritten), is unchanged: its recorded
    fingerprint is returned and nothing is read. The others are read (2 range reads each), so
    a restart over unchanged objects reads no data file.

    Args:
        listed_since: a check's start (``time.time()``): when ``index`` was listed before it
            (an index built earlier in this process, or read from an index file), the sizes
            and versions of files ``which`` are asked again (:func:`fresh_stats`: a stat or a
            HEAD each) instead of trusted, so a file rewritten since the listing is caught as
            by a fresh process. None: the listing is taken as it is (a save).
    """
    names = index.file_names()
    stats = getattr(index, "file_stats", ())
    if listed_since is not None and stats and getattr(index, "listed_at", 0.0) < listed_since:
        stats = fresh_stats(index, which)
        index = _with_stats(index, stats)
    out: dict[str, dict[str, Any]] = {}
    read: list[int] = []
    for i in which:
        old = recorded.get(names[i])
        if old is not None and stats and _same_object(old, stats[i]):
            out[names[i]] = dict(old)
        else:
            read.append(i)
    if read:
        out.update(index.file_fingerprints(read))
    return out


def fresh_stats(index: DatasetIndex, which: Sequence[int]) -> tuple[Stat, ...]:
    """``index.file_stats`` with the sizes and versions of files ``which`` asked of the store
    now (:data:`THREADS` at a time); the others as listed.

    Raises:
        FileNotFoundError: a file of ``which`` is gone.
        RemoteError: the store cannot be reached or refuses access (after retries).
    """
    stats = list(index.file_stats)
    so = index.storage_options
    now = _threaded([partial(file_stat, index.files[i], so, fresh=True) for i in which], "stat")
    for i, stat in zip(which, now):
        stats[i] = stat
    return tuple(stats)


def _with_stats(index: DatasetIndex, stats: tuple[Stat, ...]) -> DatasetIndex:
    return dataclasses.replace(index, file_stats=stats, listed_at=time.time())


def _same_object(recorded: Mapping[str, Any], stat: Stat) -> bool:
    """Whether a listed ``(size, version)`` is the recorded object (a content version)."""
    size, version = stat
    kind = version.partition("=")[0]
    return (
        kind in CONTENT_VERSIONS
        and version == recorded.get("version")
        and size >= 0
        and size == recorded.get("size")
    )


def _gather(compute: Callable[[], T], world_size: int, doing: str) -> list[T]:
    """``compute()`` on this rank, and every rank's result (``torch.distributed``
    ``all_gather_object``, by rank). A rank whose ``compute`` fails still joins the gather,
    with its error, so no rank waits for it: that rank raises its error, the others
    ``RuntimeError`` naming it (``"rank 1 could not <doing>: ..."``)."""
    import torch.distributed as dist

    result: Any = None
    error: Exception | None = None
    try:
        result = compute()
    except Exception as exc:  # raised below, once the other ranks know (no rank waits forever)
        error = exc
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(
        gathered, (result, None if error is None else f"{type(error).__name__}: {error}")
    )
    if error is not None:
        try:
            raise error
        finally:  # the frame must not hold the error its traceback holds (a cycle)
            del error
    for r, (_, their_error) in enumerate(gathered):
        if their_error is not None:
            raise RuntimeError(f"rank {r} could not {doing}: {their_error}")
    return [theirs for theirs, _ in gathered]


def _share(
    datasets: Mapping[str, DatasetIndex], rank: int, world_size: int
) -> dict[str, list[int]]:
    """Rank ``rank``'s share of the data files: every ``world_size``-th of them all (datasets
    by name, files in order), as ``{dataset: [file number, ...]}``."""
    jobs = [(name, i) for name in sorted(datasets) for i in range(len(datasets[name].files))]
    mine: dict[str, list[int]] = defaultdict(list)
    for name, i in jobs[rank::world_size]:
        mine[name].append(i)
    return dict(mine)


def fingerprint_share(
    datasets: Mapping[str, DatasetIndex], *, rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """This rank's share of the data files' fingerprints, read by this rank alone (no
    collective): ``{"sample_bytes": ..., "datasets": {dataset: {file name: fingerprint}}}``
    for every ``world_size``-th file (all of them with one rank). What each rank of a
    ``torch.distributed.checkpoint`` records (:class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`),
    so no rank stores or reads every file; checked by :func:`check_share`."""
    share = _share(datasets, rank, world_size)
    return {
        "sample_bytes": SAMPLE_BYTES,
        "datasets": {
            name: datasets[name].file_fingerprints(which) for name, which in share.items()
        },
    }


def check_share(
    recorded: Mapping[str, Any] | None,
    datasets: Mapping[str, DatasetIndex],
    *,
    world_size: int = 1,
    allow_changed_files: bool = False,
    where: str = "the checkpoint",
    listed_since: float | None = None,
) -> dict[str, list[FileChange]]:
    """Compare the files a rank recorded (:func:`fingerprint_share`) with the files now.

    Only the recorded files are read. Under ``torch.distributed`` (:func:`is_collective`:
    every rank must call this) the ranks' findings are gathered, so every rank refuses (or
    warns about) every changed file, whichever rank found it.

    Args:
        recorded: what :func:`fingerprint_share` returned at save time (None: nothing was
            recorded; nothing is checked).
        datasets: the datasets now, by name (a recorded dataset missing here is skipped: the
            readers' own checks refuse a dataset that went away).
        world_size / allow_changed_files / where / listed_since: as for
            :func:`check_data_files`.

    Raises:
        ChangedFilesError: as for :func:`check_data_files`.
        FileNotFoundError, RemoteError: a recorded file cannot be read (on the rank that read
            it; under ``torch.distributed`` the other ranks raise ``RuntimeError`` naming that
            rank and the error, none waits in the gather).
    """

    def mine() -> dict[str, list[FileChange]]:
        return {} if recorded is None else _share_changes(recorded, datasets, listed_since)

    if is_collective(world_size):
        changes: dict[str, list[FileChange]] = {}
        for found in _gather(mine, world_size, "check its data files"):
            for name, files in found.items():
                changes.setdefault(name, []).extend(files)
        changes = {n: sorted(f, key=lambda c: c.file) for n, f in sorted(changes.items())}
    else:
        changes = mine()
    if recorded is None:
        logger.info("%s records no data file fingerprints: the data files are not checked", where)
    return _refuse_or_warn(changes, allow_changed_files, where)


def _share_changes(
    recorded: Mapping[str, Any],
    datasets: Mapping[str, DatasetIndex],
    listed_since: float | None = None,
) -> dict[str, list[FileChange]]:
    """The recorded files (:func:`fingerprint_share`) that differ now, by dataset."""
    changes: dict[str, list[FileChange]] = {}
    theirs = _comparable(recorded)
    _remember_recorded(theirs, datasets)
    for name in sorted(theirs):
        index = datasets.get(name)
        if index is None:
            continue
        files = theirs[name]
        number = {f: i for i, f in enumerate(index.file_names())}
        now = current_fingerprints(
            index, [number[f] for f in files if f in number], files, listed_since=listed_since
        )
        if found := compare(files, now):
            changes[name] = found
    return changes


def check_data_files(
    recorded: Mapping[str, Any] | None,
    datasets: Mapping[str, DatasetIndex],
    *,
    rank: int = 0,
    world_size: int = 1,
    allow_changed_files: bool = False,
    where: str = "the checkpoint",
    reads: Mapping[str, Iterable[int]] | None = None,
    listed_since: float | None = None,
) -> dict[str, list[FileChange]]:
    """Compare the data files with the fingerprints recorded at save time.

    Args:
        recorded: what a checkpoint recorded: ``{"sample_bytes": 65536, "datasets": {dataset:
            {file name: fingerprint}}}`` (a manifest's ``"file_fingerprints"``); None for a
            checkpoint saved before fingerprints existed (nothing is checked; logged).
        datasets: the datasets now, by name; those with nothing recorded (added since) are
            skipped.
        rank / world_size: this process's rank among the loader's ranks. Under
            ``torch.distributed`` (:func:`is_collective`) a collective: each rank reads every
            ``world_size``-th file and every rank refuses every changed file. Without a
            process group each rank reads and compares its share alone (2 range reads per
            file, about F / world_size files) plus every file of ``reads``, and the rank that
            finds a change raises it (rank 0 also reports recorded files that are gone).
            ``world_size=1``: every file.
        allow_changed_files: log a warning naming the changed files instead of raising.
        where: what recorded them, for messages (``"loader checkpoint s3://b/ckpt"``).
        reads: the files this rank's shards read, by dataset (file numbers): without a
            process group a rank checks these too, whoever's share they are, so no rank
            reads a changed file another rank alone would have found.
        listed_since: the check's start (``time.time()``): the files of an index listed
            before it are asked again (see :func:`current_fingerprints`). None: listings are
            trusted as they are.

    Returns:
        The changed files by dataset (empty when nothing changed).

    Raises:
        ChangedFilesError: files changed and ``allow_changed_files`` is False; the message
            names each file and what differs.
    """
    if recorded is None:
        logger.info("%s records no data file fingerprints: the data files are not checked", where)
        return {}
    theirs = _comparable(recorded)
    mine = {n: ix for n, ix in datasets.items() if n in theirs}
    _remember_recorded(theirs, mine)
    if world_size > 1 and not is_collective(world_size):  # ranks known, no process group
        changes = _checked_share(theirs, mine, rank, world_size, reads or {}, listed_since)
        where = (
            f"{where} (rank {rank} of {world_size} checks every {world_size}-th file and "
            "those its shards read)"
        )
        return _refuse_or_warn(changes, allow_changed_files, where)
    current = dataset_fingerprints(
        mine, rank=rank, world_size=world_size, recorded=theirs, listed_since=listed_since
    )
    changes = {name: c for name in sorted(current) if (c := compare(theirs[name], current[name]))}
    return _refuse_or_warn(changes, allow_changed_files, where)


def _checked_share(
    theirs: Mapping[str, Mapping[str, Any]],
    datasets: Mapping[str, DatasetIndex],
    rank: int,
    world_size: int,
    reads: Mapping[str, Iterable[int]],
    listed_since: float | None,
) -> dict[str, list[FileChange]]:
    """The changed files among rank ``rank``'s share (:func:`_share`) of the recorded ones
    and the files its shards read (``reads``), read by this rank alone; rank 0 also reports
    the recorded files that are gone."""
    changes: dict[str, list[FileChange]] = {}
    share = _share(datasets, rank, world_size)
    for name in sorted(datasets):
        recorded = theirs[name]
        which = sorted(set(share.get(name, [])) | {int(i) for i in reads.get(name, ())})
        now = current_fingerprints(datasets[name], which, recorded, listed_since=listed_since)
        was = {f: recorded[f] for f in now if f in recorded}
        if rank == 0:
            present = set(datasets[name].file_names())
            was.update({f: fp for f, fp in recorded.items() if f not in present})
        if found := compare(was, now):
            changes[name] = found
    return changes


def _comparable(recorded: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    """The recorded fingerprints by dataset, as :func:`compare` takes them: digests of other
    byte ranges than :data:`SAMPLE_BYTES` (an earlier format) blanked, so not compared."""
    theirs = recorded["datasets"]
    if recorded.get("sample_bytes") == SAMPLE_BYTES:
        return theirs
    return {
        name: {f: {**fp, "sha256": ""} for f, fp in files.items()} for name, files in theirs.items()
    }


def _refuse_or_warn(
    changes: dict[str, list[FileChange]], allow_changed_files: bool, where: str
) -> dict[str, list[FileChange]]:
    """Raise :class:`ChangedFilesError` naming the changed files, or with
    ``allow_changed_files`` log them; ``changes`` itself when nothing is refused."""
    if not changes:
        return {}
    if allow_changed_files:
        logger.warning(
            "data files changed since %s was saved (accepted: allow_changed_files=True): %s",
            where, describe(changes),
        )  # fmt: skip
        return changes
    raise ChangedFilesError(
        f"cannot restore {where}: data files changed since it was saved: {describe(changes)}. "
        "Their documents may differ from those the checkpoint's positions refer to, which would "
        "silently change the stream; restore with the data as it was saved, or pass "
        "allow_changed_files=True if the change is harmless (e.g. the same bytes copied "
        "without keeping modification times)",
        changes,
    )
