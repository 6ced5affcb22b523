"""SlotPool: the slots of one (tier, layer group) pool and what the manager knows about each.

A pool of ``size`` slots keeps

- ``free``: slots holding nothing, a stack (the lowest slot numbers are taken first);
- ``queue``: cached, unreferenced slots in eviction order (the pool's eviction policy);
- ``ref``: references per slot (GPU pools: one per block-table entry of a sequence; colder
  tiers keep zeros);
- ``run_at`` / ``idx_at``: the prefix-tree run and the index in it of the block a cached slot
  holds (the back-pointers eviction follows from a victim slot to its block);
- ``held``: colder-tier slots holding blocks of suspended sequences (never evicted).

A GPU slot is in exactly one of: free, queued (cached, ref 0), referenced (ref > 0). The bulk
operations here (:meth:`take`, :meth:`give`, :meth:`hold`, :meth:`release`, :meth:`place_all`)
are the ones the manager's hot paths use; each is one list operation or one comprehension,
whatever the number of slots (CPython costs: docs/architecture.md §3.10).

These methods are the pool's doors: no other module writes ``free``, ``queue``, ``ref``,
``run_at``, ``idx_at`` or ``held`` (``tests/test_doors.py`` scans for writes); they read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, Protocol, TypeVar, cast

from kvpool.core.radix import NO_SLOT, SlotId
from kvpool.hashing.keys import BlockKey

B = TypeVar("B")
"""What a cached slot points back to (the manager's tree run)."""


class Queue(Protocol):
    """The part of an eviction policy a pool uses (:class:`kvpool.eviction.EvictionPolicy`)."""

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None: ...

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None: ...

    def remove(self, slot: int) -> None: ...

    def remove_many(self, slots: Sequence[int]) -> None: ...

    def pop(self) -> tuple[int, int]: ...

    def pop_slots(self, n: int) -> list[int]: ...

    def __len__(self) -> int: ...

    def __contains__(self, slot: object) -> bool: ...


Q = TypeVar("Q", bound=Queue)


class SlotPool(Generic[B, Q]):
    """One (tier, layer group) pool (see the module docstring)."""

    __slots__ = ("free", "held", "idx_at", "queue", "ref", "run_at", "size")

    def __init__(self, size: int, queue: Q) -> None:
        self.size = size
        self.free = cast("list[SlotId]", list(range(size - 1, -1, -1)))
        self.queue = queue
        self.ref: list[int] = [0] * size
        self.run_at: list[B | None] = [None] * size
        self.idx_at: list[int] = [0] * size
        self.held: set[SlotId] = set()

    # ---------------------------------------------------------------- free list

    def take(self, n: int) -> list[SlotId]:
        """Up to ``n`` free slots, lowest numbers first (fewer when fewer are free)."""
        free = self.free
        if n <= 0:
            return []
        if n >= len(free):
            out = free[::-1]
            free.clear()
            return out
        out = free[-n:]
        del free[-n:]
        out.reverse()
        return out

    def take_free(self) -> SlotId:
        """The free slot on top of the stack (there must be one)."""
        return self.free.pop()

    def give(self, slots: Iterable[SlotId]) -> None:
        """Slots that hold nothing any more go back to the free list."""
        self.free.extend(slots)

    def give_one(self, slot: SlotId) -> None:
        """Slot ``slot`` holds nothing any more: back to the free list."""
        self.free.append(slot)

    def withdraw_free(self, slots: set[SlotId]) -> None:
        """Slots ``slots`` are no longer free (a restart found blocks in them)."""
        self.free[:] = [s for s in self.free if s not in slots]

    def available(self) -> int:
        """Free plus evictable slots."""
        return len(self.free) + len(self.queue)

    # ---------------------------------------------------------------- the eviction queue

    def pop_victim(self) -> tuple[SlotId, int]:
        """The policy's next victim and its priority, out of the queue."""
        return cast("tuple[SlotId, int]", self.queue.pop())

    def pop_victims(self, n: int) -> list[SlotId]:
        """The policy's next ``n`` victims, out of the queue."""
        return cast("list[SlotId]", self.queue.pop_slots(n))

    def enqueue(self, slot: SlotId, priority: int, expires_at: float | None = None,
                key: BlockKey | None = None) -> None:
        """A cached slot nobody references joins the queue."""
        self.queue.push(slot, priority, expires_at, key)

    def enqueue_many(self, slots: Sequence[SlotId], priority: int,
                     keys: Sequence[BlockKey] | None = None) -> None:
        """Cached slots nobody references join the queue, in order."""
        self.queue.push_many(slots, priority, keys)

    def dequeue(self, slot: SlotId) -> None:
        """Queued slot ``slot`` leaves the queue (claimed, or its block dropped)."""
        self.queue.remove(slot)

    def dequeue_many(self, slots: Sequence[SlotId]) -> None:
        """Queued slots ``slots`` leave the queue (claimed)."""
        self.queue.remove_many(slots)

    def dequeue_if_queued(self, slot: SlotId) -> None:
        """Slot ``slot`` leaves the queue if it is in it (a colder block claimed)."""
        queue = self.queue
        if slot in queue:
            queue.remove(slot)

    # ---------------------------------------------------------------- references

    def hold(self, slots: Sequence[SlotId], refs: int = 1) -> None:
        """Add ``refs`` references to each slot of ``slots`` (a slot listed twice gets both)."""
        ref = self.ref
        for s in slots:
            ref[s] += refs

    def hold_one(self, slot: SlotId, refs: int) -> None:
        """Add ``refs`` references to ``slot``."""
        self.ref[slot] += refs

    def claim(self, slot: SlotId, refs: int) -> None:
        """Add ``refs`` references to cached slot ``slot``, taking it out of the queue if
        nobody referenced it."""
        ref = self.ref
        if not ref[slot]:
            self.queue.remove(slot)
        ref[slot] += refs

    def set_refs(self, slot: SlotId, refs: int) -> None:
        """Slot ``slot`` (unreferenced) now has ``refs`` references."""
        self.ref[slot] = refs

    def drop_ref(self, slot: SlotId) -> int:
        """Take one reference off ``slot``; returns how many are left."""
        ref = self.ref
        left = ref[slot] - 1
        assert left >= 0
        ref[slot] = left
        return left

    def keep(self, slot: SlotId) -> None:
        """Colder slot ``slot`` holds a block of a suspended sequence (never evicted)."""
        self.held.add(slot)

    def unkeep(self, slot: SlotId) -> None:
        """Colder slot ``slot`` no longer holds a block of a suspended sequence."""
        self.held.discard(slot)

    def release(self, slots: Sequence[SlotId]) -> list[SlotId]:
        """Take one reference off each of ``slots`` (distinct; NO_SLOT entries skipped). The
        slots left without one that hold nothing go back to the free list; returns those that
        hold a cached block, last listed first (how a released block table enters the queue:
        tail first). One pass over the table."""
        ref, run_at = self.ref, self.run_at
        cached: list[SlotId] = []
        free = self.free
        for s in reversed(slots):
            if s == NO_SLOT:
                continue
            left = ref[s] - 1
            ref[s] = left
            if not left:
                if run_at[s] is None:
                    free.append(s)
                else:
                    cached.append(s)
        return cached

    # ---------------------------------------------------------------- back-pointers

    def place(self, slot: SlotId, block: B, i: int) -> None:
        """Slot ``slot`` holds block ``i`` of ``block``."""
        self.run_at[slot] = block
        self.idx_at[slot] = i

    def place_all(self, slots: Sequence[SlotId], block: B, first: int = 0) -> None:
        """Slots ``slots`` hold blocks ``first``, ``first + 1``, ... of ``block`` (NO_SLOT
        entries are skipped)."""
        run_at, idx_at = self.run_at, self.idx_at
        for j, s in enumerate(slots, first):
            if s != NO_SLOT:
                run_at[s] = block
                idx_at[s] = j

    def clear(self, slot: SlotId) -> None:
        """Slot ``slot`` no longer holds a cached block."""
        self.run_at[slot] = None

    def clear_all(self, slots: Iterable[SlotId]) -> None:
        """Slots ``slots`` no longer hold cached blocks."""
        run_at = self.run_at
        for s in slots:
            run_at[s] = None

    def owner(self, slot: SlotId) -> tuple[B, int] | None:
        """(block, index) that ``slot`` holds, or None."""
        b = self.run_at[slot]
        return None if b is None else (b, self.idx_at[slot])

    # ---------------------------------------------------------------- checks

    def state_of(self, slot: SlotId) -> str:
        """'free', 'queued', 'referenced', 'held' or 'claimed' (none of these: a colder slot
        claimed during a call); for checks and tests."""
        if self.ref[slot]:
            return "referenced"
        if slot in self.queue:
            return "queued"
        if slot in self.held:
            return "held"
        return "free" if slot in set(self.free) else "claimed"
