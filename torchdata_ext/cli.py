"""The ``torchdata-ext`` command: ``prepare`` text into token shards, ``inspect`` a dataset,
``audit`` a checkpoint.

This module only parses arguments, calls the library and prints: the work is
:func:`torchdata_ext.prepare_data.tokenize_text.prepare` and :func:`torchdata_ext.audit.inspect_data.inspect_dataset`
(both also exported as ``torchdata_ext.prepare`` and ``torchdata_ext.inspect_dataset``), whose
docstrings describe the formats, the resumable parts and the report.

``torchdata-ext prepare IN... --out DIR`` tokenizes JSONL/Parquet/``.txt`` text into Arrow,
flat ``.npy`` or Mosaic MDS token shards; each option is the keyword argument of the same name. Without
``--shard-id``/``--num-shards`` inside a Slurm array job, the part is the array task
(``SLURM_ARRAY_TASK_ID`` of ``SLURM_ARRAY_TASK_COUNT``). It prints the result as JSON.

``torchdata-ext inspect PATH`` prints files, documents, tokens and a length histogram of a
dataset; ``--doc N`` prints document N (global index, or ``--file F --doc N``), decoded with
``--tokenizer`` (default: the tokenizer ``prepare`` recorded with the data), cut to its first 1,000 tokens and 10,000 characters unless ``--all``.

``torchdata-ext audit CKPT --config cfg.yaml`` prints what a loader checkpoint consumed
(:func:`torchdata_ext.audit.report.audit_checkpoint`; a checkpoint folder or a DCP checkpoint,
``--key`` picking its loader state when it holds several): a table, or ``--json``; ``--list out.parquet``
writes one row per document consumed, ``--plot audit.png`` a picture (matplotlib, the ``plot``
extra).

Every command takes ``--storage-options JSON`` (the fsspec options of its URLs; see
``docs/command-line.md``); a store that cannot work fails within a second or two, naming the
endpoint and what to check (:mod:`torchdata_ext.remote.probe`).

``torchdata-ext index DATA_PATH [--datasets a,b]`` writes each dataset's index file
(:mod:`torchdata_ext.sources.index_file`), so a job's ranks start with a GET or two per dataset and no LIST.

Errors and warnings are one line each on stderr (exit code 2 on error), in the command line's
own terms: the library names its Python parameters (``col_name=...``), which
:func:`cli_message` rewrites as this command's flags (``--text-field ...``). Output into a pipe
closed early (``| head``) stops quietly with exit code 141, as a tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO, cast

__all__ = ["audit_checkpoint", "cli_message", "inspect_dataset", "main", "prepare"]  # noqa: F822

# The library is imported by the command that needs it, not here: `--help` and an argument
# error load no torch and no NumPy (tests/test_cli_startup.py). The three library calls stay
# importable from this module as before (`from torchdata_ext.cli import prepare`).
_LIBRARY = {
    "audit_checkpoint": "torchdata_ext.audit.report",
    "inspect_dataset": "torchdata_ext.audit.inspect_data",
    "prepare": "torchdata_ext.prepare_data.tokenize_text",
}


def __getattr__(name: str) -> Any:
    """``prepare``, ``inspect_dataset``, ``audit_checkpoint``: imported on first use (PEP 562)."""
    if name not in _LIBRARY:
        raise AttributeError(f"module 'torchdata_ext.cli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LIBRARY[name]), name)


_COMPRESSIONS = ("infer", "none", "gzip", "zstd")
# library parameters that a command takes under another flag's name
_ALIASES = {
    "prepare": {"col_name": "--text-field"},
    "inspect": {},
    "audit": {"cfg": "--config"},
    "index": {},
    "batches": {},
}
_STORAGE_HELP = (
    'fsspec options of the URLs as a JSON object, e.g. \'{"client_kwargs": {"endpoint_url": '
    '"http://host:9000"}, "key": "...", "secret": "..."}\' (default: the '
    "environment, AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID...)"
)


def _json_object(text: str) -> dict[str, object]:
    """``--storage-options``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc}): give a JSON object in single quotes, "
            """e.g. '{"anon": true}'"""
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object: give one in braces, e.g. '{{\"anon\": true}}'"
        )
    return value


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, unless it has none (``None``, a flag off) or its
    help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# -- command line ------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchdata-ext", description="Prepare and inspect torchdata-ext datasets."
    )
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser(
        "prepare",
        formatter_class=_DefaultsShown,
        help="tokenize text files into shard files",
        description="Tokenize JSONL/Parquet/.txt text into Arrow, flat .npy or MDS token shards "
        "(resumable; see python -m pydoc torchdata_ext.prepare_data.tokenize_text).",
    )
    pp.add_argument("inputs", nargs="+", help="input files, folders, globs or braces (URLs)")
    pp.add_argument("--out", "-o", required=True, help="output folder (URL)")
    pp.add_argument("--format", choices=("arrow", "npy", "mds"), default="arrow",
                    help="token shard format")  # fmt: skip
    pp.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                    help=_STORAGE_HELP + "; for the inputs and --out")  # fmt: skip
    pp.add_argument(
        "--tokenizer", default="byte", help="'byte', a tokenizer.json path or a cached HF model"
    )
    pp.add_argument(
        "--byte-offset",
        type=int,
        default=None,
        help="byte tokenizer: byte b is id b + this (default: 1, as in the pipeline config)",
    )
    pp.add_argument("--text-field", default="text", help="JSONL field / Parquet text column")
    pp.add_argument(
        "--eos-token",
        type=int,
        default=None,
        help="appended to each document (npy default 0); never an id of ordinary text",
    )
    pp.add_argument("--encoding", default="utf-8", help=".txt inputs' text encoding")
    pp.add_argument("--compression", choices=_COMPRESSIONS, default="infer", help="of JSONL inputs")
    pp.add_argument("--max-tokens-per-file", type=int, default=100_000_000,
                    help="cap of tokens per output file")  # fmt: skip
    pp.add_argument("--num-proc", type=int, default=1, help="tokenizing processes")
    pp.add_argument("--chunk-documents", type=int, default=10_000,
                    help="records read and tokenized at a time per process: bounds memory "
                    "(not the input's size); progress is kept inside a file")  # fmt: skip
    pp.add_argument("--shard-id", type=int, default=None, help="this part (default SLURM id)")
    pp.add_argument("--num-shards", type=int, default=None, help="number of parts")
    pp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="report on stderr from the start (a bar with the time left on a "
                    "terminal, else a line every 10 s); default: once a part has run 2 s; "
                    "--no-progress: nothing, not even the closing summary")  # fmt: skip
    pp.add_argument("--slow-for-tests", type=float, default=0.0, help=argparse.SUPPRESS)
    pp.add_argument(
        "--data-fraction", type=float, default=1.0, help="keep a seeded sample of this share"
    )
    pp.add_argument("--seed", type=int, default=0, help="seed of the --data-fraction sample")
    pp.add_argument("--min-length", type=int, default=None, help="fewest tokens (without EOS)")
    pp.add_argument("--max-length", type=int, default=None, help="most tokens (without EOS)")

    ip = sub.add_parser("inspect", help="summarize a dataset or print one document")
    ip.add_argument("path", help="dataset folder, file, glob or data_sources.txt (URL)")
    ip.add_argument("--file-type", default=None, help="format name (default: by suffix)")
    ip.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                    help=_STORAGE_HELP)  # fmt: skip
    ip.add_argument("--col-name", default=None, help="token column or text field")
    ip.add_argument(
        "--eos-token", type=int, default=None, help="flat .npy EOS (default: as prepared, or 0)"
    )
    ip.add_argument("--doc", type=int, default=None, help="print this document")
    ip.add_argument("--file", default=None, help="with --doc: index within this file")
    ip.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or tokenizer.json, to decode (default: the one prepare recorded)",
    )
    ip.add_argument("--byte-offset", type=int, default=None, help="default: as prepared, else 1")
    ip.add_argument("--compression", choices=_COMPRESSIONS, default="infer", help="of JSONL files")
    ip.add_argument(
        "--all",
        dest="full",
        action="store_true",
        help="with --doc: the whole document (default: 1,000 tokens, 10,000 characters)",
    )

    ap = sub.add_parser(
        "audit",
        help="what a checkpoint consumed, per dataset and epoch",
        description="What a loader checkpoint says the run consumed: per dataset, the epochs "
        "of its logical shards, documents and tokens consumed per epoch, documents in flight, "
        "token share against the target (see python -m pydoc torchdata_ext.audit.report).",
    )
    ap.add_argument("checkpoint", help="checkpoint folder (URL) written by save_checkpoint, or "
                    "a torch.distributed.checkpoint (DCP) holding a DCPLoaderState")  # fmt: skip
    ap.add_argument("--key", default=None,
                    help="DCP checkpoint: the key of the loader state in the saved state dict "
                    "('data' for dcp.save({..., 'data': DCPLoaderState(loader)})); needed only "
                    "when it holds several")  # fmt: skip
    ap.add_argument("--config", required=True, help="the run's pipeline config (.yaml/.json)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                    help=_STORAGE_HELP + "; for the checkpoint, --list and --plot (the data's: "
                    "the config's storage_options)")  # fmt: skip
    ap.add_argument("--list", default=None, metavar="OUT.parquet",
                    help="write one row per document consumed to this Parquet file")  # fmt: skip
    ap.add_argument("--plot", default=None, metavar="AUDIT.png",
                    help="draw the consumption per dataset (needs matplotlib)")  # fmt: skip
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="read only the checkpoint and counts (pieces held by the pipeline "
                    "unknown)")  # fmt: skip
    ap.add_argument("--no-tokens", dest="tokens", action="store_false",
                    help="skip token counts (no file metadata read)")  # fmt: skip
    ap.add_argument("--verify", action="store_true",
                    help="re-check every data file against the fingerprint the checkpoint "
                    "recorded: size, version and the first and last 64 KiB of each (128 KiB read per "
                    "file); a changed file is an error naming it")  # fmt: skip
    ap.add_argument("--allow-changed-files", action="store_true",
                    help="list data files changed in place (same size and document counts) "
                    "in the report instead of failing; implies --verify. Files added, removed "
                    "or resized are always refused")  # fmt: skip
    _add_index_command(sub)
    _add_batches_command(sub)
    return p


def _add_index_command(sub: argparse._SubParsersAction) -> None:
    """``torchdata-ext index DATA_PATH``: write each dataset's index file."""
    xp = sub.add_parser(
        "index",
        help="write the index file of each dataset (ranks then list nothing at start)",
        description="List and count the datasets of DATA_PATH and write each one's "
        "meta/torchdata_ext_index.json (see python -m pydoc torchdata_ext.sources.index_file). Run "
        "it again after adding, removing or rewriting files: a stale index file is refused.",
    )
    xp.add_argument("data_path", help="the config's data_path (URL)")
    xp.add_argument("--datasets", default="",
                    help="dataset sub-folders, comma-separated (default: DATA_PATH is one)")  # fmt: skip
    xp.add_argument("--file-type", default="arrow", help="format name ('none': by suffix)")
    xp.add_argument("--col-name", default="tokens", help="token column or text field")
    xp.add_argument("--eos-token", type=int, default=0, help="EOS of flat .npy token files")
    xp.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                    help=_STORAGE_HELP)  # fmt: skip


def _add_batches_command(sub: argparse._SubParsersAction) -> None:
    """``torchdata-ext batches CKPT --config CFG --steps A[:B]``: what steps held."""
    bp = sub.add_parser(
        "batches",
        help="replay steps from a checkpoint: each row's documents, token ranges and specials",
        description="Replay the training loop's steps A..B-1 (counted from 1 over the run) "
        "from a loader checkpoint taken before them, without the training job, and print per "
        "step, rank and row the documents' token ranges and the specials the packer placed "
        "(see python -m pydoc torchdata_ext.forensics.replay).",
    )
    bp.add_argument("checkpoint", help="checkpoint folder (URL) or DCP checkpoint")
    bp.add_argument("--config", required=True, help="the run's pipeline config (.yaml/.json)")
    bp.add_argument("--steps", required=True, help="A (one step) or A:B (B excluded)")
    bp.add_argument("--rank", type=int, default=None, help="only this rank (default: all)")
    bp.add_argument("--ranks", type=int, default=None,
                    help="ranks of the run at these steps (default: the checkpoint's)")  # fmt: skip
    bp.add_argument("--workers", type=int, default=None,
                    help="dataloader workers per rank (default: the checkpoint's)")  # fmt: skip
    bp.add_argument("--text", action="store_true",
                    help="decode each piece with the config's tokenizer")  # fmt: skip
    out = bp.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the batches as JSON")
    out.add_argument("--parquet", default=None, metavar="OUT.parquet",
                     help="write one row per piece and special to this Parquet file")  # fmt: skip
    bp.add_argument("--key", default=None, help="DCP checkpoint: the loader state's key")
    bp.add_argument("--changes-from", default=None, metavar="LATER_CHECKPOINT",
                    help="a later checkpoint whose set_weights calls the replay uses (default: "
                         "none after the checkpoint's step)")  # fmt: skip
    bp.add_argument("--storage-options", type=_json_object, default=None, metavar="JSON",
                    help=_STORAGE_HELP)  # fmt: skip


def _batches(args: argparse.Namespace) -> None:
    """``torchdata-ext batches``: replay and print (or write) the steps."""
    from torchdata_ext.forensics.replay import show_batches
    from torchdata_ext.forensics.show import format_batches, write_pieces

    batches = show_batches(
        args.checkpoint, args.config, args.steps, args.rank, args.ranks, args.workers,
        text=args.text, storage_options=args.storage_options, key=args.key,
        changes_from=args.changes_from,
    )  # fmt: skip
    if args.parquet:
        n = write_pieces(batches, args.parquet, args.storage_options)
        print(f"wrote {n:,} pieces and specials to {args.parquet}", file=sys.stderr)
    elif args.json:
        print(json.dumps(batches, indent=1, ensure_ascii=False))
    else:
        print(format_batches(batches))


def _index(args: argparse.Namespace) -> None:
    """``torchdata-ext index``: write the index files, print their URLs."""
    from torchdata_ext.sources.index_file import write_index_files

    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    for url in write_index_files(
        args.data_path,
        names,
        file_type=None if args.file_type == "none" else args.file_type,
        col_name=args.col_name,
        eos_token=args.eos_token,
        storage_options=args.storage_options,
    ):
        print(url)


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """Library parameter name -> the flag of ``command`` that sets it."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        command
    ]
    flags = {
        a.dest: max(a.option_strings, key=len)
        for a in sub._actions
        if a.option_strings and a.dest != "help"
    }
    return {**flags, **_ALIASES.get(command, {})}


_VALUE = r"""'[^']*'|"[^"]*"|\.\.\.|[^\s,;:)\]]+"""


def cli_message(message: str, flags: dict[str, str]) -> str:
    """``message`` of the library with its parameter names as command-line flags.

    ``name=value`` becomes ``--flag value`` (``None`` becomes ``none``, quotes are dropped
    where the shell needs none) for every name in ``flags``; a bare name becomes the flag only
    when it has an underscore (``text_field``: not a word of prose) and is not part of a path.
    """
    if not flags:
        return message

    def with_value(m: re.Match[str]) -> str:
        value = m.group(2)
        if value[:1] in "'\"":
            value = shlex.quote(value[1:-1])
        elif value == "None":
            value = "none"
        return f"{flags[m.group(1)]} {value}"

    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    message = re.sub(rf"\b({names})=({_VALUE})", with_value, message)
    bare = {k: v for k, v in flags.items() if "_" in k}
    names = "|".join(sorted(map(re.escape, bare), key=len, reverse=True))
    return re.sub(rf"(?<![\w/.-])({names})(?![\w/.-])", lambda m: bare[m.group(1)], message)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``torchdata-ext`` / ``python -m torchdata_ext``."""
    parser = _parser()
    args = parser.parse_args(argv)
    flags = _flags(parser, args.command)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            _run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as a tool killed by SIGPIPE does
        with contextlib.suppress(OSError, ValueError):  # stdout is not a file descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except (ValueError, OSError, ImportError) as exc:
        _report(args.command, caught, flags)
        print(
            f"torchdata-ext {args.command}: error: {cli_message(str(exc), flags)}", file=sys.stderr
        )
        return 2
    _report(args.command, caught, flags)
    return 0


def _report(command: str, caught: list[warnings.WarningMessage], flags: dict[str, str]) -> None:
    """Print the warnings the command caught, one line each, in the command line's terms."""
    for w in caught:
        print(
            f"torchdata-ext {command}: warning: {cli_message(str(w.message), flags)}",
            file=sys.stderr,
        )


def _run(args: argparse.Namespace) -> None:
    """Do the parsed command."""
    _COMMANDS[args.command](args)


def _compression(args: argparse.Namespace) -> str | None:
    return None if args.compression == "none" else args.compression


def _prepare(args: argparse.Namespace) -> None:
    """``torchdata-ext prepare``: tokenize, print the result as JSON."""
    from torchdata_ext.prepare_data.tokenize_text import prepare
    from torchdata_ext.tokenizers.load import DEFAULT_BYTE_OFFSET

    shard_id, num_shards = args.shard_id, args.num_shards
    if shard_id is None and num_shards is None and "SLURM_ARRAY_TASK_ID" in os.environ:
        shard_id = int(os.environ["SLURM_ARRAY_TASK_ID"])
        num_shards = int(os.environ.get("SLURM_ARRAY_TASK_COUNT", "1"))
    res = prepare(
        args.inputs,
        args.out,
        format=args.format,
        storage_options=args.storage_options,
        tokenizer=args.tokenizer,
        byte_offset=DEFAULT_BYTE_OFFSET if args.byte_offset is None else args.byte_offset,
        text_field=args.text_field,
        eos_token=args.eos_token,
        max_tokens_per_file=args.max_tokens_per_file,
        num_proc=args.num_proc,
        chunk_documents=args.chunk_documents,
        shard_id=0 if shard_id is None else shard_id,
        num_shards=1 if num_shards is None else num_shards,
        encoding=args.encoding,
        compression=_compression(args),
        progress=args.progress,
        slow_for_tests=args.slow_for_tests,
        data_fraction=args.data_fraction,
        seed=args.seed,
        min_length=args.min_length,
        max_length=args.max_length,
    )
    what = "already complete" if res.skipped else "resumed" if res.resumed else "done"
    print(json.dumps({"status": what, **asdict(res)}, indent=1))


def _inspect(args: argparse.Namespace) -> None:
    """``torchdata-ext inspect``: print the summary or the document."""
    from torchdata_ext.audit.inspect_data import inspect_dataset

    inspect_dataset(
        args.path,
        file_type=args.file_type,
        col_name=args.col_name,
        eos_token=args.eos_token,
        doc=args.doc,
        file=args.file,
        tokenizer=args.tokenizer,
        byte_offset=args.byte_offset,
        compression=_compression(args),
        full=args.full,
        storage_options=args.storage_options,
        out=cast(TextIO, _Flagged(sys.stdout)),
    )


class _Flagged(io.TextIOBase):
    """``inspect``'s report with its hint in the command line's terms (``--all``, not the
    Python ``full=True``); each line is written through as it comes."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, s: str) -> int:
        from torchdata_ext.audit.inspect_data import MORE_HINT

        self._out.write(s.replace(MORE_HINT, "(--all shows all)"))
        return len(s)

    def flush(self) -> None:
        self._out.flush()


def _audit(args: argparse.Namespace) -> None:
    """``torchdata-ext audit``: print the report, write the list and the picture."""
    from torchdata_ext.audit.report import audit_checkpoint

    report = audit_checkpoint(
        args.checkpoint,
        args.config,
        args.storage_options,
        replay=args.replay,
        tokens=args.tokens,
        verify=args.verify or args.allow_changed_files,
        allow_changed_files=args.allow_changed_files,
        key=args.key,
    )
    print(report.to_json() if args.json else report.format_table())
    if args.list:
        n = report.write_documents(args.list, args.storage_options)
        print(f"wrote {n:,} documents to {args.list}", file=sys.stderr)
    if args.plot:
        report.plot(args.plot, args.storage_options)
        print(f"wrote {args.plot}", file=sys.stderr)


# command name -> what runs it (a new command: its parser in _parser, its function here; the
# library it calls is imported inside that function, so --help stays fast)
_COMMANDS = {
    "prepare": _prepare,
    "inspect": _inspect,
    "audit": _audit,
    "index": _index,
    "batches": _batches,
}

if __name__ == "__main__":
    sys.exit(main())
