"""State deltas: what changed between two states of a node graph, and applying it.

A dataloader worker reports its graph's state with every batch. Sending the whole state each
time (a megabyte with a 10,000-sequence shuffle buffer) costs more than the batch; but between
two batches only a few parts change (a cursor moved, a few buffer slots replaced). :func:`diff`
lists those parts as operations on paths into the state tree, and :func:`apply` plays them on
the previous state to give the new one.

The diff relies on one contract every node of this package keeps (tested at every step over
random pipelines in ``tests/test_state_delta.py``):

    *A state value is never mutated after ``get_state`` returned it.* A node may return the
    same object again when it has not changed (the reader's frozen cursors, the shuffle
    buffer's cached provenance blocks); it never changes an object it has handed out.

So an object identical (``is``) to the one sent before is unchanged and skipped without
looking inside; only what is new is compared. A value built only when read (the shuffle
buffer's provenance, journaled per draw) has a ``__state_value__()`` method giving the plain
value it stands for, which is what is compared and sent. If it also has
``__state_diff__(prev)``, that gives the change since the value before in its own terms (the
shuffle buffer's: the slots drawn since, :class:`~torchdata_ext.nodes.shuffle_state.JournalDelta`),
which is sent instead and played by the change's ``apply_to(old)``; it gives None when it
cannot tell (the plain values are then compared), a false change when nothing changed.
:func:`apply` copies a container on
a changed path once per delta and never writes into a state it was given, so states handed out
earlier (``TokenLoader.state_dict()`` results) stay valid: taking a state costs nothing.

Operations are tuples ``(path, kind, value)``:

* ``SET``: put ``value`` at ``path`` (``path == ()`` replaces the whole state);
* ``DELETE``: remove the dict key at ``path``;
* ``RESIZE``: the list at ``path`` keeps its first ``value[0]`` items and gets ``value[1]``
  appended;
* ``PATCH``: the 1-D array at ``path``, copied, gets ``value[1]`` (a list) at positions
  ``value[0]`` (a list), for an array of the same shape and dtype where few elements changed
  (a reader's cursor column when one shard of 1,000s was left);
* ``CHANGE``: the value at ``path`` becomes ``value.apply_to(old)``, ``value`` being what the
  new value's ``__state_diff__(old)`` gave (it never writes into ``old``).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

__all__ = ["CHANGE", "DELETE", "PATCH", "RESIZE", "SET", "Op", "apply", "diff"]

SET, DELETE, RESIZE, PATCH, CHANGE = 0, 1, 2, 3, 4
Op = tuple[tuple[Any, ...], int, Any]
_MISSING = object()
_SCALARS = (int, float, str, bytes, bool, type(None), np.integer, np.floating, np.bool_)


def diff(prev: Any, cur: Any) -> list[Op]:
    """The operations that turn state ``prev`` into state ``cur`` (see the module docstring).

    Args:
        prev: the state sent before (``None``: nothing was sent; the result sets the whole
            state).
        cur: the current state: dicts, lists, tuples, NumPy arrays and scalars.

    Returns:
        The operations, parents before children; empty when nothing changed.
    """
    ops: list[Op] = []
    if prev is None:
        return [((), SET, cur)]
    _diff(prev, cur, (), ops)
    return ops


def _diff(prev: Any, cur: Any, path: tuple[Any, ...], ops: list[Op]) -> None:
    if cur is prev:
        return
    tc = type(cur)
    if tc is not type(prev):
        if hasattr(tc, "__state_value__") or hasattr(type(prev), "__state_value__"):
            _diff(_plain(prev), _plain(cur), path, ops)  # e.g. a restored state's plain list
        else:
            ops.append((path, SET, cur))
    elif tc is dict:
        if len(cur) > 16 and len(cur) == len(prev):
            keys = list(cur)
            if keys == list(prev):  # same keys in the same order (a reader's 1,000s of cursors)
                # the changed entries, found in C as for lists
                for k in itertools.compress(
                    keys, map(operator.is_not, prev.values(), cur.values())
                ):
                    _diff(prev[k], cur[k], (*path, k), ops)
                return
        for k, v in cur.items():
            p = prev.get(k, _MISSING)
            if p is v:  # the common case, checked here: a call per unchanged entry adds up
                continue
            if p is _MISSING:
                ops.append(((*path, k), SET, v))
            else:
                _diff(p, v, (*path, k), ops)
        for k in prev:
            if k not in cur:
                ops.append(((*path, k), DELETE, None))
    elif tc is list:
        common = min(len(prev), len(cur))
        # the changed positions, found in C (a list of 2,500 cached buffer blocks each batch)
        for i in itertools.compress(range(common), map(operator.is_not, prev, cur)):
            _diff(prev[i], cur[i], (*path, i), ops)
        if len(cur) != len(prev):
            ops.append((path, RESIZE, (common, cur[common:])))
    elif tc is np.ndarray:
        if cur.shape != prev.shape or cur.dtype != prev.dtype:
            ops.append((path, SET, cur))
        elif cur.ndim != 1 or cur.dtype.kind not in "biu":
            if not np.array_equal(cur, prev):
                ops.append((path, SET, cur))
        else:
            changed = np.flatnonzero(cur != prev)
            if changed.size * (8 + cur.itemsize) * 2 < cur.nbytes:  # few: their places
                if changed.size:
                    ops.append((path, PATCH, (changed.tolist(), cur[changed].tolist())))
            elif changed.size:
                ops.append((path, SET, cur))
    elif isinstance(cur, _SCALARS):
        if cur != prev:
            ops.append((path, SET, cur))
    elif hasattr(tc, "__state_value__"):  # built when read: compared as what it stands for
        state_diff = getattr(tc, "__state_diff__", None)
        change = state_diff(cur, prev) if state_diff is not None else None
        if change is None:
            _diff(prev.__state_value__(), cur.__state_value__(), path, ops)
        elif change:  # false: nothing changed
            ops.append((path, CHANGE, change))
    elif not _equal(prev, cur):  # tuples and anything else: compared whole
        ops.append((path, SET, cur))


def _plain(x: Any) -> Any:
    """``x``, or the plain value it stands for if it is built when read."""
    value = getattr(type(x), "__state_value__", None)
    return x if value is None else value(x)


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def apply(state: Any, ops: list[Op]) -> Any:
    """The state after ``ops`` (from :func:`diff`); ``state`` itself is left unchanged.

    Each container on a changed path is copied once (a delta touching eight slots of a
    2,500-slot list copies that list once), everything else is shared with ``state``.
    """
    if not ops:
        return state
    fresh: dict[int, Any] = {}  # containers copied in this call: safe to write into

    def own(x: Any) -> Any:
        if id(x) in fresh:
            return x
        c = dict(x) if type(x) is dict else list(x)
        fresh[id(c)] = c  # kept alive until the end of the call, so ids are not reused
        return c

    root = state
    # the containers (owned) from the root down to the previous op's parent: consecutive ops
    # share most of their path (a few cursors of one reader), walked once
    chain: list[Any] = []
    above: tuple[Any, ...] = ()  # the previous op's parent path
    for path, kind, value in ops:
        if not path:
            if kind == PATCH:
                root = np.array(root)
                root[np.asarray(value[0], np.int64)] = value[1]
            elif kind == CHANGE:
                root = value.apply_to(root)
            elif kind != SET:  # a list resize at the root
                root = own(root)
                del root[value[0] :]
                root.extend(value[1])
            else:
                root = value
            chain, above = [], ()
            continue
        if not chain:
            root = own(root)
            chain = [root]
        parents = path[:-1]
        k, most = 0, min(len(parents), len(above))
        while k < most and parents[k] == above[k]:
            k += 1
        del chain[k + 1 :]  # never the target of an op before: only parents are kept
        node = chain[k]
        for key in parents[k:]:
            child = own(node[key])
            node[key] = child
            node = child
            chain.append(child)
        above = parents
        last = path[-1]
        if kind == SET:
            node[last] = value
        elif kind == DELETE:
            del node[last]
        elif kind == PATCH:  # never written in place: the old array may be in a state given out
            arr = np.array(node[last])
            arr[np.asarray(value[0], np.int64)] = value[1]
            node[last] = arr
        elif kind == CHANGE:
            node[last] = value.apply_to(node[last])
        else:
            child = own(node[last])
            del child[value[0] :]
            child.extend(value[1])
            node[last] = child
    return root
