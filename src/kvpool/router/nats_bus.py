"""A router replica's events from NATS JetStream (``bus: nats``; ``docs/router.md``).

Every worker's batches are in one stream (:mod:`kvpool.events.nats_publisher` describes the
messages); every replica reads all of it through a durable pull consumer of its own
(``{stream}-{replica_id}``), so replicas apply the same batches in the same order:

* **Order.** The stream holds a worker's batches in their order (its publisher sends one at
  a time). A batch whose ``Kvpool-Seq`` is not past the last one applied for its worker and
  epoch is a duplicate and is skipped; one past the next (a publisher that lost batches) is
  applied and counted ``missed``; a new ``Kvpool-Epoch`` is a restarted worker: its blocks
  are dropped before the batch is applied.
* **Gaps.** Stream sequences are consecutive: a message whose sequence is past the next one
  expected shows that messages were lost on the way to this replica; they are fetched one by
  one from the stream (direct gets, retried) and applied first. A lost *last* message shows
  no later sequence: every ``check_interval_s`` the stream's last sequence is compared with
  the replica's, and what the consumer has not delivered since the last check is fetched the
  same way. A message the stream no longer holds (limits) is counted ``missed``.
* **Snapshots.** Every ``snapshot_interval_s`` (when it applied something since) the replica
  writes its index (:mod:`kvpool.router.nats_snapshot`) as object ``index`` of the
  ``snapshot_bucket`` object store, with the stream sequence it holds. A starting replica
  loads the newest one and creates its consumer at the next sequence, so it replays only the
  stream's tail; it answers routes once it has caught up (or after ``catch_up_timeout_s``).
* **In-flight state** goes over core NATS (:mod:`kvpool.router.nats_inflight`).

The connection reconnects for ever; while NATS is away the replica routes on what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.errors import EventFormatError, TransportError
from kvpool.events.nats_publisher import H_EPOCH, H_FORMAT, H_SEQ, H_WORKER, ensure_stream
from kvpool.router.config import NatsOptions, WorkerConfig, WorkerKind
from kvpool.router.index import KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.nats_inflight import InflightShare
from kvpool.router.nats_snapshot import BusState, dump_snapshot, index_digest, load_snapshot
from kvpool.router.scoring import Router

__all__ = ["BusCounters", "NatsBus", "bus_worker", "cancel_all"]

logger = logging.getLogger(__name__)

SNAPSHOT_OBJECT = "index"
_FETCH_BATCH = 1024
_GET_TRIES = 20
_GET_TIMEOUT_S = 0.5
_STOP_S = 5.0
_RECANCEL_S = 0.1


@dataclass(slots=True)
class BusCounters:
    """What the replica's consumer saw (``GET /workers``' ``bus``, ``/metrics``)."""

    messages: int = 0
    duplicates: int = 0
    gaps: int = 0
    repaired: int = 0
    missed: int = 0
    restarts: int = 0
    unknown_workers: int = 0
    bad_messages: int = 0
    snapshots_written: int = 0
    snapshot_loaded_seq: int | None = None


class NatsBus:
    """Feeds a replica's :class:`Ingest` from the event stream and shares its in-flight state."""

    def __init__(self, options: NatsOptions, index: KvIndex, ingest: Ingest,
                 router: Router) -> None:
        self.options = options
        self.index = index
        self.ingest = ingest
        self.router = router
        self.replica_id = options.replica_id or f"r{os.getpid()}-{os.urandom(3).hex()}"
        self.consumer = f"{options.stream}-{self.replica_id}"
        self.state = BusState()
        self.counters = BusCounters()
        self.inflight = InflightShare(router, self.replica_id, options.inflight_subject,
                                      options.inflight_flush_s)
        self.caught_up = asyncio.Event()
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._snap_seq = 0
        self._apply_lock = asyncio.Lock()

    @property
    def applied_seq(self) -> int:
        """The stream sequence the index holds everything up to."""
        return self.state.stream_seq

    def digest(self) -> str:
        return index_digest(self.index)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect, load the newest snapshot, create the consumer and catch up."""
        import nats

        o = self.options
        try:
            self._nc = await nats.connect(o.url, connect_timeout=2, max_reconnect_attempts=-1,
                                          reconnect_time_wait=0.2, allow_reconnect=True)
        except Exception as exc:
            raise TransportError(f"cannot reach NATS at {o.url}: {exc}") from None
        self._js = self._nc.jetstream()
        await ensure_stream(self._js, o.stream, o.subject_prefix)
        await self._load_snapshot()
        await self._subscribe()
        await self.inflight.start(self._nc)
        self._tasks = [asyncio.create_task(self._consume(), name="nats-consume"),
                       asyncio.create_task(self._check(), name="nats-check")]
        if o.snapshot_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._snapshots(), name="nats-snapshots"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._catch_up(), o.catch_up_timeout_s)

    async def stop(self) -> None:
        """Cancel the loops and close the connection, each bounded by :data:`_STOP_S`."""
        await cancel_all(self._tasks, _STOP_S)
        self._tasks.clear()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.inflight.stop(), _STOP_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), _STOP_S)
            self._nc = None

    async def write_snapshot(self) -> bool:
        """Write the index to the object store now; False when nothing changed since."""
        async with self._apply_lock:
            seq = self.state.stream_seq
            if seq == self._snap_seq:
                return False
            data = dump_snapshot(self.index, self.ingest, self.state)
        store = await self._store()
        await store.put(SNAPSHOT_OBJECT, data)
        self._snap_seq = seq
        self.counters.snapshots_written += 1
        return True

    # ------------------------------------------------------------------------------ setup

    async def _store(self) -> Any:
        from nats.js.errors import BucketNotFoundError, NotFoundError

        try:
            return await self._js.object_store(self.options.snapshot_bucket)
        except (BucketNotFoundError, NotFoundError):
            from nats.js.api import ObjectStoreConfig, StorageType

            return await self._js.create_object_store(
                self.options.snapshot_bucket,
                config=ObjectStoreConfig(storage=StorageType.FILE),
            )

    async def _load_snapshot(self) -> None:
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        try:
            store = await self._store()
            obj = await store.get(SNAPSHOT_OBJECT)
        except (NotFoundError, ObjectNotFoundError):
            return
        data = obj.data
        if not data:
            return
        try:
            self.state = load_snapshot(data, self.index, self.ingest)
        except EventFormatError as exc:
            logger.warning("snapshot %s/%s not loaded (replaying the whole stream): %s",
                           self.options.snapshot_bucket, SNAPSHOT_OBJECT, exc)
            return
        self._snap_seq = self.state.stream_seq
        self.counters.snapshot_loaded_seq = self.state.stream_seq
        logger.info("loaded the index snapshot at stream sequence %d", self.state.stream_seq)

    async def _subscribe(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        o = self.options
        with contextlib.suppress(Exception):  # its position is the snapshot's, not the old one
            await self._js.delete_consumer(o.stream, self.consumer)
        config = ConsumerConfig(
            durable_name=self.consumer, ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.state.stream_seq + 1, filter_subject=f"{o.subject_prefix}.>",
            max_waiting=4,
        )
        await self._js.add_consumer(o.stream, config)
        self._sub = await self._js.pull_subscribe_bind(self.consumer, o.stream)

    async def _catch_up(self) -> None:
        while True:
            info = await self._js.stream_info(self.options.stream)
            if self.state.stream_seq >= info.state.last_seq:
                self.caught_up.set()
                return
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------------------ loops

    async def _consume(self) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while True:
            try:
                msgs = await self._sub.fetch(_FETCH_BATCH, timeout=self.options.check_interval_s)
            except (NatsTimeout, TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection is away: fetch again when it is back
                logger.debug("fetch failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            async with self._apply_lock:
                for msg in msgs:
                    await self._on_stream_msg(msg.metadata.sequence.stream, msg.headers,
                                              msg.data)

    async def _check(self) -> None:
        """Tail gaps: messages the stream has and the consumer did not deliver."""
        last_seen = -1
        while True:
            await asyncio.sleep(self.options.check_interval_s)
            try:
                info = await self._js.stream_info(self.options.stream)
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            last = info.state.last_seq
            held = self.state.stream_seq
            if last > held and held == last_seen:  # no progress for a whole interval
                async with self._apply_lock:
                    await self._repair(self.state.stream_seq + 1, last + 1)
            last_seen = self.state.stream_seq
            if last >= self.state.stream_seq:
                self.caught_up.set()

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(self.options.snapshot_interval_s)
            try:
                await self.write_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("snapshot not written: %s", exc or type(exc).__name__)

    # ------------------------------------------------------------------------------ apply

    async def _on_stream_msg(self, seq: int, headers: dict[str, str] | None,
                             data: bytes) -> None:
        held = self.state.stream_seq
        if seq <= held:
            self.counters.duplicates += 1
            return
        if seq > held + 1:
            self.counters.gaps += 1
            await self._repair(held + 1, seq)
        self._apply(seq, headers, data)

    async def _repair(self, first: int, end: int) -> None:
        """Fetch and apply stream sequences ``first`` to ``end - 1`` (direct gets)."""
        for seq in range(first, end):
            if seq <= self.state.stream_seq:
                continue
            msg = await self._get(seq)
            if msg is None:
                self.counters.missed += 1
                self.state.stream_seq = seq
                continue
            self.counters.repaired += 1
            self._apply(seq, msg.headers, msg.data or b"")

    async def _get(self, seq: int) -> Any:
        from nats.js.errors import NotFoundError

        for _ in range(_GET_TRIES):
            try:
                return await asyncio.wait_for(
                    self._js.get_msg(self.options.stream, seq, direct=True), _GET_TIMEOUT_S
                )
            except NotFoundError:
                return None
            except asyncio.CancelledError:
                raise
            except Exception:  # lost on the way, or the server is away: ask again
                await asyncio.sleep(0.05)
        return None

    def _apply(self, seq: int, headers: dict[str, str] | None, data: bytes) -> None:
        self.state.stream_seq = seq
        self.counters.messages += 1
        h = headers or {}
        wid, fmt, epoch, bseq = h.get(H_WORKER), h.get(H_FORMAT), h.get(H_EPOCH), h.get(H_SEQ)
        if wid is None or fmt is None or epoch is None or bseq is None or not bseq.isdigit():
            self.counters.bad_messages += 1
            return
        if not self.index.has_worker(wid):
            self.counters.unknown_workers += 1
            return
        n = int(bseq)
        known = self.state.publishers.get(wid)
        if known is not None and known[0] == epoch:
            if n <= known[1]:
                self.counters.duplicates += 1
                return
            if n > known[1] + 1:
                self.counters.missed += n - known[1] - 1
        elif known is not None or n > 0:
            # a restarted worker (or one whose earlier batches this stream no longer holds)
            self.counters.restarts += known is not None
            self.index.reset_worker(wid)
            self.ingest.next_id.pop(wid, None)
        self.state.publishers[wid] = (epoch, n)
        if fmt == "vllm":
            self.ingest.feed_vllm(wid, data)
        elif fmt == "trtllm":
            self.ingest.feed_trtllm(wid, data)
        else:
            self.counters.bad_messages += 1

    def as_dict(self) -> dict[str, Any]:
        c = self.counters
        return {
            "replica_id": self.replica_id, "stream_seq": self.state.stream_seq,
            "caught_up": self.caught_up.is_set(), "messages": c.messages,
            "duplicates": c.duplicates, "gaps": c.gaps, "repaired": c.repaired,
            "missed": c.missed, "restarts": c.restarts, "unknown_workers": c.unknown_workers,
            "bad_messages": c.bad_messages, "snapshots_written": c.snapshots_written,
            "snapshot_loaded_seq": c.snapshot_loaded_seq,
            "inflight_sent": self.inflight.sent, "inflight_applied": self.inflight.applied,
            "at": time.time(),
        }


async def cancel_all(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Cancel ``tasks`` and wait until they end, cancelling again those still running.

    One ``cancel()`` is not enough: on Python 3.11, ``asyncio.wait_for`` (which nats-py's
    ``fetch`` and requests await) returns its inner result when that completes at the moment
    the cancellation arrives, so the cancellation is lost and a ``while True`` loop around it
    runs on (a replica's ``_consume`` did: SIGTERM left the process idle for ever). Tasks still
    running after ``timeout_s`` are logged and left behind."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("%d task(s) did not end on cancellation: %s", len(pending),
                           ", ".join(sorted(t.get_name() for t in pending)))
            return
        _, pending = await asyncio.wait(pending, timeout=min(_RECANCEL_S, left))
    for task in tasks:  # retrieve what they ended with (a cancellation, an error)
        if task.done() and not task.cancelled():
            task.exception()


def bus_worker(w: WorkerConfig) -> WorkerConfig:
    """A worker as :class:`Ingest` sees it on the bus: its events come from the stream, so
    none of its own transports start (its ``http_base_url`` stays, for health and proxying)."""
    return msgspec.structs.replace(w, kind=WorkerKind.KVPOOL, zmq_endpoint=None,
                                   replay_endpoint=None)
