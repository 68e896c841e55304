"""``tokenizers.load_tokenizer``: the one loader behind the pipeline config and prepare/inspect."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from torchdata_ext.tokenizers.load import DEFAULT_BYTE_OFFSET, ByteTokenizer, load_tokenizer


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_byte_tokenizer_with_the_callers_offset(offset: int) -> None:
    tok = load_tokenizer("byte", byte_offset=offset)
    assert isinstance(tok, ByteTokenizer) and tok.offset == offset
    assert tok.encode("aé").tolist() == [97 + offset, 0xC3 + offset, 0xA9 + offset]


def _pipeline_ids(tmp_path: Path, data: str, **kw: Any) -> list[int]:
    """The tokens of the one sequence the pipeline packs from the dataset folder
    ``tmp_path/data`` (one document of exactly 8 tokens, EOS included: no padding)."""
    from torchdata_ext.pipeline.build import build_pipeline
    from torchdata_ext.pipeline.config import PipelineConfig

    cfg = PipelineConfig(data_path=str(tmp_path), datasets=[data], seq_length=8, shift=False,
                         logical_shards=1, shuffle_buffer=1, epochs=1, **kw)  # fmt: skip
    root = build_pipeline(cfg, collate=False)
    root.reset(None)
    seqs = list(root)
    assert len(seqs) == 1
    return [int(t) for t in seqs[0]["input_ids"]]


@pytest.mark.parametrize("byte_offset", [None, 4])
def test_the_same_text_gives_the_same_ids_through_config_and_prepare(
    tmp_path: Path, byte_offset: int | None
) -> None:
    """ "byte" is one tokenizer: on the fly (config) and ahead of time (prepare, read back by
    the pipeline and by reading the shard) the ids are byte + byte_offset (default 1) and
    EOS 0 is no byte, not even the NUL byte."""
    import pyarrow as pa

    from torchdata_ext import prepare
    from torchdata_ext.testing import write_jsonl

    text = "hi @\x00é"  # 7 bytes
    offset = {} if byte_offset is None else {"byte_offset": byte_offset}
    want = [b + (byte_offset or 1) for b in text.encode()]
    write_jsonl(str(tmp_path / "web" / "a.jsonl"), [text])
    on_the_fly = _pipeline_ids(
        tmp_path, "web", file_type="jsonl", col_name="text", tokenizer="byte", **offset
    )
    res = prepare(str(tmp_path / "web"), str(tmp_path / "prep"), progress=False, **offset)
    with pa.ipc.open_file(res.outputs[0]) as f:
        assert f.get_batch(0).column(0).to_pylist() == want
    ahead = _pipeline_ids(tmp_path, "prep", file_type="arrow")
    assert on_the_fly == ahead == [*want, 0]  # EOS 0 appended by the pipeline
    tok = load_tokenizer("byte", **offset)
    assert tok.decode(ahead) == text and tok.offset == (byte_offset or 1)
    assert ByteTokenizer().offset == DEFAULT_BYTE_OFFSET == 1


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


def test_worker_threads_share_the_cores() -> None:
    from torchdata_ext.tokenizers.load import worker_threads

    assert [worker_threads(w, cores=2) for w in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert worker_threads(4, cores=16) == 4


@pytest.mark.multiprocess
def test_tokenizer_threads_are_limited_in_workers_unless_the_user_set_them(monkeypatch) -> None:

    from torchdata_ext.loader.token_loader import TokenLoader
    from torchdata_ext.tokenizers.load import limit_tokenizer_threads, worker_threads

    for var in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(var, raising=False)
    assert limit_tokenizer_threads(2, cores=2) == 1
    assert os.environ["RAYON_NUM_THREADS"] == "1"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("RAYON_NUM_THREADS", "7")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    assert limit_tokenizer_threads(2, cores=2) is None and os.environ["RAYON_NUM_THREADS"] == "7"
    monkeypatch.delenv("RAYON_NUM_THREADS")
    # each dataloader worker builds its graph with its share of the cores set
    got = list(TokenLoader(_env_seen, num_workers=2))
    assert got == [str(worker_threads(2))] * 2
    assert "RAYON_NUM_THREADS" not in os.environ  # this process is left alone


def _env_seen(world) -> Any:
    from torchdata.nodes import IterableWrapper

    return IterableWrapper([os.environ.get("RAYON_NUM_THREADS")])
