"""Block keys and event-hash algorithms, bit for bit with the engines (COMPATIBILITY.md §1).

A *block key* names a block by its tokens and every token before it, plus its reuse scope.
The manager keys its radix tree by the digests of one algorithm (``HashAlgo``); events carry a
projection of that digest (:func:`event_hash`):

=====================  =====================  ==========================================
algorithm              digest (tree key)      event encoding
=====================  =====================  ==========================================
``v1_block_key``       int (u64)              the int
``v2_sha256``          32-byte sha256         64 lowercase hex characters
``v2_sha256_64``       32-byte sha256         first 8 bytes, big-endian, unsigned
``vllm_sha256_cbor``   32-byte sha256         last 8 bytes, big-endian, unsigned
=====================  =====================  ==========================================

Token ids must be ints in [0, 2**31) (``bool`` counts as an int, as everywhere in Python);
anything else raises :class:`InvalidTokenError` naming the first bad token. Every public entry
point validates its input before computing or changing anything.

Speed: hashing is on the admission path of the manager and on every request of the router, so
the chained loops are written for CPython: one bulk validation and conversion per call, then a
tight per-block loop. What does not depend on the chain is computed for the whole call with
numpy: the seed-independent part of the v1 mixing, and the CBOR encodings of vLLM's token ids.
The v1 chain itself (one 64-bit seed through every token) runs compiled by :mod:`kvpool.jit`
when the ``jit`` extra (numba) is installed, with the same results; the Python loop here is the
fallback. ``benchmarks/bench_hashing.py`` measures them.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Final, cast

import cbor2
import numpy as np

from kvpool import jit
from kvpool.errors import InvalidArgumentError, InvalidTokenError, UnknownHashAlgorithmError

__all__ = [
    "MAX_TOKEN_ID",
    "BlockHasher",
    "BlockKey",
    "HashAlgo",
    "cache_salt_id",
    "event_hash",
    "hash_algo",
    "request_block_hashes",
    "tokens_to_u32",
    "v1_block_key",
    "v1_block_keys",
    "v2_block_key",
    "v2_root_key",
    "validate_tokens",
    "vllm_event_int",
    "vllm_none_hash",
    "vllm_sha256_cbor_block_hash",
]

M64: Final = (1 << 64) - 1
M32: Final = (1 << 32) - 1
_C32: Final = 0x045D9F3B
_C64A: Final = 0xBF58476D1CE4E5B9
_C64B: Final = 0x94D049BB133111EB
_K: Final = 0x9E3779B9
MAX_TOKEN_ID: Final = (1 << 31) - 1
_DIGEST_SIZE: Final = 32
_TOP_BYTE: Final = 3 if sys.byteorder == "little" else 0  # of a native u32
_NUMPY_SCAN_MIN: Final = 4096  # tokens
_LOW_BYTE: Final = 0 if sys.byteorder == "little" else 3  # of a native u32
_BOOL_SCAN_MIN: Final = 64  # tokens: from here the 0 and 1 ids are found by their low byte

BlockKey = int | bytes
"""A tree key: an int for ``v1_block_key``, a 32-byte digest for the sha256 algorithms."""


class HashAlgo(StrEnum):
    """The event-hash algorithms kvpool speaks."""

    V1_BLOCK_KEY = "v1_block_key"
    V2_SHA256 = "v2_sha256"
    V2_SHA256_64 = "v2_sha256_64"
    VLLM_SHA256_CBOR = "vllm_sha256_cbor"


def hash_algo(value: str | HashAlgo) -> HashAlgo:
    """Parse an algorithm name; unknown names raise :class:`UnknownHashAlgorithmError`."""
    if isinstance(value, HashAlgo):
        return value
    try:
        return HashAlgo(value)
    except ValueError:
        names = ", ".join(a.value for a in HashAlgo)
        raise UnknownHashAlgorithmError(
            f"unknown hash algorithm {value!r}; expected one of: {names}"
        ) from None


# --------------------------------------------------------------------------------------------
# validation


def _bad_token_error(tokens: object) -> InvalidTokenError:
    """The error naming the first bad token of ``tokens`` (called only once a check failed)."""
    if isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(
        tokens, Iterable
    ):
        return InvalidTokenError(
            f"tokens must be a sequence of int token ids, got {type(tokens).__name__} "
            f"{tokens!r:.80}"
        )
    for i, t in enumerate(tokens):
        if not isinstance(t, int | np.integer) or isinstance(t, bool):
            return InvalidTokenError(
                f"token at position {i} is {t!r} ({type(t).__name__}); token ids must be ints"
            )
        if not 0 <= int(t) <= MAX_TOKEN_ID:
            return InvalidTokenError(
                f"token at position {i} is {int(t)}; token ids must be in [0, 2**31)"
            )
    return InvalidTokenError(f"invalid token ids {tokens!r:.80}")


def _u32_array(seq: list[int]) -> array[int]:
    out = array("I")
    try:
        # Rejects non-ints (floats, str, None) and ids outside [0, 2**32) in C. fromlist
        # converts each item directly; array("I", seq) goes through the sequence protocol per
        # item and measured 30 % more instructions.
        out.fromlist(seq)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token_error(seq) from None
    # fromlist takes a bool for 0 or 1: a short list is looked at item by item; in a long one
    # only the items that became 0 or 1 can be bools, and memchr finds the ids whose low byte
    # is 0 or 1 (~1 in 128). A numpy reduction did this before, ~13 us of an engine's request
    # in place (its code is cold on every call) against ~3 here.
    if len(seq) < _BOOL_SCAN_MIN:
        for t in seq:
            if t.__class__ is bool:
                raise _bad_token_error(seq)
    else:
        low = out.tobytes()[_LOW_BYTE::4]
        for b in (0, 1):
            i = low.find(b)
            while i >= 0:
                if out[i] == b and seq[i].__class__ is bool:
                    raise _bad_token_error(seq)
                i = low.find(b, i + 1)
    return out


def tokens_to_u32(tokens: Iterable[int] | np.ndarray | array[int]) -> array[int]:
    """Validate token ids and return them as a new native u32 array (``array("I")``).

    Accepts a sequence (or iterable) of ints, an ``array`` of any integer typecode, or a 1-D
    numpy array of an integer dtype. Raises :class:`InvalidTokenError` naming the first bad
    token. The result never aliases the argument.
    """
    if type(tokens) is list:  # the common case first
        out = _u32_array(tokens)
    elif isinstance(tokens, array) and tokens.typecode == "I":
        out = tokens[:]  # a memcpy, not a per-item conversion
    elif isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidTokenError(
                f"token array must be 1-D of an integer dtype, got {tokens.dtype} "
                f"with shape {tokens.shape}: {tokens!r:.80}"
            )
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
            raise _bad_token_error(tokens.tolist())
        out = array("I")
        out.frombytes(tokens.astype(np.uint32, copy=False).tobytes())
        return out
    elif isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(
        tokens, Iterable
    ):
        raise _bad_token_error(tokens)
    else:
        out = _u32_array(list(tokens))  # a one-shot iterator must survive the error path
    # An id >= 2**31 has the top bit of its u32 set: scan the most significant bytes in C, or
    # for long inputs take numpy's max (its fixed cost is that of scanning ~3,000 ids).
    if len(out) > _NUMPY_SCAN_MIN:
        if np.frombuffer(out, dtype=np.uint32).max() > MAX_TOKEN_ID:
            raise _bad_token_error(out)
    elif not out.tobytes()[_TOP_BYTE::4].isascii():
        raise _bad_token_error(out)
    return out


def validate_tokens(tokens: Sequence[int] | np.ndarray | array[int]) -> list[int]:
    """Validate token ids and return them as a new list of ints."""
    return tokens_to_u32(tokens).tolist()


def _check_tpb(tokens_per_block: object) -> int:
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise InvalidArgumentError(
            f"tokens_per_block must be an int, got {tokens_per_block!r} "
            f"({type(tokens_per_block).__name__})"
        )
    if tokens_per_block < 1:
        raise InvalidArgumentError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    return tokens_per_block


def _check_u64(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= M64:
        raise InvalidArgumentError(f"{name} must be an unsigned 64-bit int, got {value!r}")


def _check_digest(name: str, value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != _DIGEST_SIZE:
        size = f" of {len(value)} bytes" if isinstance(value, bytes | str) else ""
        raise InvalidArgumentError(
            f"{name} must be a 32-byte digest (bytes), got {type(value).__name__}{size} "
            f"{value!r:.200}"
        )
    return value


def _check_salt(cache_salt: object) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")


# --------------------------------------------------------------------------------------------
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


def _v1_keys(
    tokens: array[int], tpb: int, parent: int, salt: int | None, lora: int | None
) -> list[int]:
    """Chained v1 keys of validated u32 ``tokens`` (the last block may be partial): compiled
    when :mod:`kvpool.jit` can (the same keys), else premixed with numpy and chained here."""
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
    _check_u64("parent_hash", parent_hash)
    _check_u64("lora_id", lora_id)
    _check_u64("salt_id", salt_id)
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
    _check_tpb(tokens_per_block)
    _check_u64("parent_hash", parent_hash)
    _check_u64("lora_id", lora_id)
    _check_u64("salt_id", salt_id)
    return _v1_keys(tokens_to_u32(tokens), tokens_per_block, parent_hash, salt_id, lora_id)


# --------------------------------------------------------------------------------------------
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
    _check_u64("lora_id", lora_id)
    _check_u64("salt_id", salt_id)
    return hashlib.sha256(_scope_bytes(lora_id, salt_id)).digest()


def _le_bytes(tokens: array[int]) -> bytes:
    """Tokens as little-endian u32 bytes."""
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts
        tokens = tokens[:]
        tokens.byteswap()
    return tokens.tobytes()


# A fresh sha256 object by copying an empty one skips OpenSSL's per-call algorithm lookup.
_SHA256_NEW: Final = hashlib.sha256().copy
_V2_CUT_MIN_BLOCKS: Final = 4


def _v2_chain(raw: bytes, step: int, parent: bytes) -> list[bytes]:
    """Chained v2 keys of consecutive ``step``-byte chunks of ``raw`` (the last may be short)."""
    out: list[bytes] = []
    append = out.append
    new = _SHA256_NEW
    # The whole blocks of a long input are cut in C by iter_unpack, which measured 10 % faster
    # than slicing them in the loop; below a few blocks its fixed cost outweighs that.
    n_cut = len(raw) - len(raw) % step if len(raw) >= _V2_CUT_MIN_BLOCKS * step else 0
    if n_cut:
        for (chunk,) in struct.iter_unpack(f"{step}s", raw if n_cut == len(raw) else raw[:n_cut]):
            h = new()
            h.update(parent + chunk)
            parent = h.digest()
            append(parent)
    for off in range(n_cut, len(raw), step):  # the blocks of a short input, a partial block
        h = new()
        h.update(parent + raw[off:off + step])
        parent = h.digest()
        append(parent)
    return out


def v2_block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """sha256(parent_key + tokens as little-endian u32): the key of a block under its parent.

    ``parent_key`` is the previous block's key, or :func:`v2_root_key` for the first block.
    """
    _check_digest("parent_key", parent_key)
    return hashlib.sha256(parent_key + _le_bytes(tokens_to_u32(tokens))).digest()


def cache_salt_id(cache_salt: str) -> int:
    """The salt id shared by engine and router: first 8 bytes of sha256(salt), little-endian."""
    if not isinstance(cache_salt, str):
        raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")
    return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8")).digest()[:8], "little")


# --------------------------------------------------------------------------------------------
# vLLM sha256_cbor

_VLLM_NONE_HASH: Final = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def vllm_none_hash() -> bytes:
    """vLLM's chain seed: sha256 of the canonical CBOR of the string ``"vllm-none-hash"``."""
    return _VLLM_NONE_HASH


def vllm_sha256_cbor_block_hash(
    parent: bytes | None, tokens: Sequence[int], extra_keys: Sequence[object] | None = None
) -> bytes:
    """vLLM's block hash: sha256 of canonical CBOR ``[parent or NONE_HASH, tokens, extra]``.

    ``extra`` is ``tuple(extra_keys)``, or null when ``extra_keys`` is None or empty (vLLM never
    passes an empty tuple).
    """
    if parent is not None:
        _check_digest("parent", parent)
    if extra_keys is not None and not isinstance(extra_keys, list | tuple):
        raise InvalidArgumentError(f"extra_keys must be a list or tuple, got {extra_keys!r:.100}")
    toks = validate_tokens(tokens)
    extra = tuple(extra_keys) if extra_keys else None
    payload = [parent if parent is not None else _VLLM_NONE_HASH, toks, extra]
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


def _vllm_chain(
    tokens: array[int], tpb: int, parent: bytes, first_tail: bytes, tail: bytes
) -> list[bytes]:
    """Chained vLLM hashes of the full blocks of ``tokens``.

    The canonical CBOR of a block's ``[parent, tokens, extra]`` is put together from its
    parts: the lead, the parent, the array head, the tokens' encodings (one numpy pass for the
    whole call, cut at block boundaries) and the encoded extra keys, ``first_tail`` for the
    first block and ``tail`` for the others (see :func:`_vllm_tails`). Encoding each block
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


def _vllm_tails(lora_id: int | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """The canonical CBOR of the extra keys of :func:`_vllm_extras` (first block, later
    blocks)."""
    first, rest = _vllm_extras(lora_id, cache_salt)
    return (
        _CBOR_NULL if first is None else cbor2.dumps(first, canonical=True),
        _CBOR_NULL if rest is None else cbor2.dumps(rest, canonical=True),
    )


def vllm_event_int(block_hash: bytes) -> int:
    """The event id of a vLLM block hash: its last 8 bytes as an unsigned big-endian int."""
    _check_digest("block_hash", block_hash)
    return int.from_bytes(block_hash[-8:], "big")


# --------------------------------------------------------------------------------------------
# projections and the incremental hasher


def event_hash(algo: HashAlgo | str, key: BlockKey) -> int | str:
    """The value an event carries for a block whose tree key is ``key``."""
    if not isinstance(algo, HashAlgo):
        algo = hash_algo(algo)
    if algo is HashAlgo.V1_BLOCK_KEY:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= M64:
            raise InvalidArgumentError(f"a v1_block_key key must be a u64 int, got {key!r}")
        return key
    digest = _check_digest(f"a {algo.value} key", key)
    if algo is HashAlgo.V2_SHA256:
        return digest.hex()
    if algo is HashAlgo.V2_SHA256_64:
        return int.from_bytes(digest[:8], "big")
    return int.from_bytes(digest[-8:], "big")


class BlockHasher:
    """Incremental block keys of one sequence in one reuse scope.

    ``extend(tokens)`` appends tokens and returns the keys of the blocks they complete; the
    prefix is never rehashed (each block is hashed once, when its last token arrives), so
    feeding a sequence in any number of pieces yields exactly the keys of one call.
    ``partial_key()`` is the key of the trailing partial block, or None when the sequence ends
    on a block boundary. Keys chain exactly as the engines do.

    Invariants: ``len(keys) * tpb + pending_tokens`` is the number of tokens fed;
    ``0 <= pending_tokens < tpb``; a call that raises changes nothing.
    """

    __slots__ = (
        "_lora", "_parent", "_pending", "_salt", "_tail_first", "_tail_rest", "algo", "keys",
        "tpb",
    )

    def __init__(
        self,
        algo: HashAlgo | str,
        tokens_per_block: int,
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        root: BlockKey | None = None,
    ) -> None:
        """``root``: the scope's :meth:`root_key` when the caller has it (a v2 root is a
        sha256; a manager keeps them)."""
        self.algo = hash_algo(algo)
        self.tpb = _check_tpb(tokens_per_block)
        _check_u64("lora_id", lora_id)
        _check_salt(cache_salt)
        self._lora = lora_id
        self._salt = cache_salt_id(cache_salt) if cache_salt is not None else None
        self._tail_first, self._tail_rest = (
            _vllm_tails(lora_id, cache_salt)
            if self.algo is HashAlgo.VLLM_SHA256_CBOR
            else (b"", b"")
        )
        self.keys: list[BlockKey] = []
        """Keys of the full blocks so far, in order."""
        self._pending = array("I")
        self._parent: BlockKey = (
            root if root is not None
            else self.root_key(self.algo, lora_id=lora_id, salt_id=self._salt)
        )

    def resumed(self, keys: Sequence[BlockKey]) -> BlockHasher:
        """A new hasher of the same algorithm and scope whose chain continues after ``keys``
        (as a fresh one would after :meth:`resume`), without re-validating the settings: a
        manager keeps one hasher per scope and forks it for each commit."""
        h = object.__new__(BlockHasher)
        h.algo, h.tpb, h._lora, h._salt = self.algo, self.tpb, self._lora, self._salt
        h._tail_first, h._tail_rest = self._tail_first, self._tail_rest
        h._pending = array("I")
        if keys:
            h.keys = list(keys)
            h._parent = h.keys[-1]
        else:
            h.keys = []
            h._parent = self._parent if not self.keys else self._root_of_scope()
        return h

    def _root_of_scope(self) -> BlockKey:
        return self.root_key(self.algo, lora_id=self._lora, salt_id=self._salt)

    @staticmethod
    def root_key(
        algo: HashAlgo | str, *, lora_id: int | None = None, salt_id: int | None = None
    ) -> BlockKey:
        """The parent of a scope's first block (0 for v1, the scope digest for v2, NONE_HASH
        for vLLM)."""
        algo = hash_algo(algo)
        if algo is HashAlgo.V1_BLOCK_KEY:
            return 0
        if algo is HashAlgo.VLLM_SHA256_CBOR:
            return _VLLM_NONE_HASH
        return v2_root_key(lora_id=lora_id, salt_id=salt_id)

    @property
    def pending_tokens(self) -> int:
        """Tokens after the last full block."""
        return len(self._pending)

    def extend(self, tokens: Sequence[int] | np.ndarray | array[int]) -> list[BlockKey]:
        """Append tokens; return the keys of the blocks they complete (possibly none)."""
        toks = tokens_to_u32(tokens)
        pending = self._pending
        if pending:
            pending.extend(toks)
            toks = pending
        tpb = self.tpb
        n_full = len(toks) // tpb * tpb
        if not n_full:
            self._pending = toks
            return []
        new = self._chain(toks, n_full, full=True)
        self._pending = toks[n_full:]
        self.keys.extend(new)
        self._parent = new[-1]
        return new

    def resume(self, keys: Sequence[BlockKey]) -> None:
        """Continue a chain whose first full blocks were hashed elsewhere (a prefix matched
        in the tree carries its keys): ``keys`` become this hasher's keys, and the next block
        chains on the last. Only on a hasher nothing was fed to yet."""
        if self.keys or self._pending:
            raise InvalidArgumentError("resume() needs a fresh BlockHasher")
        if keys:
            self.keys = list(keys)
            self._parent = self.keys[-1]

    def partial_key(self) -> BlockKey | None:
        """Key of the trailing partial block, or None if there is none."""
        if not self._pending:
            return None
        return self._chain(self._pending, len(self._pending), full=False)[0]

    def key_of_prefix_block(self, tokens: Sequence[int] | array[int]) -> BlockKey:
        """Key of a block of 1..tpb ``tokens`` following the last full block (not recorded)."""
        toks = tokens_to_u32(tokens)
        if not 0 < len(toks) <= self.tpb:
            raise InvalidArgumentError(
                f"a block holds 1..{self.tpb} tokens, got {len(toks)}"
            )
        return self._chain(toks, len(toks), full=False)[0]

    def _chain(self, data: array[int], stop: int, *, full: bool) -> list[BlockKey]:
        """Keys of the blocks of ``data[:stop]`` chained on the last full block.

        With ``full`` the blocks are whole; otherwise ``data[:stop]`` is one partial block
        (vLLM never hashes those; kvpool hashes them the same way for its own tree).
        """
        algo = self.algo
        parent = self._parent
        first = not self.keys
        keys: list[BlockKey]
        if algo is HashAlgo.V1_BLOCK_KEY:
            assert isinstance(parent, int)
            toks = data[:stop] if stop < len(data) else data
            keys = cast(list[BlockKey], _v1_keys(toks, self.tpb, parent, self._salt, self._lora))
        elif algo is HashAlgo.VLLM_SHA256_CBOR:
            assert isinstance(parent, bytes)
            toks = data[:stop] if stop < len(data) else data
            tpb = self.tpb if full else stop
            tail = self._tail_first if first else self._tail_rest
            keys = cast(list[BlockKey], _vllm_chain(toks, tpb, parent, tail, self._tail_rest))
        else:
            assert isinstance(parent, bytes)
            raw = _le_bytes(data[:stop] if stop < len(data) else data)
            keys = cast(list[BlockKey], _v2_chain(raw, 4 * self.tpb, parent))
        return keys


def request_block_hashes(
    tokens: Sequence[int] | np.ndarray | array[int],
    tokens_per_block: int,
    algo: HashAlgo | str,
    *,
    cache_salt: str | None = None,
    lora_id: int | None = None,
) -> list[int | str]:
    """The event hashes a router computes for a request (COMPATIBILITY §1.5).

    Blocks cover the prompt minus its last token; a trailing partial chunk is included for the
    TensorRT-LLM algorithms, full blocks only for vLLM's. So a prompt of n tokens gives
    ceil((n-1)/tpb) hashes for the TensorRT-LLM algorithms and floor((n-1)/tpb) for vLLM's.
    The salt goes into the first block (v1), the root (v2) or the first block's extra keys
    (vLLM). For vLLM a LoRA id is hashed as its decimal string in the extra keys, standing in
    for the adapter name. Values are ints, or 64-character hex strings for ``v2_sha256``.
    """
    a = hash_algo(algo)
    tpb = _check_tpb(tokens_per_block)
    _check_u64("lora_id", lora_id)
    _check_salt(cache_salt)
    body = tokens_to_u32(tokens)  # a fresh array: dropping the last token copies nothing
    if body:
        del body[-1]
    salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
    if a is HashAlgo.V1_BLOCK_KEY:
        return cast(list[int | str], _v1_keys(body, tpb, 0, salt_id, lora_id))
    if a is HashAlgo.VLLM_SHA256_CBOR:
        first, rest = _vllm_tails(lora_id, cache_salt)
        digests = _vllm_chain(body, tpb, _VLLM_NONE_HASH, first, rest)
        return [int.from_bytes(d[-8:], "big") for d in digests]
    digests = _v2_chain(_le_bytes(body), 4 * tpb, v2_root_key(lora_id=lora_id, salt_id=salt_id))
    if a is HashAlgo.V2_SHA256:
        return [d.hex() for d in digests]
    return [int.from_bytes(d[:8], "big") for d in digests]
