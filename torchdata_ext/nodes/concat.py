"""The curriculum node: deliver one source until it ends, then the next (phases).

``Concat([phase0, phase1, ...])`` yields everything ``phase0`` yields, then, when it raises
``StopIteration``, everything ``phase1`` yields, and so on; it ends after the last. A phase is
any node of document blocks: a reader with ``epochs=1`` (the phase ends when the dataset is
exhausted), an :class:`~torchdata_ext.nodes.interleave.Interleave` of several (a weighted mix,
ending when all its finite sources have), or either wrapped in a
:class:`~torchdata_ext.nodes.take.Take` (the phase ends after exactly N tokens or N documents
of the whole run). So the stop rule of a phase is its source's end, and a budget is a ``Take``:
one definition of the budget, its exact per-worker split and its re-split on a rescale.

Where the switch falls: a phase that ends by exhaustion ends at a document boundary; a phase
with a token budget ends exactly at N tokens, cutting its last document (the rest is not
delivered in this run, see ``Take``); use ``max_documents`` for phases that end between whole
documents. Each worker switches when its own share of a phase ends, so within a worker's stream
all of phase ``i``'s documents come before phase ``i + 1``'s; across workers (and after a
shuffle buffer, which mixes a few thousand sequences around the switch) the phases overlap a
little.

State (each phase's state under its index, read strictly)::

    {"phase": int,                       # the phase being delivered (len(phases) at the end)
     "phases": {"0": <phase 0 state>, "1": <phase 1 state>, ...}}

Every phase's state is kept, also before it starts (fresh) and after it ended (final), so the
state has a fixed shape and a rescale finds every reader's cursors in it. Resume guarantee:
restoring a state continues with exactly the items the uninterrupted run would have produced.

Rescaling: a new worker starts at phase 0 with every phase's readers and budgets re-split from
the old workers; a phase whose shards are done (or whose budget share is 0) ends at its first
pull, so the new worker goes straight on to the first phase it still has data for. Old workers
in different phases are thereby merged correctly: the rest of an earlier phase comes first.
A dataset may be read by one phase only (two readers of one dataset would each walk its epoch,
repeating documents): :class:`Concat` refuses a graph where two phases read the same dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from torchdata.nodes import BaseNode

from torchdata_ext.handlers.base import DocData
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.state.graph import graph_nodes

__all__ = ["Concat"]

T = TypeVar("T")


class Concat(BaseNode[T], Generic[T]):
    """Deliver each phase's items until it ends, then the next phase's.

    Args:
        phases: the phases in order, each a node (a non-last phase must end: a finite reader or
            mix, or a ``Take``; an endless phase is never left).

    Raises:
        TypeError: ``phases`` is not a sequence of nodes.
        ValueError: no phases, the same node twice, or two phases read the same dataset.
    """

    PHASE_KEY = "phase"
    PHASES_KEY = "phases"

    def __init__(self, phases: Sequence[BaseNode[T]]) -> None:
        super().__init__()
        if isinstance(phases, (str, bytes)) or not isinstance(phases, Sequence):
            raise TypeError(f"phases={phases!r} must be a list of torchdata.nodes.BaseNode")
        if not phases:
            raise ValueError("phases is empty; pass at least one node")
        for i, node in enumerate(phases):
            if not isinstance(node, BaseNode):
                raise TypeError(f"phases[{i}]={node!r} must be a torchdata.nodes.BaseNode")
        if len({id(p) for p in phases}) != len(phases):
            raise ValueError("phases holds the same node twice; give each phase its own node")
        self.phases: list[BaseNode[T]] = list(phases)
        seen: dict[str, int] = {}
        for i, node in enumerate(self.phases):
            readers = [n for n in graph_nodes(node) if isinstance(n, ShardReader)]
            for name in sorted({r.dataset.name for r in readers}):
                if name in seen:
                    raise ValueError(
                        f"dataset {name!r} is read in phase {seen[name]} and phase {i}; a dataset "
                        "belongs to one phase (two readers would each walk its epoch and repeat "
                        "documents): give the later phase another dataset or a copy under "
                        "another name"
                    )
                seen[name] = i
        self._phase = 0
        # the states of the phases not being delivered: they change only when delivered, so
        # each is taken once (and the same object handed out until then)
        self._idle: dict[int, Any] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._idle = {}
        if initial_state is None:
            self._phase = 0
            for node in self.phases:
                node.reset()
            return
        saved = initial_state[self.PHASES_KEY]
        if set(saved) != {str(i) for i in range(len(self.phases))}:
            raise ValueError(
                f"the Concat state has phases {sorted(saved)} but this node has "
                f"{len(self.phases)}; restore with the same phases"
            )
        self._phase = int(initial_state[self.PHASE_KEY])
        for i, node in enumerate(self.phases):
            node.reset(saved[str(i)])

    def next(self) -> T:
        while self._phase < len(self.phases):
            try:
                return next(self.phases[self._phase])
            except StopIteration:
                self._idle[self._phase] = self.phases[self._phase].state_dict()
                self._phase += 1
                self._idle.pop(self._phase, None)
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        states = {}
        for i, node in enumerate(self.phases):
            if i == self._phase:
                states[str(i)] = node.state_dict()
                continue
            if i not in self._idle:
                self._idle[i] = node.state_dict()
            states[str(i)] = self._idle[i]
        return {self.PHASE_KEY: self._phase, self.PHASES_KEY: states}

    @property
    def phase(self) -> int:
        """The phase being delivered (``len(phases)`` once all ended)."""
        return self._phase

    # -- provenance / rescale ------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Nothing: Concat passes items on as it gets them (the phases report their own)."""
        return []

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file ``file`` of ``dataset``, from the phase that reads it.

        Raises:
            KeyError: no phase reads ``dataset``.
        """
        for node in self.phases:
            fetch = getattr(node, "fetch_document", None)
            if fetch is None:
                continue
            try:
                return fetch(dataset, file, doc)
            except KeyError:
                continue
        raise KeyError(f"no phase of this Concat reads dataset {dataset!r}")
