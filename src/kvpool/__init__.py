"""kvpool: the KV cache block manager for LLM inference engines.

The public API is what this module exports; everything else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvpool.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokenError,
    KVPoolError,
    OutOfBlocksError,
    UnknownHashAlgorithmError,
    UnknownSequenceError,
)
from kvpool.hashing import (
    BlockHasher,
    HashAlgo,
    cache_salt_id,
    request_block_hashes,
    v1_block_key,
    v2_block_key,
    v2_root_key,
)

__all__ = [
    "BlockHasher",
    "DuplicateSequenceError",
    "HashAlgo",
    "InvalidArgumentError",
    "InvalidTokenError",
    "KVPoolError",
    "OutOfBlocksError",
    "UnknownHashAlgorithmError",
    "UnknownSequenceError",
    "__version__",
    "cache_salt_id",
    "request_block_hashes",
    "v1_block_key",
    "v2_block_key",
    "v2_root_key",
]
