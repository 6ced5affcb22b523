"""CallCopies: the block copies one manager call makes, forwarded and ordered for the storage.

A call's bookkeeping runs first and its copies after (the storage moves the bytes in one
batch per tier pair). A block moved twice in a call (offloaded, then offloaded again, or
onboarded from a slot a copy of the same call filled) is copied once, from where its data was
when the call began; a block dropped during the call cancels the copy still bringing it.
"""

from __future__ import annotations

from kvpool.tiers.storage import BlockCopy


def _stage(c: BlockCopy) -> tuple[int, int]:
    # Copies leave colder tiers first (host->disk before GPU->host), then come up, then
    # same-tier partial copies: each stage only overwrites slots whose data already moved.
    if c.dst_tier > c.src_tier:
        return (0, -c.src_tier)
    if c.dst_tier < c.src_tier:
        return (1, 0)
    return (2, 0)


class CallCopies:
    """The copies of the call in progress (see the module docstring)."""

    __slots__ = ("_copies", "_dst")

    def __init__(self) -> None:
        self._copies: list[BlockCopy | None] = []
        # (tier, group, slot) -> index in _copies of the copy that fills it during this call
        self._dst: dict[tuple[int, int, int], int] = {}

    def __bool__(self) -> bool:
        """Does a copy of this call still fill some slot?"""
        return bool(self._dst)

    def add(self, c: BlockCopy) -> None:
        """Record a copy; if its source was itself filled by a copy of this call, forward it.

        After forwarding every copy of a call reads data that was in place when the call
        began and writes a slot nothing else writes, so the stage order of :meth:`take` is
        a correct execution order.
        """
        idx = self._dst.pop((c.src_tier, c.layer_group, c.src_slot), None)
        if idx is not None:
            first = self._copies[idx]
            assert first is not None
            c = BlockCopy(first.src_tier, first.src_slot, c.dst_tier, c.dst_slot, c.layer_group)
            self._copies[idx] = None
        self._dst[(c.dst_tier, c.layer_group, c.dst_slot)] = len(self._copies)
        self._copies.append(c)

    def filling(self, t: int, g: int, slot: int) -> BlockCopy | None:
        """The copy of this call that fills (t, g, slot), if one does."""
        idx = self._dst.get((t, g, slot))
        return None if idx is None else self._copies[idx]

    def cancel_into(self, t: int, g: int, slot: int) -> None:
        """The block at (t, g, slot) is dropped: a copy still bringing it there is moot."""
        idx = self._dst.pop((t, g, slot), None)
        if idx is not None:
            self._copies[idx] = None

    def take(self) -> list[BlockCopy]:
        """The call's copies in execution order; the plan is empty afterwards."""
        self._dst.clear()
        if not self._copies:
            return []
        copies = sorted((c for c in self._copies if c is not None), key=_stage)
        self._copies = []
        return copies
