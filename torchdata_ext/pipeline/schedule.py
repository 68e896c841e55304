"""``PipelineConfig.weight_schedule``: the datasets' weights as a function of training progress.

``weight_schedule: {20000: "1,1", 25000: {"web": 1, "code": 3}}`` means: the config's
``weights`` up to step 19,999, 1:1 from step 20,000, 1:3 from step 25,000 (steps of the
training loop, counted from 1 as the loader's ``step``, the same on every topology: a step is
one batch on every rank; key 0 is the start). With ``weight_schedule_unit="tokens"`` the keys
are global tokens (``{0: "3,1", 2e9: "1,1", 2.5e9: "1,3"}``): a point applies from the first
step whose batch starts at or after it, a step being ``world_size x batch_size x seq_length``
tokens (the run's history of that figure is recorded, so a restore with another global batch
keeps the points already passed where they were). Piecewise constant, or with
``weight_schedule_ramp_every=N`` linear between points: the shares (weights over their sum)
move from one point's to the next's in stairs of ``N`` steps. Each entry (each stair) is a
change the loader makes itself at that step, exactly as a trainer's
:meth:`~torchdata_ext.loader.token_loader.TokenLoader.set_weights` call (see
:mod:`torchdata_ext.loader.weights`: the workers restart from the exact state after the step
before, so the change lands at its step; the rows already buffered are delivered as they were
mixed). The schedule is recorded with the loader state, and a restore under another schedule
is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchdata_ext.checks import split_list

__all__ = [
    "SCHEDULE_UNITS",
    "checked_weights",
    "refuse_weight_changes",
    "schedule_of",
    "weight_schedule",
]

SCHEDULE_UNITS = ("steps", "tokens")


def checked_weights(value: Any, names: Sequence[str], where: str) -> dict[str, float]:
    """One set of weights (a schedule entry's, or a :meth:`TokenLoader.set_weights` call's): a
    list / comma-separated string in the datasets' order, or a mapping name -> weight; every
    dataset one finite number > 0. ``where`` names the setting in the messages.

    Raises:
        ValueError: a dataset missing or unknown, a count that does not fit, or a weight that
            is not a finite number > 0.
    """
    if isinstance(value, Mapping):
        got = {str(k): v for k, v in value.items()}
    else:
        items = split_list(value, where)
        if len(items) != len(names):
            raise ValueError(
                f"{where}={value!r}: {len(items)} weights for the {len(names)} datasets "
                f"{list(names)}; give one per dataset, in that order, or a mapping name -> weight"
            )
        got = dict(zip(names, items))
    missing = [n for n in names if n not in got]
    unknown = [n for n in got if n not in names]
    if missing or unknown:
        raise ValueError(
            f"{where}: give one weight per dataset of the config {list(names)} "
            f"(missing {missing}, unknown {unknown})"
        )
    out = {}
    for name in names:
        w = got[name]
        try:
            x = float(w) if not isinstance(w, bool) else float("nan")
        except (TypeError, ValueError):
            x = float("nan")
        if not 0 < x < float("inf"):
            raise ValueError(f"{where}: weights[{name!r}]={w!r} must be a finite number > 0")
        out[name] = x
    return out


def refuse_weight_changes(cfg: Any, what: str) -> None:
    """Refuse weights that change during the run (``what``: the setting or call) with the
    settings that cannot make such a change exact.

    Raises:
        ValueError: ``phases`` (each phase has its own weights) or ``pack_mode="best_fit"``
            (its window replays several blocks the old weights decided).
    """
    if cfg.phases:
        raise ValueError(
            f"{what} with curriculum phases: each phase has its own weights; change a phase's "
            "weights in the config (restore with allow_weight_changes=True), or drop the phases"
        )
    if cfg.pack_mode == "best_fit":
        raise ValueError(
            f"{what} with pack_mode='best_fit': its window replays several blocks the old "
            "weights decided, so a change there cannot be exact; use pack_mode concat or pad"
        )


def weight_schedule(value: Any, names: Sequence[str], unit: str = "steps") -> list[list[Any]]:
    """``value`` (``{at: weights}``, or the ``[[at, {name: weight}], ...]`` it becomes) checked
    against the datasets ``names``: sorted, each ``at`` an integer >= 0 (a training step for
    ``unit="steps"``, a global token count for ``unit="tokens"``: ``2e9`` and ``"2.5e9"`` are
    read as numbers).

    Raises:
        TypeError: ``value`` is neither a mapping nor a list of ``[at, weights]`` pairs.
        ValueError: a key < 0 or not a whole number, twice the same key, or weights that do
            not fit the datasets.
    """
    if value is None:
        return []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str):
        pairs = [tuple(p) for p in value]
        if any(len(p) != 2 for p in pairs):
            raise TypeError(f"weight_schedule={value!r}: give a mapping {unit} -> weights")
    else:
        raise TypeError(
            f'weight_schedule={value!r}: give a mapping {unit} -> weights, e.g. {{20000: "1,1"}}'
        )
    what = (
        "a training step (the step the weights apply from)"
        if unit == "steps"
        else ("a global token count (the weights apply from the first step starting there)")
    )
    out: list[list[Any]] = []
    for key, weights in pairs:
        at = _whole_number(key)
        if at is None or at < 0:
            raise ValueError(
                f"weight_schedule: key {key!r} must be a whole number >= 0: {what} "
                f"(weight_schedule_unit={unit!r})"
            )
        out.append([at, checked_weights(weights, names, f"weight_schedule[{key!r}]")])
    out.sort(key=lambda p: p[0])
    for a, b in zip(out, out[1:]):
        if a[0] == b[0]:
            raise ValueError(f"weight_schedule: {unit} {a[0]} is given twice")
    return out


def _whole_number(key: Any) -> int | None:
    """``key`` as a whole number (an int, a float such as 2e9, or a string of either)."""
    if isinstance(key, bool):
        return None
    if isinstance(key, str):
        try:
            key = float(key.strip().replace("_", ""))
        except ValueError:
            return None
    if isinstance(key, float):
        return int(key) if key == key and key != float("inf") and key.is_integer() else None
    return key if isinstance(key, int) else None


def schedule_of(cfg: Any) -> list[list[Any]]:
    """``cfg.weight_schedule`` checked (see :func:`weight_schedule`) with its unit and ramp,
    and refused with the settings a change of weights cannot be exact with.

    Raises:
        ValueError: as :func:`weight_schedule`, an unknown ``weight_schedule_unit``, a
            ``weight_schedule_ramp_every`` that is not an integer >= 0, or a schedule with
            ``phases`` (each phase has its own weights) or ``pack_mode="best_fit"`` (its window
            replays several blocks).
    """
    unit, ramp = cfg.weight_schedule_unit, cfg.weight_schedule_ramp_every
    if unit not in SCHEDULE_UNITS:
        raise ValueError(
            f"weight_schedule_unit={unit!r} must be one of {list(SCHEDULE_UNITS)} (what the "
            "weight_schedule's keys count)"
        )
    if isinstance(ramp, bool) or not isinstance(ramp, int) or ramp < 0:
        raise ValueError(
            f"weight_schedule_ramp_every={ramp!r} must be an integer >= 0 (0: piecewise "
            "constant; N: linear between the points, a change every N steps)"
        )
    out = weight_schedule(cfg.weight_schedule, list(cfg.dataset_weights), unit)
    if out:
        refuse_weight_changes(cfg, "weight_schedule")
    return out
