"""Lazy FIFOs: the queue structure under every eviction policy.

A policy keeps ``stamp[slot]`` for every slot of its pool (a list indexed by slot) and one or
more :class:`Fifo` objects. A push appends its slots to a FIFO as one batch ``(stamp,
slots)`` and stores the batch's stamp for each slot; a claim only changes the slot's stamp,
so the entry left behind is *dead* (skipped when victims are taken, dropped by
:func:`compact`); victims are cut from the oldest batch a slice at a time. So a block costs a
few list stores per push, claim and eviction.

Stamps: ``(batch number << ID_BITS) | fifo id`` for a queued slot (unique per batch, so a
slot's stamp names its FIFO and its batch), or one of the negative marks below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import itemgetter

from kvpool.errors import InvalidArgumentError

ID_BITS = 20
ID_MASK = (1 << ID_BITS) - 1
STEP = 1 << ID_BITS  # stamps of successive batches: (batch number << ID_BITS) | FIFO id
NOT_QUEUED = -1  # a slot's stamp while it is in no FIFO, or in a segmented policy after a
CLAIMED = -2  # ``remove`` from a recent FIFO (even id) ...
CLAIMED_FREQUENT = -3  # ... or from a frequent one (odd id): CLAIMED - (stamp & 1)


class Fifo:
    """One FIFO of a policy, oldest first, with lazy deletion.

    An entry ``slots[i]`` of a batch ``(b, slots)`` is *live* (the slot is queued here, at
    this place) iff ``stamp[slots[i]] == b`` and, in the oldest batch, ``i >= head``.
    Invariants: the oldest batch has an entry at ``head`` (a batch is dropped once consumed,
    and no batch is empty); ``dead`` counts the dead entries from ``head`` on (while it is 0,
    every entry is live: no check needed). ``live`` counts the slots queued here; the
    policy keeps it (the operations below leave it to their caller).
    """

    __slots__ = ("batches", "dead", "frequent", "head", "id", "live", "priority")

    def __init__(self, fid: int, priority: int, frequent: bool) -> None:
        if fid > ID_MASK:
            raise InvalidArgumentError(
                f"an eviction policy takes at most {(ID_MASK + 1) // 2} priority levels"
            )
        self.id = fid
        self.priority = priority
        self.frequent = frequent
        self.batches: deque[tuple[int, list[int]]] = deque()
        self.head = 0
        self.dead = 0
        self.live = 0


def take(fifo: Fifo, k: int, stamp: list[int]) -> tuple[list[int], int]:
    """Take up to ``k`` live slots from the head of ``fifo`` (their stamps become
    ``NOT_QUEUED``): the slots in order, and how many entries were consumed."""
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
            stamp[s] = NOT_QUEUED
        h += m
        used += m
        if h == len(sl):
            batches.popleft()
            h = 0
    fifo.head = h
    return out, used


def take_one(fifo: Fifo, stamp: list[int]) -> tuple[int, int]:
    """``take(fifo, 1, stamp)`` for one victim: (its slot or -1 if none is live, entries
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
            stamp[s] = NOT_QUEUED
            fifo.head = h
            return s, used
        fifo.dead -= 1
    fifo.head = 0
    return -1, used


def live_slots(fifo: Fifo, stamp: list[int]) -> list[int]:
    """The slots queued in ``fifo``, oldest first (nothing changes)."""
    out: list[int] = []
    h = fifo.head
    for b, sl in fifo.batches:
        out += [s for s in (sl[h:] if h else sl) if stamp[s] == b]
        h = 0
    return out


def compact(fifos: Sequence[Fifo], stamp: list[int]) -> None:
    """Drop every dead entry (batches keep their stamps; emptied ones go).

    Only the FIFOs holding dead entries are rebuilt, and only up to their last dead entry:
    a batch is checked in one C call (its stamps counted), so the cost is per batch, not per
    entry, and a FIFO of live entries costs nothing however long it is."""
    for fifo in fifos:
        dead = fifo.dead
        old = fifo.batches
        h = fifo.head
        if not dead:
            if h:  # only the oldest batch's consumed entries go
                b, sl = old[0]
                old[0] = (b, sl[h:])
                fifo.head = 0
            continue
        batches: deque[tuple[int, list[int]]] = deque()
        while dead and old:
            b, sl = old.popleft()
            if h:
                sl = sl[h:]
                h = 0
            n = len(sl)
            live = itemgetter(*sl)(stamp).count(b) if n > 1 else int(stamp[sl[0]] == b)
            if live == n:
                batches.append((b, sl))
            elif live:
                batches.append((b, [s for s in sl if stamp[s] == b]))
            dead -= n - live
        batches += old  # past the last dead entry every entry is live
        fifo.batches = batches
        fifo.head = 0
        fifo.dead = 0


def cut_tail(fifos: Sequence[Fifo], stamp: list[int], slots: Sequence[int]) -> Fifo | None:
    """If ``slots`` are the newest entries of one FIFO, newest first, all queued (a sequence
    released tail first and claimed again root first), cut them off and return that FIFO;
    else return None, nothing changed. The caller updates the slots' stamps and counts."""
    k = len(slots)
    v = stamp[slots[0]] if 0 <= slots[0] < len(stamp) else NOT_QUEUED
    if v < 0:
        return None
    fifo = fifos[v & ID_MASK]
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


def stamp_of(stamp: list[int], slot: int) -> int:
    """The stamp of a queued slot (``KeyError`` if it is not queued)."""
    v = stamp[slot] if 0 <= slot < len(stamp) else NOT_QUEUED
    if v < 0:
        raise KeyError(slot)
    return v
