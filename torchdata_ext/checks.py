"""Argument checks shared by the nodes and the shard maths (one definition, one message)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["check_int", "split_list"]


def check_int(name: str, value: object, minimum: int | None) -> int:
    """Return ``value`` as an ``int`` after checking it is an integer ``>= minimum``.

    Args:
        name: the argument's name, quoted in the error.
        value: what the caller passed.
        minimum: the smallest allowed value, or ``None`` for no lower bound.

    Raises:
        TypeError: ``value`` is not an integer (``bool`` counts as not one).
        ValueError: ``value`` is below ``minimum``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return int(value)


def split_list(value: Any, what: str) -> list[str]:
    """A config list given as a comma-separated string or a sequence, as stripped strings
    (None: empty).

    Raises:
        TypeError: ``value`` is neither (``what`` names it in the message).
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, Sequence):
        return [str(v).strip() for v in value]
    raise TypeError(f"{what}={value!r} must be a comma-separated string or a list")
