"""Weight schedules keyed by global tokens and linear ramps (issue 31 item 1).

A token point applies from the first step whose batch starts at or after it (a step is
``world_size x batch_size x seq_length`` tokens); a rescale to another global batch keeps the
steps already passed and moves the points not yet passed to the steps of the new batch; a ramp
is a change every ``ramp_every`` steps with the shares interpolated linearly, and gives the
batches of the same stairs written out as a piecewise-constant schedule, through restores.
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
    take_batches,
    two_dataset_config,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.loader.weights import ScheduleRecord
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD

pytestmark = pytest.mark.multiprocess

PER_STEP = 4 * 32  # batch_size x seq_length, one rank


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    return two_dataset_config(str(tmp_path_factory.mktemp("schedule_tokens")))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 1000)), min_size=1, max_size=4),
    st.integers(0, 200_000),
)
def test_a_token_point_falls_on_the_first_step_starting_at_or_after_it(history, at) -> None:
    """Over any history of global batch sizes: the step a point falls on starts at or after it,
    and the step before starts before it."""
    steps, entries = 1, []
    for length, per_step in history:
        entries.append([steps, per_step])
        steps += length
    rec = ScheduleRecord(points=[[at, {"a": 1.0}]], unit="tokens", step_tokens=entries)
    s = rec.step_of(at)
    assert rec.tokens_before(s) >= at
    assert s == 1 or rec.tokens_before(s - 1) < at
    assert rec.tokens_before(1) == 0


def test_a_restore_with_another_global_batch_moves_only_the_points_not_passed() -> None:
    rec = ScheduleRecord(
        points=[[0, {"a": 1.0, "b": 1.0}], [640, {"a": 1.0, "b": 3.0}], [1400, {"a": 3.0, "b": 1.0}]],
        unit="tokens",
        step_tokens=[[1, PER_STEP]],
    )  # fmt: skip
    assert [c[0] for c in rec.changes()] == [1, 6, 12]  # 640 / 128 = 5 steps before; 1400: 11
    rec.resumed_at(8, 2 * PER_STEP)  # saved after step 8 (1,024 tokens), then two ranks
    assert rec.step_tokens == [[1, PER_STEP], [9, 2 * PER_STEP]]
    assert [c[0] for c in rec.changes()] == [1, 6, 11]  # 9 + ceil((1400 - 1024) / 256)
    rec.resumed_at(8, 2 * PER_STEP)  # the same restore again changes nothing
    assert rec.step_tokens == [[1, PER_STEP], [9, 2 * PER_STEP]]


def test_a_ramp_interpolates_the_shares_in_stairs() -> None:
    rec = ScheduleRecord(
        points=[[2, {"a": 1.0, "b": 1.0}], [10, {"a": 1.0, "b": 3.0}]], unit="steps", ramp_every=3
    )
    got = {s: round(w["b"], 6) for s, w in rec.changes()}
    assert got == {2: 1.0, 5: 0.59375, 8: 0.6875, 10: 3.0}  # shares .5 -> .75 over steps 2..10
    tokens = ScheduleRecord(
        points=[[0, {"a": 1.0, "b": 1.0}], [1280, {"a": 1.0, "b": 3.0}]],
        unit="tokens", ramp_every=4, step_tokens=[[1, PER_STEP]],
    )  # fmt: skip
    # steps 1, 5, 9 start at 0, 512, 1024 tokens; the point 1280 falls on step 11
    assert [(s, round(w["b"], 6)) for s, w in tokens.changes()] == [
        (1, 1.0), (5, 0.6), (9, 0.7), (11, 3.0),
    ]  # fmt: skip


def test_a_token_schedule_gives_the_batches_of_the_same_steps(cfg) -> None:
    """Token points 640 and 1400 at 128 tokens a step are steps 6 and 12, whatever the workers."""
    by_steps = dataclasses.replace(cfg, weight_schedule={6: "1,3", 12: "3,1"})
    want = take_batches(TokenLoader(functools.partial(build_pipeline, by_steps), num_workers=2), 20)
    by_tokens = dataclasses.replace(
        cfg, weight_schedule={0: "1,1", 640: "1,3", 1.4e3: "3,1"}, weight_schedule_unit="tokens"
    )
    loader = TokenLoader(functools.partial(build_pipeline, by_tokens), num_workers=2)
    assert [p[0] for p in loader.weight_points()] == [1, 6, 12]
    assert same_input_ids(take_batches(loader, 20), want)
    one = TokenLoader(functools.partial(build_pipeline, by_tokens))  # in this process
    assert [p[0] for p in one.weight_points()] == [1, 6, 12]
    one.close()


def test_a_rescale_to_two_ranks_moves_the_next_token_point(cfg, tmp_path) -> None:
    """Saved after step 8 on one rank (1,024 tokens), restored on 2 ranks x 2 workers: the
    point at 1,400 tokens falls on step 11 (256 tokens a step), every document once."""
    by_tokens = dataclasses.replace(
        cfg, weight_schedule={640: "1,3", 1400: "3,1"}, weight_schedule_unit="tokens"
    )
    build = functools.partial(build_pipeline, by_tokens)
    states: dict = {}
    first = take_batches(TokenLoader(build, num_workers=2), 8, states)
    again = TokenLoader(build, num_workers=2)
    again.load_state_dict(states[8])
    save_checkpoint(again, str(tmp_path / "ckpt"))
    rest = []
    for rank in (0, 1):
        loader = TokenLoader(build, num_workers=2, rank=rank, world_size=2)
        load_checkpoint(loader, str(tmp_path / "ckpt"))
        assert [p[0] for p in loader.weight_points()] == [6, 11]
        assert loader.state_dict()["weight_schedule"]["step_tokens"] == [[1, 128], [9, 256]]
        rest.append(take_batches(loader, None, start=8))
    # after the point the mix is 3:1 (web) on both ranks: steps 13.. of both ranks together
    ids = np.concatenate([b["dataset_ids"].numpy().ravel() for r in rest for b in r[4:14]])
    assert 0.1 < (ids == 1).sum() / (ids >= 0).sum() < 0.4
    coverage: dict = {}
    names = list(cfg.dataset_weights)
    for batch in first + rest[0] + rest[1]:
        for ds, f, d, start, n in batch["provenance"].reshape(-1, 5).tolist():
            if n and ds not in (LITERAL, PAD):
                coverage.setdefault((names[ds], f, d), []).append((start, start + n))
    check_exactly_once(coverage, document_lengths(cfg))


def test_a_ramp_is_its_stairs_through_restores(cfg) -> None:
    ramp = dataclasses.replace(
        cfg, weight_schedule={2: "1,1", 10: "1,3"}, weight_schedule_ramp_every=3
    )
    build = functools.partial(build_pipeline, ramp)
    states: dict = {}
    loader = TokenLoader(build, num_workers=2)
    stairs = {s: w for s, w, _ in loader.weight_points()}
    assert sorted(stairs) == [2, 5, 8, 10]
    full = take_batches(loader, 16, states)
    written = dataclasses.replace(cfg, weight_schedule=stairs)  # the same stairs, by hand
    assert same_input_ids(
        take_batches(TokenLoader(functools.partial(build_pipeline, written), num_workers=2), 16),
        full,
    )
    for k in (3, 5, 7):  # inside the ramp, at a stair, before one
        again = TokenLoader(build, num_workers=2)
        again.load_state_dict(states[k])
        assert same_input_ids(take_batches(again, 16, start=k), full[k:]), f"restored at step {k}"


def test_a_restore_under_another_unit_or_ramp_is_refused(cfg, tmp_path) -> None:
    by_tokens = dataclasses.replace(
        cfg, weight_schedule={640: "1,3"}, weight_schedule_unit="tokens"
    )
    save_checkpoint(TokenLoader(functools.partial(build_pipeline, by_tokens)), str(tmp_path / "c"))
    for other in (
        dataclasses.replace(by_tokens, weight_schedule_unit="steps"),
        dataclasses.replace(by_tokens, weight_schedule_ramp_every=2),
    ):
        with pytest.raises(ValueError, match=r"weight_schedule differs: .*\(in tokens\)"):
            load_checkpoint(
                TokenLoader(functools.partial(build_pipeline, other)), str(tmp_path / "c")
            )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"weight_schedule": {-1: "1,1"}}, r"key -1 must be a whole number >= 0: a training step"),
        ({"weight_schedule": {"2e9x": "1,1"}, "weight_schedule_unit": "tokens"}, r"a global token count"),
        ({"weight_schedule": {2.5: "1,1"}}, r"key 2.5 must be a whole number"),
        ({"weight_schedule_unit": "epochs"}, r"weight_schedule_unit='epochs' must be one of"),
        ({"weight_schedule_ramp_every": -2}, r"weight_schedule_ramp_every=-2 must be an integer >= 0"),
        ({"weight_schedule": {"1e3": "1,1", 1000: "1,2"}, "weight_schedule_unit": "tokens"}, "tokens 1000 is given twice"),
    ],
)  # fmt: skip
def test_a_bad_schedule_is_refused_naming_the_key(cfg, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cfg, **extra)


def test_show_batches_replays_the_schedule_and_the_trainers_calls(cfg, tmp_path) -> None:
    """``show_batches`` from a checkpoint taken before a schedule's ramp and after a
    set_weights call (made for a later step) shows the batches the training loop received."""
    from torchdata_ext.forensics.replay import show_batches

    ramp = dataclasses.replace(
        cfg, weight_schedule={4: "1,3", 8: "3,1"}, weight_schedule_ramp_every=2
    )
    build = functools.partial(build_pipeline, ramp)
    loader = TokenLoader(build, num_workers=2)
    run = []
    for step, batch in enumerate(loader, 1):
        run.append(batch["input_ids"].numpy())
        if step == 3:
            save_checkpoint(loader, str(tmp_path / "at3"))
        if step == 9:
            assert loader.set_weights({"web": 1.0, "code": 4.0}, from_step=12) == 12
            save_checkpoint(loader, str(tmp_path / "at9"))
        if step == 18:
            break
    loader.close()
    for ckpt, steps in (("at3", range(4, 12)), ("at9", range(10, 19))):
        shown = show_batches(str(tmp_path / ckpt), ramp, steps)
        assert [b["step"] for b in shown] == list(steps)
        for b in shown:
            got = np.array([row["input_ids"] for row in b["rows"]])
            assert np.array_equal(got, run[b["step"] - 1]), f"{ckpt}: step {b['step']}"
