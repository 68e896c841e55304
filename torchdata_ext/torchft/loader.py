"""The data loader of one torchft replica group: :class:`ElasticLoader`.

Each step it follows the quorum the trainer started (``manager.start_quorum()``, or torchft's
``Optimizer.zero_grad()``): the step's participants ``n`` (``num_participants()``) and this
group's place among them (``participating_rank()``). The whole job's data state at the last
committed step (:class:`~torchdata_ext.torchft.job.JobState`: one loader state per
participant) is known to every participant without sending it every step: every
``exchange_every`` steps, after taking its batch, each participant sends its loader state to
all the others through torchft's fault-tolerant all-reduce
(:func:`~torchdata_ext.torchft.exchange.start_allgather`; a few kilobytes each); in between,
the job's state is the last exchanged one plus the committed steps since, and a share's state
is rebuilt when needed (a quorum change, a rolled-back step, a heal) by replaying its batches
since (deterministic). At the next step the loader sees whether the step committed
(``current_step()`` moved on):

* committed: the job's state is one step further (the exchanged states, if exchanged);
* not committed (``should_commit()`` was False): its batches count as not delivered; every
  participant goes on from the job's state before it, and those batches come again to
  whichever participant owns their data;
* a new quorum with another number of participants: the job's state is re-split into ``n``
  shares with the code a checkpoint restore at another world size runs
  (:mod:`torchdata_ext.checkpoint.rescale`), in this process, each participant computing its
  own share only.

A replica group that joins (or falls behind) heals from a live peer through torchft's
state-dict hooks: the job's data state travels with the model's
(``register_state_dict_fn``), so it starts on its share of the right step.

Guarantee: over an epoch, every token of every document is delivered exactly once in the
steps that commit, as long as no two quorums commit the same step: start the Lighthouse with
``min_replicas`` above half of the replica groups (with fewer, two groups can each train a
step alone, torchft's split brain, and both deliver its data). One data-loading rank per
replica group (a replica group's ``group_world_size`` of 1, the data ranks of torchft's
DDP/HSDP replica dimension).
"""

from __future__ import annotations

import json
import pickle
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.torchft.exchange import Gathering, start_allgather
from torchdata_ext.torchft.job import JobState, LoaderFactory, restore_share, share_state

__all__ = ["ElasticLoader", "ManagerLike", "share_of_global_batch"]

STATE_KEY = "torchdata_ext"
"""The key of the data state among the state dicts a healing replica receives."""


class ManagerLike(Protocol):
    """The part of ``torchft.Manager`` the loader uses (a test's simulated manager has it too)."""

    def num_participants(self) -> int: ...
    def participating_rank(self) -> int | None: ...
    def is_participating(self) -> bool: ...
    def current_step(self) -> int: ...
    def errored(self) -> Any: ...
    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = ..., reduce_op: Any = ...
    ) -> Any: ...
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


def share_of_global_batch(global_batches: int, participants: int, rank: int) -> int:
    """Micro-batches participant ``rank`` of ``participants`` takes of a global batch of
    ``global_batches`` micro-batches: ``global_batches // participants``, one more for the
    first ``global_batches % participants`` participants (so the shares add up to it)."""
    if not 0 <= rank < participants:
        raise ValueError(f"{rank=} must be in 0..{participants - 1}")
    return global_batches // participants + (1 if rank < global_batches % participants else 0)


@dataclass
class _Taken:
    """The batches of the last step: its step, this group's share (None: none taken), the
    job's shares, and what every participant sent after it, by participating rank (None: the
    exchange failed)."""

    step: int
    share: int | None
    shares: int
    per_step: tuple[int, ...]
    gathering: Gathering | None

    @property
    def gathered(self) -> list[bytes | None] | None:
        return None if self.gathering is None else self.gathering.result()


class ElasticLoader(Iterator[Any]):
    """The data of one torchft replica group; ``next()`` once per training step, after
    ``manager.start_quorum()`` and before the step's collectives.

    Args:
        manager: the replica group's ``torchft.Manager`` (anything with its interface).
        make_loader: ``(share, shares) -> TokenLoader`` at ``rank=share`` of
            ``world_size=shares`` (not iterating), the same pipeline on every replica group,
            e.g. ``lambda r, n: TokenLoader(partial(build_pipeline, cfg), rank=r,
            world_size=n, num_workers=2)``.
        global_batches: None (default): a constant batch per replica group: each step yields
            one batch of the loader (the global batch is that times the participants). An
            integer ``G``: a constant global batch of ``G`` loader batches (micro-batches): each
            step yields a list of this group's share of them (:func:`share_of_global_batch`:
            ``G // n``, or one more), to accumulate gradients over; when ``n`` does not divide
            ``G`` the shares differ by one, so weight each group's gradient by its tokens.
        state_key: the key of the data state among the manager's state dicts.
        exchange_every: the participants exchange their states after every
            ``exchange_every`` steps (torchft's steps ``k * exchange_every - 1``), the same on
            every replica group; the steps between cost nothing more than the loader's
            ``next()``, and a quorum change, a failed step or a heal replays at most
            ``exchange_every - 1`` steps of batches of the shares it needs. The end of the
            epoch is seen at an exchange: up to ``exchange_every - 1`` steps of None first.
        exchange_capacity: None (default): an exchange is two all-reduces, the
            states' lengths then ``participants x (16 + the longest)`` bytes (a state, pickled
            and compressed, is ~1-3 KB per loader worker). An integer: one all-reduce of
            ``participants x (16 + exchange_capacity)`` bytes, the same on every replica
            group (a larger state stops the loader with an error naming this argument).

    Yields (per step): the batch, or None when this group's share of the epoch is finished
    while others' are not (take no data this step); with ``global_batches`` a list of
    batches (possibly empty). Raises ``StopIteration`` after every share is finished.
    A batch taken in a step this group does not take part in (healing, a spare) is real
    data but not delivered: its gradient is zeroed by torchft, and the data comes again.
    """

    def __init__(
        self,
        manager: ManagerLike,
        make_loader: LoaderFactory,
        *,
        global_batches: int | None = None,
        state_key: str = STATE_KEY,
        exchange_every: int = 50,
        exchange_capacity: int | None = None,
    ) -> None:
        if global_batches is not None and (
            isinstance(global_batches, bool)
            or not isinstance(global_batches, int)
            or global_batches < 1
        ):
            raise ValueError(f"{global_batches=} must be an integer >= 1, or None")
        if exchange_capacity is not None and (
            isinstance(exchange_capacity, bool)
            or not isinstance(exchange_capacity, int)
            or exchange_capacity < 1
        ):
            raise ValueError(f"{exchange_capacity=} must be an integer >= 1, or None")
        if isinstance(exchange_every, bool) or not isinstance(exchange_every, int):
            raise ValueError(f"{exchange_every=} must be an integer >= 1")
        if exchange_every < 1:
            raise ValueError(f"{exchange_every=} must be an integer >= 1")
        self.exchange_capacity = exchange_capacity
        self.exchange_every = exchange_every
        self.exchanges = 0  # exchanges of the states this group took part in
        self.manager = manager
        self.make_loader = make_loader
        self.global_batches = global_batches
        self._lock = threading.Lock()
        self._job = JobState(0, (None,))  # a fresh run, one share: re-split at the first quorum
        self._taken: _Taken | None = None
        self._healed: JobState | None = None
        self._loader: TokenLoader | None = None
        self._it: Iterator[Any] | None = None
        self._at: tuple[int, int, int] | None = None  # (share, shares, step) the loader is at
        self._finished = False  # every share ended in the last committed step
        self.resplits = 0  # re-splits made (quorum changes of the participant count)
        self._changes: list[tuple[int, dict[str, float]]] = []  # set_weights calls
        manager.register_state_dict_fn(state_key, self.load_state_dict, self.state_dict)

    # -- the step --------------------------------------------------------------------------------
    def __iter__(self) -> ElasticLoader:
        return self

    def __next__(self) -> Any:
        m = self.manager
        n = m.num_participants()  # waits for the quorum
        share = m.participating_rank()
        taking = share is not None and m.is_participating()
        step = m.current_step()
        if n < 1:
            raise RuntimeError("the torchft quorum has no participants; call start_quorum() first")
        self._settle(step, check=taking)
        if self._finished:
            raise StopIteration
        # the job's shares: one per participant (with a global batch of G micro-batches,
        # at most G: participants past the G-th take none)
        shares = n if self.global_batches is None else min(n, self.global_batches)
        if self._job.shares != shares:
            self._job = self._job.resplit(shares)
            self.resplits += 1
        per_step = tuple(
            1
            if self.global_batches is None
            else share_of_global_batch(self.global_batches, shares, i)
            for i in range(shares)
        )
        # step 0 too: under torchft's asynchronous quorum with init_sync, every group but the
        # primary heals in step 0 while ranked (the others cannot tell it takes no batch)
        due = step == 0 or (step + 1) % self.exchange_every == 0
        mine_share = share if taking and share is not None and share < shares else None
        if share is not None and share < shares and not taking and not due:
            raise RuntimeError(
                f"replica group ranked {share} of {n} does not take part in step {step} "
                "(healing at the quorum's step): its share would be counted as read; "
                "ElasticLoader expects this only in step 0 (torchft's init_sync)"
            )
        mine: bytes | None = None
        if mine_share is not None:
            items, done = self._take(mine_share, shares, step, per_step[mine_share])
            assert self._loader is not None
            if due:
                mine = _packed({"state": self._loader.state_dict(), "done": done})
        elif taking:  # a participant past the global batch's micro-batches
            items = []
        else:  # healing or a spare: real batches of the right shape, not delivered
            items = self._throwaway(share or 0, 1)
        gathering = None
        if due:
            gathering = start_allgather(m, mine, mine_share, n, self.exchange_capacity)
            gathering.result()  # waited for in its step (a failure is this step's)
            self.exchanges += 1
        self._taken = _Taken(step, mine_share, shares, per_step, gathering)
        if self.global_batches is None:
            return items[0] if items else None
        return items

    def _take(self, share: int, shares: int, step: int, count: int) -> tuple[list[Any], bool]:
        """``count`` batches of this group's share, from the job's state at ``step``."""
        if self._at != (share, shares, step) or self._it is None:
            self._close()
            self._loader = self._restored(share)
            self._it = iter(self._loader)
        items = []
        done = False
        for _ in range(count):
            try:
                items.append(next(self._it))
            except StopIteration:
                done = True
                break
        self._at = (share, shares, step + 1)
        return items, done

    def _restored(self, share: int) -> TokenLoader:
        """Share ``share``'s loader at the job's state, with the trainer's weight changes the
        state was taken before (they take effect at later steps)."""
        return restore_share(self._job, share, self.make_loader, self._reapply)

    def _share_state(self, job: JobState, share: int) -> dict[str, Any] | None:
        """Share ``share``'s state in ``job`` (None: a fresh share)."""
        if not job.replay and job.base is None:
            return job.states[share]
        return share_state(job, share, self.make_loader, self._reapply)

    def _reapply(self, loader: TokenLoader) -> None:
        """The trainer's weight changes a restored state was taken before."""
        known = {int(p[0]) for p in loader.weight_points() if p[2] == "trainer"}
        for step, weights in self._changes:
            if step not in known:
                loader.set_weights(weights, from_step=step)

    def set_weights(self, weights: dict[str, float], from_step: int | None = None) -> int:
        """Change the datasets' weights from batch ``from_step`` on (counted from 1 as the
        loader's ``step``: with one batch per step, torchft's committed steps + 1; default:
        the next step's), on every share, through every quorum change: call it on every
        replica group at the same point of the loop (e.g. weights from an all-reduced loss),
        between steps. See :meth:`TokenLoader.set_weights`.

        Raises:
            ValueError: ``from_step`` before the next step, or what ``TokenLoader.set_weights``
                refuses.
        """
        step = self.manager.current_step() + 1 if from_step is None else int(from_step)
        if step <= self._job.step:
            raise ValueError(
                f"set_weights(from_step={from_step!r}): the job has committed {self._job.step} "
                f"steps; the earliest step a change can take effect is {self._job.step + 1}"
            )
        live = self._loader is not None and self._at is not None
        if live and self._at is not None and self._at[2] == self.manager.current_step():
            assert self._loader is not None
            self._loader.set_weights(weights, from_step=step)
        self._changes.append((step, dict(weights)))
        return step

    def _throwaway(self, share: int, count: int) -> list[Any]:
        self._close()
        loader = self._restored(min(share, self._job.shares - 1))
        try:
            it = iter(loader)
            return [x for _, x in zip(range(count), it)]
        finally:
            loader.close()

    def _settle(self, step: int, check: bool) -> None:
        """Take in the outcome of the last step: committed (the states exchanged after it are
        the job's), not committed (roll back), or healed (the job's state came with the
        model's)."""
        with self._lock:
            taken, self._taken = self._taken, None
            if self._healed is not None:
                self._job, self._healed = self._healed, None
                self._close()
            job, outcome = _advanced(self._job, taken, step, self._share_state)
            self._job = job
            if outcome == "rolled back":  # the last step did not commit: not delivered
                self._close()
            elif outcome == "committed":
                assert taken is not None
                gathered = taken.gathered
                self._finished = gathered is not None and all(
                    b is not None and _unpacked(b)["done"] for b in gathered[: taken.shares]
                )
                if taken.share is None:  # its batches were not this group's to deliver
                    self._close()
        if check and self._job.step != step:
            raise RuntimeError(
                f"the data state is at step {self._job.step} and the torchft manager at step "
                f"{step}: a replica group that skips steps must heal (torchft does it when "
                "it is behind) or load the loader's state_dict() of its step"
            )

    def _close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        self._loader, self._it, self._at = None, None, None

    def close(self) -> None:
        """Stop this group's loader (its worker processes)."""
        self._close()

    # -- state: what a healing replica group receives, and a checkpoint ----------------------------
    def job_state(self) -> JobState:
        """The job's data state at the last committed step this group knows."""
        with self._lock:
            job = self._healed if self._healed is not None else self._job
            return _advanced(job, self._taken, self.manager.current_step(), self._share_state)[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole job's data state at the last committed step, ``{"job": uint8 tensor}``:
        what torchft sends a healing replica group with the model (and what a checkpoint
        may store: it restores at any number of participants), and the trainer's
        :meth:`set_weights` calls, ``{"job", "weight_changes"}`` (uint8 tensors)."""
        data = self.job_state().to_bytes()
        changes = json.dumps(self._changes).encode()
        return {
            "job": torch.frombuffer(bytearray(data), dtype=torch.uint8),
            "weight_changes": torch.frombuffer(bytearray(changes), dtype=torch.uint8),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the job's data state of :meth:`state_dict` (from a healthy peer, or a
        checkpoint); the next step goes on from it."""
        job = JobState.from_bytes(state["job"].numpy().tobytes())
        changes = json.loads(state["weight_changes"].numpy().tobytes())
        with self._lock:
            self._healed = job
            self._changes = [(int(step), dict(weights)) for step, weights in changes]


def _packed(message: dict[str, Any]) -> bytes:
    """A participant's message in the exchange: pickled, then zlib (level 1: ~3x smaller)."""
    return zlib.compress(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), 1)


def _unpacked(data: bytes) -> dict[str, Any]:
    message: dict[str, Any] = pickle.loads(zlib.decompress(data))
    return message


def _advanced(
    job: JobState,
    taken: _Taken | None,
    step: int,
    share_state: Callable[[JobState, int], dict[str, Any] | None],
) -> tuple[JobState, str]:
    """The job's state now that the manager is at ``step``, after the step ``taken`` from
    ``job``: if it committed, ``"committed"``, the states the participants exchanged after it
    (when exchanged; a share that sent none, its group taking no batch, at ``job``'s state:
    ``share_state(job, i)``), else ``job`` one step further (its batches
    replayed when a share's state is needed); ``job`` if it did not, ``"rolled back"``;
    ``job`` if no step of it was taken since, ``""``."""
    if taken is None or taken.step != job.step or step not in (taken.step, taken.step + 1):
        return job, ""
    if step == taken.step:
        return job, "rolled back"
    if taken.shares != job.shares:  # a state healed from a peer before it re-split
        job = job.resplit(taken.shares)
    if taken.gathering is None:
        return job.advanced(taken.per_step), "committed"
    gathered = taken.gathered
    if gathered is None:
        raise RuntimeError(
            f"step {taken.step} committed although the data states were not exchanged in it; "
            "call next(loader) before the step's collectives, once per step"
        )
    states = tuple(
        _unpacked(b)["state"] if b is not None else share_state(job, i)
        for i, b in enumerate(gathered[: taken.shares])
    )
    return JobState(step, states), "committed"
