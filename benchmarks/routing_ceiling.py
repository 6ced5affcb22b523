"""What perfect routing could reuse on the conversation trace: one cache of the whole cluster.

``kvpool replay`` on the first 4,000 requests of the conversation trace (README) compares each
routing policy with the Belady bound of the cluster's total capacity (4 workers x 10,240 GPU +
51,200 host blocks of 32 tokens = 245,760 blocks). That bound evicts with foresight and credits
blocks wherever they are. This script separates what routing can still gain from what only
eviction could: it admits the same requests, in arrival order, into ONE kvpool manager with
the cluster's total capacity (the routing no router can beat: every request finds every block
the cluster holds, and nothing is cached twice) under each engine eviction policy, with
``--held`` requests running at once (the W2 admission loop of ``bench_hitrate.py``), and prints
its token hit rate next to the Belady bound and the unlimited cache on the same stream.

    .venv/bin/python benchmarks/routing_ceiling.py [--limit 4000] [--held 128]
        [--policies 2q,lru]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hitrate
from common import report
from kvpool.replay.bounds import belady_hit_rate, request_block_keys, unlimited_hit_rate
from kvpool.replay.workloads import builtin_trace, load_mooncake

WORKERS = 4
GPU_BLOCKS = 10_240  # 40 GiB of Llama-3-8B KV per worker in blocks of 32 tokens
HOST_BLOCKS = 51_200  # 200 GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4000, help="first N requests of the trace")
    ap.add_argument("--held", type=int, default=128, help="requests running at once")
    ap.add_argument("--policies", default="2q,lru", help="eviction policies (comma-separated)")
    args = ap.parse_args()
    bench_hitrate.HELD = args.held
    wl = load_mooncake(builtin_trace("conversation"), limit=args.limit)
    gpu, host = WORKERS * GPU_BLOCKS, WORKERS * HOST_BLOCKS
    stream = request_block_keys(wl, bench_hitrate.TPB)
    belady = belady_hit_rate(stream, gpu + host, bypass=True).token_hit_rate
    rows = [{"cache": "unlimited", "token_hit_%": 100 * unlimited_hit_rate(stream).token_hit_rate,
             "of_belady_%": None},
            {"cache": "belady", "token_hit_%": 100 * belady, "of_belady_%": 100.0}]
    for policy in args.policies.split(","):
        r = bench_hitrate.replay(wl, policy, gpu, host, "all")
        rows.append({"cache": f"one {policy} cache", "token_hit_%": 100 * r["token_hit_rate"],
                     "of_belady_%": 100 * r["token_hit_rate"] / belady})
    report("routing_ceiling", rows,
           title=f"one cache of {WORKERS} workers' capacity ({gpu:,} GPU + {host:,} host "
                 f"blocks), first {args.limit:,} requests, {args.held} running",
           extra={"limit": args.limit, "held": args.held})


if __name__ == "__main__":
    main()
