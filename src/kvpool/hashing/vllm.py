"""vLLM's block hash, ``vllm_sha256_cbor`` (COMPATIBILITY.md §1): sha256 of the canonical CBOR
of ``[parent, tokens, extra keys]``, chained from a fixed seed; events carry its last 8 bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Final

import cbor2
import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.inputs import check_digest, validate_tokens

__all__ = [
    "VLLM_NONE_HASH",
    "vllm_chain",
    "vllm_event_int",
    "vllm_none_hash",
    "vllm_sha256_cbor_block_hash",
    "vllm_tails",
]

# vLLM sha256_cbor

VLLM_NONE_HASH: Final = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def vllm_none_hash() -> bytes:
    """vLLM's chain seed: sha256 of the canonical CBOR of the string ``"vllm-none-hash"``."""
    return VLLM_NONE_HASH


def vllm_sha256_cbor_block_hash(
    parent: bytes | None, tokens: Sequence[int], extra_keys: Sequence[object] | None = None
) -> bytes:
    """vLLM's block hash: sha256 of canonical CBOR ``[parent or NONE_HASH, tokens, extra]``.

    ``extra`` is ``tuple(extra_keys)``, or null when ``extra_keys`` is None or empty (vLLM never
    passes an empty tuple).
    """
    if parent is not None:
        check_digest("parent", parent)
    if extra_keys is not None and not isinstance(extra_keys, list | tuple):
        raise InvalidArgumentError(f"extra_keys must be a list or tuple, got {extra_keys!r:.100}")
    toks = validate_tokens(tokens)
    extra = tuple(extra_keys) if extra_keys else None
    payload = [parent if parent is not None else VLLM_NONE_HASH, toks, extra]
    try:
        encoded = cbor2.dumps(payload, canonical=True)
    except cbor2.CBOREncodeError as e:
        raise InvalidArgumentError(f"extra_keys {extra_keys!r:.100} cannot be encoded: {e}") from e
    return hashlib.sha256(encoded).digest()


# Canonical CBOR (RFC 8949 §4.2.1, shortest form) of a token id u < 2**32: u itself below 24;
# 0x18 and 1 byte below 2**8; 0x19 and 2 big-endian bytes below 2**16; else 0x1a and 4. For its
# width class c (0..3), u | _CBOR_HEADS[c] as a big-endian u64 ends with that encoding, and
# _CBOR_KEEP[c] picks out its last _CBOR_WIDTHS[c] bytes.
_CBOR_BOUNDS: Final = np.array([24, 1 << 8, 1 << 16], dtype=np.uint32)
_CBOR_HEADS: Final = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CBOR_WIDTHS: Final = np.array([1, 2, 3, 5], dtype=np.int64)
_CBOR_KEEP: Final = np.arange(8) >= 8 - _CBOR_WIDTHS[:, None]  # bytes kept, per class
_BE_U64: Final = np.dtype(">u8")
_CBOR_NULL: Final = b"\xf6"
# The payload of a block, [parent, tokens, extra], opens with a 3-array head and a 32-byte
# byte-string head.
_VLLM_LEAD: Final = b"\x83\x58\x20"


def _cbor_uints(tokens: array[int]) -> tuple[bytes, np.ndarray]:
    """The canonical CBOR encodings of u32 ``tokens``, concatenated, and each one's width."""
    v = np.frombuffer(tokens, dtype=np.uint32)
    cls = _CBOR_BOUNDS.searchsorted(v, side="right")
    words = (v | _CBOR_HEADS.take(cls)).astype(_BE_U64)
    raw = words.view(np.uint8).reshape(-1, 8)[_CBOR_KEEP.take(cls, axis=0)].tobytes()
    return raw, _CBOR_WIDTHS.take(cls)


def _cbor_array_head(n: int) -> bytes:
    """The canonical CBOR head of an array of ``n`` items."""
    if n < 24:
        return bytes([0x80 | n])
    if n < 1 << 8:
        return bytes([0x98, n])
    if n < 1 << 16:
        return b"\x99" + n.to_bytes(2, "big")
    if n < 1 << 32:
        return b"\x9a" + n.to_bytes(4, "big")
    return b"\x9b" + n.to_bytes(8, "big")


def vllm_chain(
    tokens: array[int], tpb: int, parent: bytes, first_tail: bytes, tail: bytes
) -> list[bytes]:
    """Chained vLLM hashes of the full blocks of ``tokens``.

    The canonical CBOR of a block's ``[parent, tokens, extra]`` is put together from its
    parts: the lead, the parent, the array head, the tokens' encodings (one numpy pass for the
    whole call, cut at block boundaries) and the encoded extra keys, ``first_tail`` for the
    first block and ``tail`` for the others (see :func:`vllm_tails`). Encoding each block
    with cbor2 instead measured 4 to 7 times slower.
    """
    n = len(tokens) // tpb * tpb
    if not n:
        return []
    raw, widths = _cbor_uints(tokens if n == len(tokens) else tokens[:n])
    ends: list[int] = widths.cumsum()[tpb - 1::tpb].tolist() if n > tpb else [len(raw)]
    head = _cbor_array_head(tpb)
    lead = _VLLM_LEAD
    sha = hashlib.sha256
    join = b"".join
    out: list[bytes] = []
    append = out.append
    start = 0
    for end in ends:
        parent = sha(join((lead, parent, head, raw[start:end], first_tail))).digest()
        append(parent)
        start = end
        first_tail = tail
    return out


def _vllm_extras(
    lora_id: int | None, cache_salt: str | None
) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """vLLM's extra keys (first block, later blocks): the LoRA name, then the salt on block 0.

    kvpool has LoRA ids, not names; the id's decimal string stands in for the adapter name. As
    in vLLM, a first block salted with "5" and one under LoRA "5" (no salt) hash alike; the
    later blocks differ.
    """
    rest: tuple[str, ...] = () if lora_id is None else (str(lora_id),)
    first = rest if cache_salt is None else (*rest, cache_salt)
    return first or None, rest or None


def vllm_tails(lora_id: int | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """The canonical CBOR of the extra keys of :func:`_vllm_extras` (first block, later
    blocks)."""
    first, rest = _vllm_extras(lora_id, cache_salt)
    return (
        _CBOR_NULL if first is None else cbor2.dumps(first, canonical=True),
        _CBOR_NULL if rest is None else cbor2.dumps(rest, canonical=True),
    )


def vllm_event_int(block_hash: bytes) -> int:
    """The event id of a vLLM block hash: its last 8 bytes as an unsigned big-endian int."""
    check_digest("block_hash", block_hash)
    return int.from_bytes(block_hash[-8:], "big")
