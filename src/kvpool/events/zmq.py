"""KV event transport over ZeroMQ: vLLM's PUB socket with a replay ROUTER (COMPATIBILITY §3).

Wire protocol:

* PUB, three frames per batch: ``[topic, seq (8 bytes big-endian), payload]``; ``seq`` starts
  at 0 per publisher and grows by one per batch, so a smaller seq means the publisher restarted.
* Replay ROUTER: the last ``buffer_steps`` batches. A DEALER sends ``[b"", start_seq (8B BE)]``
  and receives ``[b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq,
  then the end marker ``[b"", b"", b"\\xff" * 8, b""]``. (vLLM's own publisher leaves the topic
  out of replies; the subscriber accepts both.)

:class:`ZmqEventPublisher` never blocks its caller: :meth:`~ZmqEventPublisher.publish` queues
the payload and a background thread (which owns both sockets, as ZeroMQ requires) sends it and
serves replay requests. :class:`ZmqEventSubscriber` delivers batches in sequence order,
repairs gaps through the replay socket and flags publisher restarts in-band.

Endpoints ending in port 0 (or ``*``) bind an ephemeral port; the bound endpoints are exposed
as ``endpoint`` / ``replay_endpoint``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from typing import Any, Final, NamedTuple

import zmq

from kvpool.errors import InvalidArgumentError, TransportError

__all__ = ["END_SEQ", "SubscribedBatch", "ZmqEventPublisher", "ZmqEventSubscriber"]

logger = logging.getLogger(__name__)

END_SEQ: Final = b"\xff" * 8
"""The seq frame of the replay end marker (-1 as a signed 8-byte big-endian int)."""


def _bind_address(endpoint: str) -> str:
    # libzmq spells "any free port" as "*"; port 0 is the spelling everyone else uses.
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + "*"
    return endpoint


def _bind(socket: zmq.Socket[Any], endpoint: str) -> str:
    try:
        socket.bind(_bind_address(endpoint))
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint!r}: {exc}") from None
    bound = socket.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


class ZmqEventPublisher:
    """PUB + replay ROUTER publisher of event batches (payloads are opaque bytes).

    Args:
        endpoint: where the PUB socket binds (``tcp://127.0.0.1:0`` picks a free port).
        replay_endpoint: where the replay ROUTER binds; None disables replay.
        topic: the first frame of every message (subscribers filter on its prefix).
        buffer_steps: how many recent batches the replay socket can serve.
        hwm: PUB send high-water mark (messages past it are dropped by ZeroMQ, never blocked).

    Raises:
        InvalidArgumentError: ``buffer_steps`` < 1.
        TransportError: an endpoint cannot be bound.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = "tcp://127.0.0.1:5558",
        topic: str = "",
        buffer_steps: int = 10_000,
        *,
        hwm: int = 100_000,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._topic = topic.encode("utf-8")
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub: zmq.Socket[Any] = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay burst is never cut short
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except TransportError:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._queue: deque[bytes] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._skip: set[int] = set()
        self._next_seq = 0
        self._closing = False
        self._closed = False
        self._signalled = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kvpool-zmq-pub", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- public

    @property
    def next_seq(self) -> int:
        """The seq of the next batch the background thread will send."""
        return self._next_seq

    def publish(self, payload: bytes) -> None:
        """Queue one batch; returns at once. Raises TransportError after :meth:`close`."""
        if self._closing:
            raise TransportError("publish() on a closed ZmqEventPublisher")
        self._queue.append(payload)
        self._wake()

    def skip_on_pub(self, seq: int) -> None:
        """Fault injection for tests: batch ``seq`` is not sent on PUB but stays replayable."""
        self._skip.add(seq)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closing = True
        self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("ZMQ publisher thread did not stop within %.1f s", timeout_s)
        self._closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internal

    def _wake(self) -> None:
        # One byte per idle period is enough; the flag saves a syscall per publish.
        if not self._signalled:
            self._signalled = True
            # A full pipe already holds a wake-up; a closed one means we are shutting down.
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self._signalled = False
                self._send_queued()
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._closing and not self._queue:
                    break
        except Exception:  # a dead thread would silently stop all events; say why
            logger.exception("ZMQ publisher thread failed")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send_queued(self) -> None:
        queue, pub, buffer, topic = self._queue, self._pub, self._buffer, self._topic
        while queue:
            payload = queue.popleft()
            seq = self._next_seq
            self._next_seq = seq + 1
            seq_bytes = seq.to_bytes(8, "big")
            if seq in self._skip:
                self._skip.discard(seq)
            else:
                pub.send_multipart((topic, seq_bytes, payload), copy=len(payload) < 65536)
            buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        router = self._replay
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            topic = self._topic
            for seq, payload in self._buffer:
                if seq >= start:
                    router.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload))
            router.send_multipart((identity, b"", b"", END_SEQ, b""))


class SubscribedBatch(NamedTuple):
    """One delivered batch.

    ``restart`` is True on the first batch after the subscriber saw the publisher restart (its
    seq went back): the consumer should drop what it knew of that publisher before applying it.
    """

    seq: int
    payload: bytes
    restart: bool = False


class ZmqEventSubscriber:
    """SUB + replay DEALER client that delivers a publisher's batches in order.

    Sequence handling, per message received on SUB with sequence ``seq`` while ``expected`` is
    the next seq to deliver:

    * ``seq == expected``: delivered.
    * ``seq > expected`` (a gap): the missing batches are requested from the replay socket and
      delivered in order; batches the publisher no longer buffers are counted in ``missed``.
      Without a replay endpoint the gap is counted in ``missed`` and skipped.
    * ``seq`` at or below the last seq seen on SUB: the publisher restarted. ``restarts`` is
      incremented, delivery restarts from seq 0 of the new publisher (replaying what the SUB
      socket missed), and the first batch delivered carries ``restart=True``.
    * otherwise (``seq < expected``): a duplicate of a replayed batch, dropped.

    ``start_seq`` is the first seq expected (0: a subscriber started before or with its
    publisher gets everything still buffered); None accepts whatever seq arrives first.

    A restart is recognised by the sequence going back. If the first batch the subscriber sees
    from a restarted publisher already has a seq beyond the old publisher's last, the two are
    indistinguishable by sequence alone and the restart looks like a gap.

    Not thread-safe: one thread calls :meth:`recv` / :meth:`catch_up`.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = 0,
        replay_timeout_s: float = 2.0,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._sub: zmq.Socket[Any] = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint!r}: {exc}") from None
        self._dealer: zmq.Socket[Any] | None = None
        if replay_endpoint is not None:
            self._dealer = self._new_dealer()
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._expected = start_seq
        self._sub_last: int | None = None
        self._restart_pending = False
        self._closed = False
        self.restarts = 0
        """Publisher restarts detected."""
        self.gaps = 0
        """Gaps seen on SUB (each repaired by replay as far as the buffer allowed)."""
        self.replayed = 0
        """Batches delivered from the replay socket."""
        self.missed = 0
        """Batches that could not be delivered (not buffered any more, or no replay socket)."""
        self.malformed = 0
        """Messages ignored because their frames were not [topic, 8-byte seq, payload]."""

    @property
    def expected_seq(self) -> int | None:
        """The seq of the next batch to deliver (None until the first with start_seq=None)."""
        return self._expected

    def recv(self, timeout_s: float | None = None) -> list[SubscribedBatch]:
        """Wait for batches and return every one that can be delivered now, in seq order.

        ``timeout_s`` None waits until a message arrives, > 0 waits up to that long, <= 0
        does not wait. Gap repair may add up to ``replay_timeout_s`` of waiting.
        """
        if self._closed:
            raise TransportError("recv() on a closed ZmqEventSubscriber")
        out: list[SubscribedBatch] = []
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self._sub.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            self._on_message(int.from_bytes(frames[1], "big"), frames[2], out)

    def catch_up(self) -> list[SubscribedBatch]:
        """Ask the replay socket for every buffered batch from the expected seq on.

        Use it after connecting (messages published before the SUB socket joined are lost to
        it) or when the publisher may have gone quiet after a lost message.
        """
        if self._dealer is None:
            return []
        out: list[SubscribedBatch] = []
        self._replay_into(0 if self._expected is None else self._expected, out)
        return out

    def close(self) -> None:
        """Close both sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internal

    def _new_dealer(self) -> zmq.Socket[Any]:
        assert self.replay_endpoint is not None
        dealer: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self.replay_endpoint)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            raise TransportError(f"cannot connect to {self.replay_endpoint!r}: {exc}") from None
        return dealer

    def _deliver(self, seq: int, payload: bytes, out: list[SubscribedBatch]) -> None:
        out.append(SubscribedBatch(seq, payload, self._restart_pending))
        self._restart_pending = False
        self._expected = seq + 1

    def _on_message(self, seq: int, payload: bytes, out: list[SubscribedBatch]) -> None:
        if self._sub_last is not None and seq <= self._sub_last:
            self.restarts += 1
            self._restart_pending = True
            self._expected = 0
        self._sub_last = seq
        if self._expected is None:
            self._expected = seq
        if seq > self._expected:
            self.gaps += 1
            if self._dealer is not None:
                self._replay_into(self._expected, out)
            if seq > self._expected:  # what replay could not fill
                self.missed += seq - self._expected
                self._expected = seq
        if seq == self._expected:
            self._deliver(seq, payload, out)

    def _replay_into(self, start: int, out: list[SubscribedBatch]) -> None:
        """Request batches >= start and deliver the ones at or after the expected seq."""
        dealer = self._dealer
        assert dealer is not None
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            if not dealer.poll(self._replay_timeout_ms):
                logger.warning("replay from %s timed out", self.replay_endpoint)
                # A late answer must not be mistaken for the next request's: new socket.
                dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return
            frames = dealer.recv_multipart()
            if len(frames) == 4:  # [b"", topic, seq, payload] (COMPATIBILITY §3)
                seq_bytes, payload = frames[2], frames[3]
            elif len(frames) == 3:  # [b"", seq, payload] (vLLM's own publisher)
                seq_bytes, payload = frames[1], frames[2]
            else:
                self.malformed += 1
                continue
            if seq_bytes == END_SEQ:
                return
            if len(seq_bytes) != 8:
                self.malformed += 1
                continue
            seq = int.from_bytes(seq_bytes, "big")
            expected = start if self._expected is None else self._expected
            if seq < expected:
                continue
            if seq > expected:
                self.missed += seq - expected
            self.replayed += 1
            self._deliver(seq, payload, out)
