"""An object store that cannot work fails fast and clearly on every entry point.

A closed port, a bucket that does not exist or missing credentials: the command line
(``prepare`` input and ``--out``, ``inspect``, ``audit``, each given ``--storage-options``) and
the Python API raise one clear error naming the URL, the endpoint and what to check, within a
few seconds (not after the S3 client's own retries and back-off, 6-30 s before).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import credentials_checked

from torchdata_ext import DatasetIndex, prepare
from torchdata_ext.cli import main
from torchdata_ext.remote import RemoteError
from torchdata_ext.testing import write_jsonl

# the clear error comes within this: ~0.4 s on an idle machine (a refused connection is one
# round trip; 1.5-6 s measured at a load average of 14 on 2 cores: making the S3 client is
# CPU), 11-27 s per command before the probe (the client's retries and back-off, idle machine)
FAST_S = 8.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def closed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Storage options of an endpoint where nothing listens (credentials set); s3fs imported
    (its import, seconds on a loaded machine, is not what the tests time)."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    return {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def _cli_fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    t0 = time.monotonic()
    assert main(list(argv)) == 2
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.startswith(f"torchdata-ext {argv[0]}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "storage_options" not in err, err
    assert elapsed < FAST_S, f"{elapsed:.1f}s"
    return err


def test_the_cli_names_a_closed_endpoint_at_once(closed, tmp_path: Path, capsys) -> None:
    endpoint = closed["client_kwargs"]["endpoint_url"]
    so = json.dumps(closed)
    local_in = tmp_path / "in.jsonl"
    write_jsonl(str(local_in), ["hello"])
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"data_path": str(tmp_path), "datasets": "d", "seq_length": 8}))
    refused = (
        f"cannot connect to the endpoint {endpoint} (connection refused: nothing listens there)"
    )
    for argv in (
        ["prepare", "s3://bucket/in.jsonl", "--out", str(tmp_path / "out")],
        ["prepare", str(local_in), "--out", "s3://bucket/out"],
        ["inspect", "s3://bucket/data"],
        ["audit", "s3://bucket/ckpt/step_1", "--config", str(cfg)],
    ):
        err = _cli_fails(capsys, *argv, "--storage-options", so)
        url = next(a for a in argv if a.startswith("s3://"))
        assert f"error: {url}" in err, err  # (audit: the checkpoint's manifest.json in it)
        assert f": access failed: {refused}; check the endpoint URL " in err, err
        assert "(--storage-options client_kwargs endpoint_url, or AWS_ENDPOINT_URL)" in err, err
    assert not (tmp_path / "out").exists()


def test_storage_options_must_be_a_json_object(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "s3://bucket/data", "--storage-options", "{anon: true}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --storage-options: not valid JSON (" in err, err
    with pytest.raises(SystemExit):
        main(["inspect", "s3://bucket/data", "--storage-options", "[1]"])
    assert "'[1]' is not a JSON object: give one in braces" in capsys.readouterr().err


def test_the_python_api_names_a_closed_endpoint_at_once(closed, tmp_path: Path) -> None:
    endpoint = closed["client_kwargs"]["endpoint_url"]
    for call in (
        lambda: DatasetIndex.build("s3://bucket/data", storage_options=closed),
        lambda: prepare("s3://bucket/in.jsonl", str(tmp_path / "out"), storage_options=closed),
    ):
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=f"cannot connect to the endpoint {endpoint}"):
            call()
        assert time.monotonic() - t0 < FAST_S


def test_a_wrong_bucket_and_missing_credentials_on_a_real_endpoint(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    so = json.dumps(s3.storage_options)
    err = _cli_fails(capsys, "inspect", "s3://no-such-bucket-here/data", "--storage-options", so)
    assert "s3://no-such-bucket-here/data: access failed: the bucket does not exist (" in err
    assert "check the bucket name in the URL and the endpoint" in err
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="the bucket does not exist"):
        DatasetIndex.build("s3://no-such-bucket-here/data", storage_options=s3.storage_options)
    assert time.monotonic() - t0 < FAST_S

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    no_keys = {"client_kwargs": s3.storage_options["client_kwargs"]}
    err = _cli_fails(capsys, "inspect", s3.url("data"), "--storage-options", json.dumps(no_keys))
    assert f"{s3.url('data')}: access failed: no credentials were found (" in err, err
    assert "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in err


def test_a_store_that_works_is_probed_once(s3) -> None:
    """The check is one request the first time a process opens a store, not one per file."""
    from torchdata_ext.remote.process_state import PROBED_STORES

    write_jsonl(s3.url("d", "a.jsonl"), ["x"], storage_options=s3.storage_options)
    PROBED_STORES.items.clear()
    idx = DatasetIndex.build(s3.url("d"), storage_options=s3.storage_options)
    assert list(idx.files) == [s3.url("d", "a.jsonl")]
    assert len(PROBED_STORES.items) == 1, PROBED_STORES.items


def test_wrong_credentials_on_a_real_endpoint(s3, capsys) -> None:
    with credentials_checked(s3.endpoint_url):  # the endpoint now checks credentials
        wrong = {**s3.storage_options, "key": "no-such-key"}
        err = _cli_fails(capsys, "inspect", s3.url("data"), "--storage-options", json.dumps(wrong))
    assert f"error: {s3.url('data')}: access failed: access denied (" in err, err
    assert "check the credentials (--storage-options key/secret/token, or the environment" in err
