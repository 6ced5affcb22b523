"""What the router routed where and has not heard the end of: per request and per worker
(:class:`~kvpool.router.scoring.Router`).

A request is *active* on its worker from its routing to :meth:`Loads.finish` (or a timeout);
its prefill is *queued* until :meth:`Loads.prefilled` (its first token). Per worker the router
keeps the active requests, their prompt tokens (the KV their decode steps read), their prefill
tokens and the part of it still queued, the load term of ``cost``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Active", "Load", "Loads"]


@dataclass(slots=True)
class Active:
    """One routed request."""

    worker_id: str
    prefill_tokens: int
    tokens: int
    started: float
    prefilled: bool = False
    predicted: tuple[int, list[int]] | None = None  # (slot, keys) predicted until prefilled


@dataclass(slots=True)
class Load:
    """One worker's active requests, summed."""

    active: int = 0
    prefill_tokens: int = 0
    queued_tokens: int = 0  # prefill of the requests not reported prefilled
    tokens: int = 0


_IDLE = Load()


class Loads:
    """Active requests by id (in routing order) and their load per worker."""

    def __init__(self) -> None:
        self.requests: dict[str, Active] = {}
        self.workers: dict[str, Load] = {}
        # (started, request id, entry) in routing order, for timeouts: popping the oldest of
        # ``requests`` itself would scan the dict's deleted slots at its front each time
        self._timeouts: deque[tuple[float, str, Active]] = deque()

    def of(self, worker_id: str) -> Load:
        """The worker's load (an idle one's is all zeros; do not change it)."""
        return self.workers.get(worker_id, _IDLE)

    def add(self, request_id: str, entry: Active, timeout: bool) -> None:
        """Register a routed request (``timeout``: it may time out, see :meth:`timed_out`)."""
        self.requests[request_id] = entry
        if timeout:
            self._timeouts.append((entry.started, request_id, entry))
        load = self.workers.get(entry.worker_id)
        if load is None:
            load = self.workers[entry.worker_id] = Load()
        load.active += 1
        load.prefill_tokens += entry.prefill_tokens
        load.queued_tokens += entry.prefill_tokens
        load.tokens += entry.tokens

    def prefilled(self, entry: Active) -> None:
        """The request's prompt is computed: its prefill leaves the queue."""
        entry.prefilled = True
        load = self.workers.get(entry.worker_id)
        if load is not None:
            load.queued_tokens -= entry.prefill_tokens

    def finish(self, entry: Active) -> None:
        """The request left its worker (prefilled first, by the caller)."""
        load = self.workers.get(entry.worker_id)
        if load is None:
            return
        load.active -= 1
        load.prefill_tokens -= entry.prefill_tokens
        load.tokens -= entry.tokens
        if load.active <= 0:
            del self.workers[entry.worker_id]

    def timed_out(self, deadline: float) -> list[Active]:
        """Take out the requests routed at or before ``deadline`` and still active (routing
        order); the caller unloads them."""
        out: list[Active] = []
        timeouts = self._timeouts
        active = self.requests
        while timeouts and timeouts[0][0] <= deadline:
            _, rid, entry = timeouts.popleft()
            if active.get(rid) is entry:  # not finished (nor routed again) since
                del active[rid]
                out.append(entry)
        if len(timeouts) > 2 * len(active) + 1024:  # mostly finished ones: keep the rest
            self._timeouts = deque([(e.started, rid, e) for rid, e in active.items()])
        return out

    def drop_worker(self, worker_id: str) -> None:
        """The worker is gone: its requests will never be reported."""
        for rid in [r for r, a in self.requests.items() if a.worker_id == worker_id]:
            del self.requests[rid]
        self.workers.pop(worker_id, None)
