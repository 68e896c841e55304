"""The progress record of a :func:`~torchdata_ext.prepare_data.tokenize_text.prepare` part.

``_progress_part{K:05d}.json`` in the output folder holds the settings of part K
(:func:`progress_config`), the number of its next output and the input position (file,
document) where that output starts, and whether the part is done. A re-run reads it back
(:func:`saved_progress`) and resumes only with the same settings; the other parts' records
(:func:`other_parts_configs`) let a part refuse filters that disagree with theirs. Records of
earlier versions lack some settings: they read as the values every earlier run used.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import posixpath
from collections.abc import Sequence
from typing import Any

from torchdata_ext.prepare_data.filter import FILTER_DEFAULTS
from torchdata_ext.prepare_data.tokenize_inputs import TokenizeSettings

__all__ = [
    "PROGRESS_VERSION",
    "new_progress",
    "other_parts_configs",
    "progress_bytes",
    "progress_config",
    "progress_path",
    "saved_progress",
]

PROGRESS_VERSION = 1
# settings added after PROGRESS_VERSION 1, at the values every earlier run used
_PROGRESS_DEFAULTS = {"encoding": "utf-8", "compression": "infer", "dtype": "uint32"}
_PROGRESS_DEFAULTS.update(FILTER_DEFAULTS)  # data_fraction, seed, min_length, max_length


def progress_path(out_path: str, shard_id: int) -> str:
    """The path of part ``shard_id``'s progress record in the output folder ``out_path``."""
    return posixpath.join(out_path, f"_progress_part{shard_id:05d}.json")


def progress_config(
    how: TokenizeSettings,
    files: Sequence[str],
    format: str,
    eos_token: int | None,
    max_tokens_per_file: int,
    shard_id: int,
    num_shards: int,
    dtype: str,
) -> dict[str, Any]:
    """The settings the progress record keeps: a re-run resumes only with the same ones."""
    config = {
        "version": PROGRESS_VERSION,
        "inputs": hashlib.sha256("\n".join(files).encode()).hexdigest()[:16],
        "num_inputs": len(files),
        "format": format,
        "tokenizer": how.tokenizer,
        "byte_offset": how.byte_offset if how.tokenizer == "byte" else None,
        "text_field": how.text_field,
        "eos_token": eos_token,
        "max_tokens_per_file": max_tokens_per_file,
        "shard_id": shard_id,
        "num_shards": num_shards,
        "encoding": codecs.lookup(how.encoding).name,
        "compression": how.compression,
        "dtype": dtype,
    }
    config.update(how.doc_filter.as_config())
    return config


def new_progress(config: dict[str, Any]) -> dict[str, Any]:
    """The progress record of a part that has not started."""
    return {"config": config, "next_output": 0, "input": 0, "doc": 0, "done": False}


def progress_bytes(state: dict[str, Any]) -> bytes:
    """The progress record as its file holds it."""
    return json.dumps(state, indent=1, sort_keys=True).encode()


def other_parts_configs(fs: Any, out_path: str, shard_id: int) -> dict[str, dict[str, Any]]:
    """The settings the other parts' progress files in ``out`` record, by file name."""
    try:
        names = fs.glob(posixpath.join(out_path, "_progress_part*.json"))
    except FileNotFoundError:
        return {}
    out = {}
    for p in names:
        name = posixpath.basename(p)
        if name != f"_progress_part{shard_id:05d}.json":
            out[name] = {**_PROGRESS_DEFAULTS, **json.loads(fs.cat_file(p)).get("config", {})}
    return out


def saved_progress(
    fs: Any, ppath: str, config: dict[str, Any], out: str, shard_id: int
) -> dict[str, Any] | None:
    """The progress an earlier run of this part saved, or None; refuses other settings."""
    if not fs.exists(ppath):
        return None
    saved = json.loads(fs.cat_file(ppath))
    if "config" in saved:
        saved["config"] = {**_PROGRESS_DEFAULTS, **saved["config"]}
    if saved.get("config") != config:
        diff = sorted(k for k in config if saved.get("config", {}).get(k) != config[k])
        raise ValueError(
            f"{out} holds an earlier prepare of part {shard_id} with different settings "
            f"({', '.join(diff)}); use another out folder, or delete "
            f"{posixpath.basename(ppath)} and its part{shard_id:05d}_* files to start over"
        )
    return dict(saved)
