"""Prefix-cache hit rate of every eviction policy on the Mooncake conversation trace (W2).

Replay (as W2 of bench_admission.py): the first 4,000 requests of the conversation trace
(``--full``: all of it), tokens synthesised per hash id (512 tokens per id), tpb 32. Each
request is admitted in trace order with ``add_sequence``, its context blocks are stored, and
it is held while the next 31 are admitted; a request that does not fit releases the oldest
held request early and retries. Every policy of ``kvpool.eviction.POLICIES`` runs in three
configurations: GPU only (20,000 blocks), and tiered (20,000 GPU + 30,000 host) with the
offload gate ``all`` and ``reused``. A capacity sweep (GPU only, 5k..100k blocks) draws hit
rate against capacity per policy (results/bench_hitrate.png).

Reported per run: token and block hit rates (``manager.stats()``), per tier (full-block hits
claimed from that tier), the fraction of the offline bound reached, the unlimited-cache
ceiling, and the replay cost in µs per prompt block (manager calls including hashing, and
excluding the time the same block keys take to hash alone).

Bounds (``kvpool.replay.bounds``) are computed on the same block stream: every full block of
every prompt minus its last token, in arrival order. ``belady`` = Belady's offline optimum
(evict the block used farthest in the future, admit every miss) for a cache of the run's
total capacity (GPU + host), each block independent (no prefix constraint, no pinned running
requests): an upper bound on the block hits of any cache of that size on this stream.
``unlimited`` = every repeat access hits.

Usage: python benchmarks/bench_hitrate.py [--quick] [--full] [--skip-sweep] [--sweep-only]
       [--policies lru,s3fifo] [--trace PATH]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, report
from kvpool.config import CacheConfig, SequenceRequest
from kvpool.errors import OutOfBlocksError
from kvpool.eviction import POLICIES
from kvpool.hashing import BlockHasher, HashAlgo
from kvpool.manager import KVCacheManager
from kvpool.replay.bounds import (
    BlockStream,
    belady_hit_rate,
    request_block_keys,
    unlimited_hit_rate,
)
from kvpool.replay.workloads import Workload, load_mooncake

TPB = 32
HELD = 32
ALGO = HashAlgo.V2_SHA256
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
GPU_BLOCKS = 20_000
HOST_BLOCKS = 30_000
SWEEP = (5_000, 10_000, 20_000, 35_000, 50_000, 75_000, 100_000)
SWEEP_QUICK = (5_000, 20_000, 50_000)


def replay(wl: Workload, policy: str, gpu: int, host: int, gate: str) -> dict[str, Any]:
    """Run the W2 admission loop through a fresh manager; returns its stats and cost."""
    m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=gpu, host_blocks=host,
                                   hash_algo=ALGO, eviction_policy=policy, offload_gate=gate))
    held: collections.deque[int] = collections.deque()
    early = 0
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    for i, r in enumerate(wl.requests):
        while True:
            try:
                m.add_sequence(SequenceRequest(i, r.tokens))
                break
            except OutOfBlocksError:
                if not held:
                    raise
                m.remove_sequence(held.popleft())
                early += 1
        m.store_context_blocks(i, len(r.tokens))
        held.append(i)
        if len(held) >= HELD:
            m.remove_sequence(held.popleft())
    while held:
        m.remove_sequence(held.popleft())
    total = time.perf_counter() - t0
    gc.enable()
    st = m.stats()
    looked_up = st.reused + st.missed
    row: dict[str, Any] = {
        "policy": policy, "gpu_blocks": gpu, "host_blocks": host,
        "gate": gate if host else "-",
        "token_hit_rate": st.token_hit_rate, "block_hit_rate": st.hit_rate,
    }
    for t, name in enumerate(("gpu", "host")[: 2 if host else 1]):
        row[f"{name}_block_hit_rate"] = st.tier_hits[t] / looked_up if looked_up else 0.0
        row[f"{name}_token_hit_rate"] = st.tier_hits[t] * TPB / st.prompt_tokens
    row.update({
        "offloaded": st.offload_blocks, "dropped": st.dropped_blocks, "early_releases": early,
        "replay_s": total,
    })
    return row


def hashing_time(wl: Workload) -> float:
    """Time to compute the keys the replay computes (prompt minus last token, then the rest)."""
    t0 = time.perf_counter()
    for r in wl.requests:
        h = BlockHasher(ALGO, TPB)
        h.extend(r.tokens[: len(r.tokens) - 1])
        h.extend(r.tokens[len(r.tokens) - 1:])
    return time.perf_counter() - t0


def prompt_blocks(wl: Workload) -> int:
    return sum(-(-len(r.tokens) // TPB) for r in wl.requests)


def main_table(wl: Workload, stream: BlockStream, policies: list[str]) -> list[dict[str, Any]]:
    unlimited = unlimited_hit_rate(stream)
    bounds = {c: belady_hit_rate(stream, c) for c in (GPU_BLOCKS, GPU_BLOCKS + HOST_BLOCKS)}
    hashing = hashing_time(wl)
    blocks = prompt_blocks(wl)
    rows: list[dict[str, Any]] = []
    for host, gate in ((0, "all"), (HOST_BLOCKS, "all"), (HOST_BLOCKS, "reused")):
        base: dict[str, Any] | None = None
        for policy in policies:
            row = replay(wl, policy, GPU_BLOCKS, host, gate)
            bound = bounds[GPU_BLOCKS + host]
            row["belady_block_hit_rate"] = bound.block_hit_rate
            row["frac_of_belady"] = row["block_hit_rate"] / bound.block_hit_rate
            row["unlimited_block_hit_rate"] = unlimited.block_hit_rate
            row["us_per_block"] = row["replay_s"] / blocks * 1e6
            row["us_per_block_excl_hash"] = (row["replay_s"] - hashing) / blocks * 1e6
            if policy == "lru":
                base = row
            if base is not None:
                row["token_hit_vs_lru"] = row["token_hit_rate"] / base["token_hit_rate"]
            rows.append(row)
            print(f"  {policy:7} host={host:6} gate={gate:6} token hit "
                  f"{row['token_hit_rate']:.4f} block hit {row['block_hit_rate']:.4f} "
                  f"({row['replay_s']:.1f} s)", flush=True)
    return rows


def sweep(wl: Workload, stream: BlockStream, policies: list[str],
          capacities: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "capacities": list(capacities),
        "belady": [belady_hit_rate(stream, c).block_hit_rate for c in capacities],
        "unlimited": unlimited_hit_rate(stream).block_hit_rate,
        "policies": {},
    }
    for policy in policies:
        rates = []
        for c in capacities:
            row = replay(wl, policy, c, 0, "all")
            rates.append(row["block_hit_rate"])
            print(f"  sweep {policy:7} {c:7} block hit {row['block_hit_rate']:.4f}", flush=True)
        out["policies"][policy] = rates
    return out


def plot(data: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [c / 1000 for c in data["capacities"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rates in data["policies"].items():
        ax.plot(caps, [100 * r for r in rates], marker="o", label=policy)
    ax.plot(caps, [100 * r for r in data["belady"]], "k--", label="Belady (offline bound)")
    ax.axhline(100 * data["unlimited"], color="grey", linestyle=":", label="unlimited cache")
    ax.set_xlabel("GPU blocks (thousands; 32 requests held)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="800 requests, 3 sweep capacities")
    ap.add_argument("--full", action="store_true", help="replay the whole trace")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, from {sorted(POLICIES)} (lru first is the baseline)")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        ap.error(f"unknown policies {unknown}; expected some of {sorted(POLICIES)}")
    limit = None if args.full else (800 if args.quick else 4000)
    wl = load_mooncake(args.trace, limit=limit)
    stream = request_block_keys(wl, TPB)
    label = f"{len(wl)} requests of {args.trace.name}"
    extra: dict[str, Any] = {"workload": label, "held": HELD, "tokens_per_block": TPB}
    rows: list[dict[str, Any]] = []
    if not args.sweep_only:
        rows = main_table(wl, stream, policies)
    if not args.skip_sweep:
        data = sweep(wl, stream, policies, SWEEP_QUICK if args.quick else SWEEP)
        extra["sweep"] = data
        plot(data, RESULTS_DIR / "bench_hitrate.png", f"Block hit rate vs capacity: {label}")
    name = "bench_hitrate" + ("_sweep" if args.sweep_only else "")
    report(name, rows, title=f"kvpool eviction policies: {label} (tpb 32, {HELD} held)",
           extra=extra)


if __name__ == "__main__":
    main()
