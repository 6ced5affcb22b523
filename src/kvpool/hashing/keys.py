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

This module holds what the algorithms share: their names, the reuse scope (LoRA id, cache
salt), the projection to event hashes, the incremental :class:`BlockHasher` and the router's
:func:`request_block_hashes`. The algorithms themselves live in :mod:`kvpool.hashing.v1`,
:mod:`kvpool.hashing.v2` and :mod:`kvpool.hashing.vllm`, input validation in
:mod:`kvpool.hashing.inputs`; their public functions are re-exported here.

Token ids must be ints in [0, 2**31) (``bool`` counts as an int, as everywhere in Python);
anything else raises :class:`InvalidTokenError` naming the first bad token. Every public entry
point validates its input before computing or changing anything.

Speed: hashing is on the admission path of the manager and on every request of the router, so
the chained loops are written for CPython: one bulk validation and conversion per call, then a
tight per-block loop. What does not depend on the chain is computed for the whole call with
numpy: the seed-independent part of the v1 mixing, and the CBOR encodings of vLLM's token ids.
The v1 chain itself runs compiled by :mod:`kvpool.hashing.jit` when the ``jit`` extra (numba) is
installed. ``benchmarks/bench_hashing.py`` measures them.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from enum import StrEnum
from typing import cast

import numpy as np

from kvpool.errors import InvalidArgumentError, UnknownHashAlgorithmError
from kvpool.hashing.inputs import (
    M64,
    MAX_TOKEN_ID,
    check_digest,
    check_salt,
    check_tpb,
    check_u64_or_none,
    tokens_to_u32,
    validate_tokens,
)
from kvpool.hashing.v1 import v1_block_key, v1_block_keys, v1_keys
from kvpool.hashing.v2 import le_bytes, v2_block_key, v2_chain, v2_heads, v2_root_key
from kvpool.hashing.vllm import (
    VLLM_NONE_HASH,
    vllm_chain,
    vllm_event_int,
    vllm_none_hash,
    vllm_sha256_cbor_block_hash,
    vllm_tails,
)
from kvpool.validation import check_u64

__all__ = [
    "M64",
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


def cache_salt_id(cache_salt: str) -> int:
    """The salt id shared by engine and router: first 8 bytes of sha256(salt), little-endian."""
    if not isinstance(cache_salt, str):
        raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")
    return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8")).digest()[:8], "little")


# projections and the incremental hasher


def event_hash(algo: HashAlgo | str, key: BlockKey) -> int | str:
    """The value an event carries for a block whose tree key is ``key``."""
    if not isinstance(algo, HashAlgo):
        algo = hash_algo(algo)
    if algo is HashAlgo.V1_BLOCK_KEY:
        return check_u64("a v1_block_key key", key)
    digest = check_digest(f"a {algo.value} key", key)
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
        self.tpb = check_tpb(tokens_per_block)
        check_u64_or_none("lora_id", lora_id)
        check_salt(cache_salt)
        self._lora = lora_id
        self._salt = cache_salt_id(cache_salt) if cache_salt is not None else None
        self._tail_first, self._tail_rest = (
            vllm_tails(lora_id, cache_salt)
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

    def keys_after(self, parent_keys: Sequence[BlockKey], raw: bytes) -> list[BlockKey]:
        """Keys of the whole blocks whose tokens are ``raw`` (native u32 bytes of validated
        token ids: a sequence's own), chained after ``parent_keys`` (the scope's keys so far):
        what ``resumed(parent_keys).extend(tokens)`` returns, without a hasher object or a
        copy of the tokens per call (a manager's commit)."""
        step = 4 * self.tpb
        if len(raw) % step:
            raise InvalidArgumentError(
                f"keys_after takes whole blocks of {step} bytes, got {len(raw)} bytes"
            )
        if not raw:
            return []
        if parent_keys:
            parent = parent_keys[-1]
        else:
            parent = self._parent if not self.keys else self._root_of_scope()
        if self.algo is not HashAlgo.V1_BLOCK_KEY and self.algo is not \
                HashAlgo.VLLM_SHA256_CBOR and sys.byteorder == "little":
            assert isinstance(parent, bytes)
            return cast(list[BlockKey], v2_chain(raw, step, parent))  # raw is little-endian
        toks = array("I")
        toks.frombytes(raw)
        return self._chain_from(parent, not parent_keys, toks, len(toks), full=True)

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
            return VLLM_NONE_HASH
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
        return self._chain_from(self._parent, not self.keys, data, stop, full=full)

    def _chain_from(self, parent: BlockKey, first: bool, data: array[int], stop: int, *,
                    full: bool) -> list[BlockKey]:
        """:meth:`_chain` after ``parent`` (``first``: the scope's first block comes next)."""
        algo = self.algo
        keys: list[BlockKey]
        if algo is HashAlgo.V1_BLOCK_KEY:
            assert isinstance(parent, int)
            toks = data[:stop] if stop < len(data) else data
            keys = cast(list[BlockKey], v1_keys(toks, self.tpb, parent, self._salt, self._lora))
        elif algo is HashAlgo.VLLM_SHA256_CBOR:
            assert isinstance(parent, bytes)
            toks = data[:stop] if stop < len(data) else data
            tpb = self.tpb if full else stop
            tail = self._tail_first if first else self._tail_rest
            keys = cast(list[BlockKey], vllm_chain(toks, tpb, parent, tail, self._tail_rest))
        else:
            assert isinstance(parent, bytes)
            raw = le_bytes(data[:stop] if stop < len(data) else data)
            keys = cast(list[BlockKey], v2_chain(raw, 4 * self.tpb, parent))
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
    tpb = check_tpb(tokens_per_block)
    check_u64_or_none("lora_id", lora_id)
    check_salt(cache_salt)
    body = tokens_to_u32(tokens)  # a fresh array: dropping the last token copies nothing
    if body:
        del body[-1]
    salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
    if a is HashAlgo.V1_BLOCK_KEY:
        return cast(list[int | str], v1_keys(body, tpb, 0, salt_id, lora_id))
    if a is HashAlgo.VLLM_SHA256_CBOR:
        first, rest = vllm_tails(lora_id, cache_salt)
        digests = vllm_chain(body, tpb, VLLM_NONE_HASH, first, rest)
        return [int.from_bytes(d[-8:], "big") for d in digests]
    digests = v2_chain(le_bytes(body), 4 * tpb, v2_root_key(lora_id=lora_id, salt_id=salt_id))
    if a is HashAlgo.V2_SHA256:
        return [d.hex() for d in digests]
    return cast(list[int | str], v2_heads(digests))
