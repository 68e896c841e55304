"""A torchft job on one machine, to try :class:`~torchdata_ext.torchft.ElasticLoader` on CPU
and to test it: a Lighthouse, each replica group's ``Manager`` on gloo, the groups' step
logs, and which steps committed (``examples/elastic_torchft.py``, the tests and the
benchmark share them).

A step log is a JSON-lines file a replica group writes: an *attempt* line per step
(``{"step", <participants key>, "rows", ...}``, written before the step's gradient leaves)
followed by ``{"step", "committed", ...}`` once ``should_commit()`` answered. An attempt is a
step and its participants (a step that fails is tried again, with other participants after a
death); it is delivered when it committed in some group.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["committed_attempts", "local_manager", "read_step_log", "start_lighthouse", "stop_job"]

_STORES: list[Any] = []


def start_lighthouse(min_replicas: int) -> Any:
    """A torchft ``LighthouseServer`` on a free port, tuned for a local job: a 300 ms join
    timeout, a 20 ms quorum tick and a 1 s heartbeat timeout (a killed group leaves the quorum
    within a second). Its ``address()`` is what :func:`local_manager` takes.

    Args:
        min_replicas: the replica groups a quorum needs, at least 1: more than half of the
            groups the job runs (2 of 3). Fewer lets two quorums train the same step at once
            (split brain): a group that starts alone before the others' first heartbeat, or
            each of two groups alone once a third has died, commits the step on its own, and
            both quorums' batches count as trained (the data of that step is delivered twice;
            the models differ until one heals from the other).
    """
    from torchft.coordination import LighthouseServer

    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"start_lighthouse({min_replicas=!r}): must be an integer >= 1")
    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=300, quorum_tick_ms=20,
        heartbeat_timeout_ms=1000,
    )  # fmt: skip


def local_manager(
    lighthouse: str,
    replica_id: str,
    load_state_dict: Callable[[Any], None],
    state_dict: Callable[[], Any],
    *,
    use_async_quorum: bool = True,
    timeout_s: float = 10.0,
) -> Any:
    """A replica group's ``torchft.Manager`` of one rank on gloo, with its own TCP store on
    localhost, joining the Lighthouse at ``lighthouse``; ``timeout_s`` (seconds) bounds its
    collectives and connections, and 3 x ``timeout_s`` its wait for a quorum. A quorum of
    ``min_replicas`` may have to wait for a group held up to ``timeout_s`` in a collective
    with a peer that died, plus the Lighthouse's heartbeat timeout: with a quorum wait no
    longer than the collectives', the waiting group's trainer ended (seen under load)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)  # the group's store serves as long as the process runs
    timeout = timedelta(seconds=timeout_s)
    quorum_timeout = timedelta(seconds=3 * timeout_s)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=use_async_quorum,
        timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout, rank=0,
        world_size=1, store_addr="localhost", store_port=store.port,
        lighthouse_addr=lighthouse, replica_id=replica_id, hostname="localhost",
    )  # fmt: skip


def read_step_log(path: str | Path) -> list[dict[str, Any]]:
    """A step log's records (none if the file does not exist; a line cut by a SIGKILL is
    left out)."""
    out = []
    p = Path(path)
    for line in p.read_text().splitlines() if p.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def committed_attempts(
    logs: Iterable[list[dict[str, Any]]], participants: str = "n"
) -> set[tuple[int, int]]:
    """The ``(step, participants)`` attempts that committed in some group, from every group's
    step log (``participants``: the attempt lines' key of the step's participant count)."""
    committed = set()
    for records in logs:
        attempt = None
        for r in records:
            if "rows" in r:
                attempt = (r["step"], r[participants])
            elif r.get("committed") and attempt is not None and attempt[0] == r["step"]:
                committed.add(attempt)
    return committed


def stop_job(procs: Mapping[str, subprocess.Popen], lighthouse: Any) -> None:
    """Kill the replica processes still running (and reap them), then stop the Lighthouse."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    lighthouse.shutdown()
