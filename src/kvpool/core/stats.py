"""Counters: per-request admission stats, manager totals and per-iteration deltas."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class RequestStats:
    """What one admission did, summed over self-attention layer groups (in blocks).

    ``alloc_total`` = blocks in the request's tables; ``alloc_new`` = slots newly taken from
    the GPU pool (fresh blocks, partial copies and onboarded blocks); ``reused`` = full +
    partial reuse; ``missed`` = context blocks computed from scratch.
    """

    alloc_total: int = 0
    alloc_new: int = 0
    reused: int = 0
    full_reused: int = 0
    partial_reused: int = 0
    missed: int = 0
    onboarded: int = 0

    @property
    def hit_rate(self) -> float:
        denom = self.reused + self.missed
        return self.reused / denom if denom else 0.0


@dataclass(slots=True)
class CacheStats:
    """Totals since creation (``stats()``) or since the last ``iteration_stats()`` call."""

    alloc_total: int = 0
    alloc_new: int = 0
    reused: int = 0
    full_reused: int = 0
    partial_reused: int = 0
    missed: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    dropped_blocks: int = 0
    evicted_blocks: int = 0
    admitted_requests: int = 0
    # the shared remote tier (kvpool.tiers.remote): blocks handed to it, brought back by
    # prefetch, and its failures (the manager carried on locally)
    remote_offload_blocks: int = 0
    remote_prefetch_blocks: int = 0
    remote_errors: int = 0
    tier_hits: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def hit_rate(self) -> float:
        """Block hit rate: reused / (reused + missed)."""
        denom = self.reused + self.missed
        return self.reused / denom if denom else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # The counting doors: the other modules count through these methods (tests/test_doors.py).

    def add_request(self, r: RequestStats) -> None:
        self.alloc_total += r.alloc_total
        self.alloc_new += r.alloc_new
        self.reused += r.reused
        self.full_reused += r.full_reused
        self.partial_reused += r.partial_reused
        self.missed += r.missed

    def admitted(self, r: RequestStats, reused_tokens: int, prompt_tokens: int) -> None:
        """One request admitted: its block counts, reused and prompt tokens, onboards."""
        self.add_request(r)
        self.reused_tokens += reused_tokens
        self.prompt_tokens += prompt_tokens
        self.admitted_requests += 1
        self.onboard_blocks += r.onboarded

    def tier_hit(self, t: int, blocks: int) -> None:
        """``blocks`` reused blocks were found on tier t."""
        self.tier_hits[t] += blocks

    def evicted(self, blocks: int, dropped: int) -> None:
        """``blocks`` blocks left their slots, ``dropped`` of them left the cache."""
        self.evicted_blocks += blocks
        self.dropped_blocks += dropped

    def offloaded(self, blocks: int, nbytes: int) -> None:
        """``blocks`` blocks (``nbytes`` bytes) moved to a colder tier."""
        self.offload_blocks += blocks
        self.offload_bytes += nbytes

    def onboarded(self, blocks: int, nbytes: int) -> None:
        """``blocks`` blocks (``nbytes`` bytes) came up to the GPU (``blocks`` 0: counted
        with their request, :meth:`admitted`)."""
        self.onboard_blocks += blocks
        self.onboard_bytes += nbytes

    def remote(self, prefetched: int = 0, errors: int = 0) -> None:
        """The shared remote tier: blocks brought back from it, failures."""
        self.remote_prefetch_blocks += prefetched
        self.remote_errors += errors

    def remote_offloaded(self, total: int) -> None:
        """The shared remote tier took ``total`` blocks so far."""
        self.remote_offload_blocks = total

    def copy(self) -> CacheStats:
        out = CacheStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.tier_hits = list(self.tier_hits)
        return out

    def minus(self, other: CacheStats) -> CacheStats:
        out = CacheStats(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in fields(self)
                if f.name != "tier_hits"
            }
        )
        out.tier_hits = [a - b for a, b in zip(self.tier_hits, other.tier_hits, strict=True)]
        return out

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        d["token_hit_rate"] = self.token_hit_rate
        return d
