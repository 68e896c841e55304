"""Rescale any to any with the full pipeline: every token of every document exactly once.

An epoch of interleave + pack + shuffle buffer runs at R x W ranks x workers (real
StatefulDataLoader worker processes), is checkpointed mid-epoch to a folder, restored at
R' x W' and finished. In-flight data (interleave remainders, packing remainders, shuffle
buffer contents) must be handed on, so the union of delivered tokens covers every document
exactly once.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    document_lengths,
    text_config,
    write_random_arrow_datasets,
    write_random_text_datasets,
)

from torchdata_ext import World
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.state.reader_state import reader_cursors


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("rescale")
    write_random_arrow_datasets(str(root), (("web", 160, 20), ("code", 80, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip


def build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world, collate=False)


def cover(coverage: dict, seqs, names) -> None:
    for seq in seqs:
        prov = np.asarray(seq["provenance"])
        for ds, f, d, start, length in prov.tolist():
            if ds in (LITERAL, PAD):
                continue
            key = (names[ds], f, d)
            coverage.setdefault(key, []).append((start, start + length))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("old", [(2, 2), (3, 1)], ids=str)
@pytest.mark.parametrize("new", [(1, 0), (1, 1), (1, 3), (2, 2), (3, 1), (4, 2)], ids=str)
def test_full_pipeline_rescale_exactly_once(cfg, tmp_path, old, new) -> None:
    coverage, _ = _checkpoint_then_finish(cfg, tmp_path, old, new)
    check_exactly_once(coverage, document_lengths(cfg))


NAMES = ["web", "code"]


def _phase1(cfg, ckpt, steps=6):
    coverage: dict = {}
    loader = TokenLoader(functools.partial(build, cfg))
    seqs = []
    for seq in loader:
        seqs.append(seq)
        if len(seqs) >= steps:
            break
    cover(coverage, seqs, NAMES)
    save_checkpoint(loader, ckpt)
    return coverage


def test_changed_weights_are_refused_unless_accepted(cfg, tmp_path) -> None:
    import dataclasses

    ckpt = str(tmp_path / "ckpt")
    coverage = _phase1(cfg, ckpt)
    reweighted = dataclasses.replace(cfg, weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="weight differs .*allow_weight_changes=True"):
        load_checkpoint(TokenLoader(functools.partial(build, reweighted)), ckpt)
    loader = TokenLoader(functools.partial(build, reweighted))
    load_checkpoint(loader, ckpt, allow_weight_changes=True)
    cover(coverage, list(loader), NAMES)
    check_exactly_once(coverage, document_lengths(cfg))


def test_added_dataset_is_refused_unless_accepted(cfg, tmp_path) -> None:
    import dataclasses

    only_web = dataclasses.replace(cfg, datasets=["web"], weights=[1.0])
    ckpt = str(tmp_path / "ckpt")
    coverage = _phase1(only_web, ckpt, steps=10)
    with pytest.raises(ValueError, match="'code' is in this pipeline but not in the checkpoint"):
        load_checkpoint(TokenLoader(functools.partial(build, cfg)), ckpt)
    loader = TokenLoader(functools.partial(build, cfg))
    with pytest.raises(ValueError, match="'web': weight differs"):  # 1.0 alone, now 2 of 3
        load_checkpoint(loader, ckpt, allow_new_datasets=True)
    load_checkpoint(loader, ckpt, allow_new_datasets=True, allow_weight_changes=True)
    from torchdata_ext.state.graph import token_counters as _token_counters

    (counters,) = [
        c for st in loader.state_dict()["workers"].values() for c in _token_counters(st).values()
    ]
    # web's count carries on; code starts at its target share (1 of 3) of the tokens so far
    assert counters["web"] >= 10 * cfg.seq_length
    assert counters["code"] == counters["web"] // 2
    seqs = list(loader)
    cover(coverage, seqs, NAMES)
    check_exactly_once(coverage, document_lengths(cfg))  # web finished once, code read once


def _checkpoint_then_finish(cfg, tmp_path, old, new, steps=7) -> tuple[dict, list]:
    """Run ``cfg`` at ``old`` ranks x workers for a few items per rank, checkpoint, restore at
    ``new`` and finish the epoch; the coverage of everything delivered, and the pieces the
    rescale handed back to the readers (``[file, doc, start, stop]``)."""
    from torchdata_ext.state.graph import reader_states as _reader_states

    coverage: dict = {}
    returned: list = []
    ckpt = str(tmp_path / "ckpt")
    R, W = old
    for r in range(R):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W, rank=r, world_size=R)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= steps + 2 * r:
                break
        cover(coverage, seqs, NAMES)
        save_checkpoint(loader, ckpt)
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W2, rank=r, world_size=R2)
        load_checkpoint(loader, ckpt)
        for st in loader.state_dict()["workers"].values():
            for reader in _reader_states(st).values():
                for extras in reader_cursors(reader).extras.values():
                    returned.extend(extras.get("returned", []))
        cover(coverage, list(loader), NAMES)
    return coverage, returned


@pytest.mark.parametrize(("old", "new"), [((2, 0), (1, 0)), ((1, 0), (3, 0)), ((1, 2), (2, 1))])
def test_best_fit_rescale_hands_on_the_window(cfg, tmp_path, old, new) -> None:
    """best_fit holds a window of documents placed into bins: the bins not yet emitted and the
    rest of the block after the window are handed on, so every token is delivered once."""
    import dataclasses

    bf = dataclasses.replace(cfg, pack_mode="best_fit", best_fit_window=7)
    for steps in (1, 4, 9):
        coverage, returned = _checkpoint_then_finish(bf, tmp_path / str(steps), old, new, steps)
        check_exactly_once(coverage, document_lengths(bf))
        assert returned, "nothing was in flight: the test would not test the hand-on"


@pytest.fixture(scope="module")
def text_cfg(tmp_path_factory) -> PipelineConfig:
    root = str(tmp_path_factory.mktemp("text_rescale"))
    words = ["data", "loader", "rescale", "token", "é", "shard"]
    write_random_text_datasets(root, [("web", 90, 12), ("code", 50, 12)], words, seed=11)
    return text_config(root)


@pytest.mark.parametrize(("old", "new"), [((2, 0), (1, 0)), ((1, 0), (3, 0)), ((1, 2), (3, 1))])
def test_text_rescale_hands_back_token_pieces_of_texts(text_cfg, tmp_path, old, new) -> None:
    """Packing remainders and buffered sequences of tokenized text are token ranges of texts:
    the reader hands the text on with the range and the tokenize node cuts it after encoding."""
    coverage, returned = _checkpoint_then_finish(text_cfg, tmp_path, old, new, steps=5)
    assert any(stop >= 0 for _, _, _, stop in returned), "no part of a text was handed back"
    lengths = {}
    for name, index in build_datasets(text_cfg).items():
        handler = index.handler()
        for f, url in enumerate(index.files):
            reader = handler.open(url)
            for d in range(handler.length(reader)):
                lengths[(name, f, d)] = len(handler.get(reader, d).encode("utf-8"))
    check_exactly_once(coverage, lengths)


def test_mix_changes_that_cannot_be_exact_are_refused(cfg, tmp_path) -> None:
    """best_fit rebuilds a window from many interleave blocks after a restore, and batches
    made again after a lagging worker snapshot need the old weights: a weight change or an
    added dataset is refused there (saying why), not applied inexactly. A checkpoint saved
    right after an accepted weight change records the new targets."""
    import dataclasses

    bf = dataclasses.replace(cfg, pack_mode="best_fit", best_fit_window=7)
    ckpt = str(tmp_path / "bf")
    _phase1(bf, ckpt)
    reweighted = dataclasses.replace(bf, weights=[1.0, 3.0])
    with pytest.raises(ValueError, match="pack_mode='best_fit'"):
        load_checkpoint(
            TokenLoader(functools.partial(build, reweighted)), ckpt, allow_weight_changes=True
        )

    lagging = TokenLoader(functools.partial(build, cfg), num_workers=1, snapshot_every_n_steps=4)
    seqs = []
    for seq in lagging:
        seqs.append(seq)
        if len(seqs) >= 5:
            break
    ckpt = str(tmp_path / "lag")
    save_checkpoint(lagging, ckpt)
    new_mix = dataclasses.replace(cfg, weights=[1.0, 3.0])
    with pytest.raises(ValueError, match="batches after the workers' last state snapshot"):
        load_checkpoint(
            TokenLoader(functools.partial(build, new_mix), num_workers=1),
            ckpt,
            allow_weight_changes=True,
        )

    ckpt, again = str(tmp_path / "mix"), str(tmp_path / "mix2")
    coverage = _phase1(cfg, ckpt)
    loader = TokenLoader(functools.partial(build, new_mix))
    load_checkpoint(loader, ckpt, allow_weight_changes=True)
    save_checkpoint(loader, again)  # before any batch under the new mix
    loader = TokenLoader(functools.partial(build, new_mix))
    load_checkpoint(loader, again)  # the same config again: nothing to accept
    cover(coverage, list(loader), NAMES)
    check_exactly_once(coverage, document_lengths(cfg))


@pytest.mark.parametrize("old,new", [(3, (1, 2)), (2, (3, 1)), (2, (1, 3)), (4, (2, 3))], ids=str)
def test_token_counters_are_split_exactly(cfg, old, new) -> None:
    """Rescaled interleave token counters add up to the saved ones: each old worker's count
    is split among the new workers that read it, nothing dropped by rounding."""
    from torchdata_ext.checkpoint.rescale import rescale_worker_states
    from torchdata_ext.state.graph import token_counters

    make = functools.partial(build, cfg)
    graphs = {}
    for r in range(old):  # old ranks of one in-process worker each
        loader = TokenLoader(make, rank=r, world_size=old)
        it = iter(loader)
        for _ in range(3 + r):
            next(it)
        for g, st in loader.state_dict()["workers"].items():
            graphs[int(g)] = st["graph"]
    saved: dict[str, int] = {}
    for st in graphs.values():
        for counters in token_counters({"graph": st}).values():
            for k, v in counters.items():
                saved[k] = saved.get(k, 0) + int(v)
    R2, W2 = new
    got: dict[str, int] = {}
    for g in range(R2 * W2):
        st = rescale_worker_states(graphs, (old, 1), World(g // W2, R2, g % W2, W2), make)
        for counters in token_counters({"graph": st}).values():
            for k, v in counters.items():
                got[k] = got.get(k, 0) + int(v)
    assert got == saved and sum(saved.values()) > 0


@pytest.mark.parametrize(("old", "new"), [((2, 0), (1, 0)), ((1, 0), (3, 0))], ids=str)
def test_rescale_while_the_shuffle_buffer_fills(cfg, tmp_path, old, new) -> None:
    """A checkpoint taken while the streaming buffer is still filling (it holds the 2 sequences
    drawn so far, of 40) rescales exactly: every token once."""
    import dataclasses

    from torchdata_ext.nodes.shuffle import buffered_provenance

    filling = dataclasses.replace(cfg, shuffle_buffer=40)
    loader = TokenLoader(functools.partial(build, filling))
    it = iter(loader)
    next(it), next(it)
    (worker,) = loader.state_dict()["workers"].values()
    assert "draws" in worker["graph"] and len(buffered_provenance(worker["graph"])[0]) == 2
    coverage, _ = _checkpoint_then_finish(filling, tmp_path, old, new, steps=2)
    check_exactly_once(coverage, document_lengths(filling))
