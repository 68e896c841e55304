"""``torchdata_ext.prepare`` through its Python API: exact files, documents, counts, progress."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import torchdata_ext
from torchdata_ext.prepare_data.tokenize_text import PrepareResult
from torchdata_ext.testing import write_jsonl, write_parquet


def _ids(text: str, offset: int = 1) -> list[int]:
    """What prepare's byte tokenizer makes of ``text`` (byte ``b`` -> ``b + offset``)."""
    return [b + offset for b in text.encode("utf-8")]


def _arrow_docs(path: str | Path) -> list[list[int]]:
    """The documents of one Arrow output, checking its layout (one ``uint16`` column: the
    smallest dtype that holds these tests' vocabularies)."""
    with pa.ipc.open_file(str(path)) as reader:
        assert reader.schema == pa.schema([("tokens", pa.uint16())])
        return [reader.get_batch(i).column(0).to_pylist() for i in range(reader.num_record_batches)]


def _outputs(out: Path, n: int, suffix: str = ".arrow", part: int = 0) -> list[str]:
    return [str(out / f"part{part:05d}_{k:05d}{suffix}") for k in range(n)]


def _counts(out: Path) -> list[tuple[str, int, int]]:
    """``(file, documents, tokens)`` rows of the counts file."""
    lines = (out / "meta" / "torchdata_ext_counts.csv").read_text().splitlines()
    assert lines[0] == "dataset/filename,documents,tokens,bytes"
    return [(f, int(d), int(t)) for f, d, t, _ in (row.split(",") for row in lines[1:])]


@pytest.fixture()
def inputs(tmp_path: Path) -> Path:
    """One input of each kind; prepare reads them sorted: a.jsonl, b.txt, c.parquet."""
    root = tmp_path / "in"
    write_jsonl(str(root / "a.jsonl"), ["ab", "", "cdé"])  # the empty text is skipped
    (root / "b.txt").write_text("x\ny", encoding="utf-8")  # one document: the whole file
    write_parquet(str(root / "c.parquet"), ["pq1", "pq22"], col_name="text")
    (root / "ignored.csv").write_text("not an input")
    return root


TEXTS = ["ab", "cdé", "x\ny", "pq1", "pq22"]


def test_arrow_files_documents_counts_and_progress(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    # ab (2 tokens) | cdé (4) | x\ny (3) | pq1 (3) | pq22 (4): no two fit in 4 tokens together
    assert res == PrepareResult(out=str(out), outputs=_outputs(out, 5), documents=5, tokens=16,
                                empty=1, total_documents=5, total_tokens=16)  # fmt: skip
    assert [_arrow_docs(p) for p in res.outputs] == [[_ids(t)] for t in TEXTS]
    names = [Path(p).name for p in res.outputs]
    assert _counts(out) == [(n, 1, len(_ids(t))) for n, t in zip(names, TEXTS)]
    progress = json.loads((out / "_progress_part00000.json").read_text())
    assert {k: progress[k] for k in ("done", "next_output", "input", "doc")} == {
        "done": True, "next_output": 5, "input": 3, "doc": 0,
    }  # fmt: skip
    assert progress["config"]["byte_offset"] == 1 and progress["config"]["eos_token"] is None
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*names, "_progress_part00000.json", "meta"]
    )


def test_files_fill_up_to_the_cap_and_a_long_document_stands_alone(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "in.jsonl"), ["ab", "c", "0123456789", "d", "ef", "g"])
    out = tmp_path / "out"
    res = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(out), max_tokens_per_file=4,
                                progress=False)  # fmt: skip
    assert [_arrow_docs(p) for p in res.outputs] == [
        [_ids("ab"), _ids("c")],
        [_ids("0123456789")],  # longer than the cap: a file of its own, never split
        [_ids("d"), _ids("ef"), _ids("g")],
    ]


def test_npy_flat_tokens_with_eos_and_data_sources(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "npy"
    res = torchdata_ext.prepare(str(inputs), str(out), format="npy", max_tokens_per_file=9,
                                progress=False)  # fmt: skip
    docs = [_ids(t) + [0] for t in TEXTS]  # EOS 0 after every document
    # 3+5 | 4+4 | 5 tokens
    assert res == PrepareResult(out=str(out), outputs=_outputs(out, 3, ".npy"), documents=5,
                                tokens=21, empty=1, total_documents=5, total_tokens=21)  # fmt: skip
    arrays = [np.load(p) for p in res.outputs]
    assert all(a.dtype == np.uint16 and a.ndim == 1 for a in arrays)
    assert [a.tolist() for a in arrays] == [docs[0] + docs[1], docs[2] + docs[3], docs[4]]
    # names relative to the list's folder: the folder can move (tests/test_npy_move.py)
    assert (out / "data_sources.txt").read_text() == "".join(
        Path(p).name + "\n" for p in res.outputs
    )
    assert _counts(out) == [("part00000_00000.npy", 2, 8), ("part00000_00001.npy", 2, 8),
                            ("part00000_00002.npy", 1, 5)]  # fmt: skip


def test_byte_offset_and_explicit_eos(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "in.jsonl"), ["hé", "yo"])
    res = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), byte_offset=4,
                                eos_token=2, progress=False)  # fmt: skip
    assert _arrow_docs(res.outputs[0]) == [_ids("hé", 4) + [2], _ids("yo", 4) + [2]]


def test_an_eos_inside_a_document_is_refused(tmp_path: Path) -> None:
    """An EOS the byte tokenizer can emit is refused before reading (byte_offset=0 makes the NUL
    byte id 0); one that the tokenizer adds itself (its own special token, allowed as EOS) is
    caught in the document that holds it."""
    tokenizers = pytest.importorskip("tokenizers")
    write_jsonl(str(tmp_path / "in.jsonl"), ["fine", "nul \x00 inside"])
    with pytest.raises(ValueError, match=r"eos_token=0 is an ordinary token \(byte 0x00\)"):
        torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), format="npy",
                              byte_offset=0, progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "fine": 1}, "[UNK]"))
    tok.add_special_tokens(["</s>"])  # id 2
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 2)]
    )
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match=r"document 0 contains eos_token=2 \(the tokenizer"):
        torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), format="npy",
                              tokenizer=str(tmp_path / "tok.json"), eos_token=2, progress=False)  # fmt: skip


def test_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 7}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    write_jsonl(str(tmp_path / "in.jsonl"), ["hello world", "world elsewhere"])
    out = tmp_path / "o"
    res = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(out),
                                tokenizer=str(tmp_path / "tok.json"), progress=False)  # fmt: skip
    assert _arrow_docs(res.outputs[0]) == [[5, 7], [7, 0]]
    config = json.loads((out / "_progress_part00000.json").read_text())["config"]
    assert config["tokenizer"] == str(tmp_path / "tok.json") and config["byte_offset"] is None


def test_parts_split_the_sorted_inputs(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "parts"
    results = [
        torchdata_ext.prepare(str(inputs), str(out), shard_id=k, num_shards=3, progress=False)
        for k in range(3)
    ]
    # one input file per part: a.jsonl (2 documents), b.txt (1), c.parquet (2)
    assert [(r.documents, r.outputs) for r in results] == [
        (2, _outputs(out, 1, part=0)), (1, _outputs(out, 1, part=1)), (2, _outputs(out, 1, part=2)),
    ]  # fmt: skip
    assert [d for r in results for d in _arrow_docs(r.outputs[0])] == [_ids(t) for t in TEXTS]
    # more parts than files: part 0 of 5 gets files [0, 3 * 1 // 5) = none
    empty = torchdata_ext.prepare(str(inputs), str(tmp_path / "e"), shard_id=0, num_shards=5,
                                  progress=False)  # fmt: skip
    assert empty == PrepareResult(out=str(tmp_path / "e"), total_documents=0, total_tokens=0)


def test_a_finished_part_is_skipped(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    first = torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    again = torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    assert again == PrepareResult(out=str(out), outputs=first.outputs, resumed=True, skipped=True,
                                  total_documents=5, total_tokens=16)  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_an_interrupted_part_resumes_where_it_stopped(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchdata_ext.prepare_data.tokenize_text as prepare_data

    ref = torchdata_ext.prepare(str(inputs), str(tmp_path / "ref"), max_tokens_per_file=4,
                                progress=False)  # fmt: skip
    real, writes = prepare_data.write_bytes_atomic, []

    def failing(url: str, data: bytes, storage_options: object = None) -> None:
        writes.append(url)
        if len(writes) == 5:  # outputs 0 and 1 and their progress are written, then a failure
            raise OSError("disk gone")
        real(url, data, storage_options)  # type: ignore[arg-type]

    out = tmp_path / "o"
    monkeypatch.setattr(prepare_data, "write_bytes_atomic", failing)
    with pytest.raises(OSError, match="disk gone"):
        torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    monkeypatch.undo()
    progress = json.loads((out / "_progress_part00000.json").read_text())
    assert (progress["next_output"], progress["input"], progress["doc"]) == (2, 1, 0)
    res = torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    # only x\ny, pq1 and pq22 are tokenized again
    assert res == PrepareResult(out=str(out), outputs=_outputs(out, 5), documents=3, tokens=10,
                                resumed=True, total_documents=5, total_tokens=16)  # fmt: skip
    assert [(tmp_path / "ref" / Path(p).name).read_bytes() for p in ref.outputs] == [
        Path(p).read_bytes() for p in res.outputs
    ]


_KILL_AT_RENAME = """
import os, signal, sys
import torchdata_ext
calls = []
def kill_at_third(*args, **kwargs):
    calls.append(args)
    if len(calls) == 3:  # output 1 is written and synced under its temporary name
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
real = os.replace
os.replace = os.rename = kill_at_third
torchdata_ext.prepare(sys.argv[1], sys.argv[2], max_tokens_per_file=4, progress=False)
"""


def test_a_temporary_file_left_by_a_kill_is_removed_on_resume(inputs: Path, tmp_path: Path) -> None:
    ref = torchdata_ext.prepare(str(inputs), str(tmp_path / "ref"), max_tokens_per_file=4,
                                progress=False)  # fmt: skip
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-c", _KILL_AT_RENAME, str(inputs), str(out)])
    assert proc.returncode == -9
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and hidden[0].startswith(".part00000_00001.arrow")
    res = torchdata_ext.prepare(str(inputs), str(out), max_tokens_per_file=4, progress=False)
    assert res.resumed and res.documents == 4
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert [Path(p).read_bytes() for p in res.outputs] == [
        (tmp_path / "ref" / Path(p).name).read_bytes() for p in ref.outputs
    ]


def test_memory_filesystem(tmp_path: Path) -> None:
    import fsspec

    root = f"memory://prepare-{uuid.uuid4().hex}"
    write_jsonl(f"{root}/in/a.jsonl", ["one", "two"])
    try:
        res = torchdata_ext.prepare(f"{root}/in", f"{root}/out", format="npy", progress=False)
        fs = fsspec.filesystem("memory")
        url = f"memory:///{root.removeprefix('memory://')}/out/part00000_00000.npy"
        assert res.outputs == [url]
        with fs.open(url, "rb") as f:
            assert np.load(f).tolist() == _ids("one") + [0] + _ids("two") + [0]
        assert fs.cat(f"{root}/out/data_sources.txt").decode() == "part00000_00000.npy\n"
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "csv"}, "format='csv' must be 'arrow', 'npy' or 'mds'"),
        ({"shard_id": 2, "num_shards": 2}, "shard_id=2 must be in 0..num_shards=2-1"),
        ({"num_shards": 0}, r"num_shards=0 must be >= 1 \(the number of parts"),
        ({"max_tokens_per_file": 0}, "max_tokens_per_file=0 must be >= 1"),
        ({"num_proc": 0}, "num_proc=0 must be >= 1"),
    ],
)
def test_bad_arguments(inputs: Path, tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torchdata_ext.prepare(str(inputs), str(tmp_path / "o"), progress=False, **kwargs)


def test_other_settings_in_the_same_folder_are_refused(inputs: Path, tmp_path: Path) -> None:
    torchdata_ext.prepare(str(inputs), str(tmp_path / "o"), progress=False)
    with pytest.raises(ValueError, match=r"different settings \(byte_offset, eos_token\)"):
        torchdata_ext.prepare(str(inputs), str(tmp_path / "o"), byte_offset=3, eos_token=1,
                              progress=False)  # fmt: skip


def test_a_token_column_is_not_text(tmp_path: Path) -> None:
    write_parquet(str(tmp_path / "in.parquet"), [[1, 2], [3]], col_name="text")
    with pytest.raises(ValueError, match="holds tokens, not text"):
        torchdata_ext.prepare(str(tmp_path / "in.parquet"), str(tmp_path / "o"), progress=False)


def test_an_input_changed_since_the_progress_record_is_refused(
    inputs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    first = torchdata_ext.prepare(str(inputs), str(out), progress=False)
    assert first.documents == 5
    record = json.loads((out / "_progress_part00000.json").read_text())
    assert [s[0] for s in record["input_stats"]] == [
        (inputs / n).stat().st_size for n in ("a.jsonl", "b.txt", "c.parquet")
    ]
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with open(inputs / "a.jsonl", "a", encoding="utf-8") as f:  # the file grows by a document
        f.write(json.dumps({"text": "new"}) + "\n")
    with pytest.raises(ValueError) as err:
        torchdata_ext.prepare(str(inputs), str(out), progress=False)
    assert str(err.value) == (
        f"input file(s) {inputs / 'a.jsonl'} changed (size or modification time) since part 0 "
        f"was prepared from them into {out} (_progress_part00000.json): its outputs hold their "
        "old content. To prepare them again, delete _progress_part00000.json and its "
        "part00000_* files (or use another out folder) and run prepare again"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # the fix the message gives: the part is prepared again, the new document in it
    for p in out.iterdir():
        if p.name == "_progress_part00000.json" or p.name.startswith("part00000_"):
            p.unlink()
    again = torchdata_ext.prepare(str(inputs), str(out), progress=False)
    assert (again.documents, again.resumed, again.skipped) == (6, False, False)
    assert torchdata_ext.prepare(str(inputs), str(out), progress=False).skipped
