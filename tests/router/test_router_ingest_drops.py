"""What the router's ingest drops, over real ZeroMQ sockets: malformed frames, absurd seqs,
stale (duplicate, late) batches and batches of another block size are counted per worker in
``/workers`` and ``/metrics`` and leave the index alone; restarts (seq 0, a run going back)
reset it. A property test drives random streams of batches, duplicates, late seqs, losses,
restarts and block-size changes through a real SUB socket, the worker's reader and the ingest:
the index equals the model's and every counter matches."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router_service import chain, config, eventually, get_json, run, samples, workers_by_id

from kvpool.events.keyed import normalize_hash
from kvpool.events.vllm_encode import encode_vllm_batch
from kvpool.events.zmq import ZmqEventSubscriber
from kvpool.hashing.keys import HashAlgo
from kvpool.router.config import IngestOptions, WorkerConfig, WorkerKind
from kvpool.router.index import KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.service import RouterService
from kvpool.router.zmq_reader import ReaderSink, ZmqReader

ALGO = HashAlgo.V2_SHA256_64.value
TOPIC = b"kv"
_TOKENS = itertools.count(10_000, 1000)  # fresh token ranges: every batch has its own keys
_NAMES = itertools.count()


def batch(block_size: int, nblocks: int = 2) -> tuple[bytes, set[int]]:
    """A vLLM batch storing a fresh chain of ``nblocks`` full blocks, and its keys."""
    start = next(_TOKENS)
    events = chain(list(range(start, start + block_size * nblocks)), block_size, ALGO)
    keys = {normalize_hash(b.block_hash) for ev in events for b in ev.data.blocks}  # type: ignore[union-attr]
    return encode_vllm_batch(events, block_size=block_size), keys


class RawPublisher:
    """The test's PUB end: an XPUB, so it knows when the subscriber joined (no message is
    lost to the slow joiner: the counters are exact)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1") -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://"):
            self.endpoint = f"{endpoint}:{self.sock.bind_to_random_port(endpoint)}"
        else:
            self.sock.bind(endpoint)
            self.endpoint = endpoint

    def joined(self) -> None:
        assert self.sock.poll(10_000), "the subscriber never joined"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------------------ the service


def test_drops_are_counted_in_workers_and_metrics_and_leave_the_index_alone() -> None:
    async def main() -> None:
        pub = RawPublisher()
        svc = RouterService(config([{"id": "v", "kind": "vllm", "zmq_endpoint": pub.endpoint,
                                     "topic": "kv", "hash_algo": ALGO}]))
        port = await svc.start()
        base = f"http://127.0.0.1:{port}"
        try:
            pub.joined()
            held: set[int] = set()
            sent: list[bytes] = []
            for seq in range(3):
                payload, keys = batch(16)
                pub.send(seq, payload)
                held |= keys
                sent.append(payload)

            async def indexed() -> bool:
                return svc.index.snapshot("v")[0] == held

            await eventually(indexed)
            pub.send(2, sent[2])  # a duplicate
            pub.send(1, batch(16)[0])  # a late batch (never delivered as such)
            pub.sock.send_multipart([TOPIC, b"\x00" * 7, b"seven-byte seq"])
            pub.sock.send_multipart([TOPIC, b"two frames"])
            pub.send((1 << 64) - 1, b"absurd")
            pub.send(3, batch(8)[0])  # another block size: refused
            payload, keys = batch(16)
            pub.send(4, payload)
            held |= keys

            async def settled() -> bool:
                return svc.ingest.status("v").last_seq == 4

            await eventually(settled)
            assert svc.index.snapshot("v")[0] == held  # not wiped, nothing of the refused batch
            async with aiohttp.ClientSession() as s:
                view = workers_by_id((await get_json(s, f"{base}/workers"))[1])["v"]
                async with s.get(f"{base}/metrics") as resp:
                    m = samples(await resp.text())
            ingest = view["ingest"]
            assert {k: ingest[k] for k in ("stale_batches", "malformed_frames", "absurd_seqs",
                                           "block_size_refused", "restarts", "missed", "gaps",
                                           "batches")} == {
                "stale_batches": 2, "malformed_frames": 2, "absurd_seqs": 1,
                "block_size_refused": 1, "restarts": 0, "missed": 0, "gaps": 0, "batches": 5}
            assert "8 tokens" in ingest["last_error"] and view["resets"] == 0
            assert view["tokens_per_block"] == 16
            for reason, n in (("stale_seq", 2), ("malformed_frame", 2), ("absurd_seq", 1),
                              ("block_size", 1), ("undecodable", 0)):
                assert m[f'kvpool_router_worker_dropped_total{{reason="{reason}",worker="v"}}'] \
                    == n, reason
            totals = ("stale_batches", "malformed_frames", "absurd_seqs", "block_size_refused",
                      "publisher_restarts")
            assert [m[f"kvpool_router_{t}_total"] for t in totals] == [2, 2, 1, 1, 0]
            # a restart (seq 0 again) resets the worker, which learns its block size again
            payload, keys = batch(8)
            pub.send(0, payload)

            async def restarted() -> bool:
                return svc.index.snapshot("v")[0] == keys

            await eventually(restarted)
            status = svc.ingest.status("v")
            assert (status.restarts, status.missed, status.block_size_refused) == (1, 0, 1)
            assert svc.index.tokens_per_block_of("v") == 8
        finally:
            await svc.stop()
            pub.close()

    run(main())


# ------------------------------------------------------------------------- property test


class _Now:
    """An event loop stand-in for the reader: what it posts runs at once, on this thread."""

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)


@dataclass
class Model:
    """What the subscriber, the reader and the ingest must make of the stream."""

    keys: set[int] = field(default_factory=set)
    block_size: int | None = None
    delivered: int = 0
    stale: int = 0
    malformed: int = 0
    absurd: int = 0
    restarts: int = 0
    missed: int = 0
    refused: int = 0
    lost: int = 0  # batches of the current publisher lost on the way, not counted yet
    sub_last: int | None = None
    next_seq: int = 0
    recent: list[tuple[int, bytes]] = field(default_factory=list)  # since the last restart
    ring: list[tuple[int, bytes]] = field(default_factory=list)  # the subscriber's 16

    def deliver(self, seq: int, payload: bytes, keys: set[int], size: int) -> None:
        self.missed += self.lost
        self.lost = 0
        self.delivered += 1
        self.sub_last = seq
        self.recent.append((seq, payload))
        self.ring = [*self.ring, (seq, payload)][-16:]
        if self.block_size is None:
            self.block_size = size
        if size == self.block_size:
            self.keys |= keys
        else:
            self.refused += 1

    def restart(self) -> None:
        self.restarts += 1
        self.keys = set()
        self.block_size = None
        self.lost = 0
        self.recent = []


def _publish(pub: RawPublisher, m: Model, size: int, lose: bool = False) -> None:
    payload, keys = batch(size)
    seq = m.next_seq
    m.next_seq += 1
    if lose:
        m.lost += 1
        return
    pub.send(seq, payload)
    m.deliver(seq, payload, keys, size)


def _play(data: Any, pub: RawPublisher, m: Model, steps: int) -> None:
    """Draw and send ``steps`` operations, keeping the model up to date."""
    sizes = st.sampled_from([4, 8])
    for _ in range(steps):
        op = data.draw(st.sampled_from(
            ["batch", "batch", "lose", "dup", "late", "restart", "garbage", "absurd"]))
        dups = [e for e in m.recent if e in m.ring]
        if op == "batch" or (op == "dup" and not dups) or (op == "late" and (m.sub_last or 0) < 2):
            _publish(pub, m, data.draw(sizes))
        elif op == "lose":
            _publish(pub, m, data.draw(sizes), lose=True)
        elif op == "dup":
            pub.send(*data.draw(st.sampled_from(dups)))
            m.stale += 1
        elif op == "late":  # an older seq with other content, then the stream goes on
            assert m.sub_last is not None
            pub.send(data.draw(st.integers(1, m.sub_last - 1)), b"\x90")  # not a valid batch
            m.stale += 1
            _publish(pub, m, data.draw(sizes))
        elif op == "restart" and m.sub_last is not None:
            lost = data.draw(st.integers(0, max(0, min(3, m.sub_last - 1))))
            m.restart()
            m.next_seq = lost  # the SUB socket missed the new publisher's first batches
            m.missed += lost
            for _ in range(1 if lost == 0 else 2):  # seq 0, or a run (k, k + 1) going back
                _publish(pub, m, data.draw(sizes))
        elif op == "garbage":
            pub.sock.send_multipart([TOPIC, b"no seq"])
            m.malformed += 1
        elif op == "absurd":
            pub.send((1 << 64) - 1 - data.draw(st.integers(0, 5)), b"absurd")
            m.absurd += 1


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_streams_leave_the_index_equal_to_the_model(data: Any) -> None:
    pub = RawPublisher(f"inproc://kvpool-ingest-property-{next(_NAMES)}")
    index = KvIndex()
    index.add_worker("w", hash_algo=ALGO)
    ingest = Ingest(index)
    worker = WorkerConfig(id="w", kind=WorkerKind.VLLM, zmq_endpoint=pub.endpoint, topic="kv",
                          hash_algo=ALGO)
    ingest.add(worker)
    sink = ReaderSink(ingest._deliver, ingest._reader_failed, ingest._set_health,
                      ingest._count_probe_failure)
    reader = ZmqReader(sink, _Now(), worker, IngestOptions(), tokens=False)  # type: ignore[arg-type]
    sub = ZmqEventSubscriber(pub.endpoint, None, "kv", start_seq=0)
    try:
        pub.joined()
        m = Model()
        _play(data, pub, m, data.draw(st.integers(1, 30)))
        _publish(pub, m, data.draw(st.sampled_from([4, 8])))  # the end: whatever is held goes
        status = ingest.status("w")
        deadline = time.monotonic() + 10
        while status.batches < m.delivered:
            assert time.monotonic() < deadline, (status, m)
            reader._handle(sub, sub.recv(timeout_s=0.05))
        reader._handle(sub, sub.recv(timeout_s=0.01))
        assert index.snapshot("w")[0] == m.keys
        assert (status.batches, status.stale_batches, status.malformed_frames,
                status.absurd_seqs, status.restarts, status.missed,
                status.block_size_refused) == (
            m.delivered, m.stale, m.malformed, m.absurd, m.restarts, m.missed, m.refused)
        assert index.worker_info("w").resets == m.restarts
        assert index.tokens_per_block_of("w") == m.block_size
    finally:
        sub.close()
        pub.close()
