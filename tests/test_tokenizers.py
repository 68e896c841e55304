"""``tokenizers.load_tokenizer``: the one loader behind the pipeline config and prepare/inspect."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchdata_ext.tokenizers import ByteTokenizer, load_tokenizer


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_byte_tokenizer_with_the_callers_offset(offset: int) -> None:
    tok = load_tokenizer("byte", byte_offset=offset)
    assert isinstance(tok, ByteTokenizer) and tok.offset == offset
    assert tok.encode("aé").tolist() == [97 + offset, 0xC3 + offset, 0xA9 + offset]


def test_pipeline_and_prepare_keep_their_byte_offsets(tmp_path: Path) -> None:
    """The pipeline's byte tokenizer maps byte b to b, prepare's (default) to b + 1."""
    from torchdata_ext import prepare
    from torchdata_ext.pipeline import PipelineConfig, build_pipeline
    from torchdata_ext.testing import write_jsonl

    write_jsonl(str(tmp_path / "web" / "a.jsonl"), ["hi"])
    cfg = PipelineConfig(datasets=["web"], data_path=str(tmp_path), weights=[1.0],
                         file_type="jsonl", col_name="text", tokenizer="byte", seq_length=2,
                         shift=False, logical_shards=1, eos_token=None, shuffle_buffer=1)  # fmt: skip
    root = build_pipeline(cfg, collate=False)
    root.reset(None)
    assert next(root)["input_ids"].tolist() == [ord("h"), ord("i")]
    res = prepare(str(tmp_path / "web"), str(tmp_path / "out"), progress=False)
    assert res.tokens == 2
    import pyarrow as pa

    with pa.ipc.open_file(res.outputs[0]) as f:
        assert f.get_batch(0).column(0).to_pylist() == [ord("h") + 1, ord("i") + 1]


def test_a_tokenizer_json_loads_as_a_hugging_face_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 3}, "[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    loaded = load_tokenizer(str(tmp_path / "tok.json"), byte_offset=1)  # offset ignored
    assert isinstance(loaded, tokenizers.Tokenizer) and loaded.encode("a").ids == [3]


def test_missing_file_and_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer='.*nope.json': no such file"):
        load_tokenizer(str(tmp_path / "nope.json"), byte_offset=0)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install 'torchdata-ext\[text\]'"):
        load_tokenizer(str(tmp_path / "nope.json"), byte_offset=0)
