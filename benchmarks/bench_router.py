"""Router: event ingestion throughput and routing-decision latency, per hash algorithm.

Ingestion (``ingest`` rows): ``--ingest-blocks`` block events (default 400,000) as vLLM msgpack
batches (what a ZMQ subscriber receives) and as TensorRT-LLM JSON lists (what an HTTP poll
returns): each batch holds 8 stored chains of 16 blocks of ``--tpb`` tokens, and a quarter of
the block events are removals. The time covers decoding and applying to the index
(:meth:`Ingest.feed_vllm` / :meth:`Ingest.feed_trtllm`); the rate is block events per second.
The worker is configured as a service configuration names it (algorithm, tokens per block,
``match_by_tokens`` for the token-chain rows), so the ingest decodes what its index needs;
every event must apply cleanly (no malformed event, no anomaly).
Target: >= 500,000 block events/s. ``index only`` rows apply the same events already decoded
(:meth:`Ingest.feed`), which splits the cost between the decoders and the index.

Routing (``route`` rows): ``--workers`` workers (default 32) holding ``--blocks`` blocks each
(default 100,000), all of one algorithm; ``--queries`` prompts (default 300) of ``--tokens``
tokens (default 8,192: 256 blocks of 32). Each prompt is held by every worker to a random depth
(uniform over the prompt's blocks, on a random tier), the rest of each worker's blocks are
unrelated chains. Each decision (hashing, walk over all workers, scoring) is timed with
``perf_counter``; requests are finished right after, so the load stays flat. Targets: p99 <= 2
ms for ``v2_sha256`` and the token chain (xxh3), <= 5 ms for ``v1_block_key``.

Run ``--quick`` for a smoke run (small sizes). The machine this runs on may be shared: read
the CPU-time rates as the less disturbed ones.

Before/after: ``--baseline SRC`` (the ``src`` folder of another checkout, say ``git worktree add
/tmp/base 7d96295`` then ``--baseline /tmp/base/src``) runs this script ``--rounds`` times
against each, in alternating subprocesses (``PYTHONPATH``), so both see the same machine load;
a row per version gives the median of each number over the rounds.

    .venv/bin/python benchmarks/bench_router.py [--quick] [--baseline SRC [--rounds N]]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvpool.events.trtllm_json import to_trtllm_json
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.hashing.keys import HashAlgo, request_block_hashes
from kvpool.router.config import WorkerConfig, WorkerKind
from kvpool.router.index import KvIndex, token_chain_keys
from kvpool.router.ingest import Ingest
from kvpool.router.scoring import Router

INGEST_TARGET = 500_000
P99_TARGET_MS = {"v1_block_key": 5.0, "v2_sha256": 2.0, "tokens (xxh3)": 2.0}
ALGOS = ["v1_block_key", "v2_sha256", "v2_sha256_64", "vllm_sha256_cbor", "tokens (xxh3)"]


# ---------------------------------------------------------------------------------- ingest


def _ingest_batches(
    rng: random.Random, algo: str, tpb: int, n_blocks: int
) -> list[list[KVCacheEvent]]:
    """Batches of 8 stored chains of 16 blocks, plus removals of earlier blocks (1/4)."""
    hex_hashes = algo == "v2_sha256"
    batches: list[list[KVCacheEvent]] = []
    held: list[int | str] = []
    eid = 0
    made = 0
    while made < n_blocks:
        batch: list[KVCacheEvent] = []
        for _ in range(8):
            blocks = []
            for _ in range(16):
                h: int | str = rng.getrandbits(64)
                if hex_hashes:
                    h = f"{h:016x}" + "0" * 48
                toks = tuple(rng.randrange(128_000) for _ in range(tpb))
                blocks.append(StoredBlock(h, toks, 0))
                held.append(h)
            batch.append(KVCacheEvent(eid, Stored(None, tuple(blocks)), 0, hash_algo=algo))
            eid += 1
            made += 16
        gone = [held.pop(rng.randrange(len(held))) for _ in range(42)]
        batch.append(KVCacheEvent(eid, Removed(tuple(gone), (0,) * len(gone)), 0, hash_algo=algo))
        eid += 1
        made += len(gone)
        batches.append(batch)
    return batches


def bench_ingest(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for algo in ALGOS:
        by_tokens = algo.startswith("tokens")
        wire_algo = HashAlgo.VLLM_SHA256_CBOR.value if by_tokens else algo
        batches = _ingest_batches(rng, wire_algo, args.tpb, args.ingest_blocks)
        n_events = sum(
            len(e.data.blocks) if isinstance(e.data, Stored) else len(e.data.block_hashes)
            for b in batches for e in b if isinstance(e.data, Stored | Removed)
        )
        formats: list[tuple[str, list[Any]]] = [
            ("vllm msgpack", [encode_vllm_batch(b, ts=0.0, block_size=args.tpb) for b in batches]),
        ]
        if not by_tokens and algo != "vllm_sha256_cbor":
            formats.append(("trtllm json", [to_trtllm_json(b).encode() for b in batches]))
        # The index alone (events already decoded): what decoding costs is the difference.
        formats.append(("index only", batches))
        for fmt, payloads in formats:
            index = KvIndex()
            index.add_worker("w", hash_algo=wire_algo, tokens_per_block=args.tpb,
                             match_by_tokens=by_tokens)
            ingest = Ingest(index)
            ingest.add(WorkerConfig("w", WorkerKind.KVPOOL, tokens_per_block=args.tpb,
                                    hash_algo=wire_algo, match_by_tokens=by_tokens))
            feeds: dict[str, Callable[[str, Any], int]] = {
                "vllm msgpack": ingest.feed_vllm,
                "trtllm json": ingest.feed_trtllm,
                "index only": ingest.feed,
            }
            feed = feeds[fmt]
            gc.collect()
            gc.disable()
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                for p in payloads:
                    feed("w", p)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            finally:
                gc.enable()
            assert index.counters.events_malformed == 0 and index.counters.anomalies == 0
            rows.append({
                "bench": "ingest",
                "algo": algo,
                "format": fmt,
                "k ev/s": n_events / wall / 1000,
                "k ev/s cpu": n_events / cpu / 1000,
                "target": f">= {INGEST_TARGET // 1000}k ev/s",
                "ok": _ok(n_events / wall >= INGEST_TARGET),
                "block events": n_events,
            })
    return rows


# ---------------------------------------------------------------------------------- routing


def _chain_hashes(algo: str, tokens: list[int], tpb: int) -> list[int | str]:
    if algo.startswith("tokens"):
        return list(token_chain_keys(tokens[:-1], tpb))
    return request_block_hashes(tokens, tpb, algo)


def bench_route(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    tpb = args.tpb
    prompts = [[rng.randrange(128_000) for _ in range(args.tokens)] for _ in range(args.queries)]
    for algo in ALGOS:
        by_tokens = algo.startswith("tokens")
        wire_algo = HashAlgo.VLLM_SHA256_CBOR.value if by_tokens else algo
        index = KvIndex()
        workers = [f"w{i:02d}" for i in range(args.workers)]
        for w in workers:
            index.add_worker(w, hash_algo=wire_algo, tokens_per_block=tpb,
                             match_by_tokens=by_tokens)
        hex_hashes = algo == "v2_sha256"
        t_build = time.perf_counter()
        per_prompt = [_chain_hashes(algo, p, tpb) for p in prompts]
        for w in workers:
            held = 0
            eid = 0
            for p, hashes in zip(prompts, per_prompt, strict=True):
                depth = rng.randrange(len(hashes) + 1)
                if not depth:
                    continue
                tier = rng.choice((0, 0, 0, 1, 2))
                blocks = []
                for i in range(depth):
                    h = hashes[i]
                    if by_tokens:  # the engine's own hash: opaque; the router keys by tokens
                        h = (hash((w, i, id(p))) & ((1 << 64) - 1))
                    toks = tuple(p[i * tpb:(i + 1) * tpb]) if by_tokens else ()
                    blocks.append(StoredBlock(h, toks, tier))
                index.apply(w, KVCacheEvent(eid, Stored(None, tuple(blocks)), 0,
                                            hash_algo=wire_algo))
                eid += 1
                held += depth
            while held < args.blocks:  # unrelated chains fill the rest
                n = min(64, args.blocks - held)
                blocks = []
                for _ in range(n):
                    r = rng.getrandbits(64)
                    h2: int | str = f"{r:016x}" + "0" * 48 if hex_hashes else r
                    toks = (r & 0xFFFF, r >> 48) if by_tokens else ()
                    blocks.append(StoredBlock(h2, toks, 0))
                index.apply(w, KVCacheEvent(eid, Stored(None, tuple(blocks)), 0,
                                            hash_algo=wire_algo))
                eid += 1
                held += n
        build_s = time.perf_counter() - t_build
        router = Router(index, prediction_ttl_s=0.0)
        for p in prompts[:3]:  # warm caches
            router.request_finished(router.route(p).request_id)
        lat, cpu_lat = [], []
        gc.collect()
        gc.disable()
        try:
            for p in prompts:
                t0, c0 = time.perf_counter(), time.thread_time()
                d = router.route(p)
                cpu_lat.append((time.thread_time() - c0) * 1000)
                lat.append((time.perf_counter() - t0) * 1000)
                router.request_finished(d.request_id)
        finally:
            gc.enable()
        lat.sort()
        cpu_lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        target = P99_TARGET_MS.get(algo)
        rows.append({
            "bench": "route",
            "algo": algo,
            "format": f"{args.workers}x{args.blocks // 1000}k blocks",
            "p50 ms": statistics.median(lat),
            "p99 ms": p99,
            "p99 ms cpu": cpu_lat[min(len(cpu_lat) - 1, int(0.99 * len(cpu_lat)))],
            "target": f"p99 <= {target:g} ms" if target is not None else "",
            "ok": _ok(p99 <= target) if target is not None else "",
            "max ms": lat[-1],
            "build s": build_s,
            "hashes": len(index.masks),
        })
        del index, router
        gc.collect()
    return rows


def _ok(passed: bool) -> str:
    return "yes" if passed else "no"


def compare(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    """This script's rows for the baseline and the current source, rounds alternating (each run
    in its own process), as medians over the rounds, the baseline's row first."""
    import kvpool

    sources = {"baseline": str(Path(args.baseline).resolve()),
               "current": str(Path(kvpool.__file__).resolve().parents[1])}
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in sources}
    for r in range(args.rounds):
        for version in sources if r % 2 == 0 else list(sources)[::-1]:
            with tempfile.TemporaryDirectory() as out:
                env = dict(os.environ, PYTHONPATH=sources[version], KVPOOL_RESULTS_DIR=out)
                subprocess.run([sys.executable, __file__, *argv], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                runs[version].append(json.loads((Path(out) / "router.json").read_text())["rows"])
    rows: list[dict[str, Any]] = []
    for i, first in enumerate(runs["baseline"][0]):
        for version, per_round in runs.items():
            row: dict[str, Any] = {"version": version}
            for k, v in first.items():
                if k == "ok":  # a round's verdict, not the median's
                    continue
                numbers = [rows_[i][k] for rows_ in per_round]
                row[k] = (statistics.median(numbers) if isinstance(v, int | float)
                          and not isinstance(v, bool) else v)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks per worker")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--tpb", type=int, default=32)
    parser.add_argument("--ingest-blocks", type=int, default=400_000)
    parser.add_argument("--only", choices=["ingest", "route"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", help="another checkout's src folder to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per version (--baseline)")
    args = parser.parse_args()
    if args.baseline:
        argv = sys.argv[1:]
        i = next(i for i, a in enumerate(argv) if a.startswith("--baseline"))
        del argv[i:i + (1 if "=" in argv[i] else 2)]
        report("router", compare(args, argv), title="kvpool router: baseline and current, "
               f"median of {args.rounds} alternating rounds", extra={"args": vars(args)})
        return
    if args.quick:
        args.workers, args.blocks, args.queries, args.ingest_blocks = 8, 10_000, 40, 40_000
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    if args.only in (None, "ingest"):
        rows += bench_ingest(args, rng)
    if args.only in (None, "route"):
        rows += bench_route(args, rng)
    report("router", rows, title="kvpool router: ingestion and decision latency",
           extra={"args": vars(args)})


if __name__ == "__main__":
    main()
