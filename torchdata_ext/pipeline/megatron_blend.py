"""Megatron's data blend (``--data-path``) as this loader's datasets and weights.

Megatron-LM names its training data with ``--data-path``: either dataset prefixes
(``--data-path /d/wiki_text_document /d/code_text_document``) or weights and prefixes in turn
(``--data-path 0.3 /d/wiki_text_document 0.7 /d/code_text_document``), as megatron-core's
``get_blend_from_list`` reads them. A prefix names a ``<prefix>.bin`` + ``<prefix>.idx`` pair.

The mapping (:func:`megatron_blend`):

* every prefix is one dataset, named by its path relative to the prefixes' common folder plus
  ``.idx`` (``wiki_text_document.idx``), under ``data_path`` = that folder, ``file_type``
  ``"megatron"``;
* weights: Megatron's weights are shares of samples, each ``seq_length`` tokens, so shares of
  tokens: this loader's weights (counted in tokens) take them as they are. Without weights
  Megatron builds one epoch of every dataset, so each dataset's weight is its token count
  (read from the ``.idx`` files).

Megatron's ``--split`` (train/valid/test by documents) has no counterpart here: use
``eval_split`` for a held-out share.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

__all__ = ["megatron_blend"]


def _parse(blend: str | Sequence[str | float]) -> tuple[list[str], list[float] | None]:
    """``(prefixes, weights or None)`` of a ``--data-path`` value, as megatron-core's
    ``get_blend_from_list`` reads it: an even-length list whose every other item (from the
    first) is a number is weights and prefixes; anything else is prefixes."""
    items = blend.split() if isinstance(blend, str) else [str(x) for x in blend]
    if not items:
        raise ValueError("data_path is empty; pass Megatron's --data-path, e.g. '0.3 a 0.7 b'")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            pass
        else:
            return [p.strip() for p in items[1::2]], weights
    return [p.strip() for p in items], None


def megatron_blend(
    blend: str | Sequence[str | float], storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The :class:`~torchdata_ext.pipeline.config.PipelineConfig` fields that Megatron's
    ``--data-path`` blend means: ``data_path``, ``datasets``, ``weights`` and ``file_type``.

    Args:
        blend: the ``--data-path`` value: a string (``"0.3 /d/a 0.7 /d/b"``) or its list
            (``[0.3, "/d/a", 0.7, "/d/b"]`` or ``["/d/a", "/d/b"]``). Prefixes may be any
            fsspec URL (all on one store).
        storage_options: fsspec options, to read token counts when the blend has no weights.

    Raises:
        ValueError: an empty blend, a prefix named twice, or a weight that is negative or a
            total of zero.
    """
    prefixes, weights = _parse(blend)
    for suffix in (".idx", ".bin"):  # a prefix given with its file's suffix is that prefix
        prefixes = [p[: -len(suffix)] if p.endswith(suffix) else p for p in prefixes]
    if len(set(prefixes)) != len(prefixes):
        dup = sorted({p for p in prefixes if prefixes.count(p) > 1})
        raise ValueError(f"data_path names {dup} more than once; merge their weights")
    if weights is not None and (min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"data_path weights {weights} must be >= 0 with a positive total")
    root = posixpath.dirname(prefixes[0])
    while any(not p.startswith(root.rstrip("/") + "/") for p in prefixes):
        parent = posixpath.dirname(root.rstrip("/"))
        if parent == root:
            root = ""
            break
        root = parent
    names = [(p[len(root.rstrip("/")) + 1 :] if root else p) + ".idx" for p in prefixes]
    if weights is None:
        weights = [float(_tokens(p + ".idx", storage_options)) for p in prefixes]
    return {
        "data_path": root or ".",
        "datasets": names,
        "weights": weights,
        "file_type": "megatron",
    }


def _tokens(url: str, storage_options: dict[str, Any] | None) -> int:
    """Tokens in the Megatron pair ``url`` names (from its index; the ``.bin`` is not read)."""
    from torchdata_ext.handlers.megatron import MegatronHandler

    handler = MegatronHandler(storage_options=storage_options)
    reader = handler.open(url)
    try:
        return int(handler.doc_lengths(reader).sum())
    finally:
        handler.close(reader)
