"""The trainer changes the mix during the run (``TokenLoader.set_weights``, issue 31 item 2).

A change lands at a definite step; a restore from any step's state, with the calls made after
it made again, gives exactly the batches of the uninterrupted run; a rescale from a checkpoint
taken after a change delivers every document once and keeps the new mix; the delivered share
follows the new weights; a step the loader has passed is refused naming the earliest one.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    document_lengths,
    same_input_ids,
    two_dataset_config,
)

from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD

pytestmark = pytest.mark.multiprocess

CALLS = {4: ({"web": 1.0, "code": 3.0}, 6), 11: ({"web": 3.0, "code": 1.0}, 12)}
"""At step k (after taking batch k): the weights and the step they take effect from."""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    return two_dataset_config(str(tmp_path_factory.mktemp("set_weights")))


def _run(loader: TokenLoader, start: int, stop: int | None, states: dict | None = None) -> list:
    """Batches ``start + 1 .. stop`` (None: to the end), making the calls of ``CALLS`` after
    the steps they are made at; ``states[k]``: the state after step k."""
    out = []
    step = start
    if states is not None:
        states[step] = loader.state_dict()
    for batch in loader:
        step += 1
        out.append(batch)
        if states is not None:
            states[step] = loader.state_dict()
        if step in CALLS:
            weights, at = CALLS[step]
            assert loader.set_weights(weights, from_step=at) == at
        if step == stop:
            break
    loader.close()
    return out


def test_restore_at_any_step_replays_the_changes(cfg) -> None:
    build = functools.partial(build_pipeline, cfg)
    states: dict = {}
    full = _run(TokenLoader(build, num_workers=2), 0, 20, states)
    for k in (0, 3, 5, 6, 9, 12):
        loader = TokenLoader(build, num_workers=2)
        loader.load_state_dict(states[k])
        rest = _run(loader, k, 20)
        assert same_input_ids(rest, full[k:]), f"restored at step {k}"
    # the changes are in the state: a restore after both needs no call
    assert states[12]["weight_changes"] == [[6, {"web": 1.0, "code": 3.0}],
                                            [12, {"web": 3.0, "code": 1.0}]]  # fmt: skip


def test_the_mix_follows_the_new_weights(cfg) -> None:
    build = functools.partial(build_pipeline, cfg)
    batches = _run(TokenLoader(build, num_workers=2), 0, 24)

    def share_of_code(a: int, b: int) -> float:  # steps a..b, 1-based
        ids = np.concatenate([x["dataset_ids"].numpy().ravel() for x in batches[a - 1 : b]])
        return float((ids == 1).sum() / (ids >= 0).sum())

    # the new mix holds from its step, without first making up for the old one (which would
    # give code all of steps 6-10 and web all of 12-19)
    assert 0.35 < share_of_code(1, 5) < 0.65  # 1:1
    assert 0.6 < share_of_code(7, 11) < 0.9  # 1:3 from step 6
    assert 0.1 < share_of_code(14, 24) < 0.4  # 3:1 from step 12


def test_a_passed_step_is_refused_naming_the_earliest(cfg) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    it = iter(loader)
    for _ in range(4):
        next(it)
    with pytest.raises(ValueError, match="earliest step a change can take effect is 5"):
        loader.set_weights({"web": 1.0, "code": 2.0}, from_step=4)
    assert loader.earliest_weight_step() == 5
    with pytest.raises(ValueError, match=r"one weight per dataset .*missing \['code'\]"):
        loader.set_weights({"web": 1.0})
    with pytest.raises(ValueError, match=r"weights\['code'\]=0 must be a finite number > 0"):
        loader.set_weights({"web": 1.0, "code": 0})
    loader.close()
    best_fit = TokenLoader(
        functools.partial(build_pipeline, dataclasses.replace(cfg, pack_mode="best_fit"))
    )
    with pytest.raises(ValueError, match="pack_mode='best_fit'"):
        best_fit.set_weights({"web": 1.0, "code": 2.0})


def test_a_rescale_after_a_change_delivers_every_document_once(cfg, tmp_path) -> None:
    build = functools.partial(build_pipeline, cfg)
    states: dict = {}
    first = _run(TokenLoader(build, num_workers=2), 0, 8, states)  # the change at 6 applied
    again = TokenLoader(build, num_workers=2)
    again.load_state_dict(states[8])
    save_checkpoint(again, str(tmp_path / "ckpt"))
    rescaled = TokenLoader(build, num_workers=3)
    load_checkpoint(rescaled, str(tmp_path / "ckpt"))
    assert rescaled.state_dict()["weight_changes"][0] == [6, {"web": 1.0, "code": 3.0}]
    rest = _run(rescaled, 8, None)
    ids = np.concatenate([x["dataset_ids"].numpy().ravel() for x in rest[15 - 9 : 35 - 8]])
    assert 0.1 < (ids == 1).sum() / (ids >= 0).sum() < 0.4  # 3:1 from step 12, 3 workers
    coverage: dict = {}
    names = list(cfg.dataset_weights)
    for batch in first + rest:
        for ds, f, d, start, n in batch["provenance"].reshape(-1, 5).tolist():
            if n and ds not in (LITERAL, PAD):
                coverage.setdefault((names[ds], f, d), []).append((start, start + n))
    check_exactly_once(coverage, document_lengths(cfg))


def test_a_weight_schedule_is_the_same_changes_made_by_the_loader(cfg, tmp_path) -> None:
    """``weight_schedule: {6: ..., 12: ...}`` gives the batches of the same set_weights calls;
    a restore replays it; a restore under another schedule is refused naming the field."""
    calls = _run(TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2), 0, 16)
    scheduled = dataclasses.replace(cfg, weight_schedule={w[1]: w[0] for w in CALLS.values()})
    build = functools.partial(build_pipeline, scheduled)
    states: dict = {}
    loader = TokenLoader(build, num_workers=2)
    got = []
    for step, batch in enumerate(loader, 1):
        got.append(batch)
        states[step] = loader.state_dict()
        if step == 16:
            break
    loader.close()
    assert same_input_ids(got, calls)
    again = TokenLoader(build, num_workers=2)
    again.load_state_dict(states[4])
    rest = []
    for step, batch in enumerate(again, 5):
        rest.append(batch)
        if step == 16:
            break
    again.close()
    assert same_input_ids(rest, calls[4:])
    save_checkpoint(TokenLoader(build), str(tmp_path / "ckpt"))
    other = dataclasses.replace(cfg, weight_schedule={6: {"web": 1.0, "code": 2.0}})
    with pytest.raises(ValueError, match=r"weight_schedule differs: the checkpoint was taken"):
        load_checkpoint(
            TokenLoader(functools.partial(build_pipeline, other)), str(tmp_path / "ckpt")
        )
