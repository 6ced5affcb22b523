"""In-flight state shared between router replicas over a core NATS subject.

Each replica announces what it routed (request id, worker, prefill and prompt tokens, the
block keys it predicts there), which prefills finished and which requests ended; every other
replica applies the same to its own :class:`~kvpool.router.scoring.Router`, so the load and
predictions each scores with are the same everywhere. Announcements made during one turn of
the event loop leave as one message (a msgpack list of records), so a busy replica sends a
few messages per millisecond, not one per route. A replica ignores its own messages.

Records (msgpack arrays): ``[0, request_id, worker_id, prefill_tokens, tokens, keys]`` (routed),
``[1, request_id]`` (prefill finished), ``[2, request_id]`` (finished). A message is
``[replica_id, [record, ...]]``. Core NATS delivers at most once: a lost message leaves a
mirrored request until ``request_timeout_s`` ends it, as for a client that never reports.

Messages of different replicas are not ordered: a request routed by one replica and reported
finished to another may have its end arrive at a third before its route. Every replica keeps
the last :data:`TOMBSTONES` finished ids and ignores a route announced for one of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Final

import msgspec

from kvpool.router.load import Active
from kvpool.router.scoring import Router

__all__ = ["InflightShare"]

logger = logging.getLogger(__name__)

ROUTED, PREFILLED, FINISHED = 0, 1, 2
TOMBSTONES: Final = 1 << 16


class InflightShare:
    """Announces this replica's routes and applies the other replicas' (one per replica)."""

    def __init__(self, router: Router, replica_id: str, subject: str) -> None:
        self.router = router
        self.replica_id = replica_id
        self.subject = subject
        self.sent = 0
        """Messages sent."""
        self.applied = 0
        """Records of other replicas applied."""
        self.received = 0
        """Messages of other replicas received."""
        self.malformed = 0
        """Messages that did not decode (skipped)."""
        self._nc: Any = None
        self._sub: Any = None
        self._pending: list[list[Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder = msgspec.msgpack.Decoder()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._encoder = msgspec.msgpack.Encoder()

    async def start(self, nc: Any) -> None:
        self._nc = nc
        self._loop = asyncio.get_running_loop()
        self._sub = await nc.subscribe(self.subject, cb=self._on_message)

    async def stop(self) -> None:
        self._flush()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    # ------------------------------------------------------------------------------ announce

    def routed(self, request_id: str) -> None:
        """Announce a request this replica routed (call right after ``Router.route``)."""
        entry = self.router.loads.requests.get(request_id)
        if entry is None:
            return
        keys = entry.predicted[1] if entry.predicted is not None else []
        self._add([ROUTED, request_id, entry.worker_id, entry.prefill_tokens, entry.tokens,
                   keys])

    def prefilled(self, request_id: str) -> None:
        self._add([PREFILLED, request_id])

    def finished(self, request_id: str) -> None:
        """Announce a request's end (call after ``Router.request_finished``, whether or not
        this replica knew the request: its route may still be on its way here)."""
        self._tombstone(request_id)
        self._add([FINISHED, request_id])

    def _tombstone(self, request_id: str) -> None:
        ended = self._finished
        ended[request_id] = None
        if len(ended) > TOMBSTONES:
            ended.popitem(last=False)

    def _add(self, record: list[Any]) -> None:
        if self._nc is None or self._loop is None:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(record)

    def _flush(self) -> None:
        if not self._pending or self._nc is None or self._loop is None:
            return
        payload = self._encoder.encode([self.replica_id, self._pending])
        self._pending = []
        self.sent += 1
        self._loop.create_task(self._publish(payload))

    async def _publish(self, payload: bytes) -> None:
        try:
            await self._nc.publish(self.subject, payload)
        except Exception as exc:  # the connection is away: the state converges by timeouts
            logger.warning("in-flight announcement lost: %s", exc or type(exc).__name__)

    # ------------------------------------------------------------------------------ apply

    async def _on_message(self, msg: Any) -> None:
        try:
            replica, records = self._decoder.decode(msg.data)
            if replica == self.replica_id:
                return
            self.received += 1
            for rec in records:
                self._apply(rec)
        except (msgspec.DecodeError, ValueError, TypeError, IndexError) as exc:
            self.malformed += 1
            logger.warning("in-flight message does not decode: %s", exc)

    def _apply(self, rec: list[Any]) -> None:
        router = self.router
        op, rid = rec[0], rec[1]
        if not isinstance(rid, str):
            raise TypeError("request id is not a string")
        if op == ROUTED:
            _, _, worker_id, prefill, tokens, keys = rec
            if (rid in router.loads.requests or rid in self._finished
                    or not router.index.has_worker(worker_id)):
                return
            now = router.clock()
            entry = Active(worker_id, int(prefill), int(tokens), now)
            router.loads.add(rid, entry, router.request_timeout_s > 0)
            if keys and router.prediction_ttl_s > 0:
                slot = router.index.slot_of(worker_id)
                if not router.approx.predicts(slot):
                    entry.predicted = (slot, list(keys))
                    router.pred.add(slot, entry.predicted[1])
        elif op == PREFILLED:
            router.prefill_finished(rid)
        elif op == FINISHED:
            router.request_finished(rid)
            self._tombstone(rid)
        else:
            raise ValueError(f"unknown in-flight record {op!r}")
        self.applied += 1
