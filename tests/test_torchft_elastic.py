"""Elastic data under torchft (issue 45), against a simulated manager (``_torchft_sim``):
replica groups join, leave, die and fail steps while the job runs; over the committed steps
every token of every document is delivered exactly once, and the rows are rows an
uninterrupted run could have made. The real torchft run is ``test_torchft_real.py``."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from _torchft_sim import SimJob
from harness import check_exactly_once, document_lengths, write_random_arrow_datasets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rows import check_rows

from torchdata_ext import TokenLoader
from torchdata_ext.batch import boundaries, position_starts
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.torchft import ElasticLoader, JobState, share_of_global_batch, share_state

NAMES = ["web", "code"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("elastic")
    write_random_arrow_datasets(str(root), (("web", 60, 20), ("code", 30, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip


def elastic(cfg: PipelineConfig, global_batches: int | None = None, every: int = 50):
    build = functools.partial(build_pipeline, cfg, collate=False)

    def make(manager):
        return ElasticLoader(
            manager,
            lambda r, n: TokenLoader(build, rank=r, world_size=n),
            global_batches=global_batches,
            exchange_every=every,
        )

    return make


def step_with(job: SimJob, event: str) -> tuple[bool, dict]:
    """One step of ``job`` with ``event`` ("join": a group joins before it, "leave": the
    newest leaves before it, "die": the oldest dies during it after the exchange, "fail": it
    fails after the exchange, "drop": its collectives fail, "": none)."""
    if event == "join":
        job.join()
    elif event == "leave" and len(job.managers) > 1:
        job.leave(max(job.managers))
    dying = event == "die" and len(job.managers) > 1
    fail = "after" if event in ("fail", "die") else "during" if event == "drop" else None
    ok, out = job.step(fail)
    if dying:
        job.leave(min(job.managers))
    return ok, out


def run(job: SimJob, events: list[str], global_batches: int | None = None, limit: int = 400):
    """Run ``job`` to the end of the epoch, ``events[k]`` happening at step ``k`` ("join",
    "leave", "die": a group dies during the step after the exchange, "fail": a step fails
    after the exchange, "drop": the step's collectives fail); every committed row, by group."""
    committed: dict[int, list] = {}
    per_step: list[int] = []
    for k in range(limit):
        ok, out = step_with(job, events[k] if k < len(events) else "")
        if any(isinstance(v, StopIteration) for v in out.values()):
            assert all(isinstance(v, StopIteration) for v in out.values()), out
            return committed, per_step
        if ok:
            rows = 0
            for rid, got in out.items():
                items = got if isinstance(got, list) else [] if got is None else [got]
                committed.setdefault(rid, []).extend(items)
                rows += len(items)
            per_step.append(rows)
    raise AssertionError(f"the epoch did not end in {limit} steps")


def check(
    cfg: PipelineConfig, committed: dict[int, list], budget: bool = False, skipped: list = ()
) -> int:
    """Each token once (all of the epoch's, or with ``budget`` a prefix of each document
    reached; the ``skipped`` pieces ``[name, file, doc, start, length, epoch]`` counted as
    delivered; a checkpoint from before skips had epochs has no ``epoch``) and the row
    checks; returns the document tokens delivered."""
    coverage: dict = {}
    for name, f, d, start, length, *_ in skipped:
        coverage.setdefault((name, f, d), []).append((start, start + length))
    streams = []
    for rows in committed.values():
        stream = []
        for row in rows:
            prov = np.asarray(row["provenance"])
            for ds, f, d, start, length in prov.tolist():
                if ds not in (LITERAL, PAD):
                    coverage.setdefault((NAMES[ds], f, d), []).append((start, start + length))
            pos = np.asarray(row["position_ids"])[None]
            seq_lens = boundaries(position_starts(pos), 1, pos.shape[1], ("seq_lens",))
            stream.append(
                {"provenance": prov, "_names": NAMES, "seq_lens": seq_lens["seq_lens"][0]}
            )
        streams.append(stream)
    if not budget:
        check_exactly_once(coverage, document_lengths(cfg))
    skipped_tokens = sum(length for *_, length in skipped)
    if not skipped:  # the row checks know no skip (a skipped step cuts documents mid-way)
        check_rows(streams, document_lengths(cfg), cfg, budget=budget)
    return sum(b - a for ranges in coverage.values() for a, b in ranges) - skipped_tokens


def test_kill_and_join_mid_run_delivers_each_token_once(cfg) -> None:
    """3 groups; one dies in step 4 (that step fails for all), a new one joins at step 9 and
    heals; a step fails without a death at 12; the collectives fail at 15."""
    job = SimJob(elastic(cfg))
    for _ in range(3):
        job.join()
    events = [""] * 4 + ["die"] + [""] * 4 + ["join"] + [""] * 2 + ["fail"] + [""] * 2 + ["drop"]
    committed, per_step = run(job, events)
    check(cfg, committed)
    assert per_step[:4] == [3] * 4 and per_step[4:8] == [2] * 4 and per_step[8] == 3
    assert len(committed) == 4  # the dead group's committed rows count too


def test_a_token_budget_holds_through_deaths_and_joins(cfg) -> None:
    """``max_tokens`` is the whole run's: split among the shares at every re-split, it ends
    the run after exactly that many document tokens, none twice, the rows as a run's."""
    job = SimJob(elastic(dataclasses.replace(cfg, max_tokens=1500)))
    for _ in range(3):
        job.join()
    events = [""] * 3 + ["die"] + [""] * 3 + ["join"] + ["fail"] + ["join"]
    committed, _ = run(job, events)
    assert check(cfg, committed, budget=True) == 1500


def _code_share(rows: list) -> float:
    tokens = [0, 0]
    for row in rows:
        for ds, _, _, _, length in np.asarray(row["provenance"]).tolist():
            if ds in (0, 1):
                tokens[ds] += length
    return tokens[1] / sum(tokens)


def test_set_weights_holds_through_deaths_and_joins(cfg) -> None:
    """Every group calls ``set_weights`` after step 4 (code 2:1 -> 1:4 of web), and that step
    fails (the states it rolls back to are from before the call); a group dies in the next
    attempt but one, and a new group joins (it receives the change with the state): the change
    holds on every share, and each token still comes once."""
    job = SimJob(elastic(cfg))
    for _ in range(3):
        job.join()
    committed: dict[int, list] = {}
    by_step: list[list] = []
    for k in range(200):
        if k == 4:
            for loader in job.loaders.values():
                assert loader.set_weights({"web": 1.0, "code": 4.0}) == 5
        if k == 9:
            job.join()
        ok, out = job.step("after" if k in (4, 6) else None)
        if k == 6:
            job.leave(min(job.managers))
        if any(isinstance(v, StopIteration) for v in out.values()):
            break
        if ok:
            rows = [v for v in out.values() if v is not None]
            by_step.append(rows)
            for rid, v in out.items():
                if v is not None:
                    committed.setdefault(rid, []).append(v)
    check(cfg, committed)
    before = _code_share([r for rows in by_step[:4] for r in rows])
    after = _code_share([r for rows in by_step[8:16] for r in rows])
    assert before < 0.5 < after, (before, after)
    for loader in job.loaders.values():  # the joiner too: the change came with the state
        assert loader._changes == [(5, {"web": 1.0, "code": 4.0})]


@pytest.mark.parametrize("die_at", [2, 3, 4])
def test_a_death_right_before_during_and_after_an_exchange(cfg, die_at) -> None:
    """States exchanged after step 0 and every 4th step (3, 7, ...): a group dies in step 2 (the
    shares' states at the change are step 0's replayed 2 steps), in step 3 (after its
    exchange; the step fails, so the exchanged states are dropped) or in step 4 (right after
    it: the exchanged states are the job's); a new group joins 3 steps later. Each token
    once, and only the exchange steps exchange."""
    job = SimJob(elastic(cfg, every=4))
    for _ in range(3):
        job.join()
    events = [""] * die_at + ["die"] + [""] * 2 + ["join"]
    committed, per_step = run(job, events)
    check(cfg, committed)
    assert per_step[:die_at] == [3] * die_at and per_step[die_at : die_at + 3] == [2, 2, 3]
    joiner = job.loaders[3]
    # the joiner took part in every exchange from its first step (step die_at + 2) to the end
    assert joiner.exchanges == sum((s + 1) % 4 == 0 for s in range(die_at + 2, len(per_step)))


def test_no_exchange_between_exchange_steps(cfg) -> None:
    """3 groups, states exchanged every 4 steps: 7 committed steps send bytes in step 0 (where
    torchft's init_sync heals ranked groups) and step 3, and nothing in the others."""
    job = SimJob(elastic(cfg, every=4))
    for _ in range(3):
        job.join()
    sent = []
    for _ in range(7):
        before = job.exchanged_bytes
        assert job.step()[0]
        sent.append(job.exchanged_bytes - before)
    assert [k for k, b in enumerate(sent) if b] == [0, 3]
    assert all(loader.exchanges == 2 for loader in job.loaders.values())


def test_bad_exchange_every_is_refused(cfg) -> None:
    job = SimJob(elastic(cfg, every=0))
    with pytest.raises(ValueError, match="exchange_every=0 must be an integer >= 1"):
        job.join()


def test_uncommitted_batch_comes_again(cfg) -> None:
    """The rows of a failed step are delivered again, by the group that owns them."""
    job = SimJob(elastic(cfg))
    job.join()
    job.join()
    ok, first = job.step("after")
    assert not ok
    ok, again = job.step()
    assert ok
    for rid in first:
        np.testing.assert_array_equal(first[rid]["input_ids"], again[rid]["input_ids"])


def test_constant_global_batch_grows_each_share(cfg) -> None:
    """``global_batches=4``: 3 groups take 2+1+1 micro-batches, 2 groups 2+2; the global batch
    stays 4 through a death and a join."""
    job = SimJob(elastic(cfg, global_batches=4))
    for _ in range(3):
        job.join()
    ok, out = job.step()
    assert sorted(len(v) for v in out.values()) == [1, 1, 2]
    events = [""] * 2 + ["die"] + [""] * 3 + ["join"]
    committed, per_step = run(job, events, global_batches=4)
    committed.setdefault(0, [])[:0] = out[0]
    committed.setdefault(1, [])[:0] = out[1]
    committed.setdefault(2, [])[:0] = out[2]
    check(cfg, committed)
    # 4 a step until a share of the epoch ends (shares end unevenly, then fewer)
    short = next(k for k, rows in enumerate(per_step) if rows < 4)
    assert short > 8 and per_step[short:] == sorted(per_step[short:], reverse=True)


def test_share_of_global_batch() -> None:
    assert [share_of_global_batch(7, 3, r) for r in range(3)] == [3, 2, 2]
    assert [share_of_global_batch(2, 3, r) for r in range(3)] == [1, 1, 0]
    with pytest.raises(ValueError, match="rank=3"):
        share_of_global_batch(4, 3, 3)


def test_job_state_round_trips_and_refuses_other_bytes() -> None:
    job = JobState(7, ({"a": 1}, None), JobState(7, ({"b": 2},)))
    assert JobState.from_bytes(job.to_bytes()) == job
    with pytest.raises(ValueError, match="not a torchdata_ext.torchft job state"):
        JobState.from_bytes(b"\x80\x05N.")


def test_bad_global_batches_is_refused(cfg) -> None:
    job = SimJob(elastic(cfg, global_batches=0))
    with pytest.raises(ValueError, match="global_batches=0 must be an integer >= 1"):
        job.join()


events = st.lists(
    st.sampled_from(["", "", "", "", "join", "leave", "die", "fail", "drop"]), max_size=30
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    start=st.integers(1, 3),
    history=events,
    global_batches=st.sampled_from([None, 2, 5]),
    every=st.sampled_from([1, 3, 50]),
)
def test_random_histories_deliver_each_token_once(
    cfg, start, history, global_batches, every
) -> None:
    """Random join / leave / die / failed-step histories, per-replica or global batches, the
    states exchanged every step, every 3 or (within the changes) never."""
    job = SimJob(elastic(cfg, global_batches, every))
    for _ in range(start):
        job.join()
    committed, per_step = run(job, history, global_batches)
    check(cfg, committed)
    if global_batches is not None:
        assert max(per_step, default=0) <= global_batches
        assert not per_step or per_step[0] == global_batches


def test_a_tensor_left_undefined_is_never_read_as_states() -> None:
    """A failed all-reduce leaves its tensor undefined: a slot whose bytes do not match their
    crc32 makes the whole exchange count as failed."""
    from _torchft_sim import SimManager

    from torchdata_ext.torchft.exchange import start_allgather

    class One(SimManager):
        def allreduce(self, tensor, should_quantize=False, reduce_op=None):
            from _torchft_sim import _Work

            return _Work()

    m = One(None, 0)  # type: ignore[arg-type]
    ok = start_allgather(m, b"state", 1, 2, 64)
    assert ok.result() == [None, b"state"]
    bad = start_allgather(m, b"state", 1, 2, 64)
    assert bad.buf is not None
    bad.buf[-60] += 1  # a byte of the data changed
    assert bad.result() is None
    with pytest.raises(ValueError, match="exchange_capacity=4"):
        start_allgather(m, b"state", 0, 2, 4)


def _in_force(points: list, step: int) -> float:
    """The code:web weight ratio in force at loader step ``step`` (2:1 before any point)."""
    ratio = 0.5
    for at, weights, _ in sorted(points, key=lambda p: (p[0], p[2] == "trainer")):
        if at <= step:
            ratio = weights["code"] / weights["web"]
    return ratio


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(start=st.integers(1, 3), history=events, every=st.sampled_from([1, 4, 50]))
@example(start=3, history=[""] * 11 + ["fail", "die", "", "join"], every=50)
def test_schedule_and_set_weights_hold_through_random_histories(cfg, start, history, every) -> None:
    """A weight schedule (code 2:1 -> 1:4 of web from step 6) and a trainer's ``set_weights``
    (3:1 from step 13, called once 10 steps committed) through random join / leave / die /
    failed-step histories: each token once, the row checks, and after every committed step
    the weights each live share's loader has in force at its next step are the ones the
    schedule and the call say."""
    scheduled = dataclasses.replace(cfg, weight_schedule={6: "1,4"})
    job = SimJob(elastic(scheduled, every=every))
    for _ in range(start):
        job.join()
    expected = lambda s: 1 / 3 if s >= 13 else 4.0 if s >= 6 else 0.5  # noqa: E731
    committed: dict[int, list] = {}
    called = False
    for k in range(400):
        ok, out = step_with(job, history[k] if k < len(history) else "")
        if any(isinstance(v, StopIteration) for v in out.values()):
            break
        if ok:
            for rid, got in out.items():
                if got is not None:
                    committed.setdefault(rid, []).append(got)
        step = max(m.current_step() for m in job.managers.values())
        if step >= 10 and not called:
            for loader in job.loaders.values():
                loader.set_weights({"web": 3.0, "code": 1.0}, from_step=13)
            called = True
        for loader in job.loaders.values():
            live = loader._loader
            if live is not None and loader._at is not None and loader._at[2] == step:
                s = step + 1
                assert _in_force(live.weight_points(), s) == pytest.approx(expected(s)), s
    else:
        raise AssertionError("the epoch did not end in 400 steps")
    check(scheduled, committed)


def _rows(batch: dict) -> list[dict]:
    """A collated batch's rows, each as the uncollated pipeline gives it (the collated table's
    filler entries, ``length`` 0, left out)."""
    prov, pos = np.asarray(batch["provenance"]), np.asarray(batch["position_ids"])
    return [
        {"provenance": prov[i][prov[i][:, 4] > 0].copy(), "position_ids": pos[i].copy()}
        for i in range(len(prov))
    ]


@pytest.mark.parametrize("die_at", [None, 1, 6])
def test_skip_steps_hold_through_deaths_and_joins(cfg, die_at) -> None:
    """``skip_steps=[[4, 6]]`` (a step is a collated batch): each share's step 4 gets what its
    step 6 would have. A group dies in step 1 (a re-split before the skip) or 6 (after it;
    exchanges every 4 steps, so the shares' states at the change are replayed through the
    skip), a new one joins 3 steps later: over the committed steps each token once, counting
    the pieces the job's final state records as skipped (the row checks, which know no
    skip, are left out)."""
    skipping = dataclasses.replace(
        cfg, skip_steps=[[4, 6]], output_keys="input_ids,position_ids,provenance"
    )
    build = functools.partial(build_pipeline, skipping)
    job = SimJob(
        lambda m: ElasticLoader(
            m, lambda r, n: TokenLoader(build, rank=r, world_size=n), exchange_every=4
        )
    )
    for _ in range(3):
        job.join()
    events = [] if die_at is None else [""] * die_at + ["die"] + [""] * 2 + ["join"]
    rows: dict[int, list] = {}
    for k in range(100):
        ok, out = step_with(job, events[k] if k < len(events) else "")
        if any(isinstance(v, StopIteration) for v in out.values()):
            break
        for rid, batch in out.items():  # copied now: the loader may reuse a batch's memory
            if ok and batch is not None:
                rows.setdefault(rid, []).extend(_rows(batch))
    loader = next(iter(job.loaders.values()))
    final = loader.job_state()
    skipped = [
        piece
        for i in range(final.shares)
        for piece in share_state(final, i, loader.make_loader)["skipped_documents"]
    ]
    # 2 steps of 2 rows on each of the 3 shares, 32 tokens a row, most of them documents'
    assert 250 < sum(piece[4] for piece in skipped) <= 3 * 2 * 2 * 32
    check(skipping, rows, skipped=skipped)


class _HealingRanked:
    """A manager whose group is ranked 1 of 2 at step 3 but heals (takes no batch)."""

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 1

    def is_participating(self) -> bool:
        return False

    def current_step(self) -> int:
        return 3

    def errored(self) -> None:
        return None


def test_a_ranked_group_taking_no_batch_between_exchanges_is_refused(cfg) -> None:
    """The others would count its share's batch as read: the loader stops, naming why."""
    build = functools.partial(build_pipeline, cfg, collate=False)
    loader = ElasticLoader(_HealingRanked(), lambda r, n: TokenLoader(build, rank=r, world_size=n))
    loader.load_state_dict(
        {"job": _as_tensor(JobState(3, (None,)).to_bytes()), "weight_changes": _as_tensor(b"[]")}
    )
    with pytest.raises(RuntimeError, match="ranked 1 of 2 does not take part in step 3"):
        next(loader)
    loader.close()


def _as_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
