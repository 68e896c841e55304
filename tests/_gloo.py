"""Process groups for the multi-process tests: gloo over a rendezvous file of the test's own.

A ``tcp://127.0.0.1:<port>`` rendezvous needs a free port picked before the ranks start,
and another test running in parallel can take that port in between (its ranks would then
join this test's store). A file in the test's temporary folder cannot be taken, and a
timeout of minutes, not torch's default 30, makes a rank that waits for a peer fail with
its stack instead of holding the test run. The ranks are forked from a fork server that
imported torch once (:func:`run_ranks`), not spawned: a spawned rank imports torch and its
distributed checkpoint again, seconds of CPU each, on a 2-core machine running 4 tests."""

from __future__ import annotations

import datetime
import multiprocessing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: seconds a rank waits in a collective for its peers (torch's default: 1,800)
TIMEOUT_S = 180


def rendezvous(folder: str | Path) -> str:
    """A ``file://`` init method in ``folder`` (a test's ``tmp_path``), new at each call."""
    return f"file://{Path(folder) / f'rendezvous-{uuid.uuid4().hex}'}"


def init_gloo(init: str, rank: int, world_size: int) -> None:
    """``torch.distributed.init_process_group`` with gloo at ``init`` (see :func:`rendezvous`).

    A rank still alive shortly before the collective timeout writes every thread's stack to
    :func:`stacks_file` (a failing :func:`run_ranks` shows it), so a rank that waits is seen
    next to the peer it waits for. Not to stderr: a rank forked from the fork server writes
    there into the capture of whichever test started that server, where nobody sees it."""
    import faulthandler

    import torch.distributed as dist

    global _STACKS
    _STACKS = open(stacks_file(init, rank), "w")  # noqa: SIM115 (open for the rank's life)
    faulthandler.dump_traceback_later(TIMEOUT_S - 10, exit=False, file=_STACKS)

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


#: the file a rank's late stack dump goes to (kept open: faulthandler writes to its descriptor)
_STACKS: Any = None


def stacks_file(init: str, rank: int) -> Path:
    """Where rank ``rank`` of the group at ``init`` (a :func:`rendezvous`) dumps its stacks."""
    return Path(f"{init.removeprefix('file://')}.stacks-{rank}")


def _stack_dumps(args: tuple[Any, ...]) -> str:
    """The stack dumps the ranks of a :func:`run_ranks` call wrote (its rendezvous is the
    first ``file://`` argument), or ``""``."""
    init = next((a for a in args if isinstance(a, str) and a.startswith("file://")), None)
    if init is None:
        return ""
    base = stacks_file(init, 0)
    dumps = []
    for path in sorted(base.parent.glob(base.name[:-1] + "*")):
        if text := path.read_text(errors="replace").strip():
            dumps.append(f"--- {path.name.rpartition('.')[2]}:\n{text}")
    return "\n".join(dumps)


#: what the ranks' fork server imports once, before it forks them
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torchdata_ext")


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, as ``torch.multiprocessing.spawn`` does
    (an error in one is raised here), but forked from a fork server that imported
    :data:`PRELOAD` once for this test process: a spawned rank imports torch and its
    distributed checkpoint again, seconds each, and the tests start about 30 ranks."""
    import torch.multiprocessing as mp

    rank_context()
    try:
        mp.start_processes(
            _as_torchrun_rank, args=(fn, *args), nprocs=nprocs, start_method="forkserver"
        )
    except Exception as exc:
        dumps = _stack_dumps(args)
        if dumps:  # the rank a failed collective waited for, caught where it was
            raise RuntimeError(f"{exc}\n\nthe ranks' stacks before the timeout:\n{dumps}") from exc
        raise


def _as_torchrun_rank(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """``fn(rank, *args)`` with the start method of a rank that torchrun started on Linux
    (``fork``). A process forked from the fork server inherits ``forkserver`` as its start
    method, so the loader's worker processes came from a new fork server of the rank's own,
    without preloads: that server and each worker imported torch and this package again
    (seconds of CPU per rank with workers), which no torchrun rank does."""
    multiprocessing.set_start_method("fork", force=True)
    fn(rank, *args)


def rank_context() -> Any:
    """The ``multiprocessing`` context :func:`run_ranks` starts ranks with (for tests that
    start their rank processes themselves)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return multiprocessing.get_context("forkserver")
