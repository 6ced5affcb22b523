"""The remote tier against plain redis-py, on a loopback redis-server.

Reads: 1,000 blocks of 2 MiB and 1,000 of 64 KiB are stored (encoded: header + payload), then
read back by ``RemoteStore.get_many`` followed by the codec's verification of every value (the
whole read path of a prefetch, without the copy into a pool), and by redis-py doing plain
pipelined GETs of the same keys in round trips of the same byte budget, without checking
anything. Both run in alternating rounds in the same process against the same server, so a busy
machine loads both alike; the figure of merit is the ratio of their throughputs (target ≥ 0.8).

Writes: the scheduler thread's cost per offloaded block with write-behind, i.e. the time of
``RemoteWriter.put`` per block while the writer thread sends earlier blocks to the server, and
the throughput the writer reaches (put of the first block to the end of ``flush``).

Run: ``python benchmarks/bench_remote.py`` (``--quick``: 200 blocks a size, fewer rounds;
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
from kvpool.remote.codec import ValueCodec
from kvpool.remote.store import DEFAULT_BATCH_BYTES, RemoteStore
from kvpool.remote.writer import RemoteWriter

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--url", help="a running server (default: start one on loopback)")
    args = parser.parse_args()
    blocks, rounds = (200, 3) if args.quick else (1000, 5)
    sizes = [2 * MiB, 64 * 1024]

    def run(url: str) -> None:
        rows = read_rows(url, blocks, sizes, rounds) + write_rows(url, blocks, sizes)
        report("bench_remote", rows, title="remote tier on a loopback server",
               extra={"rounds": rounds})

    if args.url:
        run(args.url)
    else:
        with loopback_server() as url:
            run(url)


if __name__ == "__main__":
    main()
