"""The router service over real HTTP and ZeroMQ on 127.0.0.1: config, endpoints, ingest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvpool.errors import ConfigError, TransportError
from kvpool.events.model import Created, KVCacheEvent, Removed, Stored, StoredBlock
from kvpool.events.trtllm_json import to_trtllm_json
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher
from kvpool.hashing.keys import request_block_hashes
from kvpool.router.config import ServiceConfig, load_config, parse_config
from kvpool.router.service import RouterService

LOCAL = "127.0.0.1"
PROMPT = list(range(300, 365))  # body of 64 tokens: 4 blocks of 16
FAST_INGEST = {"poll_interval_s": 0.05, "http_timeout_s": 0.5, "health_interval_s": 0.1}


def chain(tokens: list[int], tpb: int, algo: str, n: int | None = None, *, first_id: int = 0,
          tier: int = 0) -> list[KVCacheEvent]:
    """Stored events for the first ``n`` blocks of ``tokens`` as a worker would publish them."""
    hashes = request_block_hashes(tokens, tpb, algo)[:n]
    blocks = tuple(
        StoredBlock(h, tuple(tokens[i * tpb:(i + 1) * tpb]), tier) for i, h in enumerate(hashes)
    )
    return [KVCacheEvent(first_id, Stored(None, blocks), 4096, hash_algo=algo)]


def samples(text: str) -> dict[str, float]:
    """Every sample of a ``/metrics`` text, parsed by prometheus_client's own parser, as
    ``name{label="value",...}`` (labels sorted) -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def config(workers: list[dict[str, Any]], **extra: Any) -> ServiceConfig:
    return parse_config({"listen": {"host": LOCAL, "port": 0}, "ingest": FAST_INGEST,
                         "workers": workers, **extra})


class FakeTrtllm:
    """An engine's event endpoints: POST /kv_cache_events drains a queue, GET /server_info."""

    def __init__(self, algo: str | None = "v1_block_key") -> None:
        self.queue: list[KVCacheEvent] = []
        self.algo = algo
        self.polls = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _events(self, request: web.Request) -> web.Response:
        self.polls += 1
        body, self.queue = to_trtllm_json(self.queue), []
        return web.Response(text=body, content_type="application/json")

    async def _info(self, request: web.Request) -> web.Response:
        if self.algo is None:
            return web.Response(status=404)
        return web.json_response({"kv_cache_hash_algo": self.algo})

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self._events)
        app.router.add_get("/server_info", self._info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, LOCAL, port).start()
        self.port = int(self.runner.addresses[0][1])
        self.url = f"http://{LOCAL}:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, data=json.dumps(body)) as resp:
        return resp.status, await resp.json()


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


def workers_by_id(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in view["workers"]}


# ------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({}, "workers"),
        ({"workers": []}, "workers"),
        ({"workers": [{"kind": "vllm"}]}, "workers[0].id"),
        ({"workers": [{"id": "a"}]}, "workers[0].kind"),
        ({"workers": [{"id": "a", "kind": "sglang"}]}, "workers[0].kind"),
        ({"workers": [{"id": "a", "kind": "vllm"}]}, "workers[0].zmq_endpoint"),
        ({"workers": [{"id": "a", "kind": "trtllm"}]}, "workers[0].http_base_url"),
        ({"workers": [{"id": "a", "kind": "trtllm", "http_base_url": "ftp://x"}]},
         "workers[0].http_base_url"),
        ({"workers": [{"id": "a", "kind": "kvpool", "zmq_endpoint": "tcp://127.0.0.1:1"}]},
         "workers[0].hash_algo"),
        ({"workers": [{"id": "a", "kind": "kvpool", "hash_algo": "md5"}]}, "workers[0].hash_algo"),
        ({"workers": [{"id": "a", "kind": "kvpool", "tokens_per_block": 0}]},
         "workers[0].tokens_per_block"),
        ({"workers": [{"id": "a", "kind": "kvpool", "zmq_endpont": "x"}]},
         "workers[0].zmq_endpont"),
        ({"workers": [{"id": "a", "kind": "kvpool"}, {"id": "a", "kind": "kvpool"}]},
         "workers[1].id"),
        ({"workers": [{"id": "a", "kind": "kvpool"}], "listen": {"port": 70000}}, "listen.port"),
        ({"workers": [{"id": "a", "kind": "kvpool"}], "router": {"mode": "fast"}}, "router.mode"),
        ({"workers": [{"id": "a", "kind": "kvpool"}], "router": {"tier_weights": [1, 2, 3]}},
         "router.tier_weights[1]"),
        ({"workers": [{"id": "a", "kind": "kvpool"}], "ingest": {"poll_interval_s": 0}},
         "ingest.poll_interval_s"),
        ("workers: a", "config"),
    ],
)
def test_bad_config_names_the_offending_key(raw: object, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert str(info.value).startswith(key)


def test_config_file_defaults_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "router: {mode: trtllm, max_batch_size: 8}\n"
        "workers:\n"
        "  - {id: v, kind: vllm, zmq_endpoint: 'tcp://127.0.0.1:5557'}\n"
        "  - {id: t, kind: trtllm, http_base_url: 'http://127.0.0.1:8001/'}\n"
    )
    cfg = load_config(path)
    assert cfg.router.mode == "trtllm" and cfg.router.max_batch_size == 8
    assert cfg.workers[0].hash_algo == "vllm_sha256_cbor"  # vLLM's reproducible default
    assert cfg.workers[1].hash_algo is None  # asked of /server_info at run time
    assert cfg.workers[1].http_base_url == "http://127.0.0.1:8001"
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8000)
    path.write_text("workers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


# ------------------------------------------------------------------------------- endpoints


def test_route_finished_workers_metrics_and_health_over_http() -> None:
    async def main() -> None:
        svc = RouterService(config([
            {"id": "a", "kind": "kvpool", "tokens_per_block": 16},
            {"id": "b", "kind": "kvpool", "tokens_per_block": 16},
        ]))
        port = await svc.start()
        base = f"http://{LOCAL}:{port}"
        try:
            svc.ingest.feed("b", chain(PROMPT, 16, "v1_block_key", 3))
            async with aiohttp.ClientSession() as s:
                status, d = await post(s, f"{base}/route",
                                       {"token_ids": PROMPT, "request_id": "r1"})
                assert status == 200
                assert (d["worker_id"], d["request_id"]) == ("b", "r1")
                assert d["matched_blocks"] == [3, 0, 0]
                assert d["matched_tokens"] == 48 and d["total_blocks"] == 4
                assert {c["worker_id"]: c["matched_blocks"] for c in d["candidates"]} == {
                    "a": [0, 0, 0], "b": [3, 0, 0]}

                status, view = await get_json(s, f"{base}/workers")
                w = workers_by_id(view)
                assert w["b"]["blocks_per_tier"] == [3, 0, 0]
                assert w["b"]["hash_algo"] == "v1_block_key"
                assert w["b"]["active_requests"] == 1
                assert w["b"]["ingest"]["transport"] == "feed"
                assert w["a"]["events_applied"] == 0

                async with s.get(f"{base}/metrics") as resp:
                    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    m = samples(await resp.text())
                assert m["kvpool_router_routes_total"] == 1
                assert m['kvpool_router_hit_blocks_total{tier="0"}'] == 3
                assert m["kvpool_router_events_applied_total"] == 1
                assert m['kvpool_router_decision_latency_seconds_bucket{le="+Inf"}'] == 1
                assert m["kvpool_router_decision_latency_seconds_count"] == 1
                assert m['kvpool_router_worker_blocks{tier="0",worker="b"}'] == 3
                assert m['kvpool_router_worker_state{state="healthy",worker="b"}'] == 1

                assert await post(s, f"{base}/finished", {"request_id": "r1"}) == (
                    200, {"request_id": "r1", "finished": True})
                assert (await post(s, f"{base}/finished", {"request_id": "r1"}))[1][
                    "finished"] is False

                for bad in ({"token_ids": [1, -5]}, {"token_ids": [1, 2**31]},
                            {"token_ids": [2**32]}, {"token_ids": [True]}, {"token_ids": "abc"},
                            {"tokens": [1]}, []):
                    status, err = await post(s, f"{base}/route", bad)
                    assert status == 400 and err["error"]
                assert (await get_json(s, f"{base}/health"))[0] == 200
                svc.index.set_healthy("a", False)
                svc.index.set_healthy("b", False)
                assert (await get_json(s, f"{base}/health"))[0] == 503
                status, err = await post(s, f"{base}/route", {"token_ids": PROMPT})
                assert status == 503 and "no healthy worker" in err["error"]
        finally:
            await svc.stop()

    run(main())


def test_a_worker_without_events_is_routed_on_the_predicted_cache() -> None:
    """approx_blocks: the router predicts the worker's cache from what it sent there, so a
    prompt sharing a prefix with an earlier one goes back to it, beside an event-fed worker."""

    async def main() -> None:
        svc = RouterService(config([
            {"id": "quiet", "kind": "vllm", "tokens_per_block": 16, "approx_blocks": [1000]},
            {"id": "fed", "kind": "kvpool", "tokens_per_block": 16},
        ], router={"prediction_ttl_s": 60}))
        port = await svc.start()
        base = f"http://{LOCAL}:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                status, view = await get_json(s, f"{base}/workers")
                quiet = workers_by_id(view)["quiet"]
                assert quiet["ingest"]["transport"] == "none" and quiet["routable"]
                first = [t % 500 for t in range(64)]
                # the event-fed worker holds nothing: the first route is a tie, go where it went
                status, d = await post(s, f"{base}/route", {"token_ids": first})
                assert status == 200
                went = d["worker_id"]
                if went != "quiet":  # make the quiet worker the one that served a prefix
                    status, d = await post(s, f"{base}/route", {"token_ids": first[::-1]})
                    first, went = first[::-1], d["worker_id"]
                assert went == "quiet"
                second = first[:48] + [499] * 16
                status, d = await post(s, f"{base}/route", {"token_ids": second})
                assert status == 200 and d["worker_id"] == "quiet"
                assert d["matched_tokens"] == 48
        finally:
            await svc.stop()

    run(main())


def test_fake_trtllm_worker_is_polled_and_marked_unhealthy_when_it_stops() -> None:
    async def main() -> None:
        engine = FakeTrtllm(algo="v2_sha256")
        await engine.start()
        svc = RouterService(config([
            {"id": "trt", "kind": "trtllm", "http_base_url": engine.url, "tokens_per_block": 16},
            {"id": "other", "kind": "kvpool", "tokens_per_block": 16},
        ]))
        port = await svc.start()
        base = f"http://{LOCAL}:{port}"
        try:
            engine.queue += [KVCacheEvent(0, Created((64,)), 4096, hash_algo="v2_sha256")]
            engine.queue += chain(PROMPT, 16, "v2_sha256", 4, first_id=1)
            async with aiohttp.ClientSession() as s:
                async def indexed() -> bool:
                    return workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"][
                        "blocks_per_tier"] == [4, 0, 0]

                await eventually(indexed)
                view = workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"]
                assert view["hash_algo"] == "v2_sha256"  # from /server_info
                assert view["capacity_per_tier"] == [64]
                status, d = await post(s, f"{base}/route", {"token_ids": PROMPT})
                assert (status, d["worker_id"], d["matched_blocks"]) == (200, "trt", [4, 0, 0])

                # the engine restarts: ids start over, its cache is empty
                engine.queue += [KVCacheEvent(0, Created((64,)), 4096, hash_algo="v2_sha256")]
                engine.queue += chain(PROMPT, 16, "v2_sha256", 1, first_id=1)

                async def reset() -> bool:
                    w = workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"]
                    return w["blocks_per_tier"] == [1, 0, 0] and w["resets"] == 1

                await eventually(reset)

                await engine.stop()

                async def unhealthy() -> bool:
                    w = workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"]
                    return not w["healthy"]

                await eventually(unhealthy)
                w = workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"]
                assert "event poll failed" in w["ingest"]["unhealthy_reason"]
                status, d = await post(s, f"{base}/route", {"token_ids": PROMPT})
                assert d["worker_id"] == "other"
                assert [c["worker_id"] for c in d["candidates"]] == ["other"]
                async with s.get(f"{base}/metrics") as resp:
                    assert samples(await resp.text())["kvpool_router_poll_errors_total"] > 0

                await engine.start(engine.port)  # back on the same port: healthy again

                async def healthy() -> bool:
                    return workers_by_id((await get_json(s, f"{base}/workers"))[1])["trt"][
                        "healthy"]

                await eventually(healthy)
        finally:
            await svc.stop()
            if engine.runner is not None:
                await engine.stop()

    run(main())


async def within(check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    """Poll ``check`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def rebind_publisher(endpoint: str, replay: str) -> ZmqEventPublisher:
    """A publisher on the endpoints another one just released (the port may still be busy)."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return ZmqEventPublisher(endpoint, replay)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_vllm_worker_over_zmq_with_gap_replay_and_restart() -> None:
    # Every wait is on a condition, never a fixed sleep: under load a subscriber connects, a
    # replay answers and a SUB socket reconnects late. Replies and probes get a generous
    # timeout for the same reason (a late replay would count a batch as lost, a late probe
    # would mark the worker unhealthy).
    ingest = {**FAST_INGEST, "http_timeout_s": 5.0}

    async def main() -> None:
        pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        svc = RouterService(parse_config({
            "listen": {"host": LOCAL, "port": 0}, "ingest": ingest, "workers": [
                {"id": "vllm", "kind": "vllm", "zmq_endpoint": pub.endpoint,
                 "replay_endpoint": pub.replay_endpoint, "tokens_per_block": 16},
                {"id": "idle", "kind": "kvpool", "tokens_per_block": 16},
            ]}))
        port = await svc.start()
        base = f"http://{LOCAL}:{port}"
        algo = "vllm_sha256_cbor"
        hashes = request_block_hashes(PROMPT, 16, algo)
        try:
            async with aiohttp.ClientSession() as s:
                async def view() -> dict[str, Any]:
                    return workers_by_id((await get_json(s, f"{base}/workers"))[1])["vllm"]

                async def blocks() -> list[int]:
                    return list((await view())["blocks_per_tier"])

                async def seen_up_to(seq: int) -> bool:
                    last = (await view())["ingest"]["last_seq"]
                    return last is not None and last >= seq

                # The subscriber joins in its own time: publish empty batches until one
                # arrives (any it missed is then replayed, as a gap).
                pub.publish(encode_vllm_batch([]))
                while not await within(lambda: seen_up_to(0), 0.5):
                    pub.publish(encode_vllm_batch([]))

                # stored twice (vLLM does not de-duplicate), published in two batches
                for _ in range(2):
                    pub.publish(encode_vllm_batch(chain(PROMPT, 16, algo, 4)))

                async def four() -> bool:
                    return await blocks() == [4, 0, 0]

                await eventually(four)
                # a batch lost on PUB is recovered through the replay socket
                pub.skip_on_pub(pub.next_seq)
                pub.publish(encode_vllm_batch(
                    [KVCacheEvent(0, Removed((hashes[3],), (0,)), 0, hash_algo=algo)]))
                pub.publish(encode_vllm_batch(
                    [KVCacheEvent(0, Removed((hashes[3],), (0,)), 0, hash_algo=algo)]))

                async def removed() -> bool:
                    return await blocks() == [3, 0, 0]

                await eventually(removed)
                pub.publish(b"\x93not msgpack")
                status, d = await post(s, f"{base}/route", {"token_ids": PROMPT})
                assert (status, d["worker_id"], d["matched_blocks"]) == (200, "vllm", [3, 0, 0])

                async def metric(name: str) -> float:
                    async with s.get(f"{base}/metrics") as resp:
                        return samples(await resp.text())[name]

                async def counted() -> bool:
                    return (await metric("kvpool_router_replayed_batches_total") >= 1
                            and await metric("kvpool_router_sequence_gaps_total") >= 1
                            and await metric("kvpool_router_events_malformed_total") == 1)

                await eventually(counted)

                # A restart shows as a sequence number going back: the new publisher's batches
                # must carry seqs the subscriber already saw from the old one. Raise that bar,
                # so that batches lost while the SUB socket reconnects cannot exhaust it.
                last = pub.next_seq + 19  # all sent so far (the garbage batch was counted)
                for _ in range(20):
                    pub.publish(encode_vllm_batch([]))
                await eventually(lambda: seen_up_to(last))

                # the publisher restarts on the same endpoints: the worker is reset
                endpoint, replay = pub.endpoint, pub.replay_endpoint
                assert replay is not None
                pub.close()
                pub = await rebind_publisher(endpoint, replay)

                async def restarted() -> bool:
                    return await metric("kvpool_router_publisher_restarts_total") >= 1

                # Batches published while the SUB socket reconnects are lost to it: publish
                # until one arrives, within the seqs that still read as a restart.
                sent = 0
                while not await within(restarted, 1.0):
                    assert sent <= last, "the subscriber never reconnected"
                    pub.publish(encode_vllm_batch(chain(PROMPT, 16, algo, 1)))
                    sent += 1
                # after the reset only the new publisher's first block remains
                assert (await blocks())[0] == 1
        finally:
            await svc.stop()
            pub.close()

    run(main())


def test_replay_silence_marks_a_zmq_worker_unhealthy() -> None:
    async def main() -> None:
        pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        svc = RouterService(config([
            {"id": "vllm", "kind": "vllm", "zmq_endpoint": pub.endpoint,
             "replay_endpoint": pub.replay_endpoint, "tokens_per_block": 16},
        ]))
        await svc.start()
        try:
            await eventually(lambda: _true(svc.index.is_healthy("vllm")))
            pub.close()
            await eventually(lambda: _true(not svc.index.is_healthy("vllm")))
            assert svc.ingest.counters.probe_failures >= 1
        finally:
            await svc.stop()

    run(main())


async def _true(value: bool) -> bool:
    return value


def test_proxy_routes_and_streams_completions() -> None:
    async def main() -> None:
        seen: list[dict[str, Any]] = []

        async def completions(request: web.Request) -> web.StreamResponse:
            seen.append(await request.json())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {{\"chunk\": {i}}}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, LOCAL, 0).start()
        upstream = f"http://{LOCAL}:{runner.addresses[0][1]}"
        svc = RouterService(config(
            [{"id": "w", "kind": "kvpool", "tokens_per_block": 16, "http_base_url": upstream}],
            proxy=True,
        ))
        port = await svc.start()
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": PROMPT, "stream": True}
                async with s.post(f"http://{LOCAL}:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kvpool-worker"] == "w"
                    text = await resp.text()
                assert text.count("data: ") == 4 and text.endswith("[DONE]\n\n")
                assert seen == [body]
                assert svc.router.active_requests("w") == 0
                assert svc.router.stats.routes_total == 1
                # text needs the worker's tokenizer, which this one does not serve
                async with s.post(f"http://{LOCAL}:{port}/v1/completions",
                                  json={"prompt": "text"}) as resp:
                    assert resp.status == 503
                    assert "tokenizer" in (await resp.json())["error"]["message"]
        finally:
            await svc.stop()
            await runner.cleanup()

    run(main())


# --------------------------------------------------------------------------- the command


def test_kvpool_router_command_serves_until_terminated(tmp_path: Path) -> None:
    async def main() -> None:
        engine = FakeTrtllm(algo="v1_block_key")
        await engine.start()
        engine.queue += chain(PROMPT, 16, "v1_block_key", 2)
        cfg = tmp_path / "router.yaml"
        cfg.write_text(
            "listen: {host: 127.0.0.1, port: 0}\n"
            "ingest: {poll_interval_s: 0.05}\n"
            "workers:\n"
            f"  - {{id: t, kind: trtllm, http_base_url: '{engine.url}', tokens_per_block: 16}}\n"
            "  - {id: k, kind: kvpool, tokens_per_block: 16}\n"
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpool.cli", "router", "--config", str(cfg),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line.startswith("kvpool router listening on http://127.0.0.1:"), line
            base = line.split()[-1]
            async with aiohttp.ClientSession() as s:
                async def indexed() -> bool:
                    view = workers_by_id((await get_json(s, f"{base}/workers"))[1])
                    return list(view["t"]["blocks_per_tier"]) == [2, 0, 0]

                # route only once t's events are in: a request routed earlier would leave a
                # prediction (by design) that keeps its identical successors on the other worker
                await eventually(indexed)

                async def routed_to_t() -> bool:
                    status, d = await post(s, f"{base}/route", {"token_ids": PROMPT})
                    await post(s, f"{base}/finished", {"request_id": d["request_id"]})
                    return status == 200 and d["worker_id"] == "t" and d["matched_blocks"] == [
                        2, 0, 0]

                await eventually(routed_to_t)
                assert (await get_json(s, f"{base}/health"))[0] == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await engine.stop()

    run(main())


def test_kvpool_router_command_reports_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers:\n  - {id: a, kind: vllm}\n")

    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpool.cli", "router", "--config", str(cfg),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2
        assert "workers[0].zmq_endpoint" in err.decode()

    run(main())


def test_bad_bodies_limits_and_errors_are_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TEST_ROUTER_TOKEN", "s3cret")
    cfg = config([{"id": "a", "kind": "kvpool"}],
                 listen={"host": LOCAL, "port": 0, "max_body_bytes": 4096,
                         "auth_token_env": "KVPOOL_TEST_ROUTER_TOKEN"})

    async def main() -> None:
        svc = RouterService(cfg)
        port = await svc.start()
        base = f"http://{LOCAL}:{port}"
        auth = {"Authorization": "Bearer s3cret"}
        try:
            async with aiohttp.ClientSession() as s:
                async def call(method: str, path: str, data: bytes = b"",
                               headers: dict[str, str] | None = None) -> tuple[int, Any]:
                    async with s.request(method, base + path, data=data,
                                         headers=headers) as resp:
                        assert resp.content_type == "application/json", (path, resp.status)
                        return resp.status, await resp.json()

                # auth: every endpoint but /health
                assert (await call("GET", "/health"))[0] == 200
                for method, path in (("GET", "/workers"), ("GET", "/metrics"),
                                     ("POST", "/route")):
                    status, err = await call(method, path, b"{}")
                    assert status == 401 and "bearer token" in err["error"]
                status, _ = await call("GET", "/workers", headers={"Authorization": "Bearer no"})
                assert status == 401
                # invalid UTF-8 inside a JSON string: 400, not 500
                status, err = await call(
                    "POST", "/route", b'{"token_ids": [1, 2], "cache_salt": "\xe9"}', auth)
                assert status == 400 and "UnicodeDecodeError" in err["error"]
                status, err = await call("POST", "/route", b"[" * 3000, auth)
                assert status == 400
                # over listen.max_body_bytes: 413 with a JSON body naming the limit
                big = json.dumps({"token_ids": list(range(2000))}).encode()
                status, err = await call("POST", "/route", big, auth)
                assert status == 413 and "max_body_bytes (4096" in err["error"]
                for size in (4097, 4096):  # just over the limit (one segment), just at it
                    status, err = await call("POST", "/route", b" " * (size - 2) + b"{}", auth)
                    assert status == (413 if size > 4096 else 400), err
                status, err = await call("GET", "/nowhere", headers=auth)
                assert status == 404 and err["error"]
                status, err = await call("GET", "/route", headers=auth)
                assert status == 405 and err["error"]
                status, d = await call("POST", "/route", b'{"token_ids": [1, 2, 3]}', auth)
                assert status == 200 and d["worker_id"] == "a"
        finally:
            await svc.stop()

    run(main())


def test_expect_continue_head_and_allow_over_a_raw_socket() -> None:
    """What the service's own dispatch answers besides the endpoints: ``Expect:
    100-continue`` gets 100 before the body is sent (413 at once when the announced body is
    over the limit), HEAD works where GET does, a 405 names the allowed methods."""
    cfg = config([{"id": "a", "kind": "kvpool"}],
                 listen={"host": LOCAL, "port": 0, "max_body_bytes": 4096})

    async def exchange(port: int, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection(LOCAL, port)
        try:
            writer.write(head)
            interim = b""
            if body:
                interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                if interim.startswith(b"HTTP/1.1 100 "):
                    writer.write(body)
            answer = await asyncio.wait_for(reader.read(65536), 5)
            return interim, answer
        finally:
            writer.close()

    async def main() -> None:
        svc = RouterService(cfg)
        port = await svc.start()
        try:
            body = b'{"token_ids": [1, 2, 3]}'
            head = (b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nExpect: 100-continue\r\n")
            interim, answer = await exchange(
                port, head + b"Content-Length: %d\r\n\r\n" % len(body), body)
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            assert answer.startswith(b"HTTP/1.1 200 ") and b'"worker_id":"a"' in answer
            interim, answer = await exchange(port, head + b"Content-Length: 5000\r\n\r\n",
                                             b"x" * 5000)
            assert interim.startswith(b"HTTP/1.1 413 ") and b"max_body_bytes (4096" in (
                interim + answer)
            _, answer = await exchange(
                port, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")
            _, answer = await exchange(
                port, b"DELETE /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 405 ") and b"Allow: POST\r\n" in answer
        finally:
            await svc.stop()

    run(main())


def test_auth_token_variable_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TEST_ROUTER_TOKEN", raising=False)
    cfg = config([{"id": "a", "kind": "kvpool"}],
                 listen={"host": LOCAL, "port": 0, "auth_token_env": "KVPOOL_TEST_ROUTER_TOKEN"})
    with pytest.raises(ConfigError, match="KVPOOL_TEST_ROUTER_TOKEN"):
        RouterService(cfg)


def test_default_body_limit_takes_the_longest_default_prompt() -> None:
    limit = config([{"id": "a", "kind": "kvpool"}]).listen.max_body_bytes
    longest = json.dumps({"token_ids": [9_999_999] * 131_072, "request_id": "r" * 64})
    assert len(longest) < limit
    with pytest.raises(ConfigError, match=r"listen\.max_body_bytes"):
        config([{"id": "a", "kind": "kvpool"}], listen={"max_body_bytes": "1 MiB"})
