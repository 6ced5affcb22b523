"""What the manager needs from a free queue (one per (tier, layer group) pool)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.hashing.keys import BlockKey


class EvictionPolicy(Protocol):
    """A free queue: blocks pushed when evictable, claimed back, popped as victims.

    ``priority_of`` (introspection for tests) is on the policies themselves
    (:class:`~kvpool.eviction.queue.LevelQueue`), not part of what the manager relies on.
    """

    uses_keys: bool
    """Does the policy read the keys given to ``push``/``push_many`` (else they may be None)?"""

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        """``slot``, holding the block ``key``, became evictable (most recently released)."""

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        """Bulk ``push`` of distinct slots without expiry, in order (the last is the most
        recent). The manager lists one released block table tail first, so each block is an
        ancestor of the blocks listed before it; history-keeping policies rely on that."""

    def should_offload(self, slot: int) -> bool:
        """May the victim just popped from ``slot`` move to a colder tier (else it drops)?"""

    def remove(self, slot: int) -> None:
        """``slot`` is claimed again; it must be queued."""

    def remove_many(self, slots: Sequence[int]) -> None:
        """``remove`` of each of ``slots`` (distinct, all queued), in order."""

    def pop(self) -> tuple[int, int]:
        """Take the next victim: (slot, its expiry-adjusted priority). Must not be empty."""

    def pop_slots(self, n: int) -> list[int]:
        """The slots of the next ``n`` victims, as ``n`` calls of ``pop`` would give them
        (n <= len), without their priorities: a one-tier pool drops its victims whatever their
        priority. (The policies also offer ``pop_many``, the same victims with priorities; the
        manager does not use it.)"""

    def peek_order(self) -> list[int]:
        """Every queued slot in victim order (the manager's consistency check; O(n))."""

    def __len__(self) -> int: ...

    def __contains__(self, slot: object) -> bool: ...
