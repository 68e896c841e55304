"""Issue 44 item 3: documents skipped by ``skip_steps`` in one epoch and in flight again in
the next are not delivered twice over: each skipped piece records its epoch.

One small run (byte tokenizer, 2 epochs, ``skip_steps`` [5, 9) in the first) is saved at step
57, where documents skipped in epoch 0 are read again in epoch 1 and some are in flight. The
audit's delivered counts must equal those recounted from the batches the trainer received
(each document's passes taken in order: a piece opens a new pass when it overlaps the
current one), in the report, in ``--json`` and in the text table, and ``--list`` marks only
the rows of the epoch the skip happened in. A checkpoint whose pieces carry no epoch (an
earlier version's) is read as before.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pyarrow.parquet as pq
import pytest
from harness import text_config, text_document_lengths, write_random_text_datasets

from torchdata_ext import TokenLoader, audit_checkpoint
from torchdata_ext.checkpoint.folder import _sealed_json, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.pipeline.build import build_pipeline

STEP = 57


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The config, the checkpoint at ``STEP``, the batches received, the document lengths."""
    tmp = tmp_path_factory.mktemp("skip_epochs")
    words = ["data", "loader", "rescale", "token", "é", "shard"]
    write_random_text_datasets(str(tmp / "data"), [("web", 40, 12), ("code", 20, 12)], words, 11)
    cfg = dataclasses.replace(
        text_config(str(tmp / "data"), output_keys=["input_ids", "labels", "provenance"]),
        epochs=2,
        skip_steps=[[5, 9]],
        logical_shards=4,
    )
    got = []
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=0)
    for step, batch in enumerate(loader, 1):
        got.append(batch)
        if step == STEP:
            save_checkpoint(loader, str(tmp / "ckpt"))
            break
    skipped = loader.state_dict()["skipped_documents"]
    loader.close()
    lengths = text_document_lengths(cfg)
    config = tmp / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    return cfg, tmp, got, skipped, lengths, str(config)


def _passes(cfg, got, skipped) -> dict[tuple, list[list]]:
    """Each document's passes, in the order the pieces came (the skipped range's after step
    4): ``[ranges, skipped]``; a piece joins the earliest pass it does not overlap."""
    events = []
    for i, b in enumerate(got):
        if i == 4:
            events += [((p[0], p[1], p[2]), p[3], p[4], True) for p in skipped]
        prov = b["provenance"].reshape(-1, 5).numpy()
        for ds, f, d, s, n in prov[(prov[:, 0] >= 0) & (prov[:, 4] > 0)].tolist():
            events.append(((cfg.datasets[ds], f, d), s, n, False))
    passes: dict[tuple, list[list]] = {}
    for key, s, n, skip in events:
        mine = passes.setdefault(key, [])
        for p in mine:
            if not any(s < b and a < s + n for a, b in p[0]):
                p[0].append((s, s + n))
                p[1] |= skip
                break
        else:
            mine.append([[(s, s + n)], skip])
    return passes


def _delivered(cfg, got, skipped, lengths) -> dict[str, int]:
    """Per dataset, the passes whose every token the trainer received (none skipped)."""
    out = dict.fromkeys(cfg.datasets, 0)
    for key, mine in _passes(cfg, got, skipped).items():
        whole = [p for p in mine if sum(b - a for a, b in p[0]) == lengths[key] and not p[1]]
        out[key[0]] += len(whole)
    return out


def test_each_skipped_piece_records_the_epoch_it_was_consumed_in(run) -> None:
    _, _, _, skipped, _, _ = run
    assert skipped and all(len(p) == 6 and p[5] == 0 for p in skipped)


def test_documents_skipped_in_epoch_0_and_read_again_count_once_as_skipped(run, capsys) -> None:
    cfg, tmp, got, skipped, lengths, config = run
    want = _delivered(cfg, got, skipped, lengths)
    report = audit_checkpoint(str(tmp / "ckpt"), cfg)
    # the case of the issue: documents skipped in epoch 0 are in epoch 1's walk and in flight
    assert [a.epoch_min for a in report.datasets] == [1, 1]
    skipped_docs = {(p[0], p[1], p[2]) for p in skipped}
    rows = report.documents().to_pylist()
    again = {(r["dataset"], r["file_index"], r["doc"]) for r in rows if r["in_flight"]}
    assert {k[0] for k in again & skipped_docs} == {"web", "code"}
    assert {a.name: a.documents_delivered for a in report.datasets} == want
    assert want == {"web": 33, "code": 20}  # the recount, as measured once (35 / 21 before)
    assert {a.name: a.step_skipped_documents for a in report.datasets} == {
        n: len({k for k in skipped_docs if k[0] == n}) for n in cfg.datasets
    }
    assert main(["audit", str(tmp / "ckpt"), "--config", config, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {d["name"]: d["documents_delivered"] for d in printed["datasets"]} == want
    text = report.format_table()
    assert (
        "skipped by skip_steps (consumed, never delivered; --list: step_skipped): "
        + ", ".join(
            f"{a.name} {a.step_skipped_documents:,} documents ({a.step_skipped_tokens:,} tokens)"
            for a in report.datasets
        )
        in text.splitlines()
    )
    out = tmp / "docs.parquet"
    assert main(["audit", str(tmp / "ckpt"), "--config", config, "--list", str(out)]) == 0
    rows = pq.read_table(str(out)).to_pylist()
    marked = {
        (r["dataset"], r["file_index"], r["doc"], r["epoch"]) for r in rows if r["step_skipped"]
    }
    assert marked == {(*k, 0) for k in skipped_docs}


def test_a_skip_recorded_without_its_epoch_keeps_its_old_meaning(run, tmp_path) -> None:
    """An earlier version's pieces (five fields): a skipped document in flight counts as the
    pass in flight, and every row of it is marked, as before."""
    import shutil

    cfg, tmp, _, skipped, _, _ = run
    old = tmp_path / "old"
    shutil.copytree(tmp / "ckpt", old)
    (rank_file,) = [p for p in old.iterdir() if "rank" in p.name]
    meta = json.loads(rank_file.read_text())
    del meta["sha256"]
    meta["skipped_documents"] = [p[:5] for p in meta["skipped_documents"]]
    rank_file.write_bytes(_sealed_json(meta))
    report = audit_checkpoint(str(old), cfg)
    new = audit_checkpoint(str(tmp / "ckpt"), cfg)
    flying = {a.name: a for a in new.datasets}
    for a in report.datasets:
        # the old reading subtracts the skipped documents in flight again once only
        assert a.documents_delivered > flying[a.name].documents_delivered
    rows = report.documents().to_pylist()
    skipped_docs = {(p[0], p[1], p[2]) for p in skipped}
    marked = {(r["dataset"], r["file_index"], r["doc"]) for r in rows if r["step_skipped"]}
    assert marked == skipped_docs
    assert {r["epoch"] for r in rows if r["step_skipped"]} == {0, 1}
