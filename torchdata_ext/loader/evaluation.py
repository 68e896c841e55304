"""The evaluation loader: the held-out documents of a config, each exactly once, in batches
of one fixed shape.

:class:`EvalLoader` runs :func:`~torchdata_ext.pipeline.build.build_eval_pipeline` (the documents
``eval_fraction`` holds out, one epoch, no shuffle buffer) through a
:class:`~torchdata_ext.loader.token_loader.TokenLoader`. Every batch has ``batch_size`` rows: a last partial
batch is completed with padding rows (pad tokens, ``loss_mask`` False, ``seq_lens`` one segment of
``seq_length`` tokens: the padding) and a ``row_mask`` key
says which rows are real, so nothing is dropped or counted twice. With ``torch.distributed``
initialised, every rank yields the same number of batches (ranks with fewer add batches of
padding rows), so a model whose forward pass synchronises ranks does not hang on the last step.

``cache=True`` keeps the finished batches in memory after the first pass: a repeated
evaluation of a small set yields them again without reading a file or packing anything
(epochraft's ``cache``). Evaluation has no checkpoint state: each pass starts from the
beginning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchdata_ext.batch import DATASET_KEY
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_datasets, build_eval_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.world import World

__all__ = ["ROW_MASK", "EvalLoader"]

ROW_MASK = "row_mask"
"""The batch key (``torch.bool`` ``[batch_size]``) that is False on padding rows."""


class EvalLoader:
    """Iterate the held-out evaluation batches of ``cfg`` (see the module docstring).

    Args:
        cfg: the pipeline config; ``cfg.eval_fraction`` must hold documents out. Its
            ``output_keys`` get ``loss_mask`` added (padding is marked there).
        datasets: pre-built indexes (default: built from ``cfg``), e.g. in-memory datasets.
        num_workers: dataloader worker processes per rank (0: in this process).
        rank / world_size: override ``torch.distributed`` (default: detected).
        cache: keep the batches of the first whole pass in memory and yield them again on
            every later pass (no file is read again). Use it for small evaluation sets.
        equal_batches: complete every rank's stream to the same number of batches (a
            ``torch.distributed`` all-reduce of one number before each batch: the ranks
            agree whether any of them has one left; a rank that has none yields padding,
            nothing is held back). None (default): when ``torch.distributed`` is initialised
            with more than one rank. Stop a pass early on every rank at the same batch, or not
            at all (the others would wait in the all-reduce).
        **loader_options: further :class:`~torchdata_ext.loader.token_loader.TokenLoader` arguments
            (``multiprocessing_context``, ``batches_per_message``, ...).
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        datasets: Mapping[str, DatasetIndex] | None = None,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        cache: bool = False,
        equal_batches: bool | None = None,
        **loader_options: Any,
    ) -> None:
        if not isinstance(cfg, PipelineConfig):
            raise TypeError(f"cfg must be a PipelineConfig, got {type(cfg).__name__}")
        if not isinstance(cache, bool):
            raise TypeError(f"{cache=} must be True or False")
        if equal_batches is not None and not isinstance(equal_batches, bool):
            raise TypeError(f"{equal_batches=} must be True, False or None")
        keys = list(cfg.output_keys)
        flat = [k for k in ("cu_seqlens", "max_seqlen") if k in keys]
        if flat:  # whole-batch values: padding rows (and row_mask) cannot be appended to them
            raise ValueError(
                f"output_keys {flat}: an EvalLoader pads its batches with rows, which these "
                "whole-batch keys cannot take; use 'seq_lens' (per row) or position_ids"
            )
        if "loss_mask" not in keys:
            keys.append("loss_mask")
        self.cfg = dataclasses.replace(cfg, output_keys=keys)
        if datasets is None:  # no collective here: an EvalLoader may be made on one rank alone
            datasets = build_datasets(self.cfg, World.detect(rank, world_size))
        datasets = dict(datasets)
        self.build = functools.partial(build_eval_pipeline, self.cfg, datasets=datasets)
        self.build(None)  # refuse a config that holds nothing out now, not in a worker
        self.num_workers = num_workers
        self.rank = rank
        self.world_size = world_size
        self.cache = cache
        self.equal_batches = equal_batches
        self.loader_options = loader_options
        self._cached: list[dict[str, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._cached is not None:
            return iter(self._cached)
        return self._run()

    def _run(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = TokenLoader(
            self.build,
            num_workers=self.num_workers,
            rank=self.rank,
            world_size=self.world_size,
            **self.loader_options,
        )
        batches: Iterator[dict[str, torch.Tensor]] = (self._padded(b) for b in loader)
        if self._equalize():
            batches = self._in_step(batches)
        kept: list[dict[str, torch.Tensor]] | None = [] if self.cache else None
        for batch in batches:
            if kept is not None:
                kept.append(batch)
            yield batch
        if kept is not None:  # a whole pass: the next ones yield these
            self._cached = kept

    def _in_step(
        self, batches: Iterator[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """``batches`` in step with the other ranks: before each batch the ranks agree (an
        all-reduce) whether any of them still has one; a rank that has none yields a batch of
        padding rows. So no rank holds its batches back to count them first."""
        while True:  # until no rank has a batch left
            batch = next(batches, None)
            if not _global_max(int(batch is not None)):
                return
            yield batch if batch is not None else self._padding_batch()

    @property
    def dataset_names(self) -> list[str]:
        """The dataset names that the batches' ``dataset_ids`` index, in order (the config's
        ``datasets``, as in training)."""
        return list(self.cfg.dataset_weights)

    def clear_cache(self) -> None:
        """Forget the cached batches: the next pass reads the data again."""
        self._cached = None

    def _equalize(self) -> bool:
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.equal_batches is None:
            return live
        if self.equal_batches and not live:
            raise ValueError(
                "equal_batches=True needs torch.distributed initialised with more than one "
                "rank (it agrees on the batch count with an all-reduce); initialise the "
                "process group first or pass equal_batches=False"
            )
        return self.equal_batches

    # -- padding -------------------------------------------------------------------------------
    def _padded(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` completed to ``batch_size`` rows, with ``row_mask``."""
        size = self.cfg.batch_size
        rows = int(next(iter(batch.values())).shape[0])
        out = {
            k: _grow(k, v, size, self.cfg.pad_token, self.cfg.seq_length) for k, v in batch.items()
        }
        mask = torch.zeros(size, dtype=torch.bool)
        mask[:rows] = True
        out[ROW_MASK] = mask
        return out

    def _padding_batch(self) -> dict[str, torch.Tensor]:
        """A batch of padding rows only (for ranks with fewer batches than others)."""
        cfg = self.cfg
        dtype = torch.int64 if cfg.dtype == "int64" else torch.int32
        empty: dict[str, torch.Tensor] = {}
        for key in cfg.output_keys:
            if key == "loss_mask":
                empty[key] = torch.zeros(0, cfg.seq_length, dtype=torch.bool)
            elif key == "provenance":
                empty[key] = torch.zeros(0, 1, 5, dtype=torch.int64)
            elif key == DATASET_KEY:
                empty[key] = torch.zeros(0, cfg.seq_length, dtype=torch.int16)
            elif key == "seq_lens":  # one segment a row (the padding), as _grow fills it
                empty[key] = torch.zeros(0, 1, dtype=torch.int32)
            elif key != "labels" or cfg.shift:
                empty[key] = torch.zeros(0, cfg.seq_length, dtype=dtype)
        out = self._padded(empty)
        out[ROW_MASK] = torch.zeros(cfg.batch_size, dtype=torch.bool)
        return out


def _grow(key: str, value: torch.Tensor, size: int, pad_token: int, length: int) -> torch.Tensor:
    """``value`` ([rows, ...]) with padding rows appended up to ``size`` rows (``length``
    tokens each: a padding row's ``seq_lens`` is one segment, the padding, of ``length``
    tokens, as a training row's padding is a segment of its own and every row's lengths sum
    to its length)."""
    rows = int(value.shape[0])
    if rows >= size:
        return value
    fill = {"input_ids": pad_token, "labels": pad_token, "document_ids": -1, DATASET_KEY: -1}
    extra = torch.full((size - rows, *value.shape[1:]), fill.get(key, 0), dtype=value.dtype)
    if key == "provenance":  # rows of length 0, as Collate fills short tables
        extra[..., 0] = LITERAL
    if key == "seq_lens":
        extra[:, 0] = length
    return torch.cat([value, extra])


def _global_max(n: int) -> int:
    """The largest ``n`` over all ranks (``torch.distributed`` all-reduce)."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
