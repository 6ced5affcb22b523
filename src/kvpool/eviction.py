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

Cost. Every queue is a set of lazy FIFOs (:class:`_Fifo`): a push appends its slots as one
batch and stores one stamp per slot in a list indexed by slot; a claim only changes its
slot's stamp (the entry left behind is dead, skipped later, compacted away once dead entries
outnumber live ones); victims are cut from the oldest batch a slice at a time. So a block
costs a few list stores per push, claim and eviction, and the scan-resistant policies add
their history's dict work (a lookup per new key, an insert per victim).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from itertools import count as counter
from itertools import islice, repeat
from operator import eq, itemgetter, lshift, or_
from typing import Protocol, cast

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



# ---------------------------------------------------------------------------- lazy FIFOs

_ID_BITS = 20
_ID_MASK = (1 << _ID_BITS) - 1
_STEP = 1 << _ID_BITS  # stamps of successive batches: (batch number << _ID_BITS) | FIFO id
_NOT_QUEUED = -1  # a slot's stamp while it is in no FIFO, or in a segmented policy after a
_CLAIMED = -2  # ``remove`` from a recent segment (count 1) ...
_CLAIMED_FREQUENT = -3  # ... or from a frequent one (count in ``_counts``)
_SLACK = 1024  # dead entries tolerated beyond the live ones before a compaction


class _Fifo:
    """One FIFO of a policy, oldest first, with lazy deletion.

    Each push (or expiry move) appends one batch ``(stamp, slots)``; the stamp is unique to
    the batch and carries the FIFO's ``id`` in its low ``_ID_BITS`` bits. The policy keeps
    ``stamp[slot]`` for every slot, and an entry ``slots[i]`` of a batch is *live* (the slot
    is queued here, at this place) iff ``stamp[slots[i]]`` is the batch's stamp and, in the
    oldest batch, ``i >= head``. Removing a slot only changes its stamp, so the entry left
    behind is dead; taking victims skips dead entries, and the policy compacts its FIFOs when
    dead entries outnumber live ones by ``_SLACK``. Invariants: the oldest batch has an entry
    at ``head`` (a batch is dropped once consumed, and no batch is empty); ``dead`` counts
    the dead entries from ``head`` on (while it is 0, every entry is live: no check needed).
    """

    __slots__ = ("batches", "dead", "frequent", "head", "id", "priority")

    def __init__(self, fid: int, priority: int, frequent: bool) -> None:
        if fid > _ID_MASK:
            raise InvalidArgumentError(
                f"an eviction policy takes at most {(_ID_MASK + 1) // 2} priority levels"
            )
        self.id = fid
        self.priority = priority
        self.frequent = frequent
        self.batches: deque[tuple[int, list[int]]] = deque()
        self.head = 0
        self.dead = 0


def _take(fifo: _Fifo, k: int, stamp: list[int]) -> tuple[list[int], int]:
    """Take up to ``k`` live slots from the head of ``fifo`` (their stamps become
    ``_NOT_QUEUED``): the slots in order, and how many entries were consumed."""
    out: list[int] = []
    batches = fifo.batches
    h = fifo.head
    used = 0
    while batches and len(out) < k:
        b, sl = batches[0]
        cand = sl[h:h + k - len(out)]
        m = len(cand)
        if fifo.dead and (itemgetter(*cand)(stamp).count(b) != m if m > 1
                          else stamp[cand[0]] != b):  # skip the dead
            cand = [s for s in cand if stamp[s] == b]
            fifo.dead -= m - len(cand)
        out += cand
        for s in cand:
            stamp[s] = _NOT_QUEUED
        h += m
        used += m
        if h == len(sl):
            batches.popleft()
            h = 0
    fifo.head = h
    return out, used


def _take_one(fifo: _Fifo, stamp: list[int]) -> tuple[int, int]:
    """``_take(fifo, 1, stamp)`` for one victim: (its slot or -1 if none is live, entries
    consumed)."""
    batches = fifo.batches
    h = fifo.head
    used = 0
    while batches:
        b, sl = batches[0]
        s = sl[h]
        h += 1
        used += 1
        if h == len(sl):
            batches.popleft()
            h = 0
        if stamp[s] == b:
            stamp[s] = _NOT_QUEUED
            fifo.head = h
            return s, used
        fifo.dead -= 1
    fifo.head = 0
    return -1, used


def _live(fifo: _Fifo, stamp: list[int]) -> list[int]:
    """The slots queued in ``fifo``, oldest first (nothing changes)."""
    out: list[int] = []
    h = fifo.head
    for b, sl in fifo.batches:
        out += [s for s in (sl[h:] if h else sl) if stamp[s] == b]
        h = 0
    return out


def _compact(fifos: list[_Fifo], stamp: list[int]) -> None:
    """Drop every dead entry (batches keep their stamps; emptied ones go)."""
    for fifo in fifos:
        batches: deque[tuple[int, list[int]]] = deque()
        h = fifo.head
        for b, sl in fifo.batches:
            live = [s for s in (sl[h:] if h else sl) if stamp[s] == b]
            if live:
                batches.append((b, live))
            h = 0
        fifo.batches = batches
        fifo.head = 0
        fifo.dead = 0


def _cut_tail(fifos: list[_Fifo], stamp: list[int], slots: Sequence[int]) -> _Fifo | None:
    """If ``slots`` are the newest entries of one FIFO, newest first, all queued (a sequence
    released tail first and claimed again root first), cut them off and return that FIFO;
    else return None, nothing changed. The caller updates the slots' stamps and counts."""
    k = len(slots)
    v = stamp[slots[0]] if 0 <= slots[0] < len(stamp) else _NOT_QUEUED
    if v < 0:
        return None
    fifo = fifos[v & _ID_MASK]
    batches = fifo.batches
    b, sl = batches[-1]
    if b != v or len(sl) < k:
        return None
    tail = sl[len(sl) - k:]
    tail.reverse()
    if tail != (slots if isinstance(slots, list) else list(slots)) or (
            fifo.dead and k > 1 and itemgetter(*slots)(stamp).count(b) != k):
        return None
    del sl[len(sl) - k:]
    if not sl or (len(batches) == 1 and fifo.head >= len(sl)):
        batches.pop()
        if not batches:
            fifo.head = 0
    return fifo


def _is_queued(stamp: list[int], slot: object) -> bool:
    return isinstance(slot, int) and 0 <= slot < len(stamp) and stamp[slot] >= 0


def _stamp_of(stamp: list[int], slot: int) -> int:
    """The stamp of a queued slot (``KeyError`` if it is not queued)."""
    v = stamp[slot] if 0 <= slot < len(stamp) else _NOT_QUEUED
    if v < 0:
        raise KeyError(slot)
    return v


class PrioritizedLRU:
    """LRU within each retention priority level; lowest priority evicted first.

    Keeps no history: ``should_offload`` is always True, whatever the offload gate.

    Layout: one :class:`_Fifo` per level (``_ranked``: ascending priority) and a stamp per
    slot (a list indexed by slot, grown on demand past ``capacity``), so a push stores one
    int per slot, a removal one, and a victim costs a slice of its batch and one store.
    ``push_many`` trusts the manager: its slots are distinct and none is queued (``push``
    checks); slots are pool indices (ints >= 0).
    """

    __slots__ = (
        "_clock", "_expires", "_expiry", "_fifos", "_len", "_levels", "_next", "_ranked",
        "_stamp", "_stored",
    )

    uses_keys = False

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 offload_gate: str = "all") -> None:
        _check_gate(offload_gate)
        self._clock = clock
        self._stamp: list[int] = [_NOT_QUEUED] * (capacity or 0)  # slot -> stamp, see _Fifo
        self._levels: dict[int, _Fifo] = {}
        self._fifos: list[_Fifo] = []  # by id
        self._ranked: list[_Fifo] = []  # by ascending priority
        self._next = 0  # the next batch's stamp, without its FIFO id
        self._len = 0  # slots queued
        self._stored = 0  # entries in the FIFOs, live and dead
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, slot, level) min-heap
        # slot -> (expiry, level) of its current push; tells live heap entries from stale ones
        self._expires: dict[int, tuple[float, int]] = {}

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: object) -> bool:
        return _is_queued(self._stamp, slot)

    def _fifo(self, priority: int) -> _Fifo:
        fifo = self._levels.get(priority)
        if fifo is None:
            fifo = self._levels[priority] = _Fifo(len(self._fifos), priority, False)
            self._fifos.append(fifo)
            self._ranked.append(fifo)
            self._ranked.sort(key=lambda f: f.priority)
        return fifo

    def _append(self, fifo: _Fifo, slots: list[int]) -> None:
        """Queue ``slots`` (not queued, in range) at the most recent end of ``fifo``."""
        b = self._next | fifo.id
        self._next += _STEP
        stamp = self._stamp
        for s in slots:
            stamp[s] = b
        fifo.batches.append((b, slots))
        self._len += len(slots)
        self._stored += len(slots)

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        stamp = self._stamp
        if slot < 0:
            raise InvalidArgumentError(f"slot must be an int >= 0, got {slot}")
        if slot >= len(stamp):
            stamp.extend([_NOT_QUEUED] * (slot + 1 - len(stamp)))
        elif stamp[slot] >= 0:
            raise InvalidArgumentError(f"slot {slot} is already evictable")
        self._append(self._levels.get(priority) or self._fifo(priority), [slot])
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = (expires_at, priority)
            heapq.heappush(self._expiry, (expires_at, slot, priority))
        elif self._expires:
            self._expires.pop(slot, None)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        if not slots:
            return
        fifo = self._levels.get(priority) or self._fifo(priority)
        try:
            self._append(fifo, list(slots))
        except IndexError:  # a slot beyond the known pool size: grow, then again
            self._stamp.extend([_NOT_QUEUED] * (max(slots) + 1 - len(self._stamp)))
            self._append(fifo, list(slots))
        if self._expires:
            for slot in slots:
                self._expires.pop(slot, None)

    def remove(self, slot: int) -> None:
        self._fifos[_stamp_of(self._stamp, slot) & _ID_MASK].dead += 1  # (KeyError if not queued)
        self._stamp[slot] = _NOT_QUEUED
        self._len -= 1
        if self._stored > 2 * self._len + _SLACK:
            self._compact()

    def remove_many(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        stamp = self._stamp
        if _cut_tail(self._fifos, stamp, slots) is not None:  # no dead entries left behind
            for s in slots:
                stamp[s] = _NOT_QUEUED
            self._len -= len(slots)
            self._stored -= len(slots)
            return
        fifos = self._fifos
        try:
            for s in slots:
                v = stamp[s]
                if v < 0:
                    break
                fifos[v & _ID_MASK].dead += 1
                stamp[s] = _NOT_QUEUED
            else:
                self._len -= len(slots)
                if self._stored > 2 * self._len + _SLACK:
                    self._compact()
                return
        except IndexError:
            pass
        self._len -= slots.index(s)  # the ones before it were removed
        raise KeyError(s)

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        if self._expiry:
            self._expire()
        if n > self._len:
            raise IndexError(f"pop of {n} from an eviction queue of {self._len}")
        out: list[tuple[int, int]] = []
        if n <= 0:
            return out
        stamp = self._stamp
        for fifo in self._ranked:
            if not fifo.batches:
                continue
            h = fifo.head
            sl = fifo.batches[0][1]
            if not fifo.dead and len(out) + len(sl) - h >= n:
                # the rest are live entries of the oldest batch: _take, without the call
                got = sl[h:h + n - len(out)]
                for s in got:
                    stamp[s] = _NOT_QUEUED
                fifo.head = h + len(got)
                if fifo.head == len(sl):
                    fifo.batches.popleft()
                    fifo.head = 0
                self._stored -= len(got)
                out += zip(got, repeat(fifo.priority))
                break
            got, used = _take(fifo, n - len(out), stamp)
            self._stored -= used
            out += zip(got, repeat(fifo.priority))
            if len(out) == n:
                break
        self._len -= n
        return out

    def pop(self) -> tuple[int, int]:
        if self._expiry:
            self._expire()
        if self._len:
            for fifo in self._ranked:
                if fifo.batches:
                    slot, used = _take_one(fifo, self._stamp)
                    self._stored -= used
                    if slot >= 0:
                        self._len -= 1
                        return slot, fifo.priority
        raise IndexError("pop from an empty eviction queue")

    def should_offload(self, slot: int) -> bool:
        return True

    def peek_order(self) -> list[int]:
        if self._expiry:
            self._expire()
        out: list[int] = []
        for fifo in self._ranked:
            out += _live(fifo, self._stamp)
        return out

    def priority_of(self, slot: int) -> int:
        if self._expiry:
            self._expire()
        return self._fifos[_stamp_of(self._stamp, slot) & _ID_MASK].priority

    def _compact(self) -> None:
        _compact(self._fifos, self._stamp)
        self._stored = self._len

    def _expire(self) -> None:
        heap = self._expiry
        now = self._clock()
        stamp = self._stamp
        while heap and heap[0][0] <= now:
            at, slot, level = heapq.heappop(heap)
            if self._expires.get(slot) != (at, level):
                continue  # stale: the slot was pushed again since
            del self._expires[slot]
            v = stamp[slot]
            if v >= 0 and self._fifos[v & _ID_MASK].priority == level:
                self._fifos[v & _ID_MASK].dead += 1
                self._len -= 1  # its entry dies; _append counts it again
                self._append(self._fifo(DEFAULT_PRIORITY), [slot])
        if self._stored > 2 * self._len + _SLACK:
            self._compact()


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

    def add_ghosts(self, keys: Sequence[BlockKey], counts: list[int]) -> None:
        """``add(key, count, ghost=True)`` of each pair in order (counts >= 1), when no trim
        can happen on the way (``len(self) + len(keys) <= bound``): the entries go in at
        once."""
        self.add_capped(keys, [c if c < 255 else 255 for c in counts])

    def add_capped(self, keys: Sequence[BlockKey], values: Sequence[int]) -> None:
        """:meth:`add_ghosts` of counts already capped, ``min(count, 255)``."""
        if self.count_ghosts:
            first = self.seq + 1
            self.seq += len(values)
            frequent = len(values) - values.count(1)
            self.ghosts[1] += frequent
            self.ghosts[0] += len(values) - frequent
            values = list(map(or_, map(lshift, counter(first), repeat(8)), values))  # stamp << 8
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
            deque(map(entries.pop, old), maxlen=0)


class _Level:
    """One priority level of a segmented policy: its recent (count 1) and frequent FIFOs."""

    __slots__ = ("frequent", "priority", "recent")

    def __init__(self, fid: int, priority: int) -> None:
        self.priority = priority
        self.recent = _Fifo(fid, priority, False)  # even ids
        self.frequent = _Fifo(fid + 1, priority, True)  # odd ids


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

    Layout: each segment is a :class:`_Fifo` (recent: even id, frequent: odd id) with its
    live count in ``_live[id]``; per slot (lists indexed by slot, grown past ``capacity`` on
    demand) a stamp, the key last pushed, the count of a frequent block (a recent one's is
    1) and S3-FIFO's laps left. A claimed slot's stamp is ``_CLAIMED`` or
    ``_CLAIMED_FREQUENT`` (its key and count stay), which is how a push tells a block
    released again after a hit (same slot, same key) from a new one; a popped slot's is
    ``_NOT_QUEUED`` (its key is stale). Slots are pool indices (ints >= 0), distinct within
    one ``push_many`` or ``remove_many``.
    """

    __slots__ = (
        "_capacity", "_clock", "_counts", "_credits", "_expires", "_expiry", "_fifos",
        "_gate_all", "_history", "_keyless", "_keys", "_last_count", "_last_slot", "_len",
        "_levels", "_live", "_multiple", "_next", "_ranked", "_stamp", "_stored", "_tier0",
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
        self._ranked: list[_Level] = []  # levels ever used, ascending priority
        self._fifos: list[_Fifo] = []  # by id
        self._live: list[int] = []  # FIFO id -> slots queued in it
        self._next = 0  # the next batch's stamp, without its FIFO id
        self._len = 0  # slots queued
        self._stored = 0  # entries in the FIFOs, live and dead
        self._keyless = False  # was a slot ever pushed without a key?
        self._stamp = [_NOT_QUEUED] * self._capacity  # slot -> stamp, see _Fifo
        self._keys: list[BlockKey | None] = [None] * self._capacity  # slot -> key pushed
        self._counts = [0] * self._capacity  # slot -> its count, if queued as frequent
        self._credits = bytearray(self._capacity if self.MAX_LAPS else 0)  # slot -> laps left
        self._last_slot = -1
        self._last_count = 0
        self._expiry: list[tuple[float, int, int]] = []
        self._expires: dict[int, tuple[float, int]] = {}  # as in PrioritizedLRU

    # ------------------------------------------------------------------ protocol

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: object) -> bool:
        return _is_queued(self._stamp, slot)

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        stamp = self._stamp
        if slot < 0:
            raise InvalidArgumentError(f"slot must be an int >= 0, got {slot}")
        if slot >= len(stamp):
            self._grow(slot)
        elif stamp[slot] >= 0:
            raise InvalidArgumentError(f"slot {slot} is already evictable")
        lvl = self._levels.get(priority) or self._level(priority)
        if key is None:
            self._keys[slot] = None
            self._keyless = True
            self._append(lvl.recent, [slot])
        else:
            v = stamp[slot]
            self._enqueue_many(lvl, (slot,), (key,), (v,), int(v == _CLAIMED),
                               int(v == _CLAIMED_FREQUENT))
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
        stamp = self._stamp
        n = len(slots)
        grow = False
        try:
            sts: tuple[int, ...] = itemgetter(*slots)(stamp) if n > 1 else (stamp[slots[0]],)
        except IndexError:  # a slot beyond the known pool size
            sts = tuple(stamp[s] if s < len(stamp) else _NOT_QUEUED for s in slots)
            grow = True
        free = sts.count(_NOT_QUEUED)  # (count is fast on equal small ints: the same object)
        frequent = sts.count(_CLAIMED_FREQUENT) if free < n else 0
        recent = sts.count(_CLAIMED) if free + frequent < n else 0
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
        v = _stamp_of(self._stamp, slot)
        self._live[v & _ID_MASK] -= 1
        self._fifos[v & _ID_MASK].dead += 1
        self._len -= 1
        # the slot keeps its key and count: a GPU hit comes back to the same slot
        self._stamp[slot] = _CLAIMED_FREQUENT if v & 1 else _CLAIMED
        if not self._tier0:
            key = self._keys[slot]
            if key is not None:
                # claimed from a colder tier: the GPU pool it goes to takes the count over
                self._history.add(key, self._counts[slot] if v & 1 else 1, ghost=False)
        if self._stored > 2 * self._len + _SLACK:
            self._compact()

    def remove_many(self, slots: Sequence[int]) -> None:
        if not self._tier0:
            for slot in slots:
                self.remove(slot)
            return
        if not slots:
            return
        stamp = self._stamp
        fifo = _cut_tail(self._fifos, stamp, slots)
        if fifo is not None:  # no dead entries left behind
            mark = _CLAIMED_FREQUENT if fifo.frequent else _CLAIMED
            for s in slots:
                stamp[s] = mark
            self._live[fifo.id] -= len(slots)
            self._len -= len(slots)
            self._stored -= len(slots)
            return
        live = self._live
        fifos = self._fifos
        try:
            for s in slots:  # ``remove`` on the GPU tier
                v = stamp[s]
                if v < 0:
                    break
                live[v & _ID_MASK] -= 1
                fifos[v & _ID_MASK].dead += 1
                stamp[s] = _CLAIMED - (v & 1)  # _CLAIMED_FREQUENT from a frequent FIFO
            else:
                self._len -= len(slots)
                if self._stored > 2 * self._len + _SLACK:
                    self._compact()
                return
        except IndexError:
            pass
        self._len -= slots.index(s)  # the ones before it were removed
        raise KeyError(s)

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        # n victims as ``pop`` gives them: runs of them from one segment at a time, then
        # every victim's key joins the history, in victim order
        if n > self._len:
            raise IndexError(f"pop of {n} from an eviction queue of {self._len}")
        if self._expiry:
            self._expire()
        out: list[tuple[int, int]] = []
        if n <= 0:
            return out
        share = self._history.share
        live = self._live
        stamp = self._stamp
        victims: list[int] = []
        values: list[int] = []  # the victims' history values, min(count, 255)
        while len(out) < n:
            lvl = self._lowest_level()
            recent, frequent = lvl.recent, lvl.frequent
            nr, nf = live[recent.id], live[frequent.id]
            run = _recent_run(nr, nf, share, n - len(out))
            if run:
                got, used = _take(recent, run, stamp)
                live[recent.id] = nr - run
                values += [1] * run
            else:
                run = _frequent_run(nr, nf, share, n - len(out))
                got, used = (self._take_laps(frequent, run) if self.MAX_LAPS
                             else _take(frequent, run, stamp))
                live[frequent.id] = nf - run
                counts = itemgetter(*got)(self._counts) if run > 1 else (self._counts[got[0]],)
                values += counts if max(counts) < 255 else [c if c < 255 else 255 for c in counts]
            self._stored -= used
            victims += got
            out += zip(got, repeat(lvl.priority))
        self._len -= n
        self._forget(victims, values)
        self._last_slot, self._last_count = victims[-1], values[-1]
        return out

    def pop(self) -> tuple[int, int]:
        # pop_many(1) without its batching (the tiered path takes victims one at a time)
        if not self._len:
            raise IndexError("pop from an empty eviction queue")
        if self._expiry:
            self._expire()
        lvl = self._lowest_level()
        live = self._live
        recent, frequent = lvl.recent, lvl.frequent
        if _recent_run(live[recent.id], live[frequent.id], self._history.share, 1):
            slot, used = _take_one(recent, self._stamp)
            live[recent.id] -= 1
            count = 1
        else:
            if self.MAX_LAPS:
                got, used = self._take_laps(frequent, 1)
                slot = got[0]
            else:
                slot, used = _take_one(frequent, self._stamp)
            live[frequent.id] -= 1
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

    def peek_order(self) -> list[int]:
        if self._expiry:
            self._expire()
        out: list[int] = []
        for lvl in self._ranked:
            out.extend(self._simulate_level(lvl))
        return out

    def priority_of(self, slot: int) -> int:
        if self._expiry:
            self._expire()
        return self._fifos[_stamp_of(self._stamp, slot) & _ID_MASK].priority

    # ------------------------------------------------------------------ introspection

    @property
    def history(self) -> KeyHistory:
        """The key history this policy reads and feeds (shared by a layer group's tiers)."""
        return self._history

    def count_of(self, slot: int) -> int:
        """The count of the block queued at ``slot``."""
        return self._counts[slot] if _stamp_of(self._stamp, slot) & 1 else 1

    def is_frequent(self, slot: int) -> bool:
        """Whether the block queued at ``slot`` is in its level's frequent segment."""
        return bool(_stamp_of(self._stamp, slot) & 1)

    # ------------------------------------------------------------------ internals

    def _lowest_level(self) -> _Level:
        """The lowest priority level holding a block (the queue is not empty)."""
        live = self._live
        for lvl in self._ranked:
            if live[lvl.recent.id] or live[lvl.frequent.id]:
                return lvl
        raise IndexError("pop from an empty eviction queue")

    def _level(self, priority: int) -> _Level:
        lvl = self._levels.get(priority)
        if lvl is None:
            lvl = self._levels[priority] = _Level(len(self._fifos), priority)
            self._fifos += (lvl.recent, lvl.frequent)
            self._live += (0, 0)
            self._ranked.append(lvl)
            self._ranked.sort(key=lambda lv: lv.priority)
        return lvl

    def _grow(self, slot: int) -> None:
        """A slot beyond the known pool size: the pool is at least ``slot + 1`` slots."""
        n = slot + 1
        self._stamp.extend([_NOT_QUEUED] * (n - len(self._stamp)))
        self._keys.extend([None] * (n - len(self._keys)))
        self._counts.extend([0] * (n - len(self._counts)))
        if self.MAX_LAPS:
            self._credits.extend(bytes(n - len(self._credits)))
        self._capacity = max(self._capacity, n)
        self._history.bound = max(self._history.bound, int(self._multiple * self._capacity))

    def _append(self, fifo: _Fifo, slots: list[int]) -> None:
        """Queue ``slots`` (not queued, in range) at the most recent end of ``fifo``."""
        b = self._next | fifo.id
        self._next += _STEP
        stamp = self._stamp
        for s in slots:
            stamp[s] = b
        fifo.batches.append((b, slots))
        self._live[fifo.id] += len(slots)
        self._len += len(slots)
        self._stored += len(slots)

    def _enqueue_many(self, lvl: _Level, slots: Sequence[int], keys: Sequence[BlockKey],
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
            if stamps[:j].count(_NOT_QUEUED) == j:  # the claimed ones are the last ones
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
                if cs != sorted(cs):
                    _chain_floor(cs)
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
            _chain_floor(cs)
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
            return [c + 1 for c in got]
        return [c + 1 if v == _CLAIMED_FREQUENT else 2 for c, v in zip(got, stamps, strict=True)]

    def _append_keyed(self, fifo: _Fifo, slots: list[int], keys: Sequence[BlockKey]) -> None:
        """``_append`` that also stores the slots' keys."""
        b = self._next | fifo.id
        self._next += _STEP
        stamp = self._stamp
        slot_keys = self._keys
        for s, k in zip(slots, keys, strict=True):
            stamp[s] = b
            slot_keys[s] = k
        fifo.batches.append((b, slots))
        self._live[fifo.id] += len(slots)
        self._len += len(slots)
        self._stored += len(slots)

    def _append_frequent(self, fifo: _Fifo, slots: list[int],
                         keys: Sequence[BlockKey] | None, counts: list[int]) -> None:
        """``_append`` of blocks of count > 1, with their counts (and laps) and keys (None:
        the keys the slots hold)."""
        b = self._next | fifo.id
        self._next += _STEP
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
        self._live[fifo.id] += len(slots)
        self._len += len(slots)
        self._stored += len(slots)

    def _enqueue_each(self, lvl: _Level, slots: Sequence[int], keys: Sequence[BlockKey],
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
            if v0 < _NOT_QUEUED and old is not None and (old is key or old == key):
                # back after a claim (a hit, or a partial copy)
                count = (counts[slot] if v0 == _CLAIMED_FREQUENT else 1) + bump
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

    def _compact(self) -> None:
        _compact(self._fifos, self._stamp)
        self._stored = self._len

    def _expire(self) -> None:
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
            src = self._fifos[v & _ID_MASK]
            if src.priority != level:
                continue
            default = self._level(DEFAULT_PRIORITY)
            self._live[src.id] -= 1
            src.dead += 1
            self._len -= 1  # its entry dies; _append counts it again
            self._append(default.frequent if src.frequent else default.recent, [slot])
        if self._stored > 2 * self._len + _SLACK:
            self._compact()

    def _take_laps(self, frequent: _Fifo, k: int) -> tuple[list[int], int]:
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
            self._next += _STEP
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
                stamp[s] = _NOT_QUEUED
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

    def _simulate_level(self, lvl: _Level) -> list[int]:
        """The order :meth:`pop` would empty ``lvl`` in, without changing anything."""
        recent = _live(lvl.recent, self._stamp)
        frequent: deque[tuple[int, int]] = deque(
            (s, self._credits[s] if self.MAX_LAPS else 0) for s in _live(lvl.frequent,
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

    def _ghosts_back(self, found: Sequence[int]) -> None:
        # each ghost found moves the target, in order (the ghost counts B1, B2 change on the way)
        history = self._history
        ghosts = history.ghosts
        size = self._capacity if self._tier0 else 0
        share = history.share
        for v in found:
            if v <= 0:
                continue
            count = v & 255
            ghosts[count > 1] -= 1
            if not size or history.seq - (v >> 8) > size:  # older than the pool: no move
                continue
            b1, b2 = ghosts
            b1 = b1 if b1 > 1 else 1
            b2 = b2 if b2 > 1 else 1
            # max(1.0, b2 / b1) and the clamps to [0, 1], written out (builtin max is slow)
            if count == 1:
                r = b2 / b1
                share += (r if r > 1.0 else 1.0) / size
                share = share if share < 1.0 else 1.0
            else:
                r = b1 / b2
                share -= (r if r > 1.0 else 1.0) / size
                share = share if share > 0.0 else 0.0
        history.share = share


def _recent_run(nr: int, nf: int, share: float, left: int) -> int:
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


def _frequent_run(nr: int, nf: int, share: float, left: int) -> int:
    """How many of the next ``left`` victims of a level come from its frequent segment, when
    the recent segment does not give the next one (``_recent_run`` is 0).

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


def _chain_floor(counts: list[int]) -> None:
    """Raise each count to the highest one before it (a parent is used at least as often as
    its child, and a released block table lists children first)."""
    floor = 1
    for i, c in enumerate(counts):
        if c < floor:
            counts[i] = floor
        else:
            floor = c


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
