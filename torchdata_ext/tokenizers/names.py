"""Tokenizers by Hugging Face model name (``allenai/dolma2-tokenizer``), from the local cache
only: nothing is ever downloaded.

:func:`~torchdata_ext.tokenizers.load.load_tokenizer` comes here for a spec that is no file and
looks like a model name. With ``transformers`` installed, the tokenizer is
``AutoTokenizer.from_pretrained(name, local_files_only=True)``, as Bolmo's data script loads
it (the model's ``config.json`` and tokenizer files must be cached), used through its
``tokenizers`` backend so that every tool sees one kind of tokenizer. Without it, the model's
cached ``tokenizer.json`` is loaded with ``tokenizers`` (``huggingface_hub``, which
``tokenizers`` depends on, finds it). The cache is ``HF_HUB_CACHE`` (default
``$HF_HOME/hub``, ``~/.cache/huggingface/hub``), as for every Hugging Face library; fill it
once where there is network (``hf download NAME``). A name that is not cached is an error
saying so and what to do.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

__all__ = ["is_model_name", "load_cached_tokenizer"]

# a Hugging Face repository id: "name" or "owner/name" (letters, digits, "-", "_", ".")
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_model_name(spec: str) -> bool:
    """Whether ``spec`` can be a Hugging Face model name (not a URL, not a ``.json`` file)."""
    return (
        "://" not in spec
        and not spec.lower().endswith(".json")
        and ".." not in spec
        and _NAME.fullmatch(spec) is not None
    )


def load_cached_tokenizer(name: str) -> Any:
    """The tokenizer of model ``name`` from the local Hugging Face cache (see the module
    docstring), as a ``tokenizers.Tokenizer`` (a ``transformers`` fast tokenizer's backend,
    which encodes as the ``transformers`` tokenizer does, special tokens included).

    Raises:
        FileNotFoundError: ``name`` is not in the cache (naming the cache and the fixes).
        ValueError: ``transformers`` loads it as a slow tokenizer (no ``tokenizers`` backend).
        ImportError: ``huggingface_hub`` is missing (it comes with ``tokenizers``).
    """
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise ImportError(
            f"tokenizer={name!r} names a Hugging Face model, which needs the tokenizers "
            "package: pip install 'torchdata-ext[text]' (or pass the path of a tokenizer.json)"
        ) from None
    cache = constants.HF_HUB_CACHE
    fixes = (
        f"this tool never downloads: fetch it once where there is network (hf download {name}), "
        "set HF_HUB_CACHE (or HF_HOME) to the cache that holds it, or pass the path of its "
        "tokenizer.json"
    )
    try:
        auto: Any = importlib.import_module("transformers").AutoTokenizer
    except ImportError:
        auto = None
    if auto is not None:
        try:
            loaded = auto.from_pretrained(name, local_files_only=True, cache_dir=cache)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FileNotFoundError(
                f"tokenizer={name!r}: no such file, and transformers found no model of that "
                f"name in the local cache {cache} ({first}); {fixes}"
            ) from None
        backend = getattr(loaded, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"tokenizer={name!r}: transformers loads it as {type(loaded).__name__}, which has "
                "no Hugging Face tokenizers backend (a slow tokenizer); save it as a fast "
                "tokenizer (tokenizer.json) and pass that path"
            )
        return backend
    path = try_to_load_from_cache(name, "tokenizer.json", cache_dir=cache)
    if not isinstance(path, str):
        other = try_to_load_from_cache(name, "tokenizer_config.json", cache_dir=cache)
        if isinstance(other, str):
            raise FileNotFoundError(
                f"tokenizer={name!r}: the cached model {name} has no tokenizer.json (its "
                "tokenizer needs transformers to load): pip install 'torchdata-ext[transformers]'"
            )
        raise FileNotFoundError(
            f"tokenizer={name!r}: no such file, and no model of that name with a tokenizer.json "
            f"in the local Hugging Face cache {cache}; {fixes}"
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)
