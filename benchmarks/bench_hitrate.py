"""Prefix-cache hit rate of every eviction policy on the Mooncake conversation trace (W2).

Replay (W2 of bench_admission.py): the first 4,000 requests of the conversation trace
(``--full``: all of it), tokens synthesised per hash id (512 tokens per id), tpb 32. Each
request is admitted in trace order with ``add_sequence``, its context blocks are stored, and
it is held while the next 31 are admitted (32 active); a request that does not fit releases
the oldest held request early and retries. Every policy of ``kvpool.eviction.POLICIES`` runs
GPU only (20,000 blocks) and tiered (20,000 GPU + 30,000 host blocks) with the offload gate
``all`` and ``reused``; a sweep (GPU only, 5k..100k blocks) draws block hit rate against
capacity per policy (results/bench_hitrate.png).

Per run: token and block hit rates (``manager.stats()``) overall and per tier (full blocks
claimed from that tier), the ratio to LRU's token hit rate in the same configuration, the
fraction of the offline bound reached, the unlimited-cache ceiling, and the replay's cost in
µs (wall and CPU) per prompt block (every manager call, hashing included).

Bounds (``kvpool.replay.bounds``), on the same block stream (every full block of every prompt
minus its last token, in arrival order): ``belady`` is Belady's offline optimum (on a miss,
evict the cached block whose next use is farthest; every miss admitted) for a cache of the
run's total capacity (GPU + host), each block independent: no prefix constraint and no slots
pinned by running requests, so no cache of that size can beat it on this stream.
``unlimited`` = every repeat access hits.

Results merge into results/bench_hitrate.json (rows keyed by policy and configuration) and
results/bench_hitrate_sweep.json, so the work can be split (``--part``, ``--policies``) into
runs that each fit a time limit; the plot is redrawn from everything merged so far.

Usage: .venv/bin/python benchmarks/bench_hitrate.py [--quick] [--full] [--part all|table|sweep]
       [--policies lru,arc] [--trace PATH]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, report
from kvpool.config import CacheConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.eviction import POLICIES
from kvpool.hashing.keys import HashAlgo
from kvpool.replay.bounds import (
    BlockStream,
    belady_hit_rate,
    request_block_keys,
    unlimited_hit_rate,
)
from kvpool.replay.workloads import Workload, builtin_trace, load_mooncake

TPB = 32
HELD = 32
ALGO = HashAlgo.V2_SHA256
TRACE = builtin_trace("conversation")  # shipped in kvpool/data
GPU_BLOCKS = 20_000
HOST_BLOCKS = 30_000
CONFIGS = ((0, "all"), (HOST_BLOCKS, "all"), (HOST_BLOCKS, "reused"))
SWEEP = (5_000, 10_000, 20_000, 35_000, 50_000, 75_000, 100_000)
SWEEP_QUICK = (5_000, 20_000, 50_000)


def replay(wl: Workload, policy: str, gpu: int, host: int, gate: str,
           **config: Any) -> dict[str, Any]:
    """Run the W2 admission loop through a fresh manager (``config``: more CacheConfig
    fields); returns its stats and cost."""
    m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=gpu, host_blocks=host,
                                   hash_algo=ALGO, **config,
                                   eviction=EvictionConfig(policy=policy, offload_gate=gate)))
    held: collections.deque[int] = collections.deque()
    early = 0
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    c0 = time.process_time()
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
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    gc.enable()
    st = m.stats()
    looked_up = st.reused + st.missed
    blocks = sum(-(-len(r.tokens) // TPB) for r in wl.requests)
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
        "us_per_block": wall / blocks * 1e6, "cpu_us_per_block": cpu / blocks * 1e6,
    })
    return row


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["policy"], row["gpu_blocks"], row["host_blocks"], row["gate"])


def _load(path: Path, workload: str) -> dict[str, Any]:
    """Earlier results of the same workload (a run merges into them), or nothing."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if data.get("workload") == workload else {}


def table(wl: Workload, stream: BlockStream, policies: list[str],
          earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    unlimited = unlimited_hit_rate(stream).block_hit_rate
    bounds = {c: belady_hit_rate(stream, c).block_hit_rate
              for c in {GPU_BLOCKS + host for host, _ in CONFIGS}}
    rows = {_key(r): r for r in earlier}
    for host, gate in CONFIGS:
        for policy in policies:
            row = replay(wl, policy, GPU_BLOCKS, host, gate)
            row["belady_block_hit_rate"] = bounds[GPU_BLOCKS + host]
            row["unlimited_block_hit_rate"] = unlimited
            rows[_key(row)] = row
            print(f"  {policy:7} host={host:6} gate={gate:6} token hit "
                  f"{row['token_hit_rate']:.4f}  ({row['us_per_block']:.1f} us/block)",
                  flush=True)
    out = sorted(rows.values(), key=lambda r: (r["host_blocks"], r["gate"],
                                               r["policy"] != "lru", r["policy"]))
    for row in out:
        row["frac_of_belady"] = row["block_hit_rate"] / row["belady_block_hit_rate"]
        lru = rows.get(("lru", row["gpu_blocks"], row["host_blocks"], row["gate"]))
        if lru is not None:
            row["token_hit_vs_lru"] = row["token_hit_rate"] / lru["token_hit_rate"]
            row["us_per_block_vs_lru"] = row["cpu_us_per_block"] / lru["cpu_us_per_block"]
    return out


def sweep(wl: Workload, stream: BlockStream, policies: list[str],
          capacities: tuple[int, ...], earlier: dict[str, Any]) -> dict[str, Any]:
    if earlier.get("capacities") != list(capacities):
        earlier = {}
    data: dict[str, Any] = {
        "capacities": list(capacities),
        "belady": earlier.get("belady")
        or [belady_hit_rate(stream, c).block_hit_rate for c in capacities],
        "unlimited": unlimited_hit_rate(stream).block_hit_rate,
        "policies": dict(earlier.get("policies", {})),
    }
    for policy in policies:
        rates = []
        for c in capacities:
            row = replay(wl, policy, c, 0, "all")
            rates.append(row["block_hit_rate"])
            print(f"  sweep {policy:7} {c:7} block hit {row['block_hit_rate']:.4f}", flush=True)
        data["policies"][policy] = rates
    return data


def plot(data: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [c / 1000 for c in data["capacities"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for policy in sorted(data["policies"], key=lambda p: (p != "lru", p)):
        ax.plot(caps, [100 * r for r in data["policies"][policy]], marker="o", label=policy)
    ax.plot(caps, [100 * r for r in data["belady"]], "k--", label="Belady (offline bound)")
    ax.axhline(100 * data["unlimited"], color="grey", linestyle=":", label="unlimited cache")
    ax.set_xlabel(f"GPU blocks (thousands; {HELD} requests active)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
                    help=f"comma-separated, from {sorted(POLICIES)}")
    ap.add_argument("--part", choices=["all", "table", "sweep"], default="all")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        ap.error(f"unknown policies {unknown}; expected some of {sorted(POLICIES)}")
    limit = None if args.full else (800 if args.quick else 4000)
    wl = load_mooncake(args.trace, limit=limit)
    stream = request_block_keys(wl, TPB)
    label = f"{len(wl)} requests of {args.trace.name.removesuffix('.gz')}"
    suffix = "_quick" if args.quick else "_full" if args.full else ""
    extra = {"workload": label, "held": HELD, "tokens_per_block": TPB,
             "bound": "belady = offline optimum of GPU+host blocks, no prefix constraint"}
    if args.part in ("all", "table"):
        path = RESULTS_DIR / f"bench_hitrate{suffix}.json"
        rows = table(wl, stream, policies, _load(path, label).get("rows", []))
        report(f"bench_hitrate{suffix}", rows,
               title=f"kvpool eviction policies: {label} (tpb {TPB}, {HELD} active)",
               extra=extra)
    if args.part in ("all", "sweep"):
        path = RESULTS_DIR / f"bench_hitrate_sweep{suffix}.json"
        data = sweep(wl, stream, policies, SWEEP_QUICK if args.quick else SWEEP,
                     _load(path, label).get("sweep", {}))
        rows = [{"policy": p, **{f"{c // 1000}k": r for c, r in zip(data["capacities"], rates,
                                                                    strict=True)}}
                for p, rates in data["policies"].items()]
        rows.append({"policy": "belady", **{f"{c // 1000}k": r for c, r in
                                            zip(data["capacities"], data["belady"], strict=True)}})
        report(f"bench_hitrate_sweep{suffix}", rows,
               title=f"block hit rate vs GPU blocks: {label}", extra={**extra, "sweep": data})
        plot(data, RESULTS_DIR / f"bench_hitrate{suffix}.png",
             f"Block hit rate vs capacity, {label}")


if __name__ == "__main__":
    main()
