"""In-flight state shared between router replicas over a core NATS subject.

Each replica announces what it routed (request id, worker, prefill and prompt tokens, the
block keys it predicts there), which prefills finished and which requests ended; every other
replica applies the same to its own :class:`~kvpool.router.scoring.Router`, so the load and
predictions each scores with are the same everywhere. A replica ignores its own messages.

Announcements are gathered for ``flush_s`` (``nats.inflight_flush_s``) after the first one and
leave as one message (a msgpack list of records), or at once when :data:`MAX_RECORDS` wait:
every message costs both ends a socket write or read and nats-py's handling (about 60 us on
the 2-core machine of ``bench_router_service.py --bus nats``), so a busy replica sends tens of
messages a second, not one per route (``flush_s`` 0: one per turn of the event loop).

Records (msgpack arrays): ``[0, request_id, worker_id, prefill_tokens, tokens, keys]`` (routed),
``[1, request_id]`` (prefill finished), ``[2, request_id]`` (finished). A message is
``[replica_id, [record, ...]]``, decoded and checked in one call (:class:`_Message`). Core
NATS delivers at most once: a lost message leaves a mirrored request until
``request_timeout_s`` ends it, as for a client that never reports.

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

__all__ = ["MAX_RECORDS", "InflightShare"]

logger = logging.getLogger(__name__)

ROUTED, PREFILLED, FINISHED = 0, 1, 2
TOMBSTONES: Final = 1 << 16
MAX_RECORDS: Final = 256
"""A message leaves at once when this many records wait (about 150 KB with 64-block
prompts, well under NATS's 1 MB ``max_payload``)."""


class _Routed(msgspec.Struct, array_like=True, tag=ROUTED, tag_field="op"):
    request_id: str
    worker_id: str
    prefill_tokens: int
    tokens: int
    keys: list[int]


class _Prefilled(msgspec.Struct, array_like=True, tag=PREFILLED, tag_field="op"):
    request_id: str


class _Finished(msgspec.Struct, array_like=True, tag=FINISHED, tag_field="op"):
    request_id: str


class _Message(msgspec.Struct, array_like=True):
    replica: str
    records: list[_Routed | _Prefilled | _Finished]


class InflightShare:
    """Announces this replica's routes and applies the other replicas' (one per replica)."""

    def __init__(self, router: Router, replica_id: str, subject: str,
                 flush_s: float = 0.0) -> None:
        self.router = router
        self.replica_id = replica_id
        self.subject = subject
        self.flush_s = flush_s
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
        self._timer: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder = msgspec.msgpack.Decoder(_Message)
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
        loop = self._loop
        if self._nc is None or loop is None:
            return
        pending = self._pending
        pending.append(record)
        if len(pending) >= MAX_RECORDS:
            self._flush()
        elif self._timer is None:
            self._timer = (loop.call_later(self.flush_s, self._flush) if self.flush_s > 0
                           else loop.call_soon(self._flush))

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
            message = self._decoder.decode(msg.data)
        except msgspec.DecodeError as exc:  # ValidationError included
            self.malformed += 1
            logger.warning("in-flight message does not decode: %s", exc)
            return
        if message.replica == self.replica_id:
            return
        self.received += 1
        routed = self._routed
        router = self.router
        applied = 0
        for rec in message.records:
            if type(rec) is _Routed:
                applied += routed(rec)
                continue
            if type(rec) is _Finished:
                router.request_finished(rec.request_id)
                self._tombstone(rec.request_id)
            else:
                router.prefill_finished(rec.request_id)
            applied += 1
        self.applied += applied

    def _routed(self, rec: _Routed) -> bool:
        """Another replica's route: the same load and predictions as here (nothing for a
        request already here or already finished, or for a worker unknown here)."""
        router = self.router
        rid, worker_id = rec.request_id, rec.worker_id
        if (rid in router.loads.requests or rid in self._finished
                or not router.index.has_worker(worker_id)):
            return False
        entry = Active(worker_id, rec.prefill_tokens, rec.tokens, router.clock())
        router.loads.add(rid, entry, router.request_timeout_s > 0)
        keys = rec.keys
        if keys and router.prediction_ttl_s > 0:
            slot = router.index.slot_of(worker_id)
            if not router.approx.predicts(slot):
                entry.predicted = (slot, keys)  # the decoded list, owned by the entry
                router.pred.add(slot, keys)
        return True
