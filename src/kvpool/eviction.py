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
- Misuse raises before any state changes (``push`` of a queued slot, ``remove`` of an unqueued
  one); ``pop`` on an empty queue raises :class:`IndexError`.

Policies (``POLICIES``, chosen by ``CacheConfig(eviction_policy=...)``):

``lru``
    :class:`PrioritizedLRU`, the default: least recently released first, no history.
``2q``, ``s3fifo``, ``arc``
    Scan-resistant policies (:class:`TwoQueue`, :class:`S3FIFO`, :class:`ARC`) built on
    :class:`SegmentedPolicy`: each level has a *recent* segment (blocks released once) and a
    *frequent* segment (blocks released again: hit while cached, or recomputed while their
    key was still in the ghost history). They differ in how the two segments share the
    level: a fixed 25% for the recent FIFO (2Q, Johnson & Shasha 1994), a 10% small FIFO and
    a main FIFO that gives frequently used blocks extra laps (S3-FIFO, Yang et al. 2023), or
    a share adapted from ghost hits (ARC, Megiddo & Modha 2003).

Prefix trees. The manager drops a full-attention block's queued descendants with it, and
pushes a released sequence's blocks tail first. A block is released at least as often as any
descendant (every use of a child uses its parent), so the frequency classes never put a
child in a better class than its parent, and within a segment the release order puts a
sequence's tail before its head: chains are eaten from the tail, never cut at the head while
the tail stays cached.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.config import DEFAULT_PRIORITY, OFFLOAD_GATES
from kvpool.errors import InvalidArgumentError
from kvpool.hashing import BlockKey

DEFAULT_GHOST_MULTIPLE = 4.0
"""Default bound of a history-keeping policy's ghost state, as a multiple of its pool size."""


class EvictionPolicy(Protocol):
    """What the manager needs from a free queue."""

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        """``slot``, holding the block ``key``, became evictable (most recently released)."""

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        """Bulk ``push`` without expiry, in order (the last is the most recent)."""

    def should_offload(self, slot: int) -> bool:
        """May the victim just popped from ``slot`` move to a colder tier (else it drops)?"""

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
    """LRU within each retention priority level; lowest priority evicted first.

    Keeps no history: ``should_offload`` is always True, whatever the offload gate.
    """

    __slots__ = ("_buckets", "_clock", "_expires", "_expiry", "_level", "_order")

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all") -> None:
        _check_gate(offload_gate)
        self._clock = clock
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._order: list[int] = []  # non-empty-or-once-used priority levels, ascending
        self._level: dict[int, int] = {}  # slot -> priority level it is queued at
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, slot, level) min-heap
        # slot -> the expiry of its current push; tells a live heap entry from a stale one
        self._expires: dict[int, float] = {}

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
            self._expires[slot] = expires_at
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

    def should_offload(self, slot: int) -> bool:
        return True

    def _expire(self) -> None:
        heap = self._expiry
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != at:
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


class _Level:
    """One priority level of a segmented policy: slot -> release count, oldest first."""

    __slots__ = ("frequent", "recent")

    def __init__(self) -> None:
        self.recent: OrderedDict[int, int] = OrderedDict()  # released once
        self.frequent: OrderedDict[int, int] = OrderedDict()  # released more than once


class SegmentedPolicy:
    """Base of the scan-resistant policies: two segments per level and a ghost history.

    A block's *count* is how often its key has been released into this pool: 1 on its first
    push, +1 on every later push of the same key, whether it was hit while cached (``remove``
    then ``push``) or evicted and recomputed while its key was still in the history. Blocks
    with count 1 queue in the level's *recent* segment, the others in its *frequent* segment,
    each oldest first. Subclasses decide which segment gives the victim (:meth:`_pop_level`,
    :meth:`_simulate_level`).

    History: the counts of keys that left the queue (popped: the ghost proper, or removed:
    claimed by a sequence) live in one insertion-ordered map, bounded to ``ghost_multiple x
    pool size`` entries (the pool size is ``capacity``, or the highest slot seen + 1): the
    oldest entry is forgotten first. A key pushed again takes its count back out of it.

    Offload gate: with ``offload_gate="reused"`` only a victim whose count is > 1 may go to a
    colder tier; with ``"all"`` (default) every victim may.
    """

    __slots__ = (
        "_capacity", "_clock", "_counts", "_credits", "_expires", "_expiry", "_gate_all", "_ghosts",
        "_hist", "_hist_cap", "_keys", "_last_count", "_last_slot", "_levels", "_loc",
        "_multiple", "_order", "_share",
    )

    RECENT_SHARE = 0.25
    """Pop from the recent segment while it holds more than this share of its level."""
    MAX_LAPS = 0
    """Extra laps through the frequent segment a block may earn (S3-FIFO); 0 = plain FIFO."""
    COUNT_GHOSTS = False
    """Keep ``_ghosts`` (history entries per kind) up to date (ARC adapts on them)."""

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all",
                 ghost_multiple: float = DEFAULT_GHOST_MULTIPLE) -> None:
        _check_gate(offload_gate)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {capacity!r}")
        if (isinstance(ghost_multiple, bool) or not isinstance(ghost_multiple, int | float)
                or not 0 <= ghost_multiple <= 1024):
            raise InvalidArgumentError(
                f"ghost_multiple must be a number in [0, 1024], got {ghost_multiple!r}"
            )
        self._clock = clock
        self._gate_all = offload_gate == "all"
        self._multiple = float(ghost_multiple)
        self._capacity = capacity or 0
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []  # priority levels ever used, ascending
        self._loc: dict[int, OrderedDict[int, int]] = {}  # queued slot -> its segment
        self._keys: list[BlockKey | None] = [None] * self._capacity  # slot -> key pushed
        self._counts = [0] * self._capacity  # slot -> count when it was last claimed
        self._credits = bytearray(self._capacity if self.MAX_LAPS else 0)  # slot -> laps left
        self._hist: OrderedDict[BlockKey, int] = OrderedDict()  # evicted key -> its count
        self._hist_cap = int(self._multiple * self._capacity)
        self._ghosts = [0, 0]  # history entries of count 1 and of count > 1 (if COUNT_GHOSTS)
        self._share = self.RECENT_SHARE
        self._last_slot = -1
        self._last_count = 0
        self._expiry: list[tuple[float, int, int]] = []
        self._expires: dict[int, float] = {}

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
        self._enqueue(self._level(priority), slot, key)
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = expires_at
            heapq.heappush(self._expiry, (expires_at, slot, priority))
        elif self._expires:
            self._expires.pop(slot, None)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        lvl = self._level(priority)
        if slots and max(slots) >= len(self._keys):
            self._grow(max(slots))
        if keys is None:
            for slot in slots:
                self._enqueue(lvl, slot, None)
        else:
            if len(keys) != len(slots):
                raise InvalidArgumentError(f"{len(keys)} keys for {len(slots)} slots")
            self._enqueue_many(lvl, slots, keys)
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def remove(self, slot: int) -> None:
        # claimed: the slot keeps its key and count until it is pushed again (a hit comes
        # back to the same slot), or until another block reuses the slot
        self._counts[slot] = self._loc.pop(slot).pop(slot)

    def pop(self) -> tuple[int, int]:
        if self._expiry:
            self._expire()
        for p in self._order:
            lvl = self._levels[p]
            recent = lvl.recent
            frequent = lvl.frequent
            nr = len(recent)
            if nr and (not frequent or nr > self._share * (nr + len(frequent))):
                slot, count = recent.popitem(last=False)
            elif frequent:
                slot, count = (self._pop_laps(frequent) if self.MAX_LAPS
                               else frequent.popitem(last=False))
            else:
                continue
            del self._loc[slot]
            self._last_slot = slot
            self._last_count = count
            key = self._keys[slot]
            if key is not None:
                self._keys[slot] = None
                hist = self._hist
                hist[key] = count
                if len(hist) > self._hist_cap:
                    _, forgotten = hist.popitem(last=False)
                    if self.COUNT_GHOSTS:
                        self._ghosts[forgotten > 1] -= 1
                if self.COUNT_GHOSTS:
                    self._ghosts[count > 1] += 1
            return slot, p
        raise IndexError("pop from an empty eviction queue")

    def should_offload(self, slot: int) -> bool:
        return self._gate_all or (slot == self._last_slot and self._last_count > 1)

    def peek_order(self) -> list[int]:
        if self._expiry:
            self._expire()
        out: list[int] = []
        for p in self._order:
            lvl = self._levels[p]
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

    def count_of(self, slot: int) -> int:
        """How often the block queued at ``slot`` has been released into this pool."""
        return self._loc[slot][slot]

    def history_size(self) -> int:
        """Entries of the ghost history (bounded by ``ghost_multiple x pool size``)."""
        return len(self._hist)

    def history_bound(self) -> int:
        """The current bound of :meth:`history_size`."""
        return self._hist_cap

    # ------------------------------------------------------------------ internals

    def _level(self, priority: int) -> _Level:
        lvl = self._levels.get(priority)
        if lvl is None:
            lvl = self._levels[priority] = _Level()
            self._order.append(priority)
            self._order.sort()
        return lvl

    def _grow(self, slot: int) -> None:
        """A slot beyond the known pool size: the pool is at least ``slot + 1`` slots."""
        n = slot + 1
        self._keys.extend([None] * (n - len(self._keys)))
        self._counts.extend([0] * (n - len(self._counts)))
        if self.MAX_LAPS:
            self._credits.extend(bytes(n - len(self._credits)))
        self._capacity = max(self._capacity, n)
        self._hist_cap = int(self._multiple * self._capacity)

    def _enqueue(self, lvl: _Level, slot: int, key: BlockKey | None) -> None:
        if key is None:
            count = 1
        elif self._keys[slot] is key:
            count = self._counts[slot] + 1  # released again after a hit
        else:
            count = self._hist.pop(key, 0) + 1
            if count > 1:
                self._ghost_hit(count - 1)
        self._keys[slot] = key
        if count == 1:
            lvl.recent[slot] = 1
            self._loc[slot] = lvl.recent
        else:
            lvl.frequent[slot] = count
            self._loc[slot] = lvl.frequent
            if self.MAX_LAPS:
                self._credits[slot] = min(count - 2, self.MAX_LAPS)

    def _enqueue_many(self, lvl: _Level, slots: Sequence[int],
                      keys: Sequence[BlockKey]) -> None:
        # the hot path of a sequence release: _enqueue inlined, segments bound once
        loc = self._loc
        slot_keys = self._keys
        counts = self._counts
        hist_pop = self._hist.pop
        recent = lvl.recent
        frequent = lvl.frequent
        laps = self.MAX_LAPS
        for slot, key in zip(slots, keys, strict=True):
            if slot_keys[slot] is key:
                v = counts[slot]  # released again after a hit
            else:
                slot_keys[slot] = key
                v = hist_pop(key, 0)
                if not v:
                    recent[slot] = 1
                    loc[slot] = recent
                    continue
                self._ghost_hit(v)
            frequent[slot] = v + 1
            loc[slot] = frequent
            if laps:
                self._credits[slot] = min(v - 1, laps)

    def _expire(self) -> None:
        heap = self._expiry
        now = self._clock()
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != at:
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

    def _ghost_hit(self, count: int) -> None:
        """A key evicted with ``count`` was released again (adaptive policies learn here)."""

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
        """The order :meth:`_pop_level` would empty ``lvl`` in, without changing anything."""
        recent = list(lvl.recent)
        frequent: deque[tuple[int, int]] = deque(
            (s, self._credits[s] if self.MAX_LAPS else 0) for s in lvl.frequent
        )
        share = self._share
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
    were reused. A block released again (a hit, or a ghost hit) joins the frequent LRU.
    """

    __slots__ = ()
    RECENT_SHARE = 0.25


class S3FIFO(SegmentedPolicy):
    """S3-FIFO: a small FIFO (10% of the level) for new blocks and a main FIFO with laps.

    New blocks enter the small FIFO and mostly leave it quickly (one-hit wonders); reused
    blocks enter the main FIFO with ``min(count - 2, 3)`` credits: at the head of the queue a
    block with credits goes back to the tail (lazy promotion) and loses one, so blocks reused
    often outlive blocks reused once. A parent's count is at least its child's, so it never
    has fewer laps left than a child released with it.
    """

    __slots__ = ()
    RECENT_SHARE = 0.10
    MAX_LAPS = 3


class ARC(SegmentedPolicy):
    """ARC: the recent/frequent split adapts to the ghost hits.

    ``target`` (in [0, 1]) is the share of a level the recent segment may keep before it gives
    the victim. A recomputed block whose key was evicted from the recent segment (count 1)
    says the recent segment was too small: the target grows by ``max(1, B2/B1) / pool size``;
    one evicted from the frequent segment shrinks it by ``max(1, B1/B2) / pool size`` (B1, B2:
    ghost entries of each kind). Starts at 0.5.
    """

    __slots__ = ()
    RECENT_SHARE = 0.5
    COUNT_GHOSTS = True

    @property
    def target(self) -> float:
        """The recent segment's current share of a level."""
        return self._share

    def _ghost_hit(self, count: int) -> None:
        ghosts = self._ghosts
        ghosts[count > 1] -= 1
        size = max(self._capacity, 1)
        b1, b2 = max(ghosts[0], 1), max(ghosts[1], 1)
        if count == 1:
            self._share = min(1.0, self._share + max(1.0, b2 / b1) / size)
        else:
            self._share = max(0.0, self._share - max(1.0, b1 / b2) / size)


def _check_gate(gate: object) -> None:
    if gate not in OFFLOAD_GATES:
        raise InvalidArgumentError(
            f"unknown offload gate {gate!r}; expected one of {list(OFFLOAD_GATES)}"
        )


class PolicyFactory(Protocol):
    """Builds a policy for one pool."""

    def __call__(self, clock: Callable[[], float], *, capacity: int | None = ...,
                 offload_gate: str = ...) -> EvictionPolicy: ...


POLICIES: dict[str, PolicyFactory] = {
    "lru": PrioritizedLRU,
    "2q": TwoQueue,
    "s3fifo": S3FIFO,
    "arc": ARC,
}


def make_policy(name: str, clock: Callable[[], float], *, capacity: int | None = None,
                offload_gate: str = "all") -> EvictionPolicy:
    """Build the policy registered under ``name`` for a pool of ``capacity`` slots.

    ``capacity`` sizes the ghost history of the policies that keep one (None: learnt from the
    slots pushed). ``offload_gate`` is ``"all"`` or ``"reused"`` (only victims released more
    than once may go to a colder tier; LRU keeps no history and ignores it).
    """
    try:
        factory = POLICIES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
    return factory(clock, capacity=capacity, offload_gate=offload_gate)
