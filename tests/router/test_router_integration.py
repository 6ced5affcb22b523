"""The router as a user runs it (``kvpool router`` subprocess) over real sockets on 127.0.0.1:
two kvpool managers publish their events over ZMQ (vLLM msgpack), a fake TensorRT-LLM engine
serves ``/kv_cache_events`` over HTTP, and a shared-prefix workload must reach the worker that
holds its prefix. A dropped ZMQ batch is recovered by replay; a restarted publisher resets
its worker."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from test_router_service import FakeTrtllm, eventually, get_json, post, run, workers_by_id

from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher
from kvpool.hashing.keys import HashAlgo

TPB = 16
FAMILIES = {  # a shared prefix per family, 4 blocks each
    "kv0": list(range(1000, 1064)),
    "kv1": list(range(2000, 2064)),
    "trt": list(range(3000, 3064)),
}


class KvpoolWorker:
    """A kvpool manager whose events leave through a ZMQ publisher each step."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0",
                 replay: str = "tcp://127.0.0.1:0") -> None:
        self.m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=256,
                                            hash_algo=HashAlgo.V2_SHA256_64,
                                            enable_partial_reuse=False,
                                            events=EventsConfig(buffer_max_size=10_000)))
        self.pub = ZmqEventPublisher(endpoint, replay)
        self.n = 0

    def serve(self, tokens: list[int]) -> None:
        """Compute one request and keep its blocks cached, then publish the step's events."""
        self.n += 1
        self.m.add_sequence(SequenceRequest(self.n, tokens))
        self.m.remove_sequence(self.n)
        self.step()

    def step(self) -> None:
        self.m.flush_iteration_events()
        events = self.m.get_latest_events(0)
        if events:
            self.pub.publish(encode_vllm_batch(events, block_size=TPB))


def test_router_subprocess_routes_kvpool_and_trtllm_workers(tmp_path: Path) -> None:
    async def main() -> None:
        engine = FakeTrtllm(algo="v1_block_key")
        await engine.start()
        trt = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=64,
                                         hash_algo=HashAlgo.V1_BLOCK_KEY,
                                         enable_partial_reuse=False,
                                         events=EventsConfig(buffer_max_size=1000)))
        trt.add_sequence(SequenceRequest(0, [*FAMILIES["trt"], 1]))
        trt.remove_sequence(0)
        trt.flush_iteration_events()
        engine.queue += trt.get_latest_events(0)
        w0, w1 = KvpoolWorker(), KvpoolWorker()
        cfg = tmp_path / "router.yaml"
        lines = ["listen: {host: 127.0.0.1, port: 0}",
                 "ingest: {poll_interval_s: 0.05, http_timeout_s: 0.5, health_interval_s: 0.1}",
                 "workers:"]
        for wid, w in (("kv0", w0), ("kv1", w1)):
            lines.append(f"  - {{id: {wid}, kind: kvpool, zmq_endpoint: '{w.pub.endpoint}', "
                         f"replay_endpoint: '{w.pub.replay_endpoint}', tokens_per_block: {TPB}, "
                         "hash_algo: v2_sha256_64}")
        lines.append(f"  - {{id: trt, kind: trtllm, http_base_url: '{engine.url}', "
                     f"tokens_per_block: {TPB}}}")
        cfg.write_text("\n".join(lines) + "\n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpool.cli", "router", "--config", str(cfg),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            base = line.split()[-1]
            async with aiohttp.ClientSession() as s:
                async def blocks(wid: str) -> list[int]:
                    view = workers_by_id((await get_json(s, f"{base}/workers"))[1])
                    return list(view[wid]["blocks_per_tier"])

                async def routes(family: str, want: str, matched: int) -> bool:
                    toks = [*FAMILIES[family], 7, 7, 7]
                    status, d = await post(s, f"{base}/route", {"token_ids": toks})
                    await post(s, f"{base}/finished", {"request_id": d["request_id"]})
                    return status == 200 and d["worker_id"] == want and \
                        d["matched_blocks"][0] == matched

                # give the SUB sockets time to join, then serve the families
                await asyncio.sleep(0.5)
                w0.serve([*FAMILIES["kv0"], 5])
                w1.pub.skip_on_pub(w1.pub.next_seq)  # this batch only reaches SUB by replay
                w1.serve([*FAMILIES["kv1"], 5])
                # the next batch (one new block) reveals the gap
                w1.serve([*FAMILIES["kv1"], *range(5000, 5020)])

                async def all_indexed() -> bool:
                    return (await blocks("kv0"))[0] == 4 and (await blocks("kv1"))[0] == 5 \
                        and (await blocks("trt"))[0] == 4

                try:
                    await eventually(all_indexed, timeout=20)
                except AssertionError:
                    view = (await get_json(s, f"{base}/workers"))[1]
                    raise AssertionError(f"not indexed: {view}") from None
                for family in ("kv0", "kv1", "trt"):
                    assert await routes(family, family, 4), family

                async with s.get(f"{base}/metrics") as resp:
                    metrics = text_string_to_metric_families(await resp.text())
                replayed = next(f for f in metrics if f.name == "kvpool_router_replayed_batches")
                assert replayed.samples[0].value >= 1

                # kv1's engine restarts (empty cache) on the same endpoints
                endpoint, replay = w1.pub.endpoint, w1.pub.replay_endpoint
                w1.pub.close()
                for _ in range(50):  # the old sockets may hold the ports for a moment
                    try:
                        w1 = KvpoolWorker(endpoint, replay)
                        break
                    except Exception:
                        await asyncio.sleep(0.1)
                else:
                    raise AssertionError("could not rebind the restarted publisher")

                fresh = iter(range(9000, 10_000_000, 20))

                async def reset() -> bool:
                    # new traffic reveals the restart (batches sent while SUB reconnects are lost)
                    w1.serve(list(range(next(fresh), next(fresh))))
                    await asyncio.sleep(0.2)
                    view = workers_by_id((await get_json(s, f"{base}/workers"))[1])
                    return bool(view["kv1"]["resets"] >= 1)

                await eventually(reset, timeout=20)
                toks = [*FAMILIES["kv1"], 7, 7, 7]
                status, d = await post(s, f"{base}/route", {"token_ids": toks})
                scores: dict[str, Any] = {c["worker_id"]: c for c in d["candidates"]}
                assert status == 200 and scores["kv1"]["matched_blocks"][0] == 0
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            w0.pub.close()
            w1.pub.close()
            await engine.stop()

    run(main())
