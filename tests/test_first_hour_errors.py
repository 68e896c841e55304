"""What a new user meets in the first hour, said plainly (issue 29's third list): each mistake
gets one line naming the argument, field or file at fault and what to pass instead, and the
counts ``prepare`` reports add up."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import item_key, run, write_random_arrow_datasets
from test_disk_full import small_disk  # noqa: F401 - the fixture

import torchdata_ext.prepare_data.tokenize_text as tokenize_text
from torchdata_ext import prepare
from torchdata_ext.audit import audit_checkpoint
from torchdata_ext.checkpoint.folder import load_checkpoint, read_manifest, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.forensics import show_batches
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_jsonl, write_parquet
from torchdata_ext.tokenizers.load import load_tokenizer
from torchdata_ext.world import World


# -- the loader's build function -----------------------------------------------------------------
def test_token_loader_given_build_pipeline_or_a_config_says_what_to_pass() -> None:
    cfg = PipelineConfig(data_path="/nowhere")
    with pytest.raises(TypeError) as e:
        TokenLoader(build_pipeline)  # type: ignore[arg-type]
    assert str(e.value) == (
        "TokenLoader(build): build_pipeline needs the config first; pass "
        "functools.partial(build_pipeline, cfg): a function of the World"
    )
    with pytest.raises(TypeError) as e:
        TokenLoader(cfg)  # type: ignore[arg-type]
    assert str(e.value) == (
        "TokenLoader(build): PipelineConfig is not callable; pass "
        "functools.partial(build_pipeline, cfg): a function of the World"
    )
    TokenLoader(functools.partial(build_pipeline, cfg))  # the right call builds nothing yet


# -- the data's format ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_text_files_under_the_default_file_type_name_file_type_and_what_was_found(
    kind: str, tmp_path: Path
) -> None:
    for k in range(3):
        if kind == "jsonl":
            write_jsonl(str(tmp_path / "web" / f"t{k}.jsonl"), ["some text", "more"])
        else:
            write_parquet(str(tmp_path / "web" / f"t{k}.parquet"), ["some text", "more"],
                          col_name="text")  # fmt: skip
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web", tokenizer="byte")
    with pytest.raises(FileNotFoundError) as e:
        build_datasets(cfg)
    assert str(e.value) == (
        f"no data files match '{tmp_path / 'web'}' (looking for names ending in ['.arrow', "
        f"'.feather', '.ipc']); it holds 3 .{kind} files, not arrow files: set file_type to "
        f"their format ('{kind}') or None to choose by suffix"
    )
    assert build_datasets(PipelineConfig(data_path=str(tmp_path), datasets="web", file_type=None,
                                         col_name="text", tokenizer="byte"))["web"].total_docs == 6  # fmt: skip


def test_a_folder_of_unknown_files_still_says_to_check_the_path(tmp_path: Path) -> None:
    (tmp_path / "web").mkdir()
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web")
    with pytest.raises(
        FileNotFoundError, match=r"; check the path, the pattern and storage_options$"
    ):
        build_datasets(cfg)


# -- the tokenizer's name ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Byte", "BYTE", " byte"])
def test_byte_in_other_letters_is_named_byte(name: str, tmp_path: Path, capsys) -> None:
    fix = f"tokenizer={name!r}: the byte tokenizer is named 'byte' (lower case)"
    with pytest.raises(ValueError) as e:
        PipelineConfig(data_path="/data", tokenizer=name)
    assert str(e.value) == fix
    with pytest.raises(ValueError) as e:
        load_tokenizer(name)
    assert str(e.value) == fix
    write_jsonl(str(tmp_path / "a.jsonl"), ["text"])
    assert main(["prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o"),
                 "--tokenizer", name]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.strip().endswith("the byte tokenizer is named 'byte' (lower case)")
    assert "hub" not in err and "download" not in err


# -- the YAML config -----------------------------------------------------------------------------
def test_yaml_datasets_given_as_mappings_are_refused_naming_the_field(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    for body in (
        "datasets:\n  - name: web\n    weight: 3\n  - name: code\n    weight: 1\n",
        "datasets:\n  web: 3\n  code: 1\n",
    ):
        (tmp_path / "c.yaml").write_text(f"data_path: {tmp_path}\n{body}")
        with pytest.raises(ValueError) as e:
            PipelineConfig.from_file(str(tmp_path / "c.yaml"))
        assert str(e.value).startswith("datasets=")
        assert str(e.value).endswith(
            "holds mappings; give the dataset folder names as a list (datasets: [web, code] or "
            "'web,code') and their weights apart, in the same order (weights: [3, 1])"
        )


def test_shuffle_buffer_zero_or_negative_is_refused_saying_one_disables(tmp_path: Path) -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError) as e:
            PipelineConfig(data_path="/data", shuffle_buffer=bad)
        assert str(e.value) == (
            f"shuffle_buffer={bad} must be >= 1; 1 disables the shuffle buffer (sequences come "
            "out in packing order)"
        )
    assert PipelineConfig(data_path="/data", shuffle_buffer=1).shuffle_buffer == 1


# -- memory ----------------------------------------------------------------------------------------
def test_a_config_too_big_for_memory_is_refused_before_allocating() -> None:
    docs = {"web": [np.arange(1, 50, dtype=np.uint32)] * 4}
    from torchdata_ext.sources.index import DatasetIndex

    indexes = {n: DatasetIndex.from_documents(n, d) for n, d in docs.items()}
    cfg = PipelineConfig(data_path="mem", seq_length=10**9, logical_shards=4)
    with pytest.raises(ValueError) as e:
        build_pipeline(cfg, World(), indexes)
    msg = str(e.value)
    assert msg.startswith(
        "seq_length=1000000000, shuffle_buffer=10000 and batch_size=8 need at least 80.2 TB of "
        "memory per pipeline (the shuffle buffer 80.0 TB, a batch 192.0 GB; int64 tokens), more "
        "than the "
    )
    assert msg.endswith(" available; lower seq_length, shuffle_buffer or batch_size")
    # the threshold is the memory available: (4,096 + 1) x 8 B x (10,000 + 8 x 3) fits 330 MB
    small = PipelineConfig(data_path="mem", logical_shards=4)
    need = 4097 * 8 * (10_000 + 8 * 3)
    small.check_memory(available_bytes=need)
    with pytest.raises(ValueError, match=r"need at least 328\.5 MB .* more than the 328\.5 MB"):
        small.check_memory(available_bytes=need - 1)
    out = run(build_pipeline(PipelineConfig(data_path="mem", datasets="web", seq_length=16, shuffle_buffer=2,
                                            logical_shards=4, epochs=1), World(), indexes,
                             collate=False))  # fmt: skip
    assert sum(int(np.count_nonzero(x["input_ids"])) for x in out) > 0


def test_a_best_fit_window_too_big_for_memory_is_refused_before_reading() -> None:
    from torchdata_ext.sources.index import DatasetIndex

    docs = {"web": [np.arange(1, 50, dtype=np.uint32)] * 4}
    indexes = {n: DatasetIndex.from_documents(n, d) for n, d in docs.items()}
    cfg = PipelineConfig(data_path="mem", pack_mode="best_fit", best_fit_window=10**9,
                         logical_shards=4)  # fmt: skip
    with pytest.raises(ValueError) as e:
        build_pipeline(cfg, World(), indexes)
    assert str(e.value).startswith(
        "best_fit_window=1000000000 needs at least 100.0 GB of memory per pipeline (at least "
        "100 B a piece: its place in a bin, its provenance row and a token), more than the "
    )
    assert str(e.value).endswith(" left after the shuffle buffer and a batch; lower "
                                 "best_fit_window (default 1000)")  # fmt: skip
    need = 4097 * 8 * (10_000 + 8 * 3) + 1000 * 100  # the buffers and the default window
    small = PipelineConfig(data_path="mem", pack_mode="best_fit", logical_shards=4)
    small.check_memory(available_bytes=need)
    with pytest.raises(ValueError, match=r"^best_fit_window=1000 needs at least 100\.0 KB"):
        small.check_memory(available_bytes=need - 1)
    dataclasses.replace(small, pack_mode="concat").check_memory(available_bytes=need - 1)


# -- DCP -----------------------------------------------------------------------------------------
def _tiny(root: Path) -> PipelineConfig:
    write_random_arrow_datasets(str(root), (("web", 30, 10), ("code", 20, 10)), seed=2)
    return PipelineConfig(data_path=str(root), datasets="web,code", seq_length=16,
                          logical_shards=4, batch_size=2, shuffle_buffer=3, epochs=1)  # fmt: skip


def test_a_dcp_load_of_a_checkpoint_without_loader_state_says_so(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    cfg = _tiny(tmp_path / "data")
    model_only, elsewhere = str(tmp_path / "model_only"), str(tmp_path / "elsewhere")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=model_only)
        loader = TokenLoader(functools.partial(build_pipeline, cfg))
        it = iter(loader)
        next(it)
        dcp.save({"model": {"w": torch.arange(4.0)}, "train": DCPLoaderState(loader)},
                 checkpoint_id=elsewhere)  # fmt: skip
        loader.close()
        for folder, fix in (
            (model_only, "it was saved without DCPLoaderState(loader) in dcp.save's state dict; "
                         "start the loader fresh (leave DCPLoaderState out of this load) or load "
                         "a checkpoint saved with it"),
            (elsewhere, "its loader state is under ['train']: give DCPLoaderState that key in "
                        "dcp.load's state dict"),
        ):  # fmt: skip
            fresh = TokenLoader(functools.partial(build_pipeline, cfg))
            state = {"model": {"w": torch.zeros(4)}, "data": DCPLoaderState(fresh)}
            with pytest.raises(ValueError) as e:
                dcp.load(state, checkpoint_id=folder)
            keys = "'model'" if folder == model_only else "'model', 'train'"
            assert str(e.value) == (
                f"the DCP checkpoint holds no loader state under the key 'data' (its keys: "
                f"{keys}); {fix}"
            )


def test_dcp_save_on_a_full_disk_leaves_no_metadata_and_the_last_checkpoint_loads(
    small_disk,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """What docs/reliability.md says DCP leaves: torch's error, partial ``.distcp`` files and no
    ``.metadata`` (written last), so the folder never loads; the checkpoint before it does."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from torchdata_ext.checkpoint.dcp import DCPLoaderState

    cfg = _tiny(tmp_path / "data")
    disk = small_disk("ckpt", 40)  # 160 KiB
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    it = iter(loader)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=os.path.join(disk, "step_1"))
        expected = [item_key(next(it)) for _ in range(3)]
        # torch's CheckpointException (a BaseException) around the rank's zip-writer error
        with pytest.raises(CheckpointException, match=r"unexpected pos|No space left"):
            dcp.save({"model": {"w": torch.zeros(200_000)}, "data": DCPLoaderState(loader)},
                     checkpoint_id=os.path.join(disk, "step_4"))  # fmt: skip
        left = sorted(os.listdir(os.path.join(disk, "step_4")))
        assert left and ".metadata" not in left and all(n.endswith(".distcp") for n in left)
        fresh = TokenLoader(functools.partial(build_pipeline, cfg))
        with pytest.raises(
            FileNotFoundError, match=r"step_4 has no \.metadata: its save did not finish"
        ):
            dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=os.path.join(disk, "step_4"))
        fresh = TokenLoader(functools.partial(build_pipeline, cfg))
        dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=os.path.join(disk, "step_1"))
    assert [item_key(x) for _, x in zip(range(3), fresh)] == expected
    loader.close()


# -- prepare ---------------------------------------------------------------------------------------
def test_prepare_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(default: byte)", "(default: arrow)", "(default: text)", "(default: utf-8)",
                  "(default: infer)", "(default: 100000000)", "(default: 1.0)",
                  "byte b is id b + this (default: 1,"):  # fmt: skip
        assert shown in out, shown


def test_prepare_counts_the_empty_documents_it_leaves_out(tmp_path: Path, capsys) -> None:
    texts = ["one", "", "two", "", "", "three"]
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), texts)
    write_jsonl(str(tmp_path / "in" / "b.jsonl"), ["", "four"])
    res = prepare(str(tmp_path / "in"), str(tmp_path / "out"), progress=True)
    assert (res.documents, res.empty) == (4, 4)
    assert (res.total_documents, res.total_tokens) == (4, res.tokens)
    err = capsys.readouterr().err
    assert "part 0/1: 4 documents, " in err and "; left out: 4 empty" in err


def test_a_resumed_prepare_reports_the_total_and_what_it_added(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    inputs = tmp_path / "in"
    for k in range(4):
        write_jsonl(
            str(inputs / f"t{k}.jsonl"), [f"document {k} {i} " * (i + 1) for i in range(40)]
        )
    reference = prepare(str(inputs), str(tmp_path / "reference"), max_tokens_per_file=3000,
                        progress=False)  # fmt: skip
    real, writes = tokenize_text.write_bytes_atomic, []

    def failing(url: str, data: bytes, storage_options=None) -> None:
        writes.append(url)
        if url.endswith(".arrow") and sum(u.endswith(".arrow") for u in writes) == 4:
            raise OSError(f"cannot write {url} (injected)")
        real(url, data, storage_options)

    monkeypatch.setattr(tokenize_text, "write_bytes_atomic", failing)
    with pytest.raises(OSError, match="injected"):
        prepare(str(inputs), str(tmp_path / "out"), max_tokens_per_file=3000, progress=False)
    monkeypatch.setattr(tokenize_text, "write_bytes_atomic", real)
    assert main([  "prepare", str(inputs), "--out", str(tmp_path / "out"),
                 "--max-tokens-per-file", "3000", "--progress"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    done = json.loads(out)
    assert done["status"] == "resumed" and 0 < done["documents"] < reference.documents
    assert (done["total_documents"], done["total_tokens"]) == (
        reference.documents,
        reference.tokens,
    )
    assert f"part 0/1: {done['documents']:,} documents, {done['tokens']:,} tokens into " in err
    assert (
        f"added by this run; the part holds {reference.documents:,} documents, "
        f"{reference.tokens:,} tokens in all (the rest from the run it resumed)"
    ) in err
    again = prepare(str(inputs), str(tmp_path / "out"), max_tokens_per_file=3000, progress=False)
    assert again.skipped and (again.documents, again.total_documents) == (0, reference.documents)


# -- hangs (issue 44) ----------------------------------------------------------------------------
class _Ticks:
    """A clock a second further on at each read (Progress reports after 2 s)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_skip_range_past_the_end_of_the_data_is_refused_and_its_drop_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torchdata_ext import progress

    cfg = _tiny(tmp_path / "data")
    n = len(list(TokenLoader(functools.partial(build_pipeline, cfg))))
    # a range that ends with the data takes the rest of the run; one past it is refused
    ends = dataclasses.replace(cfg, skip_steps=[[3, n + 1]])
    assert len(list(TokenLoader(functools.partial(build_pipeline, ends)))) == 2
    monkeypatch.setattr(progress, "_clock", _Ticks())
    past = dataclasses.replace(cfg, skip_steps=[[3, 10**12]])
    got = []
    with pytest.raises(ValueError) as e, caplog.at_level(logging.WARNING):
        for batch in TokenLoader(functools.partial(build_pipeline, past)):
            got.append(batch)
    assert len(got) == 2
    assert str(e.value) == (
        f"skip_steps: the range [3, {10**12}] runs past the end of the data: it ran out after "
        f"{n - 2} of the range's {10**12 - 3} batches; end the range at step {n + 1} at most "
        "(B excluded) or remove it"
    )
    lines = [r.getMessage() for r in caplog.records if "skip_steps" in r.getMessage()]
    assert lines[0] == (
        f"skip_steps: dropping the batches of steps 3..{10**12 - 1}: 2 of {10**12 - 3:,} batches "
        f"after 2 s, about {10**12 - 5} s left"
    )


# -- a file where a checkpoint folder goes (issue 44 item 9) -------------------------------------
_FILE_ENTRY_POINTS: dict[str, Any] = {
    "read_manifest": lambda ck, cfg: read_manifest(ck),
    "load_checkpoint": lambda ck, cfg: load_checkpoint(
        TokenLoader(functools.partial(build_pipeline, cfg)), ck
    ),
    "show_batches": lambda ck, cfg: show_batches(ck, cfg, 3),
    "audit_checkpoint": lambda ck, cfg: audit_checkpoint(ck, cfg),
}


@pytest.mark.parametrize("entry", sorted(_FILE_ENTRY_POINTS))
def test_a_file_given_as_the_checkpoint_folder_is_named(entry: str, tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(f"data_path: {tmp_path}\n")
    cfg = PipelineConfig(data_path=str(tmp_path))
    with pytest.raises(NotADirectoryError) as e:
        _FILE_ENTRY_POINTS[entry](str(config), cfg)
    assert str(e.value) == (
        f"checkpoint {config} is a file, not a checkpoint folder: pass the folder that "
        "save_checkpoint or dcp.save wrote (a config file goes to config / --config)"
    )


@pytest.mark.parametrize("command", ["audit", "batches"])
def test_the_cli_given_a_file_as_the_checkpoint_says_so_in_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(f"data_path: {tmp_path}\n")
    extra = ["--steps", "3"] if command == "batches" else []
    assert main([command, str(config), "--config", str(config), *extra]) == 2
    assert capsys.readouterr().err == (
        f"torchdata-ext {command}: error: checkpoint {config} is a file, not a checkpoint "
        "folder: pass the folder that save_checkpoint or dcp.save wrote (a config file goes to "
        "config / --config)\n"
    )


# -- one-line errors and right answers for what used to fail (issue 44 items 14-16) --------------
def test_rank_without_world_size_says_world_size_was_not_given(tmp_path: Path) -> None:
    cfg = PipelineConfig(data_path=str(tmp_path))
    with pytest.raises(ValueError) as e:
        TokenLoader(functools.partial(build_pipeline, cfg), rank=1)
    assert str(e.value) == (
        "rank=1 needs world_size, which was not given (and no torch.distributed process group "
        "is initialised to give it, so it would be 1); pass world_size=... (> 1) as well"
    )
    assert TokenLoader(functools.partial(build_pipeline, cfg), rank=1, world_size=2).rank == 1


@pytest.mark.parametrize("from_step", [5.5, "5", True, 5.0])
def test_set_weights_from_a_step_that_is_no_whole_number_says_so(
    from_step: Any, tmp_path: Path
) -> None:
    cfg = _tiny(tmp_path / "data")
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    with pytest.raises(ValueError) as e:
        loader.set_weights({"web": 1.0, "code": 1.0}, from_step=from_step)
    assert str(e.value) == (
        f"set_weights(from_step={from_step!r}): from_step must be a whole number (the training "
        "loop's step, counted from 1)"
    )
    assert loader.set_weights({"web": 1.0, "code": 1.0}, from_step=np.int64(3)) == 3


def test_an_int64_special_id_beyond_int32_is_delivered(tmp_path: Path) -> None:
    """eos_token=10**12 fits dtype int64: the batches are those of any other EOS id."""
    cfg = _tiny(tmp_path / "data")
    top = 2**31 - 1
    want = list(
        TokenLoader(functools.partial(build_pipeline, dataclasses.replace(cfg, eos_token=top)))
    )
    big = dataclasses.replace(cfg, eos_token=10**12)
    got = list(TokenLoader(functools.partial(build_pipeline, big)))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        for key in ("input_ids", "labels"):
            assert g[key].dtype == w[key].dtype
            assert g[key].tolist() == w[key].masked_fill(w[key] == top, 10**12).tolist()
    assert sum(int((g["input_ids"] == 10**12).sum()) for g in got) > 10


# -- the config's num_workers (issue 44 item 20) ---------------------------------------------------
@pytest.mark.parametrize(
    "in_config, given, used", [(None, None, 0), (2, None, 2), (2, 0, 0), (None, 2, 2), (0, None, 0)]
)
def test_the_config_num_workers_is_used_unless_the_loader_is_given_one(
    in_config: int | None, given: int | None, used: int, tmp_path: Path
) -> None:
    cfg = dataclasses.replace(_tiny(tmp_path / "data"), num_workers=in_config)
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=given)
    assert loader.num_workers == used
    want = list(TokenLoader(functools.partial(build_pipeline, cfg), num_workers=used))
    got = list(loader)
    assert [b["input_ids"].tolist() for b in got] == [b["input_ids"].tolist() for b in want]


def test_a_bad_config_num_workers_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^num_workers=-1 must be >= 0"):
        PipelineConfig(data_path="/data", num_workers=-1)


# -- config errors with worker processes (issue 44 item 13) --------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"seq_length": 10**9}, r"^seq_length=1000000000, shuffle_buffer=3 and batch_size=2 need "
                                r"at least 72\.0 GB of memory per pipeline .*; lower seq_length, "
                                r"shuffle_buffer or batch_size$"),
        ({"logical_shards": 1}, r"^n_logical_shards=1 must be >= the number of global workers "
                                r"\(ranks x dataloader workers = 2\); raise n_logical_shards$"),
        ({"logical_shards": 10**6}, r"^n_logical_shards=1000000 must be <= the number of "
                                    r"documents \(\d+\); lower n_logical_shards \(or add data\)$"),
    ],
)  # fmt: skip
def test_config_errors_with_workers_are_the_one_line_of_the_training_process(
    change: dict[str, int], message: str, tmp_path: Path
) -> None:
    cfg = dataclasses.replace(_tiny(tmp_path / "data"), **change)
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
    with pytest.raises(ValueError, match=message) as e:
        next(iter(loader))
    assert "\n" not in str(e.value) and "worker process" not in str(e.value)
    assert loader._running.workers is None  # no worker process was started


# -- a restore with the tokenizer changed (issue 44 item 17) -------------------------------------
@pytest.mark.parametrize("saved, now", [("byte", None), (None, "byte")])
def test_a_restore_with_the_tokenizer_added_or_removed_names_tokenizer(
    saved: str | None, now: str | None, tmp_path: Path
) -> None:
    """Token data that prepare wrote with the byte tokenizer reads with tokenizer 'byte' or
    None; a Tokenize node is in the graph only with one, so a checkpoint of the other is
    refused, naming the field (before: the places of the readers, never the tokenizer)."""
    for k in range(2):
        write_jsonl(
            str(tmp_path / "text" / f"t{k}.jsonl"), [f"text number {i} " * 5 for i in range(20)]
        )
    prepare(str(tmp_path / "text"), str(tmp_path / "tok" / "web"), tokenizer="byte", progress=False)
    cfg = PipelineConfig(data_path=str(tmp_path / "tok"), datasets="web", seq_length=16,
                         logical_shards=4, batch_size=2, shuffle_buffer=3, tokenizer=saved)  # fmt: skip
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    next(iter(loader))
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    loader.close()
    other = TokenLoader(functools.partial(build_pipeline, dataclasses.replace(cfg, tokenizer=now)))
    with pytest.raises(ValueError) as e:
        load_checkpoint(other, str(tmp_path / "ckpt"))
    n_then, n_now = (1, 0) if saved else (0, 1)
    nodes = {0: "0 nodes", 1: "1 node"}
    assert str(e.value) == (
        f"cannot restore checkpoint {tmp_path / 'ckpt'}: the checkpoint's pipeline has other "
        f"nodes than this one: tokenizer (Tokenize nodes) differs (checkpoint {nodes[n_then]}, "
        f"now {nodes[n_now]}; a Tokenize node is in the graph for each dataset when tokenizer "
        "is set, for token data too). A node cannot be added or removed across a checkpoint: "
        "restore with the checkpoint's tokenizer, or start a new run"
    )
