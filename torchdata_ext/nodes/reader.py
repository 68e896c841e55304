"""The reader node: every document of a worker's logical shards, once per epoch, shuffled.

For each logical shard it owns, a worker walks the shard's documents in a seeded pseudo-random
order: the shard's file pieces in an order shuffled per epoch, and inside each piece a
:class:`~torchdata_ext.order.walk.RandomWalk` over its documents. Shards are read one at a time (one
open file at a time), in an order shuffled per epoch; a shard at a lower epoch always goes
first, so after a rescale no worker starts a new epoch while it still owns unfinished shards.

The position in a shard is ``(epoch, pos, offset)``: its epoch, the number of documents of the
walk already finished, and how many tokens of the next document were already delivered (when
long documents are cut into ``max_chunksize`` pieces). The reader's state is that cursor per
owned shard, by global shard id, so re-partitioning state over a new number of workers is a
selection by shard id.

State keys (format 2, see :mod:`torchdata_ext.state.reader_state`): ``format``, ``dataset``,
``fingerprint``, ``seed``, ``n_logical_shards``, ``split`` (the held-out split and which side of
it this reader delivers, or None; all checked on restore); ``cursors``: ``{"ids", "epoch",
"pos", "offset", "skips"}``, read-only integer arrays over the owned shards sorted by id, each
shard's cursor as it was last left (replaced, only the changed columns, when a shard finishes an
epoch or its handed-back pieces); ``active``: the cursor of the shard being read,
``{"shard", "epoch", "pos", "offset", "skips", "skipped_files", "skipped_docs", "returned"}``,
or None; ``extras``: ``{str(shard_id): {"skipped_files"?, "skipped_docs"?, "returned"?}}`` for
the left shards with such lists. Format 1 states (``shards``: a dict per shard) restore too:
states are read through :func:`~torchdata_ext.state.reader_state.reader_cursors`. Resume guarantee:
restoring a state continues with exactly the blocks the uninterrupted run would have produced
next.

This module is the walk: shard order, plans, cursors and epochs, building blocks, when to
deliver pieces handed back by a rescale, the state it saves and restores, and the
``on_error`` policy. Opening, reading, prefetching and closing files (handlers, the
:class:`~torchdata_ext.remote.ShardCache`, range reads, I/O counters) is
:class:`~torchdata_ext.sources.file_access.FileAccess`, which the reader asks for a file number and
document ids; the state format (``Cursor``, :func:`merge_reader_states`) is
:mod:`torchdata_ext.state.reader_state` and the hand-back's state edit and blocks are
:mod:`torchdata_ext.nodes.hand_back`. This module is 871 lines: what is left is one state machine over the
per-shard cursor (``Cursor``) that the plan, block, file-switch and hand-back code all advance.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache, partial
from typing import Any, Literal

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.checks import check_int
from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import READ_ERRORS, DocData
from torchdata_ext.nodes.drops import DEFAULT_MAX_DROPPED, DropWatch
from torchdata_ext.nodes.hand_back import returned_block, with_returned
from torchdata_ext.order.shard_walk import ShardPlan, shard_order_rank, shard_plan
from torchdata_ext.order.shards import check_shard_count, file_offsets, worker_shards
from torchdata_ext.order.split import EvalSplit, SplitFilter, Subset
from torchdata_ext.order.walk import RandomWalk
from torchdata_ext.remote import RemoteError, ShardCache
from torchdata_ext.sources.file_access import CacheSetting, FileAccess
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.reader_state import (
    COLUMNS,
    STATE_FORMAT,
    Cursor,
    ReaderCursors,
    cursor_state,
    merge_reader_states,
    narrow,
    reader_cursors,
)
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings
from torchdata_ext.world import World

__all__ = ["ShardReader", "merge_reader_states"]

logger = logging.getLogger(__name__)

#: shard plans kept in the process ((dataset, shards, seed, shard, epoch) each; a few small
#: arrays): a restore, a rescale or a torchft re-split builds new readers of the same shards
_PLANS_KEPT = 4096


@lru_cache(maxsize=_PLANS_KEPT)
def _shard_plan_of(
    offsets: bytes, n_logical_shards: int, seed: int, sid: int, epoch: int
) -> ShardPlan:
    """:func:`shard_plan` of the dataset whose file offsets are ``offsets`` (``int64`` bytes),
    made once per process (~30 NumPy calls), its arrays read-only."""
    plan = shard_plan(np.frombuffer(offsets, np.int64), n_logical_shards, seed, sid, epoch)
    plan.starts.flags.writeable = False
    return plan


def _starts_anything(block: DocumentBlock) -> bool:
    """``block`` holds a document's first piece or handed-back pieces (a transform uses it)."""
    return block.stop is not None or bool((block.start == 0).any())


class ShardReader(BaseNode[DocumentBlock]):
    """Read a dataset's documents in random-walk order, exactly once per epoch per document.

    Args:
        dataset: the dataset (a :class:`~torchdata_ext.sources.index.DatasetIndex`; build one with
            ``DatasetIndex.build(url, ...)``).
        n_logical_shards: N, the number of logical shards the documents are cut into; the same
            on every rank; must be >= ranks x workers and <= the number of documents. Keep it
            fixed for the life of a run (it is part of the checkpoint).
        seed: the shuffling seed (same on every rank).
        world: this copy's place among all copies; default: detected when iteration starts
            (``torch.distributed`` rank and the dataloader worker info).
        epochs: stop after this many epochs over the worker's shards (``StopIteration``);
            None (default) runs forever, starting each new epoch with a new order.
        block_docs: at most this many documents (or pieces) per output block; a block never
            spans two files. Restored from a state of another size, the first block (up to
            one holding a document's first piece) is read at the saved size.
        min_length: skip documents shorter than this (tokens; characters for text) after
            ``strip_tokens``.
        strip_tokens: token ids removed from both ends of each document (e.g. BOS/EOS already
            in the data, so the packer can place its own).
        max_chunksize: documents longer than this (tokens; characters for text) come out as
            consecutive pieces of at most this length; None keeps documents whole.
        on_error: ``"raise"`` (default) stops on an unreadable file or document; ``"skip"``
            logs it, counts it, records it in the state (a resumed or rescaled run skips the same
            things) and goes on. See :attr:`skipped`.
        dtype: the integer dtype of output tokens (``np.int32`` default; ``np.int64``).
        cache: how remote files (``s3://``, any non-local fsspec URL) are read. None (default):
            through a :class:`~torchdata_ext.remote.ShardCache` in the default cache folder
            (``$TORCHDATA_EXT_CACHE_DIR`` or the temp folder); a folder path: a cache there; a
            ``ShardCache``: that cache (share one between readers; ``range_reads=True`` for
            range requests instead of downloads); False: no cache, each file is read into
            memory when opened (with retries). Local files are always read in place.
        prefetch_shards: how many of the next shard files this worker will open (the rest of
            the current logical shard, then the next shards in its order) are downloaded in the
            background while it reads the current one (default 2); 0 turns prefetching off.
        split: a held-out evaluation split (:class:`~torchdata_ext.order.split.EvalSplit`), or None
            (default: every document is delivered).
        subset: with a ``split``: ``"train"`` (default) skips the held-out documents (their
            walk positions are consumed, as for ``min_length``), ``"eval"`` delivers only them.
        max_dropped: fail (:class:`~torchdata_ext.nodes.drops.NothingKeptError`) after this many
            documents in a row passed over (``min_length``, ``on_error``, ``split``) with none
            delivered, instead of reading on forever (default one million; None: only after
            two whole epochs of this worker's shards gave nothing). See :mod:`torchdata_ext.
            _drops`, which also warns when almost everything is passed over.

    Remote I/O changes neither the output nor the state. :meth:`io_stats` says how much time the
    reader spent waiting on I/O.
    """

    def __init__(
        self,
        dataset: DatasetIndex,
        n_logical_shards: int,
        *,
        seed: int = 0,
        world: World | None = None,
        epochs: int | None = None,
        block_docs: int = 64,
        min_length: int = 0,
        strip_tokens: Sequence[int] = (),
        max_chunksize: int | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        dtype: np.dtype | type = np.int32,
        cache: CacheSetting = None,
        prefetch_shards: int = 2,
        split: EvalSplit | None = None,
        subset: Subset = "train",
        max_dropped: int | None = DEFAULT_MAX_DROPPED,
    ) -> None:
        super().__init__()
        if not isinstance(dataset, DatasetIndex):
            raise TypeError(
                f"dataset must be a DatasetIndex (got {type(dataset).__name__}); "
                "build one with DatasetIndex.build(url)"
            )
        check_int("seed", seed, None)
        check_int("block_docs", block_docs, 1)
        check_int("min_length", min_length, 0)
        if epochs is not None:
            check_int("epochs", epochs, 1)
        if max_chunksize is not None:
            check_int("max_chunksize", max_chunksize, 1)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"{on_error=} must be 'raise' or 'skip'")
        if not np.issubdtype(np.dtype(dtype), np.integer):
            raise TypeError(f"{dtype=} must be an integer dtype such as np.int32 or np.int64")
        check_int("prefetch_shards", prefetch_shards, 0)
        if max_dropped is not None:
            check_int("max_dropped", max_dropped, 1)
        if cache is not None and not isinstance(cache, (ShardCache, str, os.PathLike, bool)):
            raise TypeError(
                f"cache={cache!r} must be a ShardCache, a cache folder path, False or None"
            )
        check_shard_count(n_logical_shards, dataset.total_docs, 1)
        if split is not None and not isinstance(split, EvalSplit):
            raise TypeError(f"split={split!r} must be an EvalSplit or None")
        if split is None and subset != "train":
            raise ValueError(f"{subset=} needs a split: pass split=EvalSplit(eval_fraction)")
        self._split = (
            None if split is None else SplitFilter(split, subset, dataset.name, dataset.files)
        )
        self.dataset = dataset
        self.n_logical_shards = int(n_logical_shards)
        self.seed = int(seed)
        self.epochs = epochs
        self.block_docs = int(block_docs)
        self.min_length = int(min_length)
        self.strip_tokens = tuple(int(t) for t in strip_tokens)
        self._strip_arr = np.asarray(self.strip_tokens, np.int64)
        self.max_chunksize = max_chunksize
        # what the blocks the nodes above replay from a saved state depend on (see
        # state/settings.py): another value is refused in reset, naming the field, but for
        # block_docs: restored under another block size, the reader reads its first blocks
        # at the saved size up to the block the nodes above replay (see _replay_size), then
        # at the new one; checkpoint/restore.py refuses it with pack_mode best_fit, whose
        # window replays several blocks. Never mutated
        self._settings = {
            "block_docs": self.block_docs,
            "max_chunksize": None if max_chunksize is None else int(max_chunksize),
            "min_length": self.min_length,
            "strip_tokens": list(self.strip_tokens),
            "col_name": dataset.handler_options.get("col_name"),  # another column: other docs
        }
        # the block size in effect and the settings the state records (see _replay_size)
        self._docs_now, self._settings_now = self.block_docs, self._settings
        self.on_error = on_error
        self.dtype = np.dtype(dtype)
        self._given_world = world
        self._fingerprint = dataset.fingerprint()
        self._offsets = file_offsets(dataset.doc_counts)
        self._offsets_key = self._offsets.tobytes()  # the plans' key (_shard_plan_of)
        self._cursors: dict[int, Cursor] = {}
        # the state's "cursors" columns and "extras" of the shards as last left: replaced
        # (copy-on-write), never written, once handed out (see reader_state.py)
        self._columns: dict[str, np.ndarray] = {}
        self._extras: dict[str, dict[str, Any]] = {}
        self._row: dict[int, int] = {}
        self._active: int | None = None
        self._queue: list[tuple[int, int, int]] = []  # (epoch, order rank, shard), a heap
        self._owned_docs = 0
        self._plan_cache: tuple[int, int, ShardPlan] | None = None
        self._walk_cache: RandomWalk | None = None
        self._order_cache: dict[int, np.ndarray] = {}
        self._empty_run = 0
        self._returned_shards: list[int] = []
        self.world: World | None = None
        self._files = FileAccess(dataset, cache, int(prefetch_shards))
        self._reader_seconds = 0.0
        self._drops = DropWatch(
            f"dataset {dataset.name!r}: the reader",
            max_dropped,
            "lower min_length, check eval_fraction / subset and the files on_error='skip' "
            "logged, or raise max_dropped_documents if the data is meant to be this sparse",
        )

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._files.close()
        self._files.stop_prefetching()
        self.world = self._given_world or World.detect()
        check_shard_count(self.n_logical_shards, self.dataset.total_docs, self.world.total_workers)
        owned = worker_shards(
            self.n_logical_shards, self.world.total_workers, self.world.global_worker
        )
        ids = np.arange(owned.start, owned.stop, dtype=np.int64)
        if initial_state is not None:
            view = reader_cursors(initial_state)  # ValueError: no reader state, unknown format
            self._check_state(initial_state)
            mine = {k: v for k, v in self._settings.items() if k != "block_docs"}
            check_settings(f"the reader of dataset {self.dataset.name!r}", initial_state, mine)
            self._replay_size(initial_state.get(SETTINGS_KEY))
            rows = view.rows(ids)
            if (rows < 0).any():
                sid = int(ids[np.argmax(rows < 0)])
                raise ValueError(
                    f"the reader state for dataset {self.dataset.name!r} has no cursor for "
                    f"logical shard {sid}, which global worker {self.world.global_worker} of "
                    f"{self.world.total_workers} owns; pass the merged state of all workers "
                    "when the number of ranks or workers changed"
                )
            view = view.take(rows)
        else:
            view = ReaderCursors.fresh(ids)
            self._docs_now, self._settings_now = self.block_docs, self._settings
        self._cursors = {int(sid): view.cursor(i) for i, sid in enumerate(ids.tolist())}
        self._row = {int(sid): i for i, sid in enumerate(ids.tolist())}
        frozen = cursor_state({}, view)
        self._columns, self._extras = frozen["cursors"], frozen["extras"]
        self._active = None
        self._queue = [
            (c.epoch, int(self._order_rank(c.epoch)[s]), s) for s, c in self._cursors.items()
        ]
        heapq.heapify(self._queue)
        self._returned_shards = sorted(s for s, c in self._cursors.items() if c.returned)
        self._owned_docs = sum(self.shard_size(s) for s in self._cursors)
        self._plan_cache = None
        self._empty_run = 0
        self._drops.reset(
            endless=self.epochs is None,
            warn=self._split is None or self._split.subset == "train",
        )

    def next(self) -> DocumentBlock:
        t0 = time.perf_counter()
        try:
            while True:
                sid = self._pick_active()
                if sid is None:
                    self._files.close()
                    self._files.stop_prefetching()
                    raise StopIteration
                c = self._cursors[sid]
                epoch, pos = c.epoch, c.pos
                block = self._read_block(sid)
                passed = c.pos - pos if c.epoch == epoch else 0
                if block is not None:
                    if self._docs_now != self.block_docs and _starts_anything(block):
                        self._docs_now, self._settings_now = self.block_docs, self._settings
                    self._empty_run = 0
                    self._drops.count(passed, len(block))
                    return block
                if passed:
                    self._drops.count(passed, 0, self._why_dropped)
        finally:
            self._reader_seconds += time.perf_counter() - t0

    def get_state(self) -> dict[str, Any]:
        active = None
        if self._active is not None:
            active = {"shard": self._active, **self._cursors[self._active].as_dict()}
        return {
            "format": STATE_FORMAT,
            "dataset": self.dataset.name,
            "fingerprint": self._fingerprint,
            "seed": self.seed,
            "n_logical_shards": self.n_logical_shards,
            "split": self._split_state(),
            SETTINGS_KEY: self._settings_now,
            "cursors": self._columns,
            "extras": self._extras,
            "active": active,
        }

    def _replay_size(self, saved: Any) -> None:
        """The block size after a restore: the saved one up to the block the nodes above replay
        (a transform node passes over blocks of a document it emitted whole), then ours."""
        then = saved.get("block_docs") if isinstance(saved, dict) else None
        if then is None or int(then) == self.block_docs:
            self._docs_now, self._settings_now = self.block_docs, self._settings
        else:
            self._docs_now = int(then)
            self._settings_now = {**self._settings, "block_docs": self._docs_now}

    def _why_dropped(self) -> str:
        why = [f"min_length={self.min_length}"]
        if self._split is not None:
            why.append(f"the {self._split.subset!r} side of {self._split.split}")
        if self.on_error == "skip":
            why.append(f"{self.skipped:,} skipped by on_error='skip'")
        return ", ".join(why)

    def _split_state(self) -> dict[str, Any] | None:
        return None if self._split is None else self._split.state()

    # -- public helpers ----------------------------------------------------------------------
    @property
    def owned_documents(self) -> int:
        """Documents in the logical shards this worker owns (known once reset)."""
        return self._owned_docs

    @property
    def skipped(self) -> int:
        """Documents skipped by ``on_error="skip"`` in this worker's shards (all epochs,
        including before a restore)."""
        return sum(c.skips for c in self._cursors.values())

    def io_stats(self) -> dict[str, float]:
        """Counters that show whether I/O is the bottleneck (this process).

        ``files_opened``; ``open_seconds`` (time spent opening files, waits for downloads
        included); ``reader_seconds`` (time spent in :meth:`next` in all); and, when remote
        files go through a cache, its :meth:`~torchdata_ext.remote.ShardCache.stats`:
        ``wait_seconds`` (time blocked on downloads or range reads), ``bytes_downloaded``,
        ``downloads``, ``cache_hits``, ``prefetch_waits``, ``misses``, ``retries``... (without a
        cache, ``wait_seconds`` is ``open_seconds``: files are read when opened). The share of
        time spent waiting on I/O is ``wait_seconds`` over the wall time (or over
        ``reader_seconds`` for the reader's own share). A cache shared by several readers
        reports their sum.
        """
        out = self._files.io_stats()
        out["reader_seconds"] = self._reader_seconds
        return out

    @property
    def cache(self) -> ShardCache | None:
        """The cache remote files are read through (None: local files, or ``cache=False``)."""
        return self._files.cache

    @property
    def prefetch_shards(self) -> int:
        """How many upcoming remote files are prefetched while one is read."""
        return self._files.prefetch

    def close(self) -> None:
        """Close open files and drop this reader's holds on cached files (so they can be
        evicted). Iteration can start again with :meth:`reset`."""
        self._files.close_all()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - no imports at interpreter shutdown
            self.close()
        except Exception:  # interpreter shutdown, half-built reader
            pass

    def _read_returned(self, sid: int, c: Cursor) -> DocumentBlock | None:
        """Deliver pieces handed back by a rescale (one file per block)."""
        if not c.returned:
            self._returned_shards.pop(0)
            self._freeze(sid)
            self._active = None
            return None
        file = c.returned[0][0]
        take: list[list[int]] = []
        while c.returned and c.returned[0][0] == file and len(take) < self._docs_now:
            take.append(c.returned.pop(0))
        return returned_block(
            self.dataset.name,
            file,
            take,
            partial(self.fetch_document, self.dataset.name, file),
            shard=sid,
            epoch=c.epoch,
            dtype=self.dtype,
        )

    def with_returned(
        self, state: dict[str, Any], pieces: Sequence[tuple[int, int, int, int]]
    ) -> dict[str, Any]:
        """A copy of reader ``state`` with in-flight ``pieces`` ``(file, doc, start, stop)``
        handed back to the logical shards holding them (each is delivered first by whichever
        worker owns the shard). Used when rescaling."""
        return with_returned(state, pieces, self._offsets, self.n_logical_shards)

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` as this reader delivers it (after
        ``strip_tokens``, whole, in the output dtype), read again from the source.

        Nodes downstream use this to rebuild buffered data from provenance on restore instead of
        keeping token copies in their state.
        """
        if dataset != self.dataset.name:
            raise KeyError(f"this reader reads dataset {self.dataset.name!r}, not {dataset!r}")
        data = self._files.fetch_document(file, doc)
        if isinstance(data, str):
            return data
        if self._strip_arr.size:
            data = _strip(data, self._strip_arr)
        return np.asarray(data).astype(self.dtype, copy=False)

    @property
    def owned_shards(self) -> list[int]:
        """The logical shard ids this copy reads (after iteration started)."""
        return sorted(self._cursors)

    def shard_size(self, shard: int) -> int:
        """Number of documents in logical shard ``shard``."""
        total = int(self._offsets[-1])
        n = self.n_logical_shards
        return ((shard + 1) * total) // n - (shard * total) // n

    # -- shard order and plans ----------------------------------------------------------------
    def _order_rank(self, epoch: int) -> np.ndarray:
        ranks = self._order_cache.get(epoch)
        if ranks is None:
            ranks = shard_order_rank(self.seed, self.n_logical_shards, epoch)
            if len(self._order_cache) > 4:
                self._order_cache.clear()
            self._order_cache[epoch] = ranks
        return ranks

    def _pick_active(self) -> int | None:
        """The shard to read: pieces handed back by a rescale first, then the lowest epoch,
        then the epoch's shuffled shard order."""
        if self._active is None and self._returned_shards:
            self._active = self._returned_shards[0]
            return self._active
        if self._active is None and self._queue:
            epoch, _, sid = self._queue[0]
            if self.epochs is None or epoch < self.epochs:
                self._active = sid
        return self._active

    def _plan(self, sid: int, epoch: int) -> ShardPlan:
        if self._plan_cache is not None and self._plan_cache[:2] == (sid, epoch):
            return self._plan_cache[2]
        plan = self._make_plan(sid, epoch)
        self._plan_cache = (sid, epoch, plan)
        return plan

    def _walk(self, size: int, seed: int) -> RandomWalk:
        """The walk of a shard piece, kept while the piece is read (it builds a table once)."""
        walk = self._walk_cache
        if walk is None or walk.n != size or walk.seed != seed:
            walk = self._walk_cache = RandomWalk(size, seed)
        return walk

    def _make_plan(self, sid: int, epoch: int) -> ShardPlan:
        """Shard ``sid``'s plan in ``epoch``, made once per process (every restore builds new
        readers of the same shards)."""
        return _shard_plan_of(self._offsets_key, self.n_logical_shards, self.seed, sid, epoch)

    def _freeze(self, sid: int) -> None:
        """Record shard ``sid``'s cursor, now left, in the state's columns and extras: new
        objects for what changed (the old ones may be in states already handed out)."""
        c, row = self._cursors[sid], self._row[sid]
        columns = self._columns
        for k in COLUMNS:
            v, col = getattr(c, k), columns[k]
            if int(col[row]) != v:
                wider = np.array(col, np.int64)
                wider[row] = v
                if columns is self._columns:
                    columns = dict(columns)
                columns[k] = narrow(wider)
        self._columns = columns
        ex, key = c.extras(), str(sid)
        if ex != self._extras.get(key, {}):
            extras = dict(self._extras)
            if ex:
                extras[key] = ex
            else:
                del extras[key]
            self._extras = extras

    def _finish_epoch(self, sid: int) -> None:
        c = self._cursors[sid]
        c.epoch, c.pos, c.offset = c.epoch + 1, 0, 0
        self._freeze(sid)
        self._active = None
        heapq.heapreplace(self._queue, (c.epoch, int(self._order_rank(c.epoch)[sid]), sid))
        self._empty_run += self.shard_size(sid)
        if self._empty_run > 2 * self._owned_docs:
            if self._split is not None:
                raise ValueError(
                    f"dataset {self.dataset.name!r}: logical shards {self.owned_shards[:8]}... "
                    f"hold no document of the {self._split.subset!r} side of "
                    f"{self._split.split}, so this endless reader would never deliver one; "
                    f"{_split_advice(self._split)}"
                )
            raise ValueError(
                f"dataset {self.dataset.name!r}: a whole epoch of logical shards "
                f"{self.owned_shards[:8]}... gave no document: every document is shorter than "
                f"{self.min_length=} or was skipped; lower min_length or check the data"
            )

    # -- reading -------------------------------------------------------------------------------
    def _read_block(self, sid: int) -> DocumentBlock | None:
        c = self._cursors[sid]
        if self._returned_shards and self._returned_shards[0] == sid:
            return self._read_returned(sid, c)
        plan = self._plan(sid, c.epoch)
        if c.pos >= plan.size:
            self._finish_epoch(sid)
            return None
        j = int(np.searchsorted(plan.starts, c.pos, side="right")) - 1
        frag = plan.fragments[j]
        k = c.pos - int(plan.starts[j])
        if frag.file in c.skipped_files:  # known bad: skip again without a retry or a warning
            c.skips += int(plan.starts[j + 1]) - c.pos
            c.pos = int(plan.starts[j + 1])
            return None
        # walk positions k .. k + count are looked at; ends[i]: positions consumed once the
        # i-th document of doc_ids is done (documents on the other side of the split are
        # passed over, consumed like filtered ones)
        walk = self._walk(frag.size, plan.seeds[j])
        if self._split is None:
            count = min(self._docs_now, frag.size - k)
            doc_ids = walk.take(k, count) + frag.start
            ends = np.arange(1, count + 1)
        else:
            count = min(self._split.window(self._docs_now), frag.size - k)
            ids = walk.take(k, count) + frag.start
            rel = np.flatnonzero(self._split.keep(frag.file, ids))[: self._docs_now]
            if len(rel) == self._docs_now:
                count = int(rel[-1]) + 1
            if not len(rel):
                c.pos += count
                return None
            doc_ids, ends = ids[rel], rel + 1
        if frag.file != self._files.current_file and not self._switch_file(sid, c, plan, j):
            return None
        base = c.pos
        docs = self._fetch(frag.file, doc_ids, c)
        block = self._whole_docs_block(sid, frag.file, doc_ids, docs, c, count)
        if block is not False:
            return block
        pieces: list[Any] = []
        files: list[int] = []
        docnums: list[int] = []
        starts: list[int] = []
        lasts: list[bool] = []
        limit = self.max_chunksize
        for d, end, data in zip(doc_ids.tolist(), ends.tolist(), docs):
            if len(pieces) >= self._docs_now:
                break
            if data is not None:
                if self._strip_arr.size and not isinstance(data, str):
                    data = _strip(data, self._strip_arr)
                n = len(data)
                if n >= self.min_length and n > 0:
                    while len(pieces) < self._docs_now:
                        off = c.offset
                        stop = n if limit is None else min(n, off + limit)
                        pieces.append(data[off:stop])
                        files.append(frag.file)
                        docnums.append(d)
                        starts.append(off)
                        lasts.append(stop == n)
                        if stop == n:
                            c.offset = 0
                            break
                        c.offset = stop
                    if c.offset:
                        break  # the block is full in the middle of this document
            c.pos = base + end
        else:
            c.pos = base + count  # passed-over documents after the last one included
        if not pieces:
            return None
        return DocumentBlock.from_pieces(
            self.dataset.name,
            pieces,
            files,
            docnums,
            starts,
            lasts,
            shard=sid,
            epoch=c.epoch,
            dtype=self.dtype,
        )

    def _whole_docs_block(
        self,
        sid: int,
        file: int,
        doc_ids: np.ndarray,
        docs: Sequence[DocData | None],
        c: Cursor,
        count: int,
    ) -> DocumentBlock | None | Literal[False]:
        """The block of ``docs`` in one vectorised step when each is a whole token document
        that needs no cutting (the usual case): stripping ``strip_tokens`` looks only at the
        documents' ends, for all documents at once; None if none is long enough; False when
        the general per-document path must build it. ``count``: the walk positions the
        documents cover."""
        if c.offset or not docs or isinstance(docs[0], str):
            return False
        if not all(d is not None for d in docs):
            return False
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))  # type: ignore[arg-type]
        flat = _concat_as(docs, self.dtype)
        offsets = np.zeros(len(docs) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        lo, hi = offsets[:-1], offsets[1:]
        if self._strip_arr.size:
            lo, hi = _strip_ends(flat, lo, hi, self._strip_arr)
            lengths = hi - lo
        if self.max_chunksize is not None and int(lengths.max()) > self.max_chunksize:
            return False
        keep = lengths >= max(self.min_length, 1)
        c.pos += count
        if not keep.all():
            idx = np.flatnonzero(keep)
            if not len(idx):
                return None
            lo, hi, lengths, doc_ids = lo[idx], hi[idx], lengths[idx], doc_ids[idx]
        n = len(lengths)
        # something stripped or dropped (an empty document drops nothing from flat, but its
        # offset must go): gather what is kept
        if n != len(docs) or lengths.sum() != len(flat):
            out_offsets = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=out_offsets[1:])
            shift = np.repeat(lo - out_offsets[:-1], lengths)
            flat = flat[np.arange(int(out_offsets[-1]), dtype=np.int64) + shift]
            offsets = out_offsets
        return DocumentBlock(
            self.dataset.name,
            flat,
            None,
            offsets,
            np.full(n, file, np.int32),
            doc_ids.astype(np.int64, copy=False),
            np.zeros(n, np.int64),
            np.ones(n, bool),
            sid,
            c.epoch,
        )

    # -- switching files ---------------------------------------------------------------------
    def _switch_file(self, sid: int, c: Cursor, plan: ShardPlan, j: int) -> bool:
        """Make the file of fragment ``j`` of shard ``sid``'s plan the open one. False when it
        cannot be read and ``on_error="skip"``: its documents are then skipped and recorded."""
        file = plan.fragments[j].file
        url = self.dataset.files[file]
        self._files.handler()  # built outside the try: a broken handler setup is no bad file
        try:
            n = self._open_prefetching(file, self._upcoming(sid, c, plan, j))
        except RemoteError:
            raise  # an outage or an access problem, never a bad file to skip
        except READ_ERRORS as exc:  # a bad file; anything else is a bug and propagates
            if self.on_error == "raise":
                raise
            logger.warning("skipping unreadable file %s (%s)", url, exc)
            c.skipped_files.append(file)
            c.skips += int(plan.starts[j + 1]) - c.pos
            c.pos = int(plan.starts[j + 1])
            return False
        if n != self.dataset.doc_counts[file]:
            self._files.close(discard=True)
            raise ValueError(
                f"{url}: has {n} documents but the dataset index counted "
                f"{int(self.dataset.doc_counts[file])}; the file changed since it was counted: "
                "delete its row in meta/*counts*.csv (or the file) and rebuild the index"
            )
        return True

    def _open_prefetching(self, file: int, upcoming: Iterator[int]) -> int:
        """Open ``file`` for the walk (see :meth:`FileAccess.open`); its document count.

        The one place the walk opens a file (tests spy on it and on :attr:`_prefetching`)."""
        return self._files.open(file, upcoming)

    @property
    def _prefetching(self) -> list[str]:
        """The URLs this reader holds prefetched in the cache."""
        return self._files.prefetching

    def _upcoming(self, sid: int, c: Cursor, plan: ShardPlan, j: int) -> Iterator[int]:
        """The files this worker opens after fragment ``j`` of shard ``sid``, in order (known
        bad ones left out; repeats possible): the rest of its plan, then the next shards, as far
        as ``prefetch_shards`` looks ahead. Lazy: only read when prefetching applies."""
        for frag in plan.fragments[j + 1 :]:
            if frag.file not in c.skipped_files:
                yield frag.file
        for epoch, _, other in heapq.nsmallest(4 * self.prefetch_shards + 2, self._queue):
            if other == sid:
                continue
            if self.epochs is not None and epoch >= self.epochs:
                break
            oc = self._cursors[other]
            oplan = self._make_plan(other, oc.epoch)
            k = max(int(np.searchsorted(oplan.starts, oc.pos, side="right")) - 1, 0)
            for frag in oplan.fragments[k:]:
                if frag.file not in oc.skipped_files:
                    yield frag.file

    def _fetch(self, file: int, doc_ids: np.ndarray, c: Cursor) -> list[DocData | None]:
        """Documents ``doc_ids`` of the open file ``file``; None for each skipped one."""
        files = self._files
        skipped = {d for f, d in c.skipped_docs if f == file} if c.skipped_docs else set()
        if not skipped:
            try:
                return list(files.get_many(doc_ids))
            except READ_ERRORS:
                if self.on_error == "raise":
                    raise
        out: list[DocData | None] = []
        for d in doc_ids.tolist():
            if d in skipped:
                out.append(None)
                continue
            try:
                out.append(files.get(d))
            except READ_ERRORS as exc:
                if self.on_error == "raise":
                    raise
                logger.warning(
                    "skipping unreadable document %d of %s (%s)", d, self.dataset.files[file], exc
                )
                c.skipped_docs.append([file, d])
                c.skips += 1
                skipped.add(d)
                out.append(None)
        return out

    # -- state checks --------------------------------------------------------------------------
    def _check_state(self, state: dict[str, Any]) -> None:
        if state["dataset"] != self.dataset.name:  # states meet readers by name, never by place
            raise ValueError(
                f"cannot restore dataset {self.dataset.name!r} from the reader state of dataset "
                f"{state['dataset']!r}: the pipeline puts its datasets (or curriculum phases) "
                "in other places than the checkpoint; restore with the checkpoint's phases"
            )
        for key, mine in (
            ("fingerprint", self._fingerprint),
            ("seed", self.seed),
            ("n_logical_shards", self.n_logical_shards),
        ):
            if state[key] != mine:
                what = {
                    "fingerprint": "the dataset's files or document counts differ",
                    "seed": "the seed differs",
                    "n_logical_shards": "n_logical_shards differs",
                }[key]
                raise ValueError(
                    f"cannot restore dataset {self.dataset.name!r}: {what} "
                    f"(checkpoint {key}={state[key]!r}, this reader {key}={mine!r}); "
                    f"restore with the same data, seed and n_logical_shards as the checkpoint"
                )
        theirs = state.get("split")  # states written before splits existed have none
        if theirs != self._split_state():
            raise ValueError(
                f"cannot restore dataset {self.dataset.name!r}: the held-out evaluation split "
                f"differs (checkpoint split={theirs!r}, this reader split="
                f"{self._split_state()!r}); a restore with another split would deliver documents "
                "of the other side or repeat them: restore with the checkpoint's eval_fraction, "
                "split seed and subset"
            )


def _strip_ends(
    flat: np.ndarray, lo: np.ndarray, hi: np.ndarray, strip: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per document ``flat[lo[i]:hi[i]]``, the range left after removing ``strip`` tokens from
    both ends (as :func:`_strip`), looking only at the ends: one vectorised step per token
    removed from the deepest end, usually one or two."""
    lo, hi = lo.copy(), hi.copy()
    for front in (True, False):
        todo = np.flatnonzero(lo < hi)
        while len(todo):
            at = lo[todo] if front else hi[todo] - 1
            todo = todo[_is_any(flat[at], strip)]
            if front:
                lo[todo] += 1
            else:
                hi[todo] -= 1
            todo = todo[lo[todo] < hi[todo]]
    return lo, hi


def _is_any(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.isin(values, ids)``, by comparisons when there are a few ids (the usual one or
    two strip tokens: ``isin`` sorts, ~10x slower on a block's few hundred document ends)."""
    if len(ids) > 4:
        return np.isin(values, ids)
    out = values == ids[0]
    for i in ids[1:]:
        out |= values == i
    return out


def _strip(data: np.ndarray, strip: np.ndarray) -> np.ndarray:
    lo, hi = 0, len(data)
    while lo < hi and data[lo] in strip:
        lo += 1
    while hi > lo and data[hi - 1] in strip:
        hi -= 1
    return data[lo:hi]


def _split_advice(split: SplitFilter) -> str:
    """What to change when shards hold no document of ``split``'s side (train or eval)."""
    fraction = split.split.eval_fraction
    if split.subset == "train":
        none = f"eval_fraction={fraction} holds out every document; " if fraction >= 1.0 else ""
        return f"{none}lower eval_fraction (training keeps the rest) or lower min_length"
    more = "" if fraction >= 1.0 else "raise eval_fraction or "
    return f"use epochs=1 for evaluation, or {more}lower min_length"


def _concat_as(docs: Sequence[Any], dtype: np.dtype) -> np.ndarray:
    """``docs`` concatenated as ``dtype`` (an unsafe cast, as a reader's ``dtype`` promises):
    integers of ``dtype``'s width concatenated as they are and viewed as ``dtype`` (the same
    bits as the cast, without the cast's slower copy loop)."""
    src = getattr(docs[0], "dtype", None)
    if (
        src is not None
        and src.itemsize == dtype.itemsize
        and src.kind in "iu"
        and dtype.kind in "iu"
    ):
        flat = np.concatenate(docs)
        if flat.dtype == src:  # every document of that type
            return flat.view(dtype)
        return flat.astype(dtype)
    return np.concatenate(docs, dtype=dtype, casting="unsafe")
