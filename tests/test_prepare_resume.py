"""Issue 44 item 21, second half: ``prepare`` keeps its progress inside a large input file.

One JSONL input of 3,000 documents, read 200 records at a time (``chunk_documents``): a
subprocess is SIGKILLed after it wrote two outputs and before it finished that one file; the
resumed run (from the document the progress record names, at its record) ends with outputs
byte-identical to an uninterrupted run's and tokenizes only what was not written. A progress
record written before it recorded the record index resumes the same (the file read from its
start). Peak memory against the input's size is measured in ``benchmarks/prepare_memory.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from harness import write_jsonl

from torchdata_ext import prepare

N_DOCS = 3000
KW = {"max_tokens_per_file": 20_000, "progress": False}

_RUN = """
import sys
import torchdata_ext
torchdata_ext.prepare(sys.argv[1], sys.argv[2], max_tokens_per_file=20_000, progress=False,
                      chunk_documents=200, slow_for_tests=0.25)
"""


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """The input file, an uninterrupted run's outputs (the whole file as one range) and the
    texts."""
    tmp = tmp_path_factory.mktemp("prepare_resume")
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "ü", ""]
    texts = [" ".join(rng.choice(words, 1 + int(rng.integers(0, 30)))) for _ in range(N_DOCS)]
    texts[7] = texts[1500] = ""  # empty texts are skipped, and do not shift positions
    write_jsonl(str(tmp / "in" / "big.jsonl"), texts)
    prepare(str(tmp / "in"), str(tmp / "ref"), chunk_documents=10**6, **KW)
    return tmp / "in", tmp / "ref", texts


def _outputs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part*.arrow"))}


def _documents(folder: Path) -> list[list[int]]:
    docs = []
    for p in sorted(folder.glob("part*.arrow")):
        with pa.ipc.open_file(str(p)) as f:
            docs += [
                f.get_batch(i).column("tokens").to_pylist() for i in range(f.num_record_batches)
            ]
    return docs


def _killed_mid_file(inputs: Path, out: Path, outputs: int = 2) -> dict:
    """Run prepare in a subprocess and SIGKILL it once ``out`` holds ``outputs`` outputs; its
    progress."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN, str(inputs), str(out)], stderr=subprocess.PIPE
    )
    progress = out / "_progress_part00000.json"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if progress.exists() and json.loads(progress.read_text())["next_output"] >= outputs:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    return json.loads(progress.read_text())


def test_a_kill_inside_a_file_resumes_there_with_the_same_outputs(big_input, tmp_path) -> None:
    inputs, ref, texts = big_input
    kept = sum(1 for t in texts if t)
    out = tmp_path / "killed"
    state = _killed_mid_file(inputs, out)
    # killed inside the one input file, with outputs of it written
    assert (state["input"], state["done"]) == (0, False) and 0 < state["doc"] < kept
    assert 0 < state["record"] < N_DOCS and state["next_output"] >= 2
    # the next output starts at that document, and its record holds it
    assert state["doc"] == sum(1 for t in texts[: state["record"]] if t) and texts[state["record"]]
    partial = _outputs(out)
    assert partial and all(_outputs(ref)[n] == b for n, b in partial.items())
    # killed again, resumed from inside the file: its record moved on, consistently
    again = _killed_mid_file(inputs, out, state["next_output"] + 2)
    assert again["input"] == 0 and state["record"] < again["record"] < N_DOCS
    assert again["doc"] == sum(1 for t in texts[: again["record"]] if t)
    res = prepare(str(inputs), str(out), chunk_documents=200, **KW)
    assert res.resumed
    assert _outputs(out) == _outputs(ref)
    assert _documents(out) == _documents(ref) and len(_documents(ref)) == kept
    # only the documents not written before the kill were tokenized again
    assert res.documents == kept - again["documents"] == kept - again["doc"]


def test_a_progress_record_without_the_record_index_resumes_the_same(big_input, tmp_path) -> None:
    inputs, ref, _ = big_input
    out = tmp_path / "old"
    state = _killed_mid_file(inputs, out)
    del state["record"]  # as an earlier version wrote it
    (out / "_progress_part00000.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    res = prepare(str(inputs), str(out), chunk_documents=200, **KW)
    assert res.resumed and _outputs(out) == _outputs(ref)


@pytest.mark.parametrize(("chunk", "procs"), [(7, 1), (1000, 1), (150, 2)])
def test_the_outputs_do_not_depend_on_the_range_size(big_input, tmp_path, chunk, procs) -> None:
    inputs, ref, texts = big_input
    kept = sum(1 for t in texts if t)
    res = prepare(str(inputs), str(tmp_path / "o"), chunk_documents=chunk, data_fraction=0.5,
                  seed=3, min_length=10, num_proc=procs, **KW)  # fmt: skip
    whole = prepare(str(inputs), str(tmp_path / "w"), chunk_documents=10**6, data_fraction=0.5,
                    seed=3, min_length=10, **KW)  # fmt: skip
    assert _outputs(tmp_path / "o") == _outputs(tmp_path / "w")
    assert (res.documents, res.sampled_out, res.too_short, res.empty) == (
        whole.documents,
        whole.sampled_out,
        whole.too_short,
        whole.empty,
    ) and 0 < res.documents < kept / 2


def test_chunk_documents_must_be_a_whole_number(big_input, tmp_path) -> None:
    inputs, _, _ = big_input
    with pytest.raises(ValueError, match=r"chunk_documents=0 must be a whole number >= 1"):
        prepare(str(inputs), str(tmp_path / "o"), chunk_documents=0, **KW)


def test_a_parquet_input_read_in_ranges_gives_the_same_outputs(big_input, tmp_path) -> None:
    """Ranges across row groups (100 rows each) of a Parquet file, one row group decoded at a
    time, give what the whole file in one range gives."""
    import pyarrow.parquet as pq

    _, _, texts = big_input
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "in" / "big.parquet"),
                   row_group_size=100)  # fmt: skip
    res = prepare(str(tmp_path / "in"), str(tmp_path / "o"), chunk_documents=130, **KW)
    whole = prepare(str(tmp_path / "in"), str(tmp_path / "w"), chunk_documents=10**6, **KW)
    assert _outputs(tmp_path / "o") == _outputs(tmp_path / "w")
    assert res.documents == whole.documents == sum(1 for t in texts if t)
