"""Event ingestion for the router: ZMQ subscribers, HTTP pollers and in-process feeds.

Every source's events are converted here, once, into the one record type the index applies,
:class:`~kvpool.events.keyed.KeyedEvent` (normalized keys, checked tiers; a malformed event is
a record the index counts): the wire decoders' keyed paths read records straight from the
payload, with no object per block; an in-process source's events are converted by
:func:`~kvpool.events.keyed.keyed`. Each batch of records then goes through the block size
check, the shared tier (:meth:`~kvpool.router.shared_tier.SharedTiers.split`) and the index.

* **vLLM-format workers** (``vllm``, and ``kvpool`` workers publishing over ZMQ): one thread
  per worker runs a :class:`~kvpool.events.zmq.ZmqEventSubscriber` (sequence numbers, gap
  repair through the replay socket, restart detection) and decodes each batch with
  :func:`~kvpool.events.vllm_msgpack.decode_vllm_keys` (map and positional events; stored
  records carry their blocks' tokens when the index matches the worker by them). The records
  go to the event loop,
  which alone touches the index. Events are numbered per worker from 0, consecutively, so the
  index can order them; a publisher restart resets the worker and the numbering. Liveness: a
  replay request for a sequence number past anything buffered must be answered (with the end
  marker) within ``http_timeout_s``, every ``health_interval_s``, and is followed by a replay
  request from the next expected batch (a lost last batch of an idle worker comes back);
  without a replay socket, ``GET {http_base_url}/health`` is probed if a base URL is
  configured; a worker with neither is ``unknown`` until its first batch arrives.
* **kvpool workers over ZMQ** are bootstrapped from a snapshot (:mod:`kvpool.events.snapshot`)
  when the reader starts, when the publisher restarted (its epoch changed, or its sequence
  went back), when a liveness probe shows batches the reader never got, and after a payload
  that could not be decoded: the index then equals the publisher's cache, whatever was lost.
* **TensorRT-LLM workers**: an asyncio task per worker reads ``GET {base}/server_info`` once for
  ``kv_cache_hash_algo`` (when not configured), then ``POST {base}/kv_cache_events`` every
  ``poll_interval_s`` (the call returns the engine's queued events as a JSON list and drains
  it), parsed by :func:`~kvpool.events.trtllm_json.parse_trtllm_keys` (token lists skipped)
  unless the index needs the tokens (to match by them, or to learn tokens per block: then
  parsed whole and converted by :func:`~kvpool.events.keyed.keyed`). A failed
  or non-200 poll marks the worker unhealthy; the next good one heals it. Event ids that jump
  back to 0 (or far back) mean the engine restarted: the worker is reset.
* **In-process feeds**: :meth:`Ingest.feed` converts and applies
  :class:`~kvpool.events.model.KVCacheEvent` objects from a kvpool manager;
  :meth:`Ingest.feed_vllm` and :meth:`Ingest.feed_trtllm` decode wire payloads (for tests,
  benchmarks and bridges).

Malformed payloads are counted (``decode_errors`` per worker and in total, ``events_malformed``
in the index), reported (``last_error``) and skipped; a ZMQ batch that does not decode is fetched
once more from the replay socket (a kvpool worker is re-bootstrapped from a snapshot instead).
Every other message dropped on the way is counted per worker and in total (``GET /workers``,
``/metrics``): ZMQ messages whose frames are not ``[topic, seq, payload]``
(``malformed_frames``), absurd sequence numbers (``absurd_seqs``), and batches whose sequence
went back without a restart (``stale_batches``: duplicates and late batches, told from a restart
by :class:`~kvpool.events.zmq.ZmqEventSubscriber`; the index is left as it is and nothing is
counted missed).

Block size: a worker's tokens per block are configured, or learned from its first stored chain
whose first block is known to be full (more blocks follow it, or the event names its block
size, as token-carrying vLLM records do); a later batch holding a stored chain of
another block size (a full block of another size, or any block longer) is refused whole and
counted (``block_size_refused``, ``last_error``), never applied: its blocks would match nothing.
A worker whose index is reset (a restart) learns its block size again.
Nothing an engine sends can stop ingestion: a reader thread or poller that fails unexpectedly is
restarted with backoff (from the last good sequence number), the worker ``degraded`` meanwhile.

Health states (``GET /workers``, ``/metrics``): ``unknown`` (never reached), ``healthy``,
``degraded`` (its reader is restarting) and ``unhealthy`` (a probe or poll failed). Healthy
workers get the traffic; unknown and degraded ones only while no worker is healthy; unhealthy
ones never. In-process feeds are healthy from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from kvpool.errors import EventFormatError, KVPoolError, TransportError, UnknownWorkerError
from kvpool.events.keyed import KeyedEvent, keyed_events
from kvpool.events.model import KVCacheEvent
from kvpool.events.trtllm_json import parse_trtllm_json, parse_trtllm_keys
from kvpool.hashing import jit
from kvpool.hashing.keys import HashAlgo
from kvpool.router.config import IngestOptions, WorkerConfig, WorkerKind
from kvpool.router.index import HOLE_WINDOW, KvIndex
from kvpool.router.shared_tier import SharedTiers
from kvpool.router.zmq_reader import (
    DELIVERY_COUNTS,
    Delivery,
    ReaderSink,
    ZmqReader,
    decode_vllm,
    next_backoff,
)

__all__ = ["WORKER_STATES", "Ingest", "IngestCounters", "TransportStatus"]

logger = logging.getLogger(__name__)

UNKNOWN, HEALTHY, DEGRADED, UNHEALTHY = "unknown", "healthy", "degraded", "unhealthy"
WORKER_STATES: Final = (UNKNOWN, HEALTHY, DEGRADED, UNHEALTHY)


@dataclass(slots=True)
class IngestCounters:
    """Totals over every worker (for ``/metrics``)."""

    batches: int = 0
    events: int = 0
    decode_errors: int = 0
    gaps: int = 0
    replayed: int = 0
    missed: int = 0
    restarts: int = 0
    polls: int = 0
    poll_errors: int = 0
    probe_failures: int = 0
    snapshots: int = 0
    transport_restarts: int = 0
    malformed_frames: int = 0
    absurd_seqs: int = 0
    stale_batches: int = 0
    block_size_refused: int = 0


@dataclass(slots=True)
class TransportStatus:
    """How one worker's events reach the router (for ``GET /workers``)."""

    transport: str  # "zmq", "http", "feed" or "none" (a predicted worker: no events)
    endpoint: str | None = None
    last_batch_at: float | None = None  # time.monotonic()
    last_seq: int | None = None
    last_event_id: int | None = None
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    missed: int = 0
    restarts: int = 0
    decode_errors: int = 0
    poll_errors: int = 0
    snapshots: int = 0
    transport_restarts: int = 0
    malformed_frames: int = 0
    """ZMQ messages dropped because their frames were not [topic, 8-byte seq, payload]."""
    absurd_seqs: int = 0
    """ZMQ messages held as suspect for an absurd sequence number."""
    stale_batches: int = 0
    """ZMQ batches dropped because their seq went back without a restart."""
    block_size_refused: int = 0
    """Batches refused whole for a stored chain of another block size than the worker's."""
    state: str = UNKNOWN
    reason: str | None = "not reached yet"
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "transport": self.transport,
            "endpoint": self.endpoint,
            "seconds_since_last_batch": (
                None if self.last_batch_at is None else round(now - self.last_batch_at, 3)
            ),
            "last_seq": self.last_seq,
            "batches": self.batches,
            "gaps": self.gaps,
            "replayed": self.replayed,
            "missed": self.missed,
            "restarts": self.restarts,
            "decode_errors": self.decode_errors,
            "poll_errors": self.poll_errors,
            "snapshots": self.snapshots,
            "transport_restarts": self.transport_restarts,
            "malformed_frames": self.malformed_frames,
            "absurd_seqs": self.absurd_seqs,
            "stale_batches": self.stale_batches,
            "block_size_refused": self.block_size_refused,
            "state": self.state,
            "reason": self.reason,
            "unhealthy_reason": None if self.state == HEALTHY else self.reason,
            "last_error": self.last_error,
        }


class Ingest:
    """Feeds a :class:`KvIndex` from its workers. The index must already know every worker
    added here; the event loop that runs :meth:`start` is the only one touching the index."""

    def __init__(
        self, index: KvIndex, options: IngestOptions | None = None,
        shared: SharedTiers | None = None,
    ) -> None:
        self.index = index
        self.shared = shared if shared is not None else SharedTiers()
        """Where blocks announced on the remote cache level go (the router's, to credit them;
        :mod:`kvpool.router.shared_tier`); the index sees the rest."""
        self.options = options or IngestOptions()
        self.counters = IngestCounters()
        self._workers: dict[str, WorkerConfig] = {}
        self._status: dict[str, TransportStatus] = {}
        self.next_id: dict[str, int] = {}
        self.block_size: dict[str, int] = {}  # learned ones, while the index holds them
        self._tasks: list[asyncio.Task[None]] = []
        self._readers: list[ZmqReader] = []
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------------ setup

    def add(self, worker: WorkerConfig) -> None:
        """Ingest ``worker``'s events once started (it must be registered in the index).

        For a worker the index matches by tokens, the compiled token reader
        (:mod:`kvpool.hashing.jit`) is loaded now (about half a second, once per process), not while
        the worker's first batch waits."""
        if not self.index.has_worker(worker.id):
            raise UnknownWorkerError(f"worker {worker.id!r} is not registered in the index")
        self._workers[worker.id] = worker
        if self.index.uses_tokens(worker.id):
            jit.backend()
        if worker.zmq_endpoint is not None:
            status = TransportStatus("zmq", worker.zmq_endpoint)
            if worker.replay_endpoint is None and worker.http_base_url is None:
                status.reason = ("no batch received yet, and nothing to probe (no "
                                 "replay_endpoint or http_base_url)")
        elif worker.kind is WorkerKind.TRTLLM:
            status = TransportStatus("http", worker.http_base_url)
        elif worker.approx_blocks is not None:  # no events: the router predicts its cache
            status = TransportStatus("none", state=HEALTHY, reason=None)
        else:
            status = TransportStatus("feed", state=HEALTHY, reason=None)
        self._status[worker.id] = status
        self._refresh_routing()

    def status(self, worker_id: str) -> TransportStatus:
        status = self._status.get(worker_id)
        if status is None:
            if not self.index.has_worker(worker_id):
                raise UnknownWorkerError(f"unknown worker {worker_id!r}")
            status = self._status[worker_id] = TransportStatus("feed", state=HEALTHY, reason=None)
        return status

    async def start(self) -> None:
        """Start every transport (ZMQ threads, HTTP pollers, health probes)."""
        self._loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=self.options.http_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        sink = ReaderSink(self._deliver, self._reader_failed, self._set_health,
                          self._count_probe_failure)
        for w in self._workers.values():
            if w.zmq_endpoint is not None:
                tokens = self.index.uses_tokens(w.id)
                reader = ZmqReader(sink, self._loop, w, self.options, tokens=tokens)
                self._readers.append(reader)
                reader.start()
                if w.replay_endpoint is None and w.http_base_url is not None:
                    self._tasks.append(asyncio.create_task(self._probe_http(w)))
            elif w.kind is WorkerKind.TRTLLM:
                self._tasks.append(asyncio.create_task(self._poll_trtllm(w)))
            elif w.http_base_url is not None:
                self._tasks.append(asyncio.create_task(self._probe_http(w)))
        # A router that starts after its workers knows what they hold before its first route:
        # wait (up to the replay timeout) for every reader's first snapshot or replay.
        if self._readers:
            await asyncio.to_thread(_wait_ready, self._readers, self.options.http_timeout_s + 0.5)
            await asyncio.sleep(0)  # the deliveries they posted run before start() returns

    async def stop(self) -> None:
        """Stop every transport and wait for them."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for reader in self._readers:
            reader.stop_event.set()
        for reader in self._readers:
            await asyncio.to_thread(reader.join, 5.0)
        self._readers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------------------ feeds

    def feed(self, worker_id: str, events: Iterable[KVCacheEvent | KeyedEvent]) -> int:
        """Apply a kvpool manager's events in-process (converted here, once: records pass as
        they are); returns how many were applied."""
        status = self.status(worker_id)
        batch = keyed_events(events, self.index.uses_tokens(worker_id))
        applied = self._apply(worker_id, batch)
        self._account(worker_id, status, len(batch))
        return applied

    def feed_vllm(self, worker_id: str, payload: bytes) -> int:
        """Decode one vLLM msgpack batch and apply it (events numbered per worker)."""
        status = self.status(worker_id)
        cfg = self._workers.get(worker_id)
        algo = (cfg.hash_algo if cfg is not None else None) or HashAlgo.VLLM_SHA256_CBOR.value
        first = self.next_id.get(worker_id, 0)
        try:
            events = decode_vllm(payload, algo, first, self.index.uses_tokens(worker_id))
        except EventFormatError as exc:
            self._malformed(worker_id, status, str(exc))
            return 0
        self.next_id[worker_id] = first + len(events)
        applied = self._apply(worker_id, events)
        self._account(worker_id, status, len(events))
        return applied

    def feed_trtllm(self, worker_id: str, text: str | bytes) -> int:
        """Decode one TensorRT-LLM JSON event list and apply it."""
        status = self.status(worker_id)
        index = self.index
        events: list[KeyedEvent]
        try:
            # The keyed parser skips token lists: no tokens, nor (unlike vLLM's) a block size
            # to learn. Where the index needs either, the events are parsed whole and converted.
            tokens = index.uses_tokens(worker_id)
            if tokens or index.learns_block_size(worker_id):
                events = keyed_events(parse_trtllm_json(text, tokens=True), tokens)
            else:
                events = parse_trtllm_keys(text)
        except EventFormatError as exc:
            self._malformed(worker_id, status, str(exc))
            return 0
        self._detect_id_restart(worker_id, status, events)
        applied = self._apply(worker_id, events)
        self._account(worker_id, status, len(events))
        return applied

    # ------------------------------------------------------------------------------ internals

    def _apply(self, worker_id: str, events: list[KeyedEvent]) -> int:
        """Apply a batch of records: remote-level blocks to :attr:`shared`, the rest to the
        index; a batch of another block size than the worker's is refused (module doc)."""
        refusal = self._block_size_refusal(worker_id, events)
        if refusal is not None:
            status = self.status(worker_id)
            status.block_size_refused += 1
            status.last_error = refusal
            self.counters.block_size_refused += 1
            if status.block_size_refused == 1 or status.block_size_refused % 1000 == 0:
                logger.warning("worker %s: batch refused (%d so far): %s", worker_id,
                               status.block_size_refused, refusal)
            return 0
        return self.index.apply_many(worker_id, self.shared.split(worker_id, events))

    def _block_size_refusal(self, worker_id: str, events: list[KeyedEvent]) -> str | None:
        """Why the batch must be refused for its block size (None: it may be applied; its
        first full chain teaches a worker that has no block size yet)."""
        index = self.index
        tpb = index.tokens_per_block_of(worker_id)
        learned = index.learns_block_size(worker_id)
        if learned and tpb is None:
            self.block_size.pop(worker_id, None)  # reset (or new): learned again
        want = self.block_size.get(worker_id) if learned else tpb
        settles = None
        for n, full in stored_block_sizes(events):
            size = want if want is not None else settles
            if size is None:
                if full:
                    settles = n
            elif n > size or (full and n != size):
                return (f"a stored chain's first block holds {n} tokens, the worker's blocks "
                        f"hold {size}: batch refused")
        if settles is not None and learned:
            self.block_size[worker_id] = settles
        return None

    def _account(self, worker_id: str, status: TransportStatus, n_events: int) -> None:
        status.batches += 1
        status.last_batch_at = time.monotonic()
        self.counters.batches += 1
        self.counters.events += n_events

    def _malformed(self, worker_id: str, status: TransportStatus, error: str | None) -> None:
        status.decode_errors += 1
        status.last_error = error
        self.counters.decode_errors += 1
        self.index.note_malformed(worker_id)
        logger.warning("worker %s sent a payload that does not decode: %s", worker_id, error)

    def _set_health(self, worker_id: str, healthy: bool, reason: str | None = None) -> None:
        self._set_state(worker_id, HEALTHY if healthy else UNHEALTHY, reason)

    def _set_state(self, worker_id: str, state: str, reason: str | None = None) -> None:
        """Record a worker's health state, then which workers may be routed to."""
        if not self.index.has_worker(worker_id):
            return
        status = self.status(worker_id)
        was = status.state
        status.state = state
        status.reason = None if state == HEALTHY else reason
        if state != was:
            if state == HEALTHY:
                logger.info("worker %s is healthy", worker_id)
            else:
                logger.warning("worker %s is %s: %s", worker_id, state, reason)
            self._refresh_routing()

    def _count_probe_failure(self) -> None:
        self.counters.probe_failures += 1

    def _reader_failed(self, worker_id: str, reason: str) -> None:
        status = self.status(worker_id)
        status.transport_restarts += 1
        self.counters.transport_restarts += 1
        self._set_state(worker_id, DEGRADED, reason)

    def _refresh_routing(self) -> None:
        """Healthy workers are routed to; unknown and degraded ones only while none is
        healthy; unhealthy ones never."""
        states = {wid: st.state for wid, st in self._status.items() if self.index.has_worker(wid)}
        fallback = HEALTHY not in states.values()
        for wid, state in states.items():
            routable = state == HEALTHY or (fallback and state in (UNKNOWN, DEGRADED))
            if self.index.is_healthy(wid) != routable:
                self.index.set_healthy(wid, routable)

    def _detect_id_restart(
        self, worker_id: str, status: TransportStatus, events: list[KeyedEvent]
    ) -> None:
        if not events:
            return
        first, last = events[0].event_id, status.last_event_id
        if last is not None and (first < last - HOLE_WINDOW or first == 0 < last):
            logger.warning("worker %s restarted (event id %d after %d)", worker_id, first, last)
            status.restarts += 1
            self.counters.restarts += 1
            self.index.reset_worker(worker_id)
        status.last_event_id = max(e.event_id for e in events)

    def _deliver(self, worker_id: str, delivery: Delivery) -> None:
        """Runs on the event loop: apply what a ZMQ reader decoded."""
        if not self.index.has_worker(worker_id):
            return
        status = self.status(worker_id)
        c = self.counters
        for name in DELIVERY_COUNTS:
            n = getattr(delivery, name)
            if n:
                setattr(status, name, getattr(status, name) + n)
                setattr(c, name, getattr(c, name) + n)
        resets = set(delivery.resets)
        for pos, (seq, events) in enumerate(delivery.batches):
            if pos in resets:
                self.index.reset_worker(worker_id)
            if events is None:
                self._malformed(worker_id, status, delivery.error)
                continue
            self._apply(worker_id, events)
            status.last_seq = seq
            self._account(worker_id, status, len(events))
        if delivery.batches and status.state != HEALTHY:
            self._set_health(worker_id, True)

    async def _poll_trtllm(self, w: WorkerConfig) -> None:
        assert self._session is not None and w.http_base_url is not None
        session, base = self._session, w.http_base_url
        status = self.status(w.id)
        need_algo = w.hash_algo is None
        backoff = 0.0
        while True:
            try:
                if need_algo:
                    need_algo = not await self._read_server_info(session, base, w.id)
                async with session.post(f"{base}/kv_cache_events") as resp:
                    if resp.status != 200:
                        raise TransportError(f"POST /kv_cache_events answered {resp.status}")
                    body = await resp.read()
                self.counters.polls += 1
                self._set_health(w.id, True)
                self.feed_trtllm(w.id, body)
                backoff = 0.0
            except (aiohttp.ClientError, TimeoutError, TransportError) as exc:
                status.poll_errors += 1
                self.counters.poll_errors += 1
                self._set_health(w.id, False, f"event poll failed: {exc or type(exc).__name__}")
            except Exception as exc:  # never silently dead: report, wait, poll again
                backoff = next_backoff(backoff)
                logger.exception("event poller of worker %s failed", w.id)
                self._reader_failed(w.id, f"event poller failed ({exc!r}); polling again in "
                                          f"{backoff:.2f} s")
                await asyncio.sleep(backoff)
            await asyncio.sleep(self.options.poll_interval_s)

    async def _read_server_info(
        self, session: aiohttp.ClientSession, base: str, worker_id: str
    ) -> bool:
        """Configure the worker's algorithm from ``/server_info``; True when settled."""
        async with session.get(f"{base}/server_info") as resp:
            if resp.status == 404:
                return True  # an engine without /server_info: its events name the algorithm
            if resp.status != 200:
                raise TransportError(f"GET /server_info answered {resp.status}")
            try:
                info = await resp.json(content_type=None)
            except ValueError as exc:
                raise TransportError(f"GET /server_info is not JSON: {exc}") from None
        algo = info.get("kv_cache_hash_algo") if isinstance(info, dict) else None
        if algo is not None:
            try:
                self.index.configure_worker(worker_id, hash_algo=algo)
            except KVPoolError as exc:
                logger.warning("worker %s advertises %s: %s", worker_id, algo, exc)
        return True

    async def _probe_http(self, w: WorkerConfig) -> None:
        assert self._session is not None
        while True:
            try:
                async with self._session.get(f"{w.http_base_url}/health") as resp:
                    ok = resp.status == 200
                    reason = f"GET /health answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, reason = False, f"GET /health failed: {exc or type(exc).__name__}"
            if not ok:
                self._count_probe_failure()
            self._set_health(w.id, ok, reason)
            await asyncio.sleep(self.options.health_interval_s)


def stored_block_sizes(events: list[KeyedEvent]) -> Iterator[tuple[int, bool]]:
    """(tokens of its first block, whether that block is full) for each stored record of
    ``events`` whose block size is known; a block is full when more follow in its chain, or
    when the event announces the block size (vLLM's ``block_size``). Only stored records
    carry either."""
    for ev in events:
        if ev.block_size:
            yield ev.block_size, True
        elif ev.block_tokens:
            yield ev.block_tokens, len(ev.keys) > 1


def _wait_ready(readers: list[ZmqReader], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for reader in readers:
        reader.ready.wait(max(0.0, end - time.monotonic()))
