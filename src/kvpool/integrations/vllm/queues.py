"""The eviction queue both halves of the integration use: one of kvpool's policies over slot
numbers (disk slots of the tier, CPU chunk ids of vLLM's pool), keyed by offload key."""

from __future__ import annotations

import time

from kvpool.errors import ConfigError
from kvpool.eviction import POLICIES, PrioritizedLRU, SegmentedPolicy

__all__ = ["SlotQueue", "new_queue"]

SlotQueue = PrioritizedLRU | SegmentedPolicy


def new_queue(policy: str, capacity: int) -> SlotQueue:
    """kvpool's ``policy`` (``lru``, ``2q``, ``s3fifo``, ``arc``) for ``capacity`` slots."""
    factory = POLICIES.get(policy)
    if factory is None:
        raise ConfigError(f"unknown eviction policy {policy!r}; expected one of {list(POLICIES)}")
    return factory(time.monotonic, capacity=capacity)
