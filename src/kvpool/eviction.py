"""Free queues of evictable blocks: which cached, unreferenced slot to give up next.

One policy object serves one (tier, layer group) pool. The manager tells it when a cached
block becomes evictable (``push``), when it is claimed again (``remove``, O(1)), and asks it
for victims (``pop``). Retention priority always dominates: a victim is taken from the lowest
non-empty priority level; the policy orders blocks only within a level. A priority with a
duration falls back to the default (35) once that duration has passed since the push.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvpool.config import DEFAULT_PRIORITY
from kvpool.errors import InvalidArgumentError


class EvictionPolicy(Protocol):
    """What the manager needs from a free queue."""

    def push(self, slot: int, priority: int, expires_at: float | None = None) -> None:
        """``slot`` became evictable (most recently released)."""

    def push_many(self, slots: Iterable[int], priority: int) -> None:
        """Bulk ``push`` without expiry, in order (the last is the most recent)."""

    def remove(self, slot: int) -> None:
        """``slot`` is claimed again; it must be queued."""

    def pop(self) -> tuple[int, int]:
        """Take the next victim: (slot, its expiry-adjusted priority). Must not be empty."""

    def peek_order(self) -> list[int]:
        """Every queued slot in victim order (for tests and introspection; O(n))."""

    def priority_of(self, slot: int) -> int:
        """The current (expiry-adjusted) priority of a queued slot."""

    def __len__(self) -> int: ...

    def __contains__(self, slot: object) -> bool: ...


class PrioritizedLRU:
    """LRU within each retention priority level; lowest priority evicted first."""

    __slots__ = ("_buckets", "_clock", "_expiry", "_level", "_order")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._order: list[int] = []  # non-empty-or-once-used priority levels, ascending
        self._level: dict[int, int] = {}  # slot -> priority level it is queued at
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, slot, level) min-heap

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, slot: object) -> bool:
        return slot in self._level

    def _bucket(self, priority: int) -> OrderedDict[int, None]:
        b = self._buckets.get(priority)
        if b is None:
            b = self._buckets[priority] = OrderedDict()
            self._order.append(priority)
            self._order.sort()
        return b

    def push(self, slot: int, priority: int, expires_at: float | None = None) -> None:
        if slot in self._level:
            raise InvalidArgumentError(f"slot {slot} is already evictable")
        self._bucket(priority)[slot] = None
        self._level[slot] = priority
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            heapq.heappush(self._expiry, (expires_at, slot, priority))

    def push_many(self, slots: Iterable[int], priority: int) -> None:
        bucket = self._bucket(priority)
        level = self._level
        for slot in slots:
            bucket[slot] = None
            level[slot] = priority

    def remove(self, slot: int) -> None:
        del self._buckets[self._level.pop(slot)][slot]

    def _expire(self) -> None:
        heap = self._expiry
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            _, slot, level = heapq.heappop(heap)
            if self._level.get(slot) == level:
                del self._buckets[level][slot]
                self._bucket(DEFAULT_PRIORITY)[slot] = None
                self._level[slot] = DEFAULT_PRIORITY

    def pop(self) -> tuple[int, int]:
        self._expire()
        for p in self._order:
            bucket = self._buckets[p]
            if bucket:
                slot, _ = bucket.popitem(last=False)
                del self._level[slot]
                return slot, p
        raise IndexError("pop from an empty eviction queue")

    def peek_order(self) -> list[int]:
        self._expire()
        out: list[int] = []
        for p in self._order:
            out.extend(self._buckets[p])
        return out

    def priority_of(self, slot: int) -> int:
        self._expire()
        return self._level[slot]


POLICIES: dict[str, Callable[[Callable[[], float]], EvictionPolicy]] = {"lru": PrioritizedLRU}


def make_policy(name: str, clock: Callable[[], float]) -> EvictionPolicy:
    """Build the policy registered under ``name``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
    return factory(clock)
