"""A request's block keys per hashing group, as the router's index keys them.

``v2`` keys (TensorRT-LLM V2's sha256 chain) are computed here from the request's u32 bytes,
the tokens validated once by the router (not again by :func:`kvpool.hashing.request_block_hashes`),
with a bounded memo of chain steps (:class:`ChainMemo`): a block whose parent digest and tokens
were hashed before takes one dict lookup instead of a sha256. Prompts share prefixes (system
prompts, the earlier turns of a conversation), so most requests find their first blocks there;
the walk of a chain stops looking at its first unknown block (every later parent is new too).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable
from functools import lru_cache
from typing import Final

from kvpool.hash_v2 import le_bytes, v2_root_key
from kvpool.hashing import BlockHasher, HashAlgo, cache_salt_id
from kvpool.router.index import token_chain_keys, token_chain_root

__all__ = [
    "DEFAULT_LEARN_STEPS", "DEFAULT_MEMO_STEPS", "ChainMemo", "request_keys", "v2_request_keys",
]

_SCHEME_ALGO: Final = {
    "v1": HashAlgo.V1_BLOCK_KEY,
    "v2": HashAlgo.V2_SHA256,
    "vllm": HashAlgo.VLLM_SHA256_CBOR,
}

DEFAULT_MEMO_STEPS: Final = 16384
"""Chain steps a :class:`ChainMemo` generation holds (two generations: about twice this, some
250 bytes a step)."""

DEFAULT_LEARN_STEPS: Final = 8
"""New chain steps a request adds to a :class:`ChainMemo` (after its known prefix)."""

# A fresh sha256 object by copying an empty one skips OpenSSL's per-call algorithm lookup.
_SHA256_NEW: Final = hashlib.sha256().copy


class ChainMemo:
    """Known v2 chain steps, ``parent digest + block bytes -> digest``, in two generations:
    new steps and steps found in the old generation go to the young one; when the young one
    holds ``steps`` it becomes the old one (the previous old one is dropped). Steps used at
    least once per generation stay; the memory is bounded by about ``2 * steps`` entries.

    A request remembers at most ``learn`` new steps, those right after its known prefix: a
    prefix many requests share (a system prompt) is learned in a few of them, while the
    unshared rest of each prompt (most of the steps a router sees) neither costs an insertion
    per block nor pushes the shared steps out (measured: remembering every step cost as much
    as the sha256 calls the memo saves)."""

    def __init__(self, steps: int = DEFAULT_MEMO_STEPS, learn: int = DEFAULT_LEARN_STEPS) -> None:
        if steps < 1 or learn < 0:
            raise ValueError(f"steps must be >= 1 and learn >= 0, got {steps} and {learn}")
        self.steps = steps
        self.learn = learn
        self.young: dict[bytes, bytes] = {}
        self.old: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def _rotate(self) -> None:
        if len(self.young) >= self.steps:
            self.old = self.young
            self.young = {}


def request_keys(
    scheme: str, tokens_per_block: int, tokens: array[int], cache_salt: str | None,
    memo: ChainMemo | None = None,
) -> list[int]:
    """The normalized block keys of a request (``tokens`` already validated u32) for one
    hashing group: what :func:`kvpool.router.index.normalize_hash` makes of the hashes the
    group's workers publish for the same blocks. Blocks cover the prompt minus its last token,
    a trailing partial block included for TensorRT-LLM's algorithms (``v1``, ``v2``) and the
    token chain, full blocks only for vLLM's (COMPATIBILITY §1.5). ``memo``: known ``v2``
    chain steps (the result is the same with or without)."""
    if scheme == "v2":
        return v2_request_keys(tokens, tokens_per_block, cache_salt, memo)
    body = tokens[: max(len(tokens) - 1, 0)]
    if scheme == "tokens":
        salt = cache_salt_id(cache_salt) if cache_salt is not None else None
        return token_chain_keys(body, tokens_per_block, token_chain_root(None, salt))
    algo = _SCHEME_ALGO[scheme]
    hasher = BlockHasher(algo, tokens_per_block, cache_salt=cache_salt)
    keys = hasher.extend(body)
    if scheme == "v1":
        tail = hasher.partial_key()
        out: list[int] = [k for k in keys if isinstance(k, int)]
        if isinstance(tail, int):
            out.append(tail)
        return out
    return [int.from_bytes(k[-8:], "big") for k in keys if isinstance(k, bytes)]


def v2_request_keys(
    tokens: array[int], tokens_per_block: int, cache_salt: str | None,
    memo: ChainMemo | None = None,
) -> list[int]:
    """``v2`` keys of a request (validated u32 ``tokens``): the first 8 bytes (big-endian) of
    each block's digest, as :func:`kvpool.hashing.request_block_hashes` with
    ``v2_sha256_64`` gives them."""
    raw = le_bytes(tokens)[:-4]  # the prompt minus its last token
    if not raw:
        return []
    parent = _root(cache_salt_id(cache_salt) if cache_salt is not None else None)
    step = 4 * tokens_per_block
    n_full = len(raw) // step
    # the whole blocks cut in one C call, then the trailing partial block (if any)
    chunks = list(_blocks(step, n_full)(raw[: n_full * step]))
    if len(raw) > n_full * step:
        chunks.append(raw[n_full * step:])
    digests: list[bytes] = []
    append = digests.append
    i = 0
    if memo is not None:
        young = memo.young
        young_get, old_get = young.get, memo.old.get
        for chunk in chunks:  # known steps
            k = parent + chunk
            d = young_get(k)
            if d is None:
                d = old_get(k)
                if d is None:
                    break
                young[k] = d
            append(d)
            parent = d
            i += 1
        learn = min(len(chunks), i + memo.learn)
        for chunk in chunks[i:learn]:  # the first new steps, remembered
            k = parent + chunk
            h = _SHA256_NEW()
            h.update(k)
            parent = young[k] = h.digest()
            append(parent)
        i = learn
        memo._rotate()
    new = _SHA256_NEW
    for chunk in chunks[i:] if i else chunks:
        h = new()
        h.update(parent + chunk)
        parent = h.digest()
        append(parent)
    return list(_digest_heads(len(digests))(b"".join(digests)))


@lru_cache(maxsize=64)
def _root(salt_id: int | None) -> bytes:
    return v2_root_key(salt_id=salt_id)


@lru_cache(maxsize=256)
def _blocks(step: int, n: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Cuts ``n * step`` bytes into ``n`` blocks in one C call."""
    return struct.Struct(f"{step}s" * n).unpack


@lru_cache(maxsize=256)
def _digest_heads(n: int) -> Callable[[bytes], tuple[int, ...]]:
    """Reads the first 8 bytes (big-endian) of each of ``n`` joined sha256 digests, in one C
    call."""
    return struct.Struct(">" + "Q24x" * n).unpack
