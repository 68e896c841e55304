"""Collate: exact stacking of packed sequences into tensors, partial batches, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import check_loader_restore, check_restore_at_every_step, item_key, run
from torchdata.nodes import BaseNode, IterableWrapper

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.nodes.collate import DEFAULT_KEYS, Collate
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.testing import write_arrow_batches


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("collate") / "web"
    root.mkdir()
    rng = np.random.default_rng(4)
    docs = [rng.integers(10, 30_000, size=int(n), dtype=np.uint32) for n in rng.integers(1, 40, 24)]
    write_arrow_batches(str(root / "a.arrow"), docs[:10])
    write_arrow_batches(str(root / "b.arrow"), docs[10:])
    return DatasetIndex.build(str(root))


def packer(index, epochs=2, **kw) -> Pack:
    reader = ShardReader(index, 4, world=World(), epochs=epochs, block_docs=3, max_chunksize=11)
    return Pack(reader, kw.pop("seq_len", 16), eos_token=0, **kw)


@pytest.mark.parametrize(
    "pack_kw,batch_size",
    [({}, 3), ({"mode": "best_fit", "window": 6, "shift": True}, 4), ({"mode": "pad"}, 1)],
    ids=["concat", "best_fit_shift", "pad_b1"],
)
def test_batches_are_the_stacked_sequences(index, pack_kw, batch_size) -> None:
    seqs = run(packer(index, **pack_kw))
    batches = check_restore_at_every_step(lambda: Collate(packer(index, **pack_kw), batch_size))
    assert len(batches) == -(-len(seqs) // batch_size)  # the last partial batch too
    shift = pack_kw.get("shift", False)
    keys = ["input_ids", "position_ids", "document_ids", "loss_mask"] + (
        ["labels"] if shift else []
    )
    for b, batch in enumerate(batches):
        group = seqs[b * batch_size : (b + 1) * batch_size]
        assert list(batch) == keys  # provenance dropped, labels only with shift
        for key in keys:
            t = batch[key]
            assert t.shape == (len(group), 16) and t.is_contiguous()
            assert t.dtype == (torch.bool if key == "loss_mask" else torch.int64)
            assert np.array_equal(t.numpy(), np.stack([s[key] for s in group]))
    assert batches[-1]["input_ids"].shape[0] == len(seqs) - (len(batches) - 1) * batch_size


def test_restore_through_loader(index) -> None:
    def make():
        return Collate(packer(index, mode="best_fit", window=5), 2, dtype=torch.int32)

    n = len(run(make()))
    check_loader_restore(make, steps=n, at=[0, 1, n // 2, n - 1])
    assert run(make())[0]["input_ids"].dtype == torch.int32


def test_drop_last_and_state(index) -> None:
    seqs = run(packer(index, epochs=1))
    assert len(seqs) % 4
    full = run(Collate(packer(index, epochs=1), 4, drop_last=True))
    assert len(full) == len(seqs) // 4 and all(b["input_ids"].shape[0] == 4 for b in full)
    node = Collate(packer(index, epochs=1), 4)
    next(node)
    assert list(node.state_dict()) == ["source"]
    assert node.state_dict()["source"] == node.source.state_dict()


def test_provenance_on_request_rebuilds_each_row(index) -> None:
    pack = packer(index, mode="pad")
    node = Collate(pack, 3, keys=("input_ids", "provenance", "loss_mask"))
    for batch in run(node):
        assert list(batch) == ["input_ids", "provenance", "loss_mask"]
        prov = batch["provenance"].numpy()
        assert prov.ndim == 3 and prov.shape[2] == 5 and prov.dtype == np.int64
        for i in range(prov.shape[0]):
            again = pack.rebuild(prov[i][prov[i][:, 4] > 0])
            assert np.array_equal(again["input_ids"], batch["input_ids"][i].numpy())
            assert np.array_equal(again["loss_mask"], batch["loss_mask"][i].numpy())


def test_bad_arguments_and_items() -> None:
    src = IterableWrapper([{"input_ids": np.arange(4)}])
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        Collate(src, 0)
    with pytest.raises(TypeError, match="batch_size=2.0 must be an integer"):
        Collate(src, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype=torch.float32 must be an integer torch dtype"):
        Collate(src, 2, dtype=torch.float32)
    with pytest.raises(TypeError, match="keys='input_ids' must be a non-empty sequence"):
        Collate(src, 2, keys="input_ids")
    with pytest.raises(TypeError, match="source must be a torchdata.nodes.BaseNode"):
        Collate([{"input_ids": np.arange(4)}], 2)  # type: ignore[arg-type]
    ragged = IterableWrapper([{"input_ids": np.arange(4)}, {"input_ids": np.arange(5)}])
    with pytest.raises(ValueError, match=r"item 1 has 'input_ids' of shape \(5,\)"):
        next(Collate(ragged, 2))
    mixed = IterableWrapper(
        [{"input_ids": np.arange(4)}, {"input_ids": np.arange(4), "labels": np.arange(4)}]
    )
    with pytest.raises(KeyError, match="item 0 of the batch has no 'labels'"):
        next(Collate(mixed, 2))


def test_stream_equals_collate_of_the_pack_stream_after_restore(index) -> None:
    """A restored Collate continues from a batch boundary of the Pack stream."""
    node = Collate(packer(index), 3)
    first = [next(node) for _ in range(2)]
    state = node.state_dict()
    rest = run(node)
    fresh = Collate(packer(index), 3)
    fresh.reset(state)
    assert [item_key(b) for b in run(fresh)] == [item_key(b) for b in rest]
    assert len(first) == 2


class _Plain(BaseNode[dict]):
    """Passes a node's items through, hiding its packed-item protocol (the generic path)."""

    def __init__(self, node: BaseNode) -> None:
        super().__init__()
        self.node = node

    def reset(self, initial_state=None) -> None:
        super().reset(initial_state)
        self.node.reset(initial_state)

    def next(self) -> dict:
        return next(self.node)

    def get_state(self) -> dict:
        return self.node.state_dict()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "pack_kw",
    [{}, {"shift": True, "mode": "pad"}, {"mode": "best_fit", "window": 5, "shift": True}],
    ids=["concat", "pad_shift", "best_fit_shift"],
)
def test_packed_sequences_written_straight_into_the_batch(index, pack_kw, dtype) -> None:
    """Over a Pack (or a shuffle buffer over one) each sequence is written into the batch
    arrays without its dict: the batches equal those of the generic path."""
    keys = ("input_ids", "labels", "provenance", "position_ids", "document_ids", "loss_mask")
    for wrap in (lambda p: p, lambda p: ShuffleBuffer(p, 7, seed=2)):
        fused = Collate(wrap(packer(index, **pack_kw)), 3, dtype=dtype, keys=keys)
        assert fused._fused
        generic = Collate(_Plain(wrap(packer(index, **pack_kw))), 3, dtype=dtype, keys=keys)
        assert not generic._fused
        a, b = run(fused), run(generic)
        assert [list(x) for x in a] == [list(x) for x in b]
        assert [item_key(x) for x in a] == [item_key(x) for x in b]
        assert all(t.dtype == (torch.bool if k == "loss_mask" else dtype if k != "provenance"
                               else torch.int64) for x in a for k, t in x.items())  # fmt: skip
    check_restore_at_every_step(
        lambda: Collate(ShuffleBuffer(packer(index, **pack_kw), 5, seed=1), 2, dtype=dtype),
        steps=range(0, 12, 3),
    )


@pytest.mark.parametrize("in_worker", [True, False], ids=["worker", "main"])
@pytest.mark.parametrize("fused", [True, False], ids=["packed", "generic"])
def test_a_batch_is_one_storage_in_a_worker(index, fused, in_worker, monkeypatch) -> None:
    """In a dataloader worker all tensors of a batch are contiguous views of one storage, so
    the worker sends one shared-memory segment per batch; each still holds exactly its own
    values (in the main process too, where each tensor has its own array)."""
    import torchdata_ext.nodes.collate as collate_module

    if in_worker:
        monkeypatch.setattr(collate_module, "get_worker_info", lambda: object())
    keys = ("input_ids", "labels", "provenance", "position_ids", "document_ids", "loss_mask")
    pack_kw = {"shift": True}
    seqs = run(packer(index, **pack_kw))
    src = packer(index, **pack_kw)
    node = Collate(src if fused else _Plain(src), 3, dtype=torch.int32, keys=keys)
    assert node._fused is fused
    for b, batch in enumerate(run(node)):
        storages = {t.untyped_storage().data_ptr() for t in batch.values()}
        assert len(storages) == (1 if in_worker else len(batch))
        group = seqs[b * 3 : (b + 1) * 3]
        for key, t in batch.items():
            assert t.is_contiguous()
            if key != "provenance":
                assert np.array_equal(t.numpy(), np.stack([s[key] for s in group]))
        prov = batch["provenance"].numpy()
        for row, s in zip(prov, group):
            assert np.array_equal(row[: len(s["provenance"])], s["provenance"])
            assert (row[len(s["provenance"]) :, 4] == 0).all()  # padding rows cover nothing


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("mode", ["concat", "pad", "best_fit"])
@pytest.mark.parametrize(
    "keys", [DEFAULT_KEYS, ("input_ids", "labels", "position_ids"), (*DEFAULT_KEYS, "provenance")]
)
def test_packed_batch_to_tensors_equals_next(index, shift, mode, keys) -> None:
    """What a worker ships (tokens + document runs) becomes exactly the batch ``next`` makes."""
    from torchdata_ext.batch import BatchGroup

    def make():
        reader = ShardReader(index, 4, world=World(), epochs=1, block_docs=3, seed=2)
        pack = Pack(reader, 16, mode=mode, eos_token=0, bos_token=1, shift=shift, window=7)
        return Collate(ShuffleBuffer(pack, 5, seed=3), 3, keys=keys)

    a, b = make(), make()
    a.reset()
    b.reset()
    wire = []
    while True:
        try:
            want = next(a)
        except StopIteration:
            with pytest.raises(StopIteration):
                b.next_packed_batch()
            break
        got = b.next_packed_batch()
        wire.append(got)
        out = got.to_tensors()
        assert list(out) == list(want)
        for k in want:
            assert out[k].dtype == want[k].dtype and torch.equal(out[k], want[k]), k
    # grouped for transport and split again: the same batches
    same = [w for w in wire if w.tokens.shape == wire[0].tokens.shape]
    group = BatchGroup.of(same)
    for x, y in zip(group.split(), same, strict=True):
        for k, v in y.to_tensors().items():
            assert torch.equal(x.to_tensors()[k], v)
