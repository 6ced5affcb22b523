"""One publisher of a cache's KV events: lists of events encoded as vLLM msgpack batches and
published on a :class:`~kvpool.events.zmq_publisher.ZmqEventPublisher` (or another
:class:`EventSink`: NATS JetStream's, :mod:`kvpool.events.nats_publisher`), the loop that drains
an event source into it, and (optionally) the state a snapshot request is answered with.

``kvpool serve`` (:mod:`kvpool.engine.server`) runs :meth:`BatchPublisher.run` in a thread
over its manager's events; a replay's ZeroMQ transport (:mod:`kvpool.replay.transport`)
calls :meth:`BatchPublisher.publish` per delivery.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection
from typing import Protocol

from kvpool.errors import InvalidArgumentError
from kvpool.events.model import KVCacheEvent
from kvpool.events.snapshot import PublishedState
from kvpool.events.vllm_encode import encode_vllm_batch
from kvpool.events.zmq_publisher import ZmqEventPublisher
from kvpool.events.zmq_sockets import PRIVATE_IPC

__all__ = ["BatchPublisher", "EventSink"]

EventSource = Callable[[float], list[KVCacheEvent]]
"""``source(timeout_s)``: the events since the last call, waiting up to ``timeout_s`` for one
(a manager's ``get_latest_events``)."""


class EventSink(Protocol):
    """Where encoded batches go: a ZMQ publisher, or a NATS JetStream one."""

    def publish(self, payload: bytes, *, update: Callable[[], object] | None = None) -> None: ...

    def close(self) -> None: ...


class BatchPublisher:
    """Encodes event lists as vLLM msgpack batches and publishes them (see the module doc).

    Args:
        endpoint, replay_endpoint, topic, buffer_steps: the
            :class:`~kvpool.events.zmq_publisher.ZmqEventPublisher`'s.
        block_size: tokens per block, written in every batch.
        sliding_window_groups: layer groups whose blocks are a sliding window's.
        partial_blocks: publish blocks not yet full too (a replay's router matches them).
        snapshots: keep every published block in a
            :class:`~kvpool.events.snapshot.PublishedState`, so that the replay socket answers
            snapshot requests with all of them (else the bare end marker).

    Raises:
        TransportError: an endpoint cannot be bound.
    """

    def __init__(self, endpoint: str | None, replay_endpoint: str | None = PRIVATE_IPC, *,
                 block_size: int, topic: str = "", buffer_steps: int = 10_000,
                 sliding_window_groups: Collection[int] = (), partial_blocks: bool = False,
                 snapshots: bool = False, sink: EventSink | None = None) -> None:
        self.block_size = block_size
        self.sliding_window_groups = tuple(sliding_window_groups)
        self.partial_blocks = partial_blocks
        self.state: PublishedState | None = PublishedState() if snapshots else None
        self.batches = 0
        self.publisher: EventSink
        if sink is not None:  # another transport (kvpool.events.nats_publisher)
            self.publisher = sink
        elif endpoint is None:
            raise InvalidArgumentError("BatchPublisher needs an endpoint or a sink")
        else:
            self.publisher = ZmqEventPublisher(
                endpoint, replay_endpoint, topic=topic, buffer_steps=buffer_steps,
                snapshot=self.snapshot if snapshots else None)

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> None:
        """One batch of ``events``; returns at once (the publisher's threads send it)."""
        state = self.state
        self.publisher.publish(
            encode_vllm_batch(events, ts=ts, block_size=self.block_size,
                              sliding_window_groups=self.sliding_window_groups,
                              partial_blocks=self.partial_blocks),
            update=None if state is None else functools.partial(state.apply, events))
        self.batches += 1

    def run(self, source: EventSource, stopping: threading.Event,
            poll_s: float = 0.1) -> None:
        """Publish what ``source`` gives, one batch per non-empty call, until ``stopping``."""
        while not stopping.is_set():
            events = source(poll_s)
            if events:
                self.publish(events)

    def snapshot(self) -> bytes:
        """Every block published so far as one batch (the replay socket's snapshot answer);
        partial blocks included, as :mod:`kvpool.events.snapshot` requires."""
        events = self.state.events() if self.state is not None else []
        return encode_vllm_batch(events, block_size=self.block_size,
                                 sliding_window_groups=self.sliding_window_groups,
                                 partial_blocks=True)

    def close(self) -> None:
        """Send what is queued and close the sockets (idempotent)."""
        self.publisher.close()
