"""The router recovers from what its workers send and lose, over real ZeroMQ and HTTP sockets.

Each test ends with the router's index equal to the worker's cache (a real kvpool manager's
``cached_blocks()``), or with the failure reported where an operator looks (``/workers``,
``/metrics``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web
from test_router_service import (
    FakeTrtllm,
    chain,
    config,
    eventually,
    get_json,
    post,
    run,
    samples,
    workers_by_id,
)

from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.events.keyed import normalize_hash
from kvpool.events.snapshot import PublishedState
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher
from kvpool.hashing.keys import HashAlgo
from kvpool.router import zmq_reader
from kvpool.router.service import RouterService

TPB = 16
ALGO = HashAlgo.V2_SHA256_64.value
PERIOD = 0.25  # liveness period of these tests (health_interval_s)
INGEST = {"poll_interval_s": 0.05, "http_timeout_s": 0.5, "health_interval_s": PERIOD}


class Worker:
    """A kvpool manager publishing its events over ZMQ, with snapshots (or vLLM-style, none)."""

    def __init__(self, *, snapshots: bool = True, gpu_blocks: int = 64,
                 buffer_steps: int = 10_000) -> None:
        self.m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=gpu_blocks,
                                            hash_algo=HashAlgo.V2_SHA256_64,
                                            enable_partial_reuse=False,
                                            events=EventsConfig(buffer_max_size=10_000)))
        self.snapshots = snapshots
        self.buffer_steps = buffer_steps
        self.state = PublishedState(ALGO)
        self.pub = self._publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        self.n = 0

    def _publisher(self, endpoint: str, replay: str) -> ZmqEventPublisher:
        snapshot = self._snapshot if self.snapshots else None
        return ZmqEventPublisher(endpoint, replay, buffer_steps=self.buffer_steps,
                                 snapshot=snapshot)

    def _snapshot(self) -> bytes:
        # partial_blocks: seeded blocks carry no tokens (they were whole when announced)
        return encode_vllm_batch(self.state.events(), block_size=TPB, partial_blocks=True)

    def serve(self, first_token: int, n_blocks: int = 3, *, lose: bool = False) -> None:
        """Cache one prompt's blocks and publish the step (``lose``: not sent on PUB)."""
        self.n += 1
        tokens = list(range(first_token, first_token + n_blocks * TPB + 1))
        self.m.add_sequence(SequenceRequest(self.n, tokens))
        self.m.remove_sequence(self.n)
        self.m.flush_iteration_events()
        events = self.m.get_latest_events(0)
        if lose:
            self.pub.skip_on_pub(self.pub.next_seq)
        self.pub.publish(encode_vllm_batch(events, block_size=TPB),
                         update=lambda: self.state.apply(events))

    def restart_publisher(self) -> None:
        """A new publisher on the same endpoints, under the live manager (its cache kept)."""
        endpoint, replay = self.pub.endpoint, self.pub.replay_endpoint
        assert replay is not None
        self.pub.close()
        self.state = PublishedState(ALGO)
        self.state.seed(self.m.cached_blocks())
        for _ in range(100):  # the old sockets may hold the ports for a moment
            try:
                self.pub = self._publisher(endpoint, replay)
                return
            except Exception:
                time.sleep(0.05)
        raise AssertionError("could not rebind the publisher")

    def cache(self) -> dict[int, frozenset[int]]:
        """Tier -> normalized hashes, as the router's index reports a worker."""
        out: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
        for h, _group, tier in self.m.cached_blocks():
            out[tier].add(normalize_hash(h))
        return {t: frozenset(hs) for t, hs in out.items()}

    def spec(self, wid: str, kind: str = "kvpool") -> dict[str, Any]:
        return {"id": wid, "kind": kind, "zmq_endpoint": self.pub.endpoint,
                "replay_endpoint": self.pub.replay_endpoint, "tokens_per_block": TPB,
                "hash_algo": ALGO}


async def _view(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    return workers_by_id((await get_json(s, f"{base}/workers"))[1])


def _equal(svc: RouterService, wid: str, w: Worker) -> bool:
    return svc.index.snapshot(wid) == w.cache()


async def _in_sync(svc: RouterService, wid: str, w: Worker, timeout: float = 10.0) -> None:
    async def same() -> bool:
        return _equal(svc, wid, w)

    await eventually(same, timeout)


def test_worker_that_published_garbage_keeps_being_ingested() -> None:
    async def main() -> None:
        # a vLLM worker, a kvpool worker with snapshots, one whose publisher has none
        vllm_like, kvpool_like, plain = Worker(snapshots=False), Worker(), Worker(snapshots=False)
        workers = {"v": vllm_like, "k": kvpool_like, "p": plain}
        svc = RouterService(config([vllm_like.spec("v", "vllm"), kvpool_like.spec("k"),
                                    plain.spec("p")], ingest=INGEST))
        port = await svc.start()
        base = f"http://127.0.0.1:{port}"
        try:
            for wid, w in workers.items():
                w.serve(100)
                await _in_sync(svc, wid, w)
                w.pub.publish(b"\xa1\x8c")  # a map whose key is invalid UTF-8
                for first in (200, 300, 400, 500):  # evicts some of the first blocks too
                    w.serve(first, 6)
                await _in_sync(svc, wid, w)
                assert svc.index.snapshot(wid)[0]  # not trivially equal: blocks are held
            async with aiohttp.ClientSession() as s:
                view = await _view(s, base)
                async with s.get(f"{base}/metrics") as resp:
                    m = samples(await resp.text())
            for wid in workers:
                ingest = view[wid]["ingest"]
                assert ingest["decode_errors"] == 1, ingest
                assert "UnicodeDecodeError" in ingest["last_error"]
                assert ingest["state"] == "healthy" and view[wid]["healthy"]
                assert m[f'kvpool_router_worker_decode_errors_total{{worker="{wid}"}}'] == 1
            assert m["kvpool_router_decode_errors_total"] == 3
            # the kvpool worker was re-synchronised from a snapshot after the bad batch
            assert view["k"]["ingest"]["snapshots"] >= 2 and view["v"]["ingest"]["snapshots"] == 0
            assert view["p"]["ingest"]["snapshots"] == 0
        finally:
            await svc.stop()
            for w in workers.values():
                w.pub.close()

    run(main())


def test_reader_that_fails_is_restarted_and_shown_degraded_meanwhile(monkeypatch: Any) -> None:
    real = zmq_reader.decode_vllm
    failures = {"left": 1}

    def flaky(*args: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected reader failure")
        return real(*args)

    async def main() -> None:
        w = Worker(snapshots=False)
        svc = RouterService(config([w.spec("v", "vllm")], ingest=INGEST))
        await svc.start()
        states: list[str] = []
        try:
            monkeypatch.setattr(zmq_reader, "decode_vllm", flaky)
            w.serve(100)

            async def restarted() -> bool:
                st = svc.ingest.status("v")
                states.append(st.state)
                return st.transport_restarts == 1 and st.state == "healthy"

            await eventually(restarted)
            assert "degraded" in states
            # resumed from the last good sequence number: the batch that failed is replayed
            w.serve(200)
            await _in_sync(svc, "v", w)
        finally:
            await svc.stop()
            w.pub.close()

    run(main())


class BadTrtllm(FakeTrtllm):
    """A TensorRT-LLM engine whose event endpoint answers ``bodies`` first, then its queue."""

    def __init__(self, bodies: list[bytes]) -> None:
        super().__init__("v1_block_key")
        self.bodies = bodies

    async def _events(self, request: web.Request) -> web.Response:
        if self.bodies:
            self.polls += 1
            return web.Response(body=self.bodies.pop(0), content_type="application/json")
        return await super()._events(request)


def test_trtllm_poller_fed_bad_bodies_keeps_polling_and_reports_them() -> None:
    async def main() -> None:
        engine = BadTrtllm([b'["\xe9"]', b"[" * 100_000 + b"]" * 100_000])
        await engine.start()
        svc = RouterService(config([{"id": "t", "kind": "trtllm", "http_base_url": engine.url,
                                     "tokens_per_block": 16}], ingest=INGEST))
        port = await svc.start()
        base = f"http://127.0.0.1:{port}"
        try:
            async def two_errors() -> bool:
                return svc.ingest.status("t").decode_errors == 2

            await eventually(two_errors)
            engine.queue += chain(list(range(300, 365)), 16, "v1_block_key", 3)

            async def indexed() -> bool:
                return svc.index.worker_info("t").blocks_per_tier[0] == 3

            await eventually(indexed)
            polls = engine.polls
            await asyncio.sleep(0.2)
            assert engine.polls > polls  # still polling
            async with aiohttp.ClientSession() as s:
                ingest = (await _view(s, base))["t"]["ingest"]
            assert ingest["state"] == "healthy" and ingest["decode_errors"] == 2
            assert "RecursionError" in ingest["last_error"]
        finally:
            await svc.stop()
            await engine.stop()

    run(main())


def test_idle_worker_whose_last_batch_was_lost_is_caught_up_by_snapshot() -> None:
    async def main() -> None:
        w = Worker(buffer_steps=1)
        svc = RouterService(config([w.spec("k")], ingest=INGEST))
        await svc.start()
        try:
            w.serve(100)
            await _in_sync(svc, "k", w)
            snapshots = svc.ingest.status("k").snapshots
            w.serve(200, lose=True)  # never reaches SUB; the worker then stays quiet
            lost_at = time.monotonic()
            await _in_sync(svc, "k", w)
            took = time.monotonic() - lost_at
            assert svc.ingest.status("k").snapshots == snapshots + 1
            # two liveness periods, plus what a loaded 2-core machine adds
            assert took <= 2 * PERIOD + 0.5, took
        finally:
            await svc.stop()
            w.pub.close()

    run(main())


def test_router_started_after_its_workers_knows_their_blocks_before_its_first_route() -> None:
    async def main() -> None:
        w = Worker(buffer_steps=2, gpu_blocks=128)  # most batches are not replayable any more
        for i in range(8):
            w.serve(1000 * (i + 1), 4)
        svc = RouterService(config([w.spec("k"), {"id": "other", "kind": "kvpool"}],
                                   ingest=INGEST))
        port = await svc.start()
        try:
            assert _equal(svc, "k", w) and len(svc.index.snapshot("k")[0]) == 32
            async with aiohttp.ClientSession() as s:
                status, d = await post(s, f"http://127.0.0.1:{port}/route",
                                       {"token_ids": list(range(3000, 3000 + 4 * TPB + 1))})
            assert (status, d["worker_id"], d["matched_blocks"]) == (200, "k", [4, 0, 0])
        finally:
            await svc.stop()
            w.pub.close()

    run(main())


def test_publisher_restarted_under_a_live_manager_leaves_the_router_equal_to_the_cache() -> None:
    async def main() -> None:
        w = Worker(gpu_blocks=32)
        svc = RouterService(config([w.spec("k")], ingest=INGEST))
        await svc.start()
        try:
            for first in (100, 200, 300):
                w.serve(first, 4)
            await _in_sync(svc, "k", w)
            w.restart_publisher()  # the new publisher starts at seq 0, the cache is kept
            w.serve(400, 4)  # and the cache moves on (evicting some of the old blocks)
            await _in_sync(svc, "k", w)
            assert len(svc.index.snapshot("k")[0]) == 16
            assert svc.ingest.status("k").snapshots >= 2
        finally:
            await svc.stop()
            w.pub.close()

    run(main())


def test_worker_never_reached_is_unknown_and_gets_no_route() -> None:
    async def main() -> None:
        with ZmqEventPublisher("tcp://127.0.0.1:0", None) as probe_port:
            silent = probe_port.endpoint  # a port nothing listens on once closed
        svc = RouterService(config([
            {"id": "ghost", "kind": "vllm", "zmq_endpoint": silent},
            {"id": "fed", "kind": "kvpool"},
        ]))
        port = await svc.start()
        base = f"http://127.0.0.1:{port}"
        prompt = list(range(300, 365))
        try:
            async with aiohttp.ClientSession() as s:
                view = await _view(s, base)
                assert view["ghost"]["ingest"]["state"] == "unknown"
                assert not view["ghost"]["healthy"] and not view["ghost"]["routable"]
                assert view["ghost"]["state"] == "unknown" and view["fed"]["state"] == "healthy"
                assert "nothing to probe" in view["ghost"]["ingest"]["reason"]
                for _ in range(10):
                    status, d = await post(s, f"{base}/route", {"token_ids": prompt})
                    assert (status, d["worker_id"]) == (200, "fed")
                    assert [c["worker_id"] for c in d["candidates"]] == ["fed"]
                async with s.get(f"{base}/metrics") as resp:
                    m = samples(await resp.text())
                assert m['kvpool_router_worker_state{state="unknown",worker="ghost"}'] == 1
                assert m['kvpool_router_worker_healthy{worker="ghost"}'] == 0
        finally:
            await svc.stop()

    run(main())


def test_trtllm_poller_that_fails_is_restarted_and_shown_degraded(monkeypatch: Any) -> None:
    async def main() -> None:
        engine = FakeTrtllm("v1_block_key")
        await engine.start()
        svc = RouterService(config([{"id": "t", "kind": "trtllm", "http_base_url": engine.url,
                                     "tokens_per_block": 16}], ingest=INGEST))
        real = svc.ingest.feed_trtllm
        failures = {"left": 1}

        def flaky(worker_id: str, text: str | bytes) -> int:
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("injected poller failure")
            return real(worker_id, text)

        monkeypatch.setattr(svc.ingest, "feed_trtllm", flaky)
        await svc.start()
        states: list[str] = []
        try:
            async def restarted() -> bool:
                st = svc.ingest.status("t")
                states.append(st.state)
                return st.transport_restarts == 1 and st.state == "healthy"

            await eventually(restarted)
            assert "degraded" in states
            engine.queue += chain(list(range(300, 365)), 16, "v1_block_key", 3)

            async def indexed() -> bool:
                return svc.index.worker_info("t").blocks_per_tier[0] == 3

            await eventually(indexed)
        finally:
            await svc.stop()
            await engine.stop()

    run(main())
