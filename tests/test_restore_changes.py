"""Exact or refused by name: random setting changes at a restore (issue 28).

A real pipeline is saved with :func:`~torchdata_ext.checkpoint.folder.save_checkpoint` at
2 ranks x 1 worker (two in-process loaders, rank 1 then rank 0), and restored with
:func:`~torchdata_ext.checkpoint.folder.load_checkpoint` at 1 rank x 2 workers under a config
with one or two fields of :data:`~torchdata_ext.pipeline.config.RESTORE_CONTRACT` changed.
Either the restore raises a ``ValueError`` naming a changed field (and, for a recorded setting,
the checkpoint's and this pipeline's values), or the rows delivered before the checkpoint and
after it (each restored worker's graph run to the end of the epoch, as its worker process
would run it) are rows of an uninterrupted run: every document token exactly once, with its
BOS/EOS separators (:mod:`torchdata_ext.audit.row_check`). A may-change field must restore.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from typing import Any

import numpy as np
import pytest
from harness import (
    document_lengths,
    text_config,
    write_random_arrow_datasets,
    write_random_text_datasets,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from torchdata_ext import World
from torchdata_ext.audit.row_check import RowRules, row_problems
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import RESTORE_CONTRACT, PipelineConfig

Key = tuple[str, int, int]

# every field of RESTORE_CONTRACT with values other than the base config's (below), each a
# valid config on the same data; "moved" stands for a copy of the data folder
CHANGES: dict[str, list[Any]] = {
    "data_path": ["moved"],
    "datasets": [["code", "web"], ["web"]],
    "weights": [[1.0, 1.0]],
    "file_type": ["arrow"],
    "col_name": ["ids"],
    "seq_length": [48],
    "shift": [False],
    "bos_token": [None, 300],
    "eos_token": [None, 2],
    "bol_token": [3],
    "eol_token": [4],
    "strip_tokens": [[7, 9]],
    "logical_shards": [6],
    "num_workers": [4],
    "batch_size": [3],
    "seed": [6],
    "tokenizer": ["byte"],
    "byte_offset": [2],
    "pack_mode": ["pad", "best_fit", "chunk"],
    "best_fit_window": [3],
    "shuffle_buffer": [1, 9],
    "shuffle_fill": ["full"],
    "interleave_mode": ["samples"],
    "mix_quantum_tokens": [64],
    "epochs": [2],
    "min_length": [15],
    "max_chunksize": [10],
    "block_docs": [2, 9],
    "pad_token": [5],
    "storage_options": [{"anon": False}],
    "dtype": ["int32"],
    "output_keys": ["input_ids,labels,provenance"],
    "eval_fraction": [0.25],
    "eval_seed": [3],
    "transforms": [
        [{"max_length": 500}],  # a changed parameter of the base's step
        [{"max_length": 1000}, {"truncate": 30}],  # a step added
        [{"drop_tokens": [7]}],  # another step
        [],  # the step removed (no transform node)
    ],
    "drop_remainder": [True],
    "phases": [[{"datasets": "web"}, {"datasets": "code"}]],
    "max_tokens": [2000],
    "max_documents": [60],
    "max_dropped_documents": [7],
    "weight_schedule": [{3: {"web": 1.0, "code": 2.0}}],
    "weight_schedule_unit": ["tokens"],
    "weight_schedule_ramp_every": [2],
}

# fields whose change at a restore is meant to change what is delivered, each with the test
# that checks the stream it gives instead of "every document once"
CHECKED_ELSEWHERE = {
    "skip_steps": "tests/test_forensics.py: every document once or listed as skipped, never both",
}


def test_every_contract_field_is_drawn() -> None:
    """A field added to the contract without values here fails (so the test below draws it)."""
    assert not set(CHANGES) & set(CHECKED_ELSEWHERE)
    assert set(CHANGES) | set(CHECKED_ELSEWHERE) == set(RESTORE_CONTRACT)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("changes")
    write_random_arrow_datasets(str(root / "data"), (("web", 60, 18), ("code", 30, 40)), seed=7)
    shutil.copytree(root / "data", root / "moved")  # copy2: modification times kept
    return PipelineConfig(
        data_path=str(root / "data"), datasets="web,code", weights="2,1", seq_length=32,
        eos_token=0, bos_token=1, logical_shards=12, batch_size=2, seed=5, shuffle_buffer=4,
        block_docs=5, epochs=1, mix_quantum_tokens=0, output_keys="input_ids,provenance",
        transforms=[{"max_length": 1000}],  # keeps every document: a step whose change is drawn
    )  # fmt: skip


def _changed(base: PipelineConfig, changes: dict[str, Any]) -> PipelineConfig:
    extra = dict(changes)
    if extra.get("data_path") == "moved":
        extra["data_path"] = base.data_path.rsplit("/", 1)[0] + "/moved"
    if extra.get("datasets") == ["code", "web"] and "weights" not in extra:
        extra["weights"] = [1.0, 2.0]  # the same weight per dataset, in the new order
    if extra.get("datasets") == ["web"]:
        extra["weights"] = [1.0]
    if "phases" in extra:
        extra.update(datasets=[], weights=[])
    if "weight_schedule" in extra:  # the same datasets; with phases or best_fit it is refused
        if extra.get("datasets") == ["web"]:  # by the config, which is not a restore's doing
            extra["weight_schedule"] = {3: {"web": 1.0}}
        if "phases" in extra or extra.get("pack_mode") == "best_fit":
            del extra["weight_schedule"]
    if "eval_seed" in extra and "eval_fraction" not in extra:
        extra["eval_fraction"] = base.eval_fraction
    return dataclasses.replace(base, **extra)


Rows = list[tuple[np.ndarray, list[str]]]


def _rows(batch: dict[str, Any], names: list[str]) -> Rows:
    return [(np.asarray(p), names) for p in batch["provenance"].numpy()]


def _save(cfg: PipelineConfig, ckpt: str, steps: tuple[int, int]) -> list[Rows]:
    """``cfg`` at 2 ranks x 1 worker, rank ``r`` run ``steps[r]`` batches, then saved."""
    loaders = [
        TokenLoader(functools.partial(build_pipeline, cfg), rank=r, world_size=2, background=False)
        for r in range(2)
    ]
    streams: list[Rows] = []
    for loader, n in zip(loaders, steps):
        rows: Rows = []
        for _, batch in zip(range(n), loader):  # range first: no batch pulled and dropped
            rows += _rows(batch, list(cfg.datasets))
        streams.append(rows)
    for loader in reversed(loaders):  # rank 0 writes the manifest last
        save_checkpoint(loader, ckpt)
    return streams


def _restore(cfg: PipelineConfig, ckpt: str) -> list[Rows]:
    """Restore at 1 rank x 2 workers and run each worker's graph to the end of the epoch,
    in this process (what each worker process runs from the state it is given)."""
    build = functools.partial(build_pipeline, cfg)
    loader = TokenLoader(build, num_workers=2, rank=0, world_size=1)
    load_checkpoint(loader, ckpt)
    state = loader.state_dict()
    assert state["skip_batches"] == 0
    streams = []
    for w in range(2):
        root = build(World(0, 1, w, 2))
        root.reset(state["workers"][str(w)]["graph"])
        rows: Rows = []
        for batch in root:
            rows += _rows(batch, list(cfg.datasets))
        streams.append(rows)
    return streams


def _coverage(streams: list[Rows]) -> dict[Key, np.ndarray]:
    """How many times each document token was delivered."""
    out: dict[Key, list[tuple[int, int]]] = {}
    for stream in streams:
        for prov, names in stream:
            for ds, f, d, start, n in prov.tolist():
                if ds >= 0 and n:
                    out.setdefault((names[ds], f, d), []).append((start, start + n))
    cover = {}
    for k, ranges in out.items():
        c = np.zeros(max(b for _, b in ranges), np.int64)
        for a, b in ranges:
            c[a:b] += 1
        cover[k] = c
    return cover


def _expected(cfg: PipelineConfig) -> dict[Key, int]:
    """The document lengths one uninterrupted epoch of ``cfg`` delivers (its filters, split
    and transforms applied): one in-process run of the whole epoch."""
    unfiltered = cfg.min_length <= 1 and (cfg.eval_fraction, cfg.transforms) == (0, [])
    unbudgeted = not cfg.phases and cfg.max_tokens is None and cfg.max_documents is None
    if unfiltered and unbudgeted and cfg.strip_tokens == [] and cfg.tokenizer is None:
        return document_lengths(cfg)
    ref = dataclasses.replace(cfg, shuffle_buffer=1, epochs=1)
    got: dict[Key, int] = {}
    for k, c in _coverage(_restore_free(ref)).items():
        got[k] = len(c)
    return got


def _restore_free(cfg: PipelineConfig) -> list[Rows]:
    root = build_pipeline(cfg, World())
    return [[row for batch in root for row in _rows(batch, list(cfg.datasets))]]


def _check(before: list[Rows], after: list[Rows], cfg: PipelineConfig) -> None:
    """The delivered rows are an uninterrupted run's (every token exactly once per epoch)."""
    streams = before + after
    if cfg.epochs == 1 and cfg.max_chunksize is None:
        lengths = _expected(cfg)
        problems = row_problems(streams, lengths, RowRules.of(cfg), budget=False)
        assert not problems, "\n".join(problems)
    else:  # more epochs than the checkpoint's, or documents cut in the reader: count tokens
        lengths = _expected(dataclasses.replace(cfg, epochs=1))
        cover = _coverage(streams)
        assert set(cover) == {k for k, n in lengths.items() if n}
        bad = {k: c for k, c in cover.items() if len(c) != lengths[k] or (c != cfg.epochs).any()}
        assert not bad, f"{len(bad)} documents not delivered exactly {cfg.epochs} times"


def _shown(value: Any) -> list[str]:
    """How a message may show ``value``."""
    return [repr(value), str(value)]


def _refusable(field: str, value: Any, cfg: PipelineConfig) -> bool:
    """Whether the contract lets a restore with ``field`` changed to ``value`` (config
    ``cfg``) be refused: a must-match or opt-in field, or a may-change one in the cases its
    reason excepts (a shuffle buffer added or removed; block_docs with pack_mode best_fit)."""
    if RESTORE_CONTRACT[field][0] != "may_change":
        return True
    if field == "shuffle_buffer":
        return value <= 1
    return field == "block_docs" and cfg.pack_mode == "best_fit"


field_names = sorted(CHANGES)
change = st.sampled_from(field_names).flatmap(
    lambda f: st.tuples(st.just(f), st.sampled_from(CHANGES[f]))
)


@settings(
    max_examples=24,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    changes=st.lists(change, min_size=1, max_size=2, unique_by=lambda c: c[0]),
    steps=st.tuples(st.integers(1, 6), st.integers(0, 6)),
)
@example(changes=[("transforms", [{"max_length": 500}])], steps=(3, 2))  # a parameter
@example(changes=[("block_docs", 2)], steps=(4, 3))
@example(changes=[("block_docs", 9), ("shuffle_buffer", 9)], steps=(5, 1))
@example(changes=[("shuffle_buffer", 1)], steps=(3, 3))  # may change, but not to 1
@example(changes=[("block_docs", 2), ("pack_mode", "best_fit")], steps=(2, 2))
@example(changes=[("transforms", [{"drop_tokens": [7]}]), ("batch_size", 3)], steps=(2, 4))
def test_a_changed_setting_restores_exactly_or_is_refused_by_name(
    base, tmp_path_factory, changes, steps
) -> None:
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    before = _save(base, ckpt, steps)
    fields = [f for f, _ in changes]
    try:
        cfg = _changed(base, dict(changes))
        after = _restore(cfg, ckpt)
    except ValueError as exc:
        msg = str(exc)
        named = [f for f in fields if f in msg]
        assert named, f"{fields} changed; the refusal names none of them: {msg}"
        assert any(_refusable(f, v, base) for f, v in changes), (
            f"{fields} may change, yet the restore was refused: {msg}"
        )
        assert "KeyError" not in msg and "Traceback" not in msg
        return
    _check(before, after, cfg)


@pytest.mark.parametrize(
    "field,value", [("max_chunksize", 10), ("min_length", 15), ("strip_tokens", [7])]
)
def test_a_reader_reset_with_another_setting_refuses_by_name(base, field, value) -> None:
    """A hand-built graph reset from a state of other reader settings refuses (no checkpoint)."""
    cfg = dataclasses.replace(base, output_keys="input_ids")
    root = build_pipeline(cfg, World(), collate=False)
    root.reset()
    for _ in range(5):
        next(root)
    state = root.state_dict()
    other = build_pipeline(dataclasses.replace(cfg, **{field: value}), World(), collate=False)
    with pytest.raises(ValueError, match=f"reader of dataset .*{field} differs.*{field}="):
        other.reset(state)


def _plus_one(tokens: np.ndarray, meta: Any) -> np.ndarray:
    return tokens + 1


def _plus_two(tokens: np.ndarray, meta: Any) -> np.ndarray:
    return tokens + 2


@pytest.mark.parametrize(
    "saved,now,says",
    [
        (
            [{"max_length": 1000}],
            [{"max_length": 500}],
            "transforms step 1 (length_filter) differs in max_length: the checkpoint was taken "
            "with max_length=1000, this pipeline has max_length=500; ",
        ),
        (
            [{"max_length": 1000}, {"truncate": 30}],
            [{"max_length": 1000}, {"truncate": 20}],
            "transforms step 2 (truncate) differs in max_tokens: the checkpoint was taken with "
            "max_tokens=30, this pipeline has max_tokens=20; ",
        ),
        (
            [{"max_length": 1000}],
            [{"max_length": 1000}, {"drop_tokens": [7]}],
            "transforms differs: the checkpoint was taken with 1 step(s) [length_filter("
            "min_length=None, max_length=1000)], this pipeline has 2 [length_filter(min_length="
            "None, max_length=1000), drop_tokens(tokens=[7])]; ",
        ),
        (
            [_plus_one],
            [_plus_two],
            "transforms step 1 (Map) differs in name: the checkpoint was taken with "
            "name='_plus_one', this pipeline has name='_plus_two'; ",
        ),
    ],
)
def test_a_changed_transform_step_is_refused_naming_the_step_and_parameter(
    base, tmp_path, saved, now, says
) -> None:
    """Folder and DCP checkpoints alike: refused before any data moves, in one line naming
    the step, the parameter, both values and the checkpoint's steps to restore with."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    cfg = dataclasses.replace(base, transforms=saved)
    loader = TokenLoader(functools.partial(build_pipeline, cfg), background=False)
    for _, _batch in zip(range(3), loader):
        pass
    save_checkpoint(loader, str(tmp_path / "folder"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "dcp"))
    other = dataclasses.replace(base, transforms=now)
    first = next(iter(TokenLoader(functools.partial(build_pipeline, other), background=False)))
    for kind in ("folder", "dcp"):
        fresh = TokenLoader(functools.partial(build_pipeline, other), background=False)
        with pytest.raises(ValueError) as err, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "folder":
                load_checkpoint(fresh, str(tmp_path / kind))
            else:
                dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=str(tmp_path / kind))
        msg = str(err.value)
        assert says in msg and "\n" not in msg, msg
        assert "Restore with the checkpoint's transforms ([" in msg, msg
        assert msg.endswith("or start a new run"), msg
        again = next(iter(fresh))  # nothing was restored: the refused loader starts afresh
        assert torch.equal(again["input_ids"], first["input_ids"])


def test_a_transform_node_reset_with_other_steps_refuses_by_name(base) -> None:
    """A hand-built graph reset from a state of other steps refuses (no checkpoint)."""
    cfg = dataclasses.replace(base, output_keys="input_ids")
    root = build_pipeline(cfg, World(), collate=False)
    root.reset()
    for _ in range(5):
        next(root)
    other = build_pipeline(
        dataclasses.replace(cfg, transforms=[{"max_length": 999}]), World(), collate=False
    )
    with pytest.raises(
        ValueError,
        match=r"cannot restore TransformDocuments: transforms step 1 \(length_filter\) differs "
        r"in max_length: the checkpoint was taken with max_length=1000, this pipeline has "
        r"max_length=999;",
    ):
        other.reset(root.state_dict())


def test_a_user_step_is_recorded_by_its_function_and_partial_arguments() -> None:
    """The same in every process and run (no memory address), other for other arguments."""
    from torchdata_ext.transforms import Filter, Map, from_spec

    one, two = functools.partial(_plus_one, meta=1), functools.partial(_plus_one, meta=2)
    assert Map(one).identity() == {
        "step": "Map",
        "name": "partial(_plus_one)",
        "on": "tokens",
        "function": "test_restore_changes._plus_one((), [('meta', 1)])",
    }
    assert Map(one).identity() != Map(two).identity()
    assert Filter(_plus_one, on="text").identity()["step"] == "Filter"
    assert from_spec({"min_length": 3, "max_length": 9}).identity() == {
        "step": "length_filter", "min_length": 3, "max_length": 9,
    }  # fmt: skip


def test_another_col_name_is_refused_by_name(tmp_path) -> None:
    """Arrow files with two token columns of equal lengths: the other column passes every
    check of the files (names, document and token counts), but its documents are others."""
    import pyarrow as pa

    rng = np.random.default_rng(3)
    for f in range(2):
        lengths = 1 + rng.integers(0, 30, 20)
        with pa.ipc.new_file(str(tmp_path / f"p{f}.arrow"), pa.schema(
            [("tokens", pa.uint32()), ("ids", pa.uint32())]
        )) as out:  # fmt: skip
            for n in lengths.tolist():
                doc = rng.integers(5, 30_000, n, dtype=np.uint32)
                out.write_batch(pa.record_batch([doc, doc[::-1].copy()], ["tokens", "ids"]))
    cfg = PipelineConfig(
        data_path=str(tmp_path), seq_length=16, eos_token=0, logical_shards=4, batch_size=2,
        output_keys="input_ids",
    )  # fmt: skip
    loader = TokenLoader(functools.partial(build_pipeline, cfg), background=False)
    for _, _batch in zip(range(3), loader):
        pass
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    other = dataclasses.replace(cfg, col_name="ids")
    fresh = TokenLoader(functools.partial(build_pipeline, other), background=False)
    with pytest.raises(ValueError) as err:
        load_checkpoint(fresh, str(tmp_path / "ckpt"))
    assert (
        "col_name differs: the checkpoint was taken with col_name='tokens', this pipeline has "
        "col_name='ids'" in str(err.value)
    )
    assert "Restore with the checkpoint's value (col_name='tokens')" in str(err.value)
    load_checkpoint(TokenLoader(functools.partial(build_pipeline, cfg)), str(tmp_path / "ckpt"))


def _restore_same(cfg: PipelineConfig, ckpt: str) -> list[Rows]:
    """Restore at the checkpoint's 2 ranks x 1 worker (no rescale: each rank's nodes replay
    from their saved states) and run each rank to the end of the epoch."""
    streams = []
    for r in range(2):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg), rank=r, world_size=2, background=False
        )
        load_checkpoint(loader, ckpt)
        streams.append([row for batch in loader for row in _rows(batch, list(cfg.datasets))])
    return streams


@pytest.mark.parametrize("mode", ["concat", "pad", "chunk", "best_fit"])
@pytest.mark.parametrize(
    "extra", [{}, {"mix_quantum_tokens": 64}, {"max_chunksize": 10}], ids=["", "quantum", "cut"]
)
def test_block_docs_may_change_but_with_best_fit(base, tmp_path, mode, extra) -> None:
    """The readers read the block the nodes above replay at the saved size, then at the new
    one: exact on the same topology and through a rescale, for every pack mode but best_fit
    (its window replays several blocks), where the restore is refused naming both fields."""
    saved = dataclasses.replace(base, pack_mode=mode, **extra)
    for i, (new, steps) in enumerate([(2, (3, 2)), (9, (5, 4)), (1, (1, 6))]):
        ckpt = str(tmp_path / f"ckpt{i}")
        before = _save(saved, ckpt, steps)
        now = dataclasses.replace(saved, block_docs=new)
        if mode == "best_fit":
            with pytest.raises(ValueError) as err:
                _restore(now, ckpt)
            assert (
                f"block_docs differs: the checkpoint was taken with block_docs=5, this pipeline "
                f"has block_docs={new};"
            ) in str(err.value)
            assert "(with pack_mode='best_fit', whose window replays several blocks)" in str(
                err.value
            )
            continue
        _check(before, _restore(now, ckpt), now)  # 2 x 1 -> 1 x 2
        _check(before, _restore_same(now, ckpt), now)  # 2 x 1 -> 2 x 1


@pytest.mark.parametrize("extra", [{}, {"max_chunksize": 7, "transforms": [{"max_length": 900}]}])
def test_block_docs_may_change_on_text(tmp_path, extra) -> None:
    """Text read ahead by Tokenize (its thread pool) and cut by the reader: the same rule."""
    root = str(tmp_path / "text")
    words = ["alpha", "beta", "gamma", "delta", "zeta"]
    write_random_text_datasets(root, (("web", 40, 6), ("code", 20, 12)), words, seed=4)
    saved = text_config(root, output_keys="input_ids,provenance", **extra)
    for i, (new, steps) in enumerate([(1, (1, 6)), (9, (4, 3))]):
        ckpt = str(tmp_path / f"ckpt{i}")
        before = _save(saved, ckpt, steps)
        now = dataclasses.replace(saved, block_docs=new)
        _check(before, _restore(now, ckpt), now)
        _check(before, _restore_same(now, ckpt), now)
