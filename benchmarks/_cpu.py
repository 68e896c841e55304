"""CPU time and resident memory of a benchmark's process tree (Linux ``/proc``)."""

from __future__ import annotations

import os


def _stats() -> dict[int, list[str]]:
    """Every process's ``/proc/<pid>/stat`` fields after the command name, by pid."""
    out: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
    return out


def _tree(stats: dict[int, list[str]]) -> set[int]:
    """This process and its live descendants."""
    tree, todo = {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        kids = [c for c, rest in stats.items() if int(rest[1]) == parent and c not in tree]
        tree.update(kids)
        todo.extend(kids)
    return tree


def tree_rss() -> int:
    """Resident bytes now of this process and its live descendants (the sum of their RSS;
    pages shared between them, e.g. a forked worker's copy of the parent, count in each)."""
    stats = _stats()
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(stats[p][21]) * page for p in _tree(stats) if p in stats)


def tree_cpu() -> float:
    """CPU seconds so far of this process and its live descendants (dataloader workers; Linux
    ``/proc``): on a shared machine a better measure than wall time, which more processes win
    by taking a larger share of contended cores."""
    stats = _stats()
    ticks = sum(int(stats[p][11]) + int(stats[p][12]) for p in _tree(stats) if p in stats)
    return ticks / os.sysconf("SC_CLK_TCK")  # utime + stime
