"""``dataset_ids`` (issue 31, item 3): each token's dataset in the batch, for a loss per dataset.

The ids are checked token by token against two readings that do not use the key's code: the
rows' provenance (a document row's dataset, a BOS/EOS's owner) and the token values
themselves (dataset ``k``'s documents hold tokens ``100 (k + 1) .. 100 (k + 2)``), in every
packing mode, with and without ``shift``, in process and through two worker processes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.nodes import IterableWrapper

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.batch import dataset_ids
from torchdata_ext.loader.evaluation import EvalLoader
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import literal_owner
from torchdata_ext.testing import write_arrow_batches

NAMES = ["web", "code", "math"]  # not sorted: the ids follow the config's order
PAD, BOS, EOS, BOL = 0, 1, 2, 3
KEYS = "input_ids,labels,loss_mask,document_ids,provenance,dataset_ids"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Three datasets; dataset ``k`` (in NAMES order) holds tokens ``100 (k + 1) ..``."""
    root = tmp_path_factory.mktemp("dataset_ids")
    rng = np.random.default_rng(5)
    for k, name in enumerate(NAMES):
        lo = 100 * (k + 1)
        docs = [rng.integers(lo, lo + 100, int(rng.integers(1, 30)), dtype=np.uint32)]
        docs += [rng.integers(lo, lo + 100, int(n), dtype=np.uint32) for n in (3, 25, 7, 12)]
        docs += [rng.integers(lo, lo + 100, int(rng.integers(1, 30)), dtype=np.uint32)] * 12
        write_arrow_batches(str(root / name / "a.arrow"), docs)
    return root


def _cfg(root: Path, mode: str, shift: bool, **kw) -> PipelineConfig:
    keys = KEYS if shift else KEYS.replace("labels,", "")
    return PipelineConfig(
        data_path=str(root), datasets=",".join(NAMES), weights="3,2,1", seq_length=16,
        logical_shards=4, batch_size=3, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        pack_mode=mode, shift=shift, output_keys=keys, shuffle_buffer=4, epochs=1,
        best_fit_window=6, **kw,
    )  # fmt: skip


def _expected(prov: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Each packed token's dataset, read from a provenance table row by row (padding rows of
    length 0 from Collate's filling drop out), checked against the token values."""
    out: list[int] = []
    for row in prov.tolist():
        owner = literal_owner(row)
        ds = row[0] if row[0] >= 0 else owner[0] if owner is not None else -1
        out += [ds] * row[4]
    ids = np.array(out)
    data = prov[:, 0].repeat(prov[:, 4]) >= 0
    np.testing.assert_array_equal(ids[data], tokens[data] // 100 - 1)  # the values agree
    assert set(tokens[ids == -1].tolist()) <= {PAD, BOL}  # each BOS/EOS has its dataset
    return ids


def _check(batches: list[dict[str, torch.Tensor]], shift: bool) -> set[int]:
    """Every batch's ``dataset_ids`` against :func:`_expected`; the ids seen."""
    seen: set[int] = set()
    assert batches
    for batch in batches:
        got = batch["dataset_ids"]
        assert got.dtype == torch.int16 and got.shape == batch["input_ids"].shape
        for i in range(len(got)):
            packed = batch["input_ids"][i].numpy()
            if shift:
                packed = np.append(packed, batch["labels"][i, -1].item())
            ids = _expected(batch["provenance"][i].numpy(), packed)
            want = ids[1:] if shift else ids[: got.shape[1]]
            assert got[i].tolist() == want.tolist()
        if shift and "loss_mask" in batch:  # ids follow the labels: none on a padding label
            assert bool(batch["loss_mask"][got >= 0].all())
        seen |= set(got.unique().tolist())
    return seen


@pytest.mark.parametrize("mode", ["concat", "pad", "best_fit", "chunk"])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_dataset_ids_are_each_tokens_dataset(data, mode, shift, workers) -> None:
    cfg = _cfg(data, mode, shift)
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
    assert loader.dataset_names == NAMES
    batches = list(loader)
    seen = _check(batches, shift)
    assert seen >= {0, 1, 2}
    if mode != "concat":  # the other modes pad: padding is -1
        assert -1 in seen


def test_dataset_ids_are_the_same_with_and_without_workers_and_cost_no_other_key(data) -> None:
    """The key adds itself only: the other keys are those of the loader without it."""
    cfg = _cfg(data, "best_fit", True)
    with_ids = list(TokenLoader(functools.partial(build_pipeline, cfg), num_workers=0))
    keys = [k for k in cfg.output_keys if k != "dataset_ids"]
    plain_cfg = _cfg(data, "best_fit", True)
    plain_cfg.output_keys = keys
    plain = list(TokenLoader(functools.partial(build_pipeline, plain_cfg), num_workers=0))
    assert len(plain) == len(with_ids)
    for a, b in zip(with_ids, plain):
        assert set(a) == {*keys, "dataset_ids"} and set(b) == set(keys)
        for k in keys:
            assert torch.equal(a[k], b[k])


def _pack(root: Path, shift: bool) -> Pack:
    index = DatasetIndex.build(str(root / "code"))
    reader = ShardReader(index, 2, world=World(), epochs=1, block_docs=3)
    return Pack(
        reader, 12, eos_token=EOS, bos_token=BOS, bol_token=BOL, mode="pad", shift=shift,
        dataset_names=["web", "code"],
    )  # fmt: skip


@pytest.mark.parametrize("shift", [True, False])
def test_every_collate_path_gives_the_same_ids(data, shift) -> None:
    """Fused (Pack's packed form), compact (``next_packed_batch().to_tensors()``) and dicts
    (Pack's ``next()`` through a plain node) agree; line specials are -1."""
    keys = ("input_ids", "labels", "provenance", "dataset_ids")
    fused = Collate(_pack(data, shift), 4, keys=keys)
    fused.reset()
    compact = Collate(_pack(data, shift), 4, keys=keys)
    compact.reset()
    pack = _pack(data, shift)
    pack.reset()
    dicts = Collate(IterableWrapper(list(pack)), 4, keys=keys)
    dicts.reset()
    n = 0
    for a in fused:
        b = compact.next_packed_batch().to_tensors()  # type: ignore[union-attr]
        c = next(dicts)
        assert torch.equal(a["dataset_ids"], b["dataset_ids"])
        assert torch.equal(a["dataset_ids"], c["dataset_ids"])
        assert set(a["dataset_ids"].unique().tolist()) <= {-1, 1}  # "code" is id 1
        if not shift:  # the line's bol is no dataset's (with shift column 0 is the BOS label)
            assert (a["dataset_ids"][:, 0] == -1).all() and (a["input_ids"][:, 0] == BOL).all()
        _check([a], shift)
        n += 1
    assert n >= 3


def test_a_source_without_provenance_is_refused_naming_the_key() -> None:
    items = [{"input_ids": np.arange(4), "position_ids": np.arange(4)} for _ in range(2)]
    node = Collate(IterableWrapper(items), 2, keys=("input_ids", "dataset_ids"))
    node.reset()
    with pytest.raises(KeyError, match="asks for 'dataset_ids', which Collate reads from each"):
        next(node)


def test_runs_that_do_not_tile_the_batch_are_refused() -> None:
    runs = np.array([[0, 5], [1, 4]], np.int32)
    assert dataset_ids(runs, 1, 9, 8, True).tolist() == [[0] * 4 + [1] * 4]
    assert dataset_ids(runs, 1, 9, 8, False).tolist() == [[0] * 5 + [1] * 3]
    with pytest.raises(ValueError, match="cover 9 tokens but the batch packs 2 x 9"):
        dataset_ids(runs, 2, 9, 8, True)


def test_config_accepts_the_key(data) -> None:
    cfg = _cfg(data, "concat", True)
    assert "dataset_ids" in cfg.output_keys
    with pytest.raises(ValueError, match="unknown \\['dataset_id'\\]; choose from"):
        PipelineConfig(data_path=str(data), output_keys="dataset_id")


def test_eval_ids_index_the_config_order_and_padding_rows_are_minus_one(data) -> None:
    """Evaluation leaves out the datasets with nothing held out; the ids still index the
    config's datasets (as in training), and the rows added to complete a batch are -1."""
    cfg = _cfg(data, "pad", True, eval_fraction={"code": 0.5, "math": 0.5})
    evaluation = EvalLoader(cfg)
    assert evaluation.dataset_names == NAMES
    batches = list(evaluation)
    real = [{k: v[b["row_mask"]] for k, v in b.items()} for b in batches]
    assert _check(real, True) - {-1} == {1, 2}
    padded = [b for b in batches if not b["row_mask"].all()]
    assert padded, "pick eval_fraction so the last batch is short"
    for b in padded:
        assert (b["dataset_ids"][~b["row_mask"]] == -1).all()


@pytest.mark.multiprocess
def test_the_key_can_be_added_at_a_restore(data) -> None:
    """``output_keys`` may change at a restore (the state holds positions, not keys): a run
    saved without ``dataset_ids`` and resumed with it continues with exactly the batches, ids
    included, of a run that had the key from the start."""
    with_ids = _cfg(data, "concat", True)
    plain = _cfg(data, "concat", True)
    plain.output_keys = [k for k in with_ids.output_keys if k != "dataset_ids"]
    reference = list(TokenLoader(functools.partial(build_pipeline, with_ids), num_workers=2))
    first = TokenLoader(functools.partial(build_pipeline, plain), num_workers=2)
    for step, _ in enumerate(first, 1):
        if step == 4:
            break
    state = first.state_dict()
    first.close()
    resumed = TokenLoader(functools.partial(build_pipeline, with_ids), num_workers=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(reference) - 4 > 3
    for a, b in zip(rest, reference[4:]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ids_follow_the_config_order_whatever_the_datasets_mapping_order(data) -> None:
    """Pre-built indexes given in another order, and a build function without a config:
    the ids still index the config's ``datasets`` and ``dataset_names`` says so."""
    from torchdata_ext.pipeline.build import build_datasets

    cfg = _cfg(data, "concat", True)
    backwards = dict(reversed(build_datasets(cfg).items()))
    assert list(backwards) == NAMES[::-1]
    loader = TokenLoader(lambda w: build_pipeline(cfg, w, backwards))
    assert loader.built_config() is None and loader.dataset_names == NAMES
    assert _check(list(loader), True) >= {0, 1, 2}  # the token values agree with the ids
