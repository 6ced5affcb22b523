"""The router service end to end: real HTTP, real ZeroMQ workers, concurrent clients.

``--workers`` kvpool workers (default 4: a real :class:`~kvpool.manager.KVCacheManager` each,
publishing its events over ZeroMQ with snapshots) keep serving prompts while the router runs as
its own process (``kvpool router --config``, as an operator starts it). ``--clients`` concurrent
HTTP clients (default 32, one aiohttp session) send ``--routes`` ``POST /route`` requests
(default 20,000) of ``--tokens``-token prompts (default 1,024: 64 blocks of 16), drawn from 64
prompt families whose first half each worker may hold. Every answer must be a 200 with a worker;
anything else (status, timeout, connection error) counts as an error.

The table: throughput (routes/s over the whole run; and per CPU second of the router process,
the rate a core of its own would give), latency per request as the client sees it (p50, p99,
max), errors, and the router process's resident memory before the load (after the workers'
blocks were indexed) and after it. Targets: >= 3,000 routes/s, p99 <= 20 ms, 0 errors. The
machine may be shared: the load average (``os.getloadavg``) at start and end is reported.

    .venv/bin/python benchmarks/bench_router_service.py [--routes 20000] [--clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.config import CacheConfig, SequenceRequest
from kvpool.errors import OutOfBlocksError
from kvpool.events.snapshot import PublishedState
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher
from kvpool.hashing import HashAlgo
from kvpool.manager import KVCacheManager

TPB = 16
ALGO = HashAlgo.V2_SHA256_64
TARGET_RPS = 3000
TARGET_P99_MS = 20.0
FAMILIES = 64


class Worker:
    """A kvpool manager whose events leave over ZMQ after each served prompt."""

    def __init__(self, gpu_blocks: int) -> None:
        self.m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=gpu_blocks,
                                            hash_algo=ALGO, enable_partial_reuse=False,
                                            event_buffer_max_size=100_000))
        self.state = PublishedState(ALGO)
        self.pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                     snapshot=self._snapshot)
        self.n = 0
        self.lock = threading.Lock()

    def _snapshot(self) -> bytes:
        # partial_blocks: seeded blocks carry no tokens (they were whole when announced)
        return encode_vllm_batch(self.state.events(), block_size=TPB, partial_blocks=True)

    def serve(self, tokens: list[int]) -> None:
        with self.lock:
            self.n += 1
            try:
                self.m.add_sequence(SequenceRequest(self.n, tokens))
            except OutOfBlocksError:
                return
            self.m.remove_sequence(self.n)
            self.m.flush_iteration_events()
            events = self.m.get_latest_events(0)
            self.pub.publish(encode_vllm_batch(events, block_size=TPB),
                             update=lambda: self.state.apply(events))


def _prompt(rng: random.Random, family: int, tokens: int) -> list[int]:
    half = tokens // 2
    prefix = [family * 10_000 + i for i in range(half)]
    return prefix + [rng.randrange(100_000, 200_000) for _ in range(tokens - half)]


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _start_router(
    workers: list[Worker], cfg_dir: Path, pythonpath: str | None
) -> tuple[Any, str]:
    lines = ["listen: {host: 127.0.0.1, port: 0}",
             "router: {request_timeout_s: 5}",
             "ingest: {health_interval_s: 1.0, http_timeout_s: 2.0}",
             "workers:"]
    for i, w in enumerate(workers):
        lines.append(f"  - {{id: w{i}, kind: kvpool, zmq_endpoint: '{w.pub.endpoint}', "
                     f"replay_endpoint: '{w.pub.replay_endpoint}', tokens_per_block: {TPB}, "
                     f"hash_algo: {ALGO.value}}}")
    cfg = cfg_dir / "router.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:  # another checkout's router, for a comparison
        env["PYTHONPATH"] = pythonpath
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpool.cli", "router", "--config", str(cfg), "--log-level",
        "WARNING", stdout=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    return proc, line.split()[-1]


async def _load(base: str, bodies: list[bytes], clients: int) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    errors = 0
    next_body = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        async def client() -> None:
            nonlocal errors
            for i in next_body:
                t0 = time.perf_counter()
                try:
                    async with s.post(f"{base}/route", data=bodies[i],
                                      headers={"Content-Type": "application/json"}) as resp:
                        answer = await resp.read()
                        ok = resp.status == 200 and b'"worker_id"' in answer
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return latencies, errors, wall


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    workers = [Worker(gpu_blocks=args.gpu_blocks) for _ in range(args.workers)]
    for i, w in enumerate(workers):  # each worker holds the prefixes of some families
        for family in range(i, FAMILIES, 2):
            w.serve(_prompt(rng, family, args.tokens))
    stop = threading.Event()

    def keep_serving() -> None:  # the workers keep publishing during the load
        r = random.Random(args.seed + 1)
        while not stop.wait(args.publish_every_s):
            r.choice(workers).serve(_prompt(r, r.randrange(FAMILIES), args.tokens))

    bodies = [json.dumps({"token_ids": _prompt(rng, rng.randrange(FAMILIES), args.tokens)})
              .encode() for _ in range(args.routes)]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = await _start_router(workers, Path(tmp), args.router_pythonpath)
        publisher = threading.Thread(target=keep_serving, daemon=True)
        try:
            async with aiohttp.ClientSession() as s, s.get(f"{base}/workers") as resp:
                view = await resp.json()
            indexed = sum(sum(w["blocks_per_tier"]) for w in view["workers"])
            rss_before, cpu_before = _rss_kib(proc.pid), _cpu_s(proc.pid)
            publisher.start()
            latencies, errors, wall = await _load(base, bodies, args.clients)
            stop.set()
            publisher.join()
            rss_after, cpu = _rss_kib(proc.pid), _cpu_s(proc.pid) - cpu_before
        finally:
            stop.set()
            proc.terminate()
            await proc.wait()
            for w in workers:
                w.pub.close()
    lat = sorted(latencies)
    rps = len(lat) / wall
    p99 = _pct(lat, 0.99) * 1000
    return {
        "routes": len(lat),
        "clients": args.clients,
        "routes/s": rps,
        "per router cpu s": len(lat) / cpu,
        "p50 ms": _pct(lat, 0.50) * 1000,
        "p99 ms": p99,
        "max ms": lat[-1] * 1000,
        "errors": errors,
        "blocks": indexed,
        "RSS MiB": f"{rss_before / 1024:.0f} -> {rss_after / 1024:.0f}",
        "load avg": f"{load_start:.1f} -> {os.getloadavg()[0]:.1f}",
        "ok": "yes" if rps >= TARGET_RPS and p99 <= TARGET_P99_MS and not errors else "NO",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routes", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gpu-blocks", type=int, default=4096)
    parser.add_argument("--publish-every-s", type=float, default=0.02,
                        help="a worker serves (and publishes) one prompt this often")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-pythonpath", default=None,
                        help="PYTHONPATH of the router process (to compare another checkout)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    row = asyncio.run(run(args))
    report("bench_router_service", [row],
           title=(f"router service over HTTP, {args.workers} workers, {args.tokens}-token prompts"
                  f" (target >= {TARGET_RPS} routes/s, p99 <= {TARGET_P99_MS:.0f} ms, 0 errors)"),
           extra={"args": vars(args)}, out=args.out)


if __name__ == "__main__":
    main()
