"""KV event transport over ZeroMQ: vLLM's PUB socket with a replay ROUTER (COMPATIBILITY §3).

Wire protocol:

* PUB, three frames per batch: ``[topic, seq (8 bytes big-endian), payload]``; ``seq`` starts
  at 0 per publisher and grows by one per batch, so a smaller seq means the publisher restarted.
* Replay ROUTER: the last ``buffer_steps`` batches. A DEALER sends ``[b"", start_seq (8B BE)]``
  and receives ``[b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq,
  then the end marker ``[b"", b"", b"\\xff" * 8, status]``. (vLLM's own publisher leaves the
  topic out of replies and sends an empty status; the subscriber accepts both.)
* kvpool additions, which a vLLM publisher answers with a bare end marker: the end marker's
  ``status`` is the publisher's next seq (8B BE) and its epoch (8 random bytes, new per
  publisher), so a liveness probe tells a consumer that it is behind or that the publisher
  restarted; and a **snapshot request** ``[b"", b"kvpool-snapshot"]`` (15 bytes: read as a
  start seq, it is past anything buffered) is answered, by a publisher given a ``snapshot``
  source, with ``[b"", topic, seq (8B BE), payload]``: one batch holding the state of every
  batch before ``seq`` (an all-cleared event, then every cached block as stored events; see
  :mod:`kvpool.events.snapshot`), then the end marker.

:class:`ZmqEventPublisher` never blocks its caller: :meth:`~ZmqEventPublisher.publish` numbers
the payload, keeps it for replay and queues it on an unbounded inproc pipe; a background thread
running ZeroMQ's proxy (in C, without the GIL, so a busy engine thread cannot hold it up) sends
it on PUB, and a second thread serves replay requests. Each socket is used by one thread at a
time, as ZeroMQ requires. :class:`ZmqEventSubscriber` delivers batches in sequence order,
repairs gaps through the replay socket and flags publisher restarts in-band.

Endpoints ending in port 0 (or ``*``) bind an ephemeral port; the bound endpoints are exposed
as ``endpoint`` / ``replay_endpoint``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import zmq

from kvpool.errors import InvalidArgumentError, TransportError

__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "PublisherStatus",
    "Snapshot",
    "SubscribedBatch",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
]

logger = logging.getLogger(__name__)

END_SEQ: Final = b"\xff" * 8
"""The seq frame of the replay end marker (-1 as a signed 8-byte big-endian int)."""

SNAPSHOT_REQUEST: Final = b"kvpool-snapshot"
"""The replay request for a snapshot (a kvpool publisher's addition)."""

_PROBE_SEQ: Final = (1 << 63).to_bytes(8, "big")  # past anything a publisher buffers
_MAX_SEQ: Final = (1 << 63) - 1  # seqs are signed 8-byte ints on the wire (END_SEQ is -1)

_INPROC_IDS = itertools.count()  # names of each publisher's inproc pipes


_MAX_SOCKETS: Final = 16_384


def _context() -> zmq.Context[Any]:
    """The process's shared ZeroMQ context, its socket limit raised.

    A publisher takes 6 sockets and a subscriber 2; ZeroMQ's default of 1,023 sockets per
    context would stop a process (a replay of a large cluster, a router of many engines) at
    about 127 publishers. ZeroMQ applies the limit only before the context's first socket, so
    this takes effect when kvpool is the first to use the shared context (it usually is).
    """
    ctx: zmq.Context[Any] = zmq.Context.instance()
    if ctx.get(zmq.MAX_SOCKETS) < _MAX_SOCKETS:
        ctx.set(zmq.MAX_SOCKETS, min(_MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
    return ctx


def _socket(ctx: zmq.Context[Any], kind: int, made: list[zmq.Socket[Any]]) -> zmq.Socket[Any]:
    """A new socket with no linger (appended to ``made``); TransportError past the limits."""
    try:
        sock: zmq.Socket[Any] = ctx.socket(kind)
    except zmq.ZMQError as exc:
        raise TransportError(
            f"cannot create a ZeroMQ socket ({exc}): the shared context's socket limit or the "
            f"process's file descriptors ran out (a publisher uses 6 sockets, a subscriber 2; "
            f"the limit is raised to {_MAX_SOCKETS} only when kvpool creates the context's "
            f"first socket)"
        ) from None
    sock.setsockopt(zmq.LINGER, 0)
    made.append(sock)
    return sock


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
        snapshot: what answers snapshot requests: a callable returning one batch payload that
            holds the state of every batch published so far. It is called under the lock
            :meth:`publish` takes, so the state it returns is exactly that of the batches
            before :attr:`next_seq` when each batch's change is applied to it through
            :meth:`publish`'s ``update`` (see :class:`kvpool.events.snapshot.PublishedState`).
            None: snapshot requests get the bare end marker, as from a vLLM publisher.

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
        snapshot: Callable[[], bytes] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._topic = topic.encode("utf-8")
        self._ctx: zmq.Context[Any] = _context()
        # publish() -> inproc PUSH -> [forwarder: ZeroMQ's proxy, no GIL] -> PUB. Both inproc
        # pipes are unbounded (HWM 0), so a send on them never blocks; PUB's own HWM drops.
        # The PAIR steers the proxy (statistics, terminate).
        made: list[zmq.Socket[Any]] = []
        try:
            self._pub: zmq.Socket[Any] = _socket(self._ctx, zmq.PUB, made)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self.endpoint = _bind(self._pub, endpoint)
            self._replay: zmq.Socket[Any] | None = None
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = _socket(self._ctx, zmq.ROUTER, made)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay burst is never cut short
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
            name = f"inproc://kvpool-pub-{next(_INPROC_IDS)}"
            self._push: zmq.Socket[Any] = _socket(self._ctx, zmq.PUSH, made)
            self._pull: zmq.Socket[Any] = _socket(self._ctx, zmq.PULL, made)
            self._ctl: zmq.Socket[Any] = _socket(self._ctx, zmq.PAIR, made)
            self._ctl_peer: zmq.Socket[Any] = _socket(self._ctx, zmq.PAIR, made)
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._pull.setsockopt(zmq.RCVHWM, 0)
            self._pull.bind(name)
            self._push.connect(name)
            self._ctl.bind(name + "-ctl")
            self._ctl_peer.connect(name + "-ctl")
        except BaseException:
            for sock in made:
                sock.close(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._snapshot = snapshot
        self.epoch = os.urandom(8)
        """Random per publisher: a consumer that sees it change knows the publisher restarted."""
        self._skip: set[int] = set()
        self._next_seq = 0
        self._parts_sent = 0  # frames handed to the forwarder
        self._lock = threading.Lock()  # publish(), close() and the replay snapshot
        self._closing = False
        self._closed = False
        self._forwarder = threading.Thread(target=self._forward, name="kvpool-zmq-pub",
                                           daemon=True)
        self._forwarder.start()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kvpool-zmq-replay", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- public

    @property
    def next_seq(self) -> int:
        """The seq the next published batch gets."""
        return self._next_seq

    def publish(self, payload: bytes, *, update: Callable[[], object] | None = None) -> None:
        """Hand one batch to the sending thread; returns at once. Raises TransportError after
        :meth:`close`.

        ``update`` (called first, under the lock snapshots take) applies the batch to the
        publisher's snapshot source, so that no snapshot sees the batch's change without its
        seq or the other way round."""
        with self._lock:
            if self._closing:
                raise TransportError("publish() on a closed ZmqEventPublisher")
            if update is not None:
                update()
            seq = self._next_seq
            self._next_seq = seq + 1
            self._buffer.append((seq, payload))
            if seq in self._skip:
                self._skip.discard(seq)
                return
            # An unbounded inproc pipe: queued for the forwarder, never blocking.
            self._push.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                      flags=zmq.NOBLOCK, copy=len(payload) < 65536)
            self._parts_sent += 3

    def skip_on_pub(self, seq: int) -> None:
        """Fault injection for tests: batch ``seq`` is not sent on PUB but stays replayable."""
        with self._lock:
            self._skip.add(seq)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the threads, close the sockets. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        deadline = time.monotonic() + timeout_s
        if not self._drain(deadline):
            logger.warning("ZMQ publisher did not send its queue within %.1f s", timeout_s)
        self._ctl.send(b"TERMINATE")
        self._forwarder.join(max(0.0, deadline - time.monotonic()) + 1.0)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if self._forwarder.is_alive() or self._thread.is_alive():
            logger.warning("ZMQ publisher threads did not stop within %.1f s", timeout_s)
        else:
            for sock in (self._push, self._pull, self._ctl, self._ctl_peer):
                sock.close()
            self._pub.close()  # its linger lets subscribers get the last batches
        self._closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internal

    def _forward(self) -> None:
        # ZeroMQ's proxy runs in C with the GIL released for as long as it runs: a Python
        # thread sending on PUB instead had to win the GIL back after every frame, and behind a
        # busy engine thread (which gives it up every 5 ms switch interval) it fell behind and
        # delivered batches in bursts, seconds late.
        try:
            zmq.proxy_steerable(self._pull, self._pub, None, self._ctl_peer)
        except zmq.ZMQError as exc:  # the context went away under it
            if exc.errno != zmq.ETERM:
                logger.exception("ZMQ publisher forwarder failed")

    def _drain(self, deadline: float) -> bool:
        """Wait until the forwarder has sent every frame handed to it (its statistics count
        the frames it sent on PUB); False at the deadline."""
        while True:
            self._ctl.send(b"STATISTICS")
            if not self._ctl.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                return False
            stats = self._ctl.recv_multipart()
            if int.from_bytes(stats[6], sys.byteorder) >= self._parts_sent:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _run(self) -> None:
        """Serve replay requests until close() writes to the wake pipe."""
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r in ready:
                    break
        except Exception:  # a dead thread would silently stop replay; say why
            logger.exception("ZMQ replay thread failed")
        finally:
            if self._replay is not None:
                self._replay.close()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        router = self._replay
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            identity, request = frames[0], frames[2]
            topic = self._topic
            snapshot: bytes | None = None
            with self._lock:
                if request == SNAPSHOT_REQUEST and self._snapshot is not None:
                    snapshot = self._snapshot()
                    batches = [(self._next_seq, snapshot)]
                elif len(request) == 8 or request == SNAPSHOT_REQUEST:
                    start = int.from_bytes(request, "big")
                    batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
                else:
                    logger.warning("ignoring a replay request of %d bytes", len(request))
                    continue
                status = self._next_seq.to_bytes(8, "big") + self.epoch
            for seq, payload in batches:
                router.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload))
            router.send_multipart((identity, b"", b"", END_SEQ, status))


class PublisherStatus(NamedTuple):
    """A replay socket's answer to a liveness probe.

    ``next_seq`` and ``epoch`` come from a kvpool publisher's end marker; a vLLM publisher
    answers without them (None).
    """

    next_seq: int | None
    epoch: bytes | None


class Snapshot(NamedTuple):
    """A publisher's state: ``payload`` (one batch) holds every batch before ``seq``."""

    seq: int
    payload: bytes
    epoch: bytes | None


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
    * a seq past ``2**63 - 1`` (not a seq), or more than ``max_gap`` past the last seq seen
      on SUB, is held as suspect and counted in ``malformed``: one corrupt seq must not count
      quintillions of batches as missed nor make every later batch look like a restart. If the
      next message continues it (suspect + 1), the jump was real and delivery goes on from there.

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
        max_gap: int = 1 << 24,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx: zmq.Context[Any] = _context()
        self._topic = topic.encode("utf-8")
        self._sub: zmq.Socket[Any] = _socket(self._ctx, zmq.SUB, [])
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint!r}: {exc}") from None
        self._dealer: zmq.Socket[Any] | None = None
        if replay_endpoint is not None:
            try:
                self._dealer = self._new_dealer()
            except TransportError:
                self._sub.close(linger=0)
                raise
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._expected = start_seq
        self._sub_last: int | None = None
        self._suspect: int | None = None
        self._max_gap = max_gap
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

    def snapshot(self) -> Snapshot | None:
        """Ask the replay socket for the publisher's snapshot; None when it has none (a vLLM
        publisher, a kvpool one without a snapshot source) or did not answer in time.

        On success delivery continues from the snapshot's seq: the consumer replaces what it
        held of the publisher by the snapshot's payload (it starts with an all-cleared event)
        and then applies the batches :meth:`recv` delivers.
        """
        if self._dealer is None:
            return None
        got: list[tuple[int, bytes]] = []
        status = self._request(SNAPSHOT_REQUEST, got)
        if status is None or not got:
            return None
        seq, payload = got[0]
        self._expected = seq
        self._sub_last = None  # SUB may still hold older batches: duplicates, not a restart
        self._suspect = None
        self._restart_pending = False
        return Snapshot(seq, payload, status.epoch)

    def fetch(self, seq: int) -> bytes | None:
        """Batch ``seq`` fetched again from the replay socket (what is delivered is unchanged):
        None when it is not buffered any more, or no answer came."""
        if self._dealer is None:
            return None
        got: list[tuple[int, bytes]] = []
        if self._request(seq.to_bytes(8, "big"), got) is None:
            return None
        return next((payload for s, payload in got if s == seq), None)

    def probe(self, timeout_s: float) -> PublisherStatus | None:
        """Liveness probe on a fresh socket: a replay request past anything buffered, which a
        live publisher answers with its end marker at once. None when no answer came within
        ``timeout_s`` (or there is no replay socket)."""
        if self.replay_endpoint is None:
            return None
        dealer = _socket(self._ctx, zmq.DEALER, [])
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", _PROBE_SEQ))
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not dealer.poll(int(left * 1000) + 1):
                    break
                frames = dealer.recv_multipart()
                if len(frames) >= 3 and frames[-2] == END_SEQ:
                    return _status(frames[-1])
            return None
        except zmq.ZMQError:
            return None
        finally:
            dealer.close(linger=0)

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
        dealer = _socket(self._ctx, zmq.DEALER, [])
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
        last = self._sub_last
        if seq > _MAX_SEQ or (last is not None and seq - last > self._max_gap
                              and seq != (self._suspect or 0) + 1):
            self.malformed += 1
            self._suspect = seq
            return
        self._suspect = None
        if last is not None and seq <= last:
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
        got: list[tuple[int, bytes]] = []
        status = self._request(start.to_bytes(8, "big"), got)
        top = None if status is None else status.next_seq
        for seq, payload in got:
            expected = start if self._expected is None else self._expected
            if seq < expected:
                continue
            if seq > _MAX_SEQ or (top is not None and seq >= top):  # not a seq it published
                self.malformed += 1
                continue
            if seq > expected:
                self.missed += seq - expected
            self.replayed += 1
            self._deliver(seq, payload, out)

    def _request(self, request: bytes, got: list[tuple[int, bytes]]) -> PublisherStatus | None:
        """Send one replay request and collect its (seq, payload) answers up to the end
        marker; the end marker's status, or None when the answer timed out."""
        dealer = self._dealer
        assert dealer is not None
        dealer.send_multipart((b"", request))
        while True:
            if not dealer.poll(self._replay_timeout_ms):
                logger.warning("replay from %s timed out", self.replay_endpoint)
                # A late answer must not be mistaken for the next request's: new socket.
                dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return None
            frames = dealer.recv_multipart()
            if len(frames) == 4:  # [b"", topic, seq, payload] (COMPATIBILITY §3)
                seq_bytes, payload = frames[2], frames[3]
            elif len(frames) == 3:  # [b"", seq, payload] (vLLM's own publisher)
                seq_bytes, payload = frames[1], frames[2]
            else:
                self.malformed += 1
                continue
            if seq_bytes == END_SEQ:
                return _status(payload)
            if len(seq_bytes) != 8:
                self.malformed += 1
                continue
            got.append((int.from_bytes(seq_bytes, "big"), payload))


def _status(frame: bytes) -> PublisherStatus:
    """The status an end marker carries (kvpool: next seq and epoch; vLLM: nothing)."""
    if len(frame) == 16:
        return PublisherStatus(int.from_bytes(frame[:8], "big"), frame[8:])
    return PublisherStatus(None, None)
