"""torchdata-ext: stateful, rescalable torchdata.nodes pipelines for LLM pre-training.

The standard pipeline, stage by stage: file handlers (:mod:`torchdata_ext.handlers`) read
shard files over fsspec; :class:`DatasetIndex` lists and counts a dataset's documents;
:class:`ShardReader` cuts them into logical shards and walks each shard in a seeded random
order, exactly once per epoch; :class:`Tokenize`, :class:`Interleave`, :class:`Pack`,
:class:`ShuffleBuffer` and :class:`Collate` turn documents into packed batches
(:class:`Concat` delivers curriculum phases in turn, :class:`Take` ends a stream at a budget);
:func:`build_pipeline` builds all of it from a :class:`PipelineConfig`; :class:`TokenLoader`
runs it under ``StatefulDataLoader`` workers, and :mod:`torchdata_ext.checkpoint` saves,
restores and rescales it. :func:`prepare` tokenizes text files into token shards and
:func:`inspect_dataset` summarizes a dataset and :func:`audit_checkpoint` says what a checkpoint
consumed (the ``torchdata-ext`` command calls all three).

The exceptions the docs tell users to catch are importable from here too:
:class:`ChangedFilesError`, :class:`DataFileError`, :class:`NothingKeptError`,
:class:`RemoteError`, :class:`StaleIndexError` and :class:`TransformError`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and IDEs see them; at run time, __getattr__
    from torchdata_ext.audit.inspect_data import inspect_dataset
    from torchdata_ext.audit.report import AuditReport, audit_checkpoint
    from torchdata_ext.document import Document, DocumentBlock
    from torchdata_ext.forensics.replay import show_batches
    from torchdata_ext.handlers.base import DataFileError
    from torchdata_ext.loader.evaluation import EvalLoader
    from torchdata_ext.loader.token_loader import PipelineDataset, TokenLoader
    from torchdata_ext.nodes import (
        Collate,
        Concat,
        FilterDocuments,
        Interleave,
        MapDocuments,
        Pack,
        ShardReader,
        ShuffleBuffer,
        Take,
        Tokenize,
        TransformDocuments,
        merge_reader_states,
    )
    from torchdata_ext.nodes.drops import NothingKeptError
    from torchdata_ext.order.split import EvalSplit
    from torchdata_ext.order.walk import RandomWalk, mix_seed
    from torchdata_ext.pipeline.build import build_datasets, build_eval_pipeline, build_pipeline
    from torchdata_ext.pipeline.config import PipelineConfig
    from torchdata_ext.prepare_data.tokenize_text import prepare
    from torchdata_ext.remote import RemoteError, RetryPolicy, ShardCache
    from torchdata_ext.sources.fingerprint import ChangedFilesError
    from torchdata_ext.sources.index import DatasetIndex
    from torchdata_ext.sources.index_file import StaleIndexError
    from torchdata_ext.state.reader_state import ReaderCursors, reader_cursors
    from torchdata_ext.tokenizers.load import ByteTokenizer
    from torchdata_ext.transforms import TransformError
    from torchdata_ext.world import World

# public name -> the module defining it, imported on first use (PEP 562): `import torchdata_ext`
# and the command line's `--help` load no torch; `from torchdata_ext import X` works as before
_MODULE_OF = {
    "AuditReport": "torchdata_ext.audit.report",
    "ByteTokenizer": "torchdata_ext.tokenizers.load",
    "ChangedFilesError": "torchdata_ext.sources.fingerprint",
    "Collate": "torchdata_ext.nodes",
    "Concat": "torchdata_ext.nodes",
    "DataFileError": "torchdata_ext.handlers.base",
    "DatasetIndex": "torchdata_ext.sources.index",
    "Document": "torchdata_ext.document",
    "DocumentBlock": "torchdata_ext.document",
    "EvalLoader": "torchdata_ext.loader.evaluation",
    "EvalSplit": "torchdata_ext.order.split",
    "FilterDocuments": "torchdata_ext.nodes",
    "Interleave": "torchdata_ext.nodes",
    "MapDocuments": "torchdata_ext.nodes",
    "NothingKeptError": "torchdata_ext.nodes.drops",
    "Pack": "torchdata_ext.nodes",
    "PipelineConfig": "torchdata_ext.pipeline.config",
    "PipelineDataset": "torchdata_ext.loader.token_loader",
    "RandomWalk": "torchdata_ext.order.walk",
    "ReaderCursors": "torchdata_ext.state.reader_state",
    "RemoteError": "torchdata_ext.remote",
    "RetryPolicy": "torchdata_ext.remote",
    "ShardCache": "torchdata_ext.remote",
    "ShardReader": "torchdata_ext.nodes",
    "ShuffleBuffer": "torchdata_ext.nodes",
    "StaleIndexError": "torchdata_ext.sources.index_file",
    "Take": "torchdata_ext.nodes",
    "TokenLoader": "torchdata_ext.loader.token_loader",
    "Tokenize": "torchdata_ext.nodes",
    "TransformDocuments": "torchdata_ext.nodes",
    "TransformError": "torchdata_ext.transforms",
    "World": "torchdata_ext.world",
    "audit_checkpoint": "torchdata_ext.audit.report",
    "build_datasets": "torchdata_ext.pipeline.build",
    "build_eval_pipeline": "torchdata_ext.pipeline.build",
    "build_pipeline": "torchdata_ext.pipeline.build",
    "inspect_dataset": "torchdata_ext.audit.inspect_data",
    "merge_reader_states": "torchdata_ext.nodes",
    "mix_seed": "torchdata_ext.order.walk",
    "prepare": "torchdata_ext.prepare_data.tokenize_text",
    "reader_cursors": "torchdata_ext.state.reader_state",
    "show_batches": "torchdata_ext.forensics.replay",
}

__all__ = [
    "AuditReport",
    "ByteTokenizer",
    "ChangedFilesError",
    "Collate",
    "Concat",
    "DataFileError",
    "DatasetIndex",
    "Document",
    "DocumentBlock",
    "EvalLoader",
    "EvalSplit",
    "FilterDocuments",
    "Interleave",
    "MapDocuments",
    "NothingKeptError",
    "Pack",
    "PipelineConfig",
    "PipelineDataset",
    "RandomWalk",
    "ReaderCursors",
    "RemoteError",
    "RetryPolicy",
    "ShardCache",
    "ShardReader",
    "ShuffleBuffer",
    "StaleIndexError",
    "Take",
    "TokenLoader",
    "Tokenize",
    "TransformDocuments",
    "TransformError",
    "World",
    "audit_checkpoint",
    "build_datasets",
    "build_eval_pipeline",
    "build_pipeline",
    "inspect_dataset",
    "merge_reader_states",
    "mix_seed",
    "prepare",
    "reader_cursors",
    "show_batches",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here (PEP 562)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'torchdata_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
