"""What the router answers and counts: the route modes, each candidate's score, the decision
and the router's counters (:class:`~kvpool.router.scoring.Router`)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import msgspec

from kvpool.router.index import TIERS

__all__ = [
    "LATENCY_BUCKETS_S",
    "CandidateScore",
    "RouteDecision",
    "RouteMode",
    "RouterStats",
]

LATENCY_BUCKETS_S: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)
"""Upper bounds of the decision-latency histogram (seconds); a last bucket catches the rest."""


class RouteMode(StrEnum):
    COST = "cost"
    TRTLLM = "trtllm"
    APPROX = "approx"


class CandidateScore(msgspec.Struct, frozen=True):
    """How one worker scored for one request."""

    worker_id: str
    score: float
    matched_blocks: tuple[int, ...]
    """Consecutive matched blocks per tier (GPU, host, disk); each at its hottest tier."""
    matched_tokens: int
    total_blocks: int
    active_requests: int
    pending_prefill_tokens: int
    saturated: bool
    shared_blocks: int = 0
    """Of the consecutive matched blocks, those found only in a shared remote tier the worker
    is configured with (:mod:`kvpool.router.shared_tier`); not in ``matched_blocks``."""


class RouteDecision(msgspec.Struct, frozen=True):
    """The router's answer: where to send the request, and why (every candidate's score)."""

    worker_id: str
    request_id: str
    mode: str
    score: float
    matched_blocks: tuple[int, ...]
    matched_tokens: int
    total_blocks: int
    prefill_tokens: int
    candidates: tuple[CandidateScore, ...]
    shared_blocks: int = 0
    """The chosen worker's matched blocks found only in its shared remote tier."""


@dataclass(slots=True)
class RouterStats:
    """Counters for ``/metrics``. ``latency_buckets[i]`` counts decisions that took at most
    ``LATENCY_BUCKETS_S[i]`` (not cumulative); the last entry counts the slower ones."""

    routes_total: int = 0
    hit_blocks: list[int] = field(default_factory=lambda: [0] * TIERS)
    shared_hit_blocks: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    finished_total: int = 0
    expired_total: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0

    def count_latency(self, elapsed: float) -> None:
        """One decision that took ``elapsed`` seconds."""
        self.latency_sum_s += elapsed
        self.latency_buckets[bisect_left(LATENCY_BUCKETS_S, elapsed)] += 1  # first bound >= it
