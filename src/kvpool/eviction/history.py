"""The key history of a layer group's scan-resistant policies (their ghosts)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import count as counter
from itertools import islice, repeat
from operator import lshift, or_

from kvpool.hashing.keys import BlockKey

DEFAULT_GHOST_MULTIPLE = 4.0
"""Default bound of a standalone history-keeping policy's history, x its pool size."""


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
