"""Replay a run's batches from a loader checkpoint: what step ``n`` of rank ``r`` held.

:func:`show_batches` restores the checkpoint into a :class:`~torchdata_ext.loader.token_loader.TokenLoader`
that never iterates (the same restore as the training job's, so a rescale onto another
topology is planned exactly as the job would plan it), takes its state, and runs each worker's
graph in this process, in the order the loader delivers: round robin over the rank's workers
from its ``next_worker``, a worker whose stream ended passed over, the ``skip_batches``
batches the checkpoint had already delivered dropped. Steps are the training loop's, counted
from 1 over the whole run (the loader's ``state_dict()["step"]``; a checkpoint saved after
step ``n`` replays from step ``n + 1``).

Fast-forward: steps before the first one shown take their rows in the packer's compact form
(``next_packed``) and drop them, so no row dict and no batch tensor is made for them; a row
that a restored shuffle buffer holds only by provenance is not read again either.

What a row shows (:func:`row_record`): its ``pieces`` (dataset, file, document, token range of
the document, and where the piece sits in the row), the ``specials`` the packer placed (BOS,
EOS, separators, padding: token id, position, count, and the document a BOS/EOS belongs to),
its ``input_ids`` as the trainer received them (and ``labels`` with ``shift``), and with
``text=True`` each piece decoded through the config's tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.checkpoint.dcp_entries import is_dcp_checkpoint
from torchdata_ext.checkpoint.folder import load_checkpoint, read_manifest
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.loader.weights import WeightChanges
from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig, as_config
from torchdata_ext.progress import Progress
from torchdata_ext.provenance import PAD, literal_owner
from torchdata_ext.remote.urls import storage_options_of
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.world import World

__all__ = ["parse_steps", "replay_rank", "row_record", "show_batches"]

logger = logging.getLogger(__name__)


def parse_steps(steps: str | int | range | Sequence[int]) -> range:
    """The steps to show: ``"A"`` / ``A`` (one step), ``"A:B"`` / ``range(A, B)`` (``B``
    excluded), or a sequence of consecutive steps."""
    if isinstance(steps, range):
        out = steps
    elif isinstance(steps, (int, np.integer)) and not isinstance(steps, bool):
        out = range(int(steps), int(steps) + 1)
    elif isinstance(steps, str):
        a, sep, b = steps.partition(":")
        try:
            out = range(int(a), int(b)) if sep else range(int(a), int(a) + 1)
        except ValueError:
            raise ValueError(
                f"steps={steps!r}: give a step A or a range A:B (B excluded), e.g. 25:36"
            ) from None
    else:
        got = [int(s) for s in cast(Sequence[int], steps)]
        if not got or got != list(range(got[0], got[0] + len(got))):
            raise ValueError(f"steps={steps!r}: give consecutive steps, e.g. range(25, 36)")
        out = range(got[0], got[-1] + 1)
    if out.step != 1 or len(out) == 0 or out.start < 1:
        raise ValueError(
            f"steps={steps!r}: give a non-empty range of steps >= 1 (the training loop's, "
            "counted from 1), e.g. 25:36"
        )
    return out


def _restored(
    cfg: PipelineConfig,
    checkpoint: str,
    rank: int,
    ranks: int,
    workers: int,
    storage_options: dict[str, Any] | None,
    key: str | None,
) -> dict[str, Any]:
    """The state a training job at ``ranks x workers`` restoring ``checkpoint`` would start
    rank ``rank`` from (``TokenLoader.state_dict()`` of a loader that never iterates)."""
    loader = TokenLoader(
        functools.partial(build_pipeline, cfg), num_workers=workers, rank=rank, world_size=ranks
    )
    if is_dcp_checkpoint(checkpoint, storage_options):
        _load_dcp(loader, checkpoint, storage_options, key)
    else:
        load_checkpoint(loader, checkpoint, storage_options=storage_options)
    return loader.state_dict()


def _load_dcp(
    loader: TokenLoader, url: str, storage_options: dict[str, Any] | None, key: str | None
) -> None:
    """Restore ``loader`` from the loader state in DCP checkpoint ``url`` (this process
    alone, no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from torchdata_ext.checkpoint.dcp import DCPLoaderState
    from torchdata_ext.checkpoint.dcp_entries import entry_files, read_metadata, reader_for
    from torchdata_ext.checkpoint.dcp_read import loader_key
    from torchdata_ext.checkpoint.dcp_seal import damaged

    reader = reader_for(url, None, storage_options)
    metadata = read_metadata(reader)
    key = loader_key(metadata, key, url)
    state = DCPLoaderState(loader, storage_reader=reader, key=key)
    try:
        dcp.load({key: state}, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:  # a truncated or damaged data file
        raise damaged(url, exc, sorted(set(entry_files(metadata, key).values()))) from None


def _manifest(
    checkpoint: str, storage_options: dict[str, Any] | None, key: str | None
) -> dict[str, Any]:
    if is_dcp_checkpoint(checkpoint, storage_options):
        from torchdata_ext.checkpoint.dcp_read import read_dcp_manifest

        return read_dcp_manifest(checkpoint, storage_options, key=key)
    return read_manifest(checkpoint, storage_options)


def replay_rank(
    cfg: PipelineConfig, state: dict[str, Any], steps: range
) -> Iterator[tuple[int, int, list[dict[str, np.ndarray]]]]:
    """Rank ``state``'s batches of ``steps`` (a :class:`TokenLoader` state, as
    ``state_dict()`` gives it), as ``(step, logical worker, rows)``: each row the packer's
    output dict (``input_ids``, ``labels`` with shift, ``provenance``, ...), and the dataset
    names its provenance ids index as ``rows[i]["_names"]``. Stops at the end of the run."""
    R, W, r = int(state["world_size"]), int(state["num_workers"]), int(state["rank"])
    # the weights in force at each step: the run's set_weights calls and weight_schedule
    weights = WeightChanges.of_state(state, functools.partial(build_pipeline, cfg))
    step = int(state.get("step", 0)) - int(state["skip_batches"])
    roots: dict[int, BaseNode] = {}
    packs: dict[int, Pack] = {}

    def start(w: int, graph: Any) -> None:  # worker w's graph for step + 1, from ``graph``
        root = weights.build_for(step + 1)(World(r, R, w, W), collate=False)
        packs[w] = _pack(root)  # found before a restore fills the buffers
        root.reset(graph)
        roots[w] = root

    for w in range(W):
        start(w, state["workers"][str(r * W + w)]["graph"][Collate.SOURCE_KEY])
    skips = {int(a): int(b) - int(a) for a, b in state.get("skip_steps", [])}
    live, w, dropping = list(range(W)), int(state["next_worker"]) % W, 0
    progress = Progress(  # the steps before the first shown, dropped unread
        f"rank {r}: fast-forwarding from step {step} (the checkpoint's) to step {steps.start} "
        f"(a checkpoint saved nearer step {steps.start} replays faster)", logger,
        total=max(0, steps.start - 1 - step), unit="steps", level=logging.WARNING,
    )  # fmt: skip
    with progress:
        while live and step < steps.stop - 1:
            if w not in live:
                w = (w + 1) % W
                continue
            if not dropping:  # the data of a skipped range is made and dropped, as the loader does
                dropping = skips.pop(step + 1, 0)
            show = not dropping and step + 1 >= steps.start
            rows = _take(roots[w], cfg.batch_size, show)
            if not rows:  # the worker's stream ended: the loader goes on with the next one
                live.remove(w)
                w = (w + 1) % W
                continue
            if dropping:
                dropping -= 1
            else:
                step += 1
                if step < steps.start:
                    progress.update()
                elif step == steps.start:
                    progress.close()
                if show:
                    names = list(packs[w].dataset_names)
                    for row in rows:
                        row["_names"] = names
                    yield step, w, rows
                if weights.due_at(step + 1):  # the loader restarts its workers with the new weights
                    for v in live:
                        start(v, roots[v].state_dict())
            w = (w + 1) % W


def _take(root: BaseNode, n: int, show: bool) -> list[Any]:
    """The next batch's rows (Collate's ``_take``): dicts when ``show``, else the compact
    items, dropped unread."""
    packed = getattr(root, "next_packed", None)
    out: list[Any] = []
    for _ in range(n):
        try:
            if show or packed is None:
                out.append(next(root))
            else:
                out.append(packed())
        except StopIteration:
            break
    return out


def _pack(root: BaseNode) -> Pack:
    (pack,) = [n for n in graph_nodes(root) if isinstance(n, Pack)]
    return pack


def row_record(
    row: dict[str, Any],
    names: Sequence[str] | np.ndarray,
    files: dict[str, list[str]] | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """One packed row as plain data: ``pieces`` (``dataset``, ``file`` number, ``file_name``
    when ``files`` lists the datasets' files, ``doc``, ``start``/``stop`` token range in the
    document, ``at``: position in the row), ``specials`` (``token``, ``at``, ``count``,
    ``kind``: ``"special"`` or ``"pad"``, and for a BOS/EOS the ``dataset``/``file``/``doc`` it
    belongs to), ``input_ids`` (and ``labels``) as lists, and with ``tokenizer`` each piece's
    ``text``.

    Args:
        row: the packer's output dict (``provenance``, ``input_ids``, ...).
        names: the dataset names the provenance ids index.
        files: per dataset, its files' names in file-number order (``DatasetIndex.file_names``).
        tokenizer: decodes a piece's tokens (``decode(ids) -> str``); None: no text.
    """
    prov = np.asarray(row["provenance"], np.int64).reshape(-1, 5)
    packed = np.asarray(row["input_ids"])
    if "labels" in row:  # the packed tokens: input_ids plus the last label
        packed = np.concatenate([packed, np.asarray(row["labels"])[-1:]])
    pieces, specials, at = [], [], 0
    for ds, f, d, start, n in prov.tolist():
        if n <= 0:
            continue
        if ds >= 0:
            piece: dict[str, Any] = {
                "dataset": names[ds], "file": f, "doc": d, "start": start, "stop": start + n,
                "at": at,
            }  # fmt: skip
            if files is not None:
                piece["file_name"] = files[names[ds]][f]
            if tokenizer is not None:
                piece["text"] = tokenizer.decode(packed[at : at + n].tolist())
            pieces.append(piece)
        else:
            special: dict[str, Any] = {
                "token": f, "at": at, "count": n, "kind": "pad" if ds == PAD else "special",
            }  # fmt: skip
            owner = literal_owner([ds, f, d, start, n])
            if owner is not None:
                special.update(dataset=names[owner[0]], file=owner[1], doc=owner[2])
            specials.append(special)
        at += n
    out: dict[str, Any] = {"pieces": pieces, "specials": specials}
    out["input_ids"] = np.asarray(row["input_ids"]).tolist()
    if "labels" in row:
        out["labels"] = np.asarray(row["labels"]).tolist()
    return out


def show_batches(
    checkpoint: str,
    config: PipelineConfig | str | os.PathLike[str],
    steps: str | int | range | Sequence[int],
    rank: int | None = None,
    ranks: int | None = None,
    workers: int | None = None,
    *,
    text: bool = False,
    storage_options: dict[str, Any] | None = None,
    key: str | None = None,
    changes_from: str | None = None,
) -> list[dict[str, Any]]:
    """The batches the training loop received at ``steps``, replayed from ``checkpoint``.

    The steps between the checkpoint's and the first shown are made and dropped (about as
    fast as training reads them); one that lasts over 2 s is logged (WARNING) per rank with
    the steps left and the time they will take: a checkpoint saved nearer replays faster.

    Args:
        checkpoint: a loader checkpoint taken before the first step shown (a folder written
            by ``save_checkpoint``, or a DCP checkpoint holding a ``DCPLoaderState``).
        config: the run's pipeline config (or its YAML/JSON path).
        steps: the training loop's steps, counted from 1 over the run: ``range(A, B)``
            (``B`` excluded), ``"A:B"``, or one step ``A``.
        rank: show only this rank (default: every rank).
        ranks / workers: the topology the run had at these steps (ranks, dataloader workers
            per rank); default: the checkpoint's. Another topology replays the rescale the
            job made when it restored there.
        text: decode each piece through the config's ``tokenizer``.
        storage_options: fsspec options of the checkpoint and of a config URL; the data's
            are the config's, these when the config has none, and the config's serve the
            checkpoint when these are not given (as for ``audit_checkpoint``).
        key: DCP checkpoint: the loader state's key, when it holds several.
        changes_from: a later checkpoint of the same run whose recorded weight changes
            (the trainer's ``set_weights`` calls) replace ``checkpoint``'s. A checkpoint
            knows only the calls made before it was saved, so without this the replay
            assumes the trainer changed no weights after ``checkpoint``'s step.

    Returns:
        One dict per (step, rank), by step then rank: ``{"step", "rank", "worker", "rows"}``,
        each row as :func:`row_record` describes.

    Raises:
        ValueError: a step at or before the checkpoint's, a rank out of range, ``text``
            without a tokenizer in the config.
    """
    cfg = as_config(config, storage_options, name="config")
    if storage_options and not cfg.storage_options:  # given once, they reach every URL
        cfg = dataclasses.replace(cfg, storage_options=storage_options_of(storage_options))
    storage_options = storage_options_of(storage_options, cfg.storage_options)
    span = parse_steps(steps)
    manifest = _manifest(checkpoint, storage_options, key)
    R = int(manifest["world_size"]) if ranks is None else _positive("ranks", ranks)
    W = int(manifest["num_workers"]) if workers is None else _positive("workers", workers)
    saved = int(manifest.get("step", 0))
    if span.start <= saved:
        raise ValueError(
            f"step {span.start}: checkpoint {checkpoint} was saved after step {saved}, so it "
            f"replays steps from {saved + 1}; pass a checkpoint saved before step {span.start}"
        )
    if rank is not None and not 0 <= rank < R:
        raise ValueError(f"rank={rank} is not a rank of the {R} ranks; pass 0..{R - 1}")
    changes = None
    if changes_from is not None:
        later = _manifest(changes_from, storage_options, key)
        if int(later.get("step", 0)) < saved:
            raise ValueError(
                f"changes_from={changes_from!r} was saved after step {later.get('step', 0)}, "
                f"before checkpoint {checkpoint} (step {saved}); pass a later checkpoint of "
                "the run"
            )
        changes = later.get("weight_changes", [])
    tokenizer = _tokenizer(cfg) if text else None
    files = {name: index.file_names() for name, index in build_datasets(cfg).items()}
    out: list[dict[str, Any]] = []
    for r in range(R) if rank is None else [rank]:
        state = _restored(cfg, checkpoint, r, R, W, storage_options, key)
        if changes is not None:
            state["weight_changes"] = changes
        for step, w, rows in replay_rank(cfg, state, span):
            records = [row_record(row, row["_names"], files, tokenizer) for row in rows]
            out.append({"step": step, "rank": r, "worker": w, "rows": records})
    out.sort(key=lambda b: (b["step"], b["rank"]))
    return out


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _tokenizer(cfg: PipelineConfig) -> Any:
    from torchdata_ext.tokenizers.load import load_tokenizer

    if cfg.tokenizer is None:
        raise ValueError(
            "text=True decodes through the config's tokenizer, but its tokenizer is None: set "
            "tokenizer in the config to the one the data was tokenized with"
        )
    return load_tokenizer(cfg.tokenizer, byte_offset=cfg.byte_offset)
