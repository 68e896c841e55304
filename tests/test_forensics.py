"""Run forensics (issue 30): a checkpoint replays the batches the trainer received.

A real run (2 ranks x 2 dataloader workers, ranks simulated one after the other as in
``test_rescale.py``) records every batch it delivers and saves at steps 10 and 20; the replay
of steps 25-35 from either checkpoint must be, token for token and piece for piece, what the
trainer recorded; and after a restore at 1 x 3 from step 20, what that job recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

import numpy as np
import pytest
from harness import text_config, text_document_lengths, write_random_text_datasets

from torchdata_ext import TokenLoader
from torchdata_ext.checkpoint.folder import load_checkpoint, read_manifest, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.forensics import row_record, show_batches
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.tokenizers.load import load_tokenizer

STEPS = range(25, 36)
LAST = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The config, the checkpoints at steps 10 and 20 (2 x 2), what each rank received at
    each step of the run and of a restore at 1 x 3 from step 20 (saved again at step 30)."""
    tmp = tmp_path_factory.mktemp("forensics")
    words = ["data", "loader", "rescale", "token", "é", "shard"]
    write_random_text_datasets(str(tmp / "data"), [("web", 200, 12), ("code", 100, 12)], words, 11)
    cfg = text_config(str(tmp / "data"), output_keys=["input_ids", "labels", "provenance"])
    build = functools.partial(build_pipeline, cfg)
    recorded: dict[tuple[int, int], dict] = {}
    for r in range(2):
        loader = TokenLoader(build, num_workers=2, rank=r, world_size=2)
        for step, batch in enumerate(loader, 1):
            recorded[(step, r)] = batch
            if step in (10, 20):
                save_checkpoint(loader, str(tmp / f"step_{step}"))
            if step == LAST:
                break
        loader.close()
    rescaled: dict[tuple[int, int], dict] = {}
    loader = TokenLoader(build, num_workers=3, rank=0, world_size=1)
    load_checkpoint(loader, str(tmp / "step_20"))
    for step, batch in enumerate(loader, 21):
        rescaled[(step, 0)] = batch
        if step == 30:
            save_checkpoint(loader, str(tmp / "step_30_1x3"))
        if step == LAST:
            break
    loader.close()
    config = tmp / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    return cfg, tmp, recorded, rescaled, str(config)


def _as_shown(cfg, recorded, steps, ranks) -> list[dict]:
    """The recorded batches in :func:`show_batches`' form."""
    files = {name: index.file_names() for name, index in build_datasets(cfg).items()}
    out = []
    for step in steps:
        for r in range(ranks):
            b = recorded[(step, r)]
            rows = [
                row_record(
                    {k: b[k][i].numpy() for k in ("input_ids", "labels", "provenance")},
                    cfg.datasets,
                    files,
                )
                for i in range(len(b["input_ids"]))
            ]
            out.append({"step": step, "rank": r, "rows": rows})
    return out


def _without_worker(batches: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "worker"} for b in batches]


def test_replay_from_either_checkpoint_is_what_the_trainer_received(run) -> None:
    cfg, tmp, recorded, _, _ = run
    want = _as_shown(cfg, recorded, STEPS, 2)
    from10 = show_batches(str(tmp / "step_10"), cfg, STEPS)
    from20 = show_batches(str(tmp / "step_20"), cfg, STEPS)
    assert from10 == from20
    assert _without_worker(from10) == want
    # the rows are real: pieces of documents, an EOS after each document end
    pieces = [p for b in from10 for row in b["rows"] for p in row["pieces"]]
    assert {p["dataset"] for p in pieces} == {"web", "code"}
    assert {p["file_name"] for p in pieces} == {"p0.jsonl", "p1.jsonl"}
    specials = [s for b in from10 for row in b["rows"] for s in row["specials"]]
    assert specials and all(s["token"] == 0 and "doc" in s for s in specials)
    # the workers alternate as the loader delivers them
    assert [b["worker"] for b in from10 if b["rank"] == 0][:4] in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_replay_on_another_topology_is_what_the_rescaled_job_received(run) -> None:
    cfg, tmp, _, rescaled, _ = run
    got = show_batches(str(tmp / "step_20"), cfg, STEPS, ranks=1, workers=3)
    assert _without_worker(got) == _as_shown(cfg, rescaled, STEPS, 1)
    assert [b["worker"] for b in got][:3] == [1, 2, 0]  # step 21 was worker 0's


def test_the_checkpoint_knows_its_step_across_a_restore(run) -> None:
    cfg, tmp, _, rescaled, _ = run
    assert read_manifest(str(tmp / "step_20"))["step"] == 20
    assert read_manifest(str(tmp / "step_30_1x3"))["step"] == 30
    got = show_batches(str(tmp / "step_30_1x3"), cfg, range(31, 36))
    assert _without_worker(got) == _as_shown(cfg, rescaled, range(31, 36), 1)


class _Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:  # a second further on at each read
        self.now += 1.0
        return self.now


def test_a_long_fast_forward_reports_progress_and_names_a_nearer_checkpoint(
    run, monkeypatch, caplog
) -> None:
    """Issue 44 item 8: steps 11..24 before step 25 are made and dropped; once that has lasted
    2 s it is logged (WARNING: heard without a logging setup), with the time left."""
    from torchdata_ext import progress

    cfg, tmp, recorded, _, _ = run
    monkeypatch.setattr(progress, "_clock", _Ticks())
    with caplog.at_level(logging.WARNING, logger="torchdata_ext.forensics"):
        got = show_batches(str(tmp / "step_10"), cfg, 25, rank=1)
    assert _without_worker(got) == [b for b in _as_shown(cfg, recorded, [25], 2) if b["rank"] == 1]
    lines = [r.getMessage() for r in caplog.records if r.name == "torchdata_ext.forensics.replay"]
    what = ("rank 1: fast-forwarding from step 10 (the checkpoint's) to step 25 (a checkpoint "
            "saved nearer step 25 replays faster)")  # fmt: skip
    assert lines[0] == f"{what}: 2 of 14 steps after 2 s, about 12 s left"
    assert all(line.startswith(what) for line in lines)
    caplog.clear()
    show_batches(str(tmp / "step_20"), cfg, 21, rank=1)  # nothing to fast-forward: silent
    assert not [r for r in caplog.records if r.name == "torchdata_ext.forensics.replay"]


def test_a_step_the_checkpoint_is_past_is_refused(run) -> None:
    cfg, tmp, _, _, _ = run
    with pytest.raises(ValueError, match=r"saved after step 20, so it replays steps from 21"):
        show_batches(str(tmp / "step_20"), cfg, range(15, 25))
    with pytest.raises(ValueError, match=r"rank=2 is not a rank of the 2 ranks"):
        show_batches(str(tmp / "step_20"), cfg, 25, rank=2)
    with pytest.raises(ValueError, match=r"steps='25-30': give a step A or a range A:B"):
        show_batches(str(tmp / "step_20"), cfg, "25-30")


def test_command_prints_json_text_and_parquet(run, tmp_path, capsys) -> None:
    import pyarrow.parquet as pq

    cfg, tmp, recorded, _, config = run
    ckpt = str(tmp / "step_10")
    assert main(["batches", ckpt, "--config", config, "--steps", "25:36", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert _without_worker(shown) == _as_shown(cfg, recorded, STEPS, 2)

    assert main(["batches", ckpt, "--config", config, "--steps", "25", "--rank", "1",
                 "--text"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    (batch,) = show_batches(ckpt, cfg, 25, rank=1, text=True)
    first = batch["rows"][0]["pieces"][0]
    # the packed tokens (input_ids and the last label): a piece may run to the row's end
    b25 = recorded[(25, 1)]
    ids = np.concatenate([b25["input_ids"][0].numpy(), b25["labels"][0].numpy()[-1:]])
    piece = ids[first["at"] : first["stop"] - first["start"] + first["at"]]
    decode = load_tokenizer("byte", byte_offset=cfg.byte_offset).decode
    assert first["text"] == decode(piece) and len(first["text"]) > 0
    assert text.startswith(f"step 25 rank 1 (worker {batch['worker']})\n  row 0\n")
    assert f"{first['dataset']} {first['file_name']} doc {first['doc']}" in text
    assert repr(first["text"][:200]) in text

    out = tmp_path / "b.parquet"
    assert main(["batches", ckpt, "--config", config, "--steps", "25:27", "--parquet",
                 str(out)]) == 0  # fmt: skip
    table = pq.read_table(out).to_pylist()
    shown = show_batches(ckpt, cfg, range(25, 27))
    n = sum(len(r["pieces"]) + len(r["specials"]) for b in shown for r in b["rows"])
    assert len(table) == n
    assert {r["kind"] for r in table} == {"piece", "special"}
    assert main(["batches", ckpt, "--config", config, "--steps", "5"]) == 2
    assert "saved after step 10, so it replays steps from 11" in capsys.readouterr().err


# -- skip_steps ---------------------------------------------------------------------------------
def _pieces(batch, names) -> list[tuple]:
    prov = batch["provenance"].reshape(-1, 5).numpy()
    rows = prov[(prov[:, 0] >= 0) & (prov[:, 4] > 0)].tolist()
    return [(names[ds], f, d, start, n) for ds, f, d, start, n in rows]


@pytest.fixture(scope="module")
def skipped(run):
    """A restore at 2 x 2 from step 20 skipping [30, 35), run to the end of the epoch (saved
    at step 40); each rank's batches by step and its last state."""
    cfg, tmp, _, _, _ = run
    cfg_skip = dataclasses.replace(cfg, skip_steps=[[30, 35]])
    got: dict[tuple[int, int], dict] = {}
    states = {}
    for r in range(2):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg_skip), num_workers=2, rank=r, world_size=2
        )
        load_checkpoint(loader, str(tmp / "step_20"))
        for step, batch in enumerate(loader, 21):
            got[(step, r)] = batch
            if step == 40:
                save_checkpoint(loader, str(tmp / "skip_40"))
        states[r] = loader.state_dict()
    return cfg_skip, got, states


def test_skip_steps_gives_step_a_what_step_b_would_have(run, skipped) -> None:
    cfg, _, recorded, _, _ = run
    _, got, states = skipped
    for r in range(2):
        for step in range(21, 30):
            assert got[(step, r)]["input_ids"].equal(recorded[(step, r)]["input_ids"]), step
        for step in range(30, LAST - 4):
            assert got[(step, r)]["input_ids"].equal(recorded[(step + 5, r)]["input_ids"]), step
        assert states[r]["skip_steps"] == [[30, 35]]
        # what was skipped is exactly what steps 30..34 held
        want = sorted(p for s in range(30, 35) for p in _pieces(recorded[(s, r)], cfg.datasets))
        assert sorted(tuple(p[:5]) for p in states[r]["skipped_documents"]) == want


def test_skipped_documents_are_listed_and_never_delivered(run, skipped) -> None:
    """Over the epoch (steps 1-20 of the run, then the restore that skipped [30, 35)), every
    token of every document is delivered once or listed as skipped, never both, never twice."""
    from harness import check_exactly_once

    cfg, _, recorded, _, _ = run
    _, got, states = skipped
    coverage: dict = {}
    delivered = [b for (s, _r), b in recorded.items() if s <= 20] + list(got.values())
    for batch in delivered:
        for ds, f, d, start, n in _pieces(batch, cfg.datasets):
            coverage.setdefault((ds, f, d), []).append((start, start + n))
    skipped_pieces = [p for st in states.values() for p in st["skipped_documents"]]
    assert skipped_pieces
    for ds, f, d, start, n, _epoch in skipped_pieces:
        coverage.setdefault((ds, f, d), []).append((start, start + n))
    check_exactly_once(coverage, text_document_lengths(cfg))


def test_skip_steps_on_a_fresh_run_skip_when_the_run_reaches_them(run) -> None:
    """No restore: the configured range is dropped when the run reaches step 30, and recorded
    in the state exactly as a restore records it."""
    cfg, _, recorded, _, _ = run
    cfg_skip = dataclasses.replace(cfg, skip_steps=[[30, 35]])
    for r in range(2):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg_skip), num_workers=2, rank=r, world_size=2
        )
        for step, batch in enumerate(loader, 1):
            want = recorded[(step if step < 30 else step + 5, r)]
            assert batch["input_ids"].equal(want["input_ids"]), step
            if step == 31:
                break
        state = loader.state_dict()
        loader.close()
        assert state["step"] == 31 and state["skip_steps"] == [[30, 35]]
        want_pieces = sorted(
            p for s in range(30, 35) for p in _pieces(recorded[(s, r)], cfg.datasets)
        )
        assert sorted(tuple(p[:5]) for p in state["skipped_documents"]) == want_pieces


def test_a_skip_the_checkpoint_is_past_is_refused(run) -> None:
    cfg, tmp, _, _, _ = run
    late = dataclasses.replace(cfg, skip_steps=[[15, 25]])
    loader = TokenLoader(functools.partial(build_pipeline, late), num_workers=2, world_size=2)
    with pytest.raises(ValueError, match=r"skip_steps: the range \[15, 25\] starts at step 15, "
                       r"but checkpoint .*step_20 was saved after step 20"):  # fmt: skip
        load_checkpoint(loader, str(tmp / "step_20"))
    with pytest.raises(ValueError, match=r"skip_steps: ranges \[30, 35\] and \[32, 40\] overlap"):
        dataclasses.replace(cfg, skip_steps=[[32, 40], [30, 35]])


def test_the_skip_is_recorded_for_a_rescale_and_a_replay(run, skipped) -> None:
    cfg, tmp, _, _, _ = run
    cfg_skip, got, states = skipped
    # replayed from before the skip with the config that skipped: what the trainer received
    shown = show_batches(str(tmp / "step_20"), cfg_skip, range(28, 33))
    assert _without_worker(shown) == _as_shown(cfg, got, range(28, 33), 2)
    # a rescale from after it, with a config that no longer lists it, still knows it
    assert read_manifest(str(tmp / "skip_40"))["skip_steps"] == [[30, 35]]
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=3)
    load_checkpoint(loader, str(tmp / "skip_40"))
    state = loader.state_dict()
    assert state["step"] == 40 and state["skip_steps"] == [[30, 35]]
    ranks = [st["skipped_documents"] for st in states.values()]
    assert sorted(map(tuple, state["skipped_documents"])) == sorted(
        tuple(p) for pieces in ranks for p in pieces
    )


# -- the batch log ------------------------------------------------------------------------------
def test_batch_log_lines_are_the_documents_the_rows_held(run, tmp_path) -> None:
    from torchdata_ext.forensics import BatchLog, batch_documents

    cfg, tmp, recorded, _, _ = run
    path = tmp_path / "log.jsonl"
    with BatchLog(str(path), cfg.datasets, flush_every=3) as log:
        for step in STEPS:
            log.write(step, recorded[(step, 1)], rank=1, loss=float(step) / 10)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    shown = show_batches(str(tmp / "step_20"), cfg, STEPS, rank=1)
    assert [(x["step"], x["rank"], x["loss"]) for x in lines] == [(s, 1, s / 10) for s in STEPS]
    for line, b in zip(lines, shown, strict=True):
        assert line["rows"] == [
            [[p["dataset"], p["file"], p["doc"], p["start"], p["stop"]] for p in row["pieces"]]
            for row in b["rows"]
        ]
    with pytest.raises(KeyError, match="add 'provenance' to the config's output_keys"):
        batch_documents({"input_ids": recorded[(25, 1)]["input_ids"]}, cfg.datasets)


@pytest.mark.parametrize("names", [["web"], []])
def test_a_batch_log_given_too_few_names_says_so(run, tmp_path, names) -> None:
    """Issue 44 item 18: a bare IndexError inside write before."""
    from torchdata_ext.forensics import BatchLog

    cfg, _, recorded, _, _ = run
    batch = next(
        recorded[(s, 0)] for s in STEPS if (recorded[(s, 0)]["provenance"][..., 0] == 1).any()
    )
    with BatchLog(str(tmp_path / "log.jsonl"), names) as log, pytest.raises(ValueError) as e:
        log.write(25, batch)
    assert str(e.value) == (
        f"names={names} lists {len(names)} dataset(s), but the batch's provenance holds dataset "
        "id 1: pass every dataset of the config, in its order (cfg.datasets)"
    )
    with BatchLog(str(tmp_path / "log2.jsonl"), "web,code") as log:  # as the config takes them
        log.write(25, batch)
    assert json.loads((tmp_path / "log2.jsonl").read_text())["rows"][0][0][0] in ("web", "code")


def test_the_audit_counts_skipped_documents_as_skipped(run, skipped) -> None:
    """At step 40 of the run that skipped [30, 35): the documents all of whose tokens the
    trainer received are exactly those the audit calls delivered, and the skipped ones are
    counted apart."""
    from torchdata_ext import audit_checkpoint

    cfg, tmp, recorded, _, _ = run
    _, got, states = skipped
    lengths = text_document_lengths(cfg)
    covered: dict = {}
    for batch in [b for (s, _r), b in recorded.items() if s <= 20] + [
        b for (s, _r), b in got.items() if s <= 40
    ]:
        for ds, f, d, _start, n in _pieces(batch, cfg.datasets):
            covered[(ds, f, d)] = covered.get((ds, f, d), 0) + n
    report = audit_checkpoint(str(tmp / "skip_40"), cfg)
    skipped_docs = {(p[0], p[1], p[2]) for st in states.values() for p in st["skipped_documents"]}
    for a in report.datasets:
        whole = sum(1 for k, n in covered.items() if k[0] == a.name and n == lengths[k])
        assert a.documents_delivered == whole
        assert a.step_skipped_documents == len({k for k in skipped_docs if k[0] == a.name}) > 0
    # issue 44 item 3: the text audit and --list show them too
    text = report.format_table()
    line = next(x for x in text.splitlines() if x.startswith("skipped by skip_steps"))
    assert line == "skipped by skip_steps (consumed, never delivered; --list: step_skipped): " + (
        ", ".join(
            f"{a.name} {a.step_skipped_documents:,} documents ({a.step_skipped_tokens:,} tokens)"
            for a in report.datasets
        )
    )
    table = report.documents().to_pylist()
    marked = {(r["dataset"], r["file_index"], r["doc"]) for r in table if r["step_skipped"]}
    assert marked == skipped_docs


def test_replay_from_a_dcp_checkpoint(run, tmp_path) -> None:
    """A DCP checkpoint (the loader state beside a model tensor) replays the same."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    cfg, _, _, _, _ = run
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
    recorded = {}
    for step, batch in enumerate(loader, 1):
        recorded[(step, 0)] = batch
        if step == 10:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
                state = {"model": {"w": torch.arange(4.0)}, "data": DCPLoaderState(loader)}
                dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        if step == 16:
            break
    loader.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = show_batches(str(tmp_path / "dcp"), cfg, range(12, 17))
    assert _without_worker(got) == _as_shown(cfg, recorded, range(12, 17), 1)


def test_a_skip_with_batches_made_again_at_the_restore_is_refused(run) -> None:
    """A state taken between snapshots (snapshot_every_n_steps > 1) makes its last batches
    again at a restore; a skip range there or after is refused by name, one in the past is not."""
    cfg, _, _, _, _ = run
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2, world_size=2)
    with pytest.raises(ValueError, match=r"skip_steps \[\[30, 35\]\] with a state taken 3 "
                       r"batches after .*steps 18..20 are made again"):  # fmt: skip
        loader.load_worker_states({}, step=20, skip_batches=3, skip_steps=[[30, 35]])
    loader.load_worker_states({}, step=20, skip_batches=3, skip_steps=[[5, 10]])
    loader.close()


@pytest.mark.parametrize(
    "text, shown",
    [("a\nb", r"'a\nb'"), ("tab\there", r"'tab\there'"), ("it's", '"it\'s"'), ("é", "'é'"),
     ("back\\slash", r"'back\\slash'")],
)  # fmt: skip
def test_batches_text_shows_each_character_escaped_once(text: str, shown: str) -> None:
    """Issue 44 item 22: a newline printed as \\\\n (escaped twice)."""
    from torchdata_ext.forensics.show import format_batches

    piece = {"at": 0, "dataset": "web", "file": 0, "file_name": "t.jsonl", "doc": 3,
             "start": 0, "stop": 3, "text": text}  # fmt: skip
    out = format_batches([{"step": 5, "rank": 0, "worker": 1,
                           "rows": [{"pieces": [piece], "specials": []}]}])  # fmt: skip
    assert out.splitlines() == [
        "step 5 rank 0 (worker 1)", "  row 0", "    [0] web t.jsonl doc 3 tokens 0..3",
        f"      {shown}",
    ]  # fmt: skip


def test_a_set_weights_after_the_checkpoint_replays_from_a_later_checkpoints_changes(
    run, tmp_path
) -> None:
    """Issue 44 item 5: a checkpoint taken before a set_weights call replays the old weights;
    ``changes_from`` (``--changes-from``) takes the calls from a later checkpoint."""
    cfg, _, _, _, _ = run
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    recorded = {}
    for step, batch in enumerate(loader, 1):
        recorded[step] = batch
        if step == 4:
            save_checkpoint(loader, str(tmp_path / "before"))
        if step == 6:
            loader.set_weights({"web": 1.0, "code": 5.0}, from_step=8)
        if step == 16:
            save_checkpoint(loader, str(tmp_path / "after"))
            break
    loader.close()
    want = _as_shown(cfg, {(s, 0): b for s, b in recorded.items()}, range(8, 17), 1)
    old = show_batches(str(tmp_path / "before"), cfg, "8:17")
    assert _without_worker(old) != want  # the replay cannot know the later call
    later = str(tmp_path / "after")
    assert (
        _without_worker(show_batches(str(tmp_path / "before"), cfg, "8:17", changes_from=later))
        == want
    )
    with pytest.raises(ValueError, match=r"saved after step 4, before checkpoint .* \(step 16\)"):
        show_batches(str(tmp_path / "after"), cfg, 18, changes_from=str(tmp_path / "before"))
