"""Free queues of evictable blocks: which cached, unreferenced slot to give up next.

One policy object serves one (tier, layer group) pool. The manager tells it when a cached
block becomes evictable (``push``, with the block's key so a policy can keep history across
slot reuse), when it is claimed again (``remove``: a hit, or the block is dropped with an
evicted ancestor), and asks it for victims (``pop``) and whether the victim just popped
deserves a colder tier (``should_offload``).

Rules every policy keeps:

- Retention priority dominates: a victim comes from the lowest non-empty priority level; the
  policy orders blocks only within a level. A priority pushed with an expiry falls back to the
  default (35) once that time has passed (the block keeps its place in the policy's order
  class, at the most recent end).
- ``push`` of a slot already queued raises :class:`InvalidArgumentError` before any state
  changes; ``remove`` needs a queued slot (``KeyError`` otherwise, nothing changed); ``pop``
  on an empty queue raises :class:`IndexError`.

Policies (``POLICIES``, chosen by ``CacheConfig(eviction_policy=...)``):

``lru``
    :class:`PrioritizedLRU`: least recently released first, no history (every engine's
    policy, and the cheapest).
``2q`` (the default), ``s3fifo``, ``arc``
    Scan-resistant policies (:class:`TwoQueue`, :class:`S3FIFO`, :class:`ARC`) built on
    :class:`SegmentedPolicy`: each level has a *recent* segment (blocks released once) and a
    *frequent* segment (blocks released again: hit while cached, or recomputed while their
    key was still in the ghost history). They differ in how the two segments share the
    level: a fixed 25% for the recent FIFO (2Q, Johnson & Shasha 1994), a 10% small FIFO and
    a main FIFO that gives frequently used blocks extra laps (S3-FIFO, Yang et al. 2023), or
    a share adapted from ghost hits (ARC, Megiddo & Modha 2003).

Prefix trees. The manager drops a full-attention block's queued descendants with it, so a
good victim is the tail of a chain. The manager pushes a released sequence's blocks tail
first, and the policies keep that: a segment gives its blocks in push order, and
``push_many`` raises each block's count to the highest count listed before it in the call (a
parent is used at least as often as its child), so the head of a released chain is never in a
worse segment than its tail. A parent released on its own, after frequent children (another
sequence held it longer), can still be a victim before them; they then go with it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Protocol

from kvpool.config import DEFAULT_PRIORITY, OFFLOAD_GATES, CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.hashing import BlockKey

DEFAULT_GHOST_MULTIPLE = 4.0
"""Default bound of a standalone history-keeping policy's history, x its pool size."""


class EvictionPolicy(Protocol):
    """What the manager needs from a free queue."""

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

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` victims, as ``n`` calls of ``pop`` would give them (n <= len)."""

    def peek_order(self) -> list[int]:
        """Every queued slot in victim order (for tests and introspection; O(n))."""

    def priority_of(self, slot: int) -> int:
        """The current (expiry-adjusted) priority of a queued slot."""

    def __len__(self) -> int: ...

    def __contains__(self, slot: object) -> bool: ...


class PrioritizedLRU:
    """LRU within each retention priority level; lowest priority evicted first.

    Keeps no history: ``should_offload`` is always True, whatever the offload gate.
    """

    __slots__ = ("_buckets", "_clock", "_expires", "_expiry", "_level", "_order")

    uses_keys = False

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all") -> None:
        _check_gate(offload_gate)
        self._clock = clock
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._order: list[int] = []  # non-empty-or-once-used priority levels, ascending
        self._level: dict[int, int] = {}  # slot -> priority level it is queued at
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, slot, level) min-heap
        # slot -> (expiry, level) of its current push; tells live heap entries from stale ones
        self._expires: dict[int, tuple[float, int]] = {}

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

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        if slot in self._level:
            raise InvalidArgumentError(f"slot {slot} is already evictable")
        self._bucket(priority)[slot] = None
        self._level[slot] = priority
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = (expires_at, priority)
            heapq.heappush(self._expiry, (expires_at, slot, priority))
        elif self._expires:
            self._expires.pop(slot, None)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        bucket = self._bucket(priority)
        level = self._level
        for slot in slots:
            bucket[slot] = None
            level[slot] = priority
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def remove(self, slot: int) -> None:
        del self._buckets[self._level.pop(slot)][slot]

    def remove_many(self, slots: Sequence[int]) -> None:
        buckets = self._buckets
        pop_level = self._level.pop
        for slot in slots:
            del buckets[pop_level(slot)][slot]

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        self._expire()
        out: list[tuple[int, int]] = []
        level = self._level
        for p in self._order:
            bucket = self._buckets[p]
            take = min(n - len(out), len(bucket))
            if take:
                popitem = bucket.popitem
                for _ in range(take):
                    slot = popitem(last=False)[0]
                    del level[slot]
                    out.append((slot, p))
                if len(out) == n:
                    return out
        if len(out) < n:
            for slot, p in reversed(out):  # put them back: nothing changed
                self._buckets[p][slot] = None
                self._buckets[p].move_to_end(slot, last=False)
                level[slot] = p
            raise IndexError(f"pop of {n} from an eviction queue of {len(out)}")
        return out

    def should_offload(self, slot: int) -> bool:
        return True

    def _expire(self) -> None:
        heap = self._expiry
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != (at, level):
                continue  # stale: the slot was pushed again since
            del self._expires[slot]
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


class KeyHistory:
    """Counts of the keys that left a layer group's queues, the oldest forgotten first.

    The policies of one layer group's tiers share one history, so a block keeps its count
    when it moves down a tier (popped from the GPU queue, pushed to the host queue) or up
    (claimed from the host queue, released into the GPU queue). An entry is ``min(count,
    255)``, positive for an evicted block (a *ghost*), negative for a block claimed from a
    colder tier (on its way up); with ``count_ghosts`` (ARC) it also packs a stamp, ``stamp
    << 8 | min(count, 255)``, numbering the entries in the order they were added.

    At most ``bound`` entries: an addition beyond that forgets, in one pass (amortised O(1)
    per addition), every key but the ``bound // 2`` inserted last, so a key outlives at least
    the next ``bound // 2 - 1`` insertions.
    """

    __slots__ = ("bound", "count_ghosts", "entries", "ghosts", "seq", "share")

    def __init__(self, bound: int, share: float, *, count_ghosts: bool = False) -> None:
        self.entries: dict[BlockKey, int] = {}
        self.bound = bound
        self.seq = 0  # entries added so far, if count_ghosts: the last one's stamp
        self.count_ghosts = count_ghosts
        self.ghosts = [0, 0]  # ghosts of count 1 and of count > 1 (if count_ghosts: ARC)
        self.share = share  # the recent segment's share of a level (ARC adapts it)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: BlockKey, count: int, *, ghost: bool) -> None:
        """Remember ``key`` with ``count``: evicted (``ghost``) or claimed from below."""
        v = count if count < 255 else 255
        if self.count_ghosts:
            self.seq += 1
            v |= self.seq << 8
        if ghost:
            self.entries[key] = v
            if self.count_ghosts:
                self.ghosts[count > 1] += 1
        else:
            self.entries[key] = -v
        if len(self.entries) > self.bound:
            self.trim()

    def add_ghosts(self, keys: list[BlockKey], counts: list[int]) -> None:
        """``add(key, count, ghost=True)`` of each pair in order, when no trim can happen on
        the way (``len(self) + len(keys) <= bound``): the entries go in at once."""
        values = [c if c < 255 else 255 for c in counts]
        if self.count_ghosts:
            seq = self.seq
            self.seq = seq + len(values)
            values = [(seq + i) << 8 | v for i, v in enumerate(values, 1)]
            frequent = sum(c > 1 for c in counts)
            self.ghosts[1] += frequent
            self.ghosts[0] += len(counts) - frequent
        self.entries.update(zip(keys, values, strict=True))

    def trim(self) -> None:
        """Forget every key but the ``bound // 2`` inserted last (dicts keep insertion order)."""
        entries = self.entries
        old = list(islice(entries, len(entries) - self.bound // 2))
        if self.count_ghosts:
            ghosts = self.ghosts
            for k in old:
                v = entries.pop(k)
                if v > 0:
                    ghosts[(v & 255) > 1] -= 1
        else:
            for k in old:
                del entries[k]


class _Level:
    """One priority level of a segmented policy: slot -> count, oldest first."""

    __slots__ = ("frequent", "recent")

    def __init__(self) -> None:
        self.recent: OrderedDict[int, int] = OrderedDict()  # count 1
        self.frequent: OrderedDict[int, int] = OrderedDict()  # count > 1


class SegmentedPolicy:
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
    """

    __slots__ = (
        "_capacity", "_clock", "_counts", "_credits", "_expires", "_expiry", "_gate_all",
        "_history", "_keys", "_last_count", "_last_slot", "_levels", "_loc",
        "_multiple", "_ranked", "_tier0",
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
        _check_gate(offload_gate)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {capacity!r}")
        if (isinstance(ghost_multiple, bool) or not isinstance(ghost_multiple, int | float)
                or not 0 <= ghost_multiple <= 1024):
            raise InvalidArgumentError(
                f"ghost_multiple must be a number in [0, 1024], got {ghost_multiple!r}"
            )
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            raise InvalidArgumentError(f"tier must be an int >= 0, got {tier!r}")
        self._clock = clock
        self._gate_all = offload_gate == "all"
        self._multiple = float(ghost_multiple)
        self._capacity = capacity or 0
        self._tier0 = tier == 0
        if history is None:
            history = KeyHistory(int(self._multiple * self._capacity), self.RECENT_SHARE,
                                 count_ghosts=self.COUNT_GHOSTS)
        self._history = history
        self._levels: dict[int, _Level] = {}
        self._ranked: list[tuple[int, _Level]] = []  # levels ever used, ascending priority
        self._loc: dict[int, OrderedDict[int, int]] = {}  # queued slot -> its segment
        self._keys: list[BlockKey | None] = [None] * self._capacity  # slot -> key pushed
        self._counts = [0] * self._capacity  # slot -> its count when last claimed
        self._credits = bytearray(self._capacity if self.MAX_LAPS else 0)  # slot -> laps left
        self._last_slot = -1
        self._last_count = 0
        self._expiry: list[tuple[float, int, int]] = []
        self._expires: dict[int, tuple[float, int]] = {}  # as in PrioritizedLRU

    # ------------------------------------------------------------------ protocol

    def __len__(self) -> int:
        return len(self._loc)

    def __contains__(self, slot: object) -> bool:
        return slot in self._loc

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        if slot in self._loc:
            raise InvalidArgumentError(f"slot {slot} is already evictable")
        if slot >= len(self._keys):
            self._grow(slot)
        lvl = self._level(priority)
        if key is None:
            self._keys[slot] = None
            lvl.recent[slot] = 1
            self._loc[slot] = lvl.recent
        else:
            self._enqueue_many(lvl, (slot,), (key,))
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = (expires_at, priority)
            heapq.heappush(self._expiry, (expires_at, slot, priority))
        elif self._expires:
            self._expires.pop(slot, None)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        if not slots:
            return
        if keys is not None and len(keys) != len(slots):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(slots)} slots")
        loc = self._loc
        if not loc.keys().isdisjoint(slots):
            queued = sorted(set(slots) & loc.keys())
            raise InvalidArgumentError(f"slots {queued} are already evictable")
        top = max(slots)
        if top >= len(self._keys):
            self._grow(top)
        lvl = self._level(priority)
        if keys is None:
            for slot in slots:
                self._keys[slot] = None
                lvl.recent[slot] = 1
                loc[slot] = lvl.recent
        else:
            self._enqueue_many(lvl, slots, keys)
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def remove_many(self, slots: Sequence[int]) -> None:
        if not self._tier0:
            for slot in slots:
                self.remove(slot)
            return
        pop_loc = self._loc.pop
        counts = self._counts
        for slot in slots:
            counts[slot] = pop_loc(slot).pop(slot)  # ``remove`` on the GPU tier

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        # n victims as ``pop`` gives them: a run of them from a recent segment at once, then
        # every victim's key joins the history, in victim order
        if n > len(self._loc):
            raise IndexError(f"pop of {n} from an eviction queue of {len(self._loc)}")
        if self._expiry:
            self._expire()
        out: list[tuple[int, int]] = []
        h = self._history
        laps = self.MAX_LAPS
        victims: list[tuple[int, int]] = []  # (slot, count), in victim order
        while len(out) < n:
            prio, lvl = self._lowest_level()
            recent = lvl.recent
            run = _recent_run(len(recent), len(lvl.frequent), h.share, n - len(out))
            popped = ([recent.popitem(False) for _ in range(run)] if run
                      else [self._pop_laps(lvl.frequent) if laps
                            else lvl.frequent.popitem(False)])
            victims += popped
            out += [(s, prio) for s, _ in popped]
        if victims:
            self._forget(victims)
            self._last_slot, self._last_count = victims[-1]
        return out

    def _forget(self, victims: list[tuple[int, int]]) -> None:
        """Unqueue popped victims; each one's key joins the history, in victim order."""
        loc = self._loc
        slot_keys = self._keys
        keys: list[BlockKey] = []
        counts: list[int] = []
        for slot, count in victims:
            del loc[slot]
            key = slot_keys[slot]
            if key is not None:
                slot_keys[slot] = None
                keys.append(key)
                counts.append(count)
        h = self._history
        if len(h.entries) + len(keys) > h.bound:  # a trim on the way: one at a time
            for key, count in zip(keys, counts, strict=True):
                h.add(key, count, ghost=True)
        else:
            h.add_ghosts(keys, counts)

    def remove(self, slot: int) -> None:
        count = self._loc.pop(slot).pop(slot)
        # the slot keeps its key and count: a GPU hit comes back to the same slot
        self._counts[slot] = count
        if not self._tier0:
            key = self._keys[slot]
            if key is not None:
                # claimed from a colder tier: the GPU pool it goes to takes the count over
                self._history.add(key, count, ghost=False)

    def pop(self) -> tuple[int, int]:
        # pop_many(1) without its batching (the tiered path takes victims one at a time)
        if not self._loc:
            raise IndexError("pop from an empty eviction queue")
        if self._expiry:
            self._expire()
        prio, lvl = self._lowest_level()
        recent = lvl.recent
        if _recent_run(len(recent), len(lvl.frequent), self._history.share, 1):
            slot, count = recent.popitem(False)
        elif self.MAX_LAPS:
            slot, count = self._pop_laps(lvl.frequent)
        else:
            slot, count = lvl.frequent.popitem(False)
        del self._loc[slot]
        key = self._keys[slot]
        if key is not None:
            self._keys[slot] = None
            self._history.add(key, count, ghost=True)
        self._last_slot, self._last_count = slot, count
        return slot, prio

    def should_offload(self, slot: int) -> bool:
        return self._gate_all or (slot == self._last_slot and self._last_count > 1)

    def peek_order(self) -> list[int]:
        if self._expiry:
            self._expire()
        out: list[int] = []
        for _, lvl in self._ranked:
            out.extend(self._simulate_level(lvl))
        return out

    def priority_of(self, slot: int) -> int:
        if self._expiry:
            self._expire()
        seg = self._loc[slot]
        for p, lvl in self._levels.items():
            if seg is lvl.recent or seg is lvl.frequent:
                return p
        raise AssertionError(f"slot {slot} is queued in no level")

    # ------------------------------------------------------------------ introspection

    @property
    def history(self) -> KeyHistory:
        """The key history this policy reads and feeds (shared by a layer group's tiers)."""
        return self._history

    def count_of(self, slot: int) -> int:
        """The count of the block queued at ``slot``."""
        return self._loc[slot][slot]

    def is_frequent(self, slot: int) -> bool:
        """Whether the block queued at ``slot`` is in its level's frequent segment."""
        seg = self._loc[slot]
        return any(seg is lvl.frequent for lvl in self._levels.values())

    # ------------------------------------------------------------------ internals

    def _lowest_level(self) -> tuple[int, _Level]:
        """The lowest priority level holding a block (the queue is not empty)."""
        for pl in self._ranked:
            if pl[1].recent or pl[1].frequent:
                return pl
        raise IndexError("pop from an empty eviction queue")

    def _level(self, priority: int) -> _Level:
        lvl = self._levels.get(priority)
        if lvl is None:
            lvl = self._levels[priority] = _Level()
            self._ranked.append((priority, lvl))
            self._ranked.sort(key=lambda pl: pl[0])
        return lvl

    def _grow(self, slot: int) -> None:
        """A slot beyond the known pool size: the pool is at least ``slot + 1`` slots."""
        n = slot + 1
        self._keys.extend([None] * (n - len(self._keys)))
        self._counts.extend([0] * (n - len(self._counts)))
        if self.MAX_LAPS:
            self._credits.extend(bytes(n - len(self._credits)))
        self._capacity = max(self._capacity, n)
        self._history.bound = max(self._history.bound, int(self._multiple * self._capacity))

    def _enqueue_many(self, lvl: _Level, slots: Sequence[int],
                      keys: Sequence[BlockKey]) -> None:
        """Queue released (tier 0) or arriving (colder tier) blocks with their counts."""
        loc = self._loc
        slot_keys = self._keys
        counts = self._counts
        hist_pop = self._history.entries.pop
        recent = lvl.recent
        frequent = lvl.frequent
        laps = self.MAX_LAPS
        credits = self._credits
        bump = 1 if self._tier0 else 0  # a release is a use; moving down a tier is not
        floor = 1  # the highest count listed so far: a descendant's (the chain runs tail first)
        for slot, key in zip(slots, keys, strict=True):
            old = slot_keys[slot]  # None unless the slot was claimed (popped slots forget)
            if old is None or (old is not key and old != key):
                slot_keys[slot] = key
                v = hist_pop(key, 0)
                if not v:
                    if floor == 1:  # the common case: a new block, nothing frequent below
                        recent[slot] = 1
                        loc[slot] = recent
                        continue
                    count = 1
                elif v > 0:
                    count = (v & 255) + bump
                    if self.COUNT_GHOSTS:
                        self._ghost_back(v)
                else:
                    count = (-v & 255) + bump
            else:
                count = counts[slot] + bump  # back after a claim (a hit, or a partial copy)
                if not bump:
                    hist_pop(key, None)
            if count < floor:
                count = floor  # a parent is used at least as often as its child
            else:
                floor = count
            if count > 1:
                frequent[slot] = count
                loc[slot] = frequent
                if laps:
                    credits[slot] = count - 2 if count - 2 < laps else laps
            else:
                recent[slot] = count
                loc[slot] = recent

    def _ghost_back(self, v: int) -> None:
        """The ghost entry ``v`` left the history for this queue (COUNT_GHOSTS)."""
        count = v & 255
        history = self._history
        history.ghosts[count > 1] -= 1
        if self._tier0:
            self._ghost_hit(count, history.seq - (v >> 8))

    def _ghost_hit(self, count: int, age: int) -> None:
        """A block evicted with ``count``, ``age`` evictions ago, was recomputed (ARC)."""

    def _expire(self) -> None:
        heap = self._expiry
        now = self._clock()
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != (at, level):
                continue  # stale: the slot was pushed again since
            del self._expires[slot]
            lvl = self._levels[level]
            seg = self._loc.get(slot)
            if seg is None or (seg is not lvl.recent and seg is not lvl.frequent):
                continue
            default = self._level(DEFAULT_PRIORITY)
            dst = default.frequent if seg is lvl.frequent else default.recent
            dst[slot] = seg.pop(slot)
            self._loc[slot] = dst

    def _pop_laps(self, frequent: OrderedDict[int, int]) -> tuple[int, int]:
        """Pop the frequent segment's victim, sending blocks with laps left round again."""
        credits = self._credits
        while True:
            slot, count = frequent.popitem(last=False)
            c = credits[slot]
            if not c:
                return slot, count
            credits[slot] = c - 1
            frequent[slot] = count  # another lap: back to the most recent end

    def _simulate_level(self, lvl: _Level) -> list[int]:
        """The order :meth:`pop` would empty ``lvl`` in, without changing anything."""
        recent = list(lvl.recent)
        frequent: deque[tuple[int, int]] = deque(
            (s, self._credits[s] if self.MAX_LAPS else 0) for s in lvl.frequent
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


class TwoQueue(SegmentedPolicy):
    """2Q: a FIFO for blocks released once (a quarter of the level), the rest LRU.

    First-time blocks wait in the recent FIFO; while it holds more than 25% of the level it
    gives the victims, so one-off traffic cycles through it without flushing the blocks that
    were reused. A block released again (after a hit, or recomputed while the history held
    its key: 2Q's A1out) joins the frequent LRU.
    """

    __slots__ = ()
    RECENT_SHARE = 0.25


class S3FIFO(SegmentedPolicy):
    """S3-FIFO: a small FIFO (10% of the level) for new blocks and a main FIFO with laps.

    New blocks enter the small FIFO and mostly leave it quickly (one-hit wonders); reused
    blocks enter the main FIFO with ``min(count - 2, 3)`` credits: at the head of the queue a
    block with credits goes back to the tail (lazy promotion) and loses one, so blocks reused
    often outlive blocks reused once. A parent's count is at least its child's, so it never
    gets fewer laps than a child released with it.
    """

    __slots__ = ()
    RECENT_SHARE = 0.10
    MAX_LAPS = 3


class ARC(SegmentedPolicy):
    """ARC: the recent/frequent split adapts to ghost hits.

    ``target`` (in [0, 1], start 0) is the share of a level the recent segment keeps. A
    block recomputed into the GPU pool whose ghost is at most ``capacity`` evictions old (a
    bigger pool would have kept it: ARC's B1 and B2 hold at most one cache of ghosts) moves
    it: evicted with count 1, the recent segment was too small, the target grows by
    ``max(1, B2/B1) / capacity``; evicted with a higher count, it shrinks by
    ``max(1, B1/B2) / capacity`` (B1, B2: ghosts of each kind in the history). The tiers of a
    layer group share the target. On traffic whose blocks come back once, soon, the target
    grows until ARC hits about as often as LRU, where the fixed splits of 2Q and S3-FIFO
    evict the blocks before their second use.
    """

    __slots__ = ()
    RECENT_SHARE = 0.0
    COUNT_GHOSTS = True

    @property
    def target(self) -> float:
        """The recent segment's current share of a level."""
        return self._history.share

    def _ghost_hit(self, count: int, age: int) -> None:
        size = self._capacity
        if not size or age > size:
            return
        history = self._history
        b1, b2 = max(history.ghosts[0], 1), max(history.ghosts[1], 1)
        if count == 1:
            history.share = min(1.0, history.share + max(1.0, b2 / b1) / size)
        else:
            history.share = max(0.0, history.share - max(1.0, b1 / b2) / size)


def _recent_run(nr: int, nf: int, share: float, left: int) -> int:
    """How many of the next ``left`` victims of a level come from its recent segment.

    The recent segment (``nr`` blocks) gives a victim while it holds more than ``share`` of
    the level (``nf`` frequent blocks), or the frequent segment is empty. That test
    ``nr - r > share * (nr - r + nf)`` holds for r = 0, 1, ... up to some point and then no
    more: the run is found from the closed form and settled exactly by the same test.
    """
    if not nf or share <= 0.0:  # the test holds while any recent block is left
        return min(left, nr)
    if share >= 1.0:  # the test never holds
        return 0
    run = min(max(nr - int(share * nf / (1.0 - share)) - 1, 0), left)
    while run > 0 and not nr - run + 1 > share * (nr - run + 1 + nf):
        run -= 1
    while run < left and nr - run > share * (nr - run + nf):
        run += 1
    return run


def _check_gate(gate: object) -> None:
    if gate not in OFFLOAD_GATES:
        raise InvalidArgumentError(
            f"unknown offload gate {gate!r}; expected one of {list(OFFLOAD_GATES)}"
        )


POLICIES: dict[str, type[PrioritizedLRU] | type[SegmentedPolicy]] = {
    "lru": PrioritizedLRU,
    "2q": TwoQueue,
    "s3fifo": S3FIFO,
    "arc": ARC,
}
"""Eviction policies by ``CacheConfig.eviction_policy`` name."""


def _factory(name: str) -> type[PrioritizedLRU] | type[SegmentedPolicy]:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None


def make_policy(name: str, clock: Callable[[], float], *, capacity: int | None = None,
                offload_gate: str = "all") -> EvictionPolicy:
    """Build the policy registered under ``name`` for one pool of ``capacity`` slots.

    ``capacity`` sizes the history of the policies that keep one (None: learnt from the slots
    pushed). ``offload_gate`` is ``"all"`` or ``"reused"`` (only victims released more than
    once may go down a tier; LRU keeps no history and ignores it).
    """
    return _factory(name)(clock, capacity=capacity, offload_gate=offload_gate)


def make_policies(config: CacheConfig, clock: Callable[[], float]) -> list[list[EvictionPolicy]]:
    """A manager's free queues, ``[tier][layer group]``, one per pool of ``config.slots``.

    The policy is ``config.eviction_policy`` with ``config.offload_gate``. The tiers of one
    layer group share one :class:`KeyHistory`, bounded to ``config.eviction_history_multiple
    x`` the group's slots on all tiers, so counts follow blocks between tiers.
    """
    factory = _factory(config.eviction_policy)
    gate = config.offload_gate
    slots = config.slots
    if not issubclass(factory, SegmentedPolicy):
        return [[factory(clock, capacity=n, offload_gate=gate) for n in tier] for tier in slots]
    multiple = config.eviction_history_multiple
    histories = [
        KeyHistory(int(multiple * sum(tier[g] for tier in slots)), factory.RECENT_SHARE,
                   count_ghosts=factory.COUNT_GHOSTS)
        for g in range(config.num_groups)
    ]
    return [
        [factory(clock, capacity=n, offload_gate=gate, ghost_multiple=multiple, tier=t,
                 history=histories[g])
         for g, n in enumerate(tier)]
        for t, tier in enumerate(slots)
    ]
