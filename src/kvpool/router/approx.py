"""The router's own prediction of the caches of workers that publish no KV events.

SGLang's router (its approximate radix tree) and Dynamo with ``--no-kv-events`` route such
workers on what they sent where; :class:`ApproxCaches` does the same for kvpool's
:class:`~kvpool.router.scoring.Router` (mode ``approx``, or per worker).

Model, per worker: the blocks of every prompt routed there, keyed by the same chained block
hashes the engine would publish. A chained hash names its whole prefix, so the set of a
worker's keys *is* a prefix tree of the prompts it was sent (a key is present only with its
parent, see below). Capacity: the worker's block budget per tier (GPU, host, disk), kept as
LRU segments the way an engine with offloading keeps them: routing a prompt to the worker
makes its blocks the most recent GPU blocks; the least recent GPU block moves to the host
segment when the GPU segment is full, from there to disk, and leaves the model from the last
segment that has room for nothing more. A prompt's blocks are touched from its last block to
its first, so a parent is always more recent than its children and LRU drops leaves first,
like the engines' own eviction. Blocks that no request touched for ``ttl_s`` seconds leave the
model too (an engine restart, a flush, another client: what the router cannot see).

Presence is kept as the :class:`~kvpool.router.index.KvIndex`'s packed masks (bit
``tier * stride + slot``), so the router's prefix walk reads predicted and published blocks
the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from kvpool.errors import InvalidArgumentError
from kvpool.validation import check_number, is_int

__all__ = ["DEFAULT_APPROX_TTL_S", "ApproxCaches"]

TIERS: Final = 3

DEFAULT_APPROX_TTL_S: Final = 600.0
"""Default lifetime of a predicted block that no request touches: a backstop for what the
router cannot see (the capacity model does the ordinary eviction)."""


class _Worker:
    """One worker's LRU segments: per tier, block key -> time it was last touched."""

    __slots__ = ("capacity", "segments", "slot")

    def __init__(self, slot: int, capacity: tuple[int, ...]) -> None:
        self.slot = slot
        self.capacity = capacity
        self.segments: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(TIERS)]


class ApproxCaches:
    """Predicted caches of the event-less workers of one router (see the module docstring).

    ``masks[h]`` has bit ``tier * stride + slot`` set when block ``h`` is predicted in tier
    ``tier`` of the worker in ``slot``; ``slot_bits`` has every tier bit of every predicted
    worker (the bits of the index's own masks the router ignores for them).
    """

    def __init__(self, stride: int, ttl_s: float = DEFAULT_APPROX_TTL_S) -> None:
        self.ttl_s = check_number("approx ttl_s", ttl_s, 0, above=True)
        self.stride = stride
        self.masks: dict[int, int] = {}
        self.slot_bits = 0
        self._workers: dict[int, _Worker] = {}

    def __len__(self) -> int:
        """Predicted (block, worker) pairs."""
        return sum(len(s) for w in self._workers.values() for s in w.segments)

    @property
    def slots(self) -> list[int]:
        return list(self._workers)

    def add(self, slot: int, capacity_blocks: Sequence[int]) -> None:
        """Predict the worker in ``slot`` with ``capacity_blocks`` per tier (1 to 3 counts,
        GPU first; missing tiers hold nothing). Replaces an earlier model of the slot."""
        caps = tuple(capacity_blocks)
        if not 1 <= len(caps) <= TIERS or any(
            not is_int(c) or c < 0 for c in caps
        ) or caps[0] < 1:
            raise InvalidArgumentError(
                "capacity_blocks must be 1 to 3 block counts >= 0 (GPU, host, disk), the "
                f"GPU's >= 1, got {capacity_blocks!r}"
            )
        self.remove(slot)
        self._workers[slot] = _Worker(slot, caps + (0,) * (TIERS - len(caps)))
        self.slot_bits |= self._bits(slot)

    def remove(self, slot: int) -> None:
        """Forget the model of ``slot`` (no-op for an unknown slot)."""
        self.clear(slot)
        if self._workers.pop(slot, None) is not None:
            self.slot_bits &= ~self._bits(slot)

    def clear(self, slot: int) -> None:
        """The worker's cache is gone (restart, reset): its predicted blocks go."""
        w = self._workers.get(slot)
        if w is None:
            return
        for t, seg in enumerate(w.segments):
            for h in seg:
                self._unset(h, slot, t)
            seg.clear()

    def predicts(self, slot: int) -> bool:
        return slot in self._workers

    def restride(self, stride: int) -> None:
        """The index widened its masks: rebuild ours with the new stride."""
        self.stride = stride
        self.masks.clear()
        self.slot_bits = 0
        for slot, w in self._workers.items():
            self.slot_bits |= self._bits(slot)
            for t, seg in enumerate(w.segments):
                bit = (1 << slot) << (t * stride)
                for h in seg:
                    self.masks[h] = self.masks.get(h, 0) | bit

    def touch(self, slot: int, keys: Sequence[int], now: float) -> None:
        """A prompt with block ``keys`` (in chain order) was routed to ``slot`` at ``now``."""
        w = self._workers[slot]
        gpu = w.segments[0]
        cap0 = w.capacity[0]
        # a prompt longer than the GPU budget keeps its first blocks (the engine could not
        # hold the rest at once either)
        keys = keys[:cap0]
        stride = self.stride
        masks = self.masks
        bit0 = 1 << slot
        for h in reversed(keys):
            if h in gpu:
                gpu.move_to_end(h)
                gpu[h] = now
                continue
            for t in (1, 2):
                seg = w.segments[t]
                if h in seg:
                    del seg[h]
                    masks[h] &= ~(bit0 << (t * stride))
                    break
            gpu[h] = now
            masks[h] = masks.get(h, 0) | bit0
        self._spill(w)

    def expire(self, now: float) -> None:
        """Drop blocks untouched for ``ttl_s`` (each segment is in touch order)."""
        deadline = now - self.ttl_s
        for slot, w in self._workers.items():
            for t, seg in enumerate(w.segments):
                while seg:
                    h, touched = next(iter(seg.items()))
                    if touched > deadline:
                        break
                    del seg[h]
                    self._unset(h, slot, t)

    # -------------------------------------------------------------------------------------

    def _spill(self, w: _Worker) -> None:
        """Move each tier's overflow (least recent first) to the next tier that holds
        blocks, or out of the model from the last one."""
        for tier in range(TIERS):
            seg = w.segments[tier]
            cap = w.capacity[tier]
            nxt = tier + 1
            while nxt < TIERS and w.capacity[nxt] == 0:
                nxt += 1
            while len(seg) > cap:
                h, touched = seg.popitem(last=False)
                self._unset(h, w.slot, tier)
                if nxt < TIERS:
                    w.segments[nxt][h] = touched
                    self.masks[h] = self.masks.get(h, 0) | ((1 << w.slot) << (nxt * self.stride))

    def _unset(self, h: int, slot: int, tier: int) -> None:
        m = self.masks.get(h, 0) & ~((1 << slot) << (tier * self.stride))
        if m:
            self.masks[h] = m
        else:
            self.masks.pop(h, None)

    def _bits(self, slot: int) -> int:
        return sum((1 << slot) << (t * self.stride) for t in range(TIERS))
