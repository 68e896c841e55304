"""``PipelineConfig.weight_schedule`` through restores at several steps and a rescale (issue 31
item 1): the rest of the stream after a restore at any step is the uninterrupted run's, and a
checkpoint taken before a scheduled step, restored at another number of workers, delivers every
document once and still switches the mix at that step.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    dataset_share,
    document_lengths,
    take_batches,
    two_dataset_config,
)

from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD

pytestmark = pytest.mark.multiprocess

SCHEDULE = {6: "1,3", 12: {"web": 3, "code": 1}}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    return two_dataset_config(
        str(tmp_path_factory.mktemp("weight_schedule")), weight_schedule=SCHEDULE
    )


def test_the_schedule_is_parsed_to_sorted_steps(cfg) -> None:
    assert cfg.weight_schedule == [[6, {"web": 1.0, "code": 3.0}], [12, {"web": 3.0, "code": 1.0}]]


def test_restore_at_several_steps_gives_the_rest_of_the_stream(cfg) -> None:
    build = functools.partial(build_pipeline, cfg)
    states: dict = {}
    full = take_batches(TokenLoader(build, num_workers=2), 18, states)
    for k in (3, 5, 6, 11, 12, 13):
        loader = TokenLoader(build, num_workers=2)
        loader.load_state_dict(states[k])
        rest = take_batches(loader, 18, start=k)
        assert len(rest) == 18 - k
        for i, (a, b) in enumerate(zip(rest, full[k:]), k + 1):
            assert np.array_equal(a["input_ids"].numpy(), b["input_ids"].numpy()), (k, i)
    # the mix follows the schedule (1:1, then 1:3 from step 6, then 3:1 from step 12)
    assert 0.35 < dataset_share(full[0:5]) < 0.65
    assert 0.6 < dataset_share(full[6:11]) < 0.9
    assert 0.1 < dataset_share(full[13:18]) < 0.4


def test_a_rescale_before_a_scheduled_step_delivers_every_document_once(cfg, tmp_path) -> None:
    """Saved at step 4 on 2 workers (before the change at 6), restored on 3 workers."""
    build = functools.partial(build_pipeline, cfg)
    states: dict = {}
    first = take_batches(TokenLoader(build, num_workers=2), 4, states)
    again = TokenLoader(build, num_workers=2)
    again.load_state_dict(states[4])
    save_checkpoint(again, str(tmp_path / "ckpt"))
    rescaled = TokenLoader(build, num_workers=3)
    load_checkpoint(rescaled, str(tmp_path / "ckpt"))
    rest = take_batches(rescaled, None, start=4)
    assert 0.6 < dataset_share(rest[7 - 5 : 11 - 4]) < 0.9  # steps 7..11: 1:3 on 3 workers
    coverage: dict = {}
    names = list(cfg.dataset_weights)
    for batch in first + rest:
        for ds, f, d, start, n in batch["provenance"].reshape(-1, 5).tolist():
            if n and ds not in (LITERAL, PAD):
                coverage.setdefault((names[ds], f, d), []).append((start, start + n))
    check_exactly_once(coverage, document_lengths(cfg))
