"""Rescale runs in one process, and the row oracle (:mod:`torchdata_ext.audit.row_check`) on them.

:func:`simulate` runs a pipeline at ``R x W`` global workers in this process, takes each
worker's graph state after a few rows, rescales to ``R' x W'`` (and optionally again) through
:func:`~torchdata_ext.checkpoint.rescale.rescale_worker_states`, exactly as ``load_checkpoint`` does,
and finishes the epoch: the streams it returns are what real workers would deliver.
:func:`check_rows` asserts that those rows are rows an uninterrupted run could have made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchdata_ext import World
from torchdata_ext.audit.row_check import RowRules, boundary_problems, row_problems
from torchdata_ext.batch import boundaries, position_starts
from torchdata_ext.checkpoint.rescale import rescale_worker_states
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig

Key = tuple[str, int, int]


def check_rows(
    streams: Sequence[Sequence[dict[str, Any]]],
    lengths: dict[Key, int],
    cfg: PipelineConfig,
    *,
    budget: bool = False,
) -> None:
    """Assert :func:`~torchdata_ext.audit.row_check.row_problems` finds nothing in ``streams`` (lists
    of delivered item dicts with a ``provenance`` table and the ``_names`` its ids index), nor
    :func:`~torchdata_ext.audit.row_check.boundary_problems` in each row's ``seq_lens``."""
    problems = [
        p
        for s, stream in enumerate(streams)
        for r, item in enumerate(stream)
        if "seq_lens" in item
        for p in boundary_problems(
            f"stream {s} row {r}",
            item["provenance"],
            item["_names"],
            item["seq_lens"],
            cfg.seq_length,
        )  # fmt: skip
    ]
    problems += row_problems(
        [[(item["provenance"], item["_names"]) for item in stream] for stream in streams],
        lengths,
        RowRules.of(cfg),
        ordered=cfg.shuffle_buffer == 1,
        budget=budget,
    )
    assert not problems, "\n".join(problems)


def _take(node: Any, n: int | None, out: list[dict[str, Any]]) -> None:
    """Append up to ``n`` items (all with None) of ``node`` to ``out``, each with the dataset
    names its provenance ids index (the Pack's, which grow as datasets are met)."""
    pack = _pack_of(node)
    while n is None or n > 0:
        try:
            item = next(node)
        except StopIteration:
            return
        pos = np.asarray(item["position_ids"])[None]  # boundaries as Collate's of dicts
        out.append(
            {
                "provenance": item["provenance"],
                "_names": list(pack.dataset_names),
                "seq_lens": boundaries(position_starts(pos), 1, pos.shape[1], ("seq_lens",))[
                    "seq_lens"
                ][0],
            }
        )
        if n is not None:
            n -= 1


def _pack_of(node: Any) -> Any:
    from torchdata_ext.nodes.pack import Pack
    from torchdata_ext.state.graph import graph_nodes

    (pack,) = [x for x in graph_nodes(node) if isinstance(x, Pack)]
    return pack


def simulate(
    cfg: PipelineConfig,
    topologies: Sequence[tuple[int, int]],
    steps: Callable[[int, int], int],
    restore_cfg: PipelineConfig | None = None,
) -> list[list[dict[str, Any]]]:
    """Run ``cfg`` at ``topologies[0]`` (ranks, workers per rank) global workers in this
    process, each for ``steps(phase, worker)`` rows, then rescale to each next topology and run
    again; the last one runs to the end of the epoch. Returns every worker's stream of every
    phase. ``restore_cfg`` (e.g. the datasets listed in another order) builds the graphs of the
    phases after the first."""
    streams: list[list[dict[str, Any]]] = []
    graphs: dict[int, dict[str, Any]] = {}
    prev: tuple[int, int] | None = None
    for phase, (R, W) in enumerate(topologies):
        conf = cfg if phase == 0 or restore_cfg is None else restore_cfg
        make = functools.partial(build_pipeline, conf, collate=False)
        final = phase == len(topologies) - 1
        new_graphs = {}
        for g in range(R * W):
            world = World(g // W, R, g % W, W)
            node = make(world)
            if prev is None:
                node.reset(None)
            else:
                node.reset(rescale_worker_states(graphs, prev, world, make))
            out: list[dict[str, Any]] = []
            _take(node, None if final else steps(phase, g), out)
            streams.append(out)
            new_graphs[g] = node.state_dict()
        graphs, prev = new_graphs, (R, W)
    return streams
