"""What may change at a restore and what must match (``RESTORE_CONTRACT``, docs/checkpoint.md).

Every ``PipelineConfig`` field has one class; a must-match field changed at a restore is
refused by name before any data moves (a 2-worker checkpoint, restored with that one field
changed); a may-change field restores exactly (the rest of the epoch holds the rows the
uninterrupted run delivered after the checkpoint).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest
from harness import write_random_arrow_datasets, write_random_text_datasets

from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import RESTORE_CONTRACT, PipelineConfig

CLASSES = ("may_change", "must_match", "opt_in")
STEPS = 10  # batches before the checkpoint


def test_every_config_field_has_one_restore_class() -> None:
    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    assert set(RESTORE_CONTRACT) == fields, (
        f"fields without a restore class: {sorted(fields - set(RESTORE_CONTRACT))}; "
        f"classes of no field: {sorted(set(RESTORE_CONTRACT) - fields)}: add the field to "
        "RESTORE_CONTRACT (pipeline/config.py) and to the table of docs/checkpoint.md"
    )
    for name, (cls, why) in RESTORE_CONTRACT.items():
        assert cls in CLASSES and why, name


DOCS = Path(__file__).parent.parent / "docs" / "checkpoint.md"


def test_the_docs_table_is_the_contract() -> None:
    """Every field's row, with its class and reason; and no row of another class or field."""
    text = DOCS.read_text()
    label = {"may_change": "may change", "must_match": "must match", "opt_in": "opt-in"}
    for name, (cls, why) in RESTORE_CONTRACT.items():
        assert f"| `{name}` | {label[cls]} | {why} |" in text, name
    rows = re.findall(r"^\| `(\w+)` \| (may change|must match|opt-in) \|", text, re.M)
    assert sorted(rows) == sorted((n, label[c]) for n, (c, _) in RESTORE_CONTRACT.items())


def test_the_docs_folder_example_says_where_its_checkpoint_was_saved(tmp_path, monkeypatch):
    """The folder-checkpoint example of docs/checkpoint.md loads the checkpoint that the page's
    blocks before it save (run in order from an empty folder, as a reader does): its comment's
    topology and step are that one's."""
    from test_readme import blocks

    from torchdata_ext.checkpoint.folder import read_manifest

    page = [b for b in blocks() if b[0].startswith("checkpoint.md:")]
    (at,) = [i for i, (_, c, _, _) in enumerate(page) if 'load_checkpoint(loader, "ckpt/step_' in c]
    code = page[at][1]
    said = re.search(r'load_checkpoint\(loader, "ckpt/step_(\d+)/loader"\)\s+# saved at '
                     r"(\d+) rank x (\d+) workers", code)  # fmt: skip
    assert said, code
    step, ranks, workers = map(int, said.groups())
    assert f"enumerate(loader, {step + 1})" in code  # the steps go on from the checkpoint's
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for where, before, _, skip in page[:at]:
        if skip is None:
            exec(compile(before, where, "exec"), namespace)
    if namespace.get("loader") is not None:
        namespace["loader"].close()
    manifest = read_manifest(f"ckpt/step_{step}/loader")
    # 0 workers: the pipeline in a thread, one logical worker in the manifest
    assert (manifest["world_size"], manifest["num_workers"]) == (ranks, max(workers, 1))
    assert manifest["step"] == step


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("contract")
    write_random_arrow_datasets(str(root), (("web", 160, 20), ("code", 80, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=16, block_docs=5,
        epochs=1, mix_quantum_tokens=0, output_keys="input_ids",
    )  # fmt: skip


def _rows(batches: list[dict[str, Any]]) -> list[tuple[int, ...]]:
    return [tuple(r) for b in batches for r in b["input_ids"].tolist()]


def _save(cfg: PipelineConfig, ckpt: str) -> list[tuple[int, ...]]:
    """Run ``cfg`` on 2 workers for :data:`STEPS` batches, save, return the rows delivered."""
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == STEPS:
            break
    save_checkpoint(loader, ckpt)
    return _rows(batches)


MUST_MATCH = [  # block_docs may change: tests/test_restore_changes.py checks it exact
    ("mix_quantum_tokens", 65_536),
    ("max_chunksize", 10),
    ("min_length", 5),
    ("strip_tokens", [7]),
    ("bos_token", None),
    ("bos_token", 300),
    ("eos_token", None),
    ("interleave_mode", "samples"),
    ("shuffle_buffer", 1),
    ("max_tokens", 3000),
    ("max_documents", 100),
    ("transforms", [{"min_length": 2}]),
    ("seed", 6),
    ("seq_length", 48),
    ("pack_mode", "pad"),
    ("shift", False),
    ("logical_shards", 12),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("field,value", MUST_MATCH, ids=lambda x: str(x))
def test_must_match_fields_are_refused_by_name(cfg, tmp_path, field, value) -> None:
    # shuffle_buffer may change its size, not from above 1 to 1 (no buffer: another graph)
    assert RESTORE_CONTRACT[field][0] == "must_match" or field == "shuffle_buffer"
    ckpt = str(tmp_path / "ckpt")
    _save(cfg, ckpt)
    changed = dataclasses.replace(cfg, **{field: value})
    loader = TokenLoader(functools.partial(build_pipeline, changed), num_workers=2)
    with pytest.raises(ValueError, match=field) as info:
        load_checkpoint(loader, ckpt)
    assert "KeyError" not in repr(info.value)


@pytest.mark.multiprocess
def test_a_changed_budget_is_refused_by_name(cfg, tmp_path) -> None:
    budgeted = dataclasses.replace(cfg, max_tokens=4000)
    ckpt = str(tmp_path / "ckpt")
    _save(budgeted, ckpt)
    for changed in (dict(max_tokens=5000), dict(max_tokens=None), dict(max_documents=50)):
        loader = TokenLoader(
            functools.partial(build_pipeline, dataclasses.replace(budgeted, **changed)),
            num_workers=2,
        )
        with pytest.raises(ValueError, match=next(iter(changed))):
            load_checkpoint(loader, ckpt)


@pytest.fixture(scope="module")
def text_root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("contract_text")
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "theta"]
    write_random_text_datasets(str(root), (("web", 60, 12), ("code", 30, 20)), words, seed=4)
    tok = _bpe(words)
    tok.save(str(root / "bpe.json"))
    _bpe(list(reversed(words)), vocab=300).save(str(root / "bpe2.json"))
    return str(root)


def _bpe(words: list[str], vocab: int = 280) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],  # id 0: the EOS, inside the vocabulary
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(words * 3)] * 50, trainer)
    return tok


def _text_cfg(root: str, **extra: Any) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="2,1", file_type="jsonl",
        col_name="text", seq_length=32, eos_token=0, pad_token=1001, logical_shards=12,
        batch_size=2, seed=9, shuffle_buffer=5, block_docs=4, epochs=1, mix_quantum_tokens=0,
        output_keys="input_ids", **extra,
    )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "saved,now,field",
    [
        (dict(tokenizer="bpe.json"), dict(tokenizer="byte"), "tokenizer"),
        (dict(tokenizer="bpe.json"), dict(tokenizer="bpe2.json"), "tokenizer"),
        (dict(tokenizer="byte"), dict(tokenizer="byte", byte_offset=2), "byte_offset"),
    ],
    ids=["bpe-to-byte", "bpe-to-bpe", "byte_offset"],
)
def test_another_tokenizer_is_refused_by_name(text_root, tmp_path, saved, now, field) -> None:
    def cfg_of(d: dict[str, Any]) -> PipelineConfig:
        d = dict(d)
        if d["tokenizer"] != "byte":
            d["tokenizer"] = f"{text_root}/{d['tokenizer']}"
        return _text_cfg(text_root, **d)

    ckpt = str(tmp_path / "ckpt")
    _save(cfg_of(saved), ckpt)
    loader = TokenLoader(functools.partial(build_pipeline, cfg_of(now)), num_workers=2)
    with pytest.raises(ValueError, match=f"{field} differs"):
        load_checkpoint(loader, ckpt)


MAY_CHANGE = [
    ("batch_size", 3),
    ("shuffle_buffer", 64),
    ("datasets", ["code", "web"]),
    ("shuffle_fill", "full"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("field,value", MAY_CHANGE, ids=lambda x: str(x))
def test_may_change_fields_restore_exactly(cfg, tmp_path, field, value) -> None:
    assert RESTORE_CONTRACT[field][0] != "must_match"
    whole = _rows(list(TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)))
    ckpt = str(tmp_path / "ckpt")
    before = _save(cfg, ckpt)
    assert whole[: len(before)] == before  # the same run up to the checkpoint
    extra: dict[str, Any] = {field: value}
    if field == "datasets":
        extra["weights"] = [1.0, 2.0]  # the same weight per dataset, in the new order
    changed = dataclasses.replace(cfg, **extra)
    loader = TokenLoader(functools.partial(build_pipeline, changed), num_workers=2)
    load_checkpoint(loader, ckpt)
    after = _rows(list(loader))
    if field in ("batch_size", "shuffle_buffer", "shuffle_fill"):
        # the rows and their contents are the same; batches (workers taking turns) or the
        # buffer's draws put them in another order
        assert collections.Counter(after) == collections.Counter(whole[len(before) :])
    else:
        assert after == whole[len(before) :]


@pytest.mark.parametrize(
    "field,value",
    [("interleave_mode", "samples"), ("mix_quantum_tokens", 65_536), ("eos_token", None)],
)
def test_a_graph_reset_with_a_saved_state_refuses_too(cfg, field, value) -> None:
    """Without a checkpoint (a graph restored from its state directly) the nodes refuse."""
    from torchdata_ext import World

    root = build_pipeline(cfg, World(), collate=False)
    root.reset()
    for _ in range(7):
        next(root)
    state = root.state_dict()
    other = build_pipeline(dataclasses.replace(cfg, **{field: value}), World(), collate=False)
    with pytest.raises(ValueError, match=f"{field}.* differs"):
        other.reset(state)


def test_states_saved_before_settings_were_recorded_still_restore(cfg) -> None:
    """A state without ``settings`` (written before they were recorded) is not checked."""
    from harness import item_key

    from torchdata_ext import World

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "settings"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    root = build_pipeline(cfg, World(), collate=False)
    root.reset()
    for _ in range(7):
        next(root)
    state = root.state_dict()
    rest = [item_key(x) for x in root]
    again = build_pipeline(cfg, World(), collate=False)
    again.reset(strip(state))
    assert [item_key(x) for x in again] == rest
    changed = build_pipeline(dataclasses.replace(cfg, block_docs=8), World(), collate=False)
    changed.reset(strip(state))  # unknown: accepted as before
