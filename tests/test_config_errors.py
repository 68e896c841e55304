"""A ``PipelineConfig`` user's mistakes, named in the config's own terms: the file and line of a
syntax error, and the ``tokenizer`` key that text data needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torchdata_ext import World
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_arrow_batches, write_jsonl, write_parquet


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    bad = tmp_path / "train.yaml"
    bad.write_text("data_path: /data\nseq_length: [4096\nbatch_size: 8\n")
    with pytest.raises(
        ValueError, match=r"train\.yaml: not valid YAML at line \d+, column \d+"
    ) as e:
        PipelineConfig.from_file(str(bad))
    assert "<unicode string>" not in str(e.value) and "fix the config file" in str(e.value)


def test_a_json_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "train.json"
    bad.write_text('{"data_path": "/data",\n "seq_length": 4096,\n}')
    with pytest.raises(ValueError, match=r"train\.json: not valid JSON at line 3, column 1"):
        PipelineConfig.from_file(str(bad))


def _text_data(tmp_path: Path, kind: str) -> str:
    texts = [f"document {i}" for i in range(8)]
    if kind == "jsonl":
        write_jsonl(str(tmp_path / "prose" / "a.jsonl"), texts)
    else:
        write_parquet(str(tmp_path / "prose" / "a.parquet"), texts, col_name="text")
    return str(tmp_path)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_text_without_a_tokenizer_asks_for_the_tokenizer_key(tmp_path: Path, kind: str) -> None:
    cfg = PipelineConfig(
        data_path=_text_data(tmp_path, kind), datasets="prose", file_type=kind, col_name="text",
        seq_length=8, logical_shards=2, batch_size=1, shuffle_buffer=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"dataset 'prose' holds text .* set tokenizer") as e:
        build_pipeline(cfg, World())
    assert "tokenize node" not in str(e.value) and f"prose/a.{kind}" in str(e.value)
    build_pipeline(PipelineConfig(**{**cfg.to_dict(), "tokenizer": "byte"}), World())


def test_tokens_without_a_tokenizer_are_fine(tmp_path: Path) -> None:
    docs = [np.arange(1, 9, dtype=np.uint32)] * 4
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), docs)
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web", seq_length=8,
                         logical_shards=2, batch_size=1, shuffle_buffer=1)  # fmt: skip
    node = build_pipeline(cfg, World())
    node.reset()
    assert next(node)["input_ids"].shape == (1, 8)


def test_shuffle_fill_is_checked_and_reaches_the_buffer(tmp_path: Path) -> None:
    docs = [np.arange(1, 50, dtype=np.uint32)] * 8
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), docs)
    kw = dict(data_path=str(tmp_path), datasets="web", seq_length=8, eos_token=0,
              logical_shards=4, shuffle_buffer=3)  # fmt: skip
    with pytest.raises(ValueError, match=r"shuffle_fill='half' must be 'stream' or 'full'"):
        PipelineConfig(**kw, shuffle_fill="half")  # type: ignore[arg-type]
    for fill in ("stream", "full"):
        node = build_pipeline(PipelineConfig(**kw, shuffle_fill=fill), World())  # type: ignore[arg-type]
        assert node.source.fill == fill
    assert PipelineConfig(**kw).shuffle_fill == "stream"  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", ["1,1,2", ""])
def test_a_dataset_named_twice_is_refused_naming_it(tmp_path: Path, weights: str) -> None:
    # a dict of weights by name would keep one of web's weights and drop the other silently
    with pytest.raises(ValueError) as e:
        PipelineConfig(data_path=str(tmp_path), datasets="web,web,code", weights=weights)
    assert str(e.value) == (
        "datasets=['web', 'web', 'code'] names ['web'] more than once; list each dataset once "
        "(to read one more often, raise its weight)"
    )
    with pytest.raises(ValueError, match=r"names \['code', 'web'\] more than once"):
        PipelineConfig(data_path=str(tmp_path), datasets=["web", "code", "web", "code"])
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web,code", weights="1,2")
    assert cfg.dataset_weights == {"web": 1.0, "code": 2.0}


@pytest.mark.parametrize(
    "value, error, message",
    [
        (-1, ValueError, "mix_quantum_tokens=-1 must be >= 0"),
        (2.5, TypeError, "mix_quantum_tokens=2.5 must be an integer"),
        (True, TypeError, "mix_quantum_tokens=True must be an integer"),
    ],
)
def test_a_bad_mix_quantum_is_refused_by_its_config_name(value, error, message) -> None:
    with pytest.raises(error) as e:
        PipelineConfig(data_path="/data", datasets=["a", "b"], mix_quantum_tokens=value)
    assert str(e.value) == message  # the config field, not Interleave's quantum_tokens


def test_mix_quantum_zero_and_none_are_accepted() -> None:
    assert PipelineConfig(data_path="/data", mix_quantum_tokens=0).mix_quantum_tokens == 0
    assert PipelineConfig(data_path="/data").mix_quantum_tokens is None
