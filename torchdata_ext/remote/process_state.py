"""What the remote I/O keeps per process, and its one reset in a forked child.

A forked child inherits its parent's memory but not its threads: a lock a parent thread held
stays locked forever, and an S3 filesystem's event loop and connections do not work. Every
process-wide object of :mod:`torchdata_ext.remote` lives here, and :func:`reset_after_fork`,
registered once with :func:`os.register_at_fork`, puts all of them right in the child:

* :data:`FILESYSTEMS`: the private filesystems of :func:`.files.private_filesystem` (dropped);
* :data:`PROBE_CLIENTS`: the probe's S3 filesystems (dropped);
* :data:`PROBED_STORES`: the stores that answered the probe (kept: they still answer);
* :data:`CACHES`: every live :class:`~torchdata_ext.remote.ShardCache`, whose per-process part
  (holds, prefetch threads, counters) is dropped with :meth:`ShardCache.after_fork`.

Imports nothing of this package (the modules above import it).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchdata_ext.remote.cache import ShardCache

__all__ = [
    "CACHES",
    "FILESYSTEMS",
    "PROBED_STORES",
    "PROBE_CLIENTS",
    "Registry",
    "reset_after_fork",
]


class Registry:
    """Objects made once per process, by key, under a lock.

    Args:
        keep_after_fork: keep the items in a forked child (facts, not clients); the lock is
            new in the child either way.
    """

    def __init__(self, keep_after_fork: bool = False) -> None:
        self.keep_after_fork = keep_after_fork
        self.lock = threading.Lock()
        self.items: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        """The item of ``key``, or None."""
        with self.lock:
            return self.items.get(key)

    def setdefault(self, key: str, value: Any) -> Any:
        """The item of ``key``, ``value`` stored first when there is none (a racing maker's
        object is dropped, the first one kept)."""
        with self.lock:
            return self.items.setdefault(key, value)

    def after_fork(self) -> None:
        """A new lock, and no items unless ``keep_after_fork``."""
        self.lock = threading.Lock()
        if not self.keep_after_fork:
            self.items = {}


FILESYSTEMS = Registry()
"""The private filesystems of :func:`.files.private_filesystem`, by protocol and options."""

PROBE_CLIENTS = Registry()
"""The probe's S3 filesystems, by protocol and options."""

PROBED_STORES = Registry(keep_after_fork=True)
"""The stores (protocol, bucket, options) that answered the probe: key -> True."""

CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()
"""Every live :class:`~torchdata_ext.remote.ShardCache` of this process."""


def reset_after_fork() -> None:
    """Put the remote I/O's process-wide objects right in a forked child (see the module doc)."""
    for registry in (FILESYSTEMS, PROBE_CLIENTS, PROBED_STORES):
        registry.after_fork()
    for cache in list(CACHES):
        cache.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=reset_after_fork)
