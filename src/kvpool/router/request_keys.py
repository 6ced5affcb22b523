"""A request's block keys per hashing group, as the router's index keys them.

``v2`` keys (TensorRT-LLM V2's sha256 chain) are computed here from the request's u32 bytes,
the tokens validated once by the router (not again by
:func:`~kvpool.hashing.keys.request_block_hashes`),
with a bounded memo of known chains (:class:`ChainMemo`): prompts share prefixes (system
prompts, the earlier turns of a conversation), and the blocks a request shares with the last
chain that began with its first block take a byte comparison instead of a sha256 each.
"""

from __future__ import annotations

from array import array
from functools import lru_cache
from typing import Final

from kvpool.hashing.keys import BlockHasher, HashAlgo, cache_salt_id
from kvpool.hashing.v2 import le_bytes, v2_chain, v2_heads, v2_root_key
from kvpool.router.index import token_chain_keys, token_chain_root

__all__ = [
    "DEFAULT_MEMO_BLOCKS", "DEFAULT_MEMO_BYTES", "DEFAULT_MEMO_CHAINS", "ChainMemo",
    "request_keys", "v2_request_keys",
]

_SCHEME_ALGO: Final = {
    "v1": HashAlgo.V1_BLOCK_KEY,
    "v2": HashAlgo.V2_SHA256,
    "vllm": HashAlgo.VLLM_SHA256_CBOR,
}

DEFAULT_MEMO_CHAINS: Final = 128
"""Chains a :class:`ChainMemo` generation holds (two generations)."""
DEFAULT_MEMO_BLOCKS: Final = 256
"""Blocks a :class:`ChainMemo` keeps of a chain ..."""
DEFAULT_MEMO_BYTES: Final = 16384
"""... and token bytes (4,096 tokens): a chain costs at most about 41 KB (256 blocks of 16
tokens: 16 KiB of tokens, 256 digests), a memo about 10 MB."""

_Chain = tuple[bytes, list[bytes], list[int]]  # token bytes, digests, keys


class ChainMemo:
    """Known v2 chains by their first block: ``(block bytes, root + first block's bytes) ->
    (the chain's token bytes, digests, keys)``, the chain of the last request that began with
    that block (its first ``min(blocks, bytes // block bytes)`` blocks). Two generations:
    chains are stored in the young one; when it holds ``chains`` it becomes the old one (the
    previous old one is dropped), so a first block used at least once a generation stays.

    A request's blocks equal to the stored chain's (a binary search of byte comparisons over
    whole-block prefixes) take their digests and keys from it; the rest are hashed and the
    request's chain replaces the stored one. The keys are the stored chain's int objects, so
    requests sharing a prefix share them: the predictions hold one object per key, not one per
    request (30 MB less at the service bench's ~20,000 live requests), and the router's dicts
    find them by identity. Per-step memos (parent digest + block -> digest) measured
    slower: a dict lookup of a 96-byte key per known block, and every new step an insertion.
    """

    def __init__(
        self, chains: int = DEFAULT_MEMO_CHAINS, blocks: int = DEFAULT_MEMO_BLOCKS,
        max_bytes: int = DEFAULT_MEMO_BYTES,
    ) -> None:
        if chains < 1 or blocks < 1 or max_bytes < 1:
            raise ValueError(
                f"chains, blocks and max_bytes must be >= 1, got {chains}, {blocks}, {max_bytes}"
            )
        self.chains = chains
        self.blocks = blocks
        self.max_bytes = max_bytes
        self.young: dict[tuple[int, bytes], _Chain] = {}
        self.old: dict[tuple[int, bytes], _Chain] = {}

    def __len__(self) -> int:
        """Chains held (a first block in both generations counts twice)."""
        return len(self.young) + len(self.old)

    def known(
        self, first: tuple[int, bytes], raw: bytes, n_blocks: int
    ) -> tuple[list[bytes], list[int]]:
        """The digests and keys of the longest prefix of whole blocks (at most ``n_blocks``)
        that ``raw`` shares with the chain stored for ``first`` (new lists)."""
        chain = self.young.get(first) or self.old.get(first)
        if chain is None:
            return [], []
        step = first[0]
        kraw, kdig, kkeys = chain
        hi = min(n_blocks, len(kdig))
        if raw[:hi * step] == kraw[:hi * step]:
            return kdig[:hi], kkeys[:hi]
        lo = 0  # lo blocks are equal, hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if raw[:mid * step] == kraw[:mid * step]:
                lo = mid
            else:
                hi = mid
        return kdig[:lo], kkeys[:lo]

    def store(
        self, first: tuple[int, bytes], raw: bytes, digests: list[bytes], keys: list[int]
    ) -> None:
        """``raw``'s chain (``digests`` and their ``keys``, copied) is the one known for
        ``first`` now."""
        step = first[0]
        n = min(self.blocks, max(self.max_bytes // step, 1))
        young = self.young
        young[first] = (raw[:n * step], digests[:n], keys[:n])
        if len(young) >= self.chains:
            self.old = young
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
    each block's digest, as :func:`kvpool.hashing.keys.request_block_hashes` with
    ``v2_sha256_64`` gives them. With a ``memo``, only the blocks past the prefix shared with
    the known chain of the request's first block are hashed."""
    raw = le_bytes(tokens)[:-4]  # the prompt minus its last token
    if not raw:
        return []
    parent = _root(cache_salt_id(cache_salt) if cache_salt is not None else None)
    step = 4 * tokens_per_block
    if memo is None:
        return v2_heads(v2_chain(raw, step, parent))
    first = (step, parent + raw[:step])
    digests, keys = memo.known(first, raw, -(-len(raw) // step))
    n = len(digests)
    new = v2_chain(raw[n * step:] if n else raw, step, digests[-1] if n else parent)
    digests += new
    keys += v2_heads(new)
    memo.store(first, raw, digests, keys)
    return keys


@lru_cache(maxsize=64)
def _root(salt_id: int | None) -> bytes:
    return v2_root_key(salt_id=salt_id)
