"""The publishing end of kvpool's ZeroMQ event transport: PUB + replay ROUTER
(:class:`ZmqEventPublisher`; the protocol is described in :mod:`kvpool.events.zmq`).
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
from typing import Any

import zmq

from kvpool.errors import InvalidArgumentError, TransportError
from kvpool.events.zmq_sockets import (
    END_SEQ,
    PRIVATE_IPC,
    SNAPSHOT_REQUEST,
    bind,
    is_private,
    new_socket,
    release,
    shared_context,
)

__all__ = ["ZmqEventPublisher"]

logger = logging.getLogger("kvpool.events.zmq")  # the transport's logger, one for both ends

_INPROC_IDS = itertools.count()  # names of each publisher's inproc pipes


class ZmqEventPublisher:
    """PUB + replay ROUTER publisher of event batches (payloads are opaque bytes).

    Args:
        endpoint: where the PUB socket binds (``tcp://127.0.0.1:0`` picks a free port;
            ``ipc://*`` a socket only this user can reach).
        replay_endpoint: where the replay ROUTER binds; None disables replay. By default
            ``ipc://*`` (:data:`~kvpool.events.zmq_sockets.PRIVATE_IPC`): a socket in a new
            directory of mode 0700, which only this user can reach, because replies (and
            snapshots: every cached block) carry the cached prompts' token ids. A ``tcp://``
            endpoint (for a consumer on another host) serves them to whoever can connect; a
            warning says so. See :mod:`kvpool.events.zmq_sockets` for ``ipc://`` paths.
        topic: the first frame of every message (subscribers filter on its prefix).
        buffer_steps: how many recent batches the replay socket can serve.
        hwm: PUB send high-water mark (messages past it are dropped by ZeroMQ, never blocked:
            a subscriber that stops reading never holds up :meth:`publish` or the engine).
            A replay client gets at most one burst of ``buffer_steps`` batches queued; one
            that does not read it has its later replies cut short (:attr:`replies_cut`), so
            it never holds up the replay thread or other clients either.
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
        replay_endpoint: str | None = PRIVATE_IPC,
        topic: str = "",
        buffer_steps: int = 10_000,
        *,
        hwm: int = 100_000,
        snapshot: Callable[[], bytes] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._topic = topic.encode("utf-8")
        self._ctx: zmq.Context[Any] = shared_context()
        # publish() -> inproc PUSH -> [forwarder: ZeroMQ's proxy, no GIL] -> PUB. Both inproc
        # pipes are unbounded (HWM 0), so a send on them never blocks; PUB's own HWM drops.
        # The PAIR steers the proxy (statistics, terminate).
        made: list[zmq.Socket[Any]] = []
        try:
            self._pub: zmq.Socket[Any] = new_socket(self._ctx, zmq.PUB, made)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self.replay_endpoint: str | None = None
            self.endpoint = bind(self._pub, endpoint, "events")
            self._replay: zmq.Socket[Any] | None = None
            if replay_endpoint is not None:
                self._replay = new_socket(self._ctx, zmq.ROUTER, made)
                # one whole replay burst per client fits (5 frames a batch); a client that
                # does not read its replies gets no more (sends never block: NOBLOCK and
                # ROUTER_MANDATORY, so a full pipe is an error here, not a silent drop)
                self._replay.setsockopt(zmq.SNDHWM, (buffer_steps + 2) * 5)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay_endpoint = bind(self._replay, replay_endpoint, "replay")
                if not is_private(self.replay_endpoint):
                    logger.warning(
                        "the KV event replay socket %s serves cached prompts' token ids (and "
                        "snapshots of the whole cache) to whoever can connect; %r binds one "
                        "only this user can reach", self.replay_endpoint, PRIVATE_IPC)
            name = f"inproc://kvpool-pub-{next(_INPROC_IDS)}"
            self._push: zmq.Socket[Any] = new_socket(self._ctx, zmq.PUSH, made)
            self._pull: zmq.Socket[Any] = new_socket(self._ctx, zmq.PULL, made)
            self._ctl: zmq.Socket[Any] = new_socket(self._ctx, zmq.PAIR, made)
            self._ctl_peer: zmq.Socket[Any] = new_socket(self._ctx, zmq.PAIR, made)
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._pull.setsockopt(zmq.RCVHWM, 0)
            self._pull.bind(name)
            self._push.connect(name)
            self._ctl.bind(name + "-ctl")
            self._ctl_peer.connect(name + "-ctl")
        except BaseException:
            for sock in made:
                sock.close(linger=0)
            for bound in (getattr(self, "endpoint", None), self.replay_endpoint):
                release(bound)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._snapshot = snapshot
        self.epoch = os.urandom(8)
        """Random per publisher: a consumer that sees it change knows the publisher restarted."""
        self._skip: set[int] = set()
        self.replies_cut = 0
        """Replay replies cut short: their client did not read (its pipe was full) or left."""
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
        release(self.endpoint)
        release(self.replay_endpoint)
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
            try:
                for seq, payload in batches:
                    router.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"),
                                           payload), flags=zmq.NOBLOCK)
                router.send_multipart((identity, b"", b"", END_SEQ, status), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # Again: its pipe is full; EHOSTUNREACH: it left
                self.replies_cut += 1
                if self.replies_cut & (self.replies_cut - 1) == 0:  # 1, 2, 4, ... times
                    logger.warning("a replay client that does not read its replies (or left) "
                                   "got part of one (%d so far): %s", self.replies_cut, exc)
