"""Documents stay whole in the mix: a document cut into ``max_chunksize`` pieces is never
interleaved with another one.

What each packing mode guarantees on the packed stream (before the shuffle buffer):

* ``concat`` and ``pad``: each document's tokens form one contiguous run, in order (only
  sequence cuts, i.e. padding and the line specials ``bol``/``eol``, come between two of its
  pieces), with its BOS right before its first token and its EOS right after its last, and
  nowhere else.
* ``best_fit``: by design it places the pieces of a window into bins by size, so a document's
  pieces can be apart; what it receives (the interleave's output) still holds every document's
  pieces contiguous and in order.
* ``concat`` under a ``"tokens"`` mix: the mix may switch datasets inside a document at the
  packer's row ends (issue 29), so the rest of a document goes on at a later row start; that
  contract (order, separators, row ends, exactly once) is ``test_mix_rows.py``'s. Here such
  streams are checked for exactly-once coverage only.

Also after a rescale: each new worker's stream holds every document it delivers as one run (the
run may start inside the document when the checkpoint's streams delivered its beginning).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from harness import check_exactly_once, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.interleave import Interleave
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_arrow_batches

EOS, BOS, BOL, EOL, PADT = 0, 1, 2, 3, 4  # document tokens are >= 10

Key = tuple[str, int, int]  # (dataset, file, doc)


# -- the property, on a stream of pieces ----------------------------------------------------------
class _Walk:
    """Follows a stream of document pieces and content specials (BOS/EOS) and fails at the
    first break of "each document is one contiguous run in order, BOS/EOS at its real ends"."""

    def __init__(
        self,
        lengths: dict[Key, int],
        bos: int | None,
        eos: int | None,
        *,
        continued: bool = False,
    ) -> None:
        self.lengths, self.bos, self.eos, self.continued = lengths, bos, eos, continued
        self.open: tuple[Key, int] | None = None  # the document in progress, its next offset
        self.need_eos = False
        self.after_bos = False
        self.seen: set[Key] = set()
        self.coverage: dict[Key, list[tuple[int, int]]] = {}

    def special(self, token: int) -> None:
        if token == self.eos and self.need_eos:
            self.need_eos = False
        elif token == self.bos and self.open is None and not self.need_eos:
            assert not self.after_bos, "two BOS in a row"
            self.after_bos = True
        else:
            raise AssertionError(f"special {token} placed inside a document (at {self.open})")

    def piece(self, key: Key, start: int, stop: int) -> None:
        assert not self.need_eos, f"a document ended without its EOS before {key}"
        if self.open is not None:
            assert (key, start) == self.open, (
                f"document {self.open[0]} stops at token {self.open[1]} of "
                f"{self.lengths[self.open[0]]} and {key}[{start}:] follows"
            )
        else:
            assert key not in self.seen, f"document {key} comes back after another document"
            if start == 0:
                assert self.after_bos == (self.bos is not None), f"BOS missing before {key}"
            else:
                assert self.continued, f"document {key} starts at token {start}"
                assert not self.after_bos, f"BOS before the middle of {key}"
            self.seen.add(key)
        self.after_bos = False
        self.coverage.setdefault(key, []).append((start, stop))
        if stop == self.lengths[key]:
            self.open, self.need_eos = None, self.eos is not None
        else:
            self.open = (key, stop)

    def finish(self) -> None:
        assert self.open is None, f"the stream ends inside document {self.open}"
        assert not self.need_eos and not self.after_bos, "the stream ends with a special missing"


def check_blocks(blocks: Iterable[DocumentBlock], lengths: dict[Key, int], **kw: Any) -> _Walk:
    """The property on the interleave's output (pieces, with their ``last`` flags)."""
    walk = _Walk(lengths, None, None, **kw)
    for block in blocks:
        for f, d, a, n, last in zip(
            block.file.tolist(),
            block.doc.tolist(),
            block.start.tolist(),
            block.lengths.tolist(),
            block.last.tolist(),
        ):
            key = (block.dataset, f, d)
            assert last == (a + n == lengths[key]), f"{key}[{a}:{a + n}] has last={last}"
            walk.piece(key, a, a + n)
    walk.finish()
    return walk


def check_packed(
    seqs: Iterable[dict[str, np.ndarray]],
    names: list[str],
    lengths: dict[Key, int],
    bos: int | None,
    eos: int | None,
    **kw: Any,
) -> _Walk:
    """The property on packed sequences, read from their provenance: padding and the line
    specials (the sequence cuts) are left out, BOS/EOS must sit at the document ends."""
    walk = _Walk(lengths, bos, eos, **kw)
    for seq in seqs:
        for ds, tok, doc, start, n in np.asarray(seq["provenance"]).tolist():
            if ds == PAD or (ds == LITERAL and tok in (BOL, EOL)):
                continue
            if ds == LITERAL:
                walk.special(tok)
            else:
                walk.piece((names[ds], tok, doc), start, start + n)
    walk.finish()
    return walk


def merged(coverage: dict[Key, list[tuple[int, int]]]) -> dict[Key, list[tuple[int, int]]]:
    """Token ranges with adjacent ones joined (a sequence cut splits a piece in two)."""
    out: dict[Key, list[tuple[int, int]]] = {}
    for key, ranges in coverage.items():
        runs: list[tuple[int, int]] = []
        for a, b in ranges:
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        out[key] = runs
    return out


# -- random configurations --------------------------------------------------------------------------
def write_datasets(root: str, spec: dict[str, tuple[list[int], int]], seed: int):
    """Arrow datasets ``name -> (documents per file, max length)``; their indexes and the
    length of every document."""
    rng = np.random.default_rng(seed)
    indexes: dict[str, DatasetIndex] = {}
    lengths: dict[Key, int] = {}
    for name, (per_file, max_len) in spec.items():
        for f, n in enumerate(per_file):
            docs = [rng.integers(10, 5000, int(rng.integers(1, max_len + 1))) for _ in range(n)]
            write_arrow_batches(f"{root}/{name}/part_{f}.arrow", docs)
            lengths.update({(name, f, d): len(x) for d, x in enumerate(docs)})
        indexes[name] = DatasetIndex.build(f"{root}/{name}")
    return indexes, lengths


@st.composite
def configs(draw) -> dict[str, Any]:
    names = ["web", "code", "books"][: draw(st.integers(1, 3))]
    spec = {
        n: (
            draw(st.lists(st.integers(2, 10), min_size=1, max_size=2)),
            draw(st.sampled_from([3, 30, 120, 400])),
        )
        for n in names
    }
    n_docs = min(sum(per_file) for per_file, _ in spec.values())
    workers = draw(st.integers(1, 2))
    specials = draw(
        st.sampled_from(
            [
                {"eos_token": EOS},
                {"bos_token": BOS, "eos_token": EOS},
                {"bos_token": BOS, "eos_token": EOS, "bol_token": BOL, "eol_token": EOL},
                {"eos_token": EOS, "eol_token": EOL, "pad_token": PADT},
            ]
        )
    )
    mode = draw(st.sampled_from(["tokens", "samples"]))
    return {
        "spec": spec,
        "weights": {n: draw(st.sampled_from([0.3, 1.0, 2.5, 8.0])) for n in names},
        "mode": mode,
        "quantum": draw(st.sampled_from([0, 0, 50])) if mode == "tokens" else 0,
        "max_chunksize": draw(st.sampled_from([1, 2, 5, 16, 64, None])),
        "block_docs": draw(st.sampled_from([1, 2, 3, 8, 64])),
        "shards": draw(st.integers(workers, max(workers, min(n_docs, 6)))),
        "workers": workers,
        "pack": draw(st.sampled_from(["concat", "pad", "best_fit"])),
        "seq_len": draw(st.sampled_from([4, 9, 32, 100])),
        "window": draw(st.sampled_from([1, 5, 40])),
        "shift": draw(st.booleans()),
        "specials": specials,
        "seed": draw(st.integers(0, 3)),
    }


def build_mix(cfg: dict[str, Any], indexes, world: World) -> Interleave:
    return Interleave(
        {
            n: ShardReader(
                index,
                cfg["shards"],
                seed=cfg["seed"],
                world=world,
                epochs=1,
                block_docs=cfg["block_docs"],
                max_chunksize=cfg["max_chunksize"],
            )
            for n, index in indexes.items()
        },
        cfg["weights"],
        mode=cfg["mode"],
        seed=cfg["seed"],
        quantum_tokens=cfg["quantum"],
    )


def build_pack(cfg: dict[str, Any], indexes, world: World) -> Pack:
    return Pack(
        build_mix(cfg, indexes, world),
        cfg["seq_len"],
        mode=cfg["pack"],
        window=cfg["window"],
        shift=cfg.get("shift", False),
        dataset_names=list(indexes),
        **cfg["specials"],
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_document_is_one_run_in_the_mix_and_in_the_packed_stream(cfg) -> None:
    with tempfile.TemporaryDirectory() as root:
        indexes, lengths = write_datasets(root, cfg["spec"], cfg["seed"])
        names = list(indexes)
        bos, eos = cfg["specials"].get("bos_token"), cfg["specials"]["eos_token"]
        coverage: dict[Key, list[tuple[int, int]]] = {}
        for w in range(cfg["workers"]):
            world = World(0, 1, w, cfg["workers"])
            mixed = check_blocks(run(build_mix(cfg, indexes, world)), lengths)
            for key, ranges in mixed.coverage.items():
                coverage.setdefault(key, []).extend(ranges)
            seqs = run(build_pack(cfg, indexes, world))
            if _row_cuts(cfg):
                assert merged(_covered(seqs, names)) == merged(mixed.coverage)
            elif cfg["pack"] != "best_fit":
                packed = check_packed(seqs, names, lengths, bos, eos)
                assert merged(packed.coverage) == merged(mixed.coverage)
        check_exactly_once(coverage, lengths)


def _row_cuts(cfg: dict[str, Any]) -> bool:
    """Whether the mix may switch inside a document at Pack's row ends (concat, tokens)."""
    return cfg["pack"] == "concat" and cfg["mode"] == "tokens"


def _covered(seqs: list[Any], names: list[str]) -> dict[Key, list[tuple[int, int]]]:
    """The document token ranges the sequences' provenance names."""
    out: dict[Key, list[tuple[int, int]]] = {}
    for seq in seqs:
        for ds, f, d, a, n in np.asarray(seq["provenance"]).tolist():
            if ds >= 0 and n:
                out.setdefault((names[ds], f, d), []).append((a, a + n))
    return out


# -- a rescale keeps documents whole in each new stream ------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("contiguity"))
    spec = {"web": ([40, 30], 60), "code": ([25], 250), "books": ([12, 9], 500)}
    return write_datasets(root, spec, 7)


RESCALE_CFG = {
    "weights": {"web": 2.0, "code": 1.0, "books": 1.0},
    "quantum": 0,
    "max_chunksize": 24,
    "block_docs": 5,
    "shards": 12,
    "seq_len": 40,
    "window": 6,
    "specials": {"bos_token": BOS, "eos_token": EOS},
    "seed": 5,
}


@pytest.mark.parametrize("mode", ["tokens", "samples"])
@pytest.mark.parametrize("pack", ["concat", "pad", "best_fit"])
@pytest.mark.parametrize(("old", "new", "steps"), [(2, 3, 9), (3, 1, 14), (4, 2, 5)])
def test_a_rescale_keeps_documents_whole_in_each_new_stream(
    corpus, mode, pack, old, new, steps
) -> None:
    from torchdata_ext.checkpoint.rescale import rescale_worker_states

    indexes, lengths = corpus
    names = list(indexes)
    cfg = {**RESCALE_CFG, "mode": mode, "pack": pack}
    make = lambda world: build_pack(cfg, indexes, world)  # noqa: E731
    coverage: dict[Key, list[tuple[int, int]]] = {}
    graphs = {}
    for g in range(old):
        node = make(World(0, 1, g, old))
        node.reset()
        before = run(node, steps + 3 * g)
        for seq in before:
            for ds, f, d, a, n in np.asarray(seq["provenance"]).tolist():
                if ds >= 0:
                    coverage.setdefault((names[ds], f, d), []).append((a, a + n))
        graphs[g] = node.state_dict()
    for g in range(new):
        world = World(0, 1, g, new)
        node = make(world)
        node.reset(rescale_worker_states(graphs, (1, old), world, make))
        seqs = run(node)
        if pack == "best_fit" or _row_cuts(cfg):  # pieces apart by design: count them only
            for key, ranges in _covered(seqs, names).items():
                coverage.setdefault(key, []).extend(ranges)
            continue
        walk = check_packed(seqs, names, lengths, BOS, EOS, continued=True)
        for key, ranges in walk.coverage.items():
            coverage.setdefault(key, []).extend(ranges)
    check_exactly_once(coverage, lengths)
