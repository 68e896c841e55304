"""Conformance suite for the file handlers, on local disk and on memory://.

Every format writes random documents with ``torchdata_ext.testing`` and must read them back
exactly through ``length`` / ``get`` / ``slice`` / ``get_many`` / ``doc_lengths``. Documents of
length 0 are included everywhere except flat-with-EOS files, which cannot store them (every
document ends with its EOS token; an empty input document is stored as ``[eos]``).
"""

from __future__ import annotations

import gzip
import os
import pickle
import posixpath
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pytest

from torchdata_ext import testing as T
from torchdata_ext.handlers import (
    ArrowHandler,
    CborHandler,
    CepedHandler,
    DataFileError,
    FileHandler,
    FlatTokenHandler,
    JsonlHandler,
    MdsHandler,
    MegatronHandler,
    NanoGptHandler,
    NpyHandler,
    ParquetHandler,
    format_for_url,
    get_handler,
    handler_for_url,
    registered_formats,
)

EOS = 0
VOCAB = 1000
ALPHABET = list("abc xyz") + ["é", "日本", "\n", '"', "\\", "\t", "\u2028", "🙂", "{", "}"]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(params=["local", "memory"])
def base_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A fresh folder URL: a tmp_path, or a unique memory:// prefix removed afterwards."""
    if request.param == "local":
        yield str(tmp_path)
        return
    prefix = f"memory://test-handlers-{uuid.uuid4().hex}"
    yield prefix
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


def token_docs(rng: np.random.Generator, n: int, dtype: Any = np.int64) -> list[np.ndarray]:
    """``n`` documents of 0..40 tokens in [1, VOCAB) (never EOS), a few of them empty."""
    lengths = rng.integers(0, 41, size=n)
    lengths[rng.random(n) < 0.15] = 0
    return [rng.integers(1, VOCAB, size=int(k)).astype(dtype) for k in lengths]


def text_docs(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` texts of 0..30 pieces including newlines, quotes and non-ASCII, a few empty."""
    lengths = rng.integers(0, 31, size=n)
    lengths[rng.random(n) < 0.15] = 0
    return ["".join(rng.choice(ALPHABET, size=int(k))) for k in lengths]


@dataclass(frozen=True)
class Case:
    """A format variant: file name, writer, handler factory and document kind."""

    id: str
    file_name: str
    write: Callable[[str, list[Any]], list[Any]]
    handler: Callable[[], FileHandler]
    kind: str = "tokens"  # or "text"
    expect_doc_lengths: bool = True
    empty_kind: str | None = None  # what a file of no documents says it holds, if not kind


CASES = [
    Case("arrow-batches-file", "shard.arrow", T.write_arrow_batches, ArrowHandler),
    Case(
        "arrow-batches-stream",
        "shard.arrow",
        lambda u, d: T.write_arrow_batches(u, d, dtype=np.uint32, stream=True),
        ArrowHandler,
    ),
    Case(
        "arrow-rows-list-file",
        "data.feather",
        lambda u, d: T.write_arrow_rows(u, d, batch_size=3, dtype=np.int32),
        ArrowHandler,
    ),
    Case(
        "arrow-rows-large-list-stream",  # like datasets.save_to_disk
        "data-00000-of-00001.arrow",
        lambda u, d: T.write_arrow_rows(
            u, d, col_name="input_ids", stream=True, batch_size=4, large=True
        ),
        lambda: ArrowHandler(col_name="input_ids"),
    ),
    Case(
        "arrow-rows-text-stream",
        "text.arrow",
        lambda u, d: T.write_arrow_rows(
            u, d, col_name="text", stream=True, batch_size=3, text=True
        ),
        lambda: ArrowHandler(col_name="text"),
        kind="text",
    ),
    Case(
        "parquet-tokens",
        "part.parquet",
        lambda u, d: T.write_parquet(
            u, d, row_group_size=3, extra_columns={"id": list(range(len(d)))}
        ),
        ParquetHandler,
    ),
    Case(
        "parquet-tokens-lru",
        "part.parquet",
        lambda u, d: T.write_parquet(u, d, row_group_size=2, dtype=np.uint16),
        lambda: ParquetHandler(max_cached_row_groups=1),
    ),
    Case(
        "parquet-text",
        "part.parquet",
        lambda u, d: T.write_parquet(u, d, col_name="text", row_group_size=4, text=True),
        lambda: ParquetHandler(col_name="text"),
        kind="text",
    ),
    Case("ceped", "tok.npy", T.write_ceped_npy, CepedHandler),
    Case(
        "ceped-sniffed",
        "tok.npy",
        lambda u, d: T.write_ceped_npy(u, d, dtype=np.int32),
        NpyHandler,
    ),
    Case(
        "flat-bin-eos",
        "tok.bin",
        lambda u, d: T.write_flat_tokens(u, d, eos_token=EOS),
        lambda: FlatTokenHandler(eos_token=EOS),
    ),
    Case(
        "flat-bin-offsets-uint16",
        "tok.bin",
        lambda u, d: T.write_flat_tokens(u, d, offsets=True, dtype=np.uint16),
        lambda: FlatTokenHandler(dtype="uint16"),
    ),
    Case(
        "flat-npy-eos",
        "tok.npy",
        lambda u, d: T.write_flat_tokens(u, d, eos_token=EOS),
        lambda: FlatTokenHandler(eos_token=EOS),
    ),
    Case(
        "flat-npy-offsets-sniffed",
        "tok.npy",
        lambda u, d: T.write_flat_tokens(u, d, offsets=True),
        NpyHandler,
    ),
    Case(
        "nanogpt",  # headerless uint16, EOT after every document
        "train.bin",
        lambda u, d: T.write_flat_tokens(u, d, eos_token=EOS, dtype=np.uint16),
        lambda: NanoGptHandler(eos_token=EOS),
    ),
    Case(
        "megatron-sentences",  # documents of several sequences, as --split-sentences writes
        "corpus_text_document.idx",
        lambda u, d: T.write_megatron(u, d, dtype=np.uint16, sentences=3),
        MegatronHandler,
    ),
    Case("jsonl", "docs.jsonl", T.write_jsonl, JsonlHandler, kind="text", expect_doc_lengths=False),
    Case(
        "jsonl-gz",
        "docs.jsonl.gz",
        lambda u, d: T.write_jsonl(u, d, field="content", compression="gz"),
        lambda: JsonlHandler(col_name="content"),
        kind="text",
        expect_doc_lengths=False,
    ),
    Case(
        "json-zst",
        "docs.json.zst",
        lambda u, d: T.write_jsonl(u, d, compression="zst"),
        JsonlHandler,
        kind="text",
        expect_doc_lengths=False,
    ),
    Case("cbor-text", "docs.cbor", T.write_cbor, CborHandler, kind="text"),
    Case(
        "cbor-text-gz",
        "docs.cbor.gz",
        lambda u, d: T.write_cbor(u, d, field="content", extra_fields={"id": range(len(d))}),
        lambda: CborHandler(col_name="content"),
        kind="text",
    ),
    Case(
        "cbor-tokens-zst",
        "docs.cbor.zst",
        lambda u, d: T.write_cbor(u, [np.asarray(x, np.int64) for x in d], field="input_ids"),
        lambda: CborHandler(col_name="input_ids"),
        empty_kind="text",  # records without a schema: an empty file cannot tell
    ),
    Case(
        "mds-ndarray-uint32",  # LLM Foundry's layout, with an int and a str column around it
        "shard.00000.mds",
        lambda u, d: T.write_mds(
            posixpath.dirname(u),
            d,
            extra_columns={"id": ("int", range(len(d))), "zsrc": ("str", ["x"] * len(d))},
        ),
        MdsHandler,
    ),
    Case(
        "mds-ndarray-dynamic-zstd",  # dtype and shape stored per sample
        "shard.00000.mds.zstd",
        lambda u, d: T.write_mds(
            posixpath.dirname(u), d, encoding="ndarray", compression="zstd", col_name="ids"
        ),
        lambda: MdsHandler(col_name="ids"),
    ),
    Case(
        "mds-bytes-gz",  # int64 token bytes (LLM Foundry's older concat_tokens shards)
        "shard.00000.mds.gz",
        lambda u, d: T.write_mds(posixpath.dirname(u), d, encoding="bytes", compression="gz"),
        lambda: MdsHandler(bytes_dtype="int64"),
    ),
    Case(
        "mds-text",
        "shard.00000.mds",
        lambda u, d: T.write_mds(
            posixpath.dirname(u),
            d,
            col_name="text",
            encoding="str",
            extra_columns={"a": ("ndarray:uint16", [[1, 2]] * len(d))},
        ),  # fmt: skip
        lambda: MdsHandler(col_name="text"),
        kind="text",
        expect_doc_lengths=False,
    ),
]
CASE_IDS = [c.id for c in CASES]


def assert_doc_equal(got: Any, expected: Any, kind: str) -> None:
    if kind == "text":
        assert isinstance(got, str)
        assert got == expected
    else:
        assert isinstance(got, np.ndarray), type(got)
        assert got.ndim == 1
        assert got.dtype.kind in "iu", got.dtype
        assert np.array_equal(got, expected)


# --------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("n_docs", [0, 1, 29])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_roundtrip(case: Case, base_url: str, n_docs: int) -> None:
    rng = np.random.default_rng([n_docs, len(case.id)])
    docs = text_docs(rng, n_docs) if case.kind == "text" else token_docs(rng, n_docs)
    url = f"{base_url}/sub/{case.file_name}"
    expected = case.write(url, docs)
    assert len(expected) == n_docs

    handler = pickle.loads(pickle.dumps(case.handler()))  # handlers hold config only
    reader = handler.open(url)
    n = handler.length(reader)
    assert n == n_docs
    kind = case.empty_kind if n_docs == 0 and case.empty_kind else case.kind
    assert handler.produces_for(reader) == kind
    assert reader.produces == kind

    docs_read = [handler.get(reader, i) for i in range(n)]
    for i in range(n):
        assert_doc_equal(docs_read[i], expected[i], case.kind)
        assert_doc_equal(handler.get(reader, np.int64(i)), expected[i], case.kind)

    for i in range(n):  # slices, including past the end
        length = len(expected[i])
        for start, count in [(0, length), (0, 0), (length, 3)] + [
            (int(rng.integers(0, length + 2)), int(rng.integers(0, length + 3))) for _ in range(3)
        ]:
            assert_doc_equal(
                handler.slice(docs_read[i], start, count),
                expected[i][start : start + count],
                case.kind,
            )

    indices = rng.integers(0, max(n, 1), size=2 * n) if n else np.zeros(0, dtype=np.int64)
    many = handler.get_many(reader, indices)
    assert len(many) == len(indices)
    for i, doc in zip(indices.tolist(), many, strict=True):
        assert_doc_equal(doc, expected[i], case.kind)
    assert handler.get_many(reader, []) == []
    if n:
        assert_doc_equal(handler.get_many(reader, [n - 1])[0], expected[n - 1], case.kind)

    lengths = handler.doc_lengths(reader)
    if case.expect_doc_lengths or lengths is not None:
        assert lengths is not None
        assert lengths.dtype == np.int64
        assert np.array_equal(lengths, [len(d) for d in expected])

    name = case.file_name
    for bad in (-1, n, n + 5):
        with pytest.raises(IndexError, match=name):
            handler.get(reader, bad)
    with pytest.raises(IndexError, match=name):
        handler.get_many(reader, [0, n])
    handler.close(reader)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_missing_file(case: Case, base_url: str) -> None:
    url = f"{base_url}/nothing-here-{case.file_name}"
    with pytest.raises(DataFileError, match="not found") as info:
        case.handler().open(url)
    assert f"nothing-here-{case.file_name}" in str(info.value)
    assert info.value.url == url


def _truncate(url: str, cut: int) -> None:
    with fsspec.open(url, "rb") as f:
        data = f.read()
    with fsspec.open(url, "wb") as f:
        f.write(data[: max(len(data) - cut, 0)])


def _read_all(handler: FileHandler, url: str) -> None:
    reader = handler.open(url)
    handler.get_many(reader, range(handler.length(reader)))


TRUNCATABLE = [
    c
    for c in CASES
    if c.id
    in {
        "arrow-batches-file",
        "arrow-batches-stream",
        "arrow-rows-large-list-stream",
        "parquet-tokens",
        "ceped",
        "ceped-sniffed",
        "flat-bin-eos",
        "flat-npy-eos",
        "megatron-sentences",
        "jsonl",
        "jsonl-gz",
        "json-zst",
        "mds-ndarray-uint32",
        "mds-ndarray-dynamic-zstd",
        "mds-bytes-gz",
        "mds-text",
        "cbor-text",
        "cbor-text-gz",
        "cbor-tokens-zst",
    }
]


@pytest.mark.parametrize("cut", [1, 9, 0.5])
@pytest.mark.parametrize("case", TRUNCATABLE, ids=[c.id for c in TRUNCATABLE])
def test_truncated(case: Case, base_url: str, cut: float) -> None:
    rng = np.random.default_rng(7)
    docs: list[Any] = text_docs(rng, 12) if case.kind == "text" else token_docs(rng, 12)
    docs = [d if len(d) else (d + "x" if case.kind == "text" else np.array([5])) for d in docs]
    url = f"{base_url}/{case.file_name}"
    case.write(url, docs)
    size = fsspec.filesystem(fsspec.core.split_protocol(url)[0] or "file").size(url)
    n_cut = int(size * cut) if cut < 1 else int(cut)
    if case.id == "jsonl" and n_cut == 1:
        n_cut = 3  # cutting only the final newline loses nothing
    if case.id.startswith("flat-bin") and n_cut % 4 == 0:
        n_cut += 1
    _truncate(url, n_cut)
    with pytest.raises(DataFileError) as info:
        _read_all(case.handler(), url)
    assert case.file_name in str(info.value)


def test_unknown_suffix() -> None:
    with pytest.raises(ValueError, match=r"shard\.xyz"):
        handler_for_url("s3://bucket/shard.xyz")
    with pytest.raises(ValueError, match="unknown file_type"):
        get_handler("nope")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("a.arrow", ArrowHandler),
        ("a.FEATHER", ArrowHandler),
        ("a.ipc", ArrowHandler),
        ("a.parquet", ParquetHandler),
        ("a.npy", NpyHandler),
        ("a.bin", FlatTokenHandler),
        ("a.jsonl", JsonlHandler),
        ("a.json", JsonlHandler),
        ("a.jsonl.gz", JsonlHandler),
        ("a.json.zst", JsonlHandler),
        ("corpus_text_document.idx", MegatronHandler),
    ],
)
def test_handler_for_url(name: str, cls: type) -> None:
    handler = handler_for_url(f"memory://x/{name}")
    assert type(handler) is cls
    assert type(handler).name == format_for_url(name)
    assert handler.name in registered_formats()


def test_get_handler_options() -> None:
    h = get_handler("flat", eos_token=2, dtype="uint16", storage_options={"anon": True})
    assert isinstance(h, FlatTokenHandler)
    assert h.eos_token == 2 and h.dtype == np.uint16 and h.storage_options == {"anon": True}
    assert get_handler("jsonl").col_name == "text"
    assert get_handler("arrow").col_name == "tokens"
    with pytest.raises(ValueError, match="integer"):
        FlatTokenHandler(dtype="float32")
    with pytest.raises(ValueError, match="compression"):
        JsonlHandler(compression="bz2")


def test_package_all_sorted() -> None:
    import torchdata_ext.handlers as handlers

    assert handlers.__all__ == sorted(handlers.__all__)
    for name in handlers.__all__:
        assert getattr(handlers, name) is not None


def test_arrow_missing_column(base_url: str) -> None:
    url = f"{base_url}/rows.arrow"
    T.write_arrow_rows(url, ["a", "b"], col_name="text", extra_columns={"id": [1, 2]})
    with pytest.raises(DataFileError) as info:
        ArrowHandler().open(url)
    msg = str(info.value)
    assert "rows.arrow" in msg and "'tokens' not found" in msg
    assert "['text', 'id']" in msg and "col_name" in msg


def test_arrow_wrong_column_type(base_url: str) -> None:
    url = f"{base_url}/floats.arrow"
    table = pa.table({"tokens": pa.array([1.5, 2.5])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with fsspec.open(url, "wb") as f:
        f.write(sink.getvalue().to_pybytes())
    with pytest.raises(DataFileError, match=r"floats\.arrow.*'tokens' has type double"):
        ArrowHandler().open(url)


def test_arrow_null_rows_and_tokens(base_url: str) -> None:
    url = f"{base_url}/nulls.arrow"
    table = pa.table({"tokens": pa.array([[1, 2], None, [3]], pa.list_(pa.int64()))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with fsspec.open(url, "wb") as f:
        f.write(sink.getvalue().to_pybytes())
    h = ArrowHandler()
    r = h.open(url)
    assert [h.get(r, i).tolist() for i in range(3)] == [[1, 2], [], [3]]
    assert h.doc_lengths(r).tolist() == [2, 0, 1]

    url2 = f"{base_url}/null-tokens.arrow"
    table = pa.table({"tokens": pa.array([[1, None]], pa.list_(pa.int64()))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with fsspec.open(url2, "wb") as f:
        f.write(sink.getvalue().to_pybytes())
    with pytest.raises(DataFileError, match=r"null-tokens\.arrow.*null tokens"):
        h.open(url2)


def test_parquet_missing_column_mentions_text(base_url: str) -> None:
    url = f"{base_url}/t.parquet"
    T.write_parquet(url, ["hello", "world"], col_name="text")
    with pytest.raises(DataFileError) as info:
        ParquetHandler().open(url)
    msg = str(info.value)
    assert "t.parquet" in msg and "'tokens' not found" in msg and "col_name='text'" in msg


def test_parquet_scalar_int_column(base_url: str) -> None:
    url = f"{base_url}/ints.parquet"
    T.write_parquet(url, ["a", "b"], col_name="text", extra_columns={"tokens": [1, 2]})
    with pytest.raises(DataFileError, match=r"ints\.parquet.*list<integer>"):
        ParquetHandler().open(url)


def test_not_parquet(base_url: str) -> None:
    url = f"{base_url}/fake.parquet"
    T.write_jsonl(url, ["x"])
    with pytest.raises(DataFileError, match=r"fake\.parquet.*not a Parquet file"):
        ParquetHandler().open(url)


def test_flat_without_eos_token(base_url: str) -> None:
    for name in ("tok.bin", "tok.npy"):
        url = f"{base_url}/{name}"
        T.write_flat_tokens(url, [np.array([5, 6]), np.array([7])])
        for handler in (FlatTokenHandler(), NpyHandler()):
            if name.endswith(".bin") and isinstance(handler, NpyHandler):
                continue
            with pytest.raises(DataFileError) as info:
                handler.open(url)
            msg = str(info.value)
            assert name in msg and "eos_token=" in msg and "offsets" in msg


def test_flat_trailing_run_without_eos(base_url: str) -> None:
    url = f"{base_url}/tok.bin"
    T.write_flat_tokens(url, [np.array([5, 6, 9, 7, 9, 8])])
    h = FlatTokenHandler(eos_token=9)
    r = h.open(url)
    assert [h.get(r, i).tolist() for i in range(h.length(r))] == [[5, 6, 9], [7, 9], [8]]
    assert h.doc_lengths(r).tolist() == [3, 2, 1]


def test_flat_bad_offsets_sidecar(base_url: str) -> None:
    url = f"{base_url}/tok.bin"
    T.write_flat_tokens(url, [np.array([5, 6]), np.array([7])], offsets=True)
    with fsspec.open(url + ".offsets.npy", "wb") as f:
        np.save(f, np.array([0, 2, 5], dtype=np.int64))
    with pytest.raises(DataFileError, match=r"tok\.bin\.offsets\.npy.*token count 3"):
        FlatTokenHandler().open(url)
    with fsspec.open(url + ".offsets.npy", "wb") as f:
        np.save(f, np.array([0, 2, 1, 3], dtype=np.int64))
    with pytest.raises(DataFileError, match="non-decreasing"):
        FlatTokenHandler().open(url)


def test_flat_eos_out_of_dtype_range(base_url: str) -> None:
    url = f"{base_url}/tok.bin"
    T.write_flat_tokens(url, [np.array([5, 6])], dtype=np.uint16)
    with pytest.raises(DataFileError, match="eos_token=70000"):
        FlatTokenHandler(eos_token=70000, dtype=np.uint16).open(url)


def test_ceped_rejects_other_arrays(base_url: str) -> None:
    cases = {
        "float.npy": np.array([1.0, 2.0]),
        "short.npy": np.array([3, 1, 1], dtype=np.int64),
        "sum.npy": np.array([1, 2, 7], dtype=np.int64),
        "neg.npy": np.array([-1], dtype=np.int64),
        "2d.npy": np.zeros((2, 2), dtype=np.int64),
    }
    for name, arr in cases.items():
        url = f"{base_url}/{name}"
        with fsspec.open(url, "wb") as f:
            np.save(f, arr)
        with pytest.raises(DataFileError, match=rf"{name}.*not a CEPED"):
            CepedHandler().open(url)
    url = f"{base_url}/raw.npy"
    with fsspec.open(url, "wb") as f:
        f.write(b"not numpy at all")
    with pytest.raises(DataFileError, match=r"raw\.npy.*not a NumPy \.npy"):
        CepedHandler().open(url)


def test_npy_sniff(base_url: str) -> None:
    ceped = f"{base_url}/c.npy"
    T.write_ceped_npy(ceped, [np.array([3, 4]), np.array([], dtype=np.int64)])
    flat = f"{base_url}/f.npy"
    T.write_flat_tokens(flat, [np.array([3, 4]), np.array([8])], eos_token=EOS)
    h = NpyHandler(eos_token=EOS)
    rc, rf = h.open(ceped), h.open(flat)
    assert rc.kind == "ceped" and h.length(rc) == 2 and h.get(rc, 0).tolist() == [3, 4]
    assert rf.kind == "flat" and h.length(rf) == 2 and h.get(rf, 1).tolist() == [8, EOS]
    # [1, 0] is a valid CEPED array (one empty document) - the sidecar overrides the sniff
    amb = f"{base_url}/amb.npy"
    T.write_flat_tokens(amb, [np.array([1, 0])], offsets=True)
    r = h.open(amb)
    assert r.kind == "flat" and [d.tolist() for d in h.get_many(r, [0])] == [[1, 0]]
    with pytest.raises(DataFileError, match=r"f\.npy.*not a CEPED array.*eos_token"):
        NpyHandler().open(flat)


def _write_raw(url: str, data: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(data)


def test_jsonl_bad_line(base_url: str) -> None:
    url = f"{base_url}/bad.jsonl"
    _write_raw(
        url, b'{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n{"txt": "c"}\n{"text": 3}\n[1]\n'
    )
    h = JsonlHandler()
    r = h.open(url)
    assert h.length(r) == 6
    assert h.get(r, 1) == "b"
    with pytest.raises(DataFileError, match=r"bad\.jsonl.*line 4 is not valid JSON"):
        h.get(r, 2)
    with pytest.raises(DataFileError, match=r"bad\.jsonl.*line 5 has no field 'text'.*'txt'"):
        h.get(r, 3)
    with pytest.raises(DataFileError, match=r"line 6: field 'text' is a JSON int"):
        h.get(r, 4)
    with pytest.raises(DataFileError, match=r"line 7 is a JSON list"):
        h.get_many(r, [0, 5])


def test_jsonl_blank_lines_crlf_bom(base_url: str) -> None:
    url = f"{base_url}/x.jsonl"
    _write_raw(
        url,
        b'\xef\xbb\xbf{"text": "a"}\r\n   \r\n\n\t{"text": "b"}\r\n \n{"text": "\xc3\xa9"}',
    )
    h = JsonlHandler()
    r = h.open(url)
    assert [h.get(r, i) for i in range(h.length(r))] == ["a", "b", "é"]


def test_jsonl_json_array_and_fake_gzip(base_url: str) -> None:
    url = f"{base_url}/arr.json"
    _write_raw(url, b'[{"text": "a"},\n {"text": "b"}]\n')
    with pytest.raises(DataFileError, match=r"arr\.json.*JSON array"):
        JsonlHandler().open(url)
    url = f"{base_url}/plain.jsonl.gz"
    T.write_jsonl(url, ["a"], compression=None)
    with pytest.raises(DataFileError, match=r"plain\.jsonl\.gz.*not gzip"):
        JsonlHandler().open(url)
    assert JsonlHandler(compression=None).get(JsonlHandler(compression=None).open(url), 0) == "a"


def test_jsonl_multi_member_gzip_and_zstd_frames(base_url: str) -> None:
    import zstandard

    part1, part2 = b'{"text": "a"}\n', b'{"text": "b"}\n'
    url = f"{base_url}/multi.jsonl.gz"
    _write_raw(url, gzip.compress(part1) + gzip.compress(part2))
    h = JsonlHandler()
    r = h.open(url)
    assert h.get_many(r, [0, 1]) == ["a", "b"]
    url = f"{base_url}/multi.jsonl.zst"
    c = zstandard.ZstdCompressor()
    _write_raw(url, c.compress(part1) + c.compress(part2))
    r = h.open(url)
    assert h.get_many(r, [1, 0]) == ["b", "a"]


def test_empty_files(base_url: str) -> None:
    url = f"{base_url}/empty.jsonl"
    _write_raw(url, b"")
    h = JsonlHandler()
    assert h.length(h.open(url)) == 0
    url = f"{base_url}/empty.bin"
    _write_raw(url, b"")
    f = FlatTokenHandler(eos_token=EOS)
    r = f.open(url)
    assert f.length(r) == 0 and f.doc_lengths(r).tolist() == []
    url = f"{base_url}/empty.arrow"
    _write_raw(url, b"")
    with pytest.raises(DataFileError, match=r"empty\.arrow"):
        ArrowHandler().open(url)


def test_directory_is_not_a_file(tmp_path: Any) -> None:
    with pytest.raises(DataFileError, match="directory"):
        ArrowHandler().open(str(tmp_path))


# --------------------------------------------------------------------------- zero copy
def test_zero_copy_local(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    docs = [d for d in token_docs(rng, 6) if d.size] or [np.array([1, 2])]
    cases: list[tuple[str, FileHandler, Callable[[str], Any]]] = [
        ("b.arrow", ArrowHandler(), lambda u: T.write_arrow_batches(u, docs)),
        ("r.arrow", ArrowHandler(), lambda u: T.write_arrow_rows(u, docs, batch_size=2)),
        ("c.npy", CepedHandler(), lambda u: T.write_ceped_npy(u, docs)),
        ("s.npy", NpyHandler(), lambda u: T.write_ceped_npy(u, docs)),
        (
            "f.npy",
            FlatTokenHandler(eos_token=EOS),
            lambda u: T.write_flat_tokens(u, docs, eos_token=EOS),
        ),
        ("f.bin", FlatTokenHandler(), lambda u: T.write_flat_tokens(u, docs, offsets=True)),
    ]
    for name, handler, write in cases:
        url = os.path.join(tmp_path, name)
        write(url)
        reader = handler.open(url)
        a: Any = handler.get(reader, 0)
        b = handler.get_many(reader, [0])[0]
        assert not a.flags.owndata and a.base is not None, name
        assert not a.flags.writeable, name  # a view of the read-only memory map
        assert np.shares_memory(a, b), name  # two reads view the same bytes: no copies
        if hasattr(reader, "tokens"):
            assert np.shares_memory(a, reader.tokens), name


def test_zero_copy_memory_fs() -> None:
    url = f"memory://test-handlers-{uuid.uuid4().hex}/c.npy"
    try:
        T.write_ceped_npy(url, [np.array([1, 2, 3])])
        h = CepedHandler()
        r = h.open(url)
        assert np.shares_memory(h.get(r, 0), r.tokens)
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


# --------------------------------------------------------------------------- writers
def test_writers_validate() -> None:
    with pytest.raises(ValueError, match="contains eos_token"):
        T.write_flat_tokens("memory://unused/x.bin", [np.array([1, EOS])], eos_token=EOS)
    with pytest.raises(ValueError, match="do not fit"):
        T.write_flat_tokens("memory://unused/x.bin", [np.array([70000])], dtype=np.uint16)
    with pytest.raises(TypeError, match="mix"):
        T.write_parquet("memory://unused/x.parquet", ["a", [1]])
    with pytest.raises(TypeError, match="integers"):
        T.write_arrow_batches("memory://unused/x.arrow", [np.array([1.5])])
    assert not fsspec.filesystem("memory").exists("/unused")


def test_parquet_row_group_cache(base_url: str) -> None:
    url = f"{base_url}/rg.parquet"
    expected = T.write_parquet(url, [np.arange(k) for k in range(10)], row_group_size=3)
    h = ParquetHandler(max_cached_row_groups=2)
    r = h.open(url)
    assert r.row_group_starts.tolist() == [0, 3, 6, 9, 10]
    order = [9, 0, 5, 1, 8, 2]
    for i, doc in zip(order, h.get_many(r, order), strict=True):
        assert np.array_equal(doc, expected[i])
    assert len(r._cache) <= 2


# --------------------------------------------------------------------------- arrow batch index
def _ipc_file(url: str, batches: list[pa.RecordBatch], schema: pa.Schema, **options: Any) -> None:
    sink = pa.BufferOutputStream()
    write_options = pa.ipc.IpcWriteOptions(**options)
    with pa.ipc.new_file(sink, schema, options=write_options) as w:
        for b in batches:
            w.write_batch(b)
    with fsspec.open(url, "wb") as f:
        f.write(sink.getvalue().to_pybytes())


def _pyarrow_docs(url: str, col: str = "tokens") -> list[np.ndarray]:
    with fsspec.open(url, "rb") as f:
        fr = pa.ipc.open_file(pa.py_buffer(f.read()))
        return [
            fr.get_batch(i).column(col).to_numpy(zero_copy_only=False)
            for i in range(fr.num_record_batches)
        ]


INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", INT_TYPES, ids=[np.dtype(t).name for t in INT_TYPES])
def test_arrow_index_every_integer_type(base_url: str, dtype: Any) -> None:
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    docs = [
        rng.integers(info.min, info.max, size=int(k), dtype=dtype, endpoint=True)
        for k in [0, 1, 7, 33, 0, 120, 5]
    ]
    url = f"{base_url}/t.arrow"
    T.write_arrow_batches(url, docs, dtype=dtype)
    h = ArrowHandler()
    r = h.open(url)
    assert r.index is not None  # the fast path serves this file
    got = h.get_many(r, range(len(docs)))
    assert r.index.fast.all()
    for i, doc in enumerate(docs):
        for d in (got[i], h.get(r, i)):
            assert d.dtype == np.dtype(dtype) and np.array_equal(d, doc)
    assert h.doc_lengths(r).tolist() == [len(d) for d in docs]


def test_arrow_index_is_zero_copy(tmp_path: Any) -> None:
    docs = [np.arange(k, dtype=np.int32) + 10 * k for k in (3, 0, 50, 8)]
    url = str(tmp_path / "z.arrow")
    T.write_arrow_batches(url, docs)
    h = ArrowHandler()
    r = h.open(url)
    base = np.frombuffer(r.source, np.uint8)
    fr = pa.ipc.open_file(pa.py_buffer(r.source))
    for i, doc in enumerate(h.get_many(r, [0, 2, 3])):
        k = [0, 2, 3][i]
        assert np.shares_memory(doc, base) and not doc.flags.writeable
        col = fr.get_batch(k).column(0)
        # the very bytes pyarrow would hand out, not a copy of them
        offset = doc.ctypes.data - base.ctypes.data
        assert offset == col.buffers()[1].address - pa.py_buffer(r.source).address
        assert np.array_equal(doc, docs[k])


def test_arrow_index_nulls_fall_back_to_pyarrow(base_url: str) -> None:
    schema = pa.schema([("tokens", pa.int32())])
    batches = [
        pa.record_batch([pa.array([1, 2, 3], pa.int32())], schema=schema),
        pa.record_batch([pa.array([4, None, 6], pa.int32())], schema=schema),
        # a validity bitmap without nulls: still the fast path
        pa.record_batch([pa.array([7, None, 9], pa.int32()).fill_null(8)], schema=schema),
        pa.record_batch([pa.array([10], pa.int32())], schema=schema),
    ]
    url = f"{base_url}/n.arrow"
    _ipc_file(url, batches, schema)
    h = ArrowHandler()
    r = h.open(url)
    assert r.index is not None
    assert [h.get(r, i).tolist() for i in (0, 2, 3)] == [[1, 2, 3], [7, 8, 9], [10]]
    assert r.index.fast.tolist() == [True, False, True, True]
    with pytest.raises(DataFileError, match=r"n\.arrow.*null tokens in record batch 1"):
        h.get(r, 1)
    with pytest.raises(DataFileError, match=r"n\.arrow.*null tokens"):
        h.get_many(r, [0, 1, 2])
    assert [d.tolist() for d in h.get_many(r, [3, 0])] == [[10], [1, 2, 3]]
    assert h.doc_lengths(r).tolist() == [3, 3, 3, 1]


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_arrow_index_compressed_batches_go_through_pyarrow(base_url: str, compression) -> None:
    schema = pa.schema([("tokens", pa.int64())])
    docs = [np.arange(k, dtype=np.int64) for k in (5, 0, 300)]
    batches = [pa.record_batch([pa.array(d)], schema=schema) for d in docs]
    url = f"{base_url}/c.arrow"
    _ipc_file(url, batches, schema, compression=compression)
    h = ArrowHandler()
    r = h.open(url)
    got = h.get_many(r, [2, 0, 1])
    assert r.index is None or not r.index.fast[[0, 2]].any()
    assert [d.tolist() for d in got] == [docs[2].tolist(), docs[0].tolist(), []]


def test_arrow_index_other_columns_and_nested_ones(base_url: str) -> None:
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, size=int(k)) for k in (4, 0, 9)]

    def batch(columns: dict[str, Any]) -> pa.RecordBatch:
        return pa.record_batch(columns)

    flat = [
        batch({"id": pa.array([i] * len(d), pa.int16()), "s": pa.array(["x"] * len(d), pa.string()),
               "tokens": pa.array(d, pa.uint32())})
        for i, d in enumerate(docs)
    ]  # fmt: skip
    nested = [
        batch({"l": pa.array([[1, 2]] * len(d), pa.list_(pa.int8())),
               "tokens": pa.array(d, pa.uint32())})
        for d in docs
    ]  # fmt: skip
    for name, batches, indexed in (("flat", flat, True), ("nested", nested, False)):
        url = f"{base_url}/{name}.arrow"
        _ipc_file(url, batches, batches[0].schema)
        h = ArrowHandler()
        r = h.open(url)
        assert (r.index is not None) == indexed
        got = h.get_many(r, range(len(docs)))
        for d, want, ref in zip(got, docs, _pyarrow_docs(url), strict=True):
            assert d.dtype == np.uint32 and np.array_equal(d, want) and np.array_equal(d, ref)


def test_arrow_many_opens_of_one_file_share_an_index(tmp_path: Any, monkeypatch) -> None:
    docs = [np.arange(k, dtype=np.int32) for k in (3, 5, 0, 2)]
    url = str(tmp_path / "m.arrow")
    T.write_arrow_batches(url, docs)
    h = ArrowHandler()
    first = h.open(url)
    assert first.index is not None and first.file_reader is not None
    opened: list[Any] = []
    real_open_file = pa.ipc.open_file
    monkeypatch.setattr(
        pa.ipc, "open_file", lambda *a, **k: opened.append(a) or real_open_file(*a, **k)
    )
    readers = [h.open(url) for _ in range(50)]
    assert not opened  # later opens neither parse the file nor ask pyarrow
    for r in readers:
        assert r.index is first.index and r.file_reader is None
        assert [d.tolist() for d in h.get_many(r, [1, 0, 3, 2])] == [
            docs[1].tolist(), docs[0].tolist(), docs[3].tolist(), [],
        ]  # fmt: skip
        h.close(r)
    assert first.index.parsed.all()
    # the file changes: its index is built again
    docs2 = [np.arange(k, dtype=np.int32) + 100 for k in (1, 2, 3, 4, 5)]
    T.write_arrow_batches(url, docs2)
    r = h.open(url)
    assert r.index is not first.index and h.length(r) == 5
    assert [d.tolist() for d in h.get_many(r, range(5))] == [d.tolist() for d in docs2]
    # the index is the process's: a new handler, or one unpickled (a restore, an evaluation
    # loader, a torchft re-split), finds it parsed
    for h2 in (ArrowHandler(), pickle.loads(pickle.dumps(h))):
        r2 = h2.open(url)
        assert r2.index is r.index and r2.file_reader is None
        assert [d.tolist() for d in h2.get_many(r2, [4])] == [docs2[4].tolist()]
        h2.close(r2)
    assert len(opened) == 1  # the changed file, once


def test_arrow_index_of_a_file_rewritten_in_place_is_never_reused(tmp_path: Any) -> None:
    """Documents of 3 and 4 tokens written over ones of 4 and 3: the same bytes count, the
    same mtime (set back), the same inode; the file's ctime moved, so its cached index (which
    would cut the tokens at the old places) is not used. Nor is one of another column."""
    url, new_url = str(tmp_path / "same.arrow"), str(tmp_path / "new.arrow")
    T.write_arrow_batches(url, [np.arange(4, dtype=np.int32), np.arange(3, dtype=np.int32)])
    T.write_arrow_batches(
        new_url, [np.arange(3, dtype=np.int32) + 7, np.arange(4, dtype=np.int32) + 7]
    )
    h = ArrowHandler()
    assert [d.tolist() for d in h.get_many(h.open(url), [0, 1])] == [[0, 1, 2, 3], [0, 1, 2]]
    st = os.stat(url)
    with open(new_url, "rb") as f:
        body = f.read()
    assert len(body) == st.st_size
    with open(url, "r+b") as f:  # in place: same inode, same size
        f.write(body)
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(url)
    same = (after.st_ino, after.st_size, after.st_mtime_ns)
    assert same == (st.st_ino, st.st_size, st.st_mtime_ns)
    h2 = ArrowHandler()
    assert [d.tolist() for d in h2.get_many(h2.open(url), [0, 1])] == [[7, 8, 9], [7, 8, 9, 10]]
    with pytest.raises(DataFileError, match="other"):
        ArrowHandler(col_name="other").open(url)


def test_arrow_index_cache_holds_the_files_opened_last(tmp_path: Any, monkeypatch) -> None:
    import torchdata_ext.handlers.arrow as arrow_module

    monkeypatch.setattr(arrow_module, "_INDEXES", arrow_module._IndexCache())
    monkeypatch.setattr(arrow_module, "_INDEX_CACHE_FILES", 3)
    urls = [str(tmp_path / f"{i}.arrow") for i in range(5)]
    for i, url in enumerate(urls):
        T.write_arrow_batches(url, [np.arange(i + 1, dtype=np.int64)])
    h = ArrowHandler()
    first = [h.open(u).index for u in urls]  # room for 3: 2, 3 and 4 stay
    assert [h.open(urls[i]).index is first[i] for i in (4, 2)] == [True, True]
    # 0 is indexed again and pushes out the one used longest ago: 3
    assert h.open(urls[0]).index is not first[0]
    assert [h.open(urls[i]).index is first[i] for i in (2, 4, 3)] == [True, True, False]
    assert len(arrow_module._INDEXES._entries) == 3


def test_arrow_index_not_used_for_streams_and_range_reads(base_url: str) -> None:
    docs = [np.arange(k, dtype=np.int64) for k in (2, 0, 4)]
    url = f"{base_url}/s.arrow"
    T.write_arrow_batches(url, docs, stream=True)
    h = ArrowHandler()
    r = h.open(url)
    assert r.ipc_format == "stream" and r.index is None
    assert [d.tolist() for d in h.get_many(r, [2, 1, 0])] == [[0, 1, 2, 3], [], [0, 1]]
    url = f"{base_url}/f.arrow"
    T.write_arrow_batches(url, docs)
    r = h.open(url)
    assert r.ipc_format == "file" and r.index is not None  # local or memory://


def test_arrow_index_template_parse_equals_the_flatbuffer_parse(tmp_path: Any) -> None:
    """Batches parsed by comparison with a template batch get exactly the fields a full read
    of their flatbuffers gives, on files mixing layouts (empty batches, whose zero fields are
    left out of the metadata, nulls, other columns, compression)."""
    from torchdata_ext.handlers.arrow import batch_index

    rng = np.random.default_rng(9)
    lengths = [0, 5, 0, 17, 1, 300, 0, 2, 64, 9]
    docs = [rng.integers(0, 50_000, size=k) for k in lengths]
    schema = pa.schema([("id", pa.int32()), ("tokens", pa.int64()), ("s", pa.string())])

    def batch(i: int, d: np.ndarray, null: bool) -> pa.RecordBatch:
        toks = pa.array(d, pa.int64(), mask=(np.arange(len(d)) == 1) if null else None)
        return pa.record_batch(
            [pa.array([i] * len(d), pa.int32()), toks, pa.array(["ab"] * len(d), pa.string())],
            schema=schema,
        )

    variants = {
        "plain": ([batch(i, d, False) for i, d in enumerate(docs)], {}),
        "nulls": ([batch(i, d, i % 3 == 0) for i, d in enumerate(docs)], {}),
        "zstd": ([batch(i, d, False) for i, d in enumerate(docs)], {"compression": "zstd"}),
    }
    for name, (batches, options) in variants.items():
        url = str(tmp_path / f"{name}.arrow")
        _ipc_file(url, batches, schema, **options)
        with open(url, "rb") as f:
            buf = f.read()
        fr = pa.ipc.open_file(pa.py_buffer(buf))
        by_template = batch_index(buf, schema, 1)
        by_flatbuffers = batch_index(buf, schema, 1)
        assert by_template is not None and by_flatbuffers is not None
        by_flatbuffers._template = False
        order = rng.permutation(len(docs))
        for part in np.array_split(order, 3):  # several calls, as get_many makes them
            by_template.ensure(buf, part)
        by_flatbuffers.ensure_all(buf)
        if name == "plain":
            assert by_template._template  # a template was made and used
        for key in ("lengths", "starts", "fast", "parsed"):
            assert np.array_equal(getattr(by_template, key), getattr(by_flatbuffers, key)), key
        view = by_template.view(buf)
        for i in np.flatnonzero(by_template.fast):
            want = fr.get_batch(int(i)).column(1).to_numpy()
            got = view[by_template.starts[i] : by_template.starts[i] + by_template.lengths[i]]
            assert np.array_equal(got, want)


def test_sorted_unique_is_np_unique_without_loading_numpy_ma() -> None:
    """The Arrow index's ``np.unique`` (which loads ``numpy.ma``, ~9 ms of a worker's first
    batch): the same values and dtype, for any integers, repeated or not, empty or not."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from torchdata_ext.handlers.arrow_index import sorted_unique

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(-(2**40), 2**40) | st.integers(0, 9), max_size=60))
    def check(values: list[int]) -> None:
        a = np.asarray(values, np.int64)
        got, want = sorted_unique(a), np.unique(a)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
        assert a.tolist() == values  # the input is left as it was

    check()
