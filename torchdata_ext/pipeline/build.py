"""The standard pre-training pipeline in one call, from a :class:`PipelineConfig`.

::

    data_path/<dataset>/*.arrow ─► DatasetIndex ─► ShardReader (logical shards, random walk)
        ─► [text transforms] ─► Tokenize (text only) ─► [token transforms]
        ─► Interleave (weights, in tokens) ─► Pack (seq_length)
        ─► ShuffleBuffer ─► Collate (batch_size) ─► Loader / StatefulDataLoader

With ``phases`` one Interleave per phase goes into a ``Concat``; ``max_tokens`` /
``max_documents`` put a ``Take`` over a dataset's reader (a mapping) or over the mix (an int).

The config and its checks are :mod:`torchdata_ext.pipeline.config`; this module builds the
dataset indexes and wires the stages, one function per stage.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.order.split import Subset
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.pipeline.curriculum import with_budget
from torchdata_ext.remote.urls import join
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.sources.index_file import load_index_file, shared_indexes, with_side_files
from torchdata_ext.sources.prepared_meta import check_config, read_meta
from torchdata_ext.tokenizers.load import load_tokenizer, token_ids, worker_threads
from torchdata_ext.world import World

if TYPE_CHECKING:
    from torchdata_ext.nodes.reader import ShardReader

__all__ = [
    "build_datasets",
    "build_eval_pipeline",
    "build_pipeline",
    "indexes_to_share",
    "mix_cuts_rows",
    "mix_quantum_tokens",
    "with_indexes",
]


def build_datasets(cfg: PipelineConfig, world: World | None = None) -> dict[str, DatasetIndex]:
    """The ``DatasetIndex`` of every dataset of ``cfg``, by name.

    Each comes from the dataset's index file (``meta/torchdata_ext_index.json``: one GET, no
    LIST; :mod:`torchdata_ext.sources.index_file`) when it has one counted as ``cfg`` asks, else from
    listing its folder (:meth:`DatasetIndex.build`). An index file is checked against a
    listing by one process of the job (rank 0, worker 0), which refuses a stale one
    (:class:`~torchdata_ext.sources.index_file.StaleIndexError`).

    Under ``torch.distributed`` (initialised, more than one rank), called in the training
    process, this is a collective: rank 0 builds the indexes and broadcasts them, so the job
    lists each folder once. Call it on every rank and pass the result to every pipeline
    (``functools.partial(build_pipeline, cfg, datasets=datasets)``): the dataloader workers
    then ask the store for nothing before reading data.

    Args:
        cfg: the pipeline config.
        world: this copy's place (default: rank from ``torch.distributed``, else the ``RANK``
            environment variable, else 0); it decides which process checks an index file.
    """
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    if (
        world is None
        and get_worker_info() is None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        return shared_indexes(lambda: _datasets_here(cfg, True), "build the dataset indexes")
    return _datasets_here(cfg, _checks_index_files(world))


def _checks_index_files(world: World | None) -> bool:
    """Whether this copy checks index files against a listing: rank 0's worker 0 (``world``
    None: rank 0 by ``torch.distributed`` or ``RANK``, outside dataloader workers)."""
    if world is not None:
        return world.rank == 0 and world.worker_id == 0
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    info = get_worker_info()
    return rank == 0 and (info is None or info.id == 0)


def _datasets_here(cfg: PipelineConfig, verify: bool) -> dict[str, DatasetIndex]:
    """:func:`build_datasets` in this process alone (``verify``: check index files)."""
    out: dict[str, DatasetIndex] = {}
    for name in cfg.dataset_weights:
        url = join(cfg.data_path, name) if cfg.datasets else cfg.data_path
        options: dict[str, Any] = dict(
            name=name,
            file_type=cfg.file_type,
            col_name=cfg.col_name,
            eos_token=cfg.eos_token,  # to the formats that split on it, whatever file_type
            storage_options=cfg.storage_options,
        )
        index = load_index_file(url, **options, verify=verify)
        if index is None:
            index = DatasetIndex.build(url, **options)
        out[name] = with_side_files(index)
    return out


def _reads_indexes(build: Any) -> bool:
    """Whether ``build`` is ``functools.partial(build_pipeline, cfg)`` without ``datasets``
    (the config alone: the loader passes the World), which reads the index files at every
    graph it builds."""
    return (
        isinstance(build, functools.partial)
        and build.func is build_pipeline
        and build.keywords.get("datasets") is None
        and len(build.args) <= 1
    )


def with_indexes(build: Any, datasets: Mapping[str, DatasetIndex]) -> Any:
    """``build`` given the indexes ``datasets`` when it would read them at every graph it
    builds (``functools.partial(build_pipeline, cfg)``); a build function of another kind as
    it is. ``load_checkpoint`` passes on the indexes its checks read so."""
    if datasets and _reads_indexes(build):
        return functools.partial(build, datasets=datasets)
    return build


def indexes_to_share(build: Any, world: World | None = None) -> dict[str, DatasetIndex] | None:
    """The indexes ``build`` would read at every graph it builds, read here, now (None for a
    build function that reads none: another kind, or given them already). What a
    ``TokenLoader`` passes on to its graphs (:func:`with_indexes`) when it starts (before its
    dataloader workers, if any), so that they and the saves read no index file (each worker read each
    dataset's index and metadata files before: 2 requests per dataset per worker on an object
    store). Read as a worker would: rank 0 checks the index files against a listing; never a
    collective. ``world``: the loader's rank (its worker 0), which decides that check; None
    detects it (``torch.distributed`` or ``RANK``): a rank given as ``rank=`` without either
    is rank 0 there, and every rank would list."""
    if not _reads_indexes(build):
        return None
    cfg = build.args[0] if build.args else build.keywords["cfg"]
    return _datasets_here(cfg, _checks_index_files(world))


def build_pipeline(
    cfg: PipelineConfig,
    world: World | None = None,
    datasets: Mapping[str, DatasetIndex] | None = None,
    *,
    collate: bool = True,
) -> BaseNode:
    """Build the whole node graph for one (rank, worker) from ``cfg``.

    Args:
        cfg: the pipeline config.
        world: this copy's place (default: detected when iteration starts).
        datasets: pre-built indexes (default: built from ``cfg``; in-memory data:
            ``{name: DatasetIndex.from_documents(name, docs)}``).
        collate: end with ``Collate`` (batches of torch tensors); False ends with the shuffle
            buffer (one packed-sequence dict of NumPy arrays per item).

    With ``cfg.eval_fraction``, the readers skip the held-out documents.
    """
    return _build(cfg, world, datasets, collate=collate, subset="train")


def build_eval_pipeline(
    cfg: PipelineConfig,
    world: World | None = None,
    datasets: Mapping[str, DatasetIndex] | None = None,
    *,
    collate: bool = True,
) -> BaseNode:
    """The graph that delivers the held-out evaluation documents of ``cfg``, once.

    The same stages as :func:`build_pipeline` with: readers that deliver only the documents
    ``cfg.eval_fraction`` holds out, one epoch (``cfg.epochs`` is ignored), no shuffle buffer,
    and a last partial batch that is kept (not dropped). Over all ranks and workers every
    held-out document comes out exactly once. Datasets with no held-out share are left out.
    :class:`~torchdata_ext.loader.evaluation.EvalLoader` runs it and pads the last batches.

    Raises:
        ValueError: ``cfg.eval_fraction`` holds out nothing.
    """
    return _build(cfg, world, datasets, collate=collate, subset="eval")


def _build(
    cfg: PipelineConfig,
    world: World | None,
    datasets: Mapping[str, DatasetIndex] | None,
    *,
    collate: bool,
    subset: Subset,
) -> BaseNode:
    """The stages of the module docstring, in order, for ``subset`` (``"eval"``: one epoch of
    the held-out documents, no budgets, no shuffle buffer)."""
    evaluating = subset == "eval"
    cfg.check_memory()  # an absurd size is refused before anything is listed or allocated
    indexes = _indexes_to_read(cfg, world, datasets, evaluating)
    tokenizer = _checked_tokenizer(cfg, indexes)
    sources: dict[str, BaseNode] = {}
    readers: list[ShardReader] = []
    for name, index in indexes.items():
        reader = _reader(cfg, name, index, world, tokenizer, subset)
        readers.append(reader)
        node = _document_stages(cfg, name, reader, tokenizer, world)
        sources[name] = (
            node if evaluating else with_budget(node, cfg, name, f"dataset:{name}", world)
        )
    node = _mix(cfg, sources, world, evaluating)
    # provenance / dataset_ids index the config's datasets, also where eval leaves some out
    names = [*cfg.dataset_weights, *(n for n in indexes if n not in cfg.dataset_weights)]
    node = _pack(cfg, node, names)
    if cfg.shuffle_buffer > 1 and not evaluating:
        node = _shuffle_buffer(cfg, node, list(indexes.values()), readers)
    if collate:
        node = _collate(cfg, node, names)
        if evaluating:  # skip_steps count training steps
            node.skip_steps = []
    return node


def _indexes_to_read(
    cfg: PipelineConfig,
    world: World | None,
    datasets: Mapping[str, DatasetIndex] | None,
    evaluating: bool,
) -> dict[str, DatasetIndex]:
    """``datasets`` (default: built here); to evaluate, only those with a held-out share.

    Raises:
        ValueError: evaluating, and ``cfg.eval_fraction`` holds out nothing.
    """
    if datasets is None:  # never a collective here: a build may run on one rank alone
        datasets = _datasets_here(cfg, _checks_index_files(world))
    indexes = dict(datasets)
    if evaluating:
        indexes = {n: ix for n, ix in indexes.items() if cfg.eval_split(n) is not None}
        if not indexes:
            raise ValueError(
                f"eval_fraction={cfg.eval_fraction!r} holds out no documents: set eval_fraction "
                "(e.g. 0.01) to evaluate on a held-out share of the data"
            )
    return indexes


def _checked_tokenizer(cfg: PipelineConfig, datasets: Mapping[str, DatasetIndex]) -> Any | None:
    """The config's tokenizer, loaded (None for token data), once the data agrees with it:
    no text without a tokenizer (:func:`_check_tokens`), no special id it emits for text, and
    data that ``prepare`` wrote tokenized as the config says."""
    if cfg.tokenizer is None:
        _check_tokens(cfg, datasets)
    tokenizer = None
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(
            cfg.tokenizer, byte_offset=cfg.byte_offset, storage_options=cfg.storage_options
        )
        cfg.check_special_ids(tokenizer)
    for name, index in datasets.items():  # data prepare wrote says how it was tokenized
        found = read_meta(index.root, index.storage_options, index.side_files)
        if found is not None:
            check_config(
                *found,
                name,
                tokenizer=tokenizer,
                tokenizer_spec=cfg.tokenizer,
                specials=cfg.special_tokens,
                dtype=cfg.dtype,
            )
    return tokenizer


def _reader(
    cfg: PipelineConfig,
    name: str,
    index: DatasetIndex,
    world: World | None,
    tokenizer: Any | None,
    subset: Subset,
) -> ShardReader:
    """The ``ShardReader`` of dataset ``name``: its logical shards' documents, in blocks,
    skipping (``"train"``) or keeping only (``"eval"``, one epoch) the held-out ones."""
    from torchdata_ext.nodes.reader import ShardReader

    return ShardReader(
        index,
        cfg.logical_shards,
        seed=cfg.seed,
        world=world,
        epochs=1 if subset == "eval" else cfg.epochs,
        block_docs=cfg.block_docs,
        min_length=cfg.min_length,
        strip_tokens=cfg.strip_tokens,  # type: ignore[arg-type]
        max_chunksize=cfg.max_chunksize if tokenizer is None else None,
        dtype=np.int32,
        split=cfg.eval_split(name),
        subset=subset,
        max_dropped=cfg.max_dropped_documents,
    )


def _document_stages(
    cfg: PipelineConfig,
    name: str,
    reader: BaseNode,
    tokenizer: Any | None,
    world: World | None,
) -> BaseNode:
    """``reader``'s documents through dataset ``name``'s text transforms, ``Tokenize`` (with a
    tokenizer) and its token transforms.

    Raises:
        ValueError: text transforms on token data (no tokenizer).
    """
    from torchdata_ext.nodes.tokenize import Tokenize
    from torchdata_ext.nodes.transform import TransformDocuments

    node = reader
    steps = cfg.transforms_for(name)
    text_steps = [t for t in steps if t.on == "text"]
    token_steps = [t for t in steps if t.on == "tokens"]
    if text_steps:
        if tokenizer is None:
            raise ValueError(
                f"transforms for dataset {name!r} include text steps {text_steps}, but the "
                "config has no tokenizer (the data is tokens): use token transforms"
            )
        node = TransformDocuments(node, text_steps, max_dropped=cfg.max_dropped_documents)
    if tokenizer is not None:
        # a transform after Tokenize cuts handed-back pieces itself (its coordinates)
        node = Tokenize(
            node,
            tokenizer,
            cut_handed_back=not token_steps,
            # 2 encoding threads (each a batch encode), 1 when a worker has one core
            num_threads=min(2, worker_threads(world.num_workers if world else 1)),
        )
    if token_steps:
        max_id, ids_from = _id_range(cfg, tokenizer)
        node = TransformDocuments(
            node,
            token_steps,
            max_dropped=cfg.max_dropped_documents,
            max_id=max_id,
            ids_from=ids_from,
        )
    return node


def _id_range(cfg: PipelineConfig, tokenizer: Any | None) -> tuple[int, str]:
    """The largest id a token transform may return, and where it comes from (for messages):
    the tokenizer's vocabulary and the config's special ids, or the output dtype."""
    if tokenizer is None:
        return int(np.iinfo(cfg.dtype).max), f"the output dtype {cfg.dtype}"
    ids = token_ids(tokenizer, cfg.tokenizer)
    specials = [v for v in cfg.special_tokens.values() if v is not None]
    top = max([ids.vocab_size - 1, *specials])
    return top, f"the vocabulary of the tokenizer {ids.name} and the special ids of the config"


def mix_quantum_tokens(cfg: PipelineConfig) -> int:
    """The ``quantum_tokens`` (tokens) the mix of ``cfg`` runs with: ``cfg.mix_quantum_tokens``,
    or one sequence (``cfg.seq_length``) when it is None (the default)."""
    if cfg.mix_quantum_tokens is None:
        return cfg.seq_length
    return cfg.mix_quantum_tokens


def mix_cuts_rows(cfg: PipelineConfig) -> bool:
    """Whether the training mix of ``cfg`` may switch datasets inside a document at a row end:
    ``"tokens"`` mode feeding a ``concat`` Pack directly (no run budget, no phases), where the
    Pack calls ``Interleave.follow_rows``. Otherwise documents are never split between them."""
    budget = any(isinstance(getattr(cfg, k), int) for k in ("max_tokens", "max_documents"))
    return (
        cfg.interleave_mode == "tokens"
        and cfg.pack_mode == "concat"
        and not cfg.phases
        and not budget
    )


def _mix(
    cfg: PipelineConfig, sources: Mapping[str, BaseNode], world: World | None, evaluating: bool
) -> BaseNode:
    """The datasets' ``Interleave`` at ``cfg``'s weights; with ``phases`` (training) a
    ``Concat`` of one mix per phase, each ending at its budget or when exhausted. Training puts
    the run's budget over it (held-out data is evaluated whole)."""
    from torchdata_ext.nodes.concat import Concat
    from torchdata_ext.nodes.interleave import Interleave

    def mix(weights: Mapping[str, float]) -> BaseNode:
        return Interleave(
            {n: sources[n] for n in weights if n in sources},
            {n: w for n, w in weights.items() if n in sources},
            mode=cfg.interleave_mode,
            seed=cfg.seed,
            quantum_tokens=mix_quantum_tokens(cfg),
        )

    if evaluating:
        return mix(cfg.dataset_weights)
    if cfg.phases:
        node: BaseNode = Concat(
            [
                with_budget(
                    mix(dict(zip(p["datasets"], p["weights"]))), p, None, f"phase{i}", world
                )
                for i, p in enumerate(cfg.phases)
            ]
        )
    else:
        node = mix(cfg.dataset_weights)
    return with_budget(node, cfg, None, "run", world)


def _pack(cfg: PipelineConfig, node: BaseNode, dataset_names: list[str]) -> BaseNode:
    """Documents packed into ``cfg.seq_length``-token sequences, the ``pack_mode`` way."""
    from torchdata_ext.nodes.pack import Pack

    # int32 inside the pipeline (half the bytes), unless a special id of an int64 config
    # needs more (the output tensors are cfg.dtype either way)
    top = max((t for t in cfg.special_tokens.values() if t is not None), default=0)
    wide = cfg.dtype == "int64" and top > np.iinfo(np.int32).max
    return Pack(
        node,
        cfg.seq_length,
        dtype=np.int64 if wide else np.int32,
        mode=cfg.pack_mode,
        bos_token=cfg.bos_token,
        eos_token=cfg.eos_token,
        bol_token=cfg.bol_token,
        eol_token=cfg.eol_token,
        pad_token=cfg.pad_token,
        shift=cfg.shift,
        window=cfg.best_fit_window,
        drop_remainder=cfg.drop_remainder,
        dataset_names=dataset_names,
        max_dropped=cfg.max_dropped_documents,
    )


def _shuffle_buffer(
    cfg: PipelineConfig,
    node: BaseNode,
    datasets: list[DatasetIndex],
    readers: list[ShardReader],
) -> BaseNode:
    """The packed sequences through a ``cfg.shuffle_buffer``-sequence ``ShuffleBuffer``, told
    one worker's share of a pass (:func:`_worker_share`) once the readers know their world."""
    from torchdata_ext.nodes.shuffle import ShuffleBuffer

    share = functools.partial(_worker_share, cfg, datasets, readers)
    return ShuffleBuffer(
        node, cfg.shuffle_buffer, seed=cfg.seed, worker_share=share, fill=cfg.shuffle_fill
    )


def _collate(cfg: PipelineConfig, node: BaseNode, dataset_names: list[str]) -> BaseNode:
    """Batches of ``cfg.batch_size`` sequences as torch tensors of ``cfg.dtype``, with the
    keys ``cfg.output_keys``, counting the tokens delivered per dataset (``dataset_names``:
    what the provenance ids index)."""
    import torch

    from torchdata_ext.nodes.collate import Collate

    dtype = torch.int64 if cfg.dtype == "int64" else torch.int32
    root = Collate(
        node, cfg.batch_size, dtype=dtype, keys=cfg.output_keys, dataset_names=dataset_names
    )
    root.skip_steps = cfg.skip_steps  # read at a restore
    return root


def _worker_share(
    cfg: PipelineConfig, datasets: list[DatasetIndex], readers: list[Any]
) -> int | None:
    """Packed sequences in one worker's share of one pass over all datasets (their tokens over
    the global workers, per sequence); None while unknown (the readers have not found their
    world yet, or a text dataset's file sizes are not known). Text datasets count no tokens:
    theirs are estimated from their files' sizes (:func:`_text_tokens`)."""
    tokens = [
        index.total_tokens if index.total_tokens >= 0 else _text_tokens(index, cfg.tokenizer)
        for index in datasets
    ]
    world = readers[0].world if readers else None
    if world is None or any(t is None for t in tokens):
        return None
    return sum(t for t in tokens if t is not None) // (world.total_workers * cfg.seq_length)


# bytes of a text file per token, roughly: the byte tokenizer makes one per byte (JSON
# syntax included: an overestimate), subword tokenizers about one per 4 bytes of English;
# compressed files hold about 4 times their size in text
_BYTES_PER_TOKEN = {"byte": 1.0}
_SUBWORD_BYTES_PER_TOKEN = 4.0
_COMPRESSED = ((".gz", ".zst", ".zstd", ".bz2", ".xz"), 4.0)


def _text_tokens(index: DatasetIndex, tokenizer: Any) -> int | None:
    """An estimate of the tokens in a text dataset, from its files' sizes as listed; None
    when the sizes are not known."""
    if not index.file_stats:
        return None
    per_token = (
        _BYTES_PER_TOKEN.get(tokenizer, _SUBWORD_BYTES_PER_TOKEN)
        if isinstance(tokenizer, str)
        else _SUBWORD_BYTES_PER_TOKEN
    )
    suffixes, ratio = _COMPRESSED
    text_bytes = sum(
        size * (ratio if url.lower().endswith(suffixes) else 1.0)
        for url, (size, _) in zip(index.files, index.file_stats)
    )
    return int(text_bytes / per_token)


def _check_tokens(cfg: PipelineConfig, datasets: Mapping[str, DatasetIndex]) -> None:
    """Refuse text data in a config without a tokenizer. A text format is known by its handler;
    a table (Arrow/Parquet) by its column, read from the first file only where the index does
    not already count tokens (it counts none for text)."""
    for name, index in datasets.items():
        if not index.files:
            continue
        handler = index.handler()
        text = handler.produces == "text"
        if not text and index.total_tokens < 0:
            reader = handler.open(index.files[0])
            try:
                text = handler.produces_for(reader) == "text"
            finally:
                handler.close(reader)
        if text:
            raise ValueError(
                f"dataset {name!r} holds text ({index.files[0]}, col_name={cfg.col_name!r}) but "
                "the config has no tokenizer: set tokenizer to 'byte' or the path of a "
                "tokenizer.json, or point col_name at a column of token ids (torchdata-ext "
                "prepare tokenizes text into token shards ahead of time)"
            )
