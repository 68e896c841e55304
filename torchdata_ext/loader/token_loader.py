"""Run a node graph in dataloader workers (or a background thread) with a state at every step.

:class:`PipelineDataset` is an ``IterableDataset`` that builds the node graph inside each
``StatefulDataLoader`` worker for that worker's :class:`~torchdata_ext.world.World`. Its
iterator sends messages of up to ``batches_per_message`` batches, each batch with what changed
in the graph's state since the previous one (:mod:`torchdata_ext.state.delta`).

:class:`TokenLoader` is what a training loop iterates. It applies each worker's state deltas
as the batches arrive, so its ``state_dict()`` is exact at every step and costs nothing to
take; ``load_state_dict`` restores it on the same topology, continuing with exactly the
batches the uninterrupted run would have produced. Restoring onto another number of ranks or
workers goes through :func:`torchdata_ext.checkpoint.folder.load_checkpoint` (planned by
:func:`torchdata_ext.checkpoint.rescale.rescale_worker_states`).

Why deltas and groups: a worker's whole state is ~1 MB with a 10,000-sequence shuffle buffer
over 3 x 1,024 shards, and a dataloader message costs ~1 ms of shared-memory and
file-descriptor work; sending the state and one message per batch made the worker path no
faster than the loader this product replaces. A delta is a few kilobytes; a message carries
several batches (one token tensor, see :class:`~torchdata_ext.batch.BatchGroup`).

This module is 1,100 lines: the worker side (the messages and their iterator) and the loader side
(applying the deltas, the state, the run's step, its skipped step ranges and the trainer's weight
changes, :mod:`torchdata_ext.loader.weights`) are the two ends of one message format.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import logging
import math
import numbers
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.nodes import BaseNode

from torchdata_ext.batch import BatchGroup, PackedBatch
from torchdata_ext.loader.background import Background as _Background
from torchdata_ext.loader.mix_history import DELIVERED_KEY, MixHistory
from torchdata_ext.loader.orphan import exit_with_parent
from torchdata_ext.loader.preflight import (
    check_before_workers,
    check_build,
    worker_start_message,
)
from torchdata_ext.loader.ring import TokenRing
from torchdata_ext.loader.running import Running
from torchdata_ext.loader.skip_epochs import stamp_epochs
from torchdata_ext.loader.weights import (
    ScheduleRecord,
    WeightChanges,
    check_ranks_agree,
    check_weights,
    is_pipeline_config,
)
from torchdata_ext.pipeline.build import indexes_to_share, with_indexes
from torchdata_ext.progress import Progress
from torchdata_ext.state.delta import apply, diff
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.tokenizers.load import limit_tokenizer_threads
from torchdata_ext.world import World

__all__ = ["STATE_FORMAT", "PipelineDataset", "TokenLoader"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
BuildFn = Callable[[World], BaseNode]

MESSAGE_TOKENS = 1 << 19
"""Tokens a worker's message carries when ``batches_per_message`` is not given: a message has
a fixed cost in both processes (the dataloader's index and result queues, pickling, a thread
woken on each side), which this many tokens make small. Through 2 workers of the issue-33
benchmark (batches of 8 x 4,097 tokens), 16 batches a message (this) took ~13% less of the
training process's CPU than 8 and delivered ~3% more tokens per second (docs/benchmarks.md).
A batch of this many tokens or more travels alone, so large batches keep the shared-memory
ring small."""

MAX_BATCHES_PER_MESSAGE = 32  # the most batches of a message sized by MESSAGE_TOKENS


def batches_for_message(batch: Any) -> int:
    """How many batches like ``batch`` a message holds by default: enough for
    :data:`MESSAGE_TOKENS` tokens, from 1 to :data:`MAX_BATCHES_PER_MESSAGE`; 8 for a batch
    whose tokens it cannot count (neither a ``tokens`` tensor nor an ``input_ids`` key)."""
    tokens = getattr(batch, "tokens", None)
    if tokens is None and isinstance(batch, Mapping):
        tokens = batch.get("input_ids")
    shape = getattr(tokens, "shape", None)
    if shape is None:
        return 8
    n = int(math.prod(shape))
    return max(1, min(MAX_BATCHES_PER_MESSAGE, -(-MESSAGE_TOKENS // max(n, 1))))


class _Message(NamedTuple):
    """What a worker sends: up to ``G`` batches and, per batch, its graph state after it
    (``delta``: a :func:`~torchdata_ext.state.delta.diff` against the previous one; else the
    state itself), and the worker's I/O counters."""

    worker: int
    items: Any  # a BatchGroup, or a list of items
    states: list[Any]
    delta: bool
    io: dict[str, float]
    ended: bool  # the worker's stream ended after these items
    ring: TokenRing | None = None  # the worker's token slots, in the first message using one


class _PipelineIterator(Iterator[_Message]):
    """One worker's graph, yielding :class:`_Message` s of up to ``group`` batches (the last
    one flagged ``ended``)."""

    def __init__(
        self,
        build: BuildFn,
        world: World,
        initial: dict[str, Any] | None,
        *,
        group: int | None = 1,
        delta: bool = True,
        ring_slots: int = 0,
    ) -> None:
        self.world = world
        self.root = build(world)
        self._initial = initial
        self._started = False
        self._group = group  # None: sized by the first batch (batches_for_message)
        self._ended = False
        self._delta = delta
        self._sent: Any = None  # the graph state sent with the last batch
        self._counted: list[Any] | None = None  # the nodes with io_stats (the graph is fixed)
        self._ring_slots = ring_slots  # 0: tokens travel in the messages
        self._ring: TokenRing | None = None
        self._ring_sent = False
        self._ring_due = False  # the ring is made for the second message on (see _grouped)
        # a worker ships batches in their compact form; in this process they are made whole
        wire = getattr(self.root, "next_packed_batch", None) if delta else None
        self._wire: Callable[..., Any] = wire if callable(wire) else self.root.__next__
        # Collate writes a batch's tokens straight into the ring slot its message will use
        self._into_slot = callable(wire) and "out" in inspect.signature(wire).parameters

    def _start(self) -> None:
        if not self._started:
            self._io_nodes()  # found before a restore fills the buffers (see io_stats)
            self.root.reset(self._initial)
            # the receiver starts from the same state (_produce), so the first
            # delta after a restore is what changed since it: a few blocks of a restored
            # shuffle buffer, not the whole buffer
            self._sent = self._initial
            self._initial = None
            self._started = True

    def __iter__(self) -> _PipelineIterator:
        return self

    def __next__(self) -> _Message:
        if self._ended:
            raise StopIteration
        # the first message holds one batch: the first batch (fresh or after a restore) does
        # not wait for the group's others
        group = self._group if self._started and self._group is not None else 1
        self._start()
        items: list[Any] = []
        states: list[Any] = []
        slot = None  # the ring slot claimed before the batches are made (written in place)
        if self._into_slot and self._ring is not None and group == self._group:
            slot = self._ring.claim()
        rows = None if slot is None else self._ring.view(slot, group)  # type: ignore[union-attr]
        try:
            while len(items) < group:
                try:
                    item = self._wire() if rows is None else self._wire(out=rows[len(items)])
                except StopIteration:
                    self._ended = True
                    break
                graph = self.root.state_dict()
                states.append(diff(self._sent, graph) if self._delta else graph)
                self._sent = graph
                items.append(item)
        except BaseException:  # an error in the graph: the slot goes back, unsent
            if slot is not None:
                self._give_back(slot, items)
            raise
        if self._group is None and items:
            self._group = batches_for_message(items[0])
        ring = None
        grouped: BatchGroup | list[Any] = items
        if self._delta and BatchGroup.can_group(items):
            grouped, ring = self._grouped(items, slot)
        elif slot is not None:  # no group after all (e.g. a short last batch): nothing sent
            self._give_back(slot, items)
        return _Message(
            self.world.worker_id, grouped, states, self._delta, self.io_stats(), self._ended, ring
        )

    def _give_back(self, slot: int, items: list[Any]) -> None:
        """Return the unused ring ``slot``, the tokens written into it copied out first (the
        slot is written again by the next message)."""
        assert self._ring is not None
        rows = self._ring.view(slot, self._ring.data.shape[1])
        for i, item in enumerate(items):
            if isinstance(item, PackedBatch) and item.tokens.data_ptr() == rows[i].data_ptr():
                item.tokens = item.tokens.clone()
        self._ring.unclaim()

    def _grouped(
        self, items: list[PackedBatch], slot: int | None = None
    ) -> tuple[BatchGroup, TokenRing | None]:
        """The batches as one group, their tokens in a ring slot (``slot`` if one was claimed
        for them, which Collate wrote them into; else the next free one) if there is one; and
        the ring, if this is the first message that uses it."""
        shape, dtype = (len(items), *items[0].tokens.shape), items[0].tokens.dtype
        if slot is not None:
            assert self._ring is not None
            if not self._ring.fits(shape, dtype):
                self._give_back(slot, items)
                return BatchGroup.of(items), None
        if self._ring is None and self._ring_slots and self._ring_due:
            assert self._group is not None  # sized by the first message, which has no ring
            self._ring = TokenRing.make((self._group, *shape[1:]), dtype, self._ring_slots)
            if self._ring is None:  # shared memory is short: tokens go in the messages
                self._ring_slots = 0
        # the first message (one batch) carries its tokens: making the ring and sending its
        # handle would hold up the first batch by ~10 ms
        self._ring_due = True
        ring = self._ring
        if slot is None:
            slot = ring.claim() if ring is not None and ring.fits(shape, dtype) else None
        if ring is None or slot is None:
            return BatchGroup.of(items), None
        group = BatchGroup.of(items, ring.view(slot, len(items)), slot)
        if self._ring_sent:
            return group, None
        self._ring_sent = True
        return group, ring

    def _io_nodes(self) -> list[Any]:
        """The graph's nodes with I/O counters, found once: walking the graph visits every
        item a buffer holds (10,000 rows restored into a shuffle buffer), so it is done
        before the graph is reset."""
        if self._counted is None:
            self._counted = [
                n for n in graph_nodes(self.root) if callable(getattr(n, "io_stats", None))
            ]
        return self._counted

    def io_stats(self) -> dict[str, float]:
        """The I/O counters of every reader in this worker's graph, summed."""
        out: dict[str, float] = {}
        for node in self._io_nodes():
            for k, v in node.io_stats().items():
                if isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out


def unpack_worker_state(state: dict[str, Any]) -> dict[str, Any]:
    """A worker state with its graph state unpickled, for states written when workers sent
    it pickled (``graph_pickle``); any other state is returned as it is."""
    if "graph_pickle" not in state:  # no release wrote it; tests/test_loader.py does
        return state
    out = {k: v for k, v in state.items() if k != "graph_pickle"}
    out["graph"] = pickle.loads(state["graph_pickle"])
    return out


class PipelineDataset(IterableDataset):
    """An ``IterableDataset`` that builds a node graph per dataloader worker.

    Each item it yields is a message of up to ``batches_per_message`` batches with the graph's
    state after each (see :class:`TokenLoader`, which unpacks them).

    Args:
        build: function from a :class:`World` to the root node of the graph (e.g.
            ``lambda world: build_pipeline(cfg, world)``); called inside each worker, so it must
            be picklable (a module-level function or a ``functools.partial``).
        rank: this process's rank; default: ``torch.distributed`` when initialised, else 0.
        world_size: the number of ranks; default: ``torch.distributed``, else 1.
        initial_states: per logical worker id, the graph state to start from.
        worker_offset: logical worker id of physical worker 0 (used to keep the round-robin
            order of batches across a restore; logical = (physical + offset) % num_workers).
        batches_per_message: batches a worker sends together (None: as many as make
            :data:`MESSAGE_TOKENS` tokens, :func:`batches_for_message`); the first message of
            an iterator holds one batch.
        ring_slots: in a dataloader worker, how many messages' tokens can be in a shared-memory
            :class:`~torchdata_ext.loader.ring.TokenRing` at once instead of in the messages (at
            least the messages in flight, the dataloader's ``prefetch_factor``, plus 2); 0:
            always in the messages.
    """

    def __init__(
        self,
        build: BuildFn,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        initial_states: dict[int, dict[str, Any]] | None = None,
        worker_offset: int = 0,
        batches_per_message: int | None = 1,
        ring_slots: int = 0,
    ) -> None:
        super().__init__()
        self.build = build
        self.rank = rank
        self.world_size = world_size
        self.initial_states = dict(initial_states or {})
        self.worker_offset = int(worker_offset)
        self.batches_per_message = None if batches_per_message is None else int(batches_per_message)
        self.ring_slots = int(ring_slots)
        self.trainer_pid = os.getpid()  # the training process, whose death ends the workers

    def world_for(self, physical_worker: int, num_workers: int) -> World:
        base = World.detect(self.rank, self.world_size)
        logical = (physical_worker + self.worker_offset) % num_workers
        return World(base.rank, base.world_size, logical, num_workers)

    def __iter__(self) -> _PipelineIterator:
        info = get_worker_info()
        physical, n = (0, 1) if info is None else (info.id, info.num_workers)
        if info is not None:  # this worker's share of the cores for its tokenizers
            limit_tokenizer_threads(n)
            exit_with_parent(
                self.trainer_pid
            )  # a killed trainer leaves no worker behind (orphan.py)
        world = self.world_for(physical, n)
        return _PipelineIterator(
            self.build,
            world,
            self.initial_states.get(world.worker_id),
            group=self.batches_per_message,
            delta=info is not None,
            ring_slots=self.ring_slots if info is not None else 0,
        )


class TokenLoader:
    """The loader a training loop iterates: a node graph per worker, ready batches out, and a
    state that can be taken at any step for almost nothing.

    Args:
        build: function from a :class:`World` to the graph's root node (picklable).
        num_workers: ``StatefulDataLoader`` worker processes; 0 runs the graph in this
            process (in the background thread, see ``background``). None (default): the
            config's ``num_workers`` when ``build`` was given a config
            (``functools.partial(build_pipeline, cfg)``) that sets it, else 0; a number
            given here wins over the config's.
        rank / world_size: override ``torch.distributed`` (default: detected).
        snapshot_every_n_steps: 1 (default): ``state_dict()`` is exact at every step. ``n > 1``:
            it is the state of the last multiple of ``n`` steps plus the number of batches
            since (``skip_batches``, made again and dropped on restore; such a state does not
            rescale). Kept for compatibility: the exact state costs as little.
        batches_per_message: batches a worker process sends in one message. Default (None):
            as many as make :data:`MESSAGE_TOKENS` (524,288) tokens, 1 to 32 (16 batches of
            8 x 4,097 tokens), :func:`batches_for_message`. A message has a fixed cost in
            both processes (the dataloader's queues, pickling, a woken thread on each side),
            spread over its tokens: 8 took 10-15% less CPU per token than 4 through 2 workers,
            16 ~13% less of the training process's than 8 (docs/benchmarks.md); a message's
            tokens sit in a shared-memory slot (``shared_tokens``), ``prefetch_factor + 2``
            slots per worker.
            Batches are still delivered one worker after the other, as with one batch per
            message, and the first message of a start holds one batch.
        prefetch_factor: messages each worker prepares ahead (default 2), or with
            ``num_workers=0`` messages the graph prepares ahead (default 4).
        pin_memory: pin batch tensors (for fast host-to-GPU copies).
        multiprocessing_context: e.g. ``"spawn"`` or ``"forkserver"``. Default: torch's,
            except in a process whose start method is ``spawn`` (one started by
            ``torch.multiprocessing.spawn``), where it is ``"forkserver"`` with this package
            preloaded (:func:`default_worker_context`).
        persistent_workers: keep workers alive between iterations.
        background: a background thread of this process (default) takes the workers' messages
            (or runs the graph, with ``num_workers=0``), applies the state deltas and builds the
            batch keys, so the training thread only takes finished batches; False does that
            work in ``next()``.
        shared_tokens: worker processes write each message's tokens into slots of shared
            memory that this process copies them out of (default), instead of sending them
            through the dataloader's pipe in the message; see :mod:`torchdata_ext.loader.ring`.

    With worker processes a worker sends with each batch only what changed in its graph's
    state (:mod:`torchdata_ext.state.delta`: a few kilobytes), and this process keeps every
    worker's state current by applying it; ``state_dict()`` hands that state out without
    copying. Batches from a ``Collate`` cross as one token tensor plus document runs
    (:class:`~torchdata_ext.batch.PackedBatch`) and their other keys are built here.

    ``iter(loader)`` starts (or, after ``load_state_dict``, resumes) the stream;
    ``state_dict()`` may be called at any step.
    """

    def __init__(
        self,
        build: BuildFn,
        *,
        num_workers: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        snapshot_every_n_steps: int = 1,
        batches_per_message: int | None = None,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        persistent_workers: bool = False,
        background: bool = True,
        shared_tokens: bool = True,
    ) -> None:
        check_build(build)
        self.build = build
        if num_workers is None:  # the config's, where the build function was given one
            cfg = self.built_config()
            num_workers = getattr(cfg, "num_workers", None) or 0
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"{num_workers=} must be an integer >= 0")
        for name, value, extra in (
            ("snapshot_every_n_steps", snapshot_every_n_steps, ""),
            ("batches_per_message", batches_per_message, ", or None (sized by its tokens)"),
        ):
            if value is None and extra:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1{extra}")
        self.num_workers = num_workers
        base = World.detect(rank, world_size)
        self.rank, self.world_size = base.rank, base.world_size
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.batches_per_message = batches_per_message
        self.pin_memory = pin_memory
        self.background = background
        self.shared_tokens = bool(shared_tokens)
        self.prefetch = prefetch_factor or (2 if num_workers else 4)
        self._dl_kwargs: dict[str, Any] = dict(
            num_workers=num_workers,
            snapshot_every_n_steps=0,  # states travel with the batches (see _Message)
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
        )
        if num_workers > 0:
            self._dl_kwargs["prefetch_factor"] = self.prefetch
            context = multiprocessing_context or default_worker_context()
            if context is not None:
                self._dl_kwargs["multiprocessing_context"] = context
        self._initial: dict[int, dict[str, Any]] = {}
        self._offset = 0
        self._skip = 0  # batches to drop after a restore (see state_dict)
        self._step0 = 0  # the run's step when the state was loaded (see state_dict)
        self._skip_steps: list[list[int]] = []  # step ranges whose data is skipped
        self._loaded = False  # a state was loaded (else a fresh run reads skip_steps itself)
        self._skipped0: list[list[Any]] = []  # documents skipped before the state was loaded
        self._mix = MixHistory()  # tokens per dataset at each weight change (mix_history.py)
        self._names: list[str] = []  # the dataset names provenance ids index (skipped rows)
        self._it: Any = None
        self._checked = False  # the config was checked here before starting workers
        # the thread and the dataloader iterator (its workers) this loader runs, stopped
        # when it is freed, even by the cyclic collector (see running.py)
        self._running = Running()
        self._running.stop_when_freed(self)
        self._weights = WeightChanges(original=build)  # the trainer's set_weights calls
        cfg = self.built_config()  # a weight_schedule's entries are changes the loader makes
        self._schedule = (
            ScheduleRecord() if cfg is None else ScheduleRecord.of_config(cfg, self.world_size)
        )
        self._weights.scheduled = self._schedule.changes()
        self._restarted = 0  # the step whose weight change the running workers were built with
        self._reset_live()

    def _reset_live(self) -> None:
        """Per logical worker: the graph state after its last delivered batch (absent: a fresh
        worker not heard from yet) and its I/O counters."""
        self._states: dict[int, Any] = dict(self._initial)
        self._io: dict[int, dict[str, float]] = {}
        self._next = self._offset
        self._yielded = 0
        self._step = self._step0  # batches the training loop received in the whole run
        self._skipped = list(self._skipped0)
        self._skip_pending: dict[int, list[list[Any]]] = {}  # this range's, by worker
        self._dropping = 0  # batches of a skipped step range still to drop
        self._applied = 0  # the first step of the skipped range dropped last
        self._skip_progress: Progress | None = None  # the range being dropped, reported
        self._snap = self._live_snapshot()

    @property
    def logical_workers(self) -> int:
        """Graph copies per rank (``num_workers``, or 1 when loading in this process)."""
        return max(1, self.num_workers)

    def _dataset(self) -> PipelineDataset:
        return PipelineDataset(
            self.build,
            rank=self.rank,
            world_size=self.world_size,
            initial_states=self._initial,
            worker_offset=self._offset,
            batches_per_message=self.batches_per_message,
            ring_slots=self.prefetch + 2 if self.shared_tokens and self.num_workers else 0,
        )

    def __iter__(self) -> Iterator[Any]:
        if self._it is not None:
            self.close()
        if not self._loaded:
            self._configured_skip_steps()
        self._reset_live()
        self.build = self._weights.build_for(self._step + 1)
        self._restarted = self._step + 1
        self._record_mix()
        return self._deliver(self._start())

    def _start(self) -> Iterator[_Delivery]:
        """Start the workers (or the background thread) from the loaded state."""
        # the index files read once here, not in every worker, nor again by a save's graph;
        # as this rank's worker 0 (its rank, not RANK's: rank 0 alone lists to check them)
        shared = indexes_to_share(self.build, World(self.rank, self.world_size))
        if shared:
            self.replace_build(lambda build: with_indexes(build, shared))
        if self.num_workers > 0:
            from torchdata.stateful_dataloader import StatefulDataLoader

            if not self._checked:  # once: a restart for new weights builds the same config
                check_before_workers(
                    self.build, World(self.rank, self.world_size, 0, self.logical_workers)
                )
                self._checked = True
            import_worker_modules()  # once here, not in every worker after the fork
            # collate_fn: messages as they are (the default converts every NumPy array in the
            # state deltas to a tensor, each then sent as its own shared-memory segment)
            with _torchdata_noise_filtered():
                self._dl = StatefulDataLoader(
                    self._dataset(), batch_size=None, collate_fn=_as_is, **self._dl_kwargs
                )
                try:
                    messages: Iterator[_Message] = iter(self._dl)
                except OSError as e:  # a fork server's socket path that does not fit
                    message = worker_start_message(e)
                    if message is None:
                        raise
                    raise OSError(message) from e
            self._running.workers = messages
        else:
            messages = iter(self._dataset())
        # a function of its inputs, not a method: the background thread holds it, and a
        # loader dropped without close() must not be kept alive by its own thread (nor its
        # workers): self._running stops both when the loader is freed (running.py)
        produced = _produce(
            messages, self.logical_workers, self._initial, self._offset, self.pin_memory,
            self.num_workers > 0,
        )  # fmt: skip
        if self.background:  # the training thread only takes finished batches
            # batches ahead: the messages prepared ahead; when sized by tokens, 8 batches a
            # message as before (a larger message's rest waits in _produce for room)
            produced = _Background(produced, self.prefetch * (self.batches_per_message or 8))
        self._it = produced
        self._running.thread = produced if isinstance(produced, _Background) else None
        return produced

    def _restart(self) -> Iterator[_Delivery]:
        """Restart the stream from the exact state now, built with the weights in force at
        the next step (a :meth:`set_weights` change due there)."""
        state = self.state_dict()
        self.close()
        self.load_state_dict(state)  # builds with the weights in force (weight_changes)
        self._restarted = self._step + 1
        self._record_mix()
        return self._start()

    def _record_mix(self) -> None:
        """At a weight change due at the next step, record the tokens per dataset delivered
        through this one (:mod:`~torchdata_ext.loader.mix_history`); not when the loaded
        state is behind the step (``skip_batches``: the counts would be of an earlier step)."""
        if not self._weights.due_at(self._step + 1):
            return
        if self._skip:  # the totals through this step are not known: nor what came before
            self._mix.since = max(self._mix.since, self._step + 1)
            return
        fresh: dict[str, Any] = {DELIVERED_KEY: {}}  # a worker not started: delivered nothing
        graphs = [self._initial.get(w, fresh) for w in range(self.logical_workers)]
        self._mix.record(self._step + 1, graphs)

    def adopt_mix_history(self, history: MixHistory) -> None:
        """Go on with ``history`` (a restore sets it after :meth:`load_worker_states`: the
        saved one on the same topology, :meth:`MixHistory.rescaled` at a rescale)."""
        self._mix = history

    def weight_points(self) -> list[list[Any]]:
        """Every weight change of the run in step order, ``[step, {name: weight}, source]``
        with ``source`` ``"schedule"`` (the config's ``weight_schedule``, token points at the
        steps this run's global batch puts them, ramps as their stairs) or ``"trainer"``
        (:meth:`set_weights`); at one step the trainer's applies. Before the first: the
        config's ``weights``."""
        return self._weights.points()

    def earliest_weight_step(self) -> int:
        """The earliest step :meth:`set_weights` can change the mix from: the next batch the
        training loop takes (the loader restarts its workers from its exact state there)."""
        return self._step + 1

    def set_weights(self, weights: Mapping[str, float], from_step: int | None = None) -> int:
        """Change the datasets' weights from batch ``from_step`` on (the run's step, counted
        from 1 as :meth:`state_dict`'s ``step``; default: the next batch).

        The batches from ``from_step`` on come from the pipeline's state after step
        ``from_step - 1`` built with the new weights: the loader restarts its workers from its
        exact state there. The change is recorded in the loader state and checkpoints, so a
        restore or rescale from any checkpoint of the run, and ``show_batches``, replay it.
        Rows the pipeline holds already (its shuffle buffer) were mixed before: the delivered
        share moves to the new weights over about ``shuffle_buffer / batch_size`` steps of
        each worker (see :mod:`torchdata_ext.loader.weights`). Under ``torchrun`` every rank
        must make the same call at the same point of its loop (e.g. weights from an all-reduced
        loss): with ``torch.distributed`` initialised the call gathers every rank's
        ``(from_step, weights)`` and refuses them on every rank if they differ
        (:func:`~torchdata_ext.loader.weights.check_ranks_agree`); a restore refuses a
        checkpoint whose ranks recorded different changes.

        Args:
            weights: dataset name -> weight (> 0, relative, in tokens as the config's).
            from_step: the first batch under the new weights, >= :meth:`earliest_weight_step`.

        Returns:
            the step the change takes effect at.

        Raises:
            TypeError: the loader was not built from ``functools.partial(build_pipeline, cfg)``.
            ValueError: ``from_step`` before the earliest step (named), a bad weight, a config
                with phases or ``pack_mode="best_fit"``, ``snapshot_every_n_steps > 1``, or
                ranks that asked for different changes (named).
        """
        if from_step is not None:
            if isinstance(from_step, bool) or not isinstance(from_step, numbers.Integral):
                raise ValueError(
                    f"set_weights(from_step={from_step!r}): from_step must be a whole number "
                    "(the training loop's step, counted from 1)"
                )
            from_step = int(from_step)
        # first, so that ranks making one bad call all refuse it rather than wait in the gather
        check_ranks_agree(
            self._step + 1 if from_step is None else from_step, weights, self.world_size
        )
        cfg = self.built_config()
        if cfg is None:
            raise TypeError(
                "set_weights needs a loader built from functools.partial(build_pipeline, cfg): "
                "the weights are the config's"
            )
        checked = check_weights(cfg, weights)
        earliest = self.earliest_weight_step()
        step = earliest if from_step is None else from_step
        if isinstance(step, bool) or not isinstance(step, int) or step < earliest:
            raise ValueError(
                f"set_weights(from_step={from_step!r}): the loader has delivered "
                f"{self._step} batches; the earliest step a change can take effect is {earliest}"
            )
        if self.num_workers and self.snapshot_every_n_steps > 1:
            raise ValueError(
                "set_weights needs the exact state at every step (snapshot_every_n_steps=1)"
            )
        self._weights.add(step, checked)
        if step == earliest:  # the config a checkpoint saved now records
            self.build = self._weights.build_for(step)
        return step

    def adopt_weight_changes(
        self, changes: Sequence[Sequence[Any]], step: int, schedule: Any = ()
    ) -> None:
        """Take the weight changes recorded in a state saved at ``step`` (batches delivered):
        the graphs are built with the weights in force at batch ``step + 1``, and the changes
        after it are made when the run reaches them. ``schedule``: the config's
        ``weight_schedule`` recorded with them (:class:`ScheduleRecord`, or the list of
        ``[step, weights]`` of earlier versions); its token points not yet passed move to
        the steps of this loader's global batch.

        Raises:
            ValueError: this loader's config has another ``weight_schedule``.
        """
        saved = ScheduleRecord.of_state(schedule, "the loader state")
        if not saved.same_schedule(self._schedule):
            raise ValueError(
                f"weight_schedule differs: the checkpoint was taken with {saved.describe()}, "
                f"this config has {self._schedule.describe()}; restore with the checkpoint's "
                "weight_schedule (a change at a later step: set_weights), or start a new run"
            )
        per_step = self._schedule.step_tokens[-1][1] if self._schedule.step_tokens else 0
        if saved.step_tokens and per_step:
            self._schedule.step_tokens = saved.step_tokens
            self._schedule.resumed_at(int(step), per_step)
        self._weights.scheduled = self._schedule.changes()
        self._weights.changes = WeightChanges.checked(changes, "the loader state")
        self.build = self._weights.build_for(int(step) + 1)
        self._restarted = int(step) + 1

    def built_config(self) -> Any | None:
        """The ``PipelineConfig`` this loader's build function was given
        (``functools.partial(build_pipeline, cfg)``, or any ``functools.partial`` given a
        config); None for a build function of another kind."""
        build = self.build
        for arg in (*getattr(build, "args", ()), *getattr(build, "keywords", {}).values()):
            if is_pipeline_config(arg):
                return arg
        return None

    @property
    def dataset_names(self) -> list[str]:
        """The dataset names that the batches' ``dataset_ids`` (and provenance dataset ids)
        index, in order: a config's ``datasets``; for another build function, read off worker
        0's graph (built and reset here)."""
        cfg = self.built_config()
        if cfg is not None:
            return list(cfg.dataset_weights)
        root = self.build(World(self.rank, self.world_size, 0, self.logical_workers))
        root.reset(None)
        return next(
            (list(n.dataset_names) for n in graph_nodes(root) if hasattr(n, "dataset_names")), []
        )

    def replace_build(self, change: Callable[[Any], Any]) -> None:
        """Give this loader ``change(build)`` for its build function, the one it was given
        and the one in force (``set_weights``): ``change`` must return a build function that
        makes the same graphs, e.g. the same config given the indexes already read
        (``load_checkpoint`` passes on the indexes its checks read, so that the graphs built
        at ``iter()`` do not read the index files again)."""
        self._weights.original = change(self._weights.original)
        self.build = change(self.build)

    def _configured_skip_steps(self) -> None:
        """A fresh run (no state loaded): the configured ``skip_steps`` (read off worker 0's
        graph root, as a restore reads them) are dropped when the run reaches them. A config
        found in the build function without them costs nothing (no graph is built here)."""
        cfg = self.built_config()
        if cfg is not None and not cfg.skip_steps:
            return
        root = self.build(World(self.rank, self.world_size, 0, self.logical_workers))
        self._skip_steps = [[int(a), int(b)] for a, b in getattr(root, "skip_steps", ())]
        if self._skip_steps and not self._names:
            root.reset(None)  # the dataset names are known once reset
            named = [n for n in graph_nodes(root) if hasattr(n, "dataset_names")]
            self._names = list(named[0].dataset_names) if named else []

    def close(self) -> None:
        """Stop the stream now: the background thread and the worker processes, which would
        otherwise go on preparing batches until the iterator is garbage-collected (taking
        cores from what comes next, e.g. an evaluation loader). ``state_dict()`` still gives
        the state after the last batch delivered; iterating again starts over from the state
        the loader started from (or from one loaded after this)."""
        self._it = None
        self._running.stop()

    def _deliver(self, produced: Iterator[_Delivery]) -> Iterator[Any]:
        """On the training thread: take each ready batch and make its worker's state the
        current one (the work is done in :func:`_produce`)."""
        W, every = self.logical_workers, self.snapshot_every_n_steps
        lagging = self.num_workers > 0 and every > 1  # only then does state_dict read _snap
        while True:
            for d in produced:
                self._states[d.worker] = d.state
                self._io[d.worker] = d.io
                self._next = (d.worker + 1) % W
                self._yielded += 1
                if lagging and self._yielded % every == 0:
                    self._snap = self._live_snapshot()
                if self._skip:  # delivered before the checkpoint, after its state
                    self._skip -= 1
                    continue
                if self._skipping(d.item, d.worker):
                    continue
                self._step += 1
                if self._restart_due():  # a checkpoint saved now records the next weights
                    self.build = self._weights.build_for(self._step + 1)
                yield d.item
                if self._restart_due():
                    break
            else:
                self._check_skip_ended()
                return
            produced = self._restart()

    def _restart_due(self) -> bool:
        """Whether a weight change is due at the next batch and the workers were not built
        with it."""
        nxt = self._step + 1
        return self._weights.due_at(nxt) and self._restarted != nxt and not self._dropping

    def _skipping(self, item: Any, worker: int) -> bool:
        """Whether ``item`` (made by logical worker ``worker``) is data of a skipped step range
        (``skip_steps``): dropped, its documents' pieces recorded in ``skipped_documents``
        with their epoch when the range ends (:mod:`torchdata_ext.loader.skip_epochs`)."""
        if not self._dropping:
            due = [r for r in self._skip_steps if r[0] == self._step + 1 != self._applied]
            if not due:
                return False
            (a, b), self._applied = due[0], due[0][0]  # once: the step stays a - 1 meanwhile
            self._dropping = b - a
            self._skip_progress = Progress(
                f"skip_steps: dropping the batches of steps {a}..{b - 1}", logger,
                total=b - a, unit="batches", bar=False, level=logging.WARNING,
            )  # fmt: skip
        self._dropping -= 1
        if self._skip_progress is not None:
            self._skip_progress.update()
            if not self._dropping:
                self._skip_progress.close()
        prov = item.get("provenance") if isinstance(item, dict) else None
        if prov is not None:
            rows = prov.reshape(-1, 5).numpy() if hasattr(prov, "numpy") else prov.reshape(-1, 5)
            pending = self._skip_pending.setdefault(worker, [])
            for ds, f, d, start, n in rows[(rows[:, 0] >= 0) & (rows[:, 4] > 0)].tolist():
                name = self._names[ds] if ds < len(self._names) else ds
                pending.append([name, f, d, start, n])
        if not self._dropping:
            self._record_skipped()
        return True

    def _record_skipped(self) -> None:
        """The pieces of the range just dropped into ``skipped_documents``, each with its
        epoch from its worker's cut now (one restore of each worker's graph per range)."""
        W = self.logical_workers
        for w, pieces in sorted(self._skip_pending.items()):
            stamp_epochs(
                self.build(World(self.rank, self.world_size, w, W)), self._states[w], pieces
            )
            self._skipped.extend(pieces)
        self._skip_pending = {}

    def _check_skip_ended(self) -> None:
        """The stream ended inside a skipped step range: refuse the range (its data ran out;
        the trainer would get no batch for step ``a`` however long the loader dropped)."""
        progress, self._skip_progress = self._skip_progress, None
        if progress is None or not self._dropping:
            return
        progress.close(ok=False)
        a, b = self._applied, self._applied + int(progress.total or 0)
        raise ValueError(
            f"skip_steps: the range [{a}, {b}] runs past the end of the data: it ran out after "
            f"{progress.done} of the range's {b - a} batches; end the range at step "
            f"{a + progress.done} at most (B excluded) or remove it"
        )

    def _live_snapshot(self) -> tuple[dict[int, Any], int, int]:
        return dict(self._states), self._next, self._yielded

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: one graph state per worker, keyed by global worker id.

        ``{"format", "rank", "world_size", "num_workers", "next_worker", "skip_batches",
        "step", "skip_steps", "skipped_documents", "workers": {global worker id: {"world",
        "graph", "io"}}}``; ``step``: the batches this rank delivered in the whole run, across
        restores (the training loop's step when it counts from 1); ``skip_steps``: the step
        ranges whose data is skipped (``PipelineConfig.skip_steps``), ``skipped_documents``:
        the pieces ``[dataset, file, doc, start, length, epoch]`` this rank skipped so far
        (``epoch``: :mod:`torchdata_ext.loader.skip_epochs`; pieces saved before have none);
        ``mix_history``: its tokens delivered per dataset at each weight change and now
        (:mod:`torchdata_ext.loader.mix_history`). Costs no copy: the graph
        states are shared with later states and never change (treat them as read-only)."""
        W = self.logical_workers
        if self.num_workers and self.snapshot_every_n_steps > 1:
            states, next_worker, at = self._snap
        else:
            states, next_worker, at = self._live_snapshot()
        skip = self._yielded - at + self._skip
        workers = {}
        for w in range(W):
            graph = states.get(w)
            if graph is None:  # a fresh worker not heard from yet: what it starts from
                root = self.build(World(self.rank, self.world_size, w, W))
                root.reset(None)
                graph = root.state_dict()
            workers[str(self.rank * W + w)] = {
                "world": [self.rank, self.world_size, w, W],
                "graph": graph,
                "io": self._io.get(w, {}),
            }
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": W,
            "next_worker": next_worker,
            "skip_batches": skip,
            "step": self._step,
            "skip_steps": [list(r) for r in self._skip_steps],
            "skipped_documents": list(self._skipped),
            "weight_changes": [list(c) for c in self._weights.changes],
            "weight_schedule": self._schedule.as_state(),
            "mix_history": self._mix.state(
                (s["graph"] for s in workers.values()), self._step - skip
            ),
            "workers": workers,
        }

    def io_stats(self) -> dict[str, float]:
        """I/O counters of all this rank's workers, summed, as of the last batch (bytes
        downloaded, cache hits, downloads, ``wait_seconds`` waiting on I/O, files opened, ...;
        see :meth:`ShardReader.io_stats`). They travel with the batches."""
        out: dict[str, float] = {}
        for io in self._io.values():
            for k, v in io.items():
                out[k] = out.get(k, 0) + v
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's state (same ranks x workers as when it was saved).

        Raises:
            RuntimeError: iteration already started (load before ``iter()``; a started loader
                never silently restarts from the beginning).
            ValueError: the state is from another topology (use
                :func:`torchdata_ext.checkpoint.folder.load_checkpoint`, which rescales).
        """
        if self._it is not None:
            raise RuntimeError(
                "load_state_dict() after iteration started would be ignored by the running "
                "workers; create a new TokenLoader, load the state, then iterate"
            )
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a TokenLoader state (format={state.get('format')!r})")
        W = self.logical_workers
        if (state["world_size"], state["num_workers"], state["rank"]) != (
            self.world_size,
            W,
            self.rank,
        ):
            raise ValueError(
                f"the state was saved at rank {state['rank']} of {state['world_size']} with "
                f"{state['num_workers']} workers, this loader is rank {self.rank} of "
                f"{self.world_size} with {W}; restore with torchdata_ext.checkpoint.folder."
                "load_checkpoint(...), which rescales"
            )
        workers = {
            int(g) - self.rank * W: unpack_worker_state(s) for g, s in state["workers"].items()
        }
        self.load_worker_states(
            {w: s["graph"] for w, s in workers.items()},
            next_worker=int(state["next_worker"]),
            skip_batches=int(state.get("skip_batches", 0)),
            step=int(state.get("step", 0)),
            skip_steps=state.get("skip_steps", ()),
            skipped_documents=state.get("skipped_documents", ()),
            weight_changes=state.get("weight_changes", ()),
            weight_schedule=state.get("weight_schedule", ()),
        )
        self._mix = MixHistory.restored(state.get("mix_history"), int(state.get("step", 0)))

    def load_worker_states(
        self,
        graphs: dict[int, dict[str, Any]],
        next_worker: int = 0,
        skip_batches: int = 0,
        step: int = 0,
        skip_steps: Sequence[Sequence[int]] = (),
        skipped_documents: Sequence[Sequence[Any]] = (),
        dataset_names: Sequence[str] = (),
        weight_changes: Sequence[Sequence[Any]] | None = None,
        weight_schedule: Any = (),
    ) -> None:
        """Start each logical worker (0 .. W-1) of this rank from the given graph state; the
        first ``skip_batches`` batches are produced again and dropped (see ``state_dict``);
        ``step``: the run's step the state was saved at (batches delivered before it);
        ``skip_steps``: step ranges ``[A, B]`` whose batches are dropped when step ``A`` is
        due (checked by the restore: :mod:`torchdata_ext.checkpoint.restore`);
        ``skipped_documents``: the pieces skipped before; ``dataset_names``: the names the
        batches' provenance ids index (to record what is skipped); ``weight_changes``: the
        :meth:`set_weights` changes recorded with the state (None: keep this loader's), and
        ``weight_schedule`` the config's schedule they were taken under."""
        if self._it is not None:
            raise RuntimeError("load the state before iteration starts")
        W = self.logical_workers
        bad = sorted(set(graphs) - set(range(W)))
        if bad:
            raise ValueError(f"worker ids {bad} are not in 0..{W - 1}")
        replayed = int(step) - int(skip_batches)  # the graphs' step: later batches are made again
        if int(skip_batches) and any(int(b) > replayed for _, b in skip_steps):
            raise ValueError(
                f"skip_steps {[list(r) for r in skip_steps]} with a state taken "
                f"{skip_batches} batches after its workers' snapshot (snapshot_every_n_steps > 1): "
                f"the batches of steps {replayed + 1}..{step} are made again at this restore, "
                "which a skip range there or after cannot be combined with; restore from a "
                "checkpoint saved with snapshot_every_n_steps=1"
            )
        self._initial = dict(graphs)
        self._offset = int(next_worker) % W
        self._skip = int(skip_batches)
        self._step0 = int(step)
        self._skip_steps = [[int(a), int(b)] for a, b in skip_steps]
        self._skipped0 = [list(p) for p in skipped_documents]
        self._loaded = True
        if dataset_names:
            self._names = list(dataset_names)
        if weight_changes is not None:
            self.adopt_weight_changes(weight_changes, int(step), weight_schedule)
        self._mix = MixHistory(since=int(step))  # until the caller adopts the saved one
        self._reset_live()


class _Delivery(NamedTuple):
    """A batch ready for the training thread, with its worker's state after it."""

    item: Any
    worker: int
    state: Any
    io: dict[str, float]


def _split(group: BatchGroup, ring: TokenRing | None, pin: bool) -> list[Any]:
    """A group's batches; those in a ring slot are made whole at once (copied out of the
    slot), then the slot is released."""
    if group.slot is None:
        return group.split()
    if ring is None:  # the ring comes with the worker's first message that uses it
        raise RuntimeError("a worker sent tokens in a shared-memory slot before its ring")
    group.tokens = ring.view(group.slot, len(group.cuts))
    out = [batch.to_tensors(own=True, pin=pin) for batch in group.split()]
    ring.release()
    return out


def _produce(
    messages: Iterator[_Message],
    W: int,
    initial: dict[int, Any],
    offset: int,
    pin_memory: bool,
    workers: bool,
) -> Iterator[_Delivery]:
    """Batches one worker after the other (each worker's message holds several), each
    with its worker's state after it (deltas applied: every state stays valid) and its
    other keys built: all of it off the training thread when ``background``."""
    states: dict[int, Any] = dict(initial)
    pending: dict[int, collections.deque[tuple[Any, Any, bool]]] = {
        w: collections.deque() for w in range(W)
    }
    io: dict[int, dict[str, float]] = {}
    rings: dict[int, TokenRing] = {}
    pin = pin_memory and _accelerator()  # where the dataloader pins, as it does
    live = set(range(W))  # workers whose stream has not ended
    w = offset
    while True:
        while not pending[w] and w in live:
            try:
                msg = next(messages)
            except StopIteration:
                live.clear()
                break
            if msg.ring is not None:
                rings[msg.worker] = msg.ring
            items = msg.items
            if isinstance(items, BatchGroup):
                items = _split(items, rings.get(msg.worker), pin)
            pending[msg.worker].extend(
                (item, st, msg.delta) for item, st in zip(items, msg.states, strict=True)
            )
            io[msg.worker] = msg.io
            if msg.ended:
                live.discard(msg.worker)
        if not pending[w]:  # w has ended: the next worker that has not
            if not live and not any(pending.values()):
                return
            w = (w + 1) % W
            continue
        item, st, delta = pending[w].popleft()
        states[w] = apply(states.get(w), st) if delta else st
        if isinstance(item, PackedBatch):
            item = item.to_tensors()
        if pin_memory and not workers:
            item = _pinned(item)
        yield _Delivery(item, w, states[w], io.get(w, {}))
        w = (w + 1) % W


def default_worker_context() -> Any | None:
    """The start method for dataloader workers when none is given: ``"forkserver"`` in a
    process whose start method is ``spawn``, else None (torch's default).

    A trainer started by ``torch.multiprocessing.spawn`` has ``spawn`` as its start method, so
    each worker would start a new interpreter and import torch and this package again before
    its first batch: 3.5-4.3 s at every start of the workers (each ``iter()``, each weight
    change) against 0.16-0.21 s with ``fork`` (2 workers, measured on 2 cores). ``fork``
    is unsafe once CUDA is initialised; a fork server is a process started once (2.7 s the
    first time), without CUDA, which forks each worker with torch and this package already
    imported (0.22 s). The dataset is pickled to the workers as with ``spawn``."""
    import multiprocessing as mp

    if mp.get_start_method(allow_none=True) != "spawn":
        return None
    if "forkserver" not in mp.get_all_start_methods():  # e.g. Windows
        return None
    mp.set_forkserver_preload(list(WORKER_IMPORTS))
    return "forkserver"


WORKER_IMPORTS = (
    "torch",
    "numpy.random",
    "fsspec.implementations.local",
    "torchdata_ext.loader.token_loader",
    "torchdata_ext.pipeline.build",
    "torchdata_ext.handlers.arrow",
)
"""Modules a worker imports on its way to its first batch (NumPy loads ``numpy.random`` on
first use, ~8 ms; with the rest ~20 ms per worker): imported in this process before the
workers start, so forked workers have them, and preloaded by a fork server
(:func:`default_worker_context`). Not ``numpy.ma`` (~9 ms, which ``np.unique`` loads): the
Arrow path avoids it (:func:`~torchdata_ext.handlers.arrow_index.sorted_unique`)."""


def import_worker_modules() -> None:
    """Import :data:`WORKER_IMPORTS` here (a no-op once they are)."""
    for name in WORKER_IMPORTS:
        importlib.import_module(name)


def _accelerator() -> bool:
    """Whether an accelerator is there to pin memory for (the dataloader's own test)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def _as_is(message: _Message) -> _Message:
    return message


def _pinned(item: Any) -> Any:
    if isinstance(item, dict):
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in item.items()}
    return item


@contextlib.contextmanager
def _torchdata_noise_filtered() -> Iterator[None]:
    """Keep two warnings of ``StatefulDataLoader`` off the user's console while it starts:
    ``'set_vital' is deprecated`` (torchdata's own call of a deprecated torch function) and
    torch's advice on the worker count, both given on every start, the latter twice (on
    construction and on ``iter``), and again after every restore. Only these messages from
    that module are filtered; any other warning (the user's build function runs here with
    ``num_workers=0``) shows as usual."""
    module = r"torchdata\.stateful_dataloader"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning, module)
        warnings.filterwarnings(
            "ignore", "This DataLoader will create .* worker processes", UserWarning, module
        )
        yield
