"""Tokenize text files into token shards (:func:`prepare`) and filter them on the way."""

from torchdata_ext.prepare_data.tokenize_text import (
    INPUT_SUFFIXES,
    PrepareResult,
    prepare,
    split_inputs,
)

__all__ = [
    "INPUT_SUFFIXES",
    "PrepareResult",
    "prepare",
    "split_inputs",
]
