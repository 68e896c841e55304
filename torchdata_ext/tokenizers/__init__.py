"""Tokenizers: loading by name or path, the byte-level tokenizer, and their special tokens."""

from torchdata_ext.tokenizers.load import (
    DEFAULT_BYTE_OFFSET,
    ByteTokenizer,
    Encoder,
    TokenIds,
    as_encoder,
    check_special_tokens,
    limit_tokenizer_threads,
    load_tokenizer,
    token_ids,
    tokenizer_hash,
    tokenizer_location,
    worker_threads,
)

__all__ = [
    "ByteTokenizer",
    "DEFAULT_BYTE_OFFSET",
    "Encoder",
    "TokenIds",
    "as_encoder",
    "check_special_tokens",
    "limit_tokenizer_threads",
    "load_tokenizer",
    "token_ids",
    "tokenizer_hash",
    "tokenizer_location",
    "worker_threads",
]
