"""The audit of a checkpoint matches what the run delivered, by provenance, document by document.

The invariant (see ``torchdata_ext/audit/report.py``): the documents a checkpoint says were consumed
and are not in flight are exactly the documents all of whose tokens were delivered in batches
up to that checkpoint; so between two checkpoints of one run, the documents that became
consumed-and-not-in-flight are exactly those whose last token was delivered in between.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from harness import document_lengths, write_random_arrow_datasets

from torchdata_ext import PipelineConfig, TokenLoader, build_datasets, build_pipeline
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.testing import write_arrow_batches

NAMES = ["web", "code"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("audit")
    write_random_arrow_datasets(str(root), (("web", 160, 20), ("code", 80, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        mix_quantum_tokens=0, output_keys="input_ids,provenance",
    )  # fmt: skip


def deliver(delivered: Counter, batch, names=NAMES) -> None:
    """Add the document tokens of a batch to ``delivered`` (by provenance; its dataset ids
    index ``names``, the datasets of the config the batch was made with)."""
    for ds, f, d, _, n in np.asarray(batch["provenance"]).reshape(-1, 5).tolist():
        if ds >= 0 and n > 0:
            delivered[(names[ds], f, d)] += n


def rows(report, *, in_flight: bool | None = None, epoch: int | None = 0) -> set:
    t = report.documents().to_pydict()
    keys = zip(t["dataset"], t["file_index"], t["doc"], t["epoch"], t["in_flight"])
    return {
        (ds, f, d)
        for ds, f, d, e, fl in keys
        if (in_flight is None or fl == in_flight) and (epoch is None or e == epoch)
    }


def check_report(report, delivered: Counter, lengths: dict) -> None:
    """The audit agrees with the delivered provenance (one epoch, no document dropped)."""
    full = {k for k, v in delivered.items() if v == lengths[k]}
    assert rows(report, in_flight=False) == full
    consumed = rows(report)
    assert set(delivered) <= consumed  # a document with a token delivered left its reader
    for d in report.datasets:
        assert d.current.documents == sum(1 for k in consumed if k[0] == d.name)
        mine = [k for k in delivered if k[0] == d.name]
        # tokens consumed = tokens delivered + tokens in flight, exactly
        assert d.current.tokens == sum(delivered[k] for k in mine) + d.in_flight_tokens
        assert d.in_flight_documents == len({k for k in consumed - full if k[0] == d.name})
        # what the audit says was delivered is what the trainer received
        assert d.tokens_delivered == sum(delivered[k] for k in mine)
        assert d.documents_delivered == sum(1 for k in full if k[0] == d.name)


@pytest.mark.parametrize(
    ("max_chunksize", "eval_fraction"), [(None, 0.0), (7, 0.0), (None, 0.25)],
    ids=["whole", "chunked", "held_out_split"],
)  # fmt: skip
def test_consumed_between_two_checkpoints_is_what_was_delivered(
    cfg, tmp_path, max_chunksize, eval_fraction
) -> None:
    cfg = dataclasses.replace(cfg, max_chunksize=max_chunksize, eval_fraction=eval_fraction)
    lengths = document_lengths(cfg)
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    delivered: Counter = Counter()
    reports, done = {}, {}
    for step, batch in enumerate(loader, 1):
        deliver(delivered, batch)
        if step in (9, 31):
            save_checkpoint(loader, str(tmp_path / f"c{step}"))
            reports[step] = audit_checkpoint(str(tmp_path / f"c{step}"), cfg)
            check_report(reports[step], delivered, lengths)
            done[step] = {k for k, v in delivered.items() if v == lengths[k]}
        if step == 31:
            break
    between = rows(reports[31], in_flight=False) - rows(reports[9], in_flight=False)
    assert between == done[31] - done[9]
    assert len(between) > 20
    # something is in flight everywhere it can be: the test covers each holder
    # (by either dataset: where the mix's row cuts fall decides which one the pipeline holds)
    held = [d.in_flight_by_holder for d in reports[9].datasets]
    assert any(by["pipeline"] for by in held) and any(by["shuffle_buffer"] for by in held), held
    web = reports[31].datasets[0]
    if eval_fraction:  # the held-out documents are in no count and no row
        from torchdata_ext.order.split import heldout_documents

        index = build_datasets(cfg)["web"]
        held_out = {("web", f, d) for f, d in heldout_documents(index, cfg.eval_split("web"))}
        assert web.held_out_documents == len(held_out) > 20
        assert not held_out & rows(reports[31], epoch=None)
        assert web.tokens == sum(n for k, n in lengths.items() if k[0] == "web") - sum(
            lengths[k] for k in held_out
        )
    assert (web.name, web.documents + web.held_out_documents, web.files) == ("web", 160, 2)
    assert web.epoch_min == 0
    assert web.target_share == pytest.approx(2 / 3)
    assert abs(web.token_share - 2 / 3) < 0.1
    assert sum(d.tokens_delivered for d in reports[31].datasets) > 31 * 2 * 30


@pytest.mark.multiprocess
def test_audit_of_a_two_rank_two_worker_run_then_a_rescale(cfg, tmp_path) -> None:
    """Ranks x workers: every worker's state is audited; after a rescale to 1 x 1 the pieces
    the pipelines held are handed back and the buffered rows go on into the new buffer, and
    the audit of the rescaled loader's checkpoint says the same documents were consumed, in
    flight as handed back or buffered."""
    lengths = document_lengths(cfg)
    delivered: Counter = Counter()
    ckpt = str(tmp_path / "old")
    for rank in range(2):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg), num_workers=2, rank=rank, world_size=2
        )
        for step, batch in enumerate(loader, 1):
            deliver(delivered, batch)
            if step == 8 + 3 * rank:
                break
        save_checkpoint(loader, ckpt)
    old = audit_checkpoint(ckpt, cfg)
    assert (old.world_size, old.num_workers) == (2, 2)
    check_report(old, delivered, lengths)

    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=0)
    load_checkpoint(loader, ckpt)  # 2 x 2 -> 1 x 1: in-flight pieces are handed back
    save_checkpoint(loader, str(tmp_path / "rescaled"))
    rescaled = audit_checkpoint(str(tmp_path / "rescaled"), cfg)
    assert rows(rescaled, in_flight=None) == rows(old, in_flight=None)
    assert rows(rescaled, in_flight=False) == rows(old, in_flight=False)
    for a, b in zip(old.datasets, rescaled.datasets):
        assert b.in_flight_documents == a.in_flight_documents > 0
        assert a.in_flight_by_holder["handed_back"] == 0 < b.in_flight_by_holder["handed_back"]
        # the buffered rows go on whole into the new buffer (issue 19), not back to the readers
        assert b.in_flight_by_holder["shuffle_buffer"] == a.in_flight_by_holder["shuffle_buffer"]
        assert b.current.tokens == a.current.tokens
    for step, batch in enumerate(loader, 1):  # the handed-back pieces are delivered first
        deliver(delivered, batch)
        if step == 15:
            break
    save_checkpoint(loader, str(tmp_path / "after"))
    check_report(audit_checkpoint(str(tmp_path / "after"), cfg), delivered, lengths)


def _run(loaders, delivered: Counter, steps: int, names=NAMES) -> None:
    """``steps`` batches (``+ 2`` per rank) of each rank's loader into ``delivered``."""
    for rank, loader in enumerate(loaders):
        for step, batch in enumerate(loader, 1):
            deliver(delivered, batch, names)
            if step == steps + 2 * rank:
                break


def _loaders(cfg, ranks: int, ckpt: str | None = None) -> list:
    """One in-process loader per rank of ``ranks`` (restored from ``ckpt`` if given)."""
    out = []
    for rank in range(ranks):
        loader = TokenLoader(functools.partial(build_pipeline, cfg), rank=rank, world_size=ranks)
        if ckpt is not None:
            load_checkpoint(loader, ckpt)
        out.append(loader)
    return out


def _save(loaders, url: str) -> None:
    for loader in loaders:
        save_checkpoint(loader, url)


def test_delivered_consumed_and_in_flight_at_every_save(cfg, tmp_path) -> None:
    """Saves mid-run at 2 ranks, right after a restore at 5 ranks (before any batch), after
    more batches, and right after a restore at the same 5 ranks: at each, per dataset, the
    audit's delivered documents and tokens are what the trainer received (provenance of the
    delivered rows) and equal consumed less in flight. A restore delivers nothing, so the
    audits taken right after one say what the checkpoint restored from says: before, the token
    share came from the saved replay points (it lagged delivery), and the audit's own replay
    pulled each restored worker's first block, counting documents no reader had read."""
    cfg = dataclasses.replace(cfg, epochs=1)  # 5 ranks finish shards early: one epoch only
    lengths = document_lengths(cfg)
    delivered: Counter = Counter()
    loaders = _loaders(cfg, 2)
    _run(loaders, delivered, 7)
    reports = {}
    for at, ranks in (("a", 2), ("b", 5), ("c", 5), ("d", 5)):
        if at != "a":  # restore the last save at 5 ranks (a rescale, then the same topology)
            loaders = _loaders(cfg, ranks, str(tmp_path / chr(ord(at) - 1)))
        if at == "c":
            _run(loaders, delivered, 5)
        _save(loaders, str(tmp_path / at))
        reports[at] = report = audit_checkpoint(str(tmp_path / at), cfg)
        check_report(report, delivered, lengths)
        for d in report.datasets:
            assert d.documents_delivered == d.current.documents - d.in_flight_documents
            assert d.tokens_delivered == d.current.tokens - d.in_flight_tokens
    for before, after in (("a", "b"), ("c", "d")):
        for x, y in zip(reports[before].datasets, reports[after].datasets):
            assert (y.current, y.tokens_delivered, y.documents_delivered, y.token_share) == (
                x.current,
                x.tokens_delivered,
                x.documents_delivered,
                x.token_share,
            )
            assert y.in_flight_documents == x.in_flight_documents
            assert y.in_flight_tokens == x.in_flight_tokens
    assert reports["b"].datasets[0].in_flight_by_holder["handed_back"] > 0


def test_audit_under_a_config_that_lists_the_datasets_the_other_way(cfg, tmp_path) -> None:
    """Saved under ``web,code`` (2, 1) and restored under ``code,web`` (1, 2): the audits of
    both checkpoints, with either config, name each dataset's own documents."""
    other = dataclasses.replace(cfg, datasets="code,web", weights="1,2")
    lengths = document_lengths(cfg)
    delivered: Counter = Counter()
    loaders = _loaders(cfg, 1)
    _run(loaders, delivered, 9)
    _save(loaders, str(tmp_path / "a"))
    loaders = _loaders(other, 1, str(tmp_path / "a"))
    _run(loaders, delivered, 8, names=["code", "web"])
    _save(loaders, str(tmp_path / "b"))
    for config in (cfg, other):
        report = audit_checkpoint(str(tmp_path / "b"), config)
        assert [d.name for d in report.datasets] == [str(n) for n in config.datasets]
        check_report(report, delivered, lengths)


def test_without_replay_counts_to_the_recorded_replay_points(cfg, tmp_path) -> None:
    lengths = document_lengths(cfg)
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    delivered: Counter = Counter()
    for step, batch in enumerate(loader, 1):
        deliver(delivered, batch)
        if step == 12:
            break
    save_checkpoint(loader, str(tmp_path / "c"))
    quick = audit_checkpoint(str(tmp_path / "c"), cfg, replay=False, tokens=False)
    exact = audit_checkpoint(str(tmp_path / "c"), cfg)
    assert not quick.replayed and exact.replayed
    full = {k for k, v in delivered.items() if v == lengths[k]}
    assert rows(quick, in_flight=False) <= full  # never claims a document it has not seen
    assert rows(quick) < rows(exact)  # the blocks the pipeline was working on are not counted
    assert all(d.in_flight_by_holder["pipeline"] == 0 for d in quick.datasets)
    assert all(d.current.tokens is None and d.tokens is not None for d in quick.datasets)
    assert "not replayed" in quick.format_table()


def test_epochs_of_ranks_at_different_places(cfg, tmp_path) -> None:
    """Rank 0 is past the end of the first epoch of its shards, rank 1 is not: the current
    epoch is the lowest, and a document consumed in two epochs has a row in each. Exact over
    both epochs: each document's rows not in flight are the times all its tokens were
    delivered."""
    small = dataclasses.replace(cfg, shuffle_buffer=2)
    lengths = document_lengths(small)
    delivered: Counter = Counter()
    ckpt = str(tmp_path / "c")
    for rank, steps in ((0, 50), (1, 20)):
        loader = TokenLoader(functools.partial(build_pipeline, small), rank=rank, world_size=2)
        for step, batch in enumerate(loader, 1):
            deliver(delivered, batch)
            if step == steps:
                break
        save_checkpoint(loader, ckpt)
    report = audit_checkpoint(ckpt, small)
    web = report.datasets[0]
    assert web.epoch_min == 0 and 12 <= web.shards_done < 24  # rank 0: all of its 12
    assert [e.epoch for e in web.epochs] == list(range(len(web.epochs)))
    assert len(web.epochs) >= 2 and web.epochs[0].documents < 160
    table = report.documents().to_pydict()
    keys = list(zip(table["dataset"], table["file_index"], table["doc"]))
    by_epoch = Counter(e for (ds, _, _), e in zip(keys, table["epoch"]) if ds == "web")
    assert [by_epoch[e.epoch] for e in web.epochs] == [e.documents for e in web.epochs]
    settled = Counter(k for k, fl in zip(keys, table["in_flight"]) if not fl)
    assert max(settled.values()) == 2
    for k, n in lengths.items():
        assert settled[k] == delivered[k] // n, k
    for d in report.datasets:  # over both epochs
        assert d.tokens_delivered == sum(v for k, v in delivered.items() if k[0] == d.name)
        assert d.documents_delivered == sum(n for k, n in settled.items() if k[0] == d.name)


def test_a_document_begun_counts_the_tokens_handed_out(cfg) -> None:
    """Counted from a cursor in the middle of a document (``max_chunksize``; the audit of a
    checkpoint without replay meets them): the tokens of the pieces handed out, exactly."""
    from torchdata_ext import ShardReader, World
    from torchdata_ext.audit.consumption import Held, audit_dataset

    index = build_datasets(cfg)["code"]
    reader = ShardReader(index, 24, seed=5, world=World(0, 1, 0, 1), block_docs=3, max_chunksize=4)
    reader.reset()
    got: Counter = Counter()
    for step in range(200):
        block = reader.next()
        for _, f, d, start, stop in block.pieces():
            got[(f, d)] += stop - start
        state = reader.state_dict()
        if step > 20 and reader_cursors(state).offset.any():
            break  # a cursor inside a document, after a few whole ones
    else:
        raise AssertionError("no cursor stopped inside a document: the test would test nothing")
    lengths = index.doc_lengths()
    _, audit = audit_dataset(
        index, state, Held(index, lengths), lengths, None,
        weight=None, target_share=None,
    )  # fmt: skip
    assert audit.current.tokens == sum(got.values())
    assert audit.current.documents == len(got)


def test_refuses_a_checkpoint_of_other_data_or_settings(cfg, tmp_path) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    next(iter(loader))
    save_checkpoint(loader, str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"the config's seed differs \(checkpoint seed=5"):
        audit_checkpoint(str(tmp_path / "c"), dataclasses.replace(cfg, seed=6))
    with pytest.raises(ValueError, match="logical_shards differs"):
        audit_checkpoint(str(tmp_path / "c"), dataclasses.replace(cfg, logical_shards=12))
    with pytest.raises(ValueError, match=r"has datasets \['code', 'web'\] but the config"):
        audit_checkpoint(
            str(tmp_path / "c"), dataclasses.replace(cfg, datasets=["web"], weights=[])
        )
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        audit_checkpoint(str(tmp_path / "nothing"), cfg)
    with pytest.raises(TypeError, match="cfg must be a PipelineConfig"):
        audit_checkpoint(str(tmp_path / "c"), 42)  # type: ignore[arg-type]


def test_cli_audit_table_json_list_and_plot(cfg, tmp_path, capsys) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    for step, _ in enumerate(loader, 1):
        if step == 10:
            break
    ckpt = str(tmp_path / "c")
    save_checkpoint(loader, ckpt)
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    report = audit_checkpoint(ckpt, cfg)

    assert main(["audit", ckpt, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == report.format_table()
    web = report.datasets[0]
    assert f"{web.current.documents:,} / 160" in out.splitlines()[2]

    assert main(["audit", ckpt, "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report.to_dict()

    listed = tmp_path / "docs.parquet"
    assert main(["audit", ckpt, "--config", str(config), "--list", str(listed)]) == 0
    table = pq.read_table(listed)
    assert table.to_pydict() == report.documents().to_pydict()
    assert table.column_names[:4] == ["dataset", "file", "file_index", "doc"]
    assert all(f.endswith(".arrow") for f in table.column("file").to_pylist())

    pytest.importorskip("matplotlib")
    picture = tmp_path / "audit.png"
    assert main(["audit", ckpt, "--config", str(config), "--plot", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_name_the_flags(cfg, tmp_path, capsys) -> None:
    assert main(["audit", str(tmp_path), "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path / 'missing.yaml'} does not exist" in err
    assert main(["audit", str(tmp_path / "none"), "--config", str(tmp_path / "x.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(cfg, tmp_path, monkeypatch) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    next(iter(loader))
    save_checkpoint(loader, str(tmp_path / "c"))
    report = audit_checkpoint(str(tmp_path / "c"), cfg)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"torchdata-ext\[plot\]"):
        report.plot(str(tmp_path / "a.png"))
    assert report.changed_files is None  # the file check is not wired in yet


def test_text_data_counts_documents_exactly_and_tokens_as_unknown(tmp_path) -> None:
    """Text tokenized on the fly: documents are exact (lengths in tokens of the delivered
    documents, read back through the pipeline), tokens are unknown."""
    from torchdata_ext import World
    from torchdata_ext.nodes.pack import Pack
    from torchdata_ext.state.graph import graph_nodes
    from torchdata_ext.testing import write_jsonl

    rng = np.random.default_rng(11)
    words = ["data", "loader", "audit", "token", "é", "shard"]
    for name, n_docs in (("web", 60), ("code", 40)):
        texts = [" ".join(rng.choice(words, 1 + int(rng.exponential(8)))) for _ in range(n_docs)]
        for f in range(2):
            write_jsonl(str(tmp_path / name / f"p{f}.jsonl"), texts[f::2])
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web,code", weights="2,1", file_type="jsonl",
        col_name="text", tokenizer="byte", seq_length=32, eos_token=0, logical_shards=8,
        batch_size=2, seed=9, shuffle_buffer=5, block_docs=4, mix_quantum_tokens=0,
        output_keys="input_ids,provenance",
    )  # fmt: skip
    pack = next(
        n
        for n in graph_nodes(build_pipeline(cfg, World(0, 1, 0, 1), collate=False))
        if isinstance(n, Pack)
    )
    lengths = {
        (name, f, d): len(pack.fetch_document(name, f, d))
        for name, index in build_datasets(cfg).items()
        for f in range(len(index.files))
        for d in range(int(index.doc_counts[f]))
    }
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    delivered: Counter = Counter()
    for step, batch in enumerate(loader, 1):
        deliver(delivered, batch)
        if step == 15:
            break
    save_checkpoint(loader, str(tmp_path / "c"))
    report = audit_checkpoint(str(tmp_path / "c"), cfg)
    full = {k for k, v in delivered.items() if v == lengths[k]}
    assert rows(report, in_flight=False) == full and len(full) > 10
    assert all(d.tokens is None and d.current.tokens is None for d in report.datasets)
    assert "?" in report.format_table()


@pytest.mark.multiprocess
def test_a_checkpoint_between_snapshots_describes_the_last_snapshot(cfg, tmp_path) -> None:
    """With ``snapshot_every_n_steps=4`` a checkpoint at step 6 holds the state of step 4 and
    the 2 batches since: the audit says so and is exact for step 4."""
    lengths = document_lengths(cfg)
    loader = TokenLoader(
        functools.partial(build_pipeline, cfg), num_workers=1, snapshot_every_n_steps=4
    )
    delivered: Counter = Counter()
    for step, batch in enumerate(loader, 1):
        if step <= 4:
            deliver(delivered, batch)
        if step == 6:
            break
    save_checkpoint(loader, str(tmp_path / "c"))
    report = audit_checkpoint(str(tmp_path / "c"), cfg)
    assert report.lagging_batches == 2
    assert "2 batches were delivered after the workers' last state snapshot" in (
        report.format_table()
    )
    check_report(report, delivered, lengths)


def test_checkpoint_and_list_on_any_fsspec_url(cfg) -> None:
    """A checkpoint on ``memory://`` is audited, and the list written there, as on disk."""
    import fsspec

    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    for step, _ in enumerate(loader, 1):
        if step == 5:
            break
    url = "memory://audit-test/ckpt"
    save_checkpoint(loader, url)
    report = audit_checkpoint(url, cfg)
    assert report.checkpoint == url and report.datasets[0].current.documents > 0
    n = report.write_documents("memory://audit-test/consumed.parquet")
    with fsspec.open("memory://audit-test/consumed.parquet", "rb") as f:
        assert pq.read_table(f).to_pydict() == report.documents().to_pydict()
    assert n == report.documents().num_rows
    fsspec.filesystem("memory").rm("memory://audit-test", recursive=True)


def test_curriculum_phases_budget_and_a_finished_dataset(cfg, tmp_path) -> None:
    """Phase 0: web for 600 tokens (a budget); phase 1: code alone until exhausted
    (``epochs=1``). Exact mid-run and at the end."""
    phased = dataclasses.replace(
        cfg,
        epochs=1,
        weights=[],
        phases=[{"datasets": "web", "max_tokens": 600}, {"datasets": "code"}],
    )
    lengths = document_lengths(phased)
    loader = TokenLoader(functools.partial(build_pipeline, phased))
    delivered: Counter = Counter()
    for step, batch in enumerate(loader, 1):
        deliver(delivered, batch)
        if step == 8:
            save_checkpoint(loader, str(tmp_path / "c8"))
            report = audit_checkpoint(str(tmp_path / "c8"), phased)
            full = {k for k, v in delivered.items() if v == lengths[k]}
            assert rows(report, in_flight=False, epoch=None) == full
    save_checkpoint(loader, str(tmp_path / "end"))  # the run is over: all delivered
    report = audit_checkpoint(str(tmp_path / "end"), phased)
    full = {k for k, v in delivered.items() if v == lengths[k]}
    assert rows(report, in_flight=False, epoch=None) == full
    web, code = report.datasets
    assert (code.current.epoch, code.current.percent_documents) == (0, 100.0)
    assert code.current.tokens == code.tokens
    assert 0 < web.current.documents < web.documents  # the budget ended web's phase
    assert web.tokens_delivered > 0 and code.tokens_delivered > 0


def test_a_finished_epoch_is_shown_whole_not_the_next_one_at_zero(cfg) -> None:
    """A reader with ``epochs=1`` read to its end has every shard waiting at epoch 1: the
    current epoch is the finished one, 100% consumed, every document listed."""
    from torchdata_ext import ShardReader, World
    from torchdata_ext.audit.consumption import Held, audit_dataset, document_rows

    index = build_datasets(cfg)["code"]
    reader = ShardReader(index, 24, seed=5, world=World(0, 1, 0, 1), block_docs=3, epochs=1)
    reader.reset()
    assert sum(len(b) for b in reader) == 80
    state = reader.state_dict()
    assert set(reader_cursors(state).epoch.tolist()) == {1}
    lengths = index.doc_lengths()
    cursors, audit = audit_dataset(
        index, state, Held(index, lengths), lengths, None,
        weight=None, target_share=None,
    )  # fmt: skip
    assert (audit.epoch_min, audit.current.epoch, audit.current.documents) == (1, 0, 80)
    assert audit.current.tokens == int(lengths.sum()) and len(audit.epochs) == 1
    file, doc, epoch, flight = document_rows(cursors)
    assert len(file) == 80 and set(epoch.tolist()) == {0} and not flight.any()


@pytest.fixture()
def saved_run(tmp_path):
    """A one-dataset run (two Arrow files) checkpointed after 4 batches: (cfg, ckpt, docs)."""
    rng = np.random.default_rng(8)
    docs = [
        rng.integers(5, 30_000, 1 + int(rng.exponential(30)), dtype=np.uint32) for _ in range(60)
    ]
    root = tmp_path / "data"
    for f in range(2):
        write_arrow_batches(str(root / "web" / f"p{f}.arrow"), docs[f::2])
    cfg = PipelineConfig(
        data_path=str(root), datasets="web", seq_length=32, eos_token=0, logical_shards=6,
        batch_size=2, seed=5, shuffle_buffer=4, block_docs=5,
    )  # fmt: skip
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    for step, _ in enumerate(loader, 1):
        if step == 4:
            break
    ckpt = str(tmp_path / "c")
    save_checkpoint(loader, ckpt)
    return cfg, ckpt, docs


def test_verify_names_a_data_file_changed_in_place(saved_run, tmp_path, capsys) -> None:
    """``verify`` re-checks every data file against the checkpoint's fingerprints: nothing
    changed gives an empty list; a file rewritten with the same size and document lengths (other
    tokens) is refused naming it, or listed with ``allow_changed_files``; the CLI the same."""
    from torchdata_ext.sources.fingerprint import ChangedFilesError

    cfg, ckpt, docs = saved_run
    root = tmp_path / "data"
    assert audit_checkpoint(ckpt, cfg, verify=True).changed_files == []
    assert audit_checkpoint(ckpt, cfg).changed_files is None

    changed = [d.copy() for d in docs[1::2]]
    changed[0][0] ^= 1  # same size, same document lengths, another token
    write_arrow_batches(str(root / "web" / "p1.arrow"), changed)
    with pytest.raises(ChangedFilesError, match=r"p1\.arrow") as err:
        audit_checkpoint(ckpt, cfg, verify=True)
    assert "p0.arrow" not in str(err.value)
    report = audit_checkpoint(ckpt, cfg, verify=True, allow_changed_files=True)
    assert len(report.changed_files) == 1 and report.changed_files[0].startswith("web/p1.arrow")
    assert "sha256" in report.changed_files[0]
    assert "CHANGED data files" in report.format_table()

    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    assert main(["audit", ckpt, "--config", str(config), "--verify"]) == 2
    assert "p1.arrow" in capsys.readouterr().err
    assert main(["audit", ckpt, "--config", str(config), "--verify", "--allow-changed-files"]) == 0
    assert "web/p1.arrow" in capsys.readouterr().out


def test_audit_names_added_and_resized_files_as_load_checkpoint_does(saved_run, tmp_path) -> None:
    cfg, ckpt, docs = saved_run
    root = tmp_path / "data" / "web"
    write_arrow_batches(str(root / "p2.arrow"), docs[:3])  # added
    write_arrow_batches(str(root / "p1.arrow"), docs[1::2][:-1])  # resized
    named = "changed files: dataset 'web': 2 file(s): p1.arrow (size "
    with pytest.raises(ValueError) as audited:
        audit_checkpoint(ckpt, cfg)
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    with pytest.raises(ValueError) as loaded:
        load_checkpoint(loader, ckpt)
    for err in (audited, loaded):
        assert named in str(err.value), err.value
        assert "p2.arrow (not in the recorded files)" in str(err.value), err.value
    # one description of the dataset's difference, in both messages
    described = str(loaded.value).split("cannot restore this loader checkpoint: ")[1]
    described = described.split(". Restore with")[0]
    assert described in str(audited.value)
    assert str(audited.value).startswith(f"checkpoint {ckpt} does not match the data now: ")


def test_allow_changed_files_without_verify_is_not_ignored(saved_run, tmp_path, capsys) -> None:
    cfg, ckpt, docs = saved_run
    changed = [d.copy() for d in docs[1::2]]
    changed[0][0] ^= 1  # same size, same document lengths, another token
    write_arrow_batches(str(tmp_path / "data" / "web" / "p1.arrow"), changed)
    with pytest.raises(ValueError, match="allow_changed_files=True needs verify=True: "):
        audit_checkpoint(ckpt, cfg, allow_changed_files=True)
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg.to_dict()))
    # the command line: --allow-changed-files implies --verify
    assert main(["audit", ckpt, "--config", str(config), "--allow-changed-files"]) == 0
    out = capsys.readouterr().out
    assert "CHANGED data files since the checkpoint (1): web/p1.arrow: sha256" in out


def test_verify_says_what_it_compared(saved_run) -> None:
    cfg, ckpt, _ = saved_run
    report = audit_checkpoint(ckpt, cfg, verify=True)
    table = report.format_table().splitlines()
    assert table[-2:] == [
        "data files verified: no difference from the checkpoint's fingerprints",
        "compared: 2 data file(s), each by its size, its version (modification time or ETag, as "
        "the filesystem lists it) and the sha256 of its first and last 64 KiB (the bytes "
        "between are not read)",
    ]
    assert audit_checkpoint(ckpt, cfg).verified is None


def test_the_plot_shows_counts_and_its_legends_match_its_axes(cfg, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from torchdata_ext.audit.render import figure

    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    for step, _ in enumerate(loader, 1):
        if step == 10:
            break
    save_checkpoint(loader, str(tmp_path / "c"))
    report = audit_checkpoint(str(tmp_path / "c"), cfg)
    left, right = figure(report, Figure).axes
    web, code = report.datasets
    held = min(web.in_flight_documents, web.current.documents)
    texts = [t.get_text() for t in left.texts]
    assert texts[0] == f"{web.current.documents - held:,} + {held:,} of 160"
    assert len(texts) == 2 and texts[1].endswith(" of 80")
    assert [t.get_text() for t in left.get_legend().get_texts()] == ["delivered", "in flight"]
    assert "(delivered + in flight)" in left.get_xlabel()
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    assert legend == ["share of the tokens delivered", "target share (weight)"]
    assert right.get_xlabel() == "% of the tokens delivered so far (all datasets)"
    texts = [t.get_text() for t in right.texts]
    assert texts[:2] == [
        f"{100 * web.token_share:.2f}% ({web.tokens_delivered:,} tokens)",
        f"{100 * web.target_share:.2f}%",
    ]
    assert texts[3] == f"{100 * code.target_share:.2f}%" == "33.33%"
