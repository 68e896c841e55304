"""torchdata_ext.torchtitan: a data loader torchtitan builds from its config, whose state in
torchtitan's own DCP checkpoint (``CheckpointManager``, entry ``"dataloader"``) restores at
another dp degree and worker count, exactly once.

Every document holds token values no other document has, so the tokens delivered (each
packed row's ``input`` plus its last label) say exactly which tokens of which documents came.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  at the top: imported late, gloo ranks abort at exit

if os.environ.get("TORCHDATA_EXT_REQUIRE_TORCHTITAN") != "1":  # CI's own venv sets it: no skip
    pytest.importorskip(
        "torchtitan.components.checkpointer",
        reason="torchtitan is not installed: pip install 'torchdata-ext[torchtitan]' "
        "(Python >= 3.11); .ci/run tests it in a venv of its own",
    )

from _gloo import init_gloo, rendezvous, run_ranks  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402

from torchdata_ext.testing import write_arrow_batches  # noqa: E402
from torchdata_ext.torchtitan import TokenDataLoader  # noqa: E402

EOS, BOS = 0, 1


def _write_corpus(root: str) -> list[int]:
    """Two datasets of documents with unique token values (from 10 up); returns every token."""
    rng = np.random.default_rng(4)
    nxt = 10
    tokens: list[int] = []
    for name, n_docs, mean in (("web", 90, 14), ("code", 40, 30)):
        docs = []
        for _ in range(n_docs):
            n = 1 + int(rng.exponential(mean))
            docs.append(np.arange(nxt, nxt + n, dtype=np.uint32))
            tokens.extend(range(nxt, nxt + n))
            nxt += n
        for f in range(2):
            write_arrow_batches(f"{root}/{name}/p{f}.arrow", docs[f::2])
    return tokens


def _loader_config(root: str, workers: int) -> TokenDataLoader.Config:
    return TokenDataLoader.Config(
        fields={
            "data_path": root, "datasets": "web,code", "weights": "2,1", "eos_token": EOS,
            "bos_token": BOS, "logical_shards": 12, "seed": 3, "shuffle_buffer": 5,
            "block_docs": 4, "epochs": 1, "mix_quantum_tokens": 0,
        },
        num_workers=workers,
    )  # fmt: skip


class _Plain:
    """A stand-in optimizer / lr scheduler state (the test is about the data loader)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(7)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert int(state["step"]) == 7


def _manager(folder: str, dataloader: TokenDataLoader) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
        dataloader=dataloader,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=_Plain(),  # type: ignore[arg-type]
        lr_schedulers=_Plain(),  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
        base_folder=folder,
    )


def _rank_main(
    rank: int, dp: int, init: str, root: str, workers: int, load: int | None, steps: int | None,
    save: int | None, budget: int | None, folder: str, out: str,
) -> None:  # fmt: skip
    warnings.simplefilter("ignore")
    init_gloo(init, rank, dp)
    try:
        config = _loader_config(root, workers)
        if budget:  # the keywords torchtitan main's trainer passes (trainer.py, build dataloader)
            loader = config.build(
                dp_world_size=dp, dp_rank=rank, tokenizer=None, max_context_length=64,
                num_tokens_per_batch=budget,
            )  # fmt: skip
        else:  # torchtitan 0.3's
            loader = config.build(
                dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=16, local_batch_size=2
            )
        manager = _manager(folder, loader)
        if load is not None:
            assert manager.load(step=load)
        rows: list[list[int]] = []
        shapes = set()
        for n, (inputs, labels) in enumerate(loader):
            shapes.add((tuple(inputs["input"].shape), tuple(inputs["positions"].shape)))
            if budget:  # a TrainerBatch row: no batch dimension
                inputs, labels = {"input": inputs["input"][None]}, labels[None]
            for x, y in zip(inputs["input"].tolist(), labels.tolist(), strict=True):
                assert x[1:] == y[:-1]  # labels are the inputs shifted by one
                rows.append([*x, y[-1]])
            if steps is not None and n + 1 >= steps:
                break
        if save is not None:
            manager.save(curr_step=save)
        manager.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "shapes": list(shapes)}))
    finally:
        dist.destroy_process_group()


def _phase(tmp: Path, name: str, dp: int, workers: int, root: str, **kw: Any) -> list[dict]:

    out = tmp / name
    out.mkdir()
    init = rendezvous(tmp)
    args = (dp, init, root, workers, kw.get("load"), kw.get("steps"), kw.get("save"),
            kw.get("budget"))  # fmt: skip
    run_ranks(_rank_main, (*args, str(tmp / "run"), str(out)), dp)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp)]


def _delivered(*phases: list[dict]) -> list[int]:
    return sorted(
        t for ranks in phases for got in ranks for row in got["rows"] for t in row if t > BOS
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_dp2_checkpoint_restores_at_dp3_and_dp1_exactly_once(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    tokens = _write_corpus(root)
    saved = _phase(tmp_path, "dp2", 2, 1, root, steps=4, save=4)
    assert all(g["shapes"] == [[[2, 16], [2, 16]]] for g in saved)
    at3 = _phase(tmp_path, "dp3", 3, 2, root, load=4)
    assert _delivered(saved, at3) == tokens  # every token of every document, exactly once
    at1 = _phase(tmp_path, "dp1", 1, 0, root, load=4)
    assert _delivered(saved, at1) == tokens
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-4"]


def test_the_loader_is_built_from_its_config_like_torchtitans_own(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    tokens = _write_corpus(root)
    config = _loader_config(root, 0)
    assert config._owner is TokenDataLoader  # Config.build() constructs it, as torchtitan does
    loader = config.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16, local_batch_size=2
    )
    batches = list(loader)
    inputs, labels = batches[0]
    assert sorted(inputs) == ["input", "positions"] and labels.shape == (2, 16)
    rows = [[*x, y[-1]] for i, lb in batches for x, y in zip(i["input"].tolist(), lb.tolist())]
    assert sorted(t for row in rows for t in row if t > BOS) == tokens
    # positions restart at each document: a BOS after an EOS is at position 0
    starts = [
        p[k + 1]
        for i, _ in batches
        for x, p in zip(i["input"].tolist(), i["positions"].tolist(), strict=True)
        for k in range(len(x) - 1)
        if x[k : k + 2] == [EOS, BOS]
    ]
    assert len(starts) > 50 and set(starts) == {0}


def test_a_loader_without_a_pipeline_says_what_to_set() -> None:
    with pytest.raises(ValueError, match=r"set pipeline='pipeline.yaml'"):
        TokenDataLoader.Config().build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16, local_batch_size=2
        )


def test_torchtitans_varlen_boundaries_from_positions_are_the_packers(tmp_path: Path) -> None:
    """torchtitan 0.3 builds its flex / varlen masks from ``positions == 0``
    (``create_varlen_metadata_for_document``: per row, offsets ``b * L``; its module imports
    triton, so it cannot be called here): on our batches that rule gives exactly the boundary
    keys Pack emitted (``Config.boundaries`` adds them)."""
    root = str(tmp_path / "data")
    _write_corpus(root)
    config = _loader_config(root, 0)
    config.boundaries = ("cu_seqlens", "max_seqlen", "seq_lens")
    loader = config.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=16, local_batch_size=2
    )
    n = 0
    for inputs, labels in loader:
        assert list(inputs) == ["input", "positions", "cu_seqlens", "max_seqlen", "seq_lens"]
        rows, width = inputs["positions"].shape
        starts = (inputs["positions"] == 0).nonzero()  # (row, column) in row-major order
        theirs = [*(starts[:, 0] * width + starts[:, 1]).tolist(), rows * width]
        assert theirs == inputs["cu_seqlens"].tolist()
        assert max(b - a for a, b in zip(theirs, theirs[1:])) == int(inputs["max_seqlen"])
        assert inputs["seq_lens"].sum(1).tolist() == [16] * len(labels)
        n += 1
    assert n > 20


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchtitan_mains_token_budget_rows_restore_at_another_dp_exactly_once(
    tmp_path: Path,
) -> None:
    """Built as torchtitan main's trainer builds its data loader (``num_tokens_per_batch``,
    ``max_context_length``): TrainerBatch rows of 48 tokens; a dp 2 checkpoint restores at dp 3,
    every token once, where main's ``GrainDataLoader`` refuses another dp degree."""
    root = str(tmp_path / "data")
    tokens = _write_corpus(root)
    saved = _phase(tmp_path, "dp2", 2, 0, root, steps=3, save=3, budget=48)
    assert all(g["shapes"] == [[[48], [48]]] for g in saved)
    at3 = _phase(tmp_path, "dp3", 3, 0, root, load=3, budget=48)
    assert _delivered(saved, at3) == tokens
    try:  # torchtitan main (not on PyPI: CI has 0.3.0): its own loader refuses the same change
        from torchtitan.components.data.loader import GrainDataLoader
    except ImportError:
        return
    at_dp3 = type("Rank0AtDp3", (), {"_dp_world_size": 3, "_rank_id": "dp_rank_0"})()
    with pytest.raises(ValueError, match="changing the effective data-parallel degree"):
        GrainDataLoader.load_state_dict(at_dp3, {"version": 1, "dp_world_size": 2})  # type: ignore[arg-type]


def test_token_budget_mode_yields_one_row_of_t_tokens(tmp_path: Path) -> None:
    """``num_tokens_per_batch`` (the keyword torchtitan's next data API passes to ``build``):
    each batch ``({"input": [T], "positions": [T], ...}, labels[T])``, every token once."""
    root = str(tmp_path / "data")
    tokens = _write_corpus(root)
    config = _loader_config(root, 1)
    config.boundaries = ("cu_seqlens", "max_seqlen", "seq_lens")
    loader = config.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, max_context_length=64, num_tokens_per_batch=48
    )
    rows = []
    for inputs, labels in loader:
        assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (48,)
        assert inputs["input"][1:].tolist() == labels[:-1].tolist()
        cu = inputs["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == 48 and inputs["seq_lens"].ndim == 1
        assert cu[:-1] == (inputs["positions"] == 0).nonzero().view(-1).tolist()
        rows.append([*inputs["input"].tolist(), int(labels[-1])])
    assert sorted(t for row in rows for t in row if t > BOS) == tokens
    assert loader.describe()["seq_length"] == 48 and loader.describe()["batch_size"] == 1
    assert loader.describe()["max_context_length (not applied)"] == 64


def test_token_budget_and_boundary_settings_are_checked(tmp_path: Path) -> None:
    config = _loader_config(str(tmp_path), 0)
    with pytest.raises(ValueError, match=r"needs seq_len and local_batch_size .* or num_tokens"):
        config.build(dp_world_size=1, dp_rank=0, tokenizer=None)
    config.token_budget = 32
    with pytest.raises(ValueError, match=r"Config token_budget=32 but the trainer"):
        config.build(dp_world_size=1, dp_rank=0, num_tokens_per_batch=64)
    config.boundaries = ("cu_seqlens", "segment_ids")
    with pytest.raises(ValueError, match=r"boundaries=.*not boundary keys \['segment_ids'\]"):
        config.build(dp_world_size=1, dp_rank=0)
