"""TensorRT-LLM's legacy block key, ``v1_block_key`` (COMPATIBILITY.md §1): a u64 chained
through every token of a block and its parent's key.

What does not depend on the chain is computed for the whole call with numpy (the
seed-independent part of the mixing); the chain itself (one 64-bit seed through every token)
runs compiled by :mod:`~kvpool.hashing.jit` when the ``jit`` extra (numba) is installed, with the
same
results; the Python loop here is the fallback. ``benchmarks/bench_hashing.py`` measures them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final

import numpy as np

from kvpool.hashing import jit
from kvpool.hashing.inputs import M64, check_tpb, check_u64_or_none, tokens_to_u32

__all__ = ["v1_block_key", "v1_block_keys", "v1_keys"]

_C32: Final = 0x045D9F3B
_C64A: Final = 0xBF58476D1CE4E5B9
_C64B: Final = 0x94D049BB133111EB
_K: Final = 0x9E3779B9

# v1_block_key (TensorRT-LLM legacy)
#
# mix32(v, seed) = seed ^ ((w + (seed << 6) + (seed >> 2)) & M64), where w depends on the token
# only. We precompute a = 4 * w for every token with numpy and use the identity
#     (seed << 6) + (seed >> 2) + w == (seed * 257 + 4 * w) >> 2
# (256 * seed + 4 * w is a multiple of 4, so the shift drops only seed's low two bits), which
# leaves five int operations per token in the sequential loop: multiply, add, shift, mask, xor.


def _mix64(v: int, seed: int) -> int:
    v = ((v ^ (v >> 30)) * _C64A) & M64
    v = ((v ^ (v >> 27)) * _C64B) & M64
    v = v ^ (v >> 31)
    return seed ^ ((v + _K + (seed << 6) + (seed >> 2)) & M64)


def _v1_premix4_array(v: np.ndarray) -> np.ndarray:
    """4 × the seed-independent part of mix32 of u32 token ids ``v`` (u32 arithmetic)."""
    v = ((v >> 16) ^ v) * np.uint32(_C32)
    v = ((v >> 16) ^ v) * np.uint32(_C32)
    v = ((v >> 16) ^ v) + np.uint32(_K)  # wraps in 32 bits, as the engine's does
    return v.astype(np.int64) << 2


# The premix of every id below 2**18 (2 MiB, built on first use), which covers the vocabularies
# in use (Llama 3: 128,256 ids; Gemma 3: 262,144): one gather instead of a dozen numpy calls,
# whose fixed cost dominates the short inputs of incremental use. Larger ids are computed.
_PREMIX_TABLE_SIZE: Final = 1 << 18
_premix_table: np.ndarray | None = None


def _v1_premix4(tokens: array[int]) -> list[int]:
    """4 × the seed-independent part of mix32 for every token, as a list of ints."""
    global _premix_table
    v = np.frombuffer(tokens, dtype=np.uint32)
    if _premix_table is None:
        _premix_table = _v1_premix4_array(np.arange(_PREMIX_TABLE_SIZE, dtype=np.uint32))
    try:
        out: list[int] = _premix_table.take(v).tolist()  # take: less overhead than [v]
    except IndexError:  # an id beyond the table
        out = _v1_premix4_array(v).tolist()
    # A list, not an array("q") for the loops to slice: iterating an array makes the same ints
    # one by one, and measured slower.
    return out


def _v1_block(body: list[int], parent: int, salt: int | None, lora: int | None) -> int:
    """The v1 key of one block whose premixed tokens (from :func:`_v1_premix4`) are ``body``."""
    m64 = M64
    seed = len(body) ^ (parent * _C64A & m64)
    if salt is not None and parent == 0:
        seed = _mix64(salt, seed)
    # A plain loop: on CPython 3.11 unrolling it (zip over one iterator) measured slower.
    for a in body:
        seed ^= (seed * 257 + a >> 2) & m64
    if lora is not None:
        seed = _mix64(lora, seed)
    return seed


def _v1_chain(
    pre: list[int], tpb: int, parent: int, salt: int | None, lora: int | None
) -> list[int]:
    """Chained keys of consecutive blocks of ``pre`` (the last one may be partial)."""
    out: list[int] = []
    append = out.append
    m64 = M64
    c64a = _C64A
    n_full = len(pre) - len(pre) % tpb
    # The full blocks run _v1_block's code inline: the call measured a few percent of the loop.
    for start in range(0, n_full, tpb):
        seed = tpb ^ (parent * c64a & m64)
        if salt is not None and parent == 0:
            seed = _mix64(salt, seed)
        for a in pre[start:start + tpb]:
            seed ^= (seed * 257 + a >> 2) & m64
        if lora is not None:
            seed = _mix64(lora, seed)
        append(seed)
        parent = seed
    if n_full < len(pre):
        append(_v1_block(pre[n_full:], parent, salt, lora))
    return out


def v1_keys(
    tokens: array[int], tpb: int, parent: int, salt: int | None, lora: int | None
) -> list[int]:
    """Chained v1 keys of validated u32 ``tokens`` (the last block may be partial): compiled
    when :mod:`~.jit` can (the same keys), else premixed with numpy and chained here."""
    keys = jit.v1_chain(tokens, tpb, parent, salt, lora)
    if keys is None:
        keys = _v1_chain(_v1_premix4(tokens), tpb, parent, salt, lora)
    return keys


def v1_block_key(
    tokens: Sequence[int],
    parent_hash: int = 0,
    *,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> int:
    """TensorRT-LLM's legacy block key of one block, chained on ``parent_hash`` (0 = first).

    The salt id is mixed in only when ``parent_hash == 0`` (the first block of a sequence); the
    LoRA id into every block.
    """
    check_u64_or_none("parent_hash", parent_hash)
    check_u64_or_none("lora_id", lora_id)
    check_u64_or_none("salt_id", salt_id)
    toks = tokens_to_u32(tokens)
    keys = jit.v1_chain(toks, len(toks), parent_hash, salt_id, lora_id) if toks else None
    return keys[0] if keys else _v1_block(_v1_premix4(toks), parent_hash, salt_id, lora_id)


def v1_block_keys(
    tokens: Sequence[int],
    tokens_per_block: int,
    *,
    parent_hash: int = 0,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> list[int]:
    """Chained v1 keys of every block of ``tokens`` (a trailing partial block included)."""
    check_tpb(tokens_per_block)
    check_u64_or_none("parent_hash", parent_hash)
    check_u64_or_none("lora_id", lora_id)
    check_u64_or_none("salt_id", salt_id)
    return v1_keys(tokens_to_u32(tokens), tokens_per_block, parent_hash, salt_id, lora_id)
