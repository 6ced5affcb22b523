"""TensorRT-LLM V2's radix keys, ``v2_sha256`` (COMPATIBILITY.md §1): sha256 of the parent's
key and the block's tokens as little-endian u32, chained from a root digest of the reuse scope.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Final

from kvpool.hashing.inputs import check_digest, check_u64_or_none, tokens_to_u32

__all__ = ["le_bytes", "v2_block_key", "v2_chain", "v2_heads", "v2_root_key"]


# v2 sha256 (TensorRT-LLM V2 radix keys)


def _scope_bytes(lora_id: int | None, salt_id: int | None) -> bytes:
    mask = (lora_id is not None) | ((salt_id is not None) << 1)
    b = bytes([mask])
    if lora_id is not None:
        b += lora_id.to_bytes(8, "little")
    if salt_id is not None:
        b += salt_id.to_bytes(8, "little")
    return b


def v2_root_key(*, lora_id: int | None = None, salt_id: int | None = None) -> bytes:
    """The root digest of a reuse scope (LoRA id and/or salt id): the parent of block 0."""
    check_u64_or_none("lora_id", lora_id)
    check_u64_or_none("salt_id", salt_id)
    return hashlib.sha256(_scope_bytes(lora_id, salt_id)).digest()


def le_bytes(tokens: array[int]) -> bytes:
    """Tokens as little-endian u32 bytes."""
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts
        tokens = tokens[:]
        tokens.byteswap()
    return tokens.tobytes()


# A fresh sha256 object by copying an empty one skips OpenSSL's per-call algorithm lookup.
_SHA256_NEW: Final = hashlib.sha256().copy
_V2_CUT_MIN_BLOCKS: Final = 4
_CUT_STRUCT_MAX_BLOCKS: Final = 256
"""Inputs of up to this many whole blocks are cut by a cached :class:`struct.Struct` (one
format code per block: at most 256 x 256 codes cached); longer ones by ``iter_unpack``."""


@lru_cache(maxsize=256)
def _cut(step: int, n: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Cuts ``n * step`` bytes into ``n`` blocks in one C call."""
    return struct.Struct(f"{step}s" * n).unpack


def v2_chain(raw: bytes, step: int, parent: bytes) -> list[bytes]:
    """Chained v2 keys of consecutive ``step``-byte chunks of ``raw`` (the last may be short)."""
    out: list[bytes] = []
    append = out.append
    new = _SHA256_NEW
    # The whole blocks of a long input are cut in C, by one cached Struct (up to
    # _CUT_STRUCT_MAX_BLOCKS) or by iter_unpack, which measured 10 % faster than slicing them in
    # the loop; below a few blocks their fixed cost outweighs that.
    n_cut = len(raw) - len(raw) % step if len(raw) >= _V2_CUT_MIN_BLOCKS * step else 0
    if n_cut:
        whole = raw if n_cut == len(raw) else raw[:n_cut]
        n = n_cut // step
        chunks = (_cut(step, n)(whole) if n <= _CUT_STRUCT_MAX_BLOCKS
                  else [c for (c,) in struct.iter_unpack(f"{step}s", whole)])
        for chunk in chunks:
            h = new()
            h.update(parent)  # two updates: no parent + chunk concatenation per block
            h.update(chunk)
            parent = h.digest()
            append(parent)
    for off in range(n_cut, len(raw), step):  # the blocks of a short input, a partial block
        h = new()
        h.update(parent)
        h.update(raw[off:off + step])
        parent = h.digest()
        append(parent)
    return out


def v2_heads(digests: list[bytes]) -> list[int]:
    """The first 8 bytes (big-endian) of each v2 digest: its ``v2_sha256_64`` event hash (what
    a router keys blocks by), read in one C call for up to ``_CUT_STRUCT_MAX_BLOCKS`` digests."""
    if len(digests) <= _CUT_STRUCT_MAX_BLOCKS:
        return list(_heads(len(digests))(b"".join(digests)))
    return [int.from_bytes(d[:8], "big") for d in digests]


@lru_cache(maxsize=256)
def _heads(n: int) -> Callable[[bytes], tuple[int, ...]]:
    return struct.Struct(">" + "Q24x" * n).unpack


def v2_block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """sha256(parent_key + tokens as little-endian u32): the key of a block under its parent.

    ``parent_key`` is the previous block's key, or :func:`v2_root_key` for the first block.
    """
    check_digest("parent_key", parent_key)
    return hashlib.sha256(parent_key + le_bytes(tokens_to_u32(tokens))).digest()

