"""Process groups for the multi-process tests: gloo over a rendezvous file of the test's own.

A ``tcp://127.0.0.1:<port>`` rendezvous needs a free port picked before the ranks start,
and another test running in parallel can take that port in between (its ranks would then
join this test's store). A file in the test's temporary folder cannot be taken, and a
timeout of minutes, not torch's default 30, makes a rank that waits for a peer fail with
its stack instead of holding the test run."""

from __future__ import annotations

import datetime
import uuid
from pathlib import Path

#: seconds a rank waits in a collective for its peers (torch's default: 1,800)
TIMEOUT_S = 180


def rendezvous(folder: str | Path) -> str:
    """A ``file://`` init method in ``folder`` (a test's ``tmp_path``), new at each call."""
    return f"file://{Path(folder) / f'rendezvous-{uuid.uuid4().hex}'}"


def init_gloo(init: str, rank: int, world_size: int) -> None:
    """``torch.distributed.init_process_group`` with gloo at ``init`` (see :func:`rendezvous`).

    A rank still alive shortly before the collective timeout prints every thread's stack (the
    test shows it), so a rank that waits is seen next to the peer it waits for."""
    import faulthandler
    import sys

    import torch.distributed as dist

    faulthandler.dump_traceback_later(TIMEOUT_S - 10, exit=False, file=sys.stderr)

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
