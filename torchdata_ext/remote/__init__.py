"""Object storage at full speed: retries, a shared local shard cache, background prefetch.

The implementation lives in :mod:`torchdata_ext.remote.cache` for now; it is split into
modules next. Import from here.
"""

from torchdata_ext.remote.cache import (
    RangeFile as RangeFile,
)
from torchdata_ext.remote.cache import (
    RemoteError,
    RetryPolicy,
    ShardCache,
    check_access,
    is_remote,
    is_transient,
    read_bytes,
    with_retries,
    write_bytes_atomic,
)
from torchdata_ext.remote.cache import (
    default_cache_dir as default_cache_dir,
)
from torchdata_ext.remote.cache import (
    explain_error as explain_error,
)

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
