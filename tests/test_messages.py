"""Messages that used to mislead: each says what the thing is and what to do, in the terms of
the entry point it came from (Python argument names from the Python API, flags from the
command line)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline, inspect_dataset, prepare
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.testing import write_arrow_batches, write_jsonl


@pytest.fixture()
def tokens(tmp_path: Path) -> PipelineConfig:
    """A one-dataset Arrow corpus (20 documents) and a small config over it."""
    docs = [np.arange(5, 5 + 10 + k, dtype=np.uint32) for k in range(20)]
    write_arrow_batches(str(tmp_path / "data" / "web" / "a.arrow"), docs)
    return PipelineConfig(
        data_path=str(tmp_path / "data"), datasets="web", seq_length=8, logical_shards=4,
        batch_size=2, shuffle_buffer=2, eos_token=0,
    )  # fmt: skip


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchdata-ext {argv[0]}: error: ") and err.count("\n") == 1, err
    return err


def test_a_checkpoint_folder_that_does_not_exist_says_so(tokens, tmp_path: Path) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, tokens))
    next(iter(loader))
    save_checkpoint(loader, str(tmp_path / "ckpt" / "step_0"))
    missing = str(tmp_path / "ckpt" / "step_1000")
    said = (
        f"checkpoint folder {missing} does not exist (so no manifest.json): check the path "
        f"({tmp_path / 'ckpt'} holds: step_0)"
    )
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(TokenLoader(functools.partial(build_pipeline, tokens)), missing)
    assert str(err.value) == said
    with pytest.raises(FileNotFoundError) as err:
        audit_checkpoint(missing, tokens)
    assert str(err.value) == said
    # a folder that exists but holds no manifest: an unfinished save, as before
    (tmp_path / "ckpt" / "step_5").mkdir()
    with pytest.raises(FileNotFoundError, match="has no manifest.json: .*a kill during save"):
        audit_checkpoint(str(tmp_path / "ckpt" / "step_5"), tokens)


def test_inspect_on_a_checkpoint_folder_says_it_is_one(tokens, tmp_path: Path, capsys) -> None:
    loader = TokenLoader(functools.partial(build_pipeline, tokens))
    next(iter(loader))
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(loader, ckpt)
    said = (
        f"{ckpt} is a loader checkpoint folder (written by save_checkpoint), not a dataset: "
        "inspect the data it was taken of, or audit the checkpoint to see what the run "
        "consumed (torchdata_ext.audit_checkpoint, or the audit command)"
    )
    with pytest.raises(ValueError) as err:
        inspect_dataset(ckpt)
    assert str(err.value) == said
    assert _cli_error(capsys, "inspect", ckpt) == f"torchdata-ext inspect: error: {said}\n"


def test_prepare_on_a_token_file_says_what_it_is(tokens, tmp_path: Path, capsys) -> None:
    arrow = str(tmp_path / "data" / "web" / "a.arrow")
    out = tmp_path / "out"
    said = (
        f"{arrow} is a 'arrow' file, not text: prepare reads JSONL, Parquet or .txt text and "
        "writes token shards. A token file is already prepared: read it directly "
        "(DatasetIndex.build / PipelineConfig with file_type='arrow'), or pass the text it "
        "was made from"
    )
    with pytest.raises(ValueError) as err:
        prepare(arrow, str(out))
    assert str(err.value) == said
    assert _cli_error(capsys, "prepare", arrow, "--out", str(out)).endswith(f"error: {said}\n")
    assert not out.exists()


def test_eval_fraction_one_advises_lowering_it(tokens) -> None:
    cfg = PipelineConfig(**{**tokens.to_dict(), "eval_fraction": 1.0})
    with pytest.raises(ValueError) as err:
        next(iter(build_pipeline(cfg)))
    message = str(err.value)
    assert message.endswith(
        "eval_fraction=1.0 holds out every document; lower eval_fraction (training keeps the "
        "rest) or lower min_length"
    ), message
    assert "raise eval_fraction" not in message


def test_eval_seed_is_named_eval_seed(tokens) -> None:
    with pytest.raises(TypeError, match=r"^eval_seed='x' must be an integer$"):
        PipelineConfig(**{**tokens.to_dict(), "eval_fraction": 0.1, "eval_seed": "x"})


def test_a_prepare_part_without_input_files_says_so(tmp_path: Path, capsys) -> None:
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), ["hello"])
    with pytest.warns(UserWarning) as caught:
        result = prepare(str(tmp_path / "in"), str(tmp_path / "o1"), shard_id=0, num_shards=2)
    assert result.documents == 0
    assert [str(w.message) for w in caught] == [
        "part 0 of 2 got no input file: the 1 input file(s) are split among the parts by file, "
        "so parts beyond them have nothing to do; use num_shards=1 or fewer, or split the "
        "inputs into more files"
    ]
    argv = ["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o2")]
    assert main([*argv, "--shard-id", "0", "--num-shards", "2"]) == 0
    err = capsys.readouterr().err
    assert "torchdata-ext prepare: warning: part 0 of 2 got no input file: " in err
    assert "use --num-shards 1 or fewer" in err


def test_inspect_from_python_names_the_python_argument(tmp_path: Path, capsys) -> None:
    write_arrow_batches(str(tmp_path / "a.arrow"), [np.arange(2000) % 90 + 33])
    inspect_dataset(str(tmp_path / "a.arrow"), doc=0, tokenizer="byte")
    out = capsys.readouterr().out
    assert ", ... 1,000 more (full=True shows all)]" in out and "--all" not in out
    with pytest.raises(ValueError, match=r"^doc=1 is out of range: the dataset has 1$"):
        inspect_dataset(str(tmp_path / "a.arrow"), doc=1)
    assert _cli_error(capsys, "inspect", str(tmp_path / "a.arrow"), "--doc", "1").endswith(
        "error: --doc 1 is out of range: the dataset has 1\n"
    )
