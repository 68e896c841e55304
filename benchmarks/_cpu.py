"""CPU time of a benchmark's process tree (Linux ``/proc``), for rates per CPU second."""

from __future__ import annotations

import os


def _tree(procs: dict[int, int]) -> set[int]:
    """This process and its live descendants, from ``{pid: ppid}``."""
    tree, todo = {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        kids = [c for c, pp in procs.items() if pp == parent and c not in tree]
        tree.update(kids)
        todo.extend(kids)
    return tree


def tree_rss() -> int:
    """Resident bytes now of this process and its live descendants (the sum of their RSS;
    pages shared between them, e.g. a forked worker's copy of the parent, count in each)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(d)] = int(rest[1])
            rss[int(d)] = int(rest[21]) * page
    return sum(rss[p] for p in _tree(parents) if p in rss)


def tree_cpu() -> float:
    """CPU seconds so far of this process and its live descendants (dataloader workers; Linux
    ``/proc``): on a shared machine a better measure than wall time, which more processes win
    by taking a larger share of contended cores."""
    procs: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            procs[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))  # ppid, utime+stime
    tree = _tree({p: pp for p, (pp, _) in procs.items()})
    return sum(procs[p][1] for p in tree if p in procs) / os.sysconf("SC_CLK_TCK")
