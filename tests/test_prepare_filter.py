"""``prepare`` as the Bolmo and CEPED scripts are used: a seeded sample of the documents
(``data_fraction``/``seed``), length filters, and ``data_sources.txt`` read back by the loader.

Each test checks the documents written (decoded back to their texts), not only counts."""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_ext
from torchdata_ext import PipelineConfig, World, build_pipeline
from torchdata_ext.cli import main
from torchdata_ext.prepare_data.filter import DocFilter
from torchdata_ext.prepare_data.tokenize_text import PrepareResult
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_jsonl, write_parquet

_M64 = (1 << 64) - 1


def in_sample(seed: int, name: str, record: int, fraction: float) -> bool:
    """The documented rule, written out in plain Python (an independent reference): SplitMix64
    of (sha256 key of seed + file name, record index) as a number in [0, 1), below fraction."""
    digest = hashlib.sha256(f"{seed}\0prepare:data_fraction\0{name}".encode()).digest()
    x = ((record * 0x9E3779B97F4A7C15) & _M64) ^ int.from_bytes(digest[:8], "little")
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return (x >> 11) / 2.0**53 < fraction


def make_inputs(root: Path) -> dict[str, list[str]]:
    """JSONL, Parquet and .txt inputs; {file name: its records' texts, empty ones included}."""
    files: dict[str, list[str]] = {}
    for f in range(5):
        texts = ["" if j % 9 == 4 else f"f{f} d{j} " + "x" * (j % 7) for j in range(40)]
        name = f"f{f}.parquet" if f == 2 else f"f{f}.jsonl"
        if f == 2:
            write_parquet(str(root / name), texts, col_name="text")
        else:
            write_jsonl(str(root / name), texts)
        files[name] = texts
    for t in range(2):
        (root / f"t{t}.txt").write_text(f"text file {t}", encoding="utf-8")
        files[f"t{t}.txt"] = [f"text file {t}"]
    return files


def expected(files: dict[str, list[str]], seed: int, fraction: float) -> list[str]:
    """The texts a sample keeps, in prepare's order (sorted file names, record order)."""
    return [
        t
        for name in sorted(files)
        for j, t in enumerate(files[name])
        if t and in_sample(seed, name, j, fraction)
    ]


def texts_of(outputs: list[str]) -> list[str]:
    """The documents of Arrow or npy (EOS 0) outputs, decoded (byte tokenizer, offset 1)."""
    docs: list[np.ndarray] = []
    for p in outputs:
        if p.endswith(".arrow"):
            with pa.ipc.open_file(p) as r:
                docs += [r.get_batch(i).column(0).to_numpy() for i in range(r.num_record_batches)]
        else:
            flat = np.load(p)
            assert flat[-1] == 0
            docs += np.split(flat[:-1], np.flatnonzero(flat[:-1] == 0))
            docs = [d[d != 0] for d in docs]
    return [bytes((d.astype(np.int64) - 1).astype(np.uint8)).decode() for d in docs]


@pytest.fixture()
def inputs(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path / "in"
    return root, make_inputs(root)


def run_parts(src: str, out: Path, num_shards: int, **kw) -> list[PrepareResult]:
    return [
        torchdata_ext.prepare(
            src,
            str(out),
            shard_id=k,
            num_shards=num_shards,
            progress=False,
            max_tokens_per_file=60,
            **kw,
        )  # fmt: skip
        for k in range(num_shards)
    ]


@pytest.mark.parametrize(("num_proc", "num_shards"), [(1, 1), (2, 1), (1, 3), (2, 4)])
def test_the_sample_is_the_same_whatever_processes_and_parts(
    inputs, tmp_path: Path, num_proc: int, num_shards: int
) -> None:
    root, files = inputs
    out = tmp_path / "out"
    results = run_parts(str(root), out, num_shards, num_proc=num_proc, data_fraction=0.3, seed=7)
    want = expected(files, 7, 0.3)
    assert texts_of([p for r in results for p in r.outputs]) == want
    nonempty = sum(1 for ts in files.values() for t in ts if t)
    assert 0.2 * nonempty < len(want) < 0.4 * nonempty  # about 30% of 167
    assert sum(r.documents for r in results) == len(want)
    assert sum(r.sampled_out for r in results) == nonempty - len(want)
    assert all(r.too_short == r.too_long == 0 for r in results)
    config = json.loads((out / "_progress_part00000.json").read_text())["config"]
    assert (config["data_fraction"], config["seed"]) == (0.3, 7)


def test_the_sample_depends_on_the_seed_and_file_names_not_on_the_folder(
    inputs, tmp_path: Path
) -> None:
    root, files = inputs
    a = run_parts(str(root), tmp_path / "a", 1, data_fraction=0.5, seed=1)[0]
    moved = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(root, moved)
    b = run_parts(str(moved), tmp_path / "b", 1, data_fraction=0.5, seed=1)[0]
    c = run_parts(str(root), tmp_path / "c", 1, data_fraction=0.5, seed=2)[0]
    assert texts_of(a.outputs) == texts_of(b.outputs) == expected(files, 1, 0.5)
    assert texts_of(c.outputs) == expected(files, 2, 0.5) != texts_of(a.outputs)
    # a smaller fraction of the same seed keeps a subset (one uniform number per document)
    small = run_parts(str(root), tmp_path / "s", 1, data_fraction=0.2, seed=1)[0]
    assert set(texts_of(small.outputs)) < set(texts_of(a.outputs))


def test_length_filters_count_tokens_without_eos(tmp_path: Path) -> None:
    texts = ["a" * n for n in (1, 2, 3, 4, 5, 6, 7, 8)] + ["é"]  # é: 2 byte tokens
    write_jsonl(str(tmp_path / "in.jsonl"), texts)
    res = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), format="npy",
                                min_length=2, max_length=5, progress=False)  # fmt: skip
    # the npy documents carry EOS 0 (6 tokens for "aaaaa"), which the range does not count
    assert texts_of(res.outputs) == ["aa", "aaa", "aaaa", "aaaaa", "é"]
    assert np.load(res.outputs[0]).tolist()[-3:] == [0xC3 + 1, 0xA9 + 1, 0]
    assert (res.documents, res.too_short, res.too_long, res.sampled_out) == (5, 1, 3, 0)
    only_min = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "m"),
                                     min_length=7, progress=False)  # fmt: skip
    assert texts_of(only_min.outputs) == ["a" * 7, "a" * 8]
    assert (only_min.too_short, only_min.too_long) == (7, 0)


def test_sample_then_lengths_counted_separately(inputs, tmp_path: Path) -> None:
    root, files = inputs
    res = run_parts(str(root), tmp_path / "o", 1, data_fraction=0.6, seed=3, min_length=9,
                    max_length=11)[0]  # fmt: skip
    sampled = expected(files, 3, 0.6)
    lengths = [len(t.encode()) for t in sampled]
    assert texts_of(res.outputs) == [t for t, n in zip(sampled, lengths) if 9 <= n <= 11]
    assert res.too_short == sum(n < 9 for n in lengths) > 0
    assert res.too_long == sum(n > 11 for n in lengths) > 0
    assert res.sampled_out == sum(1 for ts in files.values() for t in ts if t) - len(sampled)


def test_an_interrupted_sampled_part_resumes_to_the_same_bytes(
    inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchdata_ext.prepare_data.tokenize_text as prepare_data

    root, _ = inputs
    kw = dict(data_fraction=0.4, seed=5, min_length=8)
    ref = run_parts(str(root), tmp_path / "ref", 1, **kw)[0]
    assert len(ref.outputs) > 4
    real, writes = prepare_data.write_bytes_atomic, []

    def failing(url: str, data: bytes, storage_options: object = None) -> None:
        writes.append(url)
        if len(writes) == 7:  # three outputs and their progress are written
            raise OSError("disk gone")
        real(url, data, storage_options)  # type: ignore[arg-type]

    out = tmp_path / "o"
    monkeypatch.setattr(prepare_data, "write_bytes_atomic", failing)
    with pytest.raises(OSError, match="disk gone"):
        run_parts(str(root), out, 1, **kw)
    monkeypatch.undo()
    progress = json.loads((out / "_progress_part00000.json").read_text())
    assert progress["next_output"] == 3 and progress["doc"] > 0  # inside a file, after sampling
    res = run_parts(str(root), out, 1, **kw)[0]
    assert res.resumed and res.outputs == [str(out / Path(p).name) for p in ref.outputs]
    assert [Path(p).read_bytes() for p in res.outputs] == [
        Path(p).read_bytes() for p in ref.outputs
    ]


def test_progress_records_the_filters_and_old_progress_files_resume(inputs, tmp_path: Path) -> None:
    root, _ = inputs
    out = tmp_path / "o"
    run_parts(str(root), out, 1, data_fraction=0.5, seed=1)
    for other, names in [
        (dict(data_fraction=0.6, seed=1), "data_fraction"),
        (dict(data_fraction=0.5, seed=2), "seed"),
        (dict(data_fraction=0.5, seed=1, max_length=10), "max_length"),
    ]:
        with pytest.raises(ValueError, match=rf"different settings \({names}\)"):
            run_parts(str(root), out, 1, **other)
    assert run_parts(str(root), out, 1, data_fraction=0.5, seed=1)[0].skipped
    # a progress file written before these options existed resumes as an unfiltered run
    plain = tmp_path / "plain"
    run_parts(str(root), plain, 1)
    ppath = plain / "_progress_part00000.json"
    saved = json.loads(ppath.read_text())
    assert saved["config"]["seed"] is None  # the seed is recorded only when it samples
    for key in ("data_fraction", "seed", "min_length", "max_length"):
        del saved["config"][key]
    ppath.write_text(json.dumps(saved))
    assert run_parts(str(root), plain, 1, seed=99)[0].skipped  # the seed without a sample
    with pytest.raises(ValueError, match=r"different settings \(min_length\)"):
        run_parts(str(root), plain, 1, min_length=3)


def test_parts_of_one_folder_must_share_the_sample(inputs, tmp_path: Path) -> None:
    root, _ = inputs
    out = tmp_path / "o"
    kw = dict(shard_id=0, num_shards=2, progress=False)
    torchdata_ext.prepare(str(root), str(out), data_fraction=0.5, seed=1, **kw)
    kw["shard_id"] = 1
    with pytest.raises(ValueError, match=r"\(_progress_part00000.json: data_fraction=0.5, seed=1\)"
                       r".* pass the same data_fraction, seed or use another"):  # fmt: skip
        torchdata_ext.prepare(str(root), str(out), data_fraction=0.6, seed=2, **kw)
    assert not list(out.glob("part00001_*"))
    torchdata_ext.prepare(str(root), str(out), data_fraction=0.5, seed=1, **kw)  # the same: fine


def test_a_part_that_keeps_nothing_warns_and_finishes(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "in.jsonl"), ["short", "tiny"])
    with pytest.warns(UserWarning, match=r"none of the 2 documents .* 2 longer than max_length=3"):
        res = torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "o"),
                                    max_length=3, progress=False)  # fmt: skip
    assert (res.outputs, res.documents, res.too_long) == ([], 0, 2)
    assert json.loads((tmp_path / "o" / "_progress_part00000.json").read_text())["done"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"data_fraction": 0.0}, ValueError, r"data_fraction=0.0 must be a number in \(0, 1\]"),
        ({"data_fraction": 1.5}, ValueError, r"data_fraction=1.5 must be"),
        ({"data_fraction": True}, ValueError, r"data_fraction=True must be"),
        ({"seed": "1"}, TypeError, r"seed='1' must be an integer"),
        ({"min_length": -1}, ValueError, r"min_length=-1 must be >= 0"),
        ({"max_length": 0}, ValueError, r"max_length=0 must be >= 1"),
        ({"min_length": 5, "max_length": 4}, ValueError, r"min_length=5 > max_length=4"),
    ],
)
def test_bad_filter_arguments_write_nothing(
    inputs, tmp_path: Path, kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        torchdata_ext.prepare(str(inputs[0]), str(tmp_path / "o"), progress=False, **kwargs)
    assert not (tmp_path / "o").exists()


def test_cli_flags_summary_and_errors(inputs, tmp_path: Path, capsys) -> None:
    root, files = inputs
    out = tmp_path / "o"
    argv = ["prepare", str(root), "--out", str(out), "--data-fraction", "0.5", "--seed", "4",
            "--min-length", "8", "--max-length", "12"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    sampled = expected(files, 4, 0.5)
    kept = [t for t in sampled if 8 <= len(t.encode()) <= 12]
    assert texts_of(printed["outputs"]) == kept
    assert printed["sampled_out"] == sum(len([t for t in ts if t]) for ts in files.values()) - len(
        sampled
    )
    assert printed["too_short"] + printed["too_long"] == len(sampled) - len(kept)
    empty = sum(len([t for t in ts if not t]) for ts in files.values())
    assert printed["empty"] == empty > 0
    assert (
        f"left out: {empty} empty, {printed['sampled_out']} not in the sample, "
        f"{printed['too_short']} too short, {printed['too_long']} too long\n" in captured.err
    )
    assert main(["prepare", str(root), "--out", str(tmp_path / "x"), "--data-fraction", "0"]) == 2
    assert "error: --data-fraction 0.0 must be a number in (0, 1]" in capsys.readouterr().err
    assert main(["prepare", str(root), "--out", str(tmp_path / "x"), "--min-length", "9",
                 "--max-length", "3"]) == 2  # fmt: skip
    assert "error: --min-length 9 > --max-length 3: no document" in capsys.readouterr().err
    assert main(argv[:-1] + ["13"]) == 2
    assert "different settings (--max-length)" in capsys.readouterr().err


def _pipeline_documents(cfg: PipelineConfig) -> list[tuple[int, ...]]:
    """Every document the pipeline delivers, rebuilt from its sequences' provenance."""
    pieces: dict[tuple[int, int], list[tuple[int, list[int]]]] = collections.defaultdict(list)
    for seq in build_pipeline(cfg, World(0, 1, 0, 1), collate=False):
        ids, at = seq["input_ids"].tolist(), 0
        for ds, file, doc, start, n in seq["provenance"].tolist():
            if ds not in (LITERAL, PAD):
                pieces[file, doc].append((start, ids[at : at + n]))
            at += n
    return [tuple(t for _, p in sorted(pieces[k]) for t in p) for k in sorted(pieces)]


def test_data_sources_lists_relative_names_the_pipeline_reads_back(
    inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, files = inputs
    monkeypatch.chdir(tmp_path)  # a relative out folder, as in Bolmo's ./data/bolmo_test
    results = run_parts(str(root), Path("data/bolmo_test"), 2, format="npy", data_fraction=0.5,
                        seed=11, min_length=9)  # fmt: skip
    listed = (tmp_path / "data/bolmo_test/data_sources.txt").read_text()
    assert listed.endswith("\n") and "\n\n" not in listed
    names = listed.splitlines()
    # names relative to the list's folder, one per line, every part's files in order (the
    # last part lists all)
    assert names == [Path(p).name for r in results for p in r.outputs]
    paths = [str(tmp_path / "data/bolmo_test" / n) for n in names]
    assert len(paths) > 3 and all(Path(p).is_file() for p in paths)
    kept = [t for t in expected(files, 11, 0.5) if len(t.encode()) >= 9]
    assert texts_of(paths) == kept
    cfg = PipelineConfig(
        data_path=str(tmp_path / "data/bolmo_test/data_sources.txt"), file_type="flat",
        eos_token=0, seq_length=16, shift=False, batch_size=1, logical_shards=4,
        shuffle_buffer=1, epochs=1, output_keys="input_ids,provenance",
    )  # fmt: skip
    got = collections.Counter(_pipeline_documents(cfg))
    want = collections.Counter(tuple(b + 1 for b in t.encode()) + (0,) for t in kept)
    assert sum(got.values()) == len(kept) > 20
    # each prepared document once, with the EOS that ends it in the flat file
    assert got == want


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(-(2**40), 2**40),
    name=st.text("abcxyz0123._-", min_size=1, max_size=12),
    records=st.lists(st.integers(0, 10**9), max_size=40),
    cut=st.integers(0, 40),
    fractions=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)).map(sorted),
)
def test_the_sample_rule_is_elementwise_nested_and_as_documented(
    seed: int, name: str, records: list[int], cut: int, fractions: list[float]
) -> None:
    small, large = (DocFilter(f, seed) for f in fractions)
    arr = np.array(records, dtype=np.int64)
    whole = small.sampled(f"/any/folder/{name}", arr)
    # the same per document however the records are batched, and wherever the file lives
    parts = [small.sampled(f"s3://b/{name}", arr[:cut]), small.sampled(name, arr[cut:])]
    assert np.array_equal(whole, np.concatenate(parts))
    assert whole.tolist() == [in_sample(seed, name, r, fractions[0]) for r in records]
    assert not (whole & ~large.sampled(name, arr)).any()  # a smaller fraction: a subset
