"""The subscribing end of kvpool's ZeroMQ event transport: SUB + replay DEALER
(:class:`ZmqEventSubscriber`: in-order delivery, gap repair, restarts, probes and snapshots;
the protocol is described in :mod:`kvpool.events.zmq`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Final, NamedTuple

import zmq

from kvpool.errors import TransportError
from kvpool.events.zmq_sockets import (
    END_SEQ,
    MAX_SEQ,
    PROBE_SEQ,
    SNAPSHOT_REQUEST,
    new_socket,
    shared_context,
)

__all__ = ["RECENT_BATCHES", "PublisherStatus", "Snapshot", "SubscribedBatch",
           "ZmqEventSubscriber"]

logger = logging.getLogger("kvpool.events.zmq")  # the transport's logger, one for both ends

RECENT_BATCHES: Final = 16
"""Delivered batches remembered (references, no copies) to recognise a duplicate."""

# what a message on SUB is to the subscriber (ZmqEventSubscriber._judge)
_AHEAD, _STALE, _HELD, _RESTART, _RESTART_HELD = range(5)


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
    * ``seq`` at or below the last seq seen on SUB (it went back): a restart of the
      publisher, or a stale batch (a duplicate, a late one). Told apart, in this order:

      1. a copy of one of the last :data:`RECENT_BATCHES` batches delivered (same seq, same
         payload) is stale;
      2. a kvpool publisher is asked (one replay round trip): a new epoch, or its next seq
         at or below the last seen, is a restart; the same epoch still ahead: stale;
      3. otherwise (a vLLM publisher, no replay socket, no answer) seq 0 is a restart, and
         any other seq is held: if the next message continues it (held + 1, still at or
         below the last seen), the restart is confirmed from the held batch on; else the
         held batch was stale.

      A stale batch is dropped and counted in ``stale``; nothing else changes. On a restart
      ``restarts`` is incremented, delivery restarts from seq 0 of the new publisher
      (replaying what the SUB socket missed, else counting it in ``missed``), and the first
      batch delivered carries ``restart=True``.
    * otherwise (``seq < expected``): a duplicate of a replayed batch, dropped.
    * a seq past ``2**63 - 1`` (not a seq), or more than ``max_gap`` past the last seq seen
      on SUB, is held as suspect and counted in ``absurd``: one corrupt seq must not count
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
        self._ctx: zmq.Context[Any] = shared_context()
        self._topic = topic.encode("utf-8")
        self._sub: zmq.Socket[Any] = new_socket(self._ctx, zmq.SUB, [])
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
        self._held: tuple[int, bytes] | None = None  # a seq that went back, not yet judged
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=RECENT_BATCHES)
        self._epoch: bytes | None = None  # the epoch of the numbering being delivered
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
        """Messages ignored because their frames were not [topic, 8-byte seq, payload] (on
        SUB or in a replay answer), or a replayed seq the publisher never published."""
        self.absurd = 0
        """Messages held as suspect for an absurd seq (past ``2**63 - 1``, or more than
        ``max_gap`` past the last seen)."""
        self.stale = 0
        """Batches dropped because their seq went back without a restart (duplicates, late
        batches)."""

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
        self._epoch = status.epoch
        self._sub_last = None  # SUB may still hold older batches: duplicates, not a restart
        self._suspect = None
        self._held = None
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
        dealer = new_socket(self._ctx, zmq.DEALER, [])
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", PROBE_SEQ))
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
        dealer = new_socket(self._ctx, zmq.DEALER, [])
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self.replay_endpoint)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            raise TransportError(f"cannot connect to {self.replay_endpoint!r}: {exc}") from None
        return dealer

    def _deliver(self, seq: int, payload: bytes, out: list[SubscribedBatch]) -> None:
        out.append(SubscribedBatch(seq, payload, self._restart_pending))
        self._recent.append((seq, payload))
        self._restart_pending = False
        self._expected = seq + 1

    def _on_message(self, seq: int, payload: bytes, out: list[SubscribedBatch]) -> None:
        last = self._sub_last
        if seq > MAX_SEQ or (last is not None and seq - last > self._max_gap
                              and seq != (self._suspect or 0) + 1):
            self.absurd += 1
            self._suspect = seq
            return
        self._suspect = None
        held, self._held = self._held, None
        verdict = _AHEAD if last is None or seq > last else self._judge(seq, payload, last, held)
        if held is not None and verdict != _RESTART_HELD:
            self.stale += 1  # the held batch went back alone
        if verdict == _STALE:
            self.stale += 1
            return
        if verdict == _HELD:
            return
        if verdict != _AHEAD:
            self.restarts += 1
            self._restart_pending = True
            self._expected = 0
            if held is not None and verdict == _RESTART_HELD:
                self._accept(held[0], held[1], out)
        self._sub_last = seq
        self._accept(seq, payload, out)

    def _judge(self, seq: int, payload: bytes, last: int, held: tuple[int, bytes] | None) -> int:
        """What a seq that went back (at or below ``last``) is: a restart, stale, or held for
        the next message to judge (class docstring)."""
        if any(s == seq and p == payload for s, p in self._recent):
            return _STALE
        known = self._epoch
        status = None
        if self._dealer is not None:  # a replay request past anything buffered: its status
            status = self._request(PROBE_SEQ, [])
        if status is not None and status.next_seq is not None:
            if (known is not None and status.epoch != known) or status.next_seq <= last:
                self._epoch = status.epoch  # the numbering delivered from now on
                return _RESTART
            return _STALE
        if held is not None and seq == held[0] + 1:
            return _RESTART_HELD
        if seq == 0:
            return _RESTART
        self._held = (seq, payload)
        return _HELD

    def _accept(self, seq: int, payload: bytes, out: list[SubscribedBatch]) -> None:
        """A batch in the publisher's current numbering: delivered in order (a gap repaired
        from the replay socket or counted in ``missed``), a duplicate dropped."""
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
            if seq > MAX_SEQ or (top is not None and seq >= top):  # not a seq it published
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
                status = _status(payload)
                if self._epoch is None:
                    self._epoch = status.epoch
                return status
            if len(seq_bytes) != 8:
                self.malformed += 1
                continue
            got.append((int.from_bytes(seq_bytes, "big"), payload))


def _status(frame: bytes) -> PublisherStatus:
    """The status an end marker carries (kvpool: next seq and epoch; vLLM: nothing)."""
    if len(frame) == 16:
        return PublisherStatus(int.from_bytes(frame[:8], "big"), frame[8:])
    return PublisherStatus(None, None)
