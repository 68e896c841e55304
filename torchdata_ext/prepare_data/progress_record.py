"""The progress record of a :func:`~torchdata_ext.prepare_data.tokenize_text.prepare` part.

``_progress_part{K:05d}.json`` in the output folder holds the settings of part K
(:func:`progress_config`), the number of its next output and the input position (file,
document) where that output starts, and whether the part is done. A re-run reads it back
(:func:`saved_progress`) and resumes only with the same settings; the other parts' records
(:func:`other_parts_configs`) let a part refuse filters that disagree with theirs. Records of
earlier versions lack some settings: they read as the values every earlier run used.

The record also holds each input's ``[size, version]`` (:func:`input_stats`; the version is
the file's ``mtime``, or its object store's ``ETag``/``generation``) as the part first read
it: a re-run whose inputs changed since (a file that grew, was rewritten) is refused naming
them, as the outputs already written hold their old content and a done part would otherwise
report itself complete without the new documents. Records without them are not checked.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torchdata_ext.prepare_data.filter import FILTER_DEFAULTS
from torchdata_ext.prepare_data.tokenize_inputs import TokenizeSettings
from torchdata_ext.sources.fingerprint import THREADS, file_stat

__all__ = [
    "PROGRESS_VERSION",
    "input_stats",
    "new_progress",
    "other_parts_configs",
    "progress_bytes",
    "progress_config",
    "progress_path",
    "saved_progress",
    "totals_summary",
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


def input_stats(files: Sequence[str], storage_options: dict[str, Any]) -> list[list[Any]]:
    """``[size, version]`` of each input (``-1`` / ``""`` where the filesystem does not say),
    asked :data:`~torchdata_ext.sources.fingerprint.THREADS` files at a time."""
    if not files:
        return []
    with ThreadPoolExecutor(min(THREADS, len(files))) as pool:
        return [list(st) for st in pool.map(lambda u: file_stat(u, storage_options), files)]


def new_progress(config: dict[str, Any], stats: list[list[Any]] | None = None) -> dict[str, Any]:
    """The progress record of a part that has not started (``stats``: :func:`input_stats`);
    ``documents`` and ``tokens`` count what its written outputs hold, over every run."""
    state = {"config": config, "next_output": 0, "input": 0, "doc": 0, "record": 0,
             "done": False, "documents": 0, "tokens": 0}  # fmt: skip
    if stats is not None:
        state["input_stats"] = stats
    return state


def totals_summary(resumed: bool, documents: int | None, tokens: int | None) -> str:
    """The summary line's totals of a resumed part, from its record ("" for a part written in
    one run, or whose record did not count them)."""
    if not resumed or documents is None:
        return ""
    return (
        f" added by this run; the part holds {documents:,} documents, {tokens or 0:,} tokens in "
        "all (the rest from the run it resumed)"
    )


def _changed(then: Sequence[Any], now: Sequence[Any]) -> bool:
    """Whether an input's ``[size, version]`` differs from the one recorded (unknown parts and
    versions of different kinds are not compared)."""
    (size0, ver0), (size1, ver1) = then, now
    if size0 >= 0 and size1 >= 0 and size0 != size1:
        return True
    same_kind = ver0.partition("=")[0] == ver1.partition("=")[0]
    return bool(ver0 and ver1 and same_kind and ver0 != ver1)


def _check_inputs(
    saved: dict[str, Any], files: Sequence[str], stats: Sequence[Any], out: str, ppath: str
) -> None:
    """Refuse a resume whose inputs changed since the record was started."""
    then = saved.get("input_stats")
    if then is None or len(then) != len(stats):
        return
    changed = [f for f, a, b in zip(files, then, stats) if _changed(a, b)]
    if not changed:
        return
    shard_id = int(saved["config"]["shard_id"])
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    raise ValueError(
        f"input file(s) {', '.join(changed[:3])}{more} changed (size or modification time) "
        f"since part {shard_id} was prepared from them into {out} "
        f"({posixpath.basename(ppath)}): its outputs hold their old content. To prepare them "
        f"again, delete {posixpath.basename(ppath)} and its part{shard_id:05d}_* files (or use "
        "another out folder) and run prepare again"
    )


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
    fs: Any,
    ppath: str,
    config: dict[str, Any],
    out: str,
    shard_id: int,
    files: Sequence[str] = (),
    stats: Sequence[Any] | None = None,
) -> dict[str, Any] | None:
    """The progress an earlier run of this part saved, or None; refuses other settings, and
    inputs (``files``, now at ``stats``: :func:`input_stats`) changed since it was started."""
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
    if stats is not None:
        _check_inputs(saved, files, stats, out, ppath)
    return dict(saved)
