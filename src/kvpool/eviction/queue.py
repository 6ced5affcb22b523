"""Priority levels of lazy FIFOs: the machinery every eviction policy shares.

:class:`LevelQueue` holds, per retention priority level, a *recent* and a *frequent*
:class:`~kvpool.eviction.fifo.Fifo` (even and odd FIFO ids, so a stamp's low bit tells the
segment), a stamp per slot, the live count of every FIFO, the expiry heap of pushes with an
expiring priority, and the compaction of dead entries. A policy adds the order within a level:
:class:`~kvpool.eviction.lru.PrioritizedLRU` queues every block in its level's recent FIFO,
:class:`~kvpool.eviction.segmented.SegmentedPolicy` splits a level by use count.

Shared rules: a victim comes from the lowest non-empty level; a priority pushed with an
expiry falls back to the default once that time has passed (the block moves to the most
recent end of the default level's FIFO of the same kind); the FIFOs are compacted once dead
entries outnumber live ones by ``SLACK``; a claimed slot's stamp is ``CLAIMED`` or
``CLAIMED_FREQUENT`` (which segment it left).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from operator import itemgetter

from kvpool.errors import InvalidArgumentError
from kvpool.eviction.fifo import (
    CLAIMED,
    CLAIMED_FREQUENT,
    ID_MASK,
    NOT_QUEUED,
    STEP,
    Fifo,
    compact,
    cut_tail,
    stamp_of,
)
from kvpool.eviction.priority import DEFAULT_PRIORITY, OFFLOAD_GATES

SLACK = 1024
"""Dead entries tolerated beyond the live ones before a compaction."""


class Level:
    """One priority level: its recent (even id) and frequent (odd id) FIFOs."""

    __slots__ = ("frequent", "priority", "recent")

    def __init__(self, fid: int, priority: int) -> None:
        self.priority = priority
        self.recent = Fifo(fid, priority, False)
        self.frequent = Fifo(fid + 1, priority, True)


class LevelQueue:
    """Levels of lazy FIFOs with per-slot stamps, expiry and compaction (see the module).

    Counts: ``Fifo.live`` slots queued in each FIFO, ``_len`` in all, ``_stored``
    entries live and dead. Slots are pool indices (ints >= 0); the stamp list grows on demand
    past the pool size given. Subclasses define ``push``, ``push_many``, ``pop``, ``_pop_n``
    (which ``pop_many`` and ``pop_slots`` serve), ``should_offload`` and ``_level_order``.
    """

    __slots__ = (
        "_clock", "_expires", "_expiry", "_fifos", "_len", "_levels", "_next", "_ranked",
        "_stamp", "_stored",
    )

    def __init__(self, clock: Callable[[], float], capacity: int) -> None:
        self._clock = clock
        self._stamp: list[int] = [NOT_QUEUED] * capacity  # slot -> stamp, see fifo.py
        self._levels: dict[int, Level] = {}
        self._ranked: list[Level] = []  # levels ever used, ascending priority
        self._fifos: list[Fifo] = []  # by id
        self._next = 0  # the next batch's stamp, without its FIFO id
        self._len = 0  # slots queued
        self._stored = 0  # entries in the FIFOs, live and dead
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, slot, level) min-heap
        # slot -> (expiry, level) of its current push; tells live heap entries from stale ones
        self._expires: dict[int, tuple[float, int]] = {}

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: object) -> bool:
        stamp = self._stamp
        return isinstance(slot, int) and 0 <= slot < len(stamp) and stamp[slot] >= 0

    def remove(self, slot: int) -> None:
        """``slot`` is claimed again; it must be queued (``KeyError``, nothing changed)."""
        v = stamp_of(self._stamp, slot)
        fifo = self._fifos[v & ID_MASK]
        fifo.live -= 1
        fifo.dead += 1
        self._len -= 1
        self._stamp[slot] = CLAIMED - (v & 1)
        if self._stored > 2 * self._len + SLACK:
            self._compact()

    def remove_many(self, slots: Sequence[int]) -> None:
        """``remove`` of each of ``slots`` (distinct), in order; at the first slot not queued,
        ``KeyError`` (the ones before it are removed)."""
        if not slots:
            return
        stamp = self._stamp
        fifo = cut_tail(self._fifos, stamp, slots)
        if fifo is not None:  # no dead entries left behind
            mark = CLAIMED_FREQUENT if fifo.frequent else CLAIMED
            for s in slots:
                stamp[s] = mark
            n = len(slots)
            fifo.live -= n
            self._len -= n
            self._stored -= n
            return
        fifos = self._fifos
        n = len(slots)
        if n > 1:
            # one batch (the common claim of a prefix released together): its FIFO's counts
            # change once, the stamps in one loop (IndexError: a slot past the pool)
            try:
                vs = itemgetter(*slots)(stamp)
            except IndexError:
                vs = ()
            v = vs[0] if vs else -1
            if v >= 0 and vs.count(v) == n:
                fifo = fifos[v & ID_MASK]
                fifo.live -= n
                fifo.dead += n
                mark = CLAIMED - (v & 1)
                for s in slots:
                    stamp[s] = mark
                self._len -= n
                if self._stored > 2 * self._len + SLACK:
                    self._compact()
                return
        try:
            for s in slots:
                v = stamp[s]
                if v < 0:
                    break
                fifo = fifos[v & ID_MASK]
                fifo.live -= 1
                fifo.dead += 1
                stamp[s] = CLAIMED - (v & 1)
            else:
                self._len -= len(slots)
                if self._stored > 2 * self._len + SLACK:
                    self._compact()
                return
        except IndexError:
            pass
        self._len -= slots.index(s)  # the ones before it were removed
        raise KeyError(s)

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        victims, priorities = self._pop_n(n)
        return list(zip(victims, priorities, strict=True))

    def pop_slots(self, n: int) -> list[int]:
        return self._pop_n(n)[0]

    def _pop_n(self, n: int) -> tuple[list[int], list[int]]:
        """The next n victims in ``pop`` order, and their priorities."""
        raise NotImplementedError

    def peek_order(self) -> list[int]:
        """Every queued slot in victim order (for tests and introspection; O(n))."""
        if self._expiry:
            self._expire()
        out: list[int] = []
        for lvl in self._ranked:
            out += self._level_order(lvl)
        return out

    def priority_of(self, slot: int) -> int:
        """The current (expiry-adjusted) priority of a queued slot."""
        if self._expiry:
            self._expire()
        return self._fifos[stamp_of(self._stamp, slot) & ID_MASK].priority

    # ------------------------------------------------------------------ for subclasses

    def _level_order(self, lvl: Level) -> list[int]:
        """The order the policy would empty ``lvl`` in, without changing anything."""
        raise NotImplementedError

    def _level(self, priority: int) -> Level:
        lvl = self._levels.get(priority)
        if lvl is None:
            lvl = self._levels[priority] = Level(len(self._fifos), priority)
            self._fifos += (lvl.recent, lvl.frequent)
            self._ranked.append(lvl)
            self._ranked.sort(key=lambda lv: lv.priority)
        return lvl

    def _grow(self, slot: int) -> None:
        """A slot beyond the known pool size: the pool is at least ``slot + 1`` slots."""
        self._stamp.extend([NOT_QUEUED] * (slot + 1 - len(self._stamp)))

    def _check_push(self, slot: int) -> None:
        """Raise before a push of ``slot`` if it is negative or queued; grow past the pool."""
        stamp = self._stamp
        if slot < 0:
            raise InvalidArgumentError(f"slot must be an int >= 0, got {slot}")
        if slot >= len(stamp):
            self._grow(slot)
        elif stamp[slot] >= 0:
            raise InvalidArgumentError(f"slot {slot} is already evictable")

    def _track_expiry(self, slot: int, priority: int, expires_at: float | None) -> None:
        """Note the expiry of ``slot``'s push (or forget an earlier push's)."""
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = (expires_at, priority)
            heapq.heappush(self._expiry, (expires_at, slot, priority))
        elif self._expires:
            self._expires.pop(slot, None)

    def _append(self, fifo: Fifo, slots: list[int]) -> None:
        """Queue ``slots`` (not queued, in range) at the most recent end of ``fifo``."""
        b = self._next | fifo.id
        self._next += STEP
        stamp = self._stamp
        for s in slots:
            stamp[s] = b
        fifo.batches.append((b, slots))
        n = len(slots)
        fifo.live += n
        self._len += n
        self._stored += n

    def _compact(self) -> None:
        compact(self._fifos, self._stamp)
        self._stored = self._len

    def _expire(self) -> None:
        """Move every block whose priority expired to the default level."""
        heap = self._expiry
        now = self._clock()
        stamp = self._stamp
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != (at, level):
                continue  # stale: the slot was pushed again since
            del self._expires[slot]
            v = stamp[slot]
            if v < 0:
                continue
            src = self._fifos[v & ID_MASK]
            if src.priority != level:
                continue
            default = self._level(DEFAULT_PRIORITY)
            src.live -= 1
            src.dead += 1
            self._len -= 1  # its entry dies; _append counts it again
            self._append(default.frequent if src.frequent else default.recent, [slot])
        if self._stored > 2 * self._len + SLACK:
            self._compact()


def check_gate(gate: object) -> None:
    """Raise unless ``gate`` is an offload gate (``OFFLOAD_GATES``)."""
    if gate not in OFFLOAD_GATES:
        raise InvalidArgumentError(
            f"unknown offload gate {gate!r}; expected one of {list(OFFLOAD_GATES)}"
        )
