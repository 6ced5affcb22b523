"""What the router routed where and has not heard the end of: per request and per worker
(:class:`~kvpool.router.scoring.Router`).

A request is *active* on its worker from its routing to :meth:`Loads.finish` (or a timeout);
its prefill is *queued* until :meth:`Loads.prefilled` (its first token). Per worker the router
keeps the active requests, their prompt tokens (the KV their decode steps read), their prefill
tokens and the part of it still queued, the load term of ``cost``.
"""

from __future__ import annotations

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

    def of(self, worker_id: str) -> Load:
        """The worker's load (an idle one's is all zeros; do not change it)."""
        return self.workers.get(worker_id, _IDLE)

    def add(self, request_id: str, entry: Active) -> None:
        self.requests[request_id] = entry
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

    def oldest_before(self, deadline: float) -> tuple[str, Active] | None:
        """The request routed first, if it was routed before ``deadline``."""
        if not self.requests:
            return None
        rid, entry = next(iter(self.requests.items()))
        return (rid, entry) if entry.started <= deadline else None

    def drop_worker(self, worker_id: str) -> None:
        """The worker is gone: its requests will never be reported."""
        for rid in [r for r, a in self.requests.items() if a.worker_id == worker_id]:
            del self.requests[rid]
        self.workers.pop(worker_id, None)
