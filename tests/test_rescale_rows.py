"""A rescale hands on training rows, not just tokens (issue 19).

The rows delivered after a rescale (any ``R x W -> R' x W'``, and a second rescale after it)
must be rows an uninterrupted run could have made: separators between documents, each
packer-placed BOS/EOS once per document, pieces in order, budgets cutting only a document's
end. :mod:`rows` checks those invariants from the rows' provenance; the runs rescale through
``rescale_worker_states`` exactly as ``load_checkpoint`` does (the multi-process and gloo paths
are in ``test_rescale.py`` and ``test_rescale_rows_ranks.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import document_lengths, write_random_arrow_datasets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rows import check_rows, simulate

from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import literal_owner


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("rows")
    write_random_arrow_datasets(str(root), (("web", 120, 20), ("code", 60, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=16, block_docs=5,
        epochs=1, mix_quantum_tokens=0, best_fit_window=7,
    )  # fmt: skip


topology = st.tuples(st.integers(1, 3), st.integers(1, 3))


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    mode=st.sampled_from(["concat", "pad", "best_fit", "chunk"]),
    buffer=st.sampled_from([1, 3, 16]),
    chunk=st.sampled_from([None, 7, 40]),
    specials=st.sampled_from([(1, 0), (None, 0), (1, None), (0, 0)]),
    topologies=st.lists(topology, min_size=2, max_size=3),
    steps=st.integers(0, 9),
    seed=st.integers(0, 3),
    selection=st.sampled_from(["all", "min_length", "eval", "transform"]),
    reordered=st.booleans(),
)
# found by this test: a whole document handed back whose BOS had ended a delivered row
# (bos_done) went on in the middle of a row, glued to the document before it without a BOS
@example(
    mode="concat", buffer=1, chunk=None, specials=(1, None), topologies=[(2, 3), (1, 1)],
    steps=4, seed=0, selection="all", reordered=False,
)  # fmt: skip
def test_rows_after_rescales_are_rows_of_an_uninterrupted_run(
    base, mode, buffer, chunk, specials, topologies, steps, seed, selection, reordered
) -> None:
    """Random pack mode, buffer, chunk size, specials, filters / split / transforms, one or
    two rescales between random topologies, and the restoring config listing the datasets in
    the other order (same weight per name)."""
    bos, eos = specials
    cfg = dataclasses.replace(
        base, pack_mode=mode, shuffle_buffer=buffer, max_chunksize=chunk, bos_token=bos,
        eos_token=eos, seed=seed, **SELECTIONS[selection],
    )  # fmt: skip
    again = dataclasses.replace(cfg, datasets=["code", "web"], weights=[1.0, 2.0])
    streams = simulate(
        cfg,
        topologies,
        lambda phase, g: steps + (g * 3 + phase) % 5,
        restore_cfg=again if reordered else None,
    )
    check_rows(streams, _delivered_uninterrupted(cfg), cfg)


def test_a_pack_state_saved_before_bos_done_restores(base) -> None:
    """Pack states written before the ``bos_done`` key restore (as none pending)."""
    from rows import _pack_of

    from torchdata_ext import World
    from torchdata_ext.pipeline.build import build_pipeline

    node = build_pipeline(base, World(), collate=False)
    node.reset(None)
    for _ in range(3):
        next(node)
    state = node.state_dict()
    expected = [next(node)["input_ids"].tolist() for _ in range(3)]
    from torchdata_ext.state.graph import pack_states

    for pack in pack_states({"g": state}).values():
        assert pack["bos_done"] == []
        del pack["bos_done"]
    fresh = build_pipeline(base, World(), collate=False)
    fresh.reset(state)
    assert [next(fresh)["input_ids"].tolist() for _ in range(3)] == expected
    assert _pack_of(fresh).state_dict()["bos_done"] == []


SELECTIONS: dict[str, dict] = {
    "all": {},
    "min_length": {"min_length": 12},
    "eval": {"eval_fraction": 0.2},
    "transform": {"transforms": [{"min_length": 6}, {"truncate": 50}]},
}
_REFERENCE: dict = {}


def _delivered_uninterrupted(cfg) -> dict:
    """The documents (and their delivered lengths) of one uninterrupted epoch of ``cfg``:
    with a filter, a split or a transform, what a rescaled run must deliver exactly."""
    key = (cfg.data_path, cfg.min_length, cfg.eval_fraction, repr(cfg.transforms), cfg.eos_token)
    if key not in _REFERENCE:
        if key[1:4] == (1, 0.0, "[]") and cfg.tokenizer is None:
            _REFERENCE[key] = document_lengths(cfg)
        else:
            ref = dataclasses.replace(cfg, shuffle_buffer=1, pack_mode="concat")
            got: dict = {}
            for stream in simulate(ref, [(1, 1)], lambda phase, g: 0):
                for item in stream:
                    for ds, f, d, start, n in item["provenance"].tolist():
                        if ds >= 0:
                            k = (item["_names"][ds], f, d)
                            got[k] = max(got.get(k, 0), start + n)
            _REFERENCE[key] = got
    return _REFERENCE[key]


@pytest.mark.parametrize("mode", ["concat", "pad"])
@pytest.mark.parametrize("tops", [[(2, 2), (1, 3)], [(1, 3), (3, 1), (2, 1)]], ids=str)
def test_budget_cut_keeps_document_starts_through_rescales(base, mode, tops) -> None:
    """A phase's token budget cuts only the end of a document, rescaled or not: what is
    delivered of every document is a prefix of it, and the phase gets exactly its budget."""
    cfg = dataclasses.replace(
        base, pack_mode=mode, phases=[
            {"datasets": "web", "max_tokens": 900}, {"datasets": "code"},
        ], datasets=[], weights=[],
    )  # fmt: skip
    lengths = document_lengths(dataclasses.replace(base))
    for steps in (1, 4):
        streams = simulate(cfg, tops, lambda phase, g, k=steps: k + g % 3)
        check_rows(streams, lengths, cfg, budget=True)
        web = sum(
            n
            for stream in streams
            for item in stream
            for ds, _f, _d, _s, n in item["provenance"].tolist()
            if ds >= 0 and item["_names"][ds] == "web"
        )
        assert web == 900


@pytest.mark.parametrize("buffer", [1, 16])
@pytest.mark.parametrize("old,new", [((2, 2), (1, 3)), ((2, 2), (3, 1)), ((1, 1), (2, 1))])
def test_specials_held_by_the_packer_are_handed_on_once(base, buffer, old, new) -> None:
    """The cases the issue traced: a row that ends with a BOS whose document is still held
    from token 0, and a row that ends with a document's last token whose EOS is held."""
    cfg = dataclasses.replace(base, shuffle_buffer=buffer)
    lengths = document_lengths(cfg)
    for steps in range(1, 12):
        streams = simulate(cfg, [old, new], lambda phase, g, k=steps: k + g)
        check_rows(streams, lengths, cfg)


def test_oracle_catches_glued_documents_and_doubled_specials(base) -> None:
    """The oracle fails on the defects of the issue (so its passes mean something)."""
    import numpy as np

    cfg = dataclasses.replace(base, shuffle_buffer=1)
    lengths = document_lengths(cfg)
    streams = simulate(cfg, [(1, 1)], lambda phase, g: 0)
    check_rows(streams, lengths, cfg)
    rows = [np.asarray(x["provenance"]) for x in streams[0]]
    at = next(i for i, p in enumerate(rows) if (p[:, 0] == -1).sum() >= 2 and len(p) > 4)
    p = rows[at]
    eos_at = next(
        i
        for i in range(1, len(p) - 1)
        if literal_owner(p[i].tolist()) and p[i, 1] == 0 and p[i + 1, 0] == -1
    )
    glued = [dict(x) for x in streams[0]]
    glued[at]["provenance"] = np.delete(p, [eos_at, eos_at + 1], axis=0)  # drop EOS and BOS
    with pytest.raises(AssertionError, match="glued|not after its BOS|not its EOS"):
        check_rows([glued], lengths, cfg)
    doubled = [dict(x) for x in streams[0]] + [{"provenance": p[eos_at : eos_at + 1]}]
    doubled[-1]["_names"] = streams[0][at]["_names"]
    with pytest.raises(AssertionError, match="without exactly one EOS"):
        check_rows([doubled], lengths, cfg)


@pytest.fixture(scope="module")
def text_base(tmp_path_factory) -> PipelineConfig:
    from harness import text_config, write_random_text_datasets

    root = str(tmp_path_factory.mktemp("text_rows"))
    words = ["data", "loader", "rescale", "token", "é", "shard"]
    write_random_text_datasets(root, [("web", 60, 12), ("code", 30, 12)], words, seed=11)
    return text_config(root, bos_token=257)


@pytest.mark.parametrize("eos", [0, None])
@pytest.mark.parametrize("tops", [[(2, 1), (1, 2)], [(1, 3), (2, 1), (1, 1)]], ids=str)
def test_text_rows_after_rescales(text_base, eos, tops) -> None:
    """Text tokenized on the fly: handed-back pieces are token ranges of texts, cut after
    encoding; the rows obey the same invariants (with BOS only, a handed-back continuation
    starts its row)."""
    cfg = dataclasses.replace(text_base, eos_token=eos)
    lengths = _delivered_uninterrupted(dataclasses.replace(cfg, shuffle_buffer=2))
    for steps in (2, 5):
        streams = simulate(cfg, tops, lambda phase, g, k=steps: k + g)
        check_rows(streams, lengths, cfg)


@pytest.mark.parametrize(
    "quantum, topologies",
    [(64, [(1, 3), (2, 1), (1, 1)]), (100, [(2, 2), (3, 1), (1, 2)])],
)
def test_a_document_handed_back_twice_keeps_its_delivered_bos(
    tmp_path, quantum, topologies
) -> None:
    """Found 2026-11-26: a row ended with a document's BOS, the rescale handed the document back
    to a reader, the new worker had not read it by the next rescale (it was still in its
    reader's state, not among the pieces held), and the second hand-back forgot that the BOS
    was delivered: the document's start came twice. Every returned piece of the merged reader
    states is now checked against the delivered BOS."""
    write_random_arrow_datasets(str(tmp_path), (("web", 60, 18), ("code", 30, 40)), seed=7)
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web,code", weights="2,1", seq_length=32,
        eos_token=0, bos_token=1, logical_shards=12, batch_size=2, seed=5, shuffle_buffer=1,
        block_docs=5, epochs=1, mix_quantum_tokens=quantum, pack_mode="concat",
    )  # fmt: skip
    streams = simulate(cfg, topologies, lambda phase, g: 2 + g)
    check_rows(streams, document_lengths(cfg), cfg)
