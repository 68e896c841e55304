"""The audit's per-segment table of the weight changes (issue 31 item 5): a run with a
``weight_schedule`` and a ``set_weights`` call, saved and audited, reports per segment exactly
the tokens the delivered batches hold (counted here from their provenance), through a
rescale, in a DCP checkpoint, and says "unknown" for what a state saved before the counts
existed cannot tell."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from harness import write_random_arrow_datasets
from torchdata.nodes import BaseNode

from torchdata_ext.audit.mix_note import mix_bound_tokens
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.audit.segments import lag_tokens
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig

pytestmark = pytest.mark.multiprocess

NAMES = ["web", "code"]
SCHEDULE = {4: "1,3", 10: "3,1"}
CHANGE = (7, {"web": 1.0, "code": 1.0})  # set_weights after step 5, from step 7


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("segments")
    write_random_arrow_datasets(str(root), (("web", 160, 30), ("code", 160, 30)), seed=11)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="1,1", seq_length=32, eos_token=0,
        logical_shards=12, batch_size=4, seed=3, shuffle_buffer=8, block_docs=4, epochs=1,
        output_keys="input_ids,provenance", weight_schedule=SCHEDULE,
    )  # fmt: skip


def _tokens(batch: dict) -> np.ndarray:
    """The document tokens of a delivered batch per dataset, from its provenance."""
    rows = batch["provenance"].numpy().reshape(-1, 5)
    rows = rows[rows[:, 0] >= 0]
    return np.bincount(rows[:, 0], weights=rows[:, 4], minlength=2).astype(np.int64)


def _run(loader: TokenLoader, start: int, stop: int, per_step: dict) -> None:
    """Steps ``start + 1 .. stop``, each step's tokens added to ``per_step[step]``; the
    trainer's change is made after step 5."""
    for step, batch in enumerate(loader, start + 1):
        per_step[step] = per_step.get(step, 0) + _tokens(batch)
        if step == CHANGE[0] - 2:
            loader.set_weights(CHANGE[1], from_step=CHANGE[0])
        if step == stop:
            break


def _expected(per_step: dict, bounds: list[tuple[int, int]]) -> list[dict[str, int]]:
    out = []
    for a, b in bounds:
        got = sum(per_step[s] for s in range(a, b + 1))
        out.append(dict(zip(NAMES, (int(x) for x in got), strict=True)))
    return out


SEGMENTS = [(1, 3), (4, 6), (7, 9), (10, 14)]
TARGETS = [{"web": 0.5, "code": 0.5}, {"web": 0.25, "code": 0.75}]
TARGETS += [{"web": 0.5, "code": 0.5}, {"web": 0.75, "code": 0.25}]


def _check(report, per_step: dict) -> None:
    mix = report.mix_segments
    assert [(s.start, s.stop) for s in mix.segments] == SEGMENTS
    assert [s.tokens for s in mix.segments] == _expected(per_step, SEGMENTS)
    assert [s.target for s in mix.segments] == TARGETS
    assert [s.source for s in mix.segments] == ["config", "schedule", "trainer", "schedule"]
    for seg in mix.segments:
        assert seg.achieved == {n: seg.tokens[n] / seg.total for n in NAMES}
        assert seg.off_tokens <= mix.bound_tokens
    assert mix.known_from == 1


def test_per_segment_tokens_are_the_delivered_batches(cfg, tmp_path) -> None:
    build = functools.partial(build_pipeline, cfg)
    per_step: dict = {}
    loader = TokenLoader(build, num_workers=2)
    _run(loader, 0, 14, per_step)
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    report = audit_checkpoint(str(tmp_path / "ckpt"), cfg)
    _check(report, per_step)
    mix = report.mix_segments
    # the lag: per worker 8 buffered rows + the open row (33 tokens each) + a quantum of 32
    assert cfg.mix_quantum_tokens is None and mix.lag_tokens == 2 * (32 + 9 * 33) == 658
    assert mix.lag_steps == 6  # 658 tokens at 4 x 32 a step
    assert mix.bound_tokens == mix_bound_tokens(cfg, None, 2) + 2 * 658
    text = report.format_table()
    assert "mix per segment of the weight changes (by step):" in text
    total = sum(mix.segments[1].tokens.values())
    row = next(line for line in text.splitlines() if line.startswith("  4-6 "))
    assert row.split()[:5] == [
        "4-6",
        "schedule",
        "25.0%",
        "/",
        f"{100 * mix.segments[1].achieved['web']:.1f}%",
    ]
    assert f"{total:,}" in text
    assert "the mix may lag a change by up to 658 tokens (~6 step(s))" in text
    # the run's target: each segment's by its tokens (not the last weights, 75% / 25%)
    counted = [sum(t.values()) for t in _expected(per_step, SEGMENTS)]
    for d in report.datasets:
        want = sum(c * t[d.name] for c, t in zip(counted, TARGETS, strict=True)) / sum(counted)
        assert d.target_share == pytest.approx(want, abs=1e-12)
        data = json.loads(report.to_json())["mix_segments"]
    assert [s["tokens"] for s in data["segments"]] == _expected(per_step, SEGMENTS)
    assert data["lag_tokens"] == 658
    # counted from the lag on (the old mix's rows delivered), a segment's tokens are within
    # the mix's bound of its target, plus its own rows carried out to the next segment
    for (a, b), seg in zip(SEGMENTS, mix.segments, strict=True):
        if a == 1:
            continue
        settled = sum(per_step[s] for s in range(a, b + 1) if s >= a + mix.lag_steps)
        if isinstance(settled, int):
            continue  # the segment is shorter than the lag
        off = max(abs(settled[i] - seg.target[n] * settled.sum()) for i, n in enumerate(NAMES))
        assert off <= mix_bound_tokens(cfg, None, 2) + mix.lag_tokens


def test_the_plot_has_a_panel_per_segment(cfg, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from torchdata_ext.audit.render import figure

    per_step: dict = {}
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
    _run(loader, 0, 14, per_step)
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    report = audit_checkpoint(str(tmp_path / "ckpt"), cfg)
    _, _, segments = figure(report, Figure).axes
    legend = [t.get_text() for t in segments.get_legend().get_texts()]
    assert legend == ["web target", "web achieved", "code target", "code achieved"]
    assert [t.get_text() for t in segments.get_xticklabels()] == ["1-3", "4-6", "7-9", "10-14"]
    lines = segments.get_lines()
    assert list(lines[1].get_ydata()) == [
        100 * s.achieved["web"] for s in report.mix_segments.segments
    ]
    assert list(lines[2].get_ydata()) == [100 * t["code"] for t in TARGETS]


def test_per_segment_tokens_through_a_rescale(cfg, tmp_path) -> None:
    """Saved at 2 ranks x 2 workers after step 5, restored at 1 x 3, saved again at 14: the
    run's totals are carried by the new rank and the segments are the batches'."""
    build = functools.partial(build_pipeline, cfg)
    per_step: dict = {}
    for rank in range(2):
        loader = TokenLoader(build, num_workers=2, rank=rank, world_size=2)
        _run(loader, 0, 5, per_step)
        save_checkpoint(loader, str(tmp_path / "old"))
        loader.close()
    rescaled = TokenLoader(build, num_workers=3)
    load_checkpoint(rescaled, str(tmp_path / "old"))
    _run(rescaled, 5, 14, per_step)
    save_checkpoint(rescaled, str(tmp_path / "new"))
    rescaled.close()
    _check(audit_checkpoint(str(tmp_path / "new"), cfg), per_step)


def test_a_dcp_checkpoint_has_the_same_segments(cfg, tmp_path) -> None:
    build = functools.partial(build_pipeline, cfg)
    per_step: dict = {}
    loader = TokenLoader(build, num_workers=2)
    _run(loader, 0, 14, per_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        state = {"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)}
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    save_checkpoint(loader, str(tmp_path / "folder"))
    loader.close()
    in_dcp = audit_checkpoint(str(tmp_path / "dcp"), cfg)
    _check(in_dcp, per_step)
    assert in_dcp.mix_segments == audit_checkpoint(str(tmp_path / "folder"), cfg).mix_segments


def test_a_state_saved_before_the_counts_says_unknown(cfg, tmp_path) -> None:
    """A state without ``mix_history`` and without the workers' counts (saved by an earlier
    version), restored after step 8: the segments that start before it are unknown (None,
    '?' in the table), the one after the change at 10 is exact from the batches."""
    build = functools.partial(build_pipeline, cfg)
    per_step: dict = {}
    loader = TokenLoader(build, num_workers=2)
    _run(loader, 0, 8, per_step)
    state = loader.state_dict()
    loader.close()
    del state["mix_history"]
    for w in state["workers"].values():
        w["graph"] = {k: v for k, v in w["graph"].items() if k != "delivered"}
    old = TokenLoader(build, num_workers=2)
    old.load_state_dict(state)
    _run(old, 8, 14, per_step)
    save_checkpoint(old, str(tmp_path / "ckpt"))
    old.close()
    report = audit_checkpoint(str(tmp_path / "ckpt"), cfg)
    mix = report.mix_segments
    assert mix.known_from == 9
    assert [(s.start, s.stop) for s in mix.segments] == SEGMENTS
    assert [s.tokens for s in mix.segments[:3]] == [None, None, None]
    assert [s.achieved for s in mix.segments[:3]] == [None, None, None]
    assert mix.segments[3].tokens == _expected(per_step, [(10, 14)])[0]
    text = report.format_table()
    assert "per-segment history unknown before step 9" in text
    first = next(line for line in text.splitlines() if line.startswith("  1-3 "))
    assert first.split() == ["1-3", "config", "50.0%", "/", "?", "50.0%", "/", "?", "?", "?"]


def test_lag_tokens_adds_the_longest_document_when_documents_stay_whole(cfg) -> None:
    whole = PipelineConfig(**{**cfg.__dict__, "pack_mode": "pad"})  # no row cuts
    assert lag_tokens(whole, 3, 100) == 3 * (32 + 100 + 9 * 33)
    assert lag_tokens(cfg, 3, 100) == 3 * (32 + 9 * 33)


def test_a_token_keyed_schedule_has_its_segments_at_the_steps_its_points_fell_on(
    cfg, tmp_path
) -> None:
    """Points at global tokens 512 and 1,280 (4 x 32 = 128 tokens a step): steps 5 and 11."""
    by_tokens = dataclasses.replace(
        cfg, weight_schedule={512: "1,3", 1280: "3,1"}, weight_schedule_unit="tokens"
    )
    per_step: dict = {}
    loader = TokenLoader(functools.partial(build_pipeline, by_tokens), num_workers=2)
    _run(loader, 0, 14, per_step)
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    mix = audit_checkpoint(str(tmp_path / "ckpt"), by_tokens).mix_segments
    bounds = [(1, 4), (5, 6), (7, 10), (11, 14)]
    assert [(s.start, s.stop) for s in mix.segments] == bounds
    assert [s.source for s in mix.segments] == ["config", "schedule", "trainer", "schedule"]
    assert [s.tokens for s in mix.segments] == _expected(per_step, bounds)
    assert [s.target for s in mix.segments] == TARGETS


class _Wrapped(BaseNode):
    """A root wrapping the standard pipeline's Collate, as examples/train_tiny_lm.py's does."""

    def __init__(self, source: BaseNode) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])

    def next(self) -> dict:
        return self.source.next()

    def get_state(self) -> dict:
        return {"source": self.source.state_dict()}


def _wrapped_build(cfg: PipelineConfig, world) -> BaseNode:
    return _Wrapped(build_pipeline(cfg, world))


def test_a_build_function_that_wraps_the_pipeline_has_its_segments_known(cfg, tmp_path) -> None:
    """Issue 44 item 19: the audit said the run was restored from a state saved before the
    counts, with '?' segments, for a run with no restore whose root wraps Collate."""
    per_step: dict = {}
    loader = TokenLoader(functools.partial(_wrapped_build, cfg))
    _run(loader, 0, 14, per_step)
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    report = audit_checkpoint(str(tmp_path / "ckpt"), cfg)
    _check(report, per_step)
    text = report.format_table()
    assert "per-segment history unknown" not in text and " ? " not in text
