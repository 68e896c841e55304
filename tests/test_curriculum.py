"""Curriculum phases and token budgets through the whole pipeline (``PipelineConfig.phases``,
``max_tokens``, ``max_documents``): exact delivered tokens over all workers, phase order per
worker, a 2-worker ``TokenLoader``, YAML configs, and rescales mid-phase and mid-budget."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    check_restore_at_every_step,
    document_lengths,
    write_random_arrow_datasets,
)

from torchdata_ext import World
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD

NAMES = ["web", "code", "math"]
WEB_BUDGET = 1200


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("curriculum")
    write_random_arrow_datasets(
        str(root), (("web", 160, 20), ("code", 50, 30), ("math", 30, 25)), seed=4
    )
    return str(root)


def base(root: str, **kw) -> PipelineConfig:
    fields = dict(
        data_path=root, seq_length=32, eos_token=0, bos_token=1, logical_shards=12, batch_size=2,
        seed=5, shuffle_buffer=6, block_docs=5, epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip
    fields.update(kw)
    return PipelineConfig(**fields)


@pytest.fixture(scope="module")
def phase_cfg(root) -> PipelineConfig:
    """Phase 0: web for exactly WEB_BUDGET tokens of the run; phase 1: code and math mixed
    until both are exhausted."""
    return base(
        root,
        phases=[
            {"datasets": "web", "max_tokens": WEB_BUDGET},
            {"datasets": "code,math", "weights": "1,2"},
        ],
    )


def build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world, collate=False)


def rows(seqs) -> list[tuple[str, int, int, int, int]]:
    """Document rows of the sequences' provenance, in order: (dataset, file, doc, start, stop)."""
    out = []
    for seq in seqs:
        for ds, f, d, start, length in np.asarray(seq["provenance"]).tolist():
            if ds not in (LITERAL, PAD):
                out.append((NAMES[ds] if ds < len(NAMES) else ds, f, d, start, start + length))
    return out


def tokens_by_dataset(delivered: list, cfg: PipelineConfig) -> dict[str, int]:
    out = dict.fromkeys(cfg.datasets, 0)
    for ds, _f, _d, a, b in delivered:
        out[ds] = out.get(ds, 0) + b - a
    return out


def check_delivery(cfg: PipelineConfig, delivered: list, budgets: dict[str, int]) -> None:
    """Budgeted datasets: exactly their budget of tokens, none twice; the others: every token
    of every document exactly once."""
    coverage: dict = {}
    for ds, f, d, a, b in delivered:
        coverage.setdefault((ds, f, d), []).append((a, b))
    lengths = document_lengths(cfg)
    for name, budget in budgets.items():
        got = {k: v for k, v in coverage.items() if k[0] == name}
        assert sum(b - a for v in got.values() for a, b in v) == budget, name
        if not got:
            continue
        for key, ranges in got.items():
            ranges.sort()
            assert all(p[1] <= q[0] for p, q in zip(ranges, ranges[1:])), f"{key} twice"
            assert ranges[-1][1] <= lengths[key]
    rest = {k: v for k, v in coverage.items() if k[0] not in budgets}
    check_exactly_once(rest, {k: n for k, n in lengths.items() if k[0] not in budgets})


def test_config_names_phases_and_budgets(root, phase_cfg) -> None:
    assert phase_cfg.datasets == ["web", "code", "math"]
    assert phase_cfg.phases[1] == {
        "datasets": ["code", "math"], "weights": [1.0, 2.0], "max_tokens": None,
        "max_documents": None,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"dataset 'web' is in phases\[0\] and phases\[1\]"):
        base(root, phases=[{"datasets": "web"}, {"datasets": "web,code"}])
    with pytest.raises(ValueError, match=r"phases\[0\] never ends"):
        base(root, epochs=None, phases=[{"datasets": "web"}, {"datasets": "code"}])
    with pytest.raises(ValueError, match=r"phases\[0\] has unknown keys \['max_token'\]"):
        base(root, phases=[{"datasets": "web", "max_token": 5}])
    with pytest.raises(ValueError, match=r"phases\[0\].max_tokens=-3 must be >= 0"):
        base(root, phases=[{"datasets": "web", "max_tokens": -3}])
    with pytest.raises(ValueError, match="give each phase its own weights"):
        base(root, weights="1,1", phases=[{"datasets": "web"}, {"datasets": "code"}])
    with pytest.raises(ValueError, match=r"max_tokens names \['books'\], which are not datasets"):
        base(root, datasets="web,code", max_tokens={"books": 5})
    with pytest.raises(TypeError, match="max_documents=2.5 must be an integer"):
        base(root, datasets="web", max_documents=2.5)


def test_phases_and_budgets_load_from_yaml(root, tmp_path, phase_cfg) -> None:
    (tmp_path / "c.yaml").write_text(
        f"data_path: {root}\nseq_length: 32\neos_token: 0\nbos_token: 1\nlogical_shards: 12\n"
        "batch_size: 2\nseed: 5\nshuffle_buffer: 6\nblock_docs: 5\nepochs: 1\n"
        "mix_quantum_tokens: 0\nphases:\n"
        f"  - {{datasets: web, max_tokens: {WEB_BUDGET}}}\n"
        "  - datasets: [code, math]\n    weights: [1, 2]\n"
    )
    assert PipelineConfig.from_file(str(tmp_path / "c.yaml")) == phase_cfg
    (tmp_path / "b.yaml").write_text(
        f"data_path: {root}\ndatasets: web,code\nmax_tokens: {{code: 100}}\nmax_documents: 7\n"
    )
    cfg = PipelineConfig.from_file(str(tmp_path / "b.yaml"))
    assert cfg.max_tokens == {"code": 100} and cfg.max_documents == 7


@pytest.mark.parametrize("total", [1, 3])
def test_phase_order_per_worker_and_exact_budget(phase_cfg, total) -> None:
    """Without a shuffle buffer, each worker's stream has all of its web (phase 0) before any
    code or math (phase 1); over all workers web gives exactly its budget."""
    cfg = dataclasses.replace(phase_cfg, shuffle_buffer=1)
    delivered = []
    for g in range(total):
        got = rows(list(build(cfg, World(g, total, 0, 1))))
        phase = [0 if r[0] == "web" else 1 for r in got]
        assert phase == sorted(phase) and 0 in phase and 1 in phase
        delivered += got
    check_delivery(cfg, delivered, {"web": WEB_BUDGET})


@pytest.mark.parametrize("n", [1001, 1, 0])
def test_run_budget_through_two_workers(root, n) -> None:
    """A run budget with endless readers: TokenLoader with 2 worker processes delivers exactly
    max_tokens document tokens, none twice, and then ends (Pack flushes, the buffer drains);
    also when a worker's share is 0."""
    cfg = base(root, datasets="web,code", weights="2,1", epochs=None, max_tokens=n)
    loader = TokenLoader(functools.partial(build, cfg), num_workers=2)
    delivered = rows(list(loader))
    assert sum(b - a for *_, a, b in delivered) == n
    check_delivery(cfg, delivered, tokens_by_dataset(delivered, cfg))


def test_per_dataset_budgets(root) -> None:
    """A dataset's budget caps it alone: code gives exactly 300 tokens (documents cut by the
    budget stay cut), math exactly 9 documents, web (no budget) is read exactly once."""
    cfg = base(root, datasets="web,code,math", max_tokens={"code": 300}, max_documents={"math": 9})
    delivered = []
    for g in range(2):
        delivered += rows(list(build(cfg, World(g, 2, 0, 1))))
    assert len({(ds, f, d) for ds, f, d, a, _ in delivered if ds == "math" and a == 0}) == 9
    math_tokens = sum(b - a for ds, *_, a, b in delivered if ds == "math")
    check_delivery(cfg, delivered, {"code": 300, "math": math_tokens})


def test_restore_at_every_step_through_the_switch(phase_cfg) -> None:
    cfg = dataclasses.replace(phase_cfg, shuffle_buffer=3)
    items = check_restore_at_every_step(lambda: build(cfg, World(1, 2, 0, 1)))
    assert {r[0] for r in rows(items)} == {"web", "code", "math"}


def _checkpoint_then_finish(cfg, tmp_path, old, new, steps) -> list:
    """Run ``cfg`` at ``old`` ranks x workers for ``steps`` (+2 per rank) sequences per rank,
    checkpoint, restore at ``new`` and finish; every document row delivered."""
    ckpt = str(tmp_path / "ckpt")
    delivered = []
    R, W = old
    for r in range(R):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W, rank=r, world_size=R)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= steps + 2 * r:
                break
        delivered += rows(seqs)
        save_checkpoint(loader, ckpt)
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W2, rank=r, world_size=R2)
        load_checkpoint(loader, ckpt)
        delivered += rows(list(loader))
    return delivered


@pytest.mark.parametrize(
    ("old", "new", "steps"),
    [
        ((2, 0), (3, 0), 3),  # both old workers in phase 0
        ((3, 0), (1, 0), 3),
        ((2, 0), (3, 0), 14),  # one old worker in phase 0, the other in phase 1
        ((2, 0), (1, 0), 14),
        ((2, 0), (1, 0), 30),  # both in phase 1
        ((1, 2), (2, 1), 12),
    ],
    ids=str,
)
def test_rescale_mid_phase(phase_cfg, tmp_path, old, new, steps) -> None:
    """Checkpoint in phase 0 (some workers' web budget part used) or in phase 1, restore on
    another topology: web still gives exactly its budget of the run, none twice, code and math
    exactly once."""
    delivered = _checkpoint_then_finish(phase_cfg, tmp_path, old, new, steps)
    check_delivery(phase_cfg, delivered, {"web": WEB_BUDGET})


@pytest.mark.parametrize(
    ("old", "new", "mode"),
    [
        ((2, 0), (3, 0), "concat"),
        ((3, 0), (2, 0), "concat"),
        ((1, 2), (1, 3), "concat"),
        ((2, 0), (1, 0), "best_fit"),
        ((2, 0), (3, 0), "pad"),
    ],
    ids=str,
)
def test_rescale_mid_budget(root, tmp_path, old, new, mode) -> None:
    """A run budget with endless readers, checkpointed mid-budget (tokens held by the packer and
    the shuffle buffer are credited back, the remaining budget re-split): the run delivers
    exactly max_tokens over both topologies, no token twice."""
    cfg = base(
        root, datasets="web,code", weights="2,1", epochs=None, max_tokens=1501, pack_mode=mode,
        best_fit_window=7,
    )  # fmt: skip
    delivered = _checkpoint_then_finish(cfg, tmp_path, old, new, 4)
    assert sum(b - a for *_, a, b in delivered) == 1501
    check_delivery(cfg, delivered, tokens_by_dataset(delivered, cfg))


@pytest.mark.parametrize(
    ("old", "new"), [((2, 0), (3, 0)), ((3, 0), (1, 0)), ((1, 2), (2, 1))], ids=str
)
def test_rescale_with_a_dataset_budget_under_the_mix(root, tmp_path, old, new) -> None:
    """A budget on one dataset, below the interleave, with documents cut into pieces (the
    interleave reads on to the end of an open document while the cut is taken: what it reads
    is counted and credited back): code gives exactly its budget, web every token once."""
    cfg = base(root, datasets="web,code", weights="1,1", max_tokens={"code": 400}, max_chunksize=7)
    for steps in (2, 6):
        delivered = _checkpoint_then_finish(cfg, tmp_path / str(steps), old, new, steps)
        check_delivery(cfg, delivered, {"code": 400})


def test_evaluation_data_is_not_budgeted(root) -> None:
    """The held-out split is evaluated whole: build_eval_pipeline ignores phases and budgets
    (the same documents as without them), while training stops at exactly max_tokens."""
    from torchdata_ext.pipeline.build import build_eval_pipeline

    plain = base(root, datasets="web,code,math", eval_fraction=0.2)
    cfg = base(
        root, eval_fraction=0.2, max_tokens=100,
        phases=[{"datasets": "web", "max_tokens": 50}, {"datasets": "code,math"}],
    )  # fmt: skip
    held_out = sorted(rows(list(build_eval_pipeline(plain, World(), collate=False))))
    assert held_out and sorted(rows(list(build_eval_pipeline(cfg, World(), collate=False)))) == (
        held_out
    )
    assert sum(b - a for *_, a, b in rows(list(build(cfg, World())))) == 100


@pytest.mark.slow
def test_budget_counts_transformed_tokens_across_a_rescale(root, tmp_path) -> None:
    """With a document transform (truncate to 15 tokens) the budget counts the tokens as
    transformed, and still delivers exactly max_tokens over a 2 -> 3 rank rescale."""
    cfg = base(
        root, datasets="web,code", weights="2,1", epochs=None, max_tokens=901,
        transforms={"*": [{"truncate": 15}]},
    )  # fmt: skip
    delivered = _checkpoint_then_finish(cfg, tmp_path, (2, 0), (3, 0), 4)
    assert sum(b - a for *_, a, b in delivered) == 901
    assert max(b for *_, b in delivered) <= 15
    check_delivery(cfg, delivered, tokens_by_dataset(delivered, cfg))
