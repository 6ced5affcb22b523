"""Keyed events: stored and removed events in the compact form a hash-keyed consumer reads.

The router's index keys every block by an unsigned 64-bit int (:func:`normalize_hash`) and reads
neither tokens, priorities nor multimodal keys. The wire decoders can therefore hand it, for the
common events, one record per event holding the normalized keys of its blocks as a list
(:class:`StoredKeys`, :class:`RemovedKeys`) instead of a :class:`~kvpool.events.model.Stored`
with a :class:`~kvpool.events.model.StoredBlock` per block. A consumer that keys blocks by their
tokens reads stored events as :class:`StoredTokens` instead: the keys and every block's token
ids, in one byte string. Any event the records cannot carry exactly (a hash that does not
normalize, blocks on mixed tiers, created and updated events) stays a
:class:`~kvpool.events.model.KVCacheEvent`, so a keyed stream means exactly what the
corresponding event stream means to such a consumer.

Records are built by the decoders from validated input and are not checked again: ``keys`` are
ints in ``[0, 2**64)``, ``cache_level`` is 0, 1, 2 (or None on a removal: every tier), a
record's ``tokens`` are cut into blocks as :class:`StoredTokens` says.
"""

from __future__ import annotations

import binascii
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, final

import msgspec

from kvpool.events.model import KVCacheEvent

__all__ = [
    "KeyedEvent",
    "RemovedKeys",
    "StoredKeys",
    "StoredTokens",
    "digest_keys",
    "hex_keys",
    "normalize_hash",
    "normalize_hashes",
    "token_bytes",
]

_M64: Final = (1 << 64) - 1
_SWAP: Final = sys.byteorder == "little"  # keys are read big-endian


@final
class StoredKeys(msgspec.Struct, gc=False):
    """A chain of blocks stored on one tier, as normalized keys (in chain order).

    ``block_tokens`` is the token count of the chain's first block (its longest: only a chain's
    last block may be partial), 0 when unknown; a consumer may learn the block size from it.
    """

    event_id: int
    keys: list[int]
    cache_level: int = 0
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None
    block_tokens: int = 0


@final
class RemovedKeys(msgspec.Struct, gc=False):
    """Blocks removed from one tier (``cache_level``), or from every tier (None)."""

    event_id: int
    keys: list[int]
    cache_level: int | None = None
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


@final
class StoredTokens(msgspec.Struct, gc=False):
    """A chain of blocks stored on one tier, as normalized keys with the blocks' token ids.

    ``tokens`` holds the token ids of every block back to back as unsigned 32-bit little-endian
    ints (:func:`token_bytes`): block ``i`` has ids ``i * block_size`` up to ``(i + 1) *
    block_size``; every block has at least one, only the last may have fewer than
    ``block_size``. ``parent`` is the normalized key of the block the chain continues, None
    when it starts the reuse scope of ``lora_id``.
    """

    event_id: int
    keys: list[int]
    tokens: bytes
    block_size: int
    parent: int | None = None
    lora_id: int | None = None
    cache_level: int = 0
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


KeyedEvent = KVCacheEvent | StoredKeys | RemovedKeys | StoredTokens
"""One event of a keyed stream."""


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian ints, back to back (one conversion in C).

    Raises :class:`ValueError` unless every id is an int in ``[0, 2**32)``.
    """
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None


def normalize_hash(value: object) -> int:
    """Map an event's block hash to its key, an unsigned 64-bit int.

    Ints are taken modulo 2**64 (engines that used Python's signed ``hash()`` map consistently);
    ``v2_sha256`` hex digests keep their first 8 bytes, big-endian, which equals the
    ``v2_sha256_64`` encoding of the same block; raw digests (bytes) keep their last 8 bytes,
    big-endian, as vLLM's event ids do. Anything else raises :class:`ValueError`.
    """
    if type(value) is int:
        return value & _M64
    if isinstance(value, str):
        if not value or len(value) > 64:
            raise ValueError(f"block hash {value!r} is not a hex digest")
        return int(value[:16], 16)  # ValueError for non-hex text
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError("block hash is empty bytes")
        return int.from_bytes(value[-8:], "big")
    raise ValueError(f"block hash {value!r} ({type(value).__name__}) is not an int, str or bytes")


def normalize_hashes(raw: Sequence[Any]) -> list[int]:
    """:func:`normalize_hash` of every hash, in C loops for the usual lists (all ints, or all
    64-character hex digests). Raises :class:`ValueError` like :func:`normalize_hash`."""
    try:
        return [h & _M64 for h in raw]  # str & int and float & int raise TypeError
    except TypeError:
        pass
    keys = hex_keys(raw)
    if keys is None:
        keys = [h & _M64 if type(h) is int else normalize_hash(h) for h in raw]
    return keys


def hex_keys(raw: Sequence[Any]) -> list[int] | None:
    """Keys of hex digests (their first 8 bytes, as :func:`normalize_hash` reads them), or
    None unless every hash is a str that normalizes."""
    try:
        joined = "".join(raw)
        longest = max(map(len, raw))
    except (TypeError, ValueError):  # not all str, or no hash at all
        return None
    n = len(raw)
    if longest == 64 and len(joined) == 64 * n:  # all 64 characters: full sha256 digests
        try:
            return _words(binascii.unhexlify(joined), 4, 0)
        except ValueError:  # not hex somewhere: per hash, as normalize_hash reads them
            pass
    if longest > 64:
        return None
    try:
        return [int(h[:16], 16) for h in raw]
    except ValueError:
        return None


def digest_keys(raw: Sequence[Any], *, head: bool) -> list[int] | None:
    """Keys of raw digests (bytes) that all have one length, a multiple of 8 (at most 32 with
    ``head``): the first 8 bytes, big-endian, with ``head``, else the last 8. None when the list
    is anything else (the caller converts hash by hash)."""
    try:
        joined = b"".join(raw)
    except TypeError:  # not all bytes
        return None
    n = len(raw)
    size = len(joined) // n if n else 0
    if not size or size % 8 or (head and size > 32) or len(joined) != size * n:
        return None
    if max(map(len, raw)) != size:  # equal total and no longer one: all of one length
        return None
    words = size // 8
    return _words(joined, words, 0 if head else words - 1)


def _words(data: bytes, step: int, first: int) -> list[int]:
    arr = array("Q", data)
    if _SWAP:
        arr.byteswap()
    return arr[first::step].tolist()
