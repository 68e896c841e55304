"""``torchdata_ext.inspect_dataset`` through its Python API: what it returns and prints."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import torchdata_ext
from torchdata_ext.audit.inspect_data import histogram
from torchdata_ext.testing import write_arrow_batches, write_flat_tokens, write_jsonl

DOCS = [[5, 6, 7], [8], list(range(1, 21)), [9, 9], []]  # lengths 3, 1, 20, 2, 0


def _inspect(path: Path | str, **kw: Any) -> tuple[dict[str, Any], str]:
    buf = io.StringIO()
    result = torchdata_ext.inspect_dataset(str(path), out=buf, **kw)
    return result, buf.getvalue()


@pytest.fixture()
def arrow(tmp_path: Path) -> Path:
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), DOCS[:2])
    write_arrow_batches(str(tmp_path / "web" / "b.arrow"), DOCS[2:])
    return tmp_path / "web"


def test_summary_of_a_token_dataset(arrow: Path) -> None:
    result, text = _inspect(arrow)
    assert result == {
        "dataset": "web",
        "format": "arrow",
        "files": 2,
        "documents": 5,
        "tokens": 26,
        "characters": None,
        "histogram": [("[0, 16)", 4), ("[16, 128)", 1), ("[128, 1024)", 0),
                      ("[1024, 8192)", 0), ("[8192, 65536)", 0), (">= 65536", 0)],
        "prepared": None,  # no metadata file: not written by prepare
    }  # fmt: skip
    assert text.splitlines() == [
        "dataset:   web (arrow)",
        "files:     2",
        "documents: 5",
        "tokens:    26",
        "document length (tokens): min 0, median 2, mean 5.2, max 20",
        "           [0, 16)          4 " + "#" * 40,
        "         [16, 128)          1 " + "#" * 10,
        "       [128, 1024)          0 ",
        "      [1024, 8192)          0 ",
        "     [8192, 65536)          0 ",
        "          >= 65536          0 ",
    ]
    assert not (arrow / "meta").exists()  # read-only: no counts file


def test_summary_of_a_text_dataset_counts_characters(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "t" / "a.jsonl"), ["héllo", "", "x" * 20])
    result, text = _inspect(tmp_path / "t")
    assert (result["format"], result["documents"], result["tokens"], result["characters"]) == (
        "jsonl", 3, None, 25,
    )  # fmt: skip
    assert result["histogram"][:2] == [("[0, 16)", 2), ("[16, 128)", 1)]
    assert "tokens:    unknown (text); characters: 25" in text.splitlines()
    assert "document length (characters): min 0, median 5, mean 8.3, max 20" in text


@pytest.mark.parametrize(
    ("kw", "file", "doc", "tokens"),
    [
        ({"doc": 0}, "a.arrow", 0, DOCS[0]),
        ({"doc": 2}, "b.arrow", 0, DOCS[2]),  # global index: a.arrow holds documents 0 and 1
        ({"doc": 4}, "b.arrow", 2, []),
        ({"file": "1", "doc": 1}, "b.arrow", 1, DOCS[3]),  # by position in the sorted files
        ({"file": "a.arrow", "doc": 1}, "a.arrow", 1, DOCS[1]),  # by name
        ({"file": "b.arrow"}, "b.arrow", 0, DOCS[2]),  # doc defaults to 0
    ],
)
def test_one_document(arrow: Path, kw: dict, file: str, doc: int, tokens: list[int]) -> None:
    result, text = _inspect(arrow, **kw)
    assert result == {"file": str(arrow / file), "doc": doc, "tokens": tokens}
    position = ["a.arrow", "b.arrow"].index(file)
    assert text.splitlines() == [
        f"file: {arrow / file} (file {position}), document {doc}",
        f"tokens ({len(tokens)}): {tokens}",
    ]


def test_tokens_decoded_with_the_byte_offset(tmp_path: Path) -> None:
    ids = [b + 1 for b in "dé".encode()]
    write_arrow_batches(str(tmp_path / "d" / "a.arrow"), [ids + [0]])  # EOS 0 is not a byte
    result, text = _inspect(tmp_path / "d", doc=0, tokenizer="byte")  # byte_offset=1
    assert result == {"file": str(tmp_path / "d" / "a.arrow"), "doc": 0, "tokens": ids + [0],
                      "text": "dé"}  # fmt: skip
    assert text.splitlines()[1:] == [f"tokens (4): {ids + [0]}", "text:", "dé"]
    assert _inspect(tmp_path / "d", doc=0, tokenizer="byte", byte_offset=0)[0]["text"] != "dé"


def test_text_encoded_with_the_tokenizer(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "t" / "a.jsonl"), ["one", "two\nlines"])
    result, text = _inspect(tmp_path / "t", doc=1, tokenizer="byte", byte_offset=2)
    tokens = [b + 2 for b in b"two\nlines"]
    assert result == {"file": str(tmp_path / "t" / "a.jsonl"), "doc": 1, "text": "two\nlines",
                      "tokens": tokens}  # fmt: skip
    assert text.splitlines()[1:] == [
        "text (9 characters):",
        "two",
        "lines",
        f"tokens (9): {tokens}",
    ]
    assert "tokens" not in _inspect(tmp_path / "t", doc=1)[0]


def test_flat_npy_listed_in_data_sources(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    write_flat_tokens(str(flat / "x.npy"), [[1, 2], [3]], eos_token=9)
    write_flat_tokens(str(flat / "y.npy"), [[4, 5, 6]], eos_token=9)
    write_flat_tokens(str(flat / "unlisted.npy"), [[7]], eos_token=9)
    (flat / "data_sources.txt").write_text(f"{flat / 'x.npy'}\n{flat / 'y.npy'}\n")
    result, _ = _inspect(flat, eos_token=9)
    assert (result["format"], result["files"], result["documents"], result["tokens"]) == (
        "npy", 2, 3, 9,
    )  # fmt: skip
    assert _inspect(flat, eos_token=9, doc=2)[0]["tokens"] == [4, 5, 6, 9]


def test_bad_document_or_file(arrow: Path) -> None:
    with pytest.raises(ValueError, match="^doc=5 is out of range: the dataset has 5$"):
        _inspect(arrow, doc=5)
    with pytest.raises(ValueError, match=r"^doc=2 is out of range: .*a.arrow has 2 docs"):
        _inspect(arrow, file="a.arrow", doc=2)
    with pytest.raises(ValueError, match=r"^file='.arrow' matches 0 of the dataset's files"):
        _inspect(arrow, file=".arrow", doc=0)


def test_prints_to_stdout_by_default(arrow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torchdata_ext.inspect_dataset(str(arrow), doc=1)
    assert capsys.readouterr().out.splitlines()[1] == "tokens (1): [8]"


def test_histogram_bucket_edges() -> None:
    lengths = np.array([0, 15, 16, 127, 128, 65535, 65536, 10**9])
    assert histogram(lengths) == [("[0, 16)", 2), ("[16, 128)", 2), ("[128, 1024)", 1),
                                  ("[1024, 8192)", 0), ("[8192, 65536)", 1), (">= 65536", 2)]  # fmt: skip
    assert histogram(np.array([1, 5, 9]), edges=[5]) == [("[0, 5)", 1), (">= 5", 2)]
