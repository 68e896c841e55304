"""A torchtitan data loader whose state reshards: :class:`TokenDataLoader`.

torchtitan's trainer builds its data loader from ``Trainer.Config.dataloader`` with
``config.build(dp_world_size=..., dp_rank=..., tokenizer=..., seq_len=...,
local_batch_size=...)`` and saves it in its DCP checkpoint under ``"dataloader"``. Its own loaders
store one pickled state per dp rank and refuse another dp degree on load; this one stores its
state as :class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState` does, so a checkpoint taken at dp N
(W workers) restores at dp N' (W' workers): each document of the epoch exactly once, each rank
reading only the entries of the old workers it succeeds.

Use in a torchtitan config (``config_registry`` function)::

    from torchdata_ext.torchtitan import TokenDataLoader

    config = llama3_debugmodel()
    config.dataloader = TokenDataLoader.Config(pipeline="pipeline.yaml", num_workers=2)

The pipeline config (a :class:`~torchdata_ext.pipeline.config.PipelineConfig` as YAML/JSON, any fsspec
URL, and/or ``fields``) says the datasets, weights, formats and URLs; the trainer's ``seq_len``
and ``local_batch_size`` replace its ``seq_length`` and ``batch_size``. Each batch is
``({"input": input_ids, "positions": position_ids}, labels)``: what torchtitan's training step
takes. Positions restart at 0 at each run Pack emitted (each document's part of a row, and the
line specials and padding each on their own), which is where torchtitan 0.3's flex and varlen
attention find the documents (``positions == 0``): its masks are exactly the boundaries of
:func:`torchdata_ext.batch.boundaries`, never an EOS scan. ``Config.boundaries`` adds those keys
to the input dict for trainers that take them (torchtitan 0.3's passes every key but ``input``
to the model's ``forward``, so leave it empty there).

torchtitan's main branch (its Grain-based data API: ``GrainDataLoader.Config``,
``TrainerBatch``, ``BaseDataLoader`` in ``torchtitan.components.data.loader``) builds the data
loader with ``dp_world_size``, ``dp_rank``, ``tokenizer``, ``max_context_length`` and
``num_tokens_per_batch``: the same ``TokenDataLoader.Config`` goes in its
``config.dataloader``, and runs in token-budget mode. Where ``GrainDataLoader`` refuses a
checkpoint of another dp degree, this loader restores it exactly.

Token-budget mode (the shape of torchtitan's next, Grain-based data API): with
``num_tokens_per_batch=T`` (the keyword ``build`` passes, or the config's ``token_budget``)
each batch is one row of ``T`` tokens without a batch dimension,
``({"input": [T], "positions": [T]}, labels[T])``, the documents' boundaries in ``positions``
(and in ``Config.boundaries``' keys).

Requires torchtitan (``pip install "torchdata-ext[torchtitan]"``, Python >= 3.11).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# torchtitan 0.3's BaseDataLoader, or main's (its Grain-based data API moved it, with
# GrainDataLoader and TrainerBatch, to torchtitan.components.data.loader); the one place that
# knows both layouts
try:
    from torchtitan.components.data.loader import BaseDataLoader
except ImportError:
    try:
        from torchtitan.components.dataloader import BaseDataLoader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "torchdata_ext.torchtitan needs torchtitan: pip install 'torchdata-ext[torchtitan]' "
            "(torchtitan>=0.3, Python >= 3.11)"
        ) from exc

from torchdata_ext.batch import BOUNDARY_KEYS
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.remote.urls import storage_options_of
from torchdata_ext.world import World

__all__ = ["TokenDataLoader", "pipeline_config"]

_KEYS = ["input_ids", "labels", "position_ids"]


def pipeline_config(
    pipeline: str,
    fields: dict[str, Any],
    *,
    seq_len: int,
    local_batch_size: int,
    boundaries: tuple[str, ...] = (),
) -> PipelineConfig:
    """The pipeline config of a :class:`TokenDataLoader`: file ``pipeline`` (if any), then
    ``fields``, then the trainer's sequence length (tokens per row) and batch size (rows), and
    the ``boundaries`` keys (:data:`~torchdata_ext.batch.BOUNDARY_KEYS`) asked for. The file
    (any fsspec URL) is read with ``fields["storage_options"]`` when given (the rule of
    :func:`~torchdata_ext.remote.urls.storage_options_of`); those options then apply to the
    data too, over the file's own.

    Raises:
        ValueError: neither a file nor fields, or a field the pipeline does not know.
    """
    if not pipeline and not fields:
        raise ValueError(
            "TokenDataLoader.Config needs the pipeline: set pipeline='pipeline.yaml' (a "
            "PipelineConfig as YAML/JSON) or fields={'data_path': ..., 'datasets': ...}"
        )
    # the file is read with the options given in ``fields`` (its own come with it)
    given = storage_options_of(fields.get("storage_options"), name="fields['storage_options']")
    base = PipelineConfig.from_file(pipeline, given).to_dict() if pipeline else {}
    return PipelineConfig.from_dict(
        {
            **base,
            **fields,
            "seq_length": seq_len,
            "batch_size": local_batch_size,
            "shift": True,
            "output_keys": [*_KEYS, *boundaries],
        }
    )


def _build(cfg: PipelineConfig, world: World) -> Any:
    return build_pipeline(cfg, world)


class TokenDataLoader(BaseDataLoader):
    """torchtitan's ``BaseDataLoader`` over a torchdata-ext pipeline (see the module).

    Args:
        config: a :class:`TokenDataLoader.Config`.
        dp_world_size / dp_rank: the data-parallel degree and this rank's place (the trainer's
            ``batch_degree`` and ``batch_rank``).
        tokenizer: the trainer's tokenizer; unused (the pipeline config names its tokenizer,
            which must give the model's token ids).
        seq_len / local_batch_size: tokens per row and rows per batch (torchtitan 0.3's
            trainer passes them); not needed in token-budget mode.
        num_tokens_per_batch: token-budget mode: one row of this many tokens per batch,
            without a batch dimension (torchtitan's next data API passes it; or set
            ``Config.token_budget``).
        max_context_length: torchtitan's next data API's longest document context; recorded
            (:meth:`describe`) but not applied: a document longer than the row continues in
            the next row, where its positions restart at 0.
        snapshot_every_n_steps: unused: the state is exact at every step and costs nothing.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pipeline: str = ""
        """A PipelineConfig as YAML or JSON (any fsspec URL): datasets, weights, formats, URLs."""

        fields: dict[str, Any] = field(default_factory=dict)
        """PipelineConfig fields, over those of ``pipeline``; ``storage_options`` here also
        reach the ``pipeline`` file's URL."""

        num_workers: int = 0
        """Dataloader worker processes per rank (0: a background thread)."""

        allow_weight_changes: bool = False
        """On restore, accept weights that differ from the checkpoint's."""

        allow_new_datasets: bool = False
        """On restore, accept datasets the checkpoint does not have."""

        allow_changed_files: bool = False
        """On restore, log data files changed since the save instead of refusing them."""

        token_budget: int = 0
        """Token-budget mode: each batch one row of this many tokens, without a batch
        dimension (0: rows of the trainer's ``seq_len``, ``local_batch_size`` of them). The
        ``num_tokens_per_batch`` that torchtitan's next data API passes to ``build`` sets it
        too (torchtitan refuses a ``build`` keyword that is also a config field, hence the
        other name)."""

        boundaries: tuple[str, ...] = ()
        """Document-boundary keys to add to the input dict, out of ``seq_lens``,
        ``cu_seqlens``, ``max_seqlen`` (int32; see ``docs/trainers.md``), for trainers that
        take them. Empty for torchtitan 0.3's trainer: it hands every input key to the model."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int | None = None,
        local_batch_size: int | None = None,
        num_tokens_per_batch: int | None = None,
        max_context_length: int | None = None,
        snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.max_context_length = max_context_length
        self.tokens_per_batch = _tokens_per_batch(config, num_tokens_per_batch)
        bad = [k for k in config.boundaries if k not in BOUNDARY_KEYS]
        if bad or isinstance(config.boundaries, str):
            raise ValueError(
                f"TokenDataLoader.Config boundaries={config.boundaries!r}: not boundary keys "
                f"{bad}; choose a tuple out of {BOUNDARY_KEYS}"
            )
        if self.tokens_per_batch:
            seq_len, local_batch_size = self.tokens_per_batch, 1
        elif seq_len is None or local_batch_size is None:
            raise ValueError(
                f"TokenDataLoader needs seq_len and local_batch_size (got {seq_len=}, "
                f"{local_batch_size=}), or num_tokens_per_batch for one row of that many "
                "tokens per batch"
            )
        fields = dict(config.fields)
        dataset_path = getattr(config, "dataset_path", "")  # 0.3's Config field; not main's
        if dataset_path:
            fields.setdefault("data_path", dataset_path)
        self.pipeline = pipeline_config(
            config.pipeline,
            fields,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            boundaries=tuple(config.boundaries),
        )
        self.loader = TokenLoader(
            functools.partial(_build, self.pipeline),
            num_workers=config.num_workers,
            rank=dp_rank,
            world_size=dp_world_size,
        )
        self._state = DCPLoaderState(
            self.loader,
            allow_weight_changes=config.allow_weight_changes,
            allow_new_datasets=config.allow_new_datasets,
            allow_changed_files=config.allow_changed_files,
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        extra = tuple(self.config.boundaries)
        row = bool(self.tokens_per_batch)
        for batch in self.loader:
            inputs = {"input": batch["input_ids"], "positions": batch["position_ids"]}
            labels = batch["labels"]
            if row:  # one row of T tokens, no batch dimension
                inputs = {k: v[0] for k, v in inputs.items()}
                labels = labels[0]
            for key in extra:
                inputs[key] = batch[key][0] if row and key == "seq_lens" else batch[key]
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        """This rank's entries (saving), or the entries it reads (inside ``dcp.load``); see
        :class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`."""
        return self._state.state_dict(owner=self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from the entries ``dcp.load`` read, at this dp degree and worker count."""
        if not state_dict:  # torchtitan: an empty state is a fresh start
            return
        self._state.load_state_dict(state_dict)

    def describe(self) -> dict[str, Any]:
        """The pipeline this loader runs, as plain fields (for logs), and the trainer's
        ``max_context_length`` if it passed one (not applied)."""
        out = dataclasses.asdict(self.pipeline)
        if self.max_context_length is not None:
            out["max_context_length (not applied)"] = self.max_context_length
        return out


def _tokens_per_batch(config: TokenDataLoader.Config, passed: int | None) -> int:
    """The token-budget mode's row length (0: off), from the config and/or ``build``."""
    mine = config.token_budget
    for name, value in (("Config.token_budget", mine), ("num_tokens_per_batch", passed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name}={value!r} must be an integer number of tokens")
        if value is not None and value < 0:
            raise ValueError(f"{name}={value} must be >= 0 tokens (0: rows of seq_len)")
    if passed and mine and passed != mine:
        raise ValueError(
            f"TokenDataLoader.Config token_budget={mine} but the trainer passed "
            f"num_tokens_per_batch={passed}; set one of them"
        )
    return int(passed or mine)
