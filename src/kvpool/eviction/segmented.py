"""Scan-resistant policies' base: a recent and a frequent segment per level, a key history."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import eq, itemgetter
from typing import cast

from kvpool.errors import InvalidArgumentError
from kvpool.eviction.fifo import (
    CLAIMED,
    CLAIMED_FREQUENT,
    NOT_QUEUED,
    STEP,
    Fifo,
    live_slots,
    stamp_of,
    take,
    take_one,
)
from kvpool.eviction.history import DEFAULT_GHOST_MULTIPLE, KeyHistory
from kvpool.eviction.queue import Level, LevelQueue, check_gate
from kvpool.hashing.keys import BlockKey
from kvpool.validation import check_int, check_number


class SegmentedPolicy(LevelQueue):
    """Base of the scan-resistant policies: two segments per level and a key history.

    A block's *count* is how often its key has been released into the GPU pool: 1 on its
    first release, +1 on every later one, whether the block was hit while cached (``remove``
    then ``push`` of the same slot) or evicted and recomputed while the history still held
    its key; ``push_many`` raises each block's count to that of the descendants listed
    before it. A colder tier's pool (``tier > 0``) receives blocks with the count they had
    above. Blocks of count 1 queue in their level's *recent* segment, the others in its
    *frequent* segment, each oldest first. Subclasses set how the segments share a level:
    the recent segment gives the victim while it holds more than ``share`` of the level (or
    the frequent one is empty); S3-FIFO also sends frequent blocks round for extra laps.

    History: see :class:`KeyHistory`; a standalone policy owns one bounded to
    ``ghost_multiple x pool size`` entries (the pool size is ``capacity``, or the highest slot
    pushed + 1); :func:`make_policies` gives a layer group's tiers one shared history bounded
    to ``ghost_multiple x`` the group's slots on all tiers.

    Offload gate: with ``offload_gate="reused"`` only a victim of count > 1 may go down a
    tier; with ``"all"`` (default) every victim may.

    Layout: each segment is one of its level's FIFOs (see :class:`LevelQueue`); per slot
    (lists indexed by slot, grown past ``capacity`` on demand) a stamp, the key last pushed,
    the count of a frequent block (a recent one's is 1) and S3-FIFO's laps left. A claimed
    slot's stamp is ``CLAIMED`` or ``CLAIMED_FREQUENT`` (its key and count stay), which is
    how a push tells a block released again after a hit (same slot, same key) from a new one;
    a popped slot's is ``NOT_QUEUED`` (its key is stale). Slots are pool indices (ints >= 0),
    distinct within one ``push_many`` or ``remove_many``.
    """

    __slots__ = (
        "_capacity", "_counts", "_credits", "_gate_all", "_history", "_keyless", "_keys",
        "_last_count", "_last_slot", "_multiple", "_tier0",
    )

    uses_keys = True
    RECENT_SHARE = 0.25
    """The recent segment gives the victim while it holds more than this share of its level."""
    MAX_LAPS = 0
    """Extra laps through the frequent segment a block may earn (S3-FIFO); 0 = plain FIFO."""
    COUNT_GHOSTS = False
    """Track ghost kinds and ages in the history (ARC adapts on them)."""

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all", ghost_multiple: float = DEFAULT_GHOST_MULTIPLE,
                 tier: int = 0, history: KeyHistory | None = None) -> None:
        check_gate(offload_gate)
        if capacity is not None:
            check_int("capacity", capacity, 0)
        check_number("ghost_multiple", ghost_multiple, 0, 1024)
        check_int("tier", tier, 0)
        super().__init__(clock, capacity or 0)
        self._gate_all = offload_gate == "all"
        self._multiple = float(ghost_multiple)
        self._capacity = capacity or 0
        self._tier0 = tier == 0
        if history is None:
            history = KeyHistory(int(self._multiple * self._capacity), self.RECENT_SHARE,
                                 count_ghosts=self.COUNT_GHOSTS)
        self._history = history
        self._keyless = False  # was a slot ever pushed without a key?
        self._keys: list[BlockKey | None] = [None] * self._capacity  # slot -> key pushed
        self._counts = [0] * self._capacity  # slot -> its count, if queued as frequent
        self._credits = bytearray(self._capacity if self.MAX_LAPS else 0)  # slot -> laps left
        self._last_slot = -1
        self._last_count = 0

    # ------------------------------------------------------------------ protocol

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        self._check_push(slot)
        lvl = self._levels.get(priority) or self._level(priority)
        if key is None:
            self._keys[slot] = None
            self._keyless = True
            self._append(lvl.recent, [slot])
        else:
            v = self._stamp[slot]
            self._enqueue_many(lvl, (slot,), (key,), (v,), int(v == CLAIMED),
                               int(v == CLAIMED_FREQUENT))
        self._track_expiry(slot, priority, expires_at)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        if not slots:
            return
        if keys is not None and len(keys) != len(slots):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(slots)} slots")
        stamp = self._stamp
        n = len(slots)
        grow = False
        try:
            sts: tuple[int, ...] = itemgetter(*slots)(stamp) if n > 1 else (stamp[slots[0]],)
        except IndexError:  # a slot beyond the known pool size
            sts = tuple(stamp[s] if s < len(stamp) else NOT_QUEUED for s in slots)
            grow = True
        free = sts.count(NOT_QUEUED)  # (count is fast on equal small ints: the same object)
        frequent = sts.count(CLAIMED_FREQUENT) if free < n else 0
        recent = sts.count(CLAIMED) if free + frequent < n else 0
        if free + frequent + recent != n:
            queued = sorted({s for s, v in zip(slots, sts, strict=True) if v >= 0})
            raise InvalidArgumentError(f"slots {queued} are already evictable")
        if grow:
            self._grow(max(slots))
        lvl = self._levels.get(priority) or self._level(priority)
        if keys is None:
            slot_keys = self._keys
            for slot in slots:
                slot_keys[slot] = None
            self._keyless = True
            self._append(lvl.recent, list(slots))
        else:
            self._enqueue_many(lvl, slots, keys, sts, recent, frequent)
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def remove(self, slot: int) -> None:
        LevelQueue.remove(self, slot)  # the slot keeps its key and count: a GPU hit comes back
        if not self._tier0:
            key = self._keys[slot]
            if key is not None:
                # claimed from a colder tier: the GPU pool it goes to takes the count over
                count = self._counts[slot] if self._stamp[slot] == CLAIMED_FREQUENT else 1
                self._history.add(key, count, ghost=False)

    def remove_many(self, slots: Sequence[int]) -> None:
        if self._tier0:
            LevelQueue.remove_many(self, slots)
        else:
            for slot in slots:
                self.remove(slot)

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        victims, priorities = self._pop_n(n)
        return list(zip(victims, priorities, strict=True))

    def pop_slots(self, n: int) -> list[int]:
        return self._pop_n(n)[0]

    def _pop_n(self, n: int) -> tuple[list[int], list[int]]:
        """n victims as ``pop`` gives them, and their priorities: runs of them from one
        segment at a time, then every victim's key joins the history, in victim order."""
        if n > self._len:
            raise IndexError(f"pop of {n} from an eviction queue of {self._len}")
        if self._expiry:
            self._expire()
        victims: list[int] = []
        priorities: list[int] = []
        if n <= 0:
            return victims, priorities
        share = self._history.share
        stamp = self._stamp
        values: list[int] = []  # the victims' history values, min(count, 255)
        while len(victims) < n:
            lvl = self._lowest_level()
            recent, frequent = lvl.recent, lvl.frequent
            nr, nf = recent.live, frequent.live
            run = recent_run(nr, nf, share, n - len(victims))
            if run:
                got, used = take(recent, run, stamp)
                recent.live = nr - run
                values += [1] * run
            else:
                run = frequent_run(nr, nf, share, n - len(victims))
                got, used = (self._take_laps(frequent, run) if self.MAX_LAPS
                             else take(frequent, run, stamp))
                frequent.live = nf - run
                counts = itemgetter(*got)(self._counts) if run > 1 else (self._counts[got[0]],)
                values += counts if max(counts) < 255 else [c if c < 255 else 255 for c in counts]
            self._stored -= used
            victims += got
            priorities += [lvl.priority] * run
        self._len -= n
        self._forget(victims, values)
        self._last_slot, self._last_count = victims[-1], values[-1]
        return victims, priorities

    def pop(self) -> tuple[int, int]:
        # pop_many(1) without its batching (the tiered path takes victims one at a time)
        if not self._len:
            raise IndexError("pop from an empty eviction queue")
        if self._expiry:
            self._expire()
        lvl = self._lowest_level()
        recent, frequent = lvl.recent, lvl.frequent
        if recent_run(recent.live, frequent.live, self._history.share, 1):
            slot, used = take_one(recent, self._stamp)
            recent.live -= 1
            count = 1
        else:
            if self.MAX_LAPS:
                got, used = self._take_laps(frequent, 1)
                slot = got[0]
            else:
                slot, used = take_one(frequent, self._stamp)
            frequent.live -= 1
            count = self._counts[slot]
        self._stored -= used
        self._len -= 1
        key = self._keys[slot]
        if key is not None:
            self._history.add(key, count, ghost=True)
        self._last_slot, self._last_count = slot, count
        return slot, lvl.priority

    def should_offload(self, slot: int) -> bool:
        return self._gate_all or (slot == self._last_slot and self._last_count > 1)

    # ------------------------------------------------------------------ introspection

    @property
    def history(self) -> KeyHistory:
        """The key history this policy reads and feeds (shared by a layer group's tiers)."""
        return self._history

    def count_of(self, slot: int) -> int:
        """The count of the block queued at ``slot``."""
        return self._counts[slot] if stamp_of(self._stamp, slot) & 1 else 1

    def is_frequent(self, slot: int) -> bool:
        """Whether the block queued at ``slot`` is in its level's frequent segment."""
        return bool(stamp_of(self._stamp, slot) & 1)

    # ------------------------------------------------------------------ internals

    def _lowest_level(self) -> Level:
        """The lowest priority level holding a block (the queue is not empty)."""
        for lvl in self._ranked:
            if lvl.recent.live or lvl.frequent.live:
                return lvl
        raise IndexError("pop from an empty eviction queue")

    def _grow(self, slot: int) -> None:
        """A slot beyond the known pool size: the pool is at least ``slot + 1`` slots."""
        n = slot + 1
        self._stamp.extend([NOT_QUEUED] * (n - len(self._stamp)))
        self._keys.extend([None] * (n - len(self._keys)))
        self._counts.extend([0] * (n - len(self._counts)))
        if self.MAX_LAPS:
            self._credits.extend(bytes(n - len(self._credits)))
        self._capacity = max(self._capacity, n)
        self._history.bound = max(self._history.bound, int(self._multiple * self._capacity))

    def _enqueue_many(self, lvl: Level, slots: Sequence[int], keys: Sequence[BlockKey],
                      stamps: tuple[int, ...], recent: int, frequent: int) -> None:
        """Queue released (tier 0) or arriving (colder tier) blocks with their counts
        (``stamps``: the slots' stamps, none queued, ``recent`` of them claimed from a recent
        segment and ``frequent`` from a frequent one).

        On the GPU tier, a released block table is usually new blocks followed by claimed
        blocks coming back with their keys (its prefix was a hit): those take the bulk path,
        every other mix the general one."""
        n = len(slots)
        claimed = recent + frequent
        j = n  # slots[j:] come back after a claim, with their keys
        if claimed and self._tier0:
            j = n - claimed
            if stamps[:j].count(NOT_QUEUED) == j:  # the claimed ones are the last ones
                olds = itemgetter(*slots[j:])(self._keys) if claimed > 1 else (
                    self._keys[slots[j]],)
                same = tuple(keys[j:])
                if olds != same:
                    j = n if not any(map(eq, olds, same)) else -1  # all new, or a mix
            else:
                j = -1
        if j < 0 or not self._tier0:
            self._enqueue_each(lvl, slots, keys, stamps)
            return
        entries = self._history.entries
        new_keys = keys if j == n else keys[:j]
        if entries.keys().isdisjoint(new_keys):
            # the common cases: new blocks (count 1), then maybe hits coming back (count >= 2)
            if j:
                self._append_keyed(lvl.recent, list(slots[:j]) if j < n else list(slots),
                                   new_keys)
            if j < n:
                cs = self._claimed_counts(slots[j:], stamps[j:], recent, frequent)
                if cs.count(cs[0]) != len(cs) and cs != sorted(cs):  # (equal: a prefix)
                    chain_floor(cs)
                self._append_frequent(lvl.frequent, list(slots[j:]), None, cs)
            return
        # history hits: the count goes on from the entry's (its low byte, + 1)
        found = list(map(entries.pop, new_keys, repeat(0)))
        if self.COUNT_GHOSTS:  # an entry packs a stamp above its count
            cs = [((v if v > 0 else -v) & 255) + 1 for v in found]
            self._ghosts_back(found)
        else:
            cs = [(v if v > 0 else -v) + 1 for v in found]
        if j < n:
            cs += self._claimed_counts(slots[j:], stamps[j:], recent, frequent)
        if cs != sorted(cs):
            chain_floor(cs)
        r = bisect_right(cs, 1)  # counts of 1 (recent) come first
        if r:
            self._append_keyed(lvl.recent, list(slots[:r]), keys[:r])
        if r < n:
            self._append_frequent(lvl.frequent, list(slots[r:]), keys[r:], cs[r:])

    def _claimed_counts(self, slots: Sequence[int], stamps: tuple[int, ...], recent: int,
                        frequent: int) -> list[int]:
        """The counts of claimed GPU blocks released again (count when claimed + 1; ``recent``
        and ``frequent`` of them were claimed from each kind of segment)."""
        if not frequent:
            return [2] * len(slots)
        counts = self._counts
        got = itemgetter(*slots)(counts) if len(slots) > 1 else (counts[slots[0]],)
        if not recent:
            if got.count(got[0]) == len(got):  # a prefix claimed and released together
                return [got[0] + 1] * len(got)
            return [c + 1 for c in got]
        return [c + 1 if v == CLAIMED_FREQUENT else 2 for c, v in zip(got, stamps, strict=True)]

    def _append_keyed(self, fifo: Fifo, slots: list[int], keys: Sequence[BlockKey]) -> None:
        """``_append`` that also stores the slots' keys."""
        b = self._next | fifo.id
        self._next += STEP
        stamp = self._stamp
        slot_keys = self._keys
        for s, k in zip(slots, keys, strict=True):
            stamp[s] = b
            slot_keys[s] = k
        fifo.batches.append((b, slots))
        n = len(slots)
        fifo.live += n
        self._len += n
        self._stored += n

    def _append_frequent(self, fifo: Fifo, slots: list[int],
                         keys: Sequence[BlockKey] | None, counts: list[int]) -> None:
        """``_append`` of blocks of count > 1, with their counts (and laps) and keys (None:
        the keys the slots hold)."""
        b = self._next | fifo.id
        self._next += STEP
        stamp = self._stamp
        slot_counts = self._counts
        if keys is None:
            for s, c in zip(slots, counts, strict=True):
                stamp[s] = b
                slot_counts[s] = c
        else:
            slot_keys = self._keys
            for s, c, k in zip(slots, counts, keys, strict=True):
                stamp[s] = b
                slot_counts[s] = c
                slot_keys[s] = k
        laps = self.MAX_LAPS
        if laps:
            credits = self._credits
            for s, c in zip(slots, counts, strict=True):
                credits[s] = c - 2 if c - 2 < laps else laps
        fifo.batches.append((b, slots))
        n = len(slots)
        fifo.live += n
        self._len += n
        self._stored += n

    def _enqueue_each(self, lvl: Level, slots: Sequence[int], keys: Sequence[BlockKey],
                      stamps: Sequence[int]) -> None:
        """``_enqueue_many``, one block at a time (any mix, any tier)."""
        slot_keys = self._keys
        counts = self._counts
        hist_pop = self._history.entries.pop
        bump = 1 if self._tier0 else 0  # a release is a use; moving down a tier is not
        recent: list[int] = []
        frequent: list[int] = []
        fcounts: list[int] = []
        rkeys: list[BlockKey] = []
        fkeys: list[BlockKey] = []
        floor = 1  # the highest count listed so far: a descendant's (the chain runs tail first)
        for slot, key, v0 in zip(slots, keys, stamps, strict=True):
            old = slot_keys[slot]  # meaningful if the slot was claimed
            if v0 < NOT_QUEUED and old is not None and (old is key or old == key):
                # back after a claim (a hit, or a partial copy)
                count = (counts[slot] if v0 == CLAIMED_FREQUENT else 1) + bump
                if not bump:
                    hist_pop(key, None)
            else:
                v = hist_pop(key, 0)
                if not v:
                    count = 1
                elif v > 0:
                    count = (v & 255) + bump
                    if self.COUNT_GHOSTS:
                        self._ghosts_back((v,))
                else:
                    count = (-v & 255) + bump
            if count < floor:
                count = floor  # a parent is used at least as often as its child
            else:
                floor = count
            if count > 1:
                frequent.append(slot)
                fkeys.append(key)
                fcounts.append(count)
            else:
                recent.append(slot)
                rkeys.append(key)
        if recent:
            self._append_keyed(lvl.recent, recent, rkeys)
        if frequent:
            self._append_frequent(lvl.frequent, frequent, fkeys, fcounts)

    def _forget(self, victims: list[int], values: list[int]) -> None:
        """Every popped victim's key joins the history with its value, in victim order."""
        h = self._history
        got: tuple[BlockKey | None, ...] = (itemgetter(*victims)(self._keys) if len(victims) > 1
                                            else (self._keys[victims[0]],))
        if self._keyless and None in got:  # slots pushed without a key leave nothing
            pairs = [(k, v) for k, v in zip(got, values, strict=True) if k is not None]
            keys: tuple[BlockKey, ...] = tuple(k for k, _ in pairs)
            values = [v for _, v in pairs]
        else:
            keys = cast(tuple[BlockKey, ...], got)
        if not keys:
            return
        if len(h.entries) + len(keys) > h.bound:  # a trim on the way: one at a time
            for key, v in zip(keys, values, strict=True):
                h.add(key, v, ghost=True)
        else:
            h.add_capped(keys, values)

    def _ghosts_back(self, found: Sequence[int]) -> None:
        """The history entries ``found`` (in order; the positive ones are ghosts) left the
        history for this queue (COUNT_GHOSTS): the ghost counts follow."""
        ghosts = self._history.ghosts
        for v in found:
            if v > 0:
                ghosts[(v & 255) > 1] -= 1

    def _take_laps(self, frequent: Fifo, k: int) -> tuple[list[int], int]:
        """Take ``k`` victims from a frequent segment, sending blocks with laps left round
        again (to the most recent end, one lap fewer): (victims, entries consumed)."""
        credits = self._credits
        stamp = self._stamp
        batches = frequent.batches
        out: list[int] = []
        used = 0
        while True:  # one pass over the oldest batch's entries
            b, sl = batches[0]
            h = i = frequent.head
            lap: list[int] = []  # the blocks this pass sends round, a batch of their own
            b_lap = self._next | frequent.id
            self._next += STEP
            batches.append((b_lap, lap))
            for i in range(h, len(sl)):
                s = sl[i]
                if stamp[s] != b:
                    frequent.dead -= 1
                    continue
                c = credits[s]
                if c:
                    credits[s] = c - 1
                    lap.append(s)
                    stamp[s] = b_lap
                    continue
                out.append(s)
                stamp[s] = NOT_QUEUED
                if len(out) == k:
                    break
            used += i + 1 - h
            self._stored += len(lap)
            if not lap:
                batches.pop()
            if i + 1 == len(sl):
                batches.popleft()
                frequent.head = 0
            else:
                frequent.head = i + 1
            if len(out) == k:
                return out, used

    def _level_order(self, lvl: Level) -> list[int]:
        recent = live_slots(lvl.recent, self._stamp)
        frequent: deque[tuple[int, int]] = deque(
            (s, self._credits[s] if self.MAX_LAPS else 0) for s in live_slots(lvl.frequent,
                                                                        self._stamp)
        )
        share = self._history.share
        out: list[int] = []
        i = 0
        while i < len(recent) or frequent:
            nr = len(recent) - i
            if nr and (not frequent or nr > share * (nr + len(frequent))):
                out.append(recent[i])
                i += 1
                continue
            while True:
                slot, c = frequent.popleft()
                if not c:
                    out.append(slot)
                    break
                frequent.append((slot, c - 1))
        return out




def recent_run(nr: int, nf: int, share: float, left: int) -> int:
    """How many of the next ``left`` victims of a level come from its recent segment.

    The recent segment (``nr`` blocks) gives a victim while it holds more than ``share`` of
    the level (``nf`` frequent blocks), or the frequent segment is empty. That test
    ``nr - r > share * (nr - r + nf)`` holds for r = 0, 1, ... up to some point and then no
    more: the run is found from the closed form and settled exactly by the same test.
    """
    # (conditional expressions rather than min and max: this runs once per run of victims)
    if not nf or share <= 0.0:  # the test holds while any recent block is left
        return left if left < nr else nr
    if share >= 1.0:  # the test never holds
        return 0
    run = nr - int(share * nf / (1.0 - share)) - 1
    run = 0 if run < 0 else left if run > left else run
    while run > 0 and not nr - run + 1 > share * (nr - run + 1 + nf):
        run -= 1
    while run < left and nr - run > share * (nr - run + nf):
        run += 1
    return run


def frequent_run(nr: int, nf: int, share: float, left: int) -> int:
    """How many of the next ``left`` victims of a level come from its frequent segment, when
    the recent segment does not give the next one (``recent_run`` is 0).

    The frequent segment gives while the recent test ``nr > share * (nr + nf - f)`` fails
    after f frequent victims (it holds from some f on; S3-FIFO's laps do not change nf): the
    run is found from the closed form and settled exactly by the same test.
    """
    top = left if left < nf else nf
    if not nr or share >= 1.0:  # the test never holds while a frequent block is left
        return top
    if share <= 0.0:  # the test always holds
        return 0
    t = nr + nf - nr / share  # (-inf for a denormal share: compare before int)
    run = 0 if t < 0 else top if t > top else int(t)
    while run > 0 and nr > share * (nr + nf - run + 1):
        run -= 1
    while run < top and not nr > share * (nr + nf - run):
        run += 1
    return run


def chain_floor(counts: list[int]) -> None:
    """Raise each count to the highest one before it (a parent is used at least as often as
    its child, and a released block table lists children first)."""
    floor = 1
    for i, c in enumerate(counts):
        if c < floor:
            counts[i] = floor
        else:
            floor = c
