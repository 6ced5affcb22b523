"""How a replay's workers' events reach the router (:mod:`kvpool.replay.cluster`): in
process, or encoded as vLLM msgpack, published on ZeroMQ over 127.0.0.1 and decoded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from kvpool.errors import TransportError
from kvpool.events.model import KVCacheEvent
from kvpool.events.publishing import BatchPublisher
from kvpool.events.vllm_msgpack import decode_vllm_batch
from kvpool.events.zmq import ZmqEventSubscriber
from kvpool.events.zmq_publisher import ZmqEventPublisher
from kvpool.replay.sizing import HASH_ALGO
from kvpool.router.ingest import Ingest

__all__ = ["InProcess", "Zmq"]

_ZMQ_TIMEOUT_S: Final = 10.0


class InProcess:
    """Events go straight from the event manager to the router's ingest."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def deliver(self, worker_id: str, events: list[KVCacheEvent], now: float) -> int:
        return self.ingest.feed(worker_id, events)

    def close(self) -> None:
        pass


class ZmqLink:
    __slots__ = ("next_event_id", "pub", "published", "sub")

    def __init__(self, pub: BatchPublisher, sub: ZmqEventSubscriber) -> None:
        self.pub = pub
        self.sub = sub
        self.published = 0
        self.next_event_id = 0


class Zmq:
    """Events go as vLLM msgpack batches over one ZeroMQ PUB/SUB pair per worker (loopback).

    Each delivery waits until the subscriber has the batch (asking the replay socket for what
    the SUB socket missed, e.g. before it finished connecting), so results do not depend on
    network timing. Partial blocks are published (unlike vLLM): the router matches a prompt's
    trailing partial block with :data:`HASH_ALGO`, as it does with in-process events.
    """

    def __init__(self, ingest: Ingest, worker_ids: Sequence[str], tokens_per_block: int) -> None:
        self.ingest = ingest
        self.tpb = tokens_per_block
        self.links: dict[str, ZmqLink] = {}
        try:
            for wid in worker_ids:
                pub = BatchPublisher(
                    "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic=wid, buffer_steps=1024,
                    block_size=tokens_per_block, partial_blocks=True,
                )
                zpub = pub.publisher
                assert isinstance(zpub, ZmqEventPublisher)  # built from endpoints
                try:
                    sub = ZmqEventSubscriber(zpub.endpoint, zpub.replay_endpoint, topic=wid)
                except BaseException:
                    pub.close()
                    raise
                self.links[wid] = ZmqLink(pub, sub)
        except BaseException:
            self.close()
            raise

    def deliver(self, worker_id: str, events: list[KVCacheEvent], now: float) -> int:
        link = self.links[worker_id]
        link.pub.publish(events, ts=now)
        link.published += 1
        applied = 0
        deadline = time.monotonic() + _ZMQ_TIMEOUT_S
        while (link.sub.expected_seq or 0) < link.published:
            batches = link.sub.recv(timeout_s=0.02) or link.sub.catch_up()
            for b in batches:
                batch = decode_vllm_batch(
                    b.payload, hash_algo=HASH_ALGO.value, first_event_id=link.next_event_id
                )
                link.next_event_id += len(batch.events)
                applied += self.ingest.feed(worker_id, batch.events)
            if time.monotonic() > deadline:
                raise TransportError(
                    f"worker {worker_id}: event batch {link.published - 1} did not arrive over "
                    f"ZeroMQ within {_ZMQ_TIMEOUT_S:.0f} s"
                )
        return applied

    def close(self) -> None:
        for link in self.links.values():
            link.sub.close()
            link.pub.close()
        self.links.clear()

