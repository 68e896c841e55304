"""A simulated torchft job in one process: replica groups as threads, each with a manager
that has ``torchft.Manager``'s interface (quorum, ``current_step``, fault-tolerant
``allreduce``, ``should_commit``, state-dict hooks and healing as torchft does them with a
synchronous quorum), so :class:`~torchdata_ext.torchft.ElasticLoader` runs as under torchft.

:class:`SimJob` runs steps: ``step(alive, fail=...)`` forms the quorum of the ``alive``
replica groups (one behind the most advanced heals from it, as torchft does), runs every
group's ``next(loader)`` in its own thread (the exchange's all-reduces meet), then commits the
step everywhere, or nowhere (``fail``: a participant died during it, or an error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Work:
    """A finished all-reduce (the simulated one is done when ``allreduce`` returns)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class SimManager:
    """One replica group's manager; the job (:class:`SimJob`) sets its quorum."""

    def __init__(self, job: SimJob, replica: int) -> None:
        self.job, self.replica = job, replica
        self._step = 0
        self._rank: int | None = None
        self._n = 0
        self._errored: Any = None
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        assert key not in self._fns
        self._fns[key] = (load, save)

    def num_participants(self) -> int:
        return self._n

    def participating_rank(self) -> int | None:
        return self._rank

    def is_participating(self) -> bool:
        return self._rank is not None

    def current_step(self) -> int:
        return self._step

    def errored(self) -> Any:
        return self._errored

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> _Work:
        if self._errored is not None:
            return _Work()
        self.job._allreduce(self, tensor)
        return _Work()


class SimJob:
    """Replica groups ``make(manager) -> loader`` in lock-step; see the module docstring."""

    def __init__(self, make: Callable[[SimManager], Any]) -> None:
        self.make = make
        self.managers: dict[int, SimManager] = {}
        self.loaders: dict[int, Any] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self.exchanged_bytes = 0

    def join(self) -> int:
        """A new replica group (it takes part from the next step, healing first)."""
        rid = self._next_id
        self._next_id += 1
        m = SimManager(self, rid)
        self.managers[rid] = m
        self.loaders[rid] = self.make(m)
        return rid

    def leave(self, rid: int) -> None:
        """Replica group ``rid`` is gone (killed): it never takes part again."""
        self.loaders.pop(rid).close()
        self.managers.pop(rid)

    def step(self, fail: str | None = None) -> tuple[bool, dict[int, Any]]:
        """One training step of every group: ``fail`` None (commits), ``"after"`` (a failure
        after the data exchange: nobody commits) or ``"during"`` (the collectives fail:
        nobody commits). Returns (committed, each group's ``next(loader)``; StopIteration
        for a finished epoch)."""
        ids = sorted(self.managers)
        top = max(self.managers[i]._step for i in ids)
        primary = next(i for i in ids if self.managers[i]._step == top)
        for rank, i in enumerate(ids):
            m = self.managers[i]
            m._rank, m._n, m._errored = rank, len(ids), None
            if m._step < top:  # heal from a peer at the top step, as torchft does
                peer = self.managers[primary]
                for key, (load, _) in m._fns.items():
                    load(peer._fns[key][1]())
                m._step = top
        if fail == "during":
            for i in ids:
                self.managers[i]._errored = RuntimeError("a peer died in the collective")
        self._round: dict[int, torch.Tensor] = {}
        self._barrier = threading.Barrier(len(ids))
        out: dict[int, Any] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                out[i] = next(self.loaders[i])
            except StopIteration as stop:
                out[i] = stop
            except BaseException as exc:  # noqa: BLE001 - reraised below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        commit = fail is None and all(self.managers[i]._errored is None for i in ids)
        if commit:
            for i in ids:
                self.managers[i]._step += 1
        return commit, out

    def _allreduce(self, m: SimManager, tensor: torch.Tensor) -> None:
        with self._lock:
            self._round[m.replica] = tensor.clone()
            self.exchanged_bytes += tensor.numel() * tensor.element_size()
        self._barrier.wait()
        total = sum(self._round.values())
        self._barrier.wait()
        with self._lock:
            self._round.pop(m.replica, None)
        tensor.copy_(total)
        self._barrier.wait()
