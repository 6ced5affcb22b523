"""A request's block keys per hashing group, as the router's index keys them."""

from __future__ import annotations

from array import array
from typing import Final, cast

from kvpool.hashing import BlockHasher, HashAlgo, cache_salt_id, request_block_hashes
from kvpool.router.index import token_chain_keys, token_chain_root

__all__ = ["request_keys"]

_SCHEME_ALGO: Final = {
    "v1": HashAlgo.V1_BLOCK_KEY,
    "v2": HashAlgo.V2_SHA256,
    "vllm": HashAlgo.VLLM_SHA256_CBOR,
}


def request_keys(
    scheme: str, tokens_per_block: int, tokens: array[int], cache_salt: str | None
) -> list[int]:
    """The normalized block keys of a request (``tokens`` already validated u32) for one
    hashing group: what :func:`kvpool.router.index.normalize_hash` makes of the hashes the
    group's workers publish for the same blocks. Blocks cover the prompt minus its last token,
    a trailing partial block included for TensorRT-LLM's algorithms (``v1``, ``v2``) and the
    token chain, full blocks only for vLLM's (COMPATIBILITY §1.5)."""
    if scheme == "v2":  # the whole chain in one call, no hasher object
        return cast(list[int], request_block_hashes(
            tokens, tokens_per_block, HashAlgo.V2_SHA256_64, cache_salt=cache_salt
        ))
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
