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

Token ids must be ints in [0, 2**31); anything else raises :class:`InvalidTokenError`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Final

import cbor2
import numpy as np

from kvpool.errors import InvalidArgumentError, InvalidTokenError, UnknownHashAlgorithmError

__all__ = [
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
    try:
        return HashAlgo(value)
    except ValueError:
        names = ", ".join(a.value for a in HashAlgo)
        raise UnknownHashAlgorithmError(
            f"unknown hash algorithm {value!r}; expected one of: {names}"
        ) from None


# --------------------------------------------------------------------------------------------
# token validation


def _bad_token_error(tokens: Iterable[object]) -> InvalidTokenError:
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            return InvalidTokenError(
                f"token at position {i} is {t!r} ({type(t).__name__}); token ids must be ints"
            )
        if not 0 <= int(t) <= MAX_TOKEN_ID:
            return InvalidTokenError(
                f"token at position {i} is {int(t)}; token ids must be in [0, 2**31)"
            )
    return InvalidTokenError("invalid token ids")


def tokens_to_u32(tokens: Sequence[int] | np.ndarray) -> array[int]:
    """Validate token ids and return them as a native (little-endian here) u32 array.

    Raises :class:`InvalidTokenError` naming the first bad token.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidTokenError(
                f"token array must be 1-D of an integer dtype, got {tokens.dtype} "
                f"with shape {tokens.shape}"
            )
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
            raise _bad_token_error(tokens.tolist())
        out = array("I")
        out.frombytes(tokens.astype("<u4", copy=False).tobytes())
        return out
    try:
        out = array("I", tokens)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token_error(tokens) from None
    if out and int(np.frombuffer(out, dtype=np.uint32).max()) > MAX_TOKEN_ID:
        raise _bad_token_error(tokens)
    return out


def validate_tokens(tokens: Sequence[int] | np.ndarray) -> list[int]:
    """Validate token ids and return them as a list of ints."""
    return tokens_to_u32(tokens).tolist()


def _check_tpb(tokens_per_block: int) -> None:
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise InvalidArgumentError(
            f"tokens_per_block must be an int, got {tokens_per_block!r}"
        )
    if tokens_per_block < 1:
        raise InvalidArgumentError(f"tokens_per_block must be >= 1, got {tokens_per_block}")


def _check_u64(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= M64:
        raise InvalidArgumentError(f"{name} must be an unsigned 64-bit int, got {value!r}")


# --------------------------------------------------------------------------------------------
# v1_block_key (TensorRT-LLM legacy)


def _mix64(v: int, seed: int) -> int:
    v = ((v ^ (v >> 30)) * _C64A) & M64
    v = ((v ^ (v >> 27)) * _C64B) & M64
    v = v ^ (v >> 31)
    return seed ^ ((v + _K + (seed << 6) + (seed >> 2)) & M64)


def _v1_premix(tokens: array[int]) -> list[int]:
    """The seed-independent part of mix32 for every token, vectorised (u32 arithmetic)."""
    v: np.ndarray = np.frombuffer(tokens, dtype=np.uint32)
    v = ((v >> 16) ^ v) * np.uint32(_C32)
    v = ((v >> 16) ^ v) * np.uint32(_C32)
    v = ((v >> 16) ^ v) + np.uint32(_K)
    out: list[int] = v.tolist()
    return out


def _v1_combine(premixed: list[int], start: int, stop: int, parent: int, salt: int | None,
                lora: int | None) -> int:
    m64 = M64
    seed = (stop - start) ^ ((parent * _C64A) & m64)
    if parent == 0 and salt is not None:
        seed = _mix64(salt, seed)
    # seed * 64 == seed << 6; CPython's multiply by a small int is the faster of the two.
    body = premixed[start:stop]
    quads = len(body) & ~3
    it = iter(body[:quads])
    for a, b, c, d in zip(it, it, it, it, strict=True):
        seed ^= (a + seed * 64 + (seed >> 2)) & m64
        seed ^= (b + seed * 64 + (seed >> 2)) & m64
        seed ^= (c + seed * 64 + (seed >> 2)) & m64
        seed ^= (d + seed * 64 + (seed >> 2)) & m64
    for v in body[quads:]:
        seed ^= (v + seed * 64 + (seed >> 2)) & m64
    if lora is not None:
        seed = _mix64(lora, seed)
    return seed


def v1_block_key(
    tokens: Sequence[int],
    parent_hash: int = 0,
    *,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> int:
    """TensorRT-LLM's legacy block key of one block, chained on ``parent_hash`` (0 = first)."""
    _check_u64("parent_hash", parent_hash)
    _check_u64("lora_id", lora_id)
    _check_u64("salt_id", salt_id)
    premixed = _v1_premix(tokens_to_u32(tokens))
    return _v1_combine(premixed, 0, len(premixed), parent_hash, salt_id, lora_id)


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
    premixed = _v1_premix(tokens_to_u32(tokens))
    keys: list[int] = []
    parent = parent_hash
    for start in range(0, len(premixed), tokens_per_block):
        stop = min(start + tokens_per_block, len(premixed))
        parent = _v1_combine(premixed, start, stop, parent, salt_id, lora_id)
        keys.append(parent)
    return keys


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
    """The root digest of a reuse scope (LoRA id and/or salt id)."""
    _check_u64("lora_id", lora_id)
    _check_u64("salt_id", salt_id)
    return hashlib.sha256(_scope_bytes(lora_id, salt_id)).digest()


def v2_block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """sha256(parent_key + tokens as little-endian u32)."""
    if not isinstance(parent_key, bytes) or len(parent_key) != 32:
        raise InvalidArgumentError(f"parent_key must be 32 bytes, got {parent_key!r}")
    return hashlib.sha256(parent_key + _le_bytes(tokens_to_u32(tokens))).digest()


def _le_bytes(tokens: array[int]) -> bytes:
    if array("I", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian hosts
        tokens = array("I", tokens)
        tokens.byteswap()
    return tokens.tobytes()


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
    """vLLM's block hash: sha256 of canonical CBOR ``(parent or NONE_HASH, tokens, extra)``."""
    toks = tuple(validate_tokens(tokens))
    extra = tuple(extra_keys) if extra_keys else None
    return _vllm_hash(parent if parent is not None else _VLLM_NONE_HASH, toks, extra)


def _vllm_hash(parent: bytes, tokens: Sequence[int], extra: tuple[object, ...] | None) -> bytes:
    # A list and a tuple encode to the same CBOR array; lists encode faster.
    return hashlib.sha256(cbor2.dumps([parent, tokens, extra], canonical=True)).digest()


def vllm_event_int(block_hash: bytes) -> int:
    """The event id of a vLLM block hash: its last 8 bytes as an unsigned big-endian int."""
    return int.from_bytes(block_hash[-8:], "big")


# --------------------------------------------------------------------------------------------
# projections and the incremental hasher


def event_hash(algo: HashAlgo, key: BlockKey) -> int | str:
    """The value an event carries for a block whose tree key is ``key``."""
    if algo is HashAlgo.V1_BLOCK_KEY:
        assert isinstance(key, int)
        return key
    assert isinstance(key, bytes)
    if algo is HashAlgo.V2_SHA256:
        return key.hex()
    if algo is HashAlgo.V2_SHA256_64:
        return int.from_bytes(key[:8], "big")
    return int.from_bytes(key[-8:], "big")


class BlockHasher:
    """Incremental block keys of one sequence in one reuse scope.

    ``extend(tokens)`` appends tokens and returns the keys of the blocks they complete; the
    prefix is never rehashed. ``partial_key()`` is the key of the trailing partial block (or
    None when the sequence ends on a block boundary). Keys chain exactly as the engines do, so
    ``keys`` equal the one-shot functions above.
    """

    __slots__ = (
        "_cache_salt", "_lora", "_parent", "_pending", "_root", "_salt", "algo", "keys", "tpb"
    )

    def __init__(
        self,
        algo: HashAlgo | str,
        tokens_per_block: int,
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        _check_tpb(tokens_per_block)
        _check_u64("lora_id", lora_id)
        self.algo = hash_algo(algo)
        self.tpb = tokens_per_block
        self._lora = lora_id
        self._cache_salt = cache_salt
        salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
        self._salt = salt_id
        self.keys: list[BlockKey] = []
        self._pending = array("I")
        self._root: BlockKey = self.root_key(self.algo, lora_id=lora_id, salt_id=salt_id)
        self._parent: BlockKey = self._root

    @staticmethod
    def root_key(algo: HashAlgo, *, lora_id: int | None, salt_id: int | None) -> BlockKey:
        """The parent of a scope's first block (0 for v1, the scope digest for v2, ...)."""
        if algo is HashAlgo.V1_BLOCK_KEY:
            return 0
        if algo is HashAlgo.VLLM_SHA256_CBOR:
            return _VLLM_NONE_HASH
        return v2_root_key(lora_id=lora_id, salt_id=salt_id)

    def extend(self, tokens: Sequence[int] | array[int]) -> list[BlockKey]:
        """Append tokens; return the keys of the blocks they complete."""
        toks = tokens if isinstance(tokens, array) else tokens_to_u32(tokens)
        if self._pending:
            self._pending.extend(toks)
            data = self._pending
        else:
            data = toks
        tpb = self.tpb
        n_full = len(data) // tpb
        if n_full == 0:
            self._pending = array("I", data)
            return []
        new = self._hash_blocks(data, n_full)
        self._pending = data[n_full * tpb:]
        self.keys.extend(new)
        self._parent = new[-1]
        return new

    def partial_key(self) -> BlockKey | None:
        """Key of the trailing partial block, or None if there is none."""
        if not self._pending:
            return None
        return self._hash_one(self._parent, self._pending, 0, len(self._pending))

    def key_of_prefix_block(self, tokens: array[int]) -> BlockKey:
        """Key of a (possibly partial) block of ``tokens`` after the last full block."""
        return self._hash_one(self._parent, tokens, 0, len(tokens))

    @property
    def pending_tokens(self) -> int:
        """Tokens after the last full block."""
        return len(self._pending)

    def _hash_one(self, parent: BlockKey, data: array[int], start: int, stop: int) -> BlockKey:
        algo = self.algo
        if algo is HashAlgo.V1_BLOCK_KEY:
            assert isinstance(parent, int)
            pre = _v1_premix(data[start:stop])
            return _v1_combine(pre, 0, len(pre), parent, self._salt, self._lora)
        assert isinstance(parent, bytes)
        if algo is HashAlgo.VLLM_SHA256_CBOR:
            return _vllm_hash(parent, data[start:stop].tolist(), self._vllm_extra(len(self.keys)))
        return hashlib.sha256(parent + _le_bytes(data[start:stop])).digest()

    def _vllm_extra(self, block_index: int) -> tuple[object, ...] | None:
        extra: list[object] = []
        if self._lora is not None:
            extra.append(str(self._lora))
        if self._cache_salt is not None and block_index == 0:
            extra.append(self._cache_salt)
        return tuple(extra) if extra else None

    def _hash_blocks(self, data: array[int], n: int) -> list[BlockKey]:
        tpb = self.tpb
        parent = self._parent
        out: list[BlockKey] = []
        algo = self.algo
        if algo is HashAlgo.V1_BLOCK_KEY:
            assert isinstance(parent, int)
            pre = _v1_premix(data[: n * tpb])
            salt, lora = self._salt, self._lora
            p = parent
            for b in range(n):
                p = _v1_combine(pre, b * tpb, (b + 1) * tpb, p, salt, lora)
                out.append(p)
            return out
        assert isinstance(parent, bytes)
        if algo is HashAlgo.VLLM_SHA256_CBOR:
            pb = parent
            first = len(self.keys)
            for b in range(n):
                extra = self._vllm_extra(first + b)
                pb = _vllm_hash(pb, data[b * tpb:(b + 1) * tpb].tolist(), extra)
                out.append(pb)
            return out
        raw = _le_bytes(data[: n * tpb])
        step = 4 * tpb
        sha = hashlib.sha256
        pb = parent
        append = out.append
        for off in range(0, n * step, step):
            pb = sha(pb + raw[off:off + step]).digest()
            append(pb)
        return out


def request_block_hashes(
    tokens: Sequence[int],
    tokens_per_block: int,
    algo: HashAlgo | str,
    *,
    cache_salt: str | None = None,
    lora_id: int | None = None,
) -> list[int | str]:
    """The event hashes a router computes for a request (COMPATIBILITY §1.5).

    Blocks cover the prompt minus its last token; a trailing partial chunk is included for the
    TensorRT-LLM algorithms, full blocks only for vLLM's. The salt goes into the first block
    (v1), the root (v2) or the first block's extra keys (vLLM). For vLLM a LoRA id is hashed as
    its decimal string in the extra keys, standing in for the adapter name.
    """
    a = hash_algo(algo)
    _check_tpb(tokens_per_block)
    toks = tokens_to_u32(tokens)
    body = toks[: max(len(toks) - 1, 0)]
    hasher = BlockHasher(a, tokens_per_block, lora_id=lora_id, cache_salt=cache_salt)
    keys = hasher.extend(body)
    if a is not HashAlgo.VLLM_SHA256_CBOR:
        tail = hasher.partial_key()
        if tail is not None:
            keys = [*keys, tail]
    return [event_hash(a, k) for k in keys]
