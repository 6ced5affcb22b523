"""The index's reorder ledger: reference-count steps whose event-id order is not settled yet.

Per worker and attention-DP rank an :class:`EventStream` records which event ids have been
seen and which below the newest are still missing (*holes*, within :data:`HOLE_WINDOW`). A
step that would take a reference from a tier holding none is kept, with its event id, in a
:class:`LedgerEntry` for its (layer group, tier, hash); :func:`evaluate` replays an entry's
steps in event-id order and :func:`settled` tells when no step can still arrive before the
ones held (then the entry becomes a plain count again). See :mod:`kvpool.router.index`,
"Order", for the rules this implements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

HOLE_WINDOW: Final = 256
"""Event ids missing for more than this many events are taken as lost, not late."""

MAX_LEDGER: Final = 1 << 16
"""Out-of-order ledger entries kept per worker before the oldest are settled as they stand.
Token-matched workers also remember their recently removed hash mappings: between
MAX_LEDGER and 2 * MAX_LEDGER of them (two generations, the older dropped whole)."""

LATE_RELEASE: Final = -2
"""A step's delta: -1 that arrived after an event with a larger id (it cannot be history)."""

Step = tuple[int, int | None, int]
"""(event id, attention-DP rank, delta): +1, -1 or LATE_RELEASE."""


class EventStream:
    """The event ids seen from one publisher (one attention-DP rank of a worker)."""

    __slots__ = ("holes", "top")

    def __init__(self) -> None:
        self.top = -1  # streams start at event id 0
        self.holes: set[int] = set()

    def see(self, eid: int) -> bool:
        """Record ``eid``; True when a hole closed (ledgers may then resolve)."""
        top = self.top
        if eid > top:
            if 0 < eid - top - 1 <= HOLE_WINDOW:
                self.holes.update(range(top + 1, eid))
            self.top = eid
            holes = self.holes
            if holes and min(holes) < eid - HOLE_WINDOW:
                self.holes = {x for x in holes if x >= eid - HOLE_WINDOW}
                return True
            return False
        if eid in self.holes:
            self.holes.discard(eid)
            return True
        return False

    def complete_below(self, eid: int) -> bool:
        """No id below ``eid`` is still missing."""
        return not self.holes or min(self.holes) > eid


class LedgerEntry:
    """A (group, tier, hash) count with steps whose order is not settled yet."""

    __slots__ = ("base", "steps")

    def __init__(self, base: int) -> None:
        self.base = base
        self.steps: list[Step] = []


def _first(step: Step) -> int:
    return step[0]


def evaluate(entry: LedgerEntry, streams: Mapping[int | None, EventStream]) -> int:
    """The count after the entry's steps in event-id order (negative while waiting).

    A -1 step that finds no reference is kept (the count goes negative: a store may still
    arrive) when it arrived late or ids below it are missing from its stream; otherwise it
    refers to history before the index's view and is ignored."""
    running = entry.base
    for eid, rank, delta in sorted(entry.steps, key=_first):
        if delta > 0:
            running += 1
        elif running > 0 or delta == LATE_RELEASE:
            running -= 1
        else:
            stream = streams.get(rank)
            if stream is None or stream.complete_below(eid):
                continue  # in order, nothing missing below: history before our view
            running -= 1
    return running


def settled(entry: LedgerEntry, count: int, streams: Mapping[int | None, EventStream]) -> bool:
    """Can no step still arrive before the ones ``entry`` holds (``count``: its evaluation)?

    A negative count waits for a store that may be anywhere below the newest id seen; once
    nothing is missing at all, it was history."""
    upto = max(e for e, _, _ in entry.steps) if count >= 0 else None
    return all(
        (st := streams.get(r)) is None
        or (st.complete_below(upto) if upto is not None else not st.holes)
        for r in {r for _, r, _ in entry.steps}
    )
