"""Weight changes under ``torch.distributed`` (issue 31 item 2): real gloo ranks.

Two gloo ranks x 2 workers run one epoch with a change of mix made (a) by the trainer's
``set_weights`` on every rank at the same step and (b) by ``weight_schedule``, saving a folder
and a DCP checkpoint after the first change. In the same ranks, a loader restored from each
checkpoint at 2 x 2 (the calls after the save made again) must deliver the rest of the
uninterrupted run; in this process, restores at 1 x 3 (folder) and 1 x 2 (DCP) must deliver
every document once, rows an uninterrupted run could make (the rescale oracle,
:func:`rows.check_rows`), under the changed weights. Ranks that ask for different changes are
refused at the call (every rank, naming them); a checkpoint whose ranks recorded different
changes is refused at restore.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # at the top: imported late, gloo ranks abort at exit
from _gloo import init_gloo, rendezvous, run_ranks
from harness import check_exactly_once, document_lengths, write_random_arrow_datasets
from rows import check_rows

from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD

pytestmark = pytest.mark.multiprocess

NAMES = ["web", "code"]
CALLS = {3: ({"web": 1.0, "code": 4.0}, 6), 24: ({"web": 4.0, "code": 1.0}, 26)}
"""At step k (after taking batch k), on every rank: the weights and the step they apply from."""
SCHEDULE = {at: weights for weights, at in CALLS.values()}
SAVE_AT = 8  # after the first change, before the second
FORK: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "fork"}
"""The ranks' loaders: a process started by ``mp.spawn`` starts its own children by spawn too
(torchrun's ranks fork them), which would re-import torch in every worker at every restart."""


def _config(root: str, schedule: bool = False) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="1,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=12, batch_size=2, seed=3, shuffle_buffer=1, block_docs=4,
        epochs=1, output_keys="input_ids,dataset_ids,provenance",
        weight_schedule=SCHEDULE if schedule else None,
    )  # fmt: skip


def _run(loader: TokenLoader, start: int, calls: bool, save: Any = None) -> list[dict]:
    """Batches ``start + 1`` to the end of the epoch as lists, making the ``CALLS`` (with
    ``calls``) after the steps they are made at; ``save(loader)`` after step ``SAVE_AT``."""
    out = []
    for step, batch in enumerate(loader, start + 1):
        out.append({k: v.tolist() for k, v in batch.items()})
        if calls and step in CALLS:
            weights, at = CALLS[step]
            assert loader.set_weights(weights, from_step=at) == at
        if save is not None and step == SAVE_AT:
            save(loader)
    loader.close()
    return out


def _rank_main(rank: int, init: str, root: str, tmp: str) -> None:
    """One of 2 gloo ranks: per mechanism, the uninterrupted 2 x 2 run saving at ``SAVE_AT``,
    then the 2 x 2 restores from the folder and the DCP checkpoint; then the refused calls."""
    warnings.simplefilter("ignore")
    init_gloo(init, rank, 2)
    try:
        got: dict[str, Any] = {}
        for mech in ("calls", "schedule"):
            build = functools.partial(build_pipeline, _config(root, mech == "schedule"))
            folder, in_dcp = f"{tmp}/{mech}/folder", f"{tmp}/{mech}/dcp"

            def save(loader: TokenLoader, folder: str = folder, in_dcp: str = in_dcp) -> None:
                save_checkpoint(loader, folder)
                dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=in_dcp)

            got[mech] = _run(TokenLoader(build, **FORK), 0, mech == "calls", save)
            again = TokenLoader(build, **FORK)
            load_checkpoint(again, folder)
            got[mech + "_folder"] = _run(again, SAVE_AT, mech == "calls")
            again = TokenLoader(build, **FORK)
            dcp.load({"data": DCPLoaderState(again)}, checkpoint_id=in_dcp)
            got[mech + "_dcp"] = _run(again, SAVE_AT, mech == "calls")
        refused = []
        loader = TokenLoader(functools.partial(build_pipeline, _config(root)))
        next(iter(loader))
        for weights, at in (
            ({"web": 1.0, "code": 2.0 + rank}, 4),  # other weights on rank 1
            ({"web": 1.0, "code": 2.0}, 4 + rank),  # another step on rank 1
            ({"web": 1.0, "code": 2.0}, None if rank else 2),  # the next step on both
        ):
            try:
                loader.set_weights(weights, from_step=at)
            except ValueError as e:
                refused.append(str(e))
        refused.append(json.dumps(loader.state_dict()["weight_changes"]))
        loader.close()
        got["refused"] = refused
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[str, Path, list[dict]]:
    """The data, the checkpoints' folder and what each of the 2 ranks delivered and was told."""

    root = str(tmp_path_factory.mktemp("weights_ranks_data"))
    write_random_arrow_datasets(root, (("web", 120, 25), ("code", 120, 25)), seed=11)
    tmp = tmp_path_factory.mktemp("weights_ranks")
    init = rendezvous(tmp)
    run_ranks(_rank_main, (init, root, str(tmp)), 2)
    return root, tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _rows(batches: list[dict]) -> list[dict]:
    """Each delivered row as the oracle reads it: its provenance (without the collate's
    empty padding entries) and the dataset names."""
    out = []
    for batch in batches:
        for prov in batch["provenance"]:
            table = np.asarray(prov, dtype=np.int64).reshape(-1, 5)
            out.append({"provenance": table[table[:, 4] > 0], "_names": NAMES})
    return out


def _check_every_document_once(streams: list[list[dict]], cfg: PipelineConfig) -> None:
    rows = [_rows(s) for s in streams]
    check_rows(rows, document_lengths(cfg), cfg)
    coverage: dict = {}
    for stream in rows:
        for row in stream:
            for ds, f, d, start, n in row["provenance"].tolist():
                if ds not in (LITERAL, PAD):
                    coverage.setdefault((NAMES[ds], f, d), []).append((start, start + n))
    check_exactly_once(coverage, document_lengths(cfg))


def _code_share(batches: list[dict]) -> float:
    ids = np.concatenate([np.asarray(b["dataset_ids"]).ravel() for b in batches])
    return float((ids == 1).sum() / (ids >= 0).sum())


def test_the_2x2_restores_give_the_uninterrupted_batches(ranks) -> None:
    """Per rank: a schedule gives the batches of the same calls, and a restore at 2 x 2 from
    the folder or the DCP checkpoint (the later call made again) gives the rest of the run."""
    _, _, got = ranks
    for rank, g in enumerate(got):
        ids = {k: [b["input_ids"] for b in v] for k, v in g.items() if k != "refused"}
        assert len(ids["calls"]) > 40, rank  # the second change is reached
        assert ids["schedule"] == ids["calls"], rank
        for mech in ("calls", "schedule"):
            assert ids[mech + "_folder"] == ids[mech][SAVE_AT:], (rank, mech)
            assert ids[mech + "_dcp"] == ids[mech][SAVE_AT:], (rank, mech)
        # the mix follows the changes on each rank: 1:1, 1:4 from step 6, 4:1 from step 26
        full = g["calls"]
        assert 0.3 < _code_share(full[0:5]) < 0.7, rank
        assert 0.65 < _code_share(full[6:25]) < 0.95, rank
        assert _code_share(full[29:40]) < 0.45, rank
    _check_every_document_once([g["calls"] for g in got], _config(ranks[0]))


@pytest.mark.parametrize("mech", ["calls", "schedule"])
def test_a_rescale_to_1x3_and_1x2_delivers_every_document_once_under_the_new_weights(
    ranks, mech
) -> None:
    """From the 2 x 2 checkpoint at step 8: at 1 x 3 (folder) and 1 x 2 (DCP) every document
    once over the union, rows of an uninterrupted run, the changed weights in force (1:4)
    until the second change at step 26 (made by the call again, or by the schedule)."""
    root, tmp, got = ranks
    cfg = _config(root, mech == "schedule")
    head = [g[mech][:SAVE_AT] for g in got]
    for workers, how in ((3, "folder"), (2, "dcp")):
        loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
        if how == "folder":
            load_checkpoint(loader, str(tmp / mech / "folder"))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
                state = DCPLoaderState(loader, checkpoint_id=str(tmp / mech / "dcp"))
                dcp.load({"data": state}, checkpoint_id=str(tmp / mech / "dcp"))
        in_force = loader.built_config()
        assert in_force is not None and in_force.weights == [1.0, 4.0], how
        # the trainer's calls are recorded as such; a schedule's changes are the schedule's
        assert [p[:2] for p in loader.weight_points()] == (
            [[at, weights] for weights, at in CALLS.values()]
            if mech == "schedule" else [[6, {"web": 1.0, "code": 4.0}]]
        )  # fmt: skip
        assert loader.state_dict()["weight_changes"] == (
            [] if mech == "schedule" else [[6, {"web": 1.0, "code": 4.0}]]
        )
        rest = _run(loader, SAVE_AT, mech == "calls")
        assert 0.65 < _code_share(rest[: 25 - SAVE_AT]) < 0.95, how  # steps 9..25 at 1:4
        # 4:1 from step 26 (after the rows of the blocks already drawn: block_docs=4)
        assert _code_share(rest[30 - SAVE_AT : 40 - SAVE_AT]) < 0.45, how
        _check_every_document_once([*head, rest], cfg)


def test_ranks_that_ask_for_different_changes_are_refused_at_the_call(ranks) -> None:
    """Every rank raises the same message naming both ranks' calls; the agreeing call lands."""
    _, _, got = ranks
    other_weights, other_step, recorded = [], [], []
    for g in got:
        assert len(g["refused"]) == 3, g["refused"]
        other_weights.append(g["refused"][0])
        other_step.append(g["refused"][1])
        recorded.append(json.loads(g["refused"][2]))
    assert other_weights[0] == other_weights[1] and other_step[0] == other_step[1]
    assert other_weights[0] == (
        "set_weights: the ranks asked for different changes (rank 0: from_step=4 weights="
        "{'web': 1.0, 'code': 2.0}; rank 1: from_step=4 weights={'web': 1.0, 'code': 3.0}); "
        "every rank must make the same call at the same step (e.g. weights computed from an "
        "all-reduced loss, or on rank 0 and broadcast); no rank changed its mix"
    )
    assert (
        "(rank 0: from_step=4 weights={'web': 1.0, 'code': 2.0}; rank 1: from_step=5 "
        in (other_step[0])
    )
    # from_step=None is the next step (2) on rank 1, as rank 0's explicit 2: the same call
    assert recorded == [[[2, {"web": 1.0, "code": 2.0}]]] * 2


def test_a_checkpoint_whose_ranks_recorded_other_changes_is_refused(tmp_path) -> None:
    """Two ranks' loaders made in this process (no process group, so no check at the call)
    record different changes in one checkpoint: a restore at the same topology and a rescale
    both refuse it, naming the rank, both ranks' changes and what to do."""
    root = str(tmp_path / "data")
    write_random_arrow_datasets(root, (("web", 30, 20), ("code", 30, 20)), seed=5)
    build = functools.partial(build_pipeline, _config(root))
    for rank in (1, 0):  # rank 0 writes the manifest, last
        loader = TokenLoader(build, rank=rank, world_size=2)
        it = iter(loader)
        next(it)
        loader.set_weights({"web": 1.0, "code": 2.0}, from_step=5 + rank)
        next(it)
        save_checkpoint(loader, str(tmp_path / "c"))
        loader.close()
    message = (
        r"rank 1 recorded the weight changes \[\[6, \{'code': 2\.0, 'web': 1\.0\}\]\] but rank 0 "
        r"\[\[5, \{'code': 2\.0, 'web': 1\.0\}\]\]; every rank must make the same set_weights "
        r"calls \(same weights, same from_step\); restore from a checkpoint saved before they "
        r"differed"
    )
    with pytest.raises(ValueError, match=message):
        load_checkpoint(TokenLoader(build, rank=1, world_size=2), str(tmp_path / "c"))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(TokenLoader(build, num_workers=3), str(tmp_path / "c"))
    # rank 0's own entries agree with the manifest: it restores
    load_checkpoint(TokenLoader(build, rank=0, world_size=2), str(tmp_path / "c"))
