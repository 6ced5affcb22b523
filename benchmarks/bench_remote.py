"""The remote tier against plain redis-py, on a loopback redis-server.

Reads: 1,000 blocks of 2 MiB and 1,000 of 64 KiB are stored (encoded: header + payload), then
read back by ``RemoteStore.get_many`` followed by the codec's verification of every value (the
whole read path of a prefetch, without the copy into a pool), and by redis-py doing plain
pipelined GETs of the same keys in round trips of the same byte budget, without checking
anything. Both run in alternating rounds in the same process against the same server, so a busy
machine loads both alike; the figure of merit is the ratio of their throughputs (target ≥ 0.8).

Prefetch: the path engines use, ``KVCacheManager.prefetch`` of one request whose 1,000 blocks
(2 MiB, then 64 KiB each) another engine wrote: lookup, reads, verification and the copy into
host slots, the blocks then in the tree. Timed against redis-py's plain pipelined GETs of the
same values in alternating rounds (target >= 0.8x); each round starts from an empty cache
(``clear_cache``, not timed).

Writes: the scheduler thread's cost per offloaded block with write-behind, i.e. the time of
``RemoteWriter.put`` per block while the writer thread sends earlier blocks to the server, and
the throughput the writer reaches (put of the first block to the end of ``flush``); and through
the manager, the extra time an admission that evicts N blocks takes with ``remote_url`` (the
blocks' bytes snapshotted and queued) over the same admission without a remote tier, per block.

Run: ``.venv/bin/python benchmarks/bench_remote.py`` (``--quick``: 200 blocks a size, fewer rounds;
``--url redis://...`` uses a running server instead of starting one; it needs about twice the
blocks' bytes of free memory, 4 GiB for the default run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool import CacheConfig, KVCacheManager, SequenceRequest
from kvpool.config import RemoteConfig
from kvpool.hashing.keys import BlockHasher
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.store import DEFAULT_BATCH_BYTES, RemoteStore
from kvpool.tiers.remote.writer import RemoteWriter
from kvpool.tiers.storage import GroupGeometry

NS = bytes(range(16))
MiB = 1 << 20


@contextmanager
def loopback_server() -> Iterator[str]:
    """A redis-server on a free 127.0.0.1 port in a temporary directory, no persistence."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("bench_remote: no redis-server or valkey-server on PATH "
                         "(Debian: apt-get install redis-server), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


def plain_gets(client: redis.Redis, keys: list[bytes], per_round: int) -> int:
    """redis-py's plain pipelined GETs, ``per_round`` keys a round trip; bytes read."""
    total = 0
    for i in range(0, len(keys), per_round):
        pipe = client.pipeline(transaction=False)
        for k in keys[i:i + per_round]:
            pipe.get(k)
        total += sum(len(v) for v in pipe.execute())
    return total


def kvpool_reads(store: RemoteStore, codec: ValueCodec, keys: list[bytes]) -> int:
    """RemoteStore.get_many and the codec's verification of every value; payload bytes."""
    total = 0
    for k, v in zip(keys, store.get_many(keys), strict=True):
        payload = codec.decode(v, NS, k)
        assert payload is not None
        total += payload.nbytes
    return total


def read_rows(url: str, blocks: int, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    codec = ValueCodec()
    client = redis.Redis.from_url(url)
    for size in sizes:
        keys = [b"kvp:bench:%d:%d" % (size, i) for i in range(blocks)]
        payload = os.urandom(size)
        store = RemoteStore(url)
        store.put_many([(k, codec.encode(NS, k, payload)) for k in keys])
        per_round = max(1, DEFAULT_BATCH_BYTES // size)
        runs: dict[str, Callable[[], int]] = {
            "redis-py pipelined GET": lambda k=keys, n=per_round: plain_gets(client, k, n),
            "RemoteStore.get_many + verify": lambda k=keys, s=store: kvpool_reads(s, codec, k),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        nbytes = {name: fn() for name, fn in runs.items()}  # warm-up
        for _ in range(rounds):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["redis-py pipelined GET"])
        for name in runs:
            t = statistics.median(times[name])
            rows.append({
                "block": f"{size // 1024} KiB", "blocks": blocks, "reader": name,
                "GB/s": round(nbytes[name] / t / 1e9, 3),
                "ms": round(t * 1e3, 1),
                "vs redis-py": round(base / t, 2),
            })
        store.delete_many(keys)
        store.close()
    client.close()
    return rows


def write_rows(url: str, blocks: int, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        payload = os.urandom(size)
        keys = [b"kvp:bench:w:%d:%d" % (size, i) for i in range(blocks)]
        store = RemoteStore(url)
        writer = RemoteWriter(store, max_pending_bytes=blocks * size + 1)
        put = writer.put
        start = time.perf_counter()
        for k in keys:
            put(NS, k, payload)
        scheduler = time.perf_counter() - start
        assert writer.flush(600)
        total = time.perf_counter() - start
        stats = writer.stats
        assert stats.written == blocks, stats
        rows.append({
            "block": f"{size // 1024} KiB", "blocks": blocks,
            "scheduler µs/block": round(scheduler / blocks * 1e6, 2),
            "writer GB/s": round(blocks * size / total / 1e9, 3),
        })
        writer.close()
        store.delete_many(keys)
        store.close()
    return rows


TPB = 16


def _geometry(size: int) -> GroupGeometry:
    """One layer group whose blocks are ``size`` bytes (fp16, 8 KV heads of 128, 16 tokens:
    64 KiB a layer)."""
    return GroupGeometry(num_layers=size // (64 * 1024), kv_heads=8, head_dim=128,
                         dtype="float16")


def _manager(url: str | None, size: int, blocks: int, **kw: Any) -> KVCacheManager:
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=kw.pop("gpu_blocks", 4),
                                      host_blocks=kw.pop("host_blocks", blocks + 1),
                                      layer_geometry=[_geometry(size)], model_id="bench", **kw,
                                      remote=RemoteConfig(url=url)))


def prefetch_rows(url: str, blocks: int, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    rows = [row for size in sizes for row in _prefetch_size(url, client, blocks, size, rounds)]
    client.close()
    return rows


def _prefetch_size(url: str, client: redis.Redis, blocks: int, size: int,
                   rounds: int) -> list[dict[str, Any]]:
    codec = ValueCodec()
    m = _manager(url, size, blocks)
    tokens = list(range(blocks * TPB + 1))
    req = [SequenceRequest("r", tokens)]
    scope = m._st.remote.tier.scope()  # type: ignore[union-attr]
    keys = [scope.remote_key(k, 0) for k in BlockHasher(m.config.hash_algo, TPB).extend(tokens)]
    payload = os.urandom(size)
    with RemoteStore(url) as store:
        store.put_many([(k, codec.encode(scope.digest, k, payload)) for k in keys])
    per_round = max(1, DEFAULT_BATCH_BYTES // size)

    def via_prefetch() -> int:
        got = m.prefetch(req)[0]
        assert got == blocks * TPB, got
        return blocks * size

    runs: dict[str, Callable[[], int]] = {
        "redis-py pipelined GET": lambda: plain_gets(client, keys, per_round),
        "KVCacheManager.prefetch": via_prefetch,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    nbytes = {}
    for r in range(rounds + 1):  # the first round warms up
        for name, fn in runs.items():
            m.clear_cache()
            start = time.perf_counter()
            nbytes[name] = fn()
            if r:
                times[name].append(time.perf_counter() - start)
    m.close()
    client.delete(*keys)
    base = statistics.median(times["redis-py pipelined GET"])
    rows = []
    for name in runs:
        t = statistics.median(times[name])
        rows.append({
            "block": f"{size // 1024} KiB", "blocks": blocks, "reader": name,
            "GB/s": round(nbytes[name] / t / 1e9, 3), "ms": round(t * 1e3, 1),
            "vs redis-py": round(base / t, 2),
        })
    return rows


def offload_rows(url: str, blocks: int, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Scheduler-thread time per block an admission evicts, with and without a remote tier."""
    rows = []
    for size in sizes:
        cost: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for remote in (False, True):
                m = _manager(url if remote else None, size, 0, gpu_blocks=blocks + 1,
                             host_blocks=0)
                first = list(range(1_000_000 * r, 1_000_000 * r + blocks * TPB + 1))
                m.add_sequence(SequenceRequest("a", first))
                m.remove_sequence("a")  # its blocks are cached, queued for eviction
                second = [t + 500_000 for t in first]
                start = time.perf_counter()
                m.add_sequence(SequenceRequest("b", second))  # evicts every block of "a"
                cost[remote].append(time.perf_counter() - start)
                assert m.flush_remote(600)
                stats = m.remote_stats()
                assert stats is None or stats.offloaded_blocks >= blocks, stats
                m.close()
        base, with_remote = (statistics.median(cost[k]) for k in (False, True))
        rows.append({
            "block": f"{size // 1024} KiB", "blocks": blocks,
            "admission ms, no remote": round(base * 1e3, 1),
            "admission ms, remote_url": round(with_remote * 1e3, 1),
            "scheduler µs/offloaded block": round((with_remote - base) / blocks * 1e6, 1),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--url", help="a running server (default: start one on loopback)")
    args = parser.parse_args()
    blocks, rounds = (200, 3) if args.quick else (1000, 5)
    sizes = [2 * MiB, 64 * 1024]

    def run(url: str) -> None:
        rows = (read_rows(url, blocks, sizes, rounds) + prefetch_rows(url, blocks, sizes, rounds)
                + write_rows(url, blocks, sizes) + offload_rows(url, blocks, sizes, rounds))
        report("bench_remote", rows, title="remote tier on a loopback server",
               extra={"rounds": rounds})

    if args.url:
        run(args.url)
    else:
        with loopback_server() as url:
            run(url)


if __name__ == "__main__":
    main()
