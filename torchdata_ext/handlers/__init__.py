"""File-format handlers: Arrow, Parquet, CEPED / flat token NumPy files, Megatron indexed
datasets, JSON Lines, MDS, CBOR, and in-memory documents (``memory``).

Pick a handler by name with :func:`get_handler` or by file suffix with :func:`handler_for_url`;
add a format with :func:`register_handler`. Handler modules are imported lazily by the
registry, so importing this package does not import pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchdata_ext.handlers.base import (
    DataFileError,
    DocData,
    FileHandler,
    format_for_url,
    get_handler,
    get_handler_class,
    handler_for_url,
    register_handler,
    registered_formats,
)

if TYPE_CHECKING:
    from torchdata_ext.handlers.arrow import ArrowHandler
    from torchdata_ext.handlers.cbor import CborHandler
    from torchdata_ext.handlers.jsonl import JsonlHandler
    from torchdata_ext.handlers.mds import MdsHandler
    from torchdata_ext.handlers.megatron import MegatronHandler
    from torchdata_ext.handlers.memory import MemoryHandler, MemorySource
    from torchdata_ext.handlers.numpy_tokens import CepedHandler, FlatTokenHandler, NpyHandler
    from torchdata_ext.handlers.parquet import ParquetHandler
    from torchdata_ext.handlers.token_shards import LlmcHandler, NanoGptHandler

__all__ = [
    "ArrowHandler",
    "CborHandler",
    "CepedHandler",
    "DataFileError",
    "DocData",
    "FileHandler",
    "FlatTokenHandler",
    "JsonlHandler",
    "LlmcHandler",
    "MdsHandler",
    "MegatronHandler",
    "MemoryHandler",
    "MemorySource",
    "NanoGptHandler",
    "NpyHandler",
    "ParquetHandler",
    "format_for_url",
    "get_handler",
    "get_handler_class",
    "handler_for_url",
    "register_handler",
    "registered_formats",
]

_LAZY = {
    "ArrowHandler": "torchdata_ext.handlers.arrow",
    "CborHandler": "torchdata_ext.handlers.cbor",
    "CepedHandler": "torchdata_ext.handlers.numpy_tokens",
    "FlatTokenHandler": "torchdata_ext.handlers.numpy_tokens",
    "NpyHandler": "torchdata_ext.handlers.numpy_tokens",
    "JsonlHandler": "torchdata_ext.handlers.jsonl",
    "LlmcHandler": "torchdata_ext.handlers.token_shards",
    "NanoGptHandler": "torchdata_ext.handlers.token_shards",
    "MdsHandler": "torchdata_ext.handlers.mds",
    "MegatronHandler": "torchdata_ext.handlers.megatron",
    "MemoryHandler": "torchdata_ext.handlers.memory",
    "MemorySource": "torchdata_ext.handlers.memory",
    "ParquetHandler": "torchdata_ext.handlers.parquet",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
