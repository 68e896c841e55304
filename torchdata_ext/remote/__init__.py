"""Object storage at full speed: retries, a shared local shard cache, background prefetch.

Three pieces, usable on their own and wired into :class:`~torchdata_ext.nodes.ShardReader`:

* :class:`RetryPolicy` and :func:`with_retries`: exponential backoff with full jitter on
  transient errors (HTTP 5xx / 429 / ``SlowDown``, connection resets, timeouts, truncated
  bodies), a bounded number of attempts and of total time, then a :class:`RemoteError` naming the
  URL. Permanent errors are not retried: a missing bucket, bad credentials or an endpoint that
  cannot be reached (connection refused, unknown host, invalid URL) raise a
  :class:`RemoteError` at once saying what to check; a missing object raises
  ``FileNotFoundError``.
* :class:`ShardCache`: whole-file downloads of remote shard files into a local directory shared
  by every worker and rank on the machine, never read half-downloaded, downloaded once however
  many processes want them, evicted least-recently-used under a size limit; the files a reader
  needs next are prefetched in background threads. Counters (:meth:`ShardCache.stats`) say
  whether I/O is the bottleneck.
* Range reads (``ShardCache(range_reads=True)``): no download; Arrow IPC files (one document per
  record batch) and Parquet files are read with HTTP range requests, through
  :meth:`ShardCache.open_range`.

Modules (import from this package; the modules are its layout, not its interface):

* :mod:`.retry`: :class:`RemoteError`, :class:`RetryPolicy`, :func:`with_retries`,
  :func:`is_transient`, :func:`explain_error` (no I/O).
* :mod:`.files`: :func:`is_remote`, :func:`read_bytes`, :func:`write_bytes_atomic` (the
  project's one atomic write), :func:`remove_file`, :func:`check_access`,
  :func:`default_cache_dir`.
* :mod:`.cache`: :class:`ShardCache`, what one process keeps (holds, prefetch threads,
  counters) and the download.
* :mod:`.disk`: the cache folder shared by all processes: layout, ``flock`` locks, scanning and
  least-recently-used eviction.
* :mod:`.rangefile`: :class:`RangeFile`, range reads through the cache.
* :mod:`.process_state`: the filesystems, probe clients and caches each process keeps, and
  their one reset in a forked child.
"""

# `X as X`: public names that were outside `__all__`, importable from here as before the split
from torchdata_ext.remote.cache import ShardCache
from torchdata_ext.remote.disk import COMPANION_SUFFIXES as COMPANION_SUFFIXES
from torchdata_ext.remote.files import check_access, is_remote, read_bytes, write_bytes_atomic
from torchdata_ext.remote.files import default_cache_dir as default_cache_dir
from torchdata_ext.remote.files import remove_file as remove_file
from torchdata_ext.remote.rangefile import RangeFile as RangeFile
from torchdata_ext.remote.retry import RemoteError, RetryPolicy, is_transient, with_retries
from torchdata_ext.remote.retry import explain_error as explain_error

__all__ = [
    "RemoteError",
    "RetryPolicy",
    "ShardCache",
    "check_access",
    "is_remote",
    "is_transient",
    "read_bytes",
    "with_retries",
    "write_bytes_atomic",
]
