"""The audit of a loader state inside a ``torch.distributed.checkpoint`` (DCP) is the audit of
the checkpoint folder saved at the same step; a DCP folder given where a checkpoint folder is
read is named as DCP, with the call that loads it."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from harness import document_lengths
from test_audit import cfg, check_report, deliver  # noqa: F401 (cfg: the fixture)

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline
from torchdata_ext.audit.inspect_data import inspect_dataset
from torchdata_ext.audit.report import AuditReport, audit_checkpoint
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.folder import load_checkpoint, read_manifest, save_checkpoint
from torchdata_ext.cli import main


def _run(config: PipelineConfig, steps: int, workers: int, delivered: Counter) -> TokenLoader:
    loader = TokenLoader(functools.partial(build_pipeline, config), num_workers=workers)
    for step, batch in enumerate(loader, 1):
        deliver(delivered, batch)
        if step == steps:
            break
    return loader


def _dcp_save(state: dict, folder: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save(state, checkpoint_id=folder)


def _same(a: AuditReport, b: AuditReport) -> None:
    """``a`` and ``b`` say the same, but for the checkpoint's URL."""
    assert dataclasses.replace(b, checkpoint=a.checkpoint) == a
    assert b.to_dict() == {**a.to_dict(), "checkpoint": b.checkpoint}
    assert b.format_table() == a.format_table().replace(a.checkpoint, b.checkpoint)
    assert b.documents().equals(a.documents())


@pytest.fixture(scope="module")
def saved_both(cfg, tmp_path_factory) -> tuple[str, str, Counter]:  # noqa: F811
    """One loader (1 rank x 2 workers) after 11 batches, saved as a checkpoint folder and in a
    DCP checkpoint next to a model tensor; and what it delivered."""
    root = tmp_path_factory.mktemp("both")
    delivered: Counter = Counter()
    loader = _run(cfg, 11, 2, delivered)
    folder, in_dcp = str(root / "folder"), str(root / "dcp")
    save_checkpoint(loader, folder)
    _dcp_save({"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)}, in_dcp)
    loader.close()
    return folder, in_dcp, delivered


def test_a_dcp_checkpoint_audits_as_the_folder_saved_at_the_same_step(
    cfg,  # noqa: F811
    saved_both,
) -> None:
    folder, in_dcp, delivered = saved_both
    lengths = document_lengths(cfg)
    for kw in ({}, {"replay": False, "tokens": False}, {"verify": True}):
        a, b = audit_checkpoint(folder, cfg, **kw), audit_checkpoint(in_dcp, cfg, **kw)
        _same(a, b)
    assert (b.world_size, b.num_workers) == (1, 2)
    assert b.changed_files == [] and b.verified  # the ranks' fingerprint shares, merged
    assert any(d.in_flight_documents for d in b.datasets)
    check_report(audit_checkpoint(in_dcp, cfg, key="data"), delivered, lengths)


def test_cli_audit_of_a_dcp_checkpoint_prints_the_folder_table(
    cfg,  # noqa: F811
    saved_both,
    tmp_path,
    capsys,
) -> None:
    folder, in_dcp, _ = saved_both
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    assert main(["audit", folder, "--config", str(config)]) == 0
    table = capsys.readouterr().out
    assert main(["audit", in_dcp, "--config", str(config)]) == 0
    assert capsys.readouterr().out == table.replace(folder, in_dcp)
    assert main(["audit", in_dcp, "--config", str(config), "--key", "data", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        **audit_checkpoint(folder, cfg).to_dict(),
        "checkpoint": in_dcp,
    }
    assert main(["audit", folder, "--config", str(config), "--key", "data"]) == 2
    err = capsys.readouterr().err
    assert "--key data picks a loader state in a torch.distributed.checkpoint" in err
    assert f"{folder} is not one" in err


def test_a_dcp_folder_given_as_a_checkpoint_folder_is_named_with_the_call(
    cfg,  # noqa: F811
    saved_both,
) -> None:
    _, in_dcp, _ = saved_both
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    call = f"dcp.load({{'data': DCPLoaderState(loader)}}, checkpoint_id={in_dcp!r})"
    for read in (lambda: load_checkpoint(loader, in_dcp), lambda: read_manifest(in_dcp)):
        with pytest.raises(ValueError) as err:
            read()
        msg = str(err.value)
        assert f"{in_dcp} is a torch.distributed.checkpoint (DCP) checkpoint" in msg
        assert call in msg and "DCPLoaderState(loader, checkpoint_id=...)" in msg
        assert "kill during save" not in msg
    with pytest.raises(ValueError, match=r"is a torch.distributed.checkpoint \(DCP\) checkpoint, "):
        inspect_dataset(in_dcp)


def test_two_loader_states_need_a_key_and_the_refusal_lists_them(
    cfg,  # noqa: F811
    tmp_path: Path,
    capsys,
) -> None:
    train = _run(cfg, 9, 2, Counter())
    other = dataclasses.replace(cfg, seed=6)
    evaluation = _run(other, 4, 0, Counter())
    both = str(tmp_path / "both")
    _dcp_save({"train": DCPLoaderState(train), "eval": DCPLoaderState(evaluation)}, both)
    save_checkpoint(train, str(tmp_path / "train"))
    save_checkpoint(evaluation, str(tmp_path / "eval"))
    with pytest.raises(
        ValueError, match=r"holds 2 loader states, under the keys \['eval', 'train'\]"
    ):
        audit_checkpoint(both, cfg)
    with pytest.raises(ValueError, match=r"no loader state under key='model': its loader keys"):
        audit_checkpoint(both, cfg, key="model")
    _same(audit_checkpoint(str(tmp_path / "train"), cfg), audit_checkpoint(both, cfg, key="train"))
    _same(
        audit_checkpoint(str(tmp_path / "eval"), other), audit_checkpoint(both, other, key="eval")
    )
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    assert main(["audit", both, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "['eval', 'train']" in err and "--key" in err
    assert main(["audit", both, "--config", str(config), "--key", "train"]) == 0
    with pytest.raises(ValueError, match=r"under one of its loader keys \['eval', 'train'\]"):
        load_checkpoint(TokenLoader(functools.partial(build_pipeline, cfg)), both)
    train.close()
    evaluation.close()
