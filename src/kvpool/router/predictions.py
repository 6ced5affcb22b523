"""The router's predictions: the blocks of a routed request count as GPU-resident on its
worker before the worker's stored events say so (:class:`~kvpool.router.scoring.Router`).

A request's blocks are predicted from its routing until its prefill is done, then for
``ttl_s`` more (the worker's stored events are on their way): the next requests sharing the
prefix (a burst on one system prompt, the next turn of a conversation sent while this one
waits in the queue) land with it. Predictions are kept per (key, slot) with a reference per
request, so two requests with a common prefix on one worker predict it until both expire.
"""

from __future__ import annotations

from collections import deque

__all__ = ["Predictions"]


class Predictions:
    """Predicted GPU blocks: ``masks[key]`` has bit ``slot`` set while a request routed to
    ``slot`` predicts ``key`` (the index's tier-0 bit positions)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.masks: dict[int, int] = {}
        self._refs: dict[int, dict[int, int]] = {}  # slot -> {key: references} (no tuples)
        # (expiry, slot, keys) in expiry order: a constant TTL keeps appends sorted
        self._queue: deque[tuple[float, int, list[int]]] = deque()

    def __len__(self) -> int:
        """Distinct (key, slot) predictions."""
        return sum(map(len, self._refs.values()))

    def add(self, slot: int, keys: list[int]) -> None:
        """A request with block ``keys`` was routed to ``slot``: predicted until :meth:`start`
        and ``ttl_s`` after it."""
        bit = 1 << slot
        masks = self.masks
        refs = self._refs.get(slot)
        if refs is None:
            refs = self._refs[slot] = {}
        for h in keys:
            c = refs.get(h, 0)
            refs[h] = c + 1
            if c == 0:
                masks[h] = masks.get(h, 0) | bit

    def start(self, slot: int, keys: list[int], now: float) -> None:
        """The request's prefill is done at ``now``: its prediction ends ``ttl_s`` later."""
        self._queue.append((now + self.ttl_s, slot, keys))

    def expire(self, now: float) -> None:
        """Drop the predictions whose time is up."""
        q = self._queue
        while q and q[0][0] <= now:
            _, slot, keys = q.popleft()
            self.remove(slot, keys)

    def remove(self, slot: int, keys: list[int]) -> None:
        """One request's prediction of ``keys`` on ``slot`` ends."""
        clear = ~(1 << slot)
        masks = self.masks
        refs = self._refs[slot]
        for h in keys:
            c = refs[h]
            if c > 1:
                refs[h] = c - 1
                continue
            del refs[h]
            m = masks[h] & clear
            if m:
                masks[h] = m
            else:
                del masks[h]
        if not refs:
            del self._refs[slot]

    def drop_slot(self, slot: int) -> None:
        """The worker's cache is gone: the queued predictions of ``slot`` end now (those of
        requests still in prefill are ended by their owner)."""
        kept: deque[tuple[float, int, list[int]]] = deque()
        for item in self._queue:
            if item[1] == slot:
                self.remove(slot, item[2])
            else:
                kept.append(item)
        self._queue = kept
