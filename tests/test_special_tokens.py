"""Special token ids (BOS/EOS/BOL/EOL/pad) that the tokenizer can emit as ordinary tokens, or
that the output dtype cannot hold, are refused: in ``prepare``, on the command line (naming the
flag) and in ``PipelineConfig``, with the reason and the ids allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import torchdata_ext
from torchdata_ext.cli import main
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_jsonl
from torchdata_ext.tokenizers.load import ByteTokenizer, check_special_tokens, token_ids

BYTE_AT = (
    "eos_token=65 is an ordinary token (byte 0x40 '@') of the tokenizer 'byte' (byte_offset=1)"
)


@pytest.fixture()
def text_in(tmp_path: Path) -> Path:
    write_jsonl(str(tmp_path / "in" / "a.jsonl"), ["mail me @ home", "no at sign"])
    return tmp_path / "in"


@given(
    offset=st.integers(0, 600),
    token=st.integers(-3, 2**33),
    dtype=st.sampled_from(["uint32", "int32", "int64"]),
)
def test_an_id_is_refused_exactly_when_it_is_a_byte_or_outside_the_dtype(
    offset: int, token: int, dtype: str
) -> None:
    ids = token_ids(ByteTokenizer(offset))
    refused = not 0 <= token <= np.iinfo(dtype).max or offset <= token < offset + 256
    try:
        check_special_tokens({"eos_token": token}, dtype=dtype, ids=ids)
    except ValueError as exc:
        assert refused and f"eos_token={token} " in str(exc)
    else:
        assert not refused


def test_prepare_refuses_an_eos_the_byte_tokenizer_emits(text_in: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        torchdata_ext.prepare(str(text_in), str(out), eos_token=65, progress=False)
    assert str(err.value) == (
        f"{BYTE_AT}: every one in the text would read as a document end; choose an id the "
        "tokenizer never emits: 0 or 257..4294967295 (uint32)"
    )
    assert not out.exists()  # nothing written
    # the same id is free once the bytes move above it
    res = torchdata_ext.prepare(str(text_in), str(out), eos_token=65, byte_offset=66,
                                format="npy", progress=False)  # fmt: skip
    assert res.documents == 2 and np.load(res.outputs[0]).tolist().count(65) == 2


def test_the_command_line_names_the_flags(text_in: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["prepare", str(text_in), "--out", str(out), "--eos-token", "65"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torchdata-ext prepare: error: --eos-token 65 is an ordinary token (byte 0x40 '@') of "
        "the tokenizer 'byte' (--byte-offset 1): every one in the text would read as a document "
        "end; choose an id the tokenizer never emits: 0 or 257..4294967295 (uint32)\n"
    )
    assert not out.exists()


@pytest.mark.parametrize("name", ["bos_token", "eos_token", "bol_token", "eol_token", "pad_token"])
def test_the_config_refuses_a_byte_as_a_special_token(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}=65 is an ordinary token \(byte 0x40 '@'\)"):
        PipelineConfig(data_path=str(tmp_path), tokenizer="byte", **{name: 65})
    # the check is about the tokenizer: ids of tokenized data without metadata are unknown
    assert getattr(PipelineConfig(data_path=str(tmp_path), **{name: 65}), name) == 65


def test_the_config_follows_byte_offset_and_dtype(tmp_path: Path) -> None:
    base: dict[str, Any] = {"data_path": str(tmp_path), "tokenizer": "byte"}
    assert PipelineConfig(**base).eos_token == 0  # the defaults agree: 0 is no byte
    with pytest.raises(ValueError, match=r"^eos_token=0 is an ordinary token \(byte 0x00\) of "
                       r"the tokenizer 'byte' \(byte_offset=0\).*: 256\.\.9223372036854775807 "
                       r"\(int64\)$"):  # fmt: skip
        PipelineConfig(**base, byte_offset=0)
    PipelineConfig(**base, byte_offset=0, eos_token=256, pad_token=256)
    with pytest.raises(ValueError, match=r"^eos_token=2147483648 must be a token id in "
                       r"0\.\.2147483647 \(the output dtype int32\); the tokenizer never emits "
                       r"0 or 257\.\.2147483647 \(int32\)$"):  # fmt: skip
        PipelineConfig(**base, dtype="int32", eos_token=2**31)
    with pytest.raises(ValueError, match=r"^byte_offset=-1 must be >= 0"):
        PipelineConfig(**base, byte_offset=-1)
    with pytest.raises(TypeError, match=r"^pad_token='0' must be None or an integer"):
        PipelineConfig(**base, pad_token="0")  # type: ignore[arg-type]


@pytest.fixture()
def tok_json(tmp_path: Path) -> str:
    """A word-level tokenizer: ordinary ids 0..3 and 5 (an added word), special 4 (</s>)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "mail": 1, "me": 2, "home": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.add_tokens(["@"])  # not special: text produces it
    tok.save(str(tmp_path / "tok.json"))
    return str(tmp_path / "tok.json")


def test_a_hugging_face_tokenizer_allows_its_own_special_tokens(
    text_in: Path, tmp_path: Path, tok_json: str
) -> None:
    ids = token_ids(torchdata_ext.tokenizers.load.load_tokenizer(tok_json), tok_json)
    assert (ids.ordinary, ids.specials, ids.vocab_size) == (((0, 4), (5, 6)), (4,), 6)
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="in", file_type="jsonl",
                         col_name="text", tokenizer=tok_json, seq_length=4, shift=False,
                         logical_shards=1, shuffle_buffer=1, epochs=1, eos_token=None,
                         pad_token=7)  # fmt: skip
    # an EOS must be a row of the model's embedding (below vocab_size 6); padding may lie beyond
    for name, value, what, free in (
        ("eos_token", 2, "a document end", "4 (in its vocabulary)"),
        ("pad_token", 5, "padding", "4 or 6..9223372036854775807 (int64)"),
    ):
        with pytest.raises(ValueError) as err:
            build_pipeline(PipelineConfig(**{**cfg.to_dict(), name: value}), collate=False)
        assert str(err.value) == (
            f"{name}={value} is an ordinary token (a token of its vocabulary) of the tokenizer "
            f"{tok_json!r}: every one in the text would read as {what}; choose an id the "
            f"tokenizer never emits: {free}, or one of its special tokens [4]"
        )
    root = build_pipeline(PipelineConfig(**{**cfg.to_dict(), "eos_token": 4}), collate=False)
    root.reset(None)
    flat = [t for seq in root for t in seq["input_ids"].tolist()]
    assert flat[-3:] == [7, 7, 7] and flat.count(4) == 2  # padded at the end; one EOS a doc
    body = np.array(flat[:-3])
    docs = sorted(d.tolist() for d in np.split(body, np.flatnonzero(body == 4)[:-1] + 1))
    assert docs == [[0, 0, 0, 4], [1, 2, 5, 3, 4]]  # "@" is the added word 5; unknown words 0
    with pytest.raises(ValueError, match=r"^eos_token=5 is an ordinary token"):
        torchdata_ext.prepare(str(text_in), str(tmp_path / "o"), tokenizer=tok_json,
                              eos_token=5, progress=False)  # fmt: skip


@pytest.mark.parametrize("name", ["bos_token", "eos_token", "bol_token", "eol_token"])
def test_an_id_beyond_the_vocabulary_is_refused_naming_the_setting(
    text_in: Path, tmp_path: Path, tok_json: str, name: str
) -> None:
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="in", file_type="jsonl",
                         col_name="text", tokenizer=tok_json, seq_length=4, logical_shards=1,
                         shuffle_buffer=1, epochs=1, eos_token=4, pad_token=7)  # fmt: skip
    with pytest.raises(ValueError) as err:
        build_pipeline(PipelineConfig(**{**cfg.to_dict(), name: 6}), collate=False)
    assert str(err.value) == (
        f"{name}=6 is beyond the vocabulary of the tokenizer {tok_json!r} (vocab_size 6): the "
        "model has no embedding for it; choose an id the tokenizer never emits: 4 (in its "
        "vocabulary), or one of its special tokens [4]"
    )
    build_pipeline(PipelineConfig(**{**cfg.to_dict(), name: 4}), collate=False)


def test_prepare_refuses_an_eos_beyond_the_vocabulary(
    text_in: Path, tmp_path: Path, tok_json: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^eos_token=6 is beyond the vocabulary of the "
                       r"tokenizer .*tok\.json' \(vocab_size 6\): the model has no embedding"):  # fmt: skip
        torchdata_ext.prepare(str(text_in), str(out), tokenizer=tok_json, eos_token=6,
                              progress=False)  # fmt: skip
    assert not out.exists()
    assert main(["prepare", str(text_in), "--out", str(out), "--tokenizer", tok_json,
                 "--eos-token", "1000"]) == 2  # fmt: skip
    assert not out.exists()


def test_the_byte_tokenizer_takes_special_ids_above_its_bytes(tmp_path: Path) -> None:
    # its vocabulary is the bytes plus the special ids it is given (vocab_size follows them)
    cfg = PipelineConfig(data_path=str(tmp_path), tokenizer="byte", eos_token=300, bos_token=257)
    assert (cfg.eos_token, cfg.bos_token) == (300, 257)


LITERAL = ["the end <|endoftext|> is text here", "plain words only"]


@pytest.fixture()
def eot_bpe(tmp_path: Path) -> tuple[Any, str, int]:
    """A byte-level BPE trained here, ``<|endoftext|>`` its special token (id 0)."""
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["the end is near, plain words here only"] * 50, trainer)
    tok.save(str(tmp_path / "eot.json"))
    return tok, str(tmp_path / "eot.json"), tok.token_to_id("<|endoftext|>")


def _split_docs(flat: np.ndarray, eos: int) -> list[list[int]]:
    return sorted(d.tolist() for d in np.split(flat, np.flatnonzero(flat == eos)[:-1] + 1))


def test_special_token_text_is_ordinary_text_on_the_fly_and_in_prepare(
    tmp_path: Path, eot_bpe: tuple[Any, str, int]
) -> None:
    tok, path, eot = eot_bpe
    write_jsonl(str(tmp_path / "web" / "a.jsonl"), LITERAL)
    cfg = PipelineConfig(data_path=str(tmp_path), datasets="web", file_type="jsonl",
                         col_name="text", tokenizer=path, seq_length=64, shift=False,
                         logical_shards=1, shuffle_buffer=1, epochs=1, eos_token=eot,
                         pad_token=eot)  # fmt: skip
    root = build_pipeline(cfg, collate=False)
    root.reset(None)
    flat = np.concatenate([seq["input_ids"] for seq in root])
    flat = flat[: int(np.flatnonzero(flat == eot)[1]) + 1]  # the two documents, not the padding
    on_the_fly = _split_docs(flat, eot)
    res = torchdata_ext.prepare(str(tmp_path / "web"), str(tmp_path / "out"), tokenizer=path,
                                eos_token=eot, format="npy", progress=False)  # fmt: skip
    assert res.documents == 2
    prepared = _split_docs(np.load(res.outputs[0]).astype(np.int64), eot)
    assert on_the_fly == prepared  # the same ids on both paths
    assert [d.count(eot) for d in prepared] == [1, 1]  # only the EOS each document ends with
    assert sorted(tok.decode(d[:-1]) for d in prepared) == sorted(LITERAL)  # the text, whole
    assert tok.encode(LITERAL[0]).ids.count(eot) == 1  # what the tokenizer alone would do
    assert tok.encode_special_tokens is False  # the caller's tokenizer is left as it was


def test_the_encoder_keeps_special_token_text_after_a_pickle(eot_bpe: tuple[Any, str, int]) -> None:
    import pickle

    from torchdata_ext.tokenizers.load import as_encoder

    tok, _, eot = eot_bpe
    enc = as_encoder(tok)
    first = enc.encode_batch(LITERAL)
    again = pickle.loads(pickle.dumps(enc)).encode_batch(LITERAL)  # as in a loader worker
    assert [a.tolist() for a in again] == [a.tolist() for a in first]
    assert all(eot not in a for a in first)
    seen: dict[str, Any] = {}

    class TransformersLike:  # a transformers tokenizer is asked to split special-token text
        def __call__(self, batch, **kwargs):
            seen.update(kwargs)
            return {"input_ids": [[1] for _ in batch]}

    as_encoder(TransformersLike()).encode_batch(["a"])
    assert seen == {"split_special_tokens": True}
