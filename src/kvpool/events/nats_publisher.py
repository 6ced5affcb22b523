"""KV events onto a NATS JetStream stream (``kvpool serve --nats``, ``kvpool bridge``).

Every message is one batch of one worker, exactly as its engine encoded it (vLLM msgpack,
TensorRT-LLM JSON; kvpool workers publish vLLM msgpack), so the router decodes it with the
decoders the direct modes use. The message's subject is ``{subject_prefix}.{worker}`` (the
worker id with every character outside ``[A-Za-z0-9_-]`` as ``_``); its headers:

``Kvpool-Worker``
    the worker id, as the router's config names it;
``Kvpool-Format``
    ``vllm`` or ``trtllm``: which decoder the payload needs;
``Kvpool-Epoch``
    a random id per publisher start: a new epoch means the worker restarted (the router
    drops what it knew of the worker first);
``Kvpool-Seq``
    the batch's number in its epoch, from 0 (the router's per-worker order);
``Nats-Msg-Id``
    ``{worker}:{epoch}:{seq}``: a publish retried after a lost acknowledgement is stored once
    (JetStream's duplicate window).

Batches are published one at a time, each acknowledged by the stream before the next is sent
(a failed publish is retried with the same id until the stream has it), so a worker's batches
are in the stream in their order. The stream (file storage, subjects ``{subject_prefix}.>``,
direct gets on) is created when missing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import threading
from collections.abc import Callable
from typing import Any, Final

from kvpool.errors import InvalidArgumentError, TransportError

__all__ = [
    "DEFAULT_STREAM",
    "DEFAULT_SUBJECT_PREFIX",
    "FORMATS",
    "H_EPOCH",
    "H_FORMAT",
    "H_SEQ",
    "H_WORKER",
    "NatsEventPublisher",
    "ensure_stream",
    "subject_of",
]

logger = logging.getLogger(__name__)

DEFAULT_STREAM: Final = "KVPOOL_EVENTS"
DEFAULT_SUBJECT_PREFIX: Final = "kvpool.events"
H_WORKER: Final = "Kvpool-Worker"
H_FORMAT: Final = "Kvpool-Format"
H_EPOCH: Final = "Kvpool-Epoch"
H_SEQ: Final = "Kvpool-Seq"
FORMATS: Final = ("vllm", "trtllm")
_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_RETRY_S: Final = 0.2


def subject_of(prefix: str, worker_id: str) -> str:
    """The subject a worker's batches go to."""
    return f"{prefix}.{_TOKEN.sub('_', worker_id)}"


async def ensure_stream(js: Any, stream: str, subject_prefix: str) -> None:
    """Create the event stream when it does not exist (file storage, direct gets)."""
    from nats.js.api import StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    try:
        await js.stream_info(stream)
        return
    except NotFoundError:
        pass
    await js.add_stream(StreamConfig(
        name=stream, subjects=[f"{subject_prefix}.>"], storage=StorageType.FILE,
        allow_direct=True,
    ))


class NatsEventPublisher:
    """Publishes one worker's batches onto the event stream from a thread of its own.

    :meth:`publish` is thread-safe and never blocks on the network (batches queue up while
    the server is away, and go in order when it is back); :meth:`close` sends what is queued
    (for up to ``timeout_s``) and disconnects. The signature of :meth:`publish` is
    :class:`~kvpool.events.zmq.ZmqEventPublisher`'s, so either serves an engine.
    """

    def __init__(
        self, url: str, worker_id: str, *, fmt: str = "vllm", stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX, connect_timeout_s: float = 5.0,
    ) -> None:
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if not worker_id:
            raise InvalidArgumentError("worker_id must not be empty")
        if not url.startswith(("nats://", "tls://")):
            raise InvalidArgumentError(f"not a NATS URL (nats://host:port): {url!r}")
        self.url = url
        self.endpoint = url
        self.replay_endpoint: str | None = None  # ZmqEventPublisher's: the stream replays
        self.worker_id = worker_id
        self.fmt = fmt
        self.stream = stream
        self.subject = subject_of(subject_prefix, worker_id)
        self._prefix = subject_prefix
        self.epoch = os.urandom(8).hex()
        self._seq = 0
        self.published = 0
        """Batches the stream acknowledged."""
        self.retries = 0
        """Publishes tried again (no acknowledgement in time, server away)."""
        self._queue: queue.SimpleQueue[tuple[bytes, Callable[[], object] | None] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvpool-nats-publisher",
                                        daemon=True)
        self._closing = threading.Event()
        self._thread.start()
        if not self._ready.wait(connect_timeout_s) or self._error is not None:
            self._closing.set()
            self._queue.put(None)
            raise TransportError(f"cannot reach NATS at {url}: {self._error or 'timed out'}")

    def next_seq(self) -> int:
        """The number the next batch gets."""
        return self._seq

    def publish(self, payload: bytes, *, update: Callable[[], object] | None = None) -> None:
        """Queue one batch (``update`` runs once the stream has it)."""
        with self._lock:
            self._seq += 1
        self._queue.put((payload, update))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then disconnect."""
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def __enter__(self) -> NatsEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the constructor or logged
            self._error = exc
            self._ready.set()
            if not self._closing.is_set():
                logger.exception("NATS publisher of worker %s failed", self.worker_id)

    async def _main(self) -> None:
        import nats

        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2)
        try:
            js = nc.jetstream()
            await ensure_stream(js, self.stream, self._prefix)
            self._ready.set()
            loop = asyncio.get_running_loop()
            seq = 0
            while True:
                item = await loop.run_in_executor(None, self._queue.get)
                if item is None:
                    return
                payload, update = item
                await self._send(js, payload, seq)
                seq += 1
                self.published += 1
                if update is not None:
                    update()
        finally:
            await nc.close()

    async def _send(self, js: Any, payload: bytes, seq: int) -> None:
        """Publish until the stream acknowledges (same message id each try)."""
        headers = {H_WORKER: self.worker_id, H_FORMAT: self.fmt, H_EPOCH: self.epoch,
                   H_SEQ: str(seq), "Nats-Msg-Id": f"{self.worker_id}:{self.epoch}:{seq}"}
        while True:
            try:
                await js.publish(self.subject, payload, headers=dict(headers), timeout=2.0)
                return
            except Exception as exc:  # no ack, server away, no stream yet: try again
                self.retries += 1
                if self.retries == 1 or self.retries % 100 == 0:
                    logger.warning("worker %s: publish to NATS failed (%d so far): %s",
                                   self.worker_id, self.retries, exc or type(exc).__name__)
                if self._closing.is_set() and self.retries > 50:
                    raise TransportError("NATS publisher closing with batches unsent") from exc
                await asyncio.sleep(_RETRY_S)
                try:
                    await ensure_stream(js, self.stream, self._prefix)
                except Exception:
                    continue
