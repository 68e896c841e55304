"""Concat rows are full until the very end (issue 46, item 4).

With the mix cutting documents at row ends, each source other than the one running holds a
document cut at a row end. A dataset that runs out at a worker mid-row, and the rests of
documents a rescale hands back, used to start rows of their own, the row before them padded
(about 1% of the tokens of a small 3-dataset epoch). When every document end gets its own EOS
such a rest fills the row instead: a padded row is only the last one of a worker's finite run.
Without an EOS, or with BOS and EOS one token (a rest placed after another document would be
glued to it), rests still start rows: that is measured and bounded here, not promised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import document_lengths, write_random_arrow_datasets
from rows import check_rows, simulate

from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import PAD


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("no_padding")
    # short web documents, long code and books ones (most longer than a row)
    datasets = (("web", 120, 40), ("code", 60, 200), ("books", 30, 300))
    write_random_arrow_datasets(str(root), datasets, seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code,books", weights=[3, 1, 1], seq_length=64,
        logical_shards=8, batch_size=1, shuffle_buffer=1, block_docs=8, seed=1, epochs=1,
    )  # fmt: skip


def _padded_rows(streams: list[list[dict]]) -> list[tuple[int, int, int]]:
    """``(stream, row, padding tokens)`` of every row with padding."""
    out = []
    for s, stream in enumerate(streams):
        for r, item in enumerate(stream):
            prov = np.asarray(item["provenance"])
            pad = int(prov[prov[:, 0] == PAD, 4].sum())
            if pad:
                out.append((s, r, pad))
    return out


@pytest.mark.parametrize("buffer", [1, 16])
@pytest.mark.parametrize("specials", [(None, 0), (1, 0)], ids=["eos", "bos+eos"])
@pytest.mark.parametrize("tops", [[(1, 2)], [(2, 2), (1, 3)], [(1, 3), (3, 1), (2, 1)]], ids=str)
def test_only_the_last_row_of_a_worker_is_padded(base, buffer, specials, tops) -> None:
    """Through datasets running out at each worker and through one or two rescales, to the end
    of the finite epoch: every token once, rows an uninterrupted run could make, and padding
    in no row but a worker's last (the epoch's remainder; the shuffle buffer delivers it among
    its last ``buffer`` rows)."""
    cfg = dataclasses.replace(
        base, shuffle_buffer=buffer, bos_token=specials[0], eos_token=specials[1]
    )
    streams = simulate(cfg, tops, lambda phase, g: 5 + (3 * g + phase) % 4)
    check_rows(streams, document_lengths(cfg), cfg)
    last = len(streams) - tops[-1][0] * tops[-1][1]  # the streams of the final topology
    padded = _padded_rows(streams)
    # the packer's last row of a worker, which the shuffle buffer may deliver among its last
    mid = [(s, r) for s, r, _ in padded if s < last or r < len(streams[s]) - buffer]
    assert mid == [], f"padded mid-stream: {mid} (all padded rows: {padded})"
    assert len({s for s, *_ in padded}) == len(padded), f"two padded rows in a stream: {padded}"
    assert sum(len(s) for s in streams) > 300  # the epoch ran through (about 370 rows)


def test_without_an_eos_a_rest_starts_its_row(base) -> None:
    """No EOS: a rest placed after another document would be glued to it, so it starts a
    row (the row before padded): the rows stay rows of an uninterrupted run."""
    cfg = dataclasses.replace(base, bos_token=1, eos_token=None)
    streams = simulate(cfg, [(2, 2), (1, 3)], lambda phase, g: 5)
    check_rows(streams, document_lengths(cfg), cfg)
    padded = _padded_rows(streams)
    tokens = sum(len(s) for s in streams) * (cfg.seq_length + 1)
    assert 0 < sum(p for *_, p in padded) < 0.05 * tokens
