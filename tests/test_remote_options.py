"""``storage_options`` given once reach every URL of a call (a moto S3 server on 127.0.0.1).

The bucket's endpoint is known only through the options (the environment has credentials but
no endpoint), so a URL the options do not reach fails: the tokenizer of a config or of
``prepare``, a config file the audit reads, a checkpoint folder saved or loaded without options
(they default to the loader config's). An unknown option key and options given as a string are
one-line errors naming them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml
from harness import item_key, run, write_random_arrow_datasets

from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.cli import main
from torchdata_ext.forensics import show_batches
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.prepare_data.tokenize_text import prepare
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.testing import write_jsonl
from torchdata_ext.world import World

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["hello world", "world hello hello", "elsewhere world", "hello"]
IDS = {"<pad>": 0, "</s>": 1, "[UNK]": 2, "hello": 5, "world": 7}


def _word_tokenizer() -> Any:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(IDS, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "</s>"])
    return tok


def _put(s3: Any, name: str, data: bytes) -> str:
    url = s3.url(name)
    fs, path = filesystem(url, s3.storage_options)
    with fs.open(path, "wb") as f:
        f.write(data)
    return url


def _ids(text: str) -> list[int]:
    return [IDS.get(w, 2) for w in text.split()]


def _text_cfg(data: str, tokenizer: str, **extra: Any) -> PipelineConfig:
    return PipelineConfig(
        data_path=data, file_type="jsonl", col_name="text", tokenizer=tokenizer, seq_length=4,
        eos_token=1, pad_token=0, shift=False, output_keys="input_ids", logical_shards=2,
        batch_size=1, shuffle_buffer=1, epochs=1, **extra,
    )  # fmt: skip


def test_a_config_tokenizer_on_s3_is_read_with_the_configs_options(s3, tmp_path) -> None:
    _put(s3, "tok/tokenizer.json", _word_tokenizer().to_str().encode())
    write_jsonl(s3.url("text", "a.jsonl"), TEXTS, storage_options=s3.storage_options)
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    write_jsonl(str(tmp_path / "text" / "a.jsonl"), TEXTS)
    on_s3 = _text_cfg(s3.url("text"), s3.url("tok", "tokenizer.json"),
                      storage_options=s3.storage_options)  # fmt: skip
    local = _text_cfg(str(tmp_path / "text"), str(tmp_path / "tokenizer.json"))

    def rows(cfg: PipelineConfig) -> list[list[int]]:
        return [np.asarray(x["input_ids"]).tolist() for w in range(2)
                for x in run(_build(cfg, World(0, 1, w, 2)))]  # fmt: skip

    assert rows(on_s3) == rows(local)
    tokens = sorted(t for row in rows(local) for t in row if t > 1)
    assert tokens == sorted(t for text in TEXTS for t in _ids(text))  # the word ids, not bytes


def test_prepare_reads_an_s3_tokenizer_with_storage_options(s3, capsys) -> None:
    tok_url = _put(s3, "tok/tokenizer.json", _word_tokenizer().to_str().encode())
    write_jsonl(s3.url("in", "a.jsonl"), TEXTS, storage_options=s3.storage_options)
    so = json.dumps(s3.storage_options)
    args = ["prepare", s3.url("in"), "--out", s3.url("out"), "--tokenizer", tok_url,
            "--eos-token", "1", "--no-progress"]  # fmt: skip
    assert main([*args, "--storage-options", so]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    fs, path = filesystem(outputs[0], s3.storage_options)
    with fs.open(path, "rb") as f, pa.ipc.open_file(f) as reader:
        docs = [reader.get_batch(i).column(0).to_pylist() for i in range(reader.num_record_batches)]
    assert docs == [[*_ids(t), 1] for t in TEXTS]


def _token_corpus(s3: Any) -> PipelineConfig:
    write_random_arrow_datasets(s3.url("data"), (("web", 40, 20), ("code", 30, 30)), seed=5,
                                storage_options=s3.storage_options)  # fmt: skip
    return PipelineConfig(
        data_path=s3.url("data"), datasets="web,code", weights="2,1", seq_length=16,
        logical_shards=4, batch_size=2, seed=3, shuffle_buffer=3, block_docs=4, epochs=1,
        storage_options=dict(s3.storage_options),
    )  # fmt: skip


def _build(cfg: PipelineConfig, world: World) -> Any:
    return build_pipeline(cfg, world, collate=False)


def test_checkpoint_calls_default_to_the_loader_configs_options(s3) -> None:
    cfg = _token_corpus(s3)
    make = functools.partial(build_pipeline, cfg, collate=False)
    loader = TokenLoader(make)
    it = iter(loader)
    first = [item_key(next(it)) for _ in range(5)]
    save_checkpoint(loader, s3.url("ckpt"))  # no options: the config's
    rest = [item_key(x) for x in it]
    restored = TokenLoader(make)
    load_checkpoint(restored, s3.url("ckpt"))
    assert [item_key(x) for x in restored] == rest and len(first + rest) > 10
    # given options win over the config's: wrong ones fail, naming the endpoint
    wrong = s3.options_via("http://127.0.0.1:9")
    with pytest.raises(Exception, match="127.0.0.1:9"):
        load_checkpoint(TokenLoader(make), s3.url("ckpt"), storage_options=wrong)


def test_audit_reads_an_s3_config_with_the_given_options(s3, tmp_path, capsys) -> None:
    cfg = _token_corpus(s3)
    loader = TokenLoader(functools.partial(build_pipeline, cfg, collate=False))
    it = iter(loader)
    for _ in range(6):
        next(it)
    save_checkpoint(loader, s3.url("ckpt"))
    loader.close()
    fields = {k: v for k, v in cfg.to_dict().items() if k in ("data_path", "datasets",
              "weights", "seq_length", "logical_shards", "batch_size", "seed", "shuffle_buffer",
              "block_docs", "epochs")}  # fmt: skip
    local = tmp_path / "cfg.yaml"
    local.write_text(yaml.safe_dump({**fields, "storage_options": s3.storage_options}))
    remote = _put(s3, "cfg.yaml", yaml.safe_dump(fields).encode())  # no storage_options
    assert main(["audit", s3.url("ckpt"), "--config", str(local), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    so = json.dumps(s3.storage_options)
    assert (
        main(["audit", s3.url("ckpt"), "--config", remote, "--json", "--storage-options", so]) == 0
    )
    assert json.loads(capsys.readouterr().out) == expected
    assert sum(d["documents_delivered"] for d in expected["datasets"]) > 0


def test_batches_take_the_options_once_as_the_audit_does(s3, tmp_path, capsys) -> None:
    """Issue 44 item 12: ``batches --storage-options`` with a config of none reaches the data,
    and ``show_batches`` reads the checkpoint with the config's options when given none."""
    cfg = _token_corpus(s3)
    cfg.output_keys = ["input_ids", "provenance"]
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    it = iter(loader)
    for _ in range(2):
        next(it)
    save_checkpoint(loader, s3.url("ckpt"))
    want = [b["input_ids"].tolist() for _, b in zip(range(2), it)]
    loader.close()
    shown = show_batches(s3.url("ckpt"), cfg, "3:5")  # the config's options for the checkpoint
    assert [[r["input_ids"] for r in b["rows"]] for b in shown] == want
    fields = {k: v for k, v in cfg.to_dict().items() if k != "storage_options"}
    remote = _put(s3, "cfg.yaml", yaml.safe_dump(fields).encode())  # no storage_options
    so = json.dumps(s3.storage_options)
    argv = ["batches", s3.url("ckpt"), "--config", remote, "--steps", "3:5", "--json"]
    assert main([*argv, "--storage-options", so]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [[r["input_ids"] for r in b["rows"]] for b in got] == want


@pytest.mark.parametrize("inside", [None, "client_kwargs"])
def test_an_unknown_option_key_is_one_line_naming_it(s3, capsys, inside) -> None:
    """At the top level or inside client_kwargs (issue 44 item 11: aiobotocore's TypeError)."""
    if inside is None:
        bad = {**s3.storage_options, "endpint_url": s3.endpoint_url}
        what = "unknown option 'endpint_url' (did you mean 'endpoint_url'?)"
    else:
        client = {**s3.storage_options.get("client_kwargs", {}), "endpint_url": s3.endpoint_url}
        bad = {**s3.storage_options, "client_kwargs": client}
        what = (
            "unknown client_kwargs option 'endpint_url' (did you mean 'endpoint_url'?); give "
            "only arguments of botocore's Session.create_client (endpoint_url, region_name, "
            "verify, use_ssl, ...)"
        )
    with pytest.raises(ValueError) as e:
        filesystem(s3.url("x"), bad)
    assert str(e.value).startswith(f"storage_options for {s3.url('x')}: {what}")
    for argv in (["inspect", s3.url("data")], ["index", s3.url("data")]):
        assert main([*argv, "--storage-options", json.dumps(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert what in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["python", "yaml", "index", "prepare"])
def test_storage_options_given_as_a_string_ask_for_a_mapping(where, tmp_path) -> None:
    text = '{"anon": true}'
    write_jsonl(str(tmp_path / "a.jsonl"), ["some text"])
    with pytest.raises(
        ValueError, match=r"storage_options='\{\"anon\": true\}' is a string: give a mapping"
    ):
        if where == "python":
            PipelineConfig(data_path="s3://b/data", storage_options=text)  # type: ignore[arg-type]
        elif where == "yaml":
            (tmp_path / "c.yaml").write_text(f"data_path: s3://b/data\nstorage_options: '{text}'\n")
            PipelineConfig.from_file(str(tmp_path / "c.yaml"))
        elif where == "index":
            DatasetIndex.build(str(tmp_path), storage_options=text)  # type: ignore[arg-type]
        else:
            prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "o"), storage_options=text)  # type: ignore[arg-type]


def test_audit_list_and_plot_default_to_the_configs_options(s3, tmp_path, capsys) -> None:
    """``--list`` and ``--plot`` on S3 without ``--storage-options``: the config's options reach
    them (``storage_options_of``), as they reach the checkpoint."""
    import pyarrow.parquet as pq

    from torchdata_ext.audit.report import audit_checkpoint

    cfg = _token_corpus(s3)
    loader = TokenLoader(functools.partial(build_pipeline, cfg, collate=False))
    it = iter(loader)
    for _ in range(6):
        next(it)
    save_checkpoint(loader, s3.url("ckpt"))
    loader.close()
    local = tmp_path / "cfg.yaml"
    local.write_text(yaml.safe_dump(cfg.to_dict()))
    argv = ["audit", s3.url("ckpt"), "--config", str(local), "--list", s3.url("out/list.parquet")]
    has_plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_plot = False
    if has_plot:
        argv += ["--plot", s3.url("out/audit.png")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    want = audit_checkpoint(s3.url("ckpt"), cfg).documents()
    assert f"wrote {want.num_rows:,} documents to {s3.url('out/list.parquet')}" in err
    fs, path = filesystem(s3.url("out/list.parquet"), s3.storage_options)
    with fs.open(path, "rb") as f:
        assert pq.read_table(f).to_pylist() == want.to_pylist()
    if has_plot:
        fs, path = filesystem(s3.url("out/audit.png"), s3.storage_options)
        with fs.open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_torchtitan_reads_an_s3_pipeline_file_with_the_fields_options(s3) -> None:
    """``TokenDataLoader.Config(pipeline=s3 URL, fields={"storage_options": ...})``: the file is
    read with the options given (the endpoint is known only through them: read without them,
    it failed with "cannot connect to the endpoint https://...amazonaws.com")."""
    pytest.importorskip("torchtitan")
    from torchdata_ext.torchtitan import pipeline_config

    fields = {"data_path": s3.url("data"), "datasets": ["web", "code"], "weights": [2, 1]}
    remote = _put(s3, "titan.yaml", yaml.safe_dump(fields).encode())
    given = {"storage_options": dict(s3.storage_options)}
    cfg = pipeline_config(remote, given, seq_len=8, local_batch_size=2)
    assert (cfg.data_path, cfg.datasets, cfg.weights) == (s3.url("data"), ["web", "code"], [2, 1])
    assert (cfg.seq_length, cfg.batch_size) == (8, 2)
    assert cfg.storage_options == s3.storage_options
