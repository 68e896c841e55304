"""Run a node graph under ``StatefulDataLoader`` workers, with per-worker state and restore.

:class:`PipelineDataset` is an ``IterableDataset`` that builds the node graph inside each
dataloader worker for that worker's :class:`~torchdata_ext.world.World`, and whose iterator
reports the graph's state, so ``StatefulDataLoader.state_dict()`` captures it at every step.

:class:`TokenLoader` wraps ``StatefulDataLoader`` and speaks in the product's own terms: its
``state_dict()`` is ``{"format", "rank", "world_size", "num_workers", "next_worker",
"skip_batches", "workers": {global worker id: {"world", "graph", "io"}}}``, and ``load_state_dict`` restores it on the same
topology, continuing with exactly the batches the uninterrupted run would have produced (the
worker that would have produced the next batch does so). Restoring onto another number of
ranks or workers goes through :func:`torchdata_ext.checkpoint.load_checkpoint` (planned by
:func:`torchdata_ext.rescale.rescale_worker_states`).

Inside the dataloader a worker reports its graph state pickled, as one ``bytes`` value
(``graph_pickle``): ``StatefulDataLoader`` diffs and rebuilds worker states leaf by leaf in
Python at every snapshot, which for ~20,000 leaves (1,024 shards x 3 datasets) costs ~90 ms a
step; one opaque value costs a pickle (~2 ms) in the worker and nothing in the main process
until a checkpoint is taken.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.nodes import BaseNode

from torchdata_ext.graph import graph_nodes
from torchdata_ext.world import World

__all__ = ["STATE_FORMAT", "PipelineDataset", "TokenLoader"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
BuildFn = Callable[[World], BaseNode]


class _PipelineIterator(Iterator[Any]):
    """One worker's graph; ``state_dict``/``load_state_dict`` as StatefulDataLoader expects."""

    def __init__(self, build: BuildFn, world: World, initial: dict[str, Any] | None) -> None:
        self.world = world
        self.root = build(world)
        self._initial = initial
        self._started = False
        self._counted: list[Any] | None = None  # the nodes with io_stats (the graph is fixed)

    def _start(self) -> None:
        if not self._started:
            self.root.reset(self._initial)
            self._started = True

    def __iter__(self) -> _PipelineIterator:
        return self

    def __next__(self) -> Any:
        self._start()
        return next(self.root)

    def state_dict(self) -> dict[str, Any]:
        self._start()
        w = self.world
        graph = self.root.state_dict()
        out: dict[str, Any] = {"world": [w.rank, w.world_size, w.worker_id, w.num_workers]}
        if get_worker_info() is None:  # in this process: nothing to send
            out["graph"] = graph
        else:
            out["graph_pickle"] = pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL)
        out["io"] = self.io_stats()
        return out

    def io_stats(self) -> dict[str, float]:
        """The I/O counters of every reader in this worker's graph, summed."""
        if self._counted is None:  # found once: walking the graph visits every buffered item
            self._counted = [
                n for n in graph_nodes(self.root) if callable(getattr(n, "io_stats", None))
            ]
        out: dict[str, float] = {}
        for node in self._counted:
            for k, v in node.io_stats().items():
                if isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._started:
            raise RuntimeError(
                "cannot load a state into a running pipeline; load it before iteration starts"
            )
        saved = World(*state["world"])
        if saved != self.world:
            raise ValueError(
                f"this worker state was saved by {saved} but is loaded into {self.world}; "
                "restore through TokenLoader.load_state_dict, which rescales"
            )
        self._initial = unpack_worker_state(state)["graph"]


def unpack_worker_state(state: dict[str, Any]) -> dict[str, Any]:
    """A worker state as the dataloader carries it (graph state pickled) with its graph state
    unpickled: ``{"world", "graph", "io"}`` (a state already unpacked is returned as is)."""
    if "graph_pickle" not in state:
        return state
    out = {k: v for k, v in state.items() if k != "graph_pickle"}
    out["graph"] = pickle.loads(state["graph_pickle"])
    return out


class PipelineDataset(IterableDataset):
    """An ``IterableDataset`` that builds a node graph per dataloader worker.

    Args:
        build: function from a :class:`World` to the root node of the graph (e.g.
            ``lambda world: build_pipeline(cfg, world)``); called inside each worker, so it must
            be picklable (a module-level function or a ``functools.partial``).
        rank: this process's rank; default: ``torch.distributed`` when initialised, else 0.
        world_size: the number of ranks; default: ``torch.distributed``, else 1.
        initial_states: per logical worker id, the graph state to start from.
        worker_offset: logical worker id of physical worker 0 (used to keep the round-robin
            order of batches across a restore; logical = (physical + offset) % num_workers).
    """

    def __init__(
        self,
        build: BuildFn,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        initial_states: dict[int, dict[str, Any]] | None = None,
        worker_offset: int = 0,
    ) -> None:
        super().__init__()
        self.build = build
        self.rank = rank
        self.world_size = world_size
        self.initial_states = dict(initial_states or {})
        self.worker_offset = int(worker_offset)

    def world_for(self, physical_worker: int, num_workers: int) -> World:
        base = World.detect(self.rank, self.world_size)
        logical = (physical_worker + self.worker_offset) % num_workers
        return World(base.rank, base.world_size, logical, num_workers)

    def __iter__(self) -> _PipelineIterator:
        info = get_worker_info()
        physical, n = (0, 1) if info is None else (info.id, info.num_workers)
        world = self.world_for(physical, n)
        return _PipelineIterator(self.build, world, self.initial_states.get(world.worker_id))


class TokenLoader:
    """A ``StatefulDataLoader`` over a node graph that yields ready batches.

    Args:
        build: function from a :class:`World` to the graph's root node (picklable).
        num_workers: dataloader worker processes (0 runs the graph in this process).
        rank / world_size: override ``torch.distributed`` (default: detected).
        snapshot_every_n_steps: how often workers snapshot their state (1: every batch, so a
            checkpoint can be taken at any step).
        prefetch_factor: batches each worker prepares ahead (default 2 with workers).
        pin_memory: pin batch tensors (for fast host-to-GPU copies).
        multiprocessing_context: e.g. ``"spawn"`` or ``"forkserver"`` (default: torch's).
        persistent_workers: keep workers alive between iterations.

    ``iter(loader)`` starts (or, after ``load_state_dict``, resumes) the stream;
    ``state_dict()`` may be called at any step.
    """

    def __init__(
        self,
        build: BuildFn,
        *,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        snapshot_every_n_steps: int = 1,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        persistent_workers: bool = False,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"{num_workers=} must be an integer >= 0")
        self.build = build
        self.num_workers = num_workers
        base = World.detect(rank, world_size)
        self.rank, self.world_size = base.rank, base.world_size
        self._dl_kwargs: dict[str, Any] = dict(
            num_workers=num_workers,
            snapshot_every_n_steps=snapshot_every_n_steps,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
        )
        if num_workers > 0:
            self._dl_kwargs["prefetch_factor"] = prefetch_factor or 2
            if multiprocessing_context is not None:
                self._dl_kwargs["multiprocessing_context"] = multiprocessing_context
        self._initial: dict[int, dict[str, Any]] = {}
        self._offset = 0
        self._dl: Any = None
        self._it: Any = None
        self._yielded = 0
        self._skip = 0  # batches to drop after a restore (see state_dict)

    @property
    def logical_workers(self) -> int:
        """Graph copies per rank (``num_workers``, or 1 when loading in this process)."""
        return max(1, self.num_workers)

    def _make(self) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        dataset = PipelineDataset(
            self.build,
            rank=self.rank,
            world_size=self.world_size,
            initial_states=self._initial,
            worker_offset=self._offset,
        )
        with _torchdata_noise_filtered():
            self._dl = StatefulDataLoader(dataset, batch_size=None, **self._dl_kwargs)

    def __iter__(self) -> Iterator[Any]:
        if self._dl is None or self._it is not None:
            self._make()
        with _torchdata_noise_filtered():
            self._it = iter(self._dl)
        self._yielded = 0
        return self._counting(self._it)

    def _counting(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self._yielded += 1
            if self._skip:  # delivered before the checkpoint, after the workers' last snapshot
                self._skip -= 1
                continue
            yield batch

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: one graph state per worker, keyed by global worker id."""
        return self._collect(unpack=True)

    def _collect(self, unpack: bool) -> dict[str, Any]:
        """The rank's state; worker states as the dataloader carries them unless ``unpack``."""
        fix = unpack_worker_state if unpack else _same
        W = self.logical_workers
        if self._it is None:  # not started: what it would start from
            if len(self._initial) == W:
                workers = {
                    str(self.rank * W + w): {
                        "world": [self.rank, self.world_size, w, W],
                        "graph": s,
                    }
                    for w, s in self._initial.items()
                }
                return self._wrap(workers, self._offset, self._skip)
            # a fresh graph's state, built here so the shape is the same as later
            workers = {}
            for w in range(W):
                world = World(self.rank, self.world_size, w, W)
                root = self.build(world)
                root.reset(self._initial.get(w))
                workers[str(self.rank * W + w)] = {
                    "world": [self.rank, self.world_size, w, W],
                    "graph": root.state_dict(),
                }
            return self._wrap(workers, self._offset, self._skip)
        sd = self._dl.state_dict()
        workers = {}
        if self.num_workers == 0:
            st = sd["_fetcher_state"]["dataset_iter_state"] if "_fetcher_state" in sd else None
            st = st or sd.get("fetcher_state", {}).get("dataset_iter_state")
            if st is None:
                raise RuntimeError("the dataloader returned no pipeline state")
            workers[str(self.rank)] = fix(st)
            return self._wrap(workers, 0, self._skip)  # the live state, less what is to drop
        snaps = sd["_snapshot"]["_worker_snapshots"]
        for name in sorted(snaps):
            st = snaps[name]["fetcher_state"]["dataset_iter_state"]
            if st is None:  # this worker has not produced anything yet: its initial state
                physical = int(name.split("_")[1])
                logical = (physical + self._offset) % W
                if logical in self._initial:
                    st = {
                        "world": [self.rank, self.world_size, logical, W],
                        "graph": self._initial[logical],
                    }
                else:
                    st = None
            if st is not None:
                workers[str(self.rank * W + st["world"][2])] = fix(st)
        last = sd["_snapshot"]["_last_yielded_worker_id"]
        next_physical = (last + 1) % W if self._yielded else 0
        # with snapshot_every_n_steps > 1 the worker states are those of the last snapshot:
        # the batches since are produced again after a restore and dropped
        # (batches still to drop after a restore count too: the snapshot may predate them)
        since = int(sd.get("_steps_since_snapshot", 0)) + self._skip
        return self._wrap(workers, (next_physical + self._offset) % W, since)

    def io_stats(self) -> dict[str, float]:
        """I/O counters of all this rank's workers, summed, as of the last batch (bytes
        downloaded, cache hits, downloads, ``wait_seconds`` waiting on I/O, files opened, ...;
        see :meth:`ShardReader.io_stats`). With worker processes the counters travel with the
        workers' state snapshots, so they are as fresh as ``snapshot_every_n_steps``."""
        out: dict[str, float] = {}
        for st in self._collect(unpack=False)["workers"].values():
            for k, v in st.get("io", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def _wrap(
        self, workers: dict[str, Any], next_worker: int, skip_batches: int = 0
    ) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.logical_workers,
            "next_worker": next_worker,
            "skip_batches": skip_batches,
            "workers": workers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's state (same ranks x workers as when it was saved).

        Raises:
            RuntimeError: iteration already started (load before ``iter()``; a started loader
                never silently restarts from the beginning).
            ValueError: the state is from another topology (use
                :func:`torchdata_ext.checkpoint.load_checkpoint`, which rescales).
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
                f"{self.world_size} with {W}; restore with torchdata_ext.checkpoint."
                "load_checkpoint(...), which rescales"
            )
        self.load_worker_states(
            {
                int(g) - self.rank * W: unpack_worker_state(s)["graph"]
                for g, s in state["workers"].items()
            },
            next_worker=int(state["next_worker"]),
            skip_batches=int(state.get("skip_batches", 0)),
        )

    def load_worker_states(
        self, graphs: dict[int, dict[str, Any]], next_worker: int = 0, skip_batches: int = 0
    ) -> None:
        """Start each logical worker (0 .. W-1) of this rank from the given graph state; the
        first ``skip_batches`` batches are produced again and dropped (see ``state_dict``)."""
        if self._it is not None:
            raise RuntimeError("load the state before iteration starts")
        W = self.logical_workers
        bad = sorted(set(graphs) - set(range(W)))
        if bad:
            raise ValueError(f"worker ids {bad} are not in 0..{W - 1}")
        self._initial = dict(graphs)
        self._offset = int(next_worker) % W
        self._skip = int(skip_batches)
        self._dl = None


def _same(state: dict[str, Any]) -> dict[str, Any]:
    return state


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
