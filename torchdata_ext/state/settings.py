"""The settings a node's state depends on: recorded in the state, refused by name on restore.

A node whose saved position means something only under its settings (the reader's block size,
the mix's quantum, the packer's BOS/EOS, the tokenizer) records them under :data:`SETTINGS_KEY`
as a small dict of plain values keyed by the :class:`~torchdata_ext.pipeline.config.PipelineConfig`
field name, and calls :func:`check_settings` in ``reset(initial_state)``: a restore with another
value would repeat or lose data silently, so it is refused naming the field, both values and
the way out. A state saved before a setting was recorded lacks it: unknown, not checked.
:func:`check_graph_settings` makes the same check over a whole saved graph state before
anything is restored (:mod:`torchdata_ext.checkpoint.restore`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["SETTINGS_KEY", "check_graph_settings", "check_settings", "settings_mismatch"]

SETTINGS_KEY = "settings"


def settings_mismatch(
    saved: Any, mine: Mapping[str, Any], args: Mapping[str, str] | None = None
) -> str | None:
    """The description of the first setting of ``mine`` that ``saved`` (a state's
    :data:`SETTINGS_KEY` value, or None) records with another value; None if none does.
    ``args`` names a node argument where it differs from the config field. A setting that is
    a list of steps (``transforms``: one mapping per step, its ``"step"`` name and its
    parameters) is described by the first step and parameter that differ."""
    if not isinstance(saved, Mapping):
        return None
    for key, now in mine.items():
        if key not in saved:  # recorded later than this state: unknown
            continue
        then = saved[key]
        if then == now:
            continue
        steps = _steps_difference(key, then, now)
        if steps is not None:
            return (
                f"{steps}; the saved position counts documents as the checkpoint's steps made "
                "them, so the restore would repeat or lose data. Restore with the checkpoint's "
                f"{key} ({_shown_steps(then)}), or start a new run"
            )
        arg = (args or {}).get(key)
        name = f"{key} (node argument {arg})" if arg and arg != key else key
        return (
            f"{name} differs: the checkpoint was taken with {key}={then!r}, this pipeline has "
            f"{key}={now!r}; the saved position means something else under another {key}, so "
            "the restore would repeat or lose data. Restore with the checkpoint's value "
            f"({key}={then!r}), or start a new run"
        )
    return None


def _is_steps(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, Mapping) and "step" in x for x in value)


def _shown_step(step: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in step.items() if k != "step")
    return f"{step['step']}({args})"


def _shown_steps(steps: Any) -> str:
    return "[" + ", ".join(_shown_step(s) for s in steps) + "]" if _is_steps(steps) else repr(steps)


def _steps_difference(key: str, then: Any, now: Any) -> str | None:
    """Where two lists of steps differ (the step, the parameter, both values); None if they
    are not both lists of steps."""
    if not (_is_steps(then) and _is_steps(now)):
        return None
    for i, (a, b) in enumerate(zip(then, now), 1):
        if a["step"] != b["step"]:
            return (
                f"{key} step {i} differs: the checkpoint was taken with {_shown_step(a)}, this "
                f"pipeline has {_shown_step(b)}"
            )
        for p in [*a, *(k for k in b if k not in a)]:
            if a.get(p) != b.get(p):
                return (
                    f"{key} step {i} ({a['step']}) differs in {p}: the checkpoint was taken "
                    f"with {p}={a.get(p)!r}, this pipeline has {p}={b.get(p)!r}"
                )
    return (
        f"{key} differs: the checkpoint was taken with {len(then)} step(s) "
        f"{_shown_steps(then)}, this pipeline has {len(now)} {_shown_steps(now)}"
    )


def check_settings(
    node: str,
    state: Mapping[str, Any],
    mine: Mapping[str, Any],
    args: Mapping[str, str] | None = None,
) -> None:
    """Refuse restoring ``node`` (its class name) from ``state`` if a recorded setting differs
    from ``mine``.

    Raises:
        ValueError: naming the setting, the checkpoint's value, this one's and what to do.
    """
    problem = settings_mismatch(state.get(SETTINGS_KEY), mine, args)
    if problem is not None:
        raise ValueError(f"cannot restore {node}: {problem}")


def check_graph_settings(
    saved: Any,
    mine: Any,
    where: str = "this checkpoint",
    may_differ: Collection[str] = (),
    notes: Mapping[str, str] | None = None,
) -> None:
    """Refuse a saved graph state whose recorded settings differ from those of the graph state
    ``mine`` (a fresh graph of the current pipeline) at the same place. Places only one side
    has (a dataset added since) are not compared here. Settings in ``may_differ`` are not
    compared; ``notes`` adds to a setting's refusal why it must match here.

    Raises:
        ValueError: naming the setting (see :func:`check_settings`).
    """
    if isinstance(saved, Mapping) and isinstance(mine, Mapping):
        if isinstance(saved.get(SETTINGS_KEY), Mapping) and isinstance(
            mine.get(SETTINGS_KEY), Mapping
        ):
            now = {k: v for k, v in mine[SETTINGS_KEY].items() if k not in may_differ}
            problem = settings_mismatch(saved[SETTINGS_KEY], now)
            if problem is not None:
                key = problem.split(" ", 1)[0]
                note = f" ({notes[key]})" if notes and key in notes else ""
                raise ValueError(f"cannot restore {where}: {problem}{note}")
        if "cursors" in saved or "shards" in saved:  # a reader: its cursors hold no node state
            return
        for k, v in saved.items():
            if k != SETTINGS_KEY and k in mine:
                check_graph_settings(v, mine[k], where, may_differ, notes)
    elif isinstance(saved, list) and isinstance(mine, list):
        for a, b in zip(saved, mine):
            check_graph_settings(a, b, where, may_differ, notes)
