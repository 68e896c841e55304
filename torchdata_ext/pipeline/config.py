"""The pipeline's config: :class:`PipelineConfig`, one validated dataclass, and its loading
from a mapping or a YAML/JSON file.

Every field of IBM Bamba's data config (``data_path``, ``file_type``, ``col_name``,
``datasets``, ``weights``, ``seq_length``, ``bos_token``, ``eos_token``, ``bol_token``,
``eol_token``, ``strip_tokens``, ``logical_shards``, ``num_workers``, ``batch_size``, ``seed``)
means what it means there; the rest select the tokenizer, packing mode and shuffle buffer.
Its checks (special ids, eval split, transforms, budgets) each need the other fields; the
per-feature rules live apart (``curriculum.py``, ``transforms.py``, ``split.py``,
``prepared_meta.py``). :mod:`torchdata_ext.pipeline.build` builds the graph from it.

This module is 675 lines: the dataclass's field documentation and the restore contract table
(``RESTORE_CONTRACT``, one entry per field) are most of it; new logic goes in its own module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from torchdata_ext.batch import ALL_KEYS, HF_KEYS
from torchdata_ext.checks import check_int, split_list
from torchdata_ext.nodes.drops import DEFAULT_MAX_DROPPED
from torchdata_ext.order.split import EvalSplit
from torchdata_ext.pipeline.curriculum import check_budget, check_phases
from torchdata_ext.pipeline.schedule import schedule_of
from torchdata_ext.remote.urls import filesystem, storage_options_of
from torchdata_ext.tokenizers.load import (
    DEFAULT_BYTE_OFFSET,
    ByteTokenizer,
    check_special_tokens,
    token_ids,
)
from torchdata_ext.transforms import On, Transform, from_spec

__all__ = ["BEST_FIT_PIECE_BYTES", "RESTORE_CONTRACT", "PipelineConfig", "as_config", "step_ranges"]

RESTORE_CONTRACT: dict[str, tuple[str, str]] = {
    # field: (class, why) -- "may_change": a restore with another value is exact;
    # "opt_in": refused unless load_checkpoint(allow_...=True) accepts it;
    # "must_match": refused by name (docs/checkpoint.md has this table;
    # tests/test_restore_contract.py checks every field is here)
    "data_path": ("may_change", "the data may move; its files and counts must match (checked)"),
    "datasets": ("opt_in", "order is free; added needs allow_new_datasets, removed refused"),
    "weights": ("opt_in", "allow_weight_changes: the mix moves to the new targets from there"),
    "file_type": ("must_match", "selects the files read (checked as the data's files)"),
    "col_name": ("must_match", "another column is other documents (checked)"),
    "seq_length": ("must_match", "the packer's position counts tokens of a row"),
    "shift": ("must_match", "changes the tokens packed per row"),
    "bos_token": ("must_match", "the packer's position counts the specials it placed"),
    "eos_token": ("must_match", "the packer's position counts the specials it placed"),
    "bol_token": ("must_match", "changes the document tokens per row"),
    "eol_token": ("must_match", "changes the document tokens per row"),
    "strip_tokens": ("must_match", "changes document lengths the saved offsets count in"),
    "logical_shards": ("must_match", "the cursors are per logical shard"),
    "num_workers": ("may_change", "a rescale re-partitions the shards exactly"),
    "batch_size": ("may_change", "rows are batched after every saved position"),
    "seed": ("must_match", "the shard walk and the buffer's draws come from it"),
    "tokenizer": ("must_match", "token offsets of text count its tokens"),
    "byte_offset": ("must_match", "another offset is another tokenizer"),
    "pack_mode": ("must_match", "the packer's position means another strategy's"),
    "best_fit_window": ("must_match", "the best_fit window replays as it was"),
    "shuffle_buffer": ("may_change", "its size, above 1; adding or removing it is refused"),
    "shuffle_fill": ("may_change", "only how a fresh buffer fills"),
    "interleave_mode": ("must_match", "the replayed block is decided as it was"),
    "mix_quantum_tokens": (
        "must_match",
        "the replayed block is decided as it was; a checkpoint from before row cuts goes on "
        "with documents whole (exact)",
    ),
    "epochs": ("may_change", "cursors count epochs; the run ends after the new count"),
    "min_length": ("must_match", "changes the blocks the packer replays"),
    "max_chunksize": ("must_match", "changes the blocks the packer replays"),
    "block_docs": (
        "may_change",
        "the replayed block is read at the saved size; refused with pack_mode best_fit",
    ),
    "pad_token": ("may_change", "padding is written when a row is made"),
    "storage_options": ("may_change", "only how the files are reached"),
    "dtype": ("may_change", "only the output tensors' type"),
    "output_keys": ("may_change", "only which arrays a batch carries"),
    "eval_fraction": ("must_match", "the held-out split (checked)"),
    "eval_seed": ("must_match", "the held-out split (checked)"),
    "transforms": ("must_match", "each step and its parameters are recorded (checked)"),
    "drop_remainder": ("must_match", "changes what the chunk packer keeps"),
    "phases": ("must_match", "phase states and budgets go by place (checked)"),
    "max_tokens": ("must_match", "the saved shares are of the budget saved"),
    "max_documents": ("must_match", "the saved shares are of the budget saved"),
    "max_dropped_documents": ("may_change", "only when an endless stream gives up"),
    "weight_schedule": ("must_match", "recorded with the loader state, refused by name"),
    "weight_schedule_unit": ("must_match", "recorded with the schedule, refused by name"),
    "weight_schedule_ramp_every": ("must_match", "recorded with the schedule, refused by name"),
    "skip_steps": (
        "may_change",
        "a range is applied when the run reaches its first step (fresh or restored) and "
        "recorded in the loader state; a range the checkpoint is past is refused",
    ),
}
"""What each :class:`PipelineConfig` field may do across a checkpoint restore, with the reason
(the table of ``docs/checkpoint.md``)."""


def step_ranges(ranges: Any, name: str = "skip_steps") -> list[list[int]]:
    """``ranges`` (pairs ``[A, B]`` of steps >= 1, ``A < B``) checked, sorted and apart."""
    if not isinstance(ranges, (list, tuple)):
        raise TypeError(f"{name}={ranges!r} must be a list of [A, B] step ranges, e.g. [[30, 35]]")
    out: list[list[int]] = []
    for r in ranges:
        ok = isinstance(r, (list, tuple)) and len(r) == 2
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        if not ok or not 1 <= r[0] < r[1]:
            raise ValueError(
                f"{name}: {r!r} is not a step range [A, B] with 1 <= A < B (B excluded); "
                "e.g. [[30, 35]] skips steps 30..34"
            )
        out.append([int(r[0]), int(r[1])])
    out.sort()
    for a, b in zip(out, out[1:]):
        if b[0] < a[1]:
            raise ValueError(f"{name}: ranges {a} and {b} overlap; merge them into one")
    return out


@dataclass
class PipelineConfig:
    """Everything needed to build the standard pipeline.

    Attributes:
        data_path: folder (fsspec URL) holding one sub-folder per dataset.
        datasets: dataset sub-folder names, a list or a comma-separated string
            (Bamba: ``"web,code"``); empty means ``data_path`` itself is one dataset.
        weights: relative weight of each dataset in tokens (need not sum to 1); list or
            comma-separated string; default: equal.
        file_type: a registered format name (``"arrow"``, ``"parquet"``, ``"npy"``, ``"flat"``,
            ``"ceped"``, ``"jsonl"``), or None to choose by file suffix.
        col_name: the token column (or text field for text data).
        seq_length: tokens per output sequence (per ``input_ids`` row).
        shift: output ``input_ids``/``labels`` shifted by one (packs ``seq_length + 1``
            tokens; Bamba's behaviour); False outputs ``seq_length``-token ``input_ids`` only.
        bos_token / eos_token: added at each document's start / end where missing (None: none).
        bol_token / eol_token: added at the start / end of every output sequence (None: none).
        strip_tokens: token ids stripped from both ends of every document before the above
            (list or comma-separated string, Bamba's format).
        logical_shards: logical shards per dataset (>= ranks x workers; e.g. 1024-30720).
        num_workers: dataloader worker processes per rank of a
            :class:`~torchdata_ext.loader.token_loader.TokenLoader` built from this config
            and not given ``num_workers`` (its argument wins); None: 0, the graph in the
            training process.
        batch_size: sequences per batch.
        seed: seed of shuffling, interleaving and the shuffle buffer.
        tokenizer: None for tokenized data; ``"byte"`` for the byte tokenizer; or a path to a
            Hugging Face ``tokenizer.json``. Data that ``prepare`` wrote carries how it was
            tokenized (``meta/torchdata_ext_meta.json``): a tokenizer, ``byte_offset``,
            ``bos_token``/``eos_token`` or ``dtype`` that disagrees with it is refused.
        byte_offset: the byte tokenizer maps byte ``b`` to id ``b + byte_offset`` (default 1,
            as in ``prepare`` and ``inspect``: id 0, the default EOS and pad, is never a byte).
            BOS/EOS/BOL/EOL/pad ids the tokenizer emits for ordinary text are refused.
        pack_mode: ``"concat"``, ``"pad"``, ``"best_fit"`` or ``"chunk"`` (each document cut
            into ``seq_length`` pieces, never two documents in one sequence).
        drop_remainder: ``chunk`` mode: drop each document's last, partial piece instead of
            padding it.
        best_fit_window: documents considered at once in ``best_fit`` mode.
        shuffle_buffer: packed sequences held by the shuffle buffer (Bamba: 10,000); 1 disables
            (0 and negative values are refused).
        shuffle_fill: ``"stream"`` (default): the buffer delivers from the first batch and
            grows by one sequence per draw until full (as fms-fsdp's); ``"full"``: it fills
            before the first batch (which waits for ``shuffle_buffer`` sequences). See
            ``docs/time-to-data.md``.
        interleave_mode: ``"tokens"`` (deterministic, furthest below target share first) or
            ``"samples"`` (random by weight).
        mix_quantum_tokens: in ``"tokens"`` mode, how far (tokens) a source may run past the
            next one's share before the mix switches (0: document by document). None, the
            default: one sequence (``seq_length`` tokens), so the mix switches about once a
            row and batches hold the weights from the first one. With ``pack_mode: concat``
            (no run budget, no phases) the mix switches datasets at row ends, inside a long
            document too: each share stays within ``(mix_quantum_tokens + 2 rows)`` tokens per
            worker of its target; else within ``(... + longest document)`` (pipeline.md). The
            default was 65,536 before; a checkpoint taken with that restores only with
            ``mix_quantum_tokens=65536`` (refused by name otherwise).
        epochs: None for an endless stream; 1 for validation data.
        min_length: skip documents shorter than this many tokens.
        max_chunksize: cut token documents longer than this many tokens in the reader (bounds
            memory; None keeps them whole).
        block_docs: documents per block moving through the pipeline.
        pad_token: token id of padding (pad mode, best-fit mode and the final flush).
        storage_options: fsspec options (credentials, endpoint) for every URL of the config:
            ``data_path`` and its index files, a ``tokenizer.json`` URL; also what
            ``save_checkpoint`` / ``load_checkpoint`` use when given none. A mapping (a string
            is refused); for ``s3://``, keys ``s3fs.S3FileSystem`` takes.
        dtype: ``"int64"`` or ``"int32"`` for the output tensors.
        phases: a curriculum (``Concat``): a list of phases, each a mapping with ``datasets``
            (names, list or comma-separated string), optional ``weights`` (as ``weights``) and
            an optional stop rule ``max_tokens`` / ``max_documents`` (for the whole run, all
            ranks x workers together). A phase without one ends when its datasets are
            exhausted (needs ``epochs``). Each dataset belongs to one phase; ``datasets`` may be
            left empty (it becomes all phases' datasets) and ``weights`` must be. Empty: no
            phases, ``datasets`` mixed at ``weights``.
        max_tokens: a token budget (``Take``): an int ends the run after exactly that many
            document tokens over all ranks x workers (each worker delivers its share, then
            Pack flushes and the shuffle buffer drains); a mapping dataset -> int caps each
            named dataset's tokens for the run. None: no budget.
        max_documents: the same in documents (whole documents; counted at their start).
        output_keys: the batch keys (list or comma-separated string) out of ``input_ids``,
            ``labels``, ``position_ids``, ``document_ids``, ``loss_mask``, ``provenance``,
            and the document boundaries ``seq_lens``, ``cu_seqlens``, ``max_seqlen``
            (:func:`torchdata_ext.batch.boundaries`, ``docs/trainers.md``), ``dataset_ids``
            (each token's dataset, for a loss per dataset: :func:`~torchdata_ext.batch.dataset_ids`).
            Default: what a Hugging Face causal LM with packed-sequence attention consumes
            (``input_ids``, ``labels``, ``position_ids``). Through dataloader workers only the
            tokens and document runs cross; these keys are built in the training process.
        eval_fraction: the share of each dataset's documents held out for evaluation (a
            number for all datasets, or ``{dataset: fraction}``; 0, the default, holds out
            nothing). Held-out documents are chosen by a seeded hash of (dataset, file name,
            document index) (:mod:`torchdata_ext.order.split`): the same ones in every run, topology
            and after files are added. The training stream never delivers them;
            :func:`build_eval_pipeline` / :class:`~torchdata_ext.loader.evaluation.EvalLoader`
            deliver exactly them.
        eval_seed: the seed of the held-out split (independent of ``seed``; keep it fixed).
        transforms: document transforms (maps and filters, :mod:`torchdata_ext.transforms`)
            run on every dataset's documents before interleave: a list for all datasets, or a
            mapping dataset name -> list (``"*"``: all datasets, applied first). Entries are
            ``Map``/``Filter`` objects, callables (per-document maps ``fn(data, meta)``, on
            text for text datasets) or built-in specs: ``{"min_length": 32}``,
            ``{"max_length": 8192}``, ``{"drop_tokens": [7]}``, ``{"truncate": 2048}`` (token
            counts). Functions must be deterministic and picklable.
        max_dropped_documents: on an endless stream (``epochs=None``), a reader or a transform
            node that read this many documents in a row and kept none (``min_length``, the
            split, ``on_error``, filters, maps emptying documents) fails naming its counts
            instead of waiting for a batch forever (default 1,000,000; also after a whole pass
            over a worker's documents with none kept); None: only after that pass. See
            ``docs/first-hour.md``.
        skip_steps: ranges ``[A, B]`` of the training loop's steps (counted from 1 over the
            run, ``B`` excluded) whose data is skipped when the run reaches step ``A``
            (restored from a checkpoint taken before step ``A``, or started fresh): the
            trainer's step ``A`` receives what step ``B`` would have received. The skip is recorded in the loader state (later
            restores, rescales and ``show_batches`` know it); a range starting at or before
            the checkpoint's step is refused, and so is a range the data runs out in (when
            it does). Dropping a range that takes longer than 2 s is logged (WARNING) with
            the batches left and the time they will take. See ``docs/forensics.md``.
        weight_schedule: ``{step: weights}``: the weights from that training step on
            (must match at a restore), see :mod:`~torchdata_ext.pipeline.schedule`.
        weight_schedule_unit: what the schedule's keys count: ``"steps"`` or ``"tokens"``
            (global: ``world_size x batch_size x seq_length`` a step).
        weight_schedule_ramp_every: 0: piecewise constant; N: linear between the points, in
            stairs of N steps (each a restart of the workers).
    """

    data_path: str = ""
    datasets: list[str] | str = field(default_factory=list)
    weights: list[float] | str = field(default_factory=list)
    file_type: str | None = "arrow"
    col_name: str = "tokens"
    seq_length: int = 4096
    shift: bool = True
    bos_token: int | None = None
    eos_token: int | None = 0
    bol_token: int | None = None
    eol_token: int | None = None
    strip_tokens: list[int] | str = ""
    logical_shards: int = 1024
    num_workers: int | None = None
    batch_size: int = 8
    seed: int = 42
    tokenizer: str | None = None
    byte_offset: int = DEFAULT_BYTE_OFFSET
    pack_mode: Literal["concat", "pad", "best_fit", "chunk"] = "concat"
    best_fit_window: int = 1000
    shuffle_buffer: int = 10_000
    shuffle_fill: Literal["stream", "full"] = "stream"
    interleave_mode: Literal["tokens", "samples"] = "tokens"
    mix_quantum_tokens: int | None = None
    epochs: int | None = None
    min_length: int = 1
    max_chunksize: int | None = None
    block_docs: int = 64
    pad_token: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)
    dtype: Literal["int64", "int32"] = "int64"
    output_keys: list[str] | str = field(default_factory=lambda: list(HF_KEYS))
    eval_fraction: float | dict[str, float] = 0.0
    eval_seed: int = 0
    transforms: list[Any] | dict[str, list[Any]] = field(default_factory=list)
    drop_remainder: bool = False
    phases: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | dict[str, int] | None = None
    max_documents: int | dict[str, int] | None = None
    max_dropped_documents: int | None = DEFAULT_MAX_DROPPED
    skip_steps: list[list[int]] = field(default_factory=list)
    weight_schedule: Any = field(default_factory=dict)
    weight_schedule_unit: Literal["steps", "tokens"] = "steps"
    weight_schedule_ramp_every: int = 0

    def __post_init__(self) -> None:
        self._check_shapes()
        self._check_phases()
        self.datasets = split_list(self.datasets, "datasets")
        dups = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if dups:
            raise ValueError(
                f"datasets={self.datasets} names {dups} more than once; list each dataset once "
                "(to read one more often, raise its weight)"
            )
        raw_weights = split_list(self.weights, "weights")
        try:
            self.weights = [float(w) for w in raw_weights]
        except ValueError:
            raise ValueError(f"weights={raw_weights!r} must be numbers") from None
        strip = split_list(self.strip_tokens, "strip_tokens")
        try:
            self.strip_tokens = [int(t) for t in strip]
        except ValueError:
            raise ValueError(f"strip_tokens={strip!r} must be token ids (integers)") from None
        if not self.data_path:
            raise ValueError("data_path is empty; set it to the folder (URL) holding the data")
        if self.weights and len(self.weights) != max(1, len(self.datasets)):
            raise ValueError(
                f"{len(self.weights)} weights for {len(self.datasets)} datasets "
                f"({self.datasets}); give one weight per dataset"
            )
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"weights={self.weights} must all be > 0")
        for name in ("seq_length", "logical_shards", "batch_size", "block_docs", "best_fit_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if self.dtype not in ("int64", "int32"):
            raise ValueError(f"dtype={self.dtype!r} must be 'int64' or 'int32'")
        if self.shuffle_fill not in ("stream", "full"):
            raise ValueError(f"shuffle_fill={self.shuffle_fill!r} must be 'stream' or 'full'")
        self._check_eval_split()
        check_int("byte_offset", self.byte_offset, 0)
        if self.num_workers is not None:
            check_int("num_workers", self.num_workers, 0)
        if self.max_dropped_documents is not None:
            check_int("max_dropped_documents", self.max_dropped_documents, 1)
        if self.mix_quantum_tokens is not None:  # named here, not as Interleave's argument
            check_int("mix_quantum_tokens", self.mix_quantum_tokens, 0)
        self.skip_steps = step_ranges(self.skip_steps)
        self.weight_schedule = schedule_of(self)
        # the byte tokenizer is known without I/O; a tokenizer.json is checked when loaded
        byte = ByteTokenizer(self.byte_offset) if self.tokenizer == "byte" else None
        self.check_special_ids(byte)
        self.output_keys = split_list(self.output_keys, "output_keys")
        known = (*ALL_KEYS, "provenance")
        unknown = [k for k in self.output_keys if k not in known]
        if unknown or not self.output_keys:
            raise ValueError(
                f"output_keys={self.output_keys!r}: unknown {unknown or 'none given'}; "
                f"choose from {list(known)}"
            )
        if self.drop_remainder and self.pack_mode != "chunk":
            raise ValueError(
                f"drop_remainder=True is for pack_mode='chunk' only (got "
                f"pack_mode={self.pack_mode!r}); set pack_mode: chunk or drop drop_remainder"
            )
        for name in self.dataset_weights:  # checked now: a bad spec names itself early
            self.transforms_for(name)
        names = list(self.dataset_weights)
        for budget in ("max_tokens", "max_documents"):
            setattr(self, budget, check_budget(budget, getattr(self, budget), names))

    def _check_shapes(self) -> None:
        """Refuse, naming the field, values of the wrong shape that would fail later with a
        misleading message (a file path made of a mapping, a string splatted as options)."""
        self.storage_options = storage_options_of(self.storage_options)
        for name in ("datasets", "weights"):
            value = getattr(self, name)
            if isinstance(value, Mapping) or (
                isinstance(value, Sequence)
                and not isinstance(value, str)
                and any(isinstance(v, Mapping) for v in value)
            ):
                raise ValueError(
                    f"{name}={value!r} holds mappings; give the dataset folder names as a list "
                    "(datasets: [web, code] or 'web,code') and their weights apart, in the same "
                    "order (weights: [3, 1])"
                )
        check_int("shuffle_buffer", self.shuffle_buffer, None)
        if self.shuffle_buffer < 1:
            raise ValueError(
                f"shuffle_buffer={self.shuffle_buffer} must be >= 1; 1 disables the shuffle "
                "buffer (sequences come out in packing order)"
            )
        tok = self.tokenizer
        if isinstance(tok, str) and tok != "byte" and tok.strip().lower() == "byte":
            raise ValueError(f"tokenizer={tok!r}: the byte tokenizer is named 'byte' (lower case)")

    def check_memory(self, available_bytes: int | None = None) -> None:
        """Refuse a config whose buffers cannot fit in this machine's memory, before any is
        allocated, naming the fields that size them.

        One pipeline holds at least its shuffle buffer (``shuffle_buffer`` sequences of
        ``seq_length + shift`` tokens of ``dtype``) and a batch (``batch_size`` such
        sequences for each of the ``output_keys``); each dataloader worker holds its own
        pipeline. A config whose one pipeline needs more than the memory available is an
        error (an out-of-memory kill with no message otherwise). In ``best_fit`` mode the
        window adds at least :data:`BEST_FIT_PIECE_BYTES` a piece.

        Args:
            available_bytes: the memory available, in bytes (default: ``MemAvailable`` of
                ``/proc/meminfo``; nothing is checked where it cannot be read).

        Raises:
            ValueError: the estimate exceeds the memory available, naming ``seq_length``,
                ``shuffle_buffer`` and ``batch_size`` and both sizes.
        """
        available = _available_memory() if available_bytes is None else available_bytes
        if available is None:
            return
        row = (self.seq_length + int(self.shift)) * np.dtype(self.dtype).itemsize
        buffer = self.shuffle_buffer * row
        batch = self.batch_size * row * len(split_list(self.output_keys, "output_keys"))
        needed = buffer + batch
        if needed > available:
            raise ValueError(
                f"seq_length={self.seq_length}, shuffle_buffer={self.shuffle_buffer} and "
                f"batch_size={self.batch_size} need at least {_size(needed)} of memory per "
                f"pipeline (the shuffle buffer {_size(buffer)}, a batch {_size(batch)}; "
                f"{self.dtype} tokens), more than the {_size(available)} available; lower "
                "seq_length, shuffle_buffer or batch_size"
            )
        if self.pack_mode == "best_fit":
            window = self.best_fit_window * BEST_FIT_PIECE_BYTES
            if buffer + batch + window > available:
                raise ValueError(
                    f"best_fit_window={self.best_fit_window} needs at least {_size(window)} of "
                    f"memory per pipeline (at least {BEST_FIT_PIECE_BYTES} B a piece: its "
                    f"place in a bin, its provenance row and a token), more than the "
                    f"{_size(available - buffer - batch)} left after the shuffle buffer and a "
                    "batch; lower best_fit_window (default 1000)"
                )

    def transforms_for(self, dataset: str) -> list[Transform]:
        """The transform steps of ``dataset``, in order (bare callables work on text when
        the config has a tokenizer, else on tokens).

        Raises:
            TypeError / ValueError: a bad ``transforms`` entry, naming it.
        """
        specs: Any = self.transforms
        if isinstance(specs, Mapping):
            unknown = sorted(set(specs) - {"*", *self.dataset_weights})
            if unknown:
                raise ValueError(
                    f"transforms names datasets {unknown} that are not in the config "
                    f"(datasets: {list(self.dataset_weights)}; '*' means all)"
                )
            specs = [*(specs.get("*") or []), *(specs.get(dataset) or [])]
        if not isinstance(specs, Sequence) or isinstance(specs, str):
            raise TypeError(
                f"transforms={specs!r} must be a list of transforms or a mapping dataset -> list"
            )
        on: On = "text" if self.tokenizer is not None else "tokens"
        return [from_spec(spec, on) for spec in specs]

    def _check_eval_split(self) -> None:
        fr = self.eval_fraction
        values = fr.values() if isinstance(fr, Mapping) else [fr]
        check_int("eval_seed", self.eval_seed, None)  # (EvalSplit would call it seed)
        for v in values:
            EvalSplit(v, self.eval_seed)  # its checks name the value
        if isinstance(fr, Mapping):
            unknown = sorted(set(fr) - set(self.dataset_weights))
            if unknown:
                raise ValueError(
                    f"eval_fraction names datasets {unknown} that are not in datasets "
                    f"{list(self.dataset_weights)}; use their names"
                )

    def eval_split(self, dataset: str) -> EvalSplit | None:
        """The held-out split of ``dataset`` (None: nothing held out)."""
        fr = self.eval_fraction
        f = fr.get(dataset, 0.0) if isinstance(fr, Mapping) else fr
        return EvalSplit(float(f), self.eval_seed) if f else None

    def _check_phases(self) -> None:
        if self.phases:
            self.phases, self.datasets = check_phases(
                self.phases, weights=self.weights, datasets=self.datasets, epochs=self.epochs
            )
        else:
            self.phases = []

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelineConfig:
        """Build from a mapping; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def from_megatron(
        cls,
        data_path: str | Sequence[str | float],
        storage_options: dict[str, Any] | None = None,
        **fields: Any,
    ) -> PipelineConfig:
        """A config reading the Megatron indexed datasets of Megatron-LM's ``--data-path``.

        Args:
            data_path: the ``--data-path`` value (``"0.3 /d/wiki_text_document 0.7
                /d/code_text_document"``, its list, or prefixes without weights); see
                :mod:`torchdata_ext.pipeline.megatron_blend` for the mapping.
            storage_options: fsspec options for remote prefixes.
            **fields: any other config field (``seq_length``, ``batch_size``...). ``eos_token``
                defaults to None: ``preprocess_data.py --append-eod`` already ended every
                document with the tokenizer's EOD.

        Returns:
            A config whose ``data_path``, ``datasets``, ``weights`` and ``file_type`` come
            from the blend.
        """
        from torchdata_ext.pipeline.megatron_blend import megatron_blend

        given = sorted({"data_path", "datasets", "weights", "file_type"} & set(fields))
        if given:
            raise ValueError(f"{given} come from the Megatron data_path; do not pass them too")
        fields.setdefault("eos_token", None)
        if storage_options is not None:
            fields["storage_options"] = storage_options
        return cls(**megatron_blend(data_path, storage_options), **fields)

    @classmethod
    def from_file(cls, url: str, storage_options: dict[str, Any] | None = None) -> PipelineConfig:
        """Load a ``.yaml``/``.yml`` or ``.json`` config (any fsspec URL).

        Raises:
            ValueError: the file is not valid YAML/JSON (naming the file, line and column), or
                not a mapping of known keys.
        """
        fs, path = filesystem(url, storage_options)
        with fs.open(path, "rt") as f:
            text = f.read()
        if url.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise ImportError("reading YAML configs needs PyYAML: pip install pyyaml") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(
                    f"{url}: not valid YAML{_yaml_where(exc)}; fix the config file"
                ) from None
        elif url.endswith(".json"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{url}: not valid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}); "
                    "fix the config file"
                ) from None
        else:
            raise ValueError(f"{url}: config files must end in .yaml, .yml or .json")
        if not isinstance(data, dict):
            raise ValueError(f"{url}: the config must be a mapping of keys to values")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def special_tokens(self) -> dict[str, int | None]:
        """The special token ids by field name (BOS, EOS, BOL, EOL, pad)."""
        names = ("bos_token", "eos_token", "bol_token", "eol_token", "pad_token")
        return {name: getattr(self, name) for name in names}

    def check_special_ids(self, tokenizer: Any | None = None) -> None:
        """Refuse special ids outside ``dtype`` or that ``tokenizer`` (this config's, loaded)
        emits for ordinary text.

        Raises:
            ValueError: naming the field, its value, the reason and the ids allowed.
        """
        ids = None if tokenizer is None else token_ids(tokenizer, self.tokenizer)
        if ids is not None and ids.vocab_size - 1 > np.iinfo(self.dtype).max:
            raise ValueError(
                f"dtype={self.dtype!r} cannot hold the ids of tokenizer={self.tokenizer!r} "
                f"(vocab_size {ids.vocab_size}); set dtype='int64'"
            )
        check_special_tokens(self.special_tokens, dtype=self.dtype, ids=ids)

    @property
    def dataset_weights(self) -> dict[str, float]:
        names = list(self.datasets) or [self._single_name()]
        weights = list(self.weights) or [1.0] * len(names)
        return dict(zip(names, weights))  # type: ignore[arg-type]

    def _single_name(self) -> str:
        return os.path.basename(str(self.data_path).rstrip("/")) or "data"


BEST_FIT_PIECE_BYTES = 100
"""A lower bound of the memory one piece of a ``best_fit`` window holds: its place in a bin
(a 3-tuple, 64 B, and a list slot), its provenance row (5 x int64) and one token."""


def _available_memory() -> int | None:
    """This machine's available memory in bytes (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: float) -> str:
    """``n`` bytes as ``12.3 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


def _yaml_where(exc: Exception) -> str:
    """Where and what a PyYAML error is, in the file's lines (PyYAML names the text it was
    given, ``"<unicode string>"``, not the file)."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return f" ({exc})"
    out = f" at {at(mark)} ({problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        out += f", {context} that starts at {at(context_mark)}"
    return out + ")"


def as_config(
    cfg: Any, storage_options: dict[str, Any] | None = None, *, name: str = "cfg"
) -> PipelineConfig:
    """``cfg`` as a :class:`PipelineConfig`: one as it is, a mapping of its fields, or the
    path or fsspec URL of a YAML/JSON config, read with ``storage_options``.

    Args:
        cfg: the config the run used.
        storage_options: fsspec options for a config URL.
        name: the caller's argument name, which the errors use.

    Raises:
        FileNotFoundError: no config file there.
        TypeError: ``cfg`` is none of these.
    """
    if isinstance(cfg, PipelineConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return PipelineConfig.from_dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        try:
            return PipelineConfig.from_file(os.fspath(cfg), storage_options)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{name}={os.fspath(cfg)!r} does not exist; pass the pipeline config (.yaml or "
                ".json) the run used"
            ) from None
    raise TypeError(
        f"{name} must be a PipelineConfig, a mapping of its fields or a YAML/JSON config path, "
        f"not {type(cfg).__name__}"
    )
