"""kvpool inside vLLM 0.33, against vLLM's own policies and tiers, in one run (issue 30).

Needs vLLM 0.33's own code: ``tests/peers/install_vllm.sh .venv`` installs it (``--no-deps``).

1. Host-tier hit rate. vLLM's ``CPUPrimaryTierOffloadingManager`` (its CPU tier, on a real
   ``SharedOffloadRegion``) is driven by the chunk keys of the first 4,000 requests of the
   Mooncake conversation trace (``kvpool/data``, loaded by ``kvpool.replay.mooncake``; one
   chunk per 512-token hash id, the full chunks of each prompt), as vLLM's offloading
   scheduler drives it: ``on_new_request``; ``lookup`` of the prompt's chunks until the first
   miss; ``prepare_load``/``complete_load`` of the hit prefix; ``prepare_store``/
   ``complete_store`` of the rest; ``on_request_finished``. Hit rate = chunks hit / chunks
   looked up, for vLLM's ``lru`` and ``arc`` and kvpool's ``KvpoolLRU``, ``KvpoolTwoQ``,
   ``KvpoolS3FIFO``, ``KvpoolARC`` at the same capacities.
2. Secondary tier throughput and restart. ``KvpoolTier`` (disk) and vLLM's ``fs`` tier
   (``FileSystemTierManager``, its defaults: 16+16 threads, O_DIRECT when the file system
   takes it) on the same directory's file system, built as vLLM builds them (a real
   ``OffloadingSpec`` of a 256 KiB chunk): ``--jobs`` store jobs of 32 chunks of 256 KiB from a
   primary pool of random bytes, then loads of all of them into a zeroed pool (bytes
   compared), MB/s from first submit to ``drain_jobs``; then each tier is shut down and built
   again on its directory, and the share of stored chunks its lookups find (fs answers RETRY
   first: asked again after ``on_schedule_end`` until it answers), loads compared bit-exact.
   The page cache is not dropped between writing and reading (no privilege to), for either.
3. Calling-thread latency of ``lookup`` (per key), ``submit_store`` and ``submit_load`` (per
   32-chunk job of 256 KiB chunks), ``--latency-jobs`` jobs on a tier of 64 chunks (so
   KvpoolTier's stores evict), p50/p99/max in µs of wall time and of the calling thread's CPU
   time (``time.thread_time``: what the call itself costs, without the time the OS gave other
   processes or threads meanwhile), KvpoolTier and vLLM's fs tier in turn, job by job (both
   under the same machine load), the garbage collector on, both tiers with their defaults.

Results: results/bench_vllm_tier.json. Usage:
    python benchmarks/bench_vllm_tier.py [--requests 4000] [--capacities 4000,8000,16000]
        [--jobs 32] [--latency-jobs 300] [--parts hitrate,tier,latency] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report
from kvpool.replay.mooncake import builtin_trace, load_mooncake

try:
    from vllm.v1.kv_offload import config as vconfig
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingSpec,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager
except ImportError as exc:
    sys.exit(f"bench_vllm_tier needs vLLM 0.33's own code ({exc}): "
             "run tests/peers/install_vllm.sh .venv")

TOKENS_PER_CHUNK = 512
BIG_CHUNK = 256 << 10
JOB_CHUNKS = 32
POLICIES = [("vllm", "lru"), ("vllm", "arc"), ("kvpool", "KvpoolLRU"), ("kvpool", "KvpoolTwoQ"),
            ("kvpool", "KvpoolS3FIFO"), ("kvpool", "KvpoolARC")]


def _key(hash_id: int) -> bytes:
    return make_offload_key(hash_id.to_bytes(32, "big"), 0)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- 1. hit rate

def _hit_rate(requests: list[list[bytes]], capacity: int, source: str, policy: str
              ) -> dict[str, Any]:
    region = SharedOffloadRegion(engine_id=f"kvpool-bench-{uuid.uuid4().hex}",
                                 num_chunks=capacity, rank=None, kv_bytes_per_chunk=4096,
                                 cpu_page_size=4096)
    manager = CPUPrimaryTierOffloadingManager(
        num_chunks=capacity, mmap_region=region, cache_policy=policy,
        cache_policy_module_path="kvpool.integrations.vllm" if source == "kvpool" else None)
    looked = hits = refused = 0
    start = time.perf_counter()
    for n, keys in enumerate(requests):
        ctx = ReqContext(f"r{n}")
        manager.on_new_request(ctx)
        hit = 0
        for k in keys:
            if manager.lookup(k, ctx) is not LookupResult.HIT:
                break
            hit += 1
        looked += len(keys)
        hits += hit
        if hit:
            manager.prepare_load(keys[:hit], ctx)
            manager.complete_load(keys[:hit], ctx)
        out = manager.prepare_store(keys, ctx)  # vLLM offers all; stored ones are skipped
        if out is None:
            refused += 1
        else:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    seconds = time.perf_counter() - start
    manager.shutdown()
    return {"part": "hit rate", "capacity_chunks": capacity, "policy": f"{source}:{policy}",
            "hit_rate": round(hits / looked, 4), "chunks_looked_up": looked,
            "stores_refused": refused, "us_per_chunk": round(seconds / looked * 1e6, 2)}


def hit_rates(n_requests: int, capacities: list[int]) -> list[dict[str, Any]]:
    workload = load_mooncake(builtin_trace("conversation"), limit=n_requests)
    requests = [[_key(h) for h in (r.hash_ids or ())[:r.prompt_length // TOKENS_PER_CHUNK]]
                for r in workload.requests]
    seen: set[bytes] = set()
    repeats = 0
    for keys in requests:
        repeats += sum(k in seen for k in keys)
        seen.update(keys)
    ceiling = repeats / sum(map(len, requests))
    rows = []
    for capacity in capacities:
        runs = [_hit_rate(requests, capacity, src, pol) for src, pol in POLICIES]
        lru = next(r["hit_rate"] for r in runs if r["policy"] == "vllm:lru")
        for row in runs:
            row["vs_vllm_lru"] = round(row["hit_rate"] / lru, 3) if lru else None
            row["unlimited_ceiling"] = round(ceiling, 4)
            print(row, flush=True)
        rows += runs
    return rows


# ---------------------------------------------------------------------------- 2. tiers


class _Spec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's OffloadingSpec of one model with 256 KiB chunks (what the tiers read of it)."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


def _spec() -> _Spec:
    parallel = vconfig.OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=True)
    config = vconfig.OffloadingConfig(
        groups=(vconfig.OffloadingGroupConfig(16, tuple(f"l{i}" for i in range(32)), 0),),
        worker_kv_bytes_per_block=BIG_CHUNK // 32, enable_kv_cache_events=False,
        extra_config={}, engine_id="bench", model=vconfig.OffloadingModelConfig("bench-model",
                                                                               "bfloat16"),
        cache=vconfig.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=32),
        parallel=parallel)
    return _Spec(config)


_THREADS = [4]  # KvpoolTier's io_threads (--io-threads)


def _build(kind: str, pool: np.ndarray, directory: Path, chunks: int) -> Any:
    entry: dict[str, Any] = ({"type": "fs", "root_dir": str(directory)} if kind == "fs" else
                             {"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm",
                              "disk_path": str(directory), "disk_bytes": chunks * BIG_CHUNK,
                              "io_threads": _THREADS[0]})
    return SecondaryTierFactory.create_secondary_tier(entry, memoryview(pool), _spec())


def _jobs(tier: Any, keys: list[bytes], *, load: bool, first_id: int) -> tuple[float, int]:
    """Submit the keys as 32-chunk jobs (chunk i of the pool for key i), drain; (seconds,
    jobs that failed)."""
    ctx = ReqContext("bench")
    start = time.perf_counter()
    for j in range(0, len(keys), JOB_CHUNKS):
        job = TransferJob(first_id + j, keys[j:j + JOB_CHUNKS],
                          np.arange(j, min(j + JOB_CHUNKS, len(keys)), dtype=np.int32),
                          load, ctx)
        (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    seconds = time.perf_counter() - start
    failed = sum(not r.success for r in tier.get_finished_jobs())
    return seconds, failed


def _found_after_restart(tier: Any, keys: list[bytes]) -> int:
    ctx = ReqContext("restart")
    deadline = time.monotonic() + 60
    while True:
        results = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in results or time.monotonic() > deadline:
            return sum(r is LookupResult.HIT for r in results)
        tier.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.01)


def _pool(chunks: int) -> np.ndarray:
    """A page-aligned primary pool, as vLLM's (an mmap; O_DIRECT needs the alignment)."""
    region = mmap.mmap(-1, chunks * BIG_CHUNK)
    return np.frombuffer(region, dtype=np.int8).reshape(chunks, BIG_CHUNK)


def throughput(n_jobs: int, root: Path) -> list[dict[str, Any]]:
    chunks = n_jobs * JOB_CHUNKS
    rng = np.random.default_rng(0)
    source = rng.integers(-128, 128, (chunks, BIG_CHUNK), dtype=np.int8)
    keys = [_key(10**9 + i) for i in range(chunks)]
    rows = []
    for kind in ("fs", "KvpoolTier"):
        directory = root / kind
        pool = _pool(chunks)
        pool[:] = source
        tier = _build(kind, pool, directory, chunks)
        o_direct = getattr(tier, "_use_o_direct", None)
        store_s, store_failed = _jobs(tier, keys, load=False, first_id=0)
        pool[:] = 0
        load_s, load_failed = _jobs(tier, keys, load=True, first_id=10**6)
        exact = bool(np.array_equal(pool, source))
        tier.shutdown()
        pool[:] = 0
        again = _build(kind, pool, directory, chunks)
        found = _found_after_restart(again, keys)
        _, reload_failed = _jobs(again, keys, load=True, first_id=2 * 10**6)
        exact_after = bool(np.array_equal(pool, source))
        again.shutdown()
        mb = chunks * BIG_CHUNK / 1e6
        rows.append({"part": "tier", "tier": kind, "chunks": chunks,
                     "store_MBps": round(mb / store_s, 1), "load_MBps": round(mb / load_s, 1),
                     "failed_jobs": store_failed + load_failed, "bit_exact": exact,
                     "found_after_restart": round(found / chunks, 4),
                     "reload_failed_jobs": reload_failed, "bit_exact_after_restart": exact_after,
                     "o_direct": o_direct})
        print(rows[-1], flush=True)
        del pool
        shutil.rmtree(directory, ignore_errors=True)
    fs, kv = rows
    for name in ("store_MBps", "load_MBps"):
        kv[f"{name}_vs_fs"] = round(kv[name] / fs[name], 2)
    return rows


# ---------------------------------------------------------------------------- 3. latency

def _percentiles(samples: list[float], prefix: str) -> dict[str, float]:
    a = np.array(samples) * 1e6
    return {f"{prefix}p50_us": round(float(np.percentile(a, 50)), 1),
            f"{prefix}p99_us": round(float(np.percentile(a, 99)), 1),
            f"{prefix}max_us": round(float(a.max()), 1)}


def _timed(calls: dict[str, list[list[float]]], name: str, fn: Any, *args: Any) -> None:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn(*args)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    calls.setdefault(name, [[], []])
    calls[name][0].append(wall)
    calls[name][1].append(cpu)


def _latency_round(tier: Any, calls: dict[str, list[list[float]]], n: int) -> None:
    """One store job, the lookups of its keys, one load job of them (each drained)."""
    ctx = ReqContext("latency")
    ids = np.arange(JOB_CHUNKS, dtype=np.int32)
    keys = [_key(n * JOB_CHUNKS + i) for i in range(JOB_CHUNKS)]
    _timed(calls, "submit_store", tier.submit_store, TransferJob(2 * n, keys, ids, False, ctx))
    tier.drain_jobs()
    tier.get_finished_jobs()
    tier.on_schedule_end(ScheduleEndContext((), ()))
    for k in keys:
        _timed(calls, "lookup", tier.lookup, k, ctx)
    _timed(calls, "submit_load", tier.submit_load, TransferJob(2 * n + 1, keys, ids, True, ctx))
    tier.drain_jobs()
    tier.get_finished_jobs()


def latency(n_jobs: int, root: Path) -> list[dict[str, Any]]:
    """Both tiers in turn, job by job (A/B under the same machine load), GC on."""
    kinds = ("KvpoolTier", "fs")
    pools = {kind: _pool(JOB_CHUNKS) for kind in kinds}
    tiers = {}
    for kind in kinds:
        pools[kind][:] = np.random.default_rng(1).integers(-128, 128, pools[kind].shape,
                                                           dtype=np.int8)
        tiers[kind] = _build(kind, pools[kind], root / f"latency-{kind}", 2 * JOB_CHUNKS)
    calls: dict[str, dict[str, list[list[float]]]] = {kind: {} for kind in kinds}
    for n in range(n_jobs):
        for kind in kinds if n % 2 else kinds[::-1]:
            _latency_round(tiers[kind], calls[kind], n)
    for tier in tiers.values():
        tier.shutdown()
    return [{"part": "latency", "tier": kind, "call": name, "samples": len(wall),
             **_percentiles(wall, ""), **_percentiles(cpu, "cpu_")}
            for kind in kinds for name, (wall, cpu) in calls[kind].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--capacities", default="4000,8000,16000")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--latency-jobs", type=int, default=300)
    parser.add_argument("--parts", default="hitrate,tier,latency")
    parser.add_argument("--io-threads", type=int, default=_THREADS[0],
                        help="KvpoolTier's io_threads")
    parser.add_argument("--dir", default=None, help="where the tiers write (default: a temp "
                                                    "directory under the current one)")
    args = parser.parse_args()
    _THREADS[0] = args.io_threads
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-tier-", dir=args.dir or "."))
    try:
        parts = args.parts.split(",")
        rows = []
        if "hitrate" in parts:
            rows += hit_rates(args.requests, [int(c) for c in args.capacities.split(",")])
        if "tier" in parts:
            rows += throughput(args.jobs, root)
        if "latency" in parts:
            rows += latency(args.latency_jobs, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report("bench_vllm_tier", rows, title="kvpool in vLLM 0.33: host-tier policies, tiers",
           extra={"requests": args.requests, "chunk_bytes": BIG_CHUNK, "dir": str(root)})


if __name__ == "__main__":
    main()
