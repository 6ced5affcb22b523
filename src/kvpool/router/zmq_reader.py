"""The router's reader of one ZMQ worker: a thread that owns the worker's sockets.

ZeroMQ sockets stay on the thread that made them, so each ZMQ worker gets a thread that runs a
:class:`~kvpool.events.zmq.ZmqEventSubscriber`, decodes each batch
(:func:`decode_vllm`) and hands the result to the event loop through its :class:`ReaderSink`
(the router's :class:`~kvpool.router.ingest.Ingest`), which alone touches the index. Every
``health_interval_s`` it probes the replay socket
(:meth:`~kvpool.events.zmq.ZmqEventSubscriber.probe`), then:

* a vLLM publisher (no snapshots): asks for a replay from the next expected batch, so a lost
  last batch of an idle worker comes back within one period;
* a kvpool publisher with snapshots: compares the publisher's next seq and epoch with what was
  delivered; a changed epoch (restart) or batches that do not arrive within a short grace make
  the reader bootstrap the worker from a snapshot.

Snapshots also bootstrap a kvpool worker when the reader starts, when the subscriber sees the
sequence go back (restart), and after a batch that does not decode; a vLLM worker's undecodable
batch is fetched once more from the replay socket (a copy damaged on the way may decode), else
skipped. Whatever fails unexpectedly restarts the reader with backoff from the last good
sequence number; the worker is ``degraded`` meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from kvpool.errors import EventFormatError
from kvpool.events.keyed import KeyedEvent
from kvpool.events.vllm_msgpack import decode_vllm_keys
from kvpool.events.zmq import SubscribedBatch, ZmqEventSubscriber
from kvpool.hashing.keys import HashAlgo
from kvpool.router.config import IngestOptions, WorkerConfig, WorkerKind

__all__ = ["DELIVERY_COUNTS", "MAX_BACKOFF_S", "Delivery", "ReaderSink", "ZmqReader", "decode_vllm",
           "next_backoff"]

logger = logging.getLogger(__name__)

_NONE_SEEN: Final = (0,) * 7
MAX_BACKOFF_S: Final = 10.0
"""Longest wait before a failed reader or poller is restarted (the wait doubles from 50 ms)."""


def next_backoff(backoff: float) -> float:
    return min(MAX_BACKOFF_S, max(0.05, backoff * 2))


def decode_vllm(payload: bytes, algo: str, first_id: int, tokens: bool) -> list[KeyedEvent]:
    """One vLLM batch as the index reads it: keyed records, with the stored blocks' tokens when
    it needs them."""
    return decode_vllm_keys(payload, hash_algo=algo, first_event_id=first_id, tokens=tokens)


DELIVERY_COUNTS: Final = ("gaps", "replayed", "missed", "restarts", "snapshots",
                          "malformed_frames", "absurd_seqs", "stale_batches")
"""The counters of a :class:`Delivery`, named as in the ingest's per-worker and total ones."""


@dataclass(slots=True)
class Delivery:
    """What a ZMQ reader thread hands to the event loop for one recv."""

    resets: list[int] = field(default_factory=list)  # positions in ``batches`` after a restart
    batches: list[tuple[int, list[KeyedEvent] | None]] = field(default_factory=list)
    gaps: int = 0
    replayed: int = 0
    missed: int = 0
    restarts: int = 0
    malformed_frames: int = 0  # messages whose frames were not [topic, seq, payload]
    absurd_seqs: int = 0  # messages held as suspect for an absurd seq
    stale_batches: int = 0  # batches whose seq went back without a restart (dropped)
    snapshots: int = 0
    error: str | None = None  # why the last undecodable batch was refused


@dataclass(frozen=True, slots=True)
class ReaderSink:
    """Where a reader's results go: each is posted to the event loop, which alone runs them."""

    deliver: Callable[[str, Delivery], None]
    """(worker id, delivery): batches decoded, counters, snapshots."""
    failed: Callable[[str, str], None]
    """(worker id, reason): the reader failed and restarts with backoff."""
    health: Callable[[str, bool, str], None]
    """(worker id, healthy, reason): what a liveness probe showed."""
    probe_failed: Callable[[], None]
    """Count one failed liveness probe."""


class ZmqReader(threading.Thread):
    """Owns one worker's ZMQ sockets (see the module docstring).

    ``tokens``: whether the index matches this worker by tokens (it then decodes the stored
    blocks' tokens).
    """

    def __init__(
        self,
        sink: ReaderSink,
        loop: asyncio.AbstractEventLoop,
        w: WorkerConfig,
        options: IngestOptions,
        *,
        tokens: bool,
    ) -> None:
        super().__init__(name=f"kvpool-router-zmq-{w.id}", daemon=True)
        self.sink = sink
        self.loop = loop
        self.w = w
        self.algo = w.hash_algo or HashAlgo.VLLM_SHA256_CBOR.value
        self.tokens = tokens
        self.options = options
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        """Set once the first bootstrap (snapshot or replay) was handed to the event loop."""
        self.snapshots = w.kind is WorkerKind.KVPOOL and w.replay_endpoint is not None
        self.next_id = 0
        self.resume_seq = 0  # where a restarted reader resumes: after the last batch handled
        self.epoch: bytes | None = None
        self._seen = _NONE_SEEN  # subscriber counters already reported

    def run(self) -> None:
        backoff = 0.0
        while not self.stop_event.is_set():
            try:
                self._read()
                return
            except Exception as exc:  # never silently dead: report, wait, start again
                backoff = next_backoff(backoff)
                logger.exception("ZMQ reader of worker %s failed", self.w.id)
                self._post(self.sink.failed, self.w.id,
                           f"event reader failed ({exc!r}); restarting in {backoff:.2f} s")
                if self.stop_event.wait(backoff):
                    return

    def _read(self) -> None:
        w = self.w
        assert w.zmq_endpoint is not None
        sub = ZmqEventSubscriber(
            w.zmq_endpoint, w.replay_endpoint, w.topic, start_seq=self.resume_seq,
            replay_timeout_s=self.options.http_timeout_s,
        )
        self._seen = _NONE_SEEN
        with sub:
            if not (self.snapshots and self._resync(sub)):
                self._handle(sub, sub.catch_up())
            self.ready.set()
            next_probe = time.monotonic()
            while not self.stop_event.is_set():
                self._handle(sub, sub.recv(timeout_s=0.05))
                if w.replay_endpoint is not None and time.monotonic() >= next_probe:
                    self._check(sub)
                    next_probe = time.monotonic() + self.options.health_interval_s

    def _check(self, sub: ZmqEventSubscriber) -> None:
        """The liveness probe, and what it shows (see the module docstring)."""
        status = sub.probe(self.options.http_timeout_s)
        if status is None:
            self._post_health(False, "replay socket did not answer a liveness probe")
            return
        self._post_health(True, "")
        if not self.snapshots or status.next_seq is None:
            self._handle(sub, sub.catch_up())
            return
        if self.epoch is None:
            self.epoch = status.epoch
        behind = status.epoch != self.epoch
        if not behind:
            # Batches published before the probe may still be on their way: a short grace.
            grace = time.monotonic() + min(0.25, self.options.health_interval_s / 4)
            while (sub.expected_seq or 0) < status.next_seq and time.monotonic() < grace:
                self._handle(sub, sub.recv(timeout_s=0.02))
            # (ahead is fine: batches that came after the probe)
            behind = (sub.expected_seq or 0) < status.next_seq
        if behind:
            logger.warning("worker %s: publisher at seq %d (epoch %s), reader at %s: snapshot",
                           self.w.id, status.next_seq, status.epoch.hex() if status.epoch else
                           None, sub.expected_seq)
            if not self._resync(sub):  # a kvpool publisher without snapshots: replay it is
                self.epoch = status.epoch
                self._handle(sub, sub.catch_up())

    def _resync(self, sub: ZmqEventSubscriber, before: Delivery | None = None) -> bool:
        """Replace the worker's blocks by the publisher's snapshot, after ``before`` (posted
        with it); False when the publisher has none (nothing posted)."""
        snap = sub.snapshot()
        if snap is None:
            return False  # ``before`` stays the caller's to post
        d = before if before is not None else Delivery()
        try:
            events = decode_vllm(snap.payload, self.algo, 0, self.tokens)
        except EventFormatError as exc:
            d.error = f"snapshot: {exc}"
            d.batches.append((snap.seq - 1, None))
        else:
            self.next_id = len(events)
            self.epoch = snap.epoch
            d.resets.append(len(d.batches))
            d.batches.append((snap.seq - 1, events))
            d.snapshots += 1
        self.resume_seq = sub.expected_seq or 0
        self._post(self.sink.deliver, self.w.id, d)
        return True

    def _handle(self, sub: ZmqEventSubscriber, batches: list[SubscribedBatch]) -> None:
        counters = (sub.gaps, sub.replayed, sub.missed, sub.restarts, sub.malformed,
                    sub.absurd, sub.stale)
        if not batches and counters == self._seen:
            return
        d = Delivery()
        (d.gaps, d.replayed, d.missed, d.restarts, d.malformed_frames, d.absurd_seqs,
         d.stale_batches) = (now - before for now, before in zip(counters, self._seen, strict=True))
        self._seen = counters
        for b in batches:
            if b.restart:
                if self.snapshots and self._resync(sub, d):
                    return  # the snapshot holds this batch and every one before it
                self.next_id = 0
                d.resets.append(len(d.batches))
            events = self._decode(b.payload)
            if events is None:
                d.error = self._last_error
                d.batches.append((b.seq, None))
                if self.snapshots and self._resync(sub, d):
                    return
                payload = sub.fetch(b.seq)  # a copy damaged on the way may decode
                events = None if payload is None else self._decode(payload)
                if events is None:
                    continue
            self.next_id += len(events)
            d.batches.append((b.seq, events))
        self.resume_seq = sub.expected_seq or 0
        self._post(self.sink.deliver, self.w.id, d)

    _last_error: str | None = None

    def _decode(self, payload: bytes) -> list[KeyedEvent] | None:
        try:
            return decode_vllm(payload, self.algo, self.next_id, self.tokens)
        except EventFormatError as exc:
            self._last_error = str(exc)
            return None

    def _post_health(self, ok: bool, reason: str) -> None:
        if not ok:
            self._post(self.sink.probe_failed)
        self._post(self.sink.health, self.w.id, ok, reason)

    def _post(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed while we were stopping
            self.loop.call_soon_threadsafe(fn, *args)
