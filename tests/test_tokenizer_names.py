"""Tokenizers by Hugging Face model name, from a local cache only (built here: no download).

The cache is a temporary folder in the Hugging Face hub layout
(``models--owner--name/refs/main``, ``snapshots/<rev>/tokenizer.json``) with a tiny WordPiece
tokenizer whose post-processor adds ``[CLS]``/``[SEP]``, so the tests see the exact ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import torchdata_ext
from torchdata_ext.cli import main
from torchdata_ext.testing import write_jsonl
from torchdata_ext.tokenizers.load import load_tokenizer
from torchdata_ext.tokenizers.names import is_model_name

tokenizers = pytest.importorskip("tokenizers")

NAME = "tiny-org/tiny-tok"
TEXTS = ["hello worlds", "world", "hello unknown"]
# [CLS]=1 ... [SEP]=2 around each text; "unknown" is [UNK]=0
IDS = [[1, 3, 4, 5, 2], [1, 4, 2], [1, 3, 0, 2]]


def tiny_tokenizer():
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    return tok


def snapshot(cache: Path, name: str = NAME, rev: str = "0123abcd") -> Path:
    """The snapshot folder of ``name`` in a hub-layout ``cache``, with refs/main pointing at it."""
    repo = cache / f"models--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    return snap


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty local Hugging Face cache in use, offline (and no tokenizer loaded before)."""
    from huggingface_hub import constants

    import torchdata_ext.prepare_data.tokenize_inputs as tokenize_inputs

    monkeypatch.setattr(tokenize_inputs, "_TOKENIZERS", {})  # prepare loads a spec once per process

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


@pytest.fixture()
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError


def arrow_docs(paths: list[str]) -> list[list[int]]:
    docs = []
    for p in paths:
        with pa.ipc.open_file(p) as r:
            docs += [r.get_batch(i).column(0).to_pylist() for i in range(r.num_record_batches)]
    return docs


def prepare_by_name(tmp_path: Path, name: str = NAME) -> torchdata_ext.PrepareResult:
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    return torchdata_ext.prepare(
        str(tmp_path / "in.jsonl"), str(tmp_path / "out"), tokenizer=name, progress=False
    )


@pytest.mark.parametrize(
    ("spec", "is_name"),
    [
        ("gpt2", True),
        ("allenai/dolma2-tokenizer", True),
        ("meta-llama/Llama-2-7b-hf", True),
        ("tokenizer.json", False),
        ("models/tok.JSON", False),
        ("s3://bucket/tok", False),
        ("/abs/tok", False),
        ("./tok", False),
        ("a/b/c", False),
        ("../x", False),
    ],
)
def test_what_counts_as_a_model_name(spec: str, is_name: bool) -> None:
    assert is_model_name(spec) is is_name


def test_a_cached_tokenizer_json_without_transformers(
    cache: Path, tmp_path: Path, no_transformers: None
) -> None:
    tiny_tokenizer().save(str(snapshot(cache) / "tokenizer.json"))
    assert isinstance(load_tokenizer(NAME, byte_offset=1), tokenizers.Tokenizer)
    res = prepare_by_name(tmp_path)
    assert arrow_docs(res.outputs) == IDS
    config = json.loads((tmp_path / "out" / "_progress_part00000.json").read_text())["config"]
    assert config["tokenizer"] == NAME


def test_a_cached_model_through_transformers(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    snap = snapshot(cache)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), unk_token="[UNK]"
    )
    fast.save_pretrained(str(snap))
    (snap / "config.json").write_text(json.dumps({"model_type": "bert"}))  # AutoTokenizer reads it
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append((a, k)) or real(*a, **k))  # fmt: skip
    loaded = load_tokenizer(NAME, byte_offset=1)
    assert isinstance(loaded, tokenizers.Tokenizer)  # the fast tokenizer's backend
    assert calls and calls[0][0] == (NAME,) and calls[0][1]["local_files_only"] is True
    assert [e.ids for e in loaded.encode_batch(TEXTS)] == fast(TEXTS)["input_ids"] == IDS
    assert arrow_docs(prepare_by_name(tmp_path).outputs) == IDS


@pytest.mark.parametrize("with_transformers", [False, True])
def test_a_name_not_in_the_cache_is_a_clear_error(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, with_transformers: bool
) -> None:
    if with_transformers:
        pytest.importorskip("transformers")
    else:
        monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(FileNotFoundError, match=rf"tokenizer='org/absent': no such file, and .*"
                       rf"local .*cache {cache}.* never downloads"):  # fmt: skip
        prepare_by_name(tmp_path, "org/absent")
    assert not (tmp_path / "out").exists()
    argv = ["prepare", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o2"), "--tokenizer",
            "org/absent"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchdata-ext prepare: error: --tokenizer org/absent: no such file")
    assert "hf download org/absent" in err


def test_a_cached_model_without_tokenizer_json_needs_transformers(
    cache: Path, tmp_path: Path, no_transformers: None
) -> None:
    (snapshot(cache) / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        FileNotFoundError, match=r"has no tokenizer.json .*torchdata-ext\[transformers\]"
    ):
        prepare_by_name(tmp_path)


def test_a_missing_path_is_still_a_missing_file(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file; pass 'byte' or the path"):
        load_tokenizer(str(tmp_path / "nope" / "tokenizer.json"), byte_offset=1)
