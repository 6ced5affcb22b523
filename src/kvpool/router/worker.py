"""A worker's state in the router's index, and what the index says about workers.

:class:`WorkerState` holds everything the index keeps per worker: its hashing configuration,
its reference counts (compact: one layer group, counts above one only, presence in the
index's global masks; expanded: per layer group and tier dicts), its reorder ledger
(:mod:`kvpool.router.ledger`) and, for ``match_by_tokens`` workers, the engine hash -> token
key maps (:mod:`kvpool.router.token_keys`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from kvpool.hashing.keys import HashAlgo
from kvpool.router.ledger import EventStream, LedgerEntry
from kvpool.validation import check_int

TIERS: Final = 3
"""Tiers the index tracks: 0 = GPU, 1 = host, 2 = disk."""

GroupKey = tuple[str, int]
"""How a worker's blocks are hashed: (scheme, tokens_per_block). Workers of one group share
the request's hashes. Schemes: ``v1``, ``v2`` (both v2 algorithms: the same digest),
``vllm`` and ``tokens`` (the index's own chain, for ``match_by_tokens`` workers)."""

SCHEMES: Final = {
    HashAlgo.V1_BLOCK_KEY: "v1",
    HashAlgo.V2_SHA256: "v2",
    HashAlgo.V2_SHA256_64: "v2",
    HashAlgo.VLLM_SHA256_CBOR: "vllm",
}


def hash_scheme(algo: HashAlgo) -> str:
    """The hash space of an algorithm after normalization (both v2 encodings share one)."""
    return SCHEMES[algo]


class Malformed(Exception):
    """An event cannot be applied; nothing was changed."""


class Skipped(Exception):
    """An event is well formed but refers to something unknown; counted as an anomaly."""


@dataclass(slots=True)
class IndexCounters:
    """Event counters (monotonic). ``anomalies`` counts references taken from tiers that held
    none, removals of unknown hashes and stores under unknown parents (token matching)."""

    events_applied: int = 0
    events_malformed: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_moved: int = 0
    anomalies: int = 0
    resets: int = 0


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """A snapshot of one worker's place in the index (what ``GET /workers`` shows)."""

    worker_id: str
    hash_algo: str | None
    tokens_per_block: int | None
    match_by_tokens: bool
    healthy: bool
    blocks_per_tier: tuple[int, ...]
    capacity_per_tier: tuple[int, ...] | None
    layer_groups: tuple[int, ...]
    events_applied: int
    events_malformed: int
    anomalies: int
    resets: int
    last_event_id: int | None
    last_event_age_s: float | None


@dataclass(slots=True, eq=False)
class WorkerState:
    """One worker's place in the index: its configuration, block counts, reorder ledger and
    (``match_by_tokens``) engine hash -> token key maps."""

    worker_id: str
    slot: int
    algo: HashAlgo | None
    algo_configured: bool
    tpb: int | None
    tpb_configured: bool
    match_by_tokens: bool
    healthy: bool = True
    # Compact (one layer group, ``group`` once seen): a count is 1 + extras[tier].get(hash, 0)
    # where the worker's bit of (tier, hash) is set in KvIndex.masks, else 0; ``groups`` is
    # empty. Expanded (several layer groups): layer group -> per tier {hash: positive count}.
    compact: bool = True
    group: int | None = None
    extras: list[dict[int, int]] = field(default_factory=lambda: [{} for _ in range(TIERS)])
    groups: dict[int, list[dict[int, int]]] = field(default_factory=dict)
    # (layer group, tier, hash) -> steps still to be put in event-id order
    ledger: dict[tuple[int, int, int], LedgerEntry] = field(default_factory=dict)
    # attention-DP rank -> which event ids have been seen
    streams: dict[int | None, EventStream] = field(default_factory=dict)
    arrived_late: bool = False  # the event being applied came after one with a larger id
    # match_by_tokens: engine hash -> the index's chain key, for held blocks (``chain``) and
    # recently removed ones, in two generations: ``chain_recent`` takes removed mappings in
    # bulk until it holds MAX_LEDGER, then becomes ``chain_older`` (the older one is dropped
    # whole). The last MAX_LEDGER to 2 * MAX_LEDGER removed mappings are kept, with no
    # per-entry bookkeeping of their order.
    chain: dict[int, int] = field(default_factory=dict)
    chain_recent: dict[int, int] = field(default_factory=dict)
    chain_older: dict[int, int] = field(default_factory=dict)
    present: list[int] = field(default_factory=lambda: [0] * TIERS)
    capacity: dict[int, tuple[int, ...]] = field(default_factory=dict)
    created_seen: set[tuple[int, int | None]] = field(default_factory=set)
    counters: IndexCounters = field(default_factory=IndexCounters)
    last_event_id: int | None = None
    last_event_at: float | None = None


def info_of(w: WorkerState) -> WorkerInfo:
    """A snapshot of ``w`` (what ``GET /workers`` shows)."""
    cap: tuple[int, ...] | None = None
    if w.capacity:
        levels = max(len(c) for c in w.capacity.values())
        cap = tuple(
            sum(c[i] for c in w.capacity.values() if i < len(c)) for i in range(levels)
        )
    c = w.counters
    return WorkerInfo(
        worker_id=w.worker_id,
        hash_algo=w.algo.value if w.algo is not None else None,
        tokens_per_block=w.tpb,
        match_by_tokens=w.match_by_tokens,
        healthy=w.healthy,
        blocks_per_tier=tuple(w.present),
        capacity_per_tier=cap,
        layer_groups=(
            tuple(sorted(w.groups)) if not w.compact
            else () if w.group is None else (w.group,)
        ),
        events_applied=c.events_applied,
        events_malformed=c.events_malformed,
        anomalies=c.anomalies,
        resets=c.resets,
        last_event_id=w.last_event_id,
        last_event_age_s=(
            time.monotonic() - w.last_event_at if w.last_event_at is not None else None
        ),
    )


def none_left(w: WorkerState, group: int, level: int | None, levels: object) -> bool:
    """True when, before a removal of distinct keys on ``level`` (every tier when both it and
    ``levels`` are None), it is known that no removed block stays held anywhere: the worker is
    compact in ``group``, holds one reference per block, and nothing on another tier."""
    if not (w.compact and w.group == group) or any(w.extras):
        return False
    if level is None:
        return levels is None
    present = w.present
    return sum(present) == present[level]


def tier_bits(slot: int, stride: int) -> int:
    """A slot's presence bits on every tier."""
    return sum((1 << slot) << (t * stride) for t in range(TIERS))


def held_elsewhere(w: WorkerState, group: int, tier: int, h: int) -> bool:
    return any(g != group and h in tiers[tier] for g, tiers in w.groups.items())


def group_key(w: WorkerState) -> GroupKey | None:
    if w.tpb is None:
        return None
    if w.match_by_tokens:
        return ("tokens", w.tpb)
    if w.algo is None:
        return None
    return (SCHEMES[w.algo], w.tpb)


def check_tpb(tpb: int | None) -> None:
    if tpb is None:
        return
    check_int("tokens_per_block", tpb, 1)
