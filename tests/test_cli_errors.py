"""``torchdata-ext prepare`` / ``inspect`` given bad input: one clear line on stderr that names
the file, field or flag (CLI flags, never the Python parameters), exit code 2, and nothing of
the user's left damaged or behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torchdata_ext
from torchdata_ext.cli import main
from torchdata_ext.testing import write_arrow_batches, write_jsonl
from torchdata_ext.tokenizers.load import load_tokenizer

API_NAMES = (
    "col_name",
    "text_field",
    "_token=",
    "compression=",
    "encoding=",
    "tokenizer=",
    "storage_options",
    "out=",
)


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI in-process; it must exit 2 with one error line and no API names."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchdata-ext {argv[0]}: error: ") and err.count("\n") == 1, err
    for name in API_NAMES:  # (not inside a path, e.g. a test's tmp_path)
        assert not re.search(rf"(?<![\w/.-]){name}", err), f"{name!r} is a Python name: {err}"
    return err


@pytest.fixture()
def text_in(tmp_path: Path) -> Path:
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), ["hello", "world"])
    return tmp_path / "in"


def test_a_tokenizer_file_that_is_not_a_tokenizer(text_in: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "tok.txt"
    bad.write_text("not a tokenizer")
    out = tmp_path / "out"
    err = _fails(capsys, "prepare", str(text_in), "--out", str(out), "--tokenizer", str(bad))
    assert f"--tokenizer {bad} is not a Hugging Face tokenizer.json" in err
    assert not out.exists()
    with pytest.raises(ValueError, match=r"tokenizer='.*tok.txt' is not a Hugging Face"):
        load_tokenizer(str(bad), byte_offset=0)


@pytest.mark.parametrize("eos", ["8589934592", "-1"])
def test_an_eos_token_outside_uint32(text_in: Path, tmp_path: Path, capsys, eos: str) -> None:
    out = tmp_path / "out"
    err = _fails(capsys, "prepare", str(text_in), "--out", str(out), "--eos-token", eos)
    assert f"--eos-token {eos} must be a token id in 0..4294967295" in err
    assert not out.exists()
    with pytest.raises(ValueError, match=rf"eos_token={eos} must be a token id"):
        torchdata_ext.prepare(str(text_in), str(out), eos_token=int(eos), progress=False)


def test_out_naming_an_existing_file(text_in: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.txt"
    out.write_text("the user's file")
    err = _fails(capsys, "prepare", str(text_in), "--out", str(out))
    assert f"--out {out} is a file, not a folder" in err
    assert out.read_text() == "the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "results.txt"]


def test_a_missing_text_field_names_the_flag(text_in: Path, tmp_path: Path, capsys) -> None:
    err = _fails(capsys, "prepare", str(text_in), "--out", str(tmp_path / "o"),
                 "--text-field", "body")  # fmt: skip
    assert "has no field 'body'" in err and "pass --text-field ..." in err
    assert not (tmp_path / "o").exists()
    err = _fails(capsys, "inspect", str(text_in), "--col-name", "body")
    assert "has no field 'body'" in err and "pass --col-name ..." in err
    write_arrow_batches(str(tmp_path / "tok" / "a.arrow"), [[1, 2]])
    err = _fails(capsys, "inspect", str(tmp_path / "tok"), "--col-name", "ids")
    assert "column 'ids' not found" in err and "pass --col-name ..." in err


def test_a_compression_suffix_that_lies_names_the_flag(tmp_path: Path, capsys) -> None:
    plain = tmp_path / "in" / "a.jsonl.gz"
    plain.parent.mkdir()
    plain.write_text('{"text": "not gzipped"}\n')
    err = _fails(capsys, "prepare", str(plain), "--out", str(tmp_path / "o"))
    assert "is not gzip data" in err and "--compression none" in err
    err = _fails(capsys, "inspect", str(plain))
    assert "--compression none" in err
    assert main(["prepare", str(plain), "--out", str(tmp_path / "o"), "--compression", "none",
                 "--no-progress"]) == 0  # fmt: skip
    assert main(["inspect", str(plain), "--compression", "none", "--doc", "0"]) == 0
    assert "not gzipped" in capsys.readouterr().out
    err = _fails(capsys, "inspect", str(tmp_path / "o"), "--compression", "none")
    assert "--compression none applies to JSONL files only" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-shards", "0"], "--num-shards 0 must be >= 1 (the number of parts the inputs are "
                                "split into; 1: one)"),
        (["--num-shards", "-2"], "--num-shards -2 must be >= 1 (the number of parts the inputs "
                                 "are split into; 1: one)"),
        (["--shard-id", "3", "--num-shards", "2"], "--shard-id 3 must be in 0..--num-shards 2-1"),
        (["--shard-id", "-1", "--num-shards", "2"], "--shard-id -1 must be in 0..--num-shards 2-1"),
    ],
)  # fmt: skip
def test_a_part_out_of_range_is_refused_naming_the_flag(
    text_in: Path, tmp_path: Path, capsys, flags: list[str], message: str
) -> None:
    """Issue 44 item 21: --num-shards 0 was taken as 1."""
    out = tmp_path / "out"
    assert main(["prepare", str(text_in), "--out", str(out), "--tokenizer", "byte", *flags]) == 2
    assert capsys.readouterr().err == f"torchdata-ext prepare: error: {message}\n"
    assert not out.exists()


def test_an_input_with_no_documents(tmp_path: Path, capsys) -> None:
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), ["", ""])
    (tmp_path / "in" / "b.jsonl").write_text("")
    out = tmp_path / "out"
    err = _fails(capsys, "prepare", str(tmp_path / "in"), "--out", str(out))
    assert "no documents" in err and "2 input files" in err and "--text-field text" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="no documents"):
        torchdata_ext.prepare(str(tmp_path / "in"), str(out), progress=False)


def test_latin1_text_is_reported_and_read_with_encoding(tmp_path: Path, capsys) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes("café naïve".encode("latin-1"))
    (tmp_path / "in" / "b.txt").write_bytes("plain".encode("latin-1"))
    (tmp_path / "in" / "c.txt").write_bytes("déjà".encode("latin-1"))
    assert main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 0  # fmt: skip
    cap = capsys.readouterr()
    assert json.loads(cap.out)["undecodable_documents"] == 2
    assert (
        "torchdata-ext prepare: warning: 2 of 3 documents (in 2 files, the first "
        f"{tmp_path / 'in' / 'a.txt'}) are not valid utf-8" in cap.err
    )
    assert "with --encoding ... (e.g. --encoding latin-1" in cap.err and "encoding=" not in cap.err
    with pytest.warns(UnicodeWarning, match="with encoding=..."):
        torchdata_ext.prepare(str(tmp_path / "in"), str(tmp_path / "o2"), progress=False)
    assert main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o3"),
                 "--encoding", "latin-1", "--no-progress"]) == 0  # fmt: skip
    cap = capsys.readouterr()
    assert json.loads(cap.out)["undecodable_documents"] == 0 and "warning" not in cap.err
    got = torchdata_ext.inspect_dataset(str(tmp_path / "o3"), doc=0, tokenizer="byte")
    assert got["text"] == "café naïve"
    _fails(capsys, "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o4"),
           "--encoding", "martian")  # fmt: skip


@pytest.fixture()
def long_doc(tmp_path: Path) -> tuple[Path, list[int]]:
    doc = (np.arange(15_000) % 90 + 33).tolist()  # printable ASCII through the byte tokenizer
    write_arrow_batches(str(tmp_path / "long" / "a.arrow"), [doc, [65, 66]])
    return tmp_path / "long", doc


def test_inspect_doc_caps_tokens_and_text(long_doc, capsys) -> None:
    path, doc = long_doc
    assert main(["inspect", str(path), "--doc", "0", "--tokenizer", "byte"]) == 0
    out = capsys.readouterr().out
    assert f"tokens (15000): {doc[:1000]}"[:-1] + ", ... 14,000 more (--all shows all)]" in out
    assert str(doc[:1001])[:-1] not in out
    assert len(out) < 20_000 and "\n[... 5,000 more characters (--all shows all)]" in out
    assert main(["inspect", str(path), "--doc", "0", "--tokenizer", "byte", "--all"]) == 0
    out = capsys.readouterr().out
    assert f"tokens (15000): {doc}" in out and "--all" not in out
    with open(os.devnull, "w") as devnull:
        got = torchdata_ext.inspect_dataset(str(path), doc=0, tokenizer="byte", out=devnull)
    assert got["tokens"] == doc and len(got["text"]) == 15_000  # returned whole


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    write_arrow_batches(str(path / "a.arrow"), [np.full(200_000, 12345)])  # > a pipe's buffer
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchdata_ext", "inspect", str(path), "--doc", "0", "--all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(100)  # `| head -c 100`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err  # 128 + SIGPIPE, as `head` expects


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("pass col_name=...", "pass --text-field ..."),
        ("rename it or pass compression=None", "rename it or pass --compression none"),
        ("out='/a b/c' is a file", "--out '/a b/c' is a file"),
        ("different settings (byte_offset, eos_token)", "different settings (--byte-offset, --eos-token)"),
        ("/data/text_field/x.jsonl: bad", "/data/text_field/x.jsonl: bad"),  # a path stays
        ("the format of the file", "the format of the file"),  # prose stays
        ("check storage_options", "check --storage-options"),
    ],
)  # fmt: skip
def test_cli_message_speaks_in_flags(message: str, expected: str) -> None:
    from torchdata_ext.cli import _flags, _parser, cli_message

    assert cli_message(message, _flags(_parser(), "prepare")) == expected


def test_progress_of_an_earlier_version_still_resumes(text_in: Path, tmp_path: Path) -> None:
    """Progress files written before encoding/compression were settings match their defaults."""
    out = tmp_path / "out"
    torchdata_ext.prepare(str(text_in), str(out), progress=False)
    progress = out / "_progress_part00000.json"
    state = json.loads(progress.read_text())
    del state["config"]["encoding"], state["config"]["compression"]
    progress.write_text(json.dumps(state))
    assert torchdata_ext.prepare(str(text_in), str(out), progress=False).skipped
    with pytest.raises(ValueError, match=r"different settings \(encoding\)"):
        torchdata_ext.prepare(str(text_in), str(out), encoding="latin-1", progress=False)
