"""``lru``: least recently released first within each retention priority level."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.eviction.fifo import NOT_QUEUED, live_slots, take, take_one
from kvpool.eviction.queue import Level, LevelQueue, check_gate
from kvpool.hashing.keys import BlockKey


class PrioritizedLRU(LevelQueue):
    """LRU within each retention priority level; lowest priority evicted first.

    Keeps no history: ``should_offload`` is always True, whatever the offload gate. Every
    block queues in its level's recent FIFO (see :class:`LevelQueue`), so a push stores one
    int per slot, a removal one, and a victim costs a slice of its batch and one store.
    ``push_many`` trusts the manager: its slots are distinct and none is queued (``push``
    checks).
    """

    __slots__ = ()

    uses_keys = False

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all") -> None:
        check_gate(offload_gate)
        super().__init__(clock, capacity or 0)

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        self._check_push(slot)
        self._append((self._levels.get(priority) or self._level(priority)).recent, [slot])
        self._track_expiry(slot, priority, expires_at)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        if not slots:
            return
        fifo = (self._levels.get(priority) or self._level(priority)).recent
        try:
            self._append(fifo, list(slots))
        except IndexError:  # a slot beyond the known pool size: grow, then again
            self._grow(max(slots))
            self._append(fifo, list(slots))
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def _pop_n(self, n: int) -> tuple[list[int], list[int]]:
        """The next n victims and their priorities (lowest level first, oldest first)."""
        if self._expiry:
            self._expire()
        if n > self._len:
            raise IndexError(f"pop of {n} from an eviction queue of {self._len}")
        out: list[int] = []
        priorities: list[int] = []
        if n <= 0:
            return out, priorities
        stamp = self._stamp
        for lvl in self._ranked:
            fifo = lvl.recent
            if not fifo.batches:
                continue
            h = fifo.head
            sl = fifo.batches[0][1]
            if not fifo.dead and len(out) + len(sl) - h >= n:
                # the rest are live entries of the oldest batch: take, without the call
                got = sl[h:h + n - len(out)]
                for s in got:
                    stamp[s] = NOT_QUEUED
                fifo.head = h + len(got)
                if fifo.head == len(sl):
                    fifo.batches.popleft()
                    fifo.head = 0
                self._stored -= len(got)
                fifo.live -= len(got)
                out += got
                priorities += [fifo.priority] * len(got)
                break
            got, used = take(fifo, n - len(out), stamp)
            self._stored -= used
            fifo.live -= len(got)
            out += got
            priorities += [fifo.priority] * len(got)
            if len(out) == n:
                break
        self._len -= n
        return out, priorities

    def pop(self) -> tuple[int, int]:
        if self._expiry:
            self._expire()
        if self._len:
            for lvl in self._ranked:
                fifo = lvl.recent
                if fifo.batches:
                    slot, used = take_one(fifo, self._stamp)
                    self._stored -= used
                    if slot >= 0:
                        fifo.live -= 1
                        self._len -= 1
                        return slot, fifo.priority
        raise IndexError("pop from an empty eviction queue")

    def should_offload(self, slot: int) -> bool:
        return True

    def _level_order(self, lvl: Level) -> list[int]:
        return live_slots(lvl.recent, self._stamp)
