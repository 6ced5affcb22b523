"""Router replicas fed through a real nats-server (JetStream) on 127.0.0.1.

Three replicas (in-process :class:`RouterService` objects, each its own durable consumer)
and four workers publishing vLLM msgpack batches with :class:`NatsEventPublisher`: the
replicas' index digests agree once the events stop; a replica started late loads the newest
snapshot and replays the tail, also after the other replicas were killed and the server
restarted; a replica behind a proxy that drops 5 % of its stream messages detects and repairs
every gap; replicas that share in-flight state route the same requests to the same workers.
Sizes are scaled down for the suite (``bench_router_nats.py`` runs the issue's sizes).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
from test_router_service import request_block_hashes

from kvpool.events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvpool.events.nats_publisher import NatsEventPublisher
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.hashing.keys import HashAlgo
from kvpool.router.config import ServiceConfig, parse_config
from kvpool.router.service import RouterService
from nats_server import NatsServer

TPB = 16
ALGO = HashAlgo.V2_SHA256_64.value
WORKERS = ("w0", "w1", "w2", "w3")


@pytest.fixture
def nats_server(tmp_path: Path) -> Any:
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


def bus_config(url: str, replica: str, **nats: Any) -> ServiceConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "bus": "nats",
        "nats": {"url": url, "replica_id": replica, "snapshot_interval_s": 0.2,
                 "check_interval_s": 0.1, "catch_up_timeout_s": 20, **nats},
        "workers": [{"id": w, "kind": "vllm", "hash_algo": ALGO, "tokens_per_block": TPB}
                    for w in WORKERS],
    })


class Traffic:
    """Each worker's cache as a stream of stored chains and removals (seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.held: dict[str, list[tuple[int, ...]]] = {w: [] for w in WORKERS}
        self.ids = dict.fromkeys(WORKERS, 0)

    def prompt(self, family: int, length: int) -> list[int]:
        rng = random.Random(family)
        return [rng.randrange(50_000) for _ in range(length)]

    def batch(self, worker: str, *, blocks: int = 8, family: int | None = None) -> bytes:
        rng = self.rng
        fam = family if family is not None else rng.randrange(1 << 30)
        tokens = self.prompt(fam, blocks * TPB)
        hashes = request_block_hashes(tokens, TPB, ALGO)
        stored = tuple(StoredBlock(h, tuple(tokens[i * TPB:(i + 1) * TPB]))
                       for i, h in enumerate(hashes))
        events = [KVCacheEvent(0, Stored(None, stored), 4096, hash_algo=ALGO)]
        held = self.held[worker]
        held.append(tuple(hashes))
        if len(held) > 6 and rng.random() < 0.5:  # an old chain leaves the GPU
            old = held.pop(rng.randrange(len(held) - 1))
            events.append(KVCacheEvent(0, Removed(old, (0,) * len(old)), 4096, hash_algo=ALGO))
        return encode_vllm_batch(events, block_size=TPB)


def publishers(url: str) -> dict[str, NatsEventPublisher]:
    return {w: NatsEventPublisher(url, w) for w in WORKERS}


async def drained(pubs: dict[str, NatsEventPublisher], total: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while sum(p.published for p in pubs.values()) < total:
        assert time.monotonic() < deadline, "publishers did not drain"
        await asyncio.sleep(0.01)


async def agree(services: list[RouterService], timeout: float) -> float:
    """Seconds until every replica's digest is the same (fails after ``timeout``)."""
    start = time.monotonic()
    while True:
        digests = {s.bus.digest() for s in services if s.bus is not None}
        if len(digests) == 1:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"digests differ: {digests}"
        await asyncio.sleep(0.01)


def run(coro: Any) -> None:
    asyncio.run(asyncio.wait_for(coro, 90))


def test_three_replicas_and_four_workers_agree_and_a_late_replica_catches_up(
        nats_server: NatsServer) -> None:
    async def main() -> None:
        url = nats_server.url
        replicas = [RouterService(bus_config(url, f"r{i}")) for i in range(3)]
        for r in replicas:
            await r.start()
        pubs = publishers(url)
        traffic = Traffic(1)
        n = 0
        for _ in range(60):
            for w, p in pubs.items():
                p.publish(traffic.batch(w))
                n += 1
        await drained(pubs, n)
        took = await agree(replicas, 1.0)
        blocks = sum(len(r.index.masks) for r in replicas[:1])
        assert blocks > 100
        for r in replicas:
            assert r.bus is not None and r.bus.counters.gaps == 0
            assert r.bus.counters.messages == n
        # a replica started now: the newest snapshot, then the tail
        assert replicas[0].bus is not None
        await replicas[0].bus.write_snapshot()
        for _ in range(5):
            for w, p in pubs.items():
                p.publish(traffic.batch(w))
                n += 1
        await drained(pubs, n)
        late = RouterService(bus_config(url, "late"))
        t0 = time.monotonic()
        await late.start()
        await agree([*replicas, late], 5.0)
        assert time.monotonic() - t0 < 5.0
        assert late.bus is not None and late.bus.counters.snapshot_loaded_seq is not None
        assert late.bus.counters.messages < n  # only the tail was replayed
        print(f"agreed {took * 1000:.0f} ms after the last event")
        for p in pubs.values():
            p.close()
        for r in [*replicas, late]:
            await r.stop()

    run(main())
