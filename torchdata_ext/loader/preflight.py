"""Checks that run in the training process before any dataloader worker starts.

A config error found inside a worker comes back as a many-line "Caught ValueError in
DataLoader worker process 0" traceback; found here it is the one line the 0-worker loader
gives. :func:`check_build` refuses a build that is not a function of a
:class:`~torchdata_ext.world.World` (when the loader is made); :func:`check_before_workers`
builds worker 0's graph, without reading anything, so that the build's own checks and each
reader's logical shards against all the workers run first (when iteration starts).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.order.shards import check_shard_count
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.world import World

__all__ = ["check_before_workers", "check_build", "worker_start_message"]

_SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX socket's path on Linux (108 with the NUL)
_FORKSERVER_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")  # what multiprocessing adds


def check_before_workers(build: Callable[[World], Any], world: World) -> None:
    """Build ``world``'s graph here (worker 0 of the rank, with the rank's logical worker
    count), before any worker process starts: the build's own checks (memory, tokenizer,
    special ids) and each reader's logical shards against all ranks' workers
    (``world.total_workers``). Nothing is read: the graph is not reset.

    Raises:
        ValueError: what the build or the shard count refuses, in one line.
    """
    for node in graph_nodes(build(world)):
        if isinstance(node, ShardReader):
            check_shard_count(node.n_logical_shards, node.dataset.total_docs, world.total_workers)


def check_build(build: Any) -> None:
    """Refuse, saying what to pass, a ``build`` that is not a function of a :class:`World`: a
    config (not callable) or ``build_pipeline`` itself (which takes the config first).

    Raises:
        TypeError: naming what was passed and ``functools.partial(build_pipeline, cfg)``.
    """
    fix = "pass functools.partial(build_pipeline, cfg): a function of the World"
    if not callable(build):
        raise TypeError(f"TokenLoader(build): {type(build).__name__} is not callable; {fix}")
    name = getattr(build, "__name__", "")
    if name in ("build_pipeline", "build_eval_pipeline") and str(
        getattr(build, "__module__", "")
    ).startswith("torchdata_ext."):
        raise TypeError(
            f"TokenLoader(build): {name} needs the config first; "
            f"pass functools.partial({name}, cfg): a function of the World"
        )


def worker_start_message(err: OSError) -> str | None:
    """The clear message for dataloader workers that could not start because the fork
    server's socket path does not fit (``OSError: AF_UNIX path too long``; None for any
    other error): multiprocessing puts it in the temporary folder (``TMPDIR``), which a
    cluster's job often sets deep (a fork server is the default in a trainer started by
    ``torch.multiprocessing.spawn``)."""
    if "AF_UNIX path too long" not in str(err):
        return None
    tmp = tempfile.gettempdir()
    return (
        f"the dataloader's workers could not start: their fork server's socket goes in the "
        f"temporary folder {tmp!r} ({len(tmp)} characters), and a socket's path must fit "
        f"{_SOCKET_PATH_MAX} bytes ({_SOCKET_PATH_MAX - _FORKSERVER_SUFFIX} for the folder); "
        "set TMPDIR to a shorter folder (e.g. /tmp) for the training process, or pass "
        "multiprocessing_context='fork' to TokenLoader"
    )
