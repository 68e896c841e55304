"""The default mix (issue 29 item 2): close to the weights from the first batches, exact
through restores and rescales, a checkpoint of the old default refused by name, and the audit
saying why a share is far off.

The default ``mix_quantum_tokens`` is None: one sequence (``seq_length`` tokens), so the mix
switches datasets about once a row; it was 65,536 tokens, with which the README's quick start
delivered batches of one dataset only for its first dozen batches.
"""

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
from rows import check_rows, simulate

from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.nodes.interleave import Interleave
from torchdata_ext.pipeline.build import mix_quantum_tokens
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.testing import write_arrow_batches

OLD_DEFAULT = 65_536


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> PipelineConfig:
    """Two token datasets, ``web`` short documents and ``code`` longer ones, mixed 2 : 1 at the
    default quantum (one 32-token sequence)."""
    root = tmp_path_factory.mktemp("mix")
    write_random_arrow_datasets(str(root), (("web", 120, 20), ("code", 60, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=5, block_docs=5,
        epochs=1, output_keys="input_ids,provenance",
    )  # fmt: skip


def _interleave(node) -> Interleave:
    found = [n for n in graph_nodes(node) if isinstance(n, Interleave)]
    assert len(found) == 1
    return found[0]


def test_the_default_quantum_is_one_sequence(base) -> None:
    """None (the default) runs the mix at ``seq_length`` tokens, recorded so in the state; an
    explicit value is used as given."""
    assert PipelineConfig(data_path="x").mix_quantum_tokens is None
    assert mix_quantum_tokens(base) == 32
    node = build_pipeline(base, World(), collate=False)
    node.reset()
    assert _interleave(node).quantum_tokens == 32
    assert _interleave(node).get_state()["settings"]["mix_quantum_tokens"] == 32
    old = dataclasses.replace(base, mix_quantum_tokens=OLD_DEFAULT)
    assert _interleave(build_pipeline(old, World(), collate=False)).quantum_tokens == OLD_DEFAULT


def _shares(rows: list[dict], names: list[str]) -> np.ndarray:
    """Document tokens per dataset in each row (rows x datasets), from provenance."""
    out = np.zeros((len(rows), len(names)), np.int64)
    for r, row in enumerate(rows):
        for ds, _, _, _, n in np.asarray(row["provenance"]).reshape(-1, 5).tolist():
            if ds >= 0:
                out[r, ds] += n
    return out


def test_every_prefix_of_rows_holds_the_weights_within_the_bound(base) -> None:
    """Without a buffer, after every row until a dataset runs out (one epoch), each dataset's
    share of the delivered tokens is within the documented bound of its target: (quantum +
    longest document) per switch, plus the block the packer holds and the row being filled."""
    cfg = dataclasses.replace(base, shuffle_buffer=1)
    node = build_pipeline(cfg, World(), collate=False)
    node.reset()
    rows = list(node)
    counts = np.cumsum(_shares(rows, ["web", "code"]), axis=0)
    ends = min(int(np.argmax(counts[:, k] == counts[-1, k])) for k in range(2))
    assert ends > 60  # most of the epoch is checked
    counts = counts[:ends]
    total = counts.sum(axis=1)
    longest = max(document_lengths(cfg).values())
    slack = 2 * (32 + longest) + 33
    target = np.array([2 / 3, 1 / 3])
    gap = np.abs(counts - total[:, None] * target)
    assert (gap <= slack).all(), f"rows off the weights by {int(gap.max())} tokens > {slack}"
    assert (counts[19] > 0).all()


def test_the_quick_start_mix_is_close_from_the_first_batch() -> None:
    """The README's quick start (3 : 1, byte tokenizer, seq 128, batch 4, a 100-row buffer):
    with the old default its first 11 batches held (almost) one dataset only; now batches 1-11
    hold the two close to 3 : 1 (within 10 points)."""
    rng = np.random.default_rng(0)
    letters = {"web": "ab", "code": "cd"}  # the datasets' bytes: told apart in the rows
    data = {
        n: DatasetIndex.from_documents(
            n, ["".join(rng.choice(list(ch), 10 + int(rng.integers(0, 300)))) for _ in range(400)]
        )
        for n, ch in letters.items()
    }  # fmt: skip

    def web_share(quantum: int | None) -> float:
        cfg = PipelineConfig(
            data_path="memory", datasets="web,code", weights="3,1", tokenizer="byte",
            seq_length=128, batch_size=4, logical_shards=8, shuffle_buffer=100,
            mix_quantum_tokens=quantum,
        )  # fmt: skip
        node = build_pipeline(cfg, World(), datasets=data)
        node.reset()
        ids = np.concatenate([np.asarray(next(node)["input_ids"]).ravel() for _ in range(11)])
        web = np.isin(ids, [ord("a") + 1, ord("b") + 1]).sum()
        code = np.isin(ids, [ord("c") + 1, ord("d") + 1]).sum()
        return web / (web + code)

    assert web_share(OLD_DEFAULT) > 0.9  # a block of web documents (up to 65,536 tokens)
    assert abs(web_share(None) - 0.75) <= 0.10


def test_restore_at_every_step_with_the_default_mix(base) -> None:
    """Every step's state restores to exactly the rest of the stream (rows, provenance), with
    documents cut in pieces by the reader too (pieces of one document stay together)."""
    for cfg in (base, dataclasses.replace(base, max_chunksize=7)):
        items = check_restore_at_every_step(
            functools.partial(build_pipeline, cfg, World(), collate=False), max_steps=45
        )
        assert len(items) == 45


@pytest.mark.parametrize("mode", ["concat", "pad"])
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("tops", [[(2, 2), (1, 3)], [(1, 3), (3, 1), (2, 1)]], ids=str)
def test_rescales_with_the_default_mix_deliver_rows_of_an_uninterrupted_run(
    base, mode, chunk, tops
) -> None:
    """Rescaled through ``rescale_worker_states`` (as ``load_checkpoint``), the default mix's
    rows pass the row oracle and the epoch delivers every document's tokens exactly once."""
    cfg = dataclasses.replace(base, pack_mode=mode, max_chunksize=chunk)
    streams = simulate(cfg, tops, lambda phase, g: 2 + (g * 3 + phase) % 5)
    check_rows(streams, document_lengths(cfg), cfg)
    coverage: dict = {}
    for stream in streams:
        for item in stream:
            for ds, f, d, start, n in item["provenance"].tolist():
                if ds >= 0 and n > 0:
                    coverage.setdefault((item["_names"][ds], f, d), []).append((start, start + n))
    check_exactly_once(coverage, document_lengths(cfg))


def test_a_checkpoint_of_the_old_default_is_refused_by_name_or_restored_exactly(
    base, tmp_path
) -> None:
    """A checkpoint taken with the old default (65,536) is refused under the new default,
    naming ``mix_quantum_tokens``, both values and the way out; restored with
    ``mix_quantum_tokens=65536`` it goes on exactly."""
    old = dataclasses.replace(base, mix_quantum_tokens=OLD_DEFAULT, epochs=None)
    loader = TokenLoader(functools.partial(build_pipeline, old))
    it = iter(loader)
    for _ in range(4):
        next(it)
    save_checkpoint(loader, str(tmp_path / "c"))
    expected = [np.asarray(next(it)["input_ids"]).tolist() for _ in range(3)]
    loader.close()
    new = TokenLoader(
        functools.partial(build_pipeline, dataclasses.replace(old, mix_quantum_tokens=None))
    )
    with pytest.raises(ValueError) as err:
        load_checkpoint(new, str(tmp_path / "c"))
        next(iter(new))
    msg = str(err.value)
    assert "mix_quantum_tokens=65536" in msg and "mix_quantum_tokens=32" in msg, msg
    new.close()
    again = TokenLoader(functools.partial(build_pipeline, old))
    load_checkpoint(again, str(tmp_path / "c"))
    got = iter(again)
    assert [np.asarray(next(got)["input_ids"]).tolist() for _ in range(3)] == expected
    again.close()


@pytest.mark.parametrize("mode", ["pad", "concat"])
def test_the_audit_says_why_a_share_is_far_off(tmp_path, mode) -> None:
    """One very long document: where a share is 5 points or more off its target, the audit's
    table ends with one line naming the dataset, its share and target, mix_quantum_tokens and
    the longest document (``pad``: documents whole) or two rows (``concat``: the mix switches
    datasets at row ends inside it); where every share is closer, no such line."""
    rng = np.random.default_rng(1)
    for name, n in (("code", 4), ("prose", 60)):
        docs = [rng.integers(5, 999, int(rng.integers(5, 40)), dtype=np.uint32) for _ in range(n)]
        if name == "code":
            docs.insert(1, np.full(800, 7, np.uint32))
        write_arrow_batches(str(tmp_path / "data" / name / "a.arrow"), docs)
    cfg = PipelineConfig(
        data_path=str(tmp_path / "data"), datasets="code,prose", weights="1,2", seq_length=32,
        logical_shards=4, batch_size=2, shuffle_buffer=4, block_docs=4, seed=0, pack_mode=mode,
    )  # fmt: skip
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    it = iter(loader)
    steps = (4, 12, 300)
    for step in range(1, max(steps) + 1):
        next(it)
        if step in steps:
            save_checkpoint(loader, str(tmp_path / f"c{step}"))
    loader.close()
    far = 0
    for step in steps:
        report = audit_checkpoint(str(tmp_path / f"c{step}"), cfg)
        code = report.datasets[0]
        assert code.token_share is not None
        note = report.mix_note
        if (
            abs(code.token_share - 1 / 3) < 0.05
            and abs(report.datasets[1].token_share - 2 / 3) < 0.05
        ):
            assert note is None, (step, note)
            continue
        far += 1
        worst = max(report.datasets, key=lambda d: abs(d.token_share - d.target_share))
        why = (
            "two rows (66 tokens) past a share, as it switches datasets at row ends"
            if mode == "concat"
            else "its longest document (800 tokens) past a share"
        )
        assert note is not None and note.startswith(
            f"mix: {worst.name} has {100 * worst.token_share:.1f}% of the tokens delivered "
            f"against its {100 * worst.target_share:.1f}% target: each of the 1 worker(s) may "
            f"run mix_quantum_tokens (32) + {why}"
        ), (step, note)
        assert report.format_table().splitlines().count(note) == 1
    assert 0 < far < len(steps)  # both cases seen
