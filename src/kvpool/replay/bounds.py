"""Offline bounds on the prefix-cache hit rate of a workload.

A workload becomes a :class:`BlockStream`: for every request in arrival order, the keys of the
full blocks of its prompt minus its last token (ARCHITECTURE §3.1: the last prompt token's KV
is computed with the first output token, so it is never reused). Keys chain, so equal keys mean
equal token prefixes. The *accesses* are every key of every request in that order.

* :func:`unlimited_hit_rate` — an infinite cache: every access to a key seen before hits.
* :func:`belady_hit_rate` — Belady's optimal offline replacement (OPT/MIN) for a cache of
  ``capacity`` blocks, with each block treated independently (no prefix constraint: a block
  may hit although its parent missed). It is therefore an upper bound on the block hits of any
  cache of that many blocks, online or offline, prefix-constrained or not, on the same access
  order. With ``bypass=False`` (default) every missed block is admitted (evicting the cached
  block whose next use is farthest, never-again first); this is the exact optimum for caches
  that store every block they compute — which KV caches do. With ``bypass=True`` a missed
  block whose next use is later than that of every cached block is not admitted; this is the
  optimum when admission may be refused, so it is >= the default, and bounds both kinds.

Hit tokens are hit blocks x tokens_per_block; the token hit rate divides them by the total
prompt tokens (the fraction of prefill a cache could skip). Neither bound models that blocks
of running requests cannot be evicted, nor partial-block reuse.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvpool.errors import InvalidArgumentError
from kvpool.replay.workloads import Workload
from kvpool.validation import check_int

__all__ = [
    "BlockStream",
    "HitRateBound",
    "belady_hit_rate",
    "request_block_keys",
    "unlimited_hit_rate",
]


@dataclass(frozen=True, slots=True, eq=False)
class BlockStream:
    """The block keys of a workload's requests, flattened in arrival order.

    Request ``i`` owns ``keys[offsets[i]:offsets[i+1]]`` and has ``prompt_tokens[i]`` prompt
    tokens. ``keys`` are 64-bit ints; only their equality matters.
    """

    keys: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.int64]
    prompt_tokens: npt.NDArray[np.int64]
    tokens_per_block: int

    @classmethod
    def from_requests(
        cls,
        request_keys: Sequence[Sequence[int]],
        tokens_per_block: int = 1,
        prompt_tokens: Sequence[int] | None = None,
    ) -> BlockStream:
        """Build a stream from per-request key lists (ints in [0, 2**64)).

        ``prompt_tokens`` defaults to each request's blocks x ``tokens_per_block`` (then the
        token hit rate equals the block hit rate).
        """
        check_int("tokens_per_block", tokens_per_block, 1)
        lengths = [len(k) for k in request_keys]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        try:
            flat = [int(k) for keys in request_keys for k in keys]
            keys_arr = np.array(flat, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError):
            raise InvalidArgumentError(
                "block keys must be ints in [0, 2**64)"
            ) from None
        if prompt_tokens is None:
            prompts = np.array(lengths, dtype=np.int64) * tokens_per_block
        else:
            if len(prompt_tokens) != len(lengths):
                raise InvalidArgumentError(
                    f"prompt_tokens has {len(prompt_tokens)} entries for {len(lengths)} requests"
                )
            prompts = np.array(prompt_tokens, dtype=np.int64)
            short = np.nonzero(prompts < np.array(lengths, dtype=np.int64) * tokens_per_block)[0]
            if short.size:
                i = int(short[0])
                raise InvalidArgumentError(
                    f"request {i} has {lengths[i]} blocks of {tokens_per_block} tokens but only "
                    f"{int(prompts[i])} prompt tokens"
                )
        return cls(keys_arr, offsets, prompts, tokens_per_block)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def accesses(self) -> int:
        """Block accesses: the number of keys over all requests."""
        return int(self.keys.size)

    def request(self, i: int) -> list[int]:
        """The keys of request ``i``."""
        out: list[int] = self.keys[self.offsets[i] : self.offsets[i + 1]].tolist()
        return out


@dataclass(frozen=True, slots=True)
class HitRateBound:
    """Hits of a bound over a stream.

    ``hits`` <= ``accesses`` count blocks; ``hit_tokens = hits * tokens_per_block`` <=
    ``prompt_tokens``. ``capacity_blocks`` is None for the unlimited bound.
    """

    policy: str
    capacity_blocks: int | None
    hits: int
    accesses: int
    hit_tokens: int
    prompt_tokens: int

    @property
    def block_hit_rate(self) -> float:
        """hits / accesses (0 when there are no accesses)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def token_hit_rate(self) -> float:
        """hit_tokens / prompt_tokens (0 when there are no prompt tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-able summary, rates included."""
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "hits": self.hits,
            "accesses": self.accesses,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
        }


def request_block_keys(workload: Workload, tokens_per_block: int) -> BlockStream:
    """The block stream of ``workload`` at ``tokens_per_block``.

    Request ``r`` contributes ``(len(r.tokens) - 1) // tokens_per_block`` keys, the full blocks
    of its prompt minus its last token. Key ``i`` is xxh3-64 of block ``i``'s tokens
    (little-endian u32) seeded with key ``i-1``; the first block is seeded with 0, or with a
    digest of the request's ``cache_salt``, so salted requests never share keys with others.
    These keys are kvpool-internal (not an event hash algorithm): they are fast, and equality
    is all a bound needs.
    """
    check_int("tokens_per_block", tokens_per_block, 1)
    step = 4 * tokens_per_block
    digest = xxhash.xxh3_64_intdigest
    flat: list[int] = []
    lengths: list[int] = []
    prompts: list[int] = []
    for req in workload.requests:
        n = (len(req.tokens) - 1) // tokens_per_block
        raw = memoryview(req.tokens).cast("B")
        key = 0 if req.cache_salt is None else digest(
            b"kvpool-salt\x00" + req.cache_salt.encode("utf-8")
        )
        for off in range(0, n * step, step):
            key = digest(raw[off : off + step], key)
            flat.append(key)
        lengths.append(n)
        prompts.append(len(req.tokens))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return BlockStream(
        np.array(flat, dtype=np.uint64),
        offsets,
        np.array(prompts, dtype=np.int64),
        tokens_per_block,
    )


def _as_stream(stream: BlockStream | Sequence[Sequence[int]]) -> BlockStream:
    return stream if isinstance(stream, BlockStream) else BlockStream.from_requests(stream)


def _bound(
    s: BlockStream, policy: str, capacity: int | None, hits: int
) -> HitRateBound:
    return HitRateBound(
        policy=policy,
        capacity_blocks=capacity,
        hits=hits,
        accesses=s.accesses,
        hit_tokens=hits * s.tokens_per_block,
        prompt_tokens=int(s.prompt_tokens.sum()),
    )


def unlimited_hit_rate(stream: BlockStream | Sequence[Sequence[int]]) -> HitRateBound:
    """Hits of an infinite cache: every access but the first of each key.

    A plain sequence of per-request key lists is read as a stream with one token per block.
    """
    s = _as_stream(stream)
    distinct = int(np.unique(s.keys).size)
    return _bound(s, "unlimited", None, s.accesses - distinct)


def _next_uses(keys: npt.NDArray[np.uint64]) -> tuple[list[int], list[int]]:
    """Dense block ids per access, and each access's next-use code.

    The code of access ``i`` is the index of the next access to the same block, or
    ``n + block`` when there is none (so "never again" sorts after every real index, and
    codes stay unique, which the lazy heap below relies on).
    """
    n = int(keys.size)
    _, inverse = np.unique(keys, return_inverse=True)
    ids = inverse.astype(np.int64).reshape(-1)
    order = np.argsort(ids, kind="stable")
    nxt = ids + n
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    ids_list: list[int] = ids.tolist()
    nxt_list: list[int] = nxt.tolist()
    return ids_list, nxt_list


def belady_hit_rate(
    stream: BlockStream | Sequence[Sequence[int]], capacity: int, *, bypass: bool = False
) -> HitRateBound:
    """Hits of Belady's optimal replacement with ``capacity`` blocks (see the module doc).

    On a hit the block stays; on a miss with a free slot it is admitted; on a miss with a full
    cache the cached block used farthest in the future (never again first) is evicted for it,
    unless ``bypass`` is set and the new block itself is used later than every cached block,
    in which case it is not admitted. O(accesses x log accesses).
    """
    check_int("capacity", capacity, 0)
    s = _as_stream(stream)
    n = s.accesses
    policy = "belady_bypass" if bypass else "belady"
    if n == 0 or capacity == 0:
        return _bound(s, policy, capacity, 0)
    ids, nxt = _next_uses(s.keys)
    # cache: block -> code of its next use. heap: negated codes, max next use on top; entries
    # go stale when a block is hit again (new code) or evicted, and are skipped when popped.
    cache: dict[int, int] = {}
    heap: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for i in range(n):
        x = ids[i]
        code = nxt[i]
        if x in cache:
            hits += 1
        elif len(cache) >= capacity:
            while True:
                top = -heap[0]
                victim = ids[top] if top < n else top - n
                if cache.get(victim) == top:
                    break
                pop(heap)
            if bypass and code > top:
                continue
            pop(heap)
            del cache[victim]
        cache[x] = code
        push(heap, -code)
    return _bound(s, policy, capacity, hits)
