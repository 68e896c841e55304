"""``torchdata-ext prepare`` and ``inspect``: exact contents, resume after SIGKILL, parts."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torchdata_ext.cli import inspect_dataset, main, prepare
from torchdata_ext.prepare_data.tokenize_text import split_inputs
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.testing import (
    write_arrow_batches,
    write_ceped_npy,
    write_flat_tokens,
    write_jsonl,
    write_parquet,
)
from torchdata_ext.tokenizers.load import ByteTokenizer

TOK = ByteTokenizer(offset=1)


def _texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "eta", "θ"]
    return [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(n)]


def _make_inputs(root: Path, n_files: int = 6) -> list[str]:
    """Mixed-format inputs; returns all texts in prepare's order (sorted names, empty skipped)."""
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {}
    for f in range(n_files):
        texts = _texts(f, 5 + f)
        kind = f % 4
        if kind == 0:
            name = f"f{f:02d}.jsonl"
            write_jsonl(str(root / name), [*texts, ""])
        elif kind == 1:
            name = f"f{f:02d}.jsonl.gz"
            write_jsonl(str(root / name), texts)
        elif kind == 2:
            name = f"f{f:02d}.parquet"
            write_parquet(str(root / name), texts, col_name="text")
        else:
            name = f"f{f:02d}.txt"
            texts = ["\n\n".join(texts)]
            (root / name).write_text(texts[0], encoding="utf-8")
        out[name] = texts
    return [t for name in sorted(out) for t in out[name] if t]


def _read_docs(folder: Path, file_type: str = "arrow") -> list[list[int]]:
    options = {"eos_token": 0} if file_type == "flat" else {}
    index = DatasetIndex.build(str(folder), file_type=file_type, handler_options=options)
    h = index.handler()
    docs: list[list[int]] = []
    for url in index.files:
        r = h.open(url)
        docs.extend(np.asarray(h.get(r, i)).tolist() for i in range(h.length(r)))
        h.close(r)
    return docs


def _bytes_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part*"))}


@pytest.mark.parametrize("fmt", ["arrow", "npy"])
def test_prepare_documents_equal_tokenized_inputs(tmp_path: Path, fmt: str) -> None:
    texts = _make_inputs(tmp_path / "in")
    res = prepare(
        str(tmp_path / "in"), str(tmp_path / "out"), format=fmt, max_tokens_per_file=300,
        progress=False,
    )  # fmt: skip
    eos = [0] if fmt == "npy" else []
    expected = [TOK.encode(t).tolist() + eos for t in texts]
    got = _read_docs(tmp_path / "out", "flat" if fmt == "npy" else "arrow")
    assert got == expected
    assert res.documents == len(texts) and res.tokens == sum(map(len, expected))
    assert len(res.outputs) > 3  # split by --max-tokens-per-file
    counts = (tmp_path / "out" / "meta" / "torchdata_ext_counts.csv").read_text().splitlines()
    assert len(counts) == 1 + len(res.outputs)
    if fmt == "npy":
        listed = (tmp_path / "out" / "data_sources.txt").read_text().split()
        assert listed == [os.path.basename(p) for p in res.outputs]  # relative to the folder
        assert np.load(res.outputs[0]).dtype == np.uint16
        assert DatasetIndex.build(str(tmp_path / "out" / "data_sources.txt"), file_type="flat",
                                  handler_options={"eos_token": 0}).total_docs == len(texts)  # fmt: skip


def test_prepare_num_proc_gives_identical_bytes_and_rerun_is_a_no_op(tmp_path: Path) -> None:
    _make_inputs(tmp_path / "in", 8)
    prepare(str(tmp_path / "in"), str(tmp_path / "a"), max_tokens_per_file=250, progress=False)
    prepare(str(tmp_path / "in/*"), str(tmp_path / "b"), max_tokens_per_file=250, num_proc=2,
            progress=False)  # fmt: skip
    assert _bytes_of(tmp_path / "a") == _bytes_of(tmp_path / "b")
    again = prepare(str(tmp_path / "in"), str(tmp_path / "a"), max_tokens_per_file=250,
                    progress=False)  # fmt: skip
    assert again.skipped and again.documents == 0


def test_prepare_refuses_other_settings_in_the_same_folder(tmp_path: Path) -> None:
    _make_inputs(tmp_path / "in", 2)
    prepare(str(tmp_path / "in"), str(tmp_path / "o"), progress=False)
    with pytest.raises(ValueError, match="max_tokens_per_file"):
        prepare(str(tmp_path / "in"), str(tmp_path / "o"), max_tokens_per_file=7, progress=False)


def test_shard_parts_together_equal_the_whole(tmp_path: Path) -> None:
    texts = _make_inputs(tmp_path / "in", 7)
    whole = prepare(str(tmp_path / "in"), str(tmp_path / "whole"), progress=False)
    names = []
    for k in range(3):
        res = prepare(str(tmp_path / "in"), str(tmp_path / "parts"), shard_id=k, num_shards=3,
                      max_tokens_per_file=400, progress=False)  # fmt: skip
        mine = [os.path.basename(u) for u in res.outputs]
        assert mine and all(n.startswith(f"part{k:05d}_") for n in mine)
        names += mine
    assert len(set(names)) == len(names)
    assert _read_docs(tmp_path / "parts") == _read_docs(tmp_path / "whole")
    assert len(_read_docs(tmp_path / "parts")) == whole.documents == len(texts)
    letters = [str(i) for i in range(10)]
    assert [x for k in range(3) for x in split_inputs(letters, k, 3)] == letters


def test_sigkill_mid_run_then_resume_gives_the_same_shards(tmp_path: Path) -> None:
    _make_inputs(tmp_path / "in", 12)
    common = ["--max-tokens-per-file", "200", "--no-progress"]
    prepare(str(tmp_path / "in"), str(tmp_path / "ref"), max_tokens_per_file=200, progress=False)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torchdata_ext", "prepare", str(tmp_path / "in"), "--out",
           str(out), *common, "--slow-for-tests", "0.3"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    progress = out / "_progress_part00000.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["next_output"] >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(progress.read_text())
    assert not state["done"]
    partial = _bytes_of(out)
    ref = _bytes_of(tmp_path / "ref")
    assert len(partial) < len(ref)
    # only complete files under final names, each identical to the uninterrupted run's
    assert all(ref[name] == data for name, data in partial.items())
    assert main(["prepare", str(tmp_path / "in"), "--out", str(out), *common]) == 0
    assert _bytes_of(out) == ref
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def _run_inspect(path: str, **kw: object) -> str:
    buf = io.StringIO()
    inspect_dataset(path, out=buf, **kw)  # type: ignore[arg-type]
    return buf.getvalue()


def _check_summary(text: str, docs: list[Any]) -> None:
    assert f"documents: {len(docs):,}" in text
    assert f"tokens:    {sum(map(len, docs)):,}" in text


def test_inspect_every_format(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 300, int(rng.integers(1, 200))).tolist() for _ in range(9)]
    write_arrow_batches(str(tmp_path / "arrow/a.arrow"), docs[:4])
    write_arrow_batches(str(tmp_path / "arrow/b.arrow"), docs[4:])
    write_parquet(str(tmp_path / "pq/a.parquet"), docs, row_group_size=3)
    write_ceped_npy(str(tmp_path / "ceped/a.npy"), docs)
    flat = write_flat_tokens(str(tmp_path / "flat/a.npy"), docs, eos_token=0)
    for fmt, expected in (("arrow", docs), ("pq", docs), ("ceped", docs), ("flat", flat)):
        path = str(tmp_path / fmt)
        want = [d.tolist() if hasattr(d, "tolist") else d for d in expected]
        _check_summary(_run_inspect(path), want)
        shown = _run_inspect(path, doc=5)
        assert f"tokens ({len(want[5])}): {want[5]}" in shown
    shown = _run_inspect(str(tmp_path / "arrow"), file="b.arrow", doc=1)
    assert f"tokens ({len(docs[5])}): {docs[5]}" in shown and "document 1" in shown
    assert not (tmp_path / "arrow" / "meta").exists()  # inspect is read-only

    texts = ["héllo", "", "a longer document " * 10]
    write_jsonl(str(tmp_path / "js/a.jsonl"), texts)
    summary = _run_inspect(str(tmp_path / "js"))
    assert "documents: 3" in summary and f"characters: {sum(map(len, texts))}" in summary
    shown = _run_inspect(str(tmp_path / "js"), doc=0, tokenizer="byte")
    assert "héllo" in shown and str(TOK.encode("héllo").tolist()) in shown


def test_cli_prepare_then_inspect_decodes(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "in/x.jsonl"), ["first", "second doc ü"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(
        [sys.executable, "-m", "torchdata_ext", "prepare", str(tmp_path / "in"), "--out",
         str(tmp_path / "o"), "--format", "npy"],  # fmt: skip
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "torchdata_ext", "inspect", str(tmp_path / "o"), "--doc", "1",
         "--tokenizer", "byte"],  # fmt: skip
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert "second doc ü" in res.stdout
    assert str(TOK.encode("second doc ü").tolist() + [0]) in res.stdout
    assert main(["inspect", str(tmp_path / "o"), "--doc", "5"]) == 2  # out of range: clear error


def test_command_line_doc_lists_every_flag_of_batches(capsys) -> None:
    """docs/command-line.md's `batches` section names exactly the flags `batches --help` has."""
    import re

    with pytest.raises(SystemExit) as exit_info:
        main(["batches", "--help"])
    assert exit_info.value.code == 0
    helped = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", capsys.readouterr().out)) - {"--help"}
    doc = (Path(__file__).parent.parent / "docs" / "command-line.md").read_text()
    section = doc.split("## `batches`", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", table)) == helped
    assert {"--steps", "--rank", "--ranks", "--workers", "--parquet", "--key"} <= helped
