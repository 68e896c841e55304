"""llm.c and nanoGPT token shards: ``file_type: llmc`` and ``file_type: nanogpt``.

* **llm.c** (``dev/data/data_common.py``'s ``write_datafile``): a header of 256 little-endian
  ``int32`` (``[0]`` magic, ``[1]`` version, ``[2]`` the token count, the rest zeros), then the
  tokens: magic 20240520 version 1, ``uint16`` tokens (GPT-2); magic 20240801 version 7,
  ``uint32`` tokens (Llama 3). Its scripts put the end-of-text token *before* every document
  (``[eot] + encode(text)``).
* **nanoGPT** (``data/openwebtext/prepare.py``): no header, ``uint16`` tokens written with
  ``np.memmap``, the end-of-text token *after* every document (``encode(text) + [eot]``).

Documents are split at the end-of-text token given as ``eos_token`` (the config's), each ending
with it, as for flat files. In an llm.c shard the token that starts the file (llm.c's EOT
before the first document) is left out, so each document is its text and the EOT llm.c wrote
after it: with the same ``eos_token`` in the pipeline (which ends the last document with one),
the packed stream holds every document's tokens with one EOT between documents, as llm.c's
loader reads them. An offsets sidecar (``<file>.offsets.npy``, over the tokens after the
header) wins over splitting.

Sniffing: a ``.bin`` read as ``flat`` (the ``.bin`` default) whose 1024-byte header is a valid
llm.c one with the file's own token count is read as llm.c (no token file of another layout
starts with the int32 20240520 or 20240801, then 1 or 7, then its length). A headerless nanoGPT
file cannot be told from a flat ``uint32`` one: name it ``file_type: nanogpt``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchdata_ext.handlers.base import DataFileError
from torchdata_ext.handlers.numpy_tokens import (
    FlatTokenHandler,
    TokenArrayReader,
    llmc_layout,
    read_source,
)
from torchdata_ext.handlers.ranged import OpenRanges

__all__ = ["LlmcHandler", "NanoGptHandler"]


class LlmcHandler(FlatTokenHandler):
    """llm.c token shards (``fineweb_train_000001.bin``): a 256-int32 header, then tokens.

    Args:
        col_name: unused (the files have no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.
        eos_token: llm.c's end-of-text token (50256 with GPT-2's tokenizer): documents are split
            at it, each ending with it (the EOT before the first document is left out).
            Ignored with an offsets sidecar.

    The token dtype comes from the header (``uint16`` for version 1, ``uint32`` for 7).
    """

    name: ClassVar[str] = "llmc"
    suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        eos_token: int | None = None,
    ) -> None:
        super().__init__(col_name, storage_options, eos_token=eos_token, dtype="uint16")

    def open(self, url: str) -> TokenArrayReader:
        buf = read_source(url, self.storage_options)
        layout = llmc_layout(buf)
        if isinstance(layout, str):
            raise DataFileError(
                url,
                f"not an llm.c token shard ({layout}); check the file (llm.c's write_datafile "
                "writes a 256-int32 header), or for a headerless file use file_type='nanogpt'",
            )
        return self.llmc_reader(url, buf, layout)

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> None:
        """None: an llm.c shard is read whole (splitting at ``eos_token`` reads every token)."""
        return None

    def __repr__(self) -> str:
        return f"LlmcHandler(eos_token={self.eos_token!r})"


class NanoGptHandler(FlatTokenHandler):
    """nanoGPT's ``train.bin`` / ``val.bin``: headerless ``uint16`` tokens, each document
    followed by the end-of-text token.

    Args:
        col_name: unused (the files have no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.
        eos_token: the end-of-text token nanoGPT appended to every document (50256 with GPT-2's
            tokenizer): documents are split after it. Ignored with an offsets sidecar.
    """

    name: ClassVar[str] = "nanogpt"
    suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        eos_token: int | None = None,
    ) -> None:
        super().__init__(col_name, storage_options, eos_token=eos_token, dtype="uint16")

    def __repr__(self) -> str:
        return f"NanoGptHandler(eos_token={self.eos_token!r})"
