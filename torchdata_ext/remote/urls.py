"""fsspec URL handling: brace expansion, globs, and filesystem resolution.

Every path in torchdata-ext is an fsspec URL: a local path, ``file://``, ``memory://``,
``s3://`` or anything fsspec knows, optionally with shell globs (``*``, ``?``, ``[..]``) and
brace expansion (``shard_{00..99}.jsonl``, ``{a,b}/*.arrow``).

**The options of a call** (:func:`storage_options_of`, the one rule): the ``storage_options``
given once reach every URL of that call (data, tokenizer, config, checkpoint, index, the
audit's list and picture); a call given none takes its default (a checkpoint call: the loader
config's ``storage_options``), else none (the environment: ``AWS_ENDPOINT_URL``, ...). They are
a mapping, refused otherwise, and for ``s3://`` every key must be one the S3 filesystem takes
(an unknown key is named, instead of a ``TypeError`` at the first request).
"""

from __future__ import annotations

import functools
import inspect
import os
import posixpath
from collections.abc import Mapping
from typing import Any

import braceexpand
from fsspec.core import url_to_fs

__all__ = [
    "METADATA_FILES",
    "expand_urls",
    "filesystem",
    "is_local",
    "join",
    "one_request",
    "protocol_of",
    "storage_options_of",
    "unstrip",
]

_GLOB_CHARS = ("*", "?", "[")


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Resolve ``url`` to ``(filesystem, path)`` with fsspec.

    Args:
        url: an fsspec URL or local path.
        storage_options: keyword arguments for the filesystem (credentials, endpoint, ...).

    The first time a process resolves a URL of an object store (``s3://``), one quick request
    checks that the endpoint, the bucket and the credentials work
    (:func:`torchdata_ext.remote.probe.probe_store`), so a wrong one fails within a second or
    two with a clear message rather than after the client's own retries.

    Raises:
        ValueError: the URL's protocol is unknown or its filesystem package is not installed;
            ``storage_options`` is not a mapping, or has a key the filesystem does not take.
        RemoteError: the store cannot be used: nothing answers at its endpoint, the bucket does
            not exist, the credentials are missing or invalid (the message says what to check).
    """
    storage_options = storage_options_of(storage_options)
    try:
        fs, path = url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise ValueError(
            f"cannot open {url=}: {exc}. For s3:// URLs install the s3 extra "
            "(pip install 'torchdata-ext[s3]')"
        ) from exc
    _check_option_keys(url, fs, storage_options)
    if not is_local(fs):
        from torchdata_ext.remote.probe import probe_store  # (remote imports this module)

        bucket = str(path).split("/", 1)[0]
        probe_store(url, protocol_of(fs), bucket, storage_options)
    return fs, path


def storage_options_of(
    given: Any, default: Mapping[str, Any] | None = None, *, name: str = "storage_options"
) -> dict[str, Any]:
    """The fsspec options of a call: ``given``, else ``default``, else none (a new dict).

    The one rule for every URL of a call (see the module docstring): a checkpoint call passes
    the loader config's options as ``default``; everything else passes what it was given.

    Args:
        given: the options the caller passed (None: not given).
        default: the options to use when none were given (e.g. the config's).
        name: the argument or field named in an error (``"storage_options"``, ``--storage-options``).

    Raises:
        ValueError: the options are not a mapping (a string, e.g. JSON not parsed, or a YAML
            scalar): give a mapping.
    """
    value = default if given is None else given
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        what = "a string" if isinstance(value, str) else f"a {type(value).__name__}"
        raise ValueError(
            f"{name}={value!r} is {what}: give a mapping of fsspec options, e.g. "
            """{"key": "...", "secret": "...", "client_kwargs": {"endpoint_url": "http://host:9000"}} """
            "(in YAML, a nested block under storage_options:)"
        )
    return dict(value)


def _check_option_keys(url: str, fs: Any, options: Mapping[str, Any]) -> None:
    """Refuse an option ``fs`` does not take, naming it (s3fs hands unknown keys to its client
    session, which fails at the first request with a ``TypeError``)."""
    if not options or protocol_of(fs) not in ("s3", "s3a"):
        return
    known = _known_options(type(fs))  # type: ignore[arg-type]  # classes are hashable
    unknown = sorted(set(options) - known)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        raise ValueError(
            f"storage_options for {url}: unknown option {', '.join(map(repr, unknown))}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; give only arguments of {type(fs).__module__.split('.')[0]}."
            f"{type(fs).__name__} (key, secret, token, anon, endpoint_url, client_kwargs, "
            "config_kwargs, ...)"
        )
    client = options.get("client_kwargs")
    if isinstance(client, Mapping):
        known_client = _client_options()
        unknown = sorted(set(client) - known_client)
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], sorted(known_client), n=1)
            raise ValueError(
                f"storage_options for {url}: unknown client_kwargs option "
                f"{', '.join(map(repr, unknown))}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + "; give only arguments of botocore's Session.create_client (endpoint_url, "
                "region_name, verify, use_ssl, ...)"
            )


@functools.cache
def _known_options(cls: type) -> frozenset[str]:
    """The option keys an S3 filesystem class takes: its ``__init__``'s and its bases', the
    listings cache's, and those of the client session it hands the rest to."""
    known = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is not None:
            known.update(_named_parameters(init))
    from aiobotocore.session import AioSession  # where s3fs sends the keys it does not know

    known.update(_named_parameters(AioSession.__init__))
    return frozenset(known - {"self"})


@functools.cache
def _client_options() -> frozenset[str]:
    """The keys of ``client_kwargs``: what s3fs hands to the client's creation (botocore's
    ``Session.create_client``, whose signature aiobotocore keeps), the service name aside."""
    from botocore.session import Session

    return frozenset(_named_parameters(Session.create_client) - {"self", "service_name"})


def _named_parameters(function: Any) -> set[str]:
    return {
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def protocol_of(fs: Any) -> str:
    """The primary protocol name of an fsspec filesystem (``"file"``, ``"s3"``, ...)."""
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else str(proto)


def one_request(fs: Any) -> dict[str, Any]:
    """``fs.cat_file``'s options that read a whole small object in one request: s3fs asks an
    object's size first (a HEAD) to read large ones in parallel parts, unless told
    ``max_concurrency=1``; other filesystems need nothing."""
    return {"max_concurrency": 1} if protocol_of(fs) == "s3" else {}


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local filesystem (files can be memory-mapped)."""
    return protocol_of(fs) in ("file", "local")


def unstrip(fs: Any, path: str) -> str:
    """Turn a filesystem-internal ``path`` back into a full URL for ``fs``."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def join(url: str, *parts: str) -> str:
    """Join URL path components with ``/`` (works for local paths and object stores)."""
    out = url.rstrip("/")
    for part in parts:
        out = out + "/" + part.strip("/")
    return out


def expand_urls(
    urls: str | os.PathLike[str] | list[str] | tuple[str, ...],
    storage_options: dict[str, Any] | None = None,
    *,
    suffixes: tuple[str, ...] | None = None,
) -> list[str]:
    """Expand braces, globs and directories into a sorted, de-duplicated list of file URLs.

    A directory expands to every file below it (recursively) whose name ends with one of
    ``suffixes`` (all files when ``suffixes`` is None); hidden files, files under a ``meta``
    folder and the metadata files of known tools (:data:`METADATA_FILES`: what Hugging Face
    ``datasets.save_to_disk`` writes next to its Arrow files) are left out, from a glob's
    matches too. A file named explicitly (no glob) is always kept. The result is sorted, so
    the same inputs always give the same order on every rank.

    Args:
        urls: one URL or a list of URLs, each possibly with braces and globs.
        storage_options: keyword arguments for the filesystem.
        suffixes: file name endings to keep when expanding a directory or glob.

    Raises:
        FileNotFoundError: a URL (after expansion) matches no file.
    """
    if isinstance(urls, (str, os.PathLike)):
        urls = [os.fspath(urls)]
    out: list[str] = []
    for raw in urls:
        for url in braceexpand.braceexpand(str(raw)):
            fs, path = filesystem(url, storage_options)
            found: list[str] = []
            if any(c in path for c in _GLOB_CHARS):
                for p in fs.glob(path):
                    found.extend(_files_below(fs, p, suffixes))
            elif fs.isdir(path):
                found.extend(_files_below(fs, path, suffixes))
            elif fs.exists(path):
                found.append(path)  # a file named explicitly is taken whatever its suffix
            if not found:
                other = _other_suffixes(fs, path) if suffixes else {}
                error = FileNotFoundError(
                    f"no data files match {url!r}"
                    + (f" (looking for names ending in {list(suffixes)})" if suffixes else "")
                    + (
                        f"; it holds {', '.join(f'{n} {s}' for s, n in other.items())} files"
                        if other
                        else "; check the path, the pattern and storage_options"
                    )
                )
                error.other_suffixes = list(other)  # type: ignore[attr-defined]
                try:
                    raise error
                finally:  # the frame must not hold the error its traceback holds (a cycle)
                    del error
            out.extend(unstrip(fs, p) for p in found)
    return sorted(set(out))


def _other_suffixes(fs: Any, path: str) -> dict[str, int]:
    """The name endings (``.jsonl``, ``.jsonl.gz``) of the files ``path`` holds (a folder or a
    glob) and how many of each, most first: what a listing looking for others found."""
    try:
        paths = fs.glob(path) if any(c in path for c in _GLOB_CHARS) else [path]
        files = [f for p in paths for f in _files_below(fs, p, None)]
    except OSError:
        return {}
    counts: dict[str, int] = {}
    for f in files:
        name = posixpath.basename(f).lower()
        parts = name.split(".")[1:]  # the endings after the base name
        if parts:
            compressed = len(parts) > 1 and parts[-1] in _COMPRESSED
            ext = "." + ".".join(parts[-2:] if compressed else parts[-1:])
            counts[ext] = counts.get(ext, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


_COMPRESSED = ("gz", "zst", "zstd", "bz2", "xz")


def _files_below(fs: Any, path: str, suffixes: tuple[str, ...] | None) -> list[str]:
    if fs.isdir(path):
        files = [p for p in fs.find(path) if not _hidden_or_meta(p[len(path) :])]
    else:
        files = [path]
    files = [p for p in files if posixpath.basename(p) not in METADATA_FILES]
    if suffixes is not None:
        files = [p for p in files if p.lower().endswith(suffixes)]
    return files


METADATA_FILES = frozenset(
    {
        "dataset_info.json",  # datasets.save_to_disk: features, sizes
        "state.json",  # datasets.save_to_disk: the Arrow file list, fingerprint
        "dataset_dict.json",  # datasets.DatasetDict.save_to_disk: the split names
    }
)
"""File names never taken as data when a directory or glob is expanded."""


def _hidden_or_meta(rel: str) -> bool:
    parts = [p for p in rel.split("/") if p]
    return any(p.startswith((".", "_")) or p == "meta" for p in parts)
