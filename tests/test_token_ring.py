"""Tokens through shared-memory ring slots (``torchdata_ext.loader.ring``): a worker writes a
message's tokens into a slot the training process has released, or sends them in the message
when none is free; either way the training process delivers exactly the batches of the
in-process pipeline, and a slot is never written while its tokens are still to be read."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from torchdata_ext import World
from torchdata_ext.batch import BatchGroup, PackedBatch
from torchdata_ext.loader.ring import TokenRing
from torchdata_ext.loader.token_loader import (
    MAX_BATCHES_PER_MESSAGE,
    MESSAGE_TOKENS,
    TokenLoader,
    _PipelineIterator,
    _split,
    batches_for_message,
)
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.state.delta import apply
from torchdata_ext.testing import write_arrow_batches

KEYS = ["input_ids", "labels", "position_ids", "document_ids", "loss_mask"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("ring")
    rng = np.random.default_rng(11)
    for name in ("web", "code"):
        docs = [rng.integers(5, 900, int(rng.integers(1, 70)), dtype=np.uint32) for _ in range(90)]
        write_arrow_batches(str(root / name / "a.arrow"), docs)
    return str(root)


def _cfg(data_path: str, batch_size: int = 3) -> PipelineConfig:
    return PipelineConfig(
        data_path=data_path, datasets="web,code", weights="2,1", seq_length=20, logical_shards=8,
        batch_size=batch_size, shuffle_buffer=6, block_docs=4, seed=5, output_keys=KEYS,
    )  # fmt: skip


def _build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world)


def _key(batch: dict[str, torch.Tensor] | PackedBatch) -> list[list[list[int]]]:
    if isinstance(batch, PackedBatch):  # sent in the message: made whole when delivered
        batch = batch.to_tensors()
    return [batch[k].int().tolist() for k in KEYS]


def test_slots_are_claimed_in_order_and_only_once_released() -> None:
    ring = TokenRing((2, 3, 5), torch.int64, slots=2)
    assert [ring.claim(), ring.claim(), ring.claim()] == [0, 1, None]
    ring.release()
    assert [ring.claim(), ring.claim()] == [0, None]
    ring.release()
    ring.release()
    assert [ring.claim(), ring.claim(), ring.claim()] == [1, 0, None]
    assert ring.fits((2, 3, 5), torch.int64) and ring.fits((1, 3, 5), torch.int64)
    assert not ring.fits((3, 3, 5), torch.int64)  # more batches than a slot holds
    assert not ring.fits((2, 3, 6), torch.int64) and not ring.fits((2, 3, 5), torch.int32)
    with pytest.raises(ValueError, match="slots"):
        TokenRing((1,), torch.int64, slots=0)


def test_slot_and_in_message_tokens_give_the_in_process_batches(data_path) -> None:
    """One worker's messages, sent as the dataloader's queue sends them (ForkingPickler), with
    a one-slot ring: a message finds the slot taken whenever the previous one is unread and
    sends its tokens itself. The batches and the states after them are the in-process ones,
    whichever way each message went."""
    cfg = _cfg(data_path)
    world = World(0, 1, 0, 1)
    # produce two messages before reading them (the second finds the slot taken), then one
    # at a time (the slot is free again each time)
    pattern = [2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 2, 2]
    ref_node = build_pipeline(cfg, world)
    ref = [_key(next(ref_node)) for _ in range(2 * sum(pattern))]

    it = _PipelineIterator(
        functools.partial(_build, cfg), world, None, group=2, delta=True, ring_slots=1
    )
    ring = None
    state = None
    got, ways = [], []
    for ahead in pattern:
        wire = [ForkingPickler.dumps(next(it)) for _ in range(ahead)]
        for raw in wire:
            msg = pickle.loads(raw)
            ring = msg.ring or ring
            ways.append("slot" if msg.items.slot is not None else "message")
            assert isinstance(msg.items, BatchGroup)
            for batch, delta in zip(_split(msg.items, ring, False), msg.states, strict=True):
                state = apply(state, delta)
                got.append((_key(batch), state))
    assert "slot" in ways and "message" in ways, ways
    assert len(got) == len(ref) - 1  # the first message holds one batch, the others two
    assert [batch for batch, _ in got] == ref[: len(got)]
    for i, (_, st) in enumerate(got[:-1]):  # each state restores the rest of the stream
        node = build_pipeline(cfg, world)
        node.reset(pickle.loads(pickle.dumps(st)))
        assert _key(next(node)) == ref[i + 1], i


@pytest.mark.parametrize("batch_size", [3, 4, 7])
@pytest.mark.parametrize("most_ahead", [1, 2])
def test_batches_written_straight_into_their_slot_end_exactly(
    data_path, batch_size, most_ahead
) -> None:
    """Collate writes each batch's tokens into the ring slot its message takes (no copy);
    at the end of a finite epoch a short last batch (3: the last pair holds it, 4: it travels
    alone) or no batch at all (7: the epoch ends on a message's end) gives its slot back,
    tokens copied out first. Messages read one at a time, or alternately one and two (the
    slot taken): the whole epoch is the in-process one and every claimed slot is released."""
    cfg = dataclasses.replace(_cfg(data_path, batch_size), epochs=1)
    world = World(0, 1, 0, 1)
    ref = [_key(b) for b in build_pipeline(cfg, world)]
    it = _PipelineIterator(
        functools.partial(_build, cfg), world, None, group=2, delta=True, ring_slots=1
    )
    wire, placed = it._wire, []

    def spy(out=None):  # whether Collate's batch is the slot's row it was given
        batch = wire(out=out)
        placed.append(out is not None and batch.tokens.data_ptr() == out.data_ptr())
        return batch

    it._wire = spy
    ring, got, ahead = None, [], 0
    while True:
        msgs = []
        for _ in range(1 + ahead % most_ahead):  # messages made before they are read
            try:
                msgs.append(pickle.loads(ForkingPickler.dumps(next(it))))
            except StopIteration:
                break
        ahead += 1
        if not msgs:
            break
        for msg in msgs:
            ring = msg.ring or ring
            if isinstance(msg.items, BatchGroup):
                batches = _split(msg.items, ring, False)
            else:  # a slot given back: its batches own their tokens, not a view of the ring
                batches = list(msg.items)
                for b in batches:
                    assert b.tokens.untyped_storage().nbytes() == b.tokens.nbytes
            got.extend(_key(b) for b in batches)
    assert got == ref
    assert sum(placed) > len(ref) // 3, placed  # most batches went straight into a slot
    assert it._ring is not None and it._ring.claimed == int(it._ring.released[0])


def test_an_error_in_the_graph_gives_the_claimed_slot_back(data_path) -> None:
    """A batch that fails mid-message leaves no slot claimed: the next messages use the ring
    as before and deliver the rest of the stream."""
    cfg = _cfg(data_path)
    world = World(0, 1, 0, 1)
    ref_node = build_pipeline(cfg, world)
    ref = [_key(next(ref_node)) for _ in range(13)]
    it = _PipelineIterator(
        functools.partial(_build, cfg), world, None, group=2, delta=True, ring_slots=1
    )
    wire, calls = it._wire, [0]

    def failing(out=None):
        calls[0] += 1
        if calls[0] == 7:  # the second batch of the fourth message
            raise OSError("disk gone")
        return wire(out=out)

    it._wire = failing
    ring, got = None, []
    for _ in range(7):
        try:
            msg = pickle.loads(ForkingPickler.dumps(next(it)))
        except OSError:
            assert it._ring.claimed == int(it._ring.released[0])
            continue
        ring = msg.ring or ring
        assert msg.items.slot is not None or ring is None
        got.extend(_key(b) for b in _split(msg.items, ring, False))
    # batch 5 was made before the error, in the message that was not sent
    assert got == ref[:5] + ref[6 : len(got) + 1]


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        ((8, 4097), 16),  # the issue-33 benchmark's batch: 32,776 tokens
        ((8, 4096), 16),  # exactly MESSAGE_TOKENS in 16
        ((8, 4098), 16),  # a little over 1/16 of it: rounded up, never fewer tokens
        ((64, 8193), 1),  # a batch above MESSAGE_TOKENS travels alone
        ((1, 129), MAX_BATCHES_PER_MESSAGE),  # tiny batches: capped
    ],
)
def test_a_message_holds_batches_for_its_tokens(shape, want) -> None:
    n = shape[0] * shape[1]
    assert want == min(MAX_BATCHES_PER_MESSAGE, max(1, -(-MESSAGE_TOKENS // n)))
    packed = PackedBatch(
        torch.zeros(shape, dtype=torch.int32), *(np.zeros(1, np.int32),) * 4, shape[1] - 1,
        True, ("input_ids",),
    )  # fmt: skip
    assert batches_for_message(packed) == want
    assert batches_for_message({"input_ids": np.zeros(shape, np.int64)}) == want
    assert batches_for_message({"text": ["a", "b"]}) == 8  # nothing to count: the old default


def test_messages_sized_by_tokens_carry_the_stream_of_one_batch_messages(data_path) -> None:
    """``group=None`` (``TokenLoader``'s default): the first message holds one batch, every
    later one ``batches_for_message`` of it (the ring made for that many), and the batches and
    states are those of one batch per message."""
    cfg = _cfg(data_path)
    world = World(0, 1, 0, 1)

    def run(group: int | None) -> tuple[list[int], list[object], list[object]]:
        it = _PipelineIterator(
            functools.partial(_build, cfg), world, None, group=group, delta=True, ring_slots=4
        )
        ring, state, sizes, batches, states = None, None, [], [], []
        while len(batches) < 200:
            msg = pickle.loads(ForkingPickler.dumps(next(it)))
            ring = msg.ring or ring
            sizes.append(len(msg.states))
            for batch, delta in zip(_split(msg.items, ring, False), msg.states, strict=True):
                state = apply(state, delta)
                batches.append(_key(batch))
                states.append(pickle.dumps(state))
        return sizes, batches[:200], states[:200]

    sizes, batches, states = run(None)
    want = batches_for_message(PackedBatch(torch.zeros(3, 21), *(np.zeros(1),) * 4, 20, True, ()))
    assert want == MAX_BATCHES_PER_MESSAGE  # 3 x 21 tokens: the cap
    assert sizes[0] == 1 and set(sizes[1:]) == {want}, sizes
    one_sizes, one_batches, one_states = run(1)
    assert set(one_sizes) == {1}
    assert batches == one_batches
    for i in (0, 1, want, want + 1, 2 * want + 3, 150):  # inside and across messages
        for st in (states[i], one_states[i]):  # each state restores the rest of the stream
            node = build_pipeline(cfg, world)
            node.reset(pickle.loads(st))
            assert [_key(next(node)) for _ in range(3)] == batches[i + 1 : i + 4], i


def test_batches_per_message_is_refused_by_name_unless_a_count_or_none(data_path) -> None:
    build = functools.partial(_build, _cfg(data_path))
    for bad in (0, -2, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"batches_per_message=.* or None"):
            TokenLoader(build, batches_per_message=bad)  # type: ignore[arg-type]
    assert TokenLoader(build).batches_per_message is None


def test_batches_copied_out_of_a_slot_do_not_change_when_it_is_written_again(data_path) -> None:
    """A one-row batch's ``input_ids`` would be a contiguous view of the slot: it is copied,
    so the batches a training loop keeps stay as they were delivered. (The first message
    carries its tokens itself: the ring is made after the first batch is out.)"""
    cfg = _cfg(data_path, batch_size=1)
    world = World(0, 1, 0, 1)
    it = _PipelineIterator(
        functools.partial(_build, cfg), world, None, group=1, delta=True, ring_slots=1
    )
    ring = None
    kept = []
    for i in range(6):
        msg = pickle.loads(ForkingPickler.dumps(next(it)))
        ring = msg.ring or ring
        assert msg.items.slot == (None if i == 0 else 0), i
        kept.extend(_split(msg.items, ring, False))
    ref_node = build_pipeline(cfg, world)
    assert [_key(b) for b in kept] == [_key(next(ref_node)) for _ in range(6)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("batch_size", [1, 3])
def test_two_workers_deliver_the_same_stream_with_and_without_shared_tokens(
    data_path, batch_size
) -> None:
    """Through real worker processes: the ring (default) and tokens in the messages give the
    same batches, and a restore at a step continues with the rest of that stream."""
    build = functools.partial(_build, _cfg(data_path, batch_size))
    runs = {}
    for shared in (True, False):
        loader = TokenLoader(build, num_workers=2, shared_tokens=shared, batches_per_message=2)
        it = iter(loader)
        runs[shared] = [_key(next(it)) for _ in range(30)]
        if shared:
            for _ in range(7):
                next(it)
            state = pickle.loads(pickle.dumps(loader.state_dict()))
            after = [_key(next(it)) for _ in range(12)]
        del it, loader
    assert runs[True] == runs[False]
    again = TokenLoader(build, num_workers=2, batches_per_message=2)
    again.load_state_dict(state)
    it = iter(again)
    assert [_key(next(it)) for _ in range(12)] == after


@pytest.mark.parametrize("short", ["free space", "allocation fails"])
def test_short_shared_memory_sends_the_tokens_in_the_messages(
    data_path, monkeypatch, short
) -> None:
    """A container's small /dev/shm (Docker's 64 MB) must not kill a worker: with too little
    free, or when the allocation fails, no ring is made and every message carries its tokens;
    the batches are the in-process ones."""
    import torchdata_ext.loader.ring as ring_module

    if short == "free space":
        monkeypatch.setattr(ring_module, "_free_bytes", lambda path: 16 << 20)  # 16 MB free
    else:

        def no_space(self):
            raise RuntimeError("unable to write to file </torch_1_2>: No space left on device")

        monkeypatch.setattr(torch.Tensor, "share_memory_", no_space)
    cfg = _cfg(data_path)
    world = World(0, 1, 0, 1)
    it = _PipelineIterator(
        functools.partial(_build, cfg), world, None, group=2, delta=True, ring_slots=4
    )
    got = []
    for _ in range(8):
        msg = pickle.loads(ForkingPickler.dumps(next(it)))
        assert msg.ring is None and msg.items.slot is None
        got.extend(_key(b) for b in _split(msg.items, None, False))
    ref_node = build_pipeline(cfg, world)
    assert got == [_key(next(ref_node)) for _ in range(len(got))]


def test_a_ring_is_made_when_shared_memory_has_room(monkeypatch) -> None:
    import torchdata_ext.loader.ring as ring_module

    shape = (4, 8, 4097)  # 1 MB of int64 per slot, 4 MB for 4 slots
    monkeypatch.setattr(ring_module, "_free_bytes", lambda path: 40 << 20)
    assert TokenRing.make(shape, torch.int64, 4) is None  # 8 x 4 MB + 32 MB > 40 MB
    monkeypatch.setattr(ring_module, "_free_bytes", lambda path: 80 << 20)
    ring = TokenRing.make(shape, torch.int64, 4)
    assert ring is not None and ring.slots == 4 and ring.data.is_shared()
    monkeypatch.setattr(ring_module, "_free_bytes", lambda path: None)  # no /dev/shm to ask
    assert TokenRing.make(shape, torch.int64, 4) is not None


def test_a_group_with_its_tokens_in_a_slot_says_so_when_split_alone() -> None:
    group = BatchGroup(None, [], [], [], [], [], 4, True, ("input_ids",), slot=3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="ring slot 3"):
        group.split()


@pytest.mark.multiprocess
def test_close_stops_the_worker_processes_and_keeps_the_state(data_path) -> None:
    """``close()`` ends the workers at once (they would otherwise go on tokenizing and
    reading until garbage-collected, taking the cores from what runs next); the state is the
    one after the last batch delivered, and it restores."""
    import multiprocessing

    build = functools.partial(_build, _cfg(data_path))
    before = set(multiprocessing.active_children())
    loader = TokenLoader(build, num_workers=2)
    it = iter(loader)
    seen = [_key(next(it)) for _ in range(5)]
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2, multiprocessing.active_children()
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    assert not any(p.is_alive() for p in workers)
    # as saved (the shuffle buffer's provenance is built when read)
    assert pickle.dumps(pickle.loads(pickle.dumps(loader.state_dict()))) == pickle.dumps(state)
    ref = TokenLoader(build, num_workers=2)
    ref_it = iter(ref)
    want = [_key(next(ref_it)) for _ in range(9)]
    assert want[:5] == seen
    again = TokenLoader(build, num_workers=2)
    again.load_state_dict(state)
    again_it = iter(again)
    assert [_key(next(again_it)) for _ in range(4)] == want[5:]
    again.close()
    ref.close()
