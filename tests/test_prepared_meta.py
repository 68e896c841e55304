"""``prepare`` records how it tokenized (``meta/torchdata_ext_meta.json``, next to the counts);
the pipeline refuses a config that disagrees with it, naming both values and the file; inspect
decodes with it without flags; data without the file loads as before."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

import torchdata_ext
from torchdata_ext.cli import main
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.sources.index import COUNTS_FILE
from torchdata_ext.sources.prepared_meta import META_FILE
from torchdata_ext.testing import write_jsonl

TEXTS = ["first doc @ home", "second, with é", "third"]


@pytest.fixture()
def text_in(tmp_path: Path) -> Path:
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), TEXTS)
    return tmp_path / "in"


def _prepare(text_in: Path, out: Path, **kw: Any) -> Path:
    torchdata_ext.prepare(str(text_in), str(out), progress=False, **kw)
    return out


def _config(root: Path, name: str, **kw: Any) -> PipelineConfig:
    base: dict[str, Any] = {"data_path": str(root), "datasets": [name], "file_type": "arrow",
                            "seq_length": 8, "logical_shards": 1, "shuffle_buffer": 1}  # fmt: skip
    return PipelineConfig(**{**base, **kw})


def test_prepare_writes_the_metadata_next_to_the_counts(text_in: Path, tmp_path: Path) -> None:
    out = _prepare(text_in, tmp_path / "d", format="npy", byte_offset=4, eos_token=300)
    assert (out / "meta" / COUNTS_FILE).exists()
    assert json.loads((out / "meta" / META_FILE).read_text()) == {
        "meta_version": 1,
        "tokenizer": "byte",
        "byte_offset": 4,
        "tokenizer_sha256": None,
        "vocab_size": 301,  # EOS 300 is the largest id
        "ordinary_ids": [[4, 260]],
        "special_ids": [],
        "bos_token": None,
        "eos_token": 300,
        "dtype": "uint16",
        "format": "npy",
        "package_version": torchdata_ext.__version__,
    }
    assert not list((out / "meta").glob(".*"))  # atomic: no temporary file left


def test_a_config_that_disagrees_with_the_data_is_refused(text_in: Path, tmp_path: Path) -> None:
    npy = _prepare(text_in, tmp_path / "npy", format="npy")  # EOS 0 between documents
    arrow = _prepare(text_in, tmp_path / "arrow")  # no EOS written: the pipeline adds it
    meta_npy, meta_arrow = (str(p / "meta" / META_FILE) for p in (npy, arrow))
    flat = _config(tmp_path, "npy", file_type="flat", eos_token=5)
    with pytest.raises(ValueError) as err:
        build_pipeline(flat, collate=False)
    assert str(err.value) == (
        f"eos_token=5 but dataset 'npy' was prepared with eos_token=0 ({meta_npy}), which its "
        "documents already carry; set eos_token=0"
    )
    with pytest.raises(ValueError) as err:
        build_pipeline(_config(tmp_path, "arrow", tokenizer="byte", byte_offset=2), collate=False)
    assert str(err.value) == (
        "tokenizer='byte' (byte_offset=2) but dataset 'arrow' was prepared with the tokenizer "
        f"'byte' (byte_offset=1) ({meta_arrow}); use that tokenizer (and byte_offset), or "
        "prepare the data again with this one"
    )
    with pytest.raises(ValueError) as err:  # tokenized data: the metadata knows the bytes
        build_pipeline(_config(tmp_path, "arrow", pad_token=65), collate=False)
    assert str(err.value).startswith(
        f"pad_token=65 is an ordinary token (byte 0x40 '@') of the tokenizer 'byte' "
        f"(byte_offset=1) ({meta_arrow}): every one in the text would read as padding"
    )
    # what agrees is accepted (the tokenizer passes tokenized data through)
    ok = _config(tmp_path, "arrow", tokenizer="byte", epochs=1, shift=False, seq_length=99)
    tokens = _batches(ok)[0]["input_ids"].tolist()
    docs = bytes(t - 1 if t else 0 for t in tokens).rstrip(b"\0").split(b"\0")
    assert sorted(d.decode() for d in docs) == sorted(TEXTS)


def _batches(cfg: PipelineConfig) -> list[dict[str, Any]]:
    root = build_pipeline(cfg, collate=False)
    root.reset(None)
    return list(root)


def test_a_dtype_that_cannot_hold_the_data_is_refused(text_in: Path, tmp_path: Path) -> None:
    big = _prepare(text_in, tmp_path / "big", byte_offset=2**31)  # ids 2**31 .. 2**31 + 255
    meta = json.loads((big / "meta" / META_FILE).read_text())
    assert meta["vocab_size"] == 2**31 + 256
    with pytest.raises(ValueError) as err:
        build_pipeline(_config(tmp_path, "big", dtype="int32"), collate=False)
    assert str(err.value) == (
        "dtype='int32' cannot hold the ids of dataset 'big': it was prepared as uint32 with "
        f"vocab_size=2147483904 ({big / 'meta' / META_FILE}); set dtype='int64'"
    )
    build_pipeline(_config(tmp_path, "big", dtype="int64"), collate=False)


def test_data_without_the_file_loads_unchecked(text_in: Path, tmp_path: Path) -> None:
    out = _prepare(text_in, tmp_path / "old")
    cfg = _config(tmp_path, "old", pad_token=65, epochs=1)
    with pytest.raises(ValueError, match="pad_token=65 is an ordinary token"):
        build_pipeline(cfg, collate=False)
    (out / "meta" / META_FILE).unlink()  # as an older prepare left it
    assert len(_batches(cfg)) > 0


def test_a_broken_metadata_file_names_itself(text_in: Path, tmp_path: Path) -> None:
    out = _prepare(text_in, tmp_path / "d")
    (out / "meta" / META_FILE).write_text('{"tokenizer": "byte"}')
    with pytest.raises(ValueError, match=re.escape(f"{out / 'meta' / META_FILE}: not a torchdata")):
        build_pipeline(_config(tmp_path, "d"), collate=False)


def test_a_part_with_other_token_settings_is_refused(text_in: Path, tmp_path: Path) -> None:
    write_jsonl(str(text_in / "b.jsonl"), ["more"])
    out = _prepare(text_in, tmp_path / "d", shard_id=0, num_shards=2)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError) as err:
        _prepare(text_in, out, shard_id=1, num_shards=2, byte_offset=2)
    assert str(err.value).startswith(
        f"{out} holds data prepared with other token settings (byte_offset=2 here, 1 there; "
    )
    assert sorted(p.name for p in out.iterdir()) == before  # part 1 wrote nothing
    _prepare(text_in, out, shard_id=1, num_shards=2)  # the same settings are fine


def test_inspect_decodes_with_what_prepare_recorded(text_in: Path, tmp_path: Path, capsys) -> None:
    out = _prepare(text_in, tmp_path / "d", format="npy", byte_offset=4, eos_token=300)
    buf = io.StringIO()
    summary = torchdata_ext.inspect_dataset(str(out), out=buf)
    assert summary["documents"] == 3 and summary["prepared"]["eos_token"] == 300
    assert "prepared:  tokenizer 'byte' (byte_offset=4), vocab_size 301, bos_token None, " \
           "eos_token 300, uint16" in buf.getvalue()  # fmt: skip
    got = torchdata_ext.inspect_dataset(str(out), doc=1, out=io.StringIO())
    assert got["text"] == TEXTS[1]
    assert got["tokens"] == [b + 4 for b in TEXTS[1].encode()] + [300]
    assert main(["inspect", str(out), "--doc", "2"]) == 0  # no --tokenizer, no --eos-token
    assert capsys.readouterr().out.splitlines()[-2:] == ["text:", TEXTS[2]]
    # another byte offset would decode the tokens into other text: refused, naming both
    with pytest.raises(
        ValueError,
        match=r"tokenizer='byte' \(byte_offset=0\) is not the "
        r"tokenizer the data was prepared with, 'byte' \(byte_offset=4\)",
    ):
        torchdata_ext.inspect_dataset(str(out), doc=1, byte_offset=0, out=io.StringIO())  # fmt: skip


def test_inspect_without_the_recorded_tokenizer_shows_tokens(text_in: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "third": 1}, "[UNK]"))
    tok.add_special_tokens(["</s>"])  # id 2: an EOS must lie in the vocabulary
    tok.save(str(tmp_path / "tok.json"))
    out = _prepare(text_in, tmp_path / "d", tokenizer=str(tmp_path / "tok.json"), eos_token=2)
    assert torchdata_ext.inspect_dataset(str(out), doc=2, out=io.StringIO())["text"] == "third"
    (tmp_path / "tok.json").unlink()
    with pytest.warns(UserWarning, match=r"names the tokenizer .*tok.json', which cannot be"):
        got = torchdata_ext.inspect_dataset(str(out), doc=2, out=io.StringIO())
    assert got["tokens"] == [1, 2] and "text" not in got
