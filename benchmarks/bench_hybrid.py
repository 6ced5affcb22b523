"""Token hit rate of hybrid-model checkpoint policies at equal memory (issue 35, docs/hybrid.md).

Model: qwen3-next-80b-a3b (kvpool.planner.hybrid: 12 attention layers, 24,576 B per token;
36 gated-delta-net layers, 39.5 MB of state per sequence; vLLM's attention block for it is
544 tokens). Each workload is replayed request after request through a real KVCacheManager
whose GPU pools share one byte budget (kvpool.replay.hybrid); every mode gets its best split of
that budget between state slots and attention blocks (kvpool.replay.hybrid.SPLITS).

Workloads:
- ``short``: synthetic, 16 shared 300-token system prompts + a ~64-token question each
  (one turn), 2,000 requests, 8 GiB;
- ``conversation``: the first 4,000 requests of the Mooncake conversation trace, 40 GiB.

Modes: kvpool ``marconi`` (the default policy), kvpool ``every_block`` (tpb 16), ``align``
(vLLM's 544-token grid, the better of every boundary and last boundary), and ``attention``
(the same workload on an attention-only model, every byte for attention blocks).

Checks (exit 1 if one fails): marconi >= 3x align on ``short`` and >= 1.2x on
``conversation``; marconi >= 1.3x every_block on both; on ``short`` marconi >= 90 % of the
attention-only model's hit rate. Results: results/bench_hybrid.json.

Usage: .venv/bin/python benchmarks/bench_hybrid.py [--workload short|conversation|all]
       [--requests N] [--splits 0.2,0.5] [--modes marconi,align]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.planner.hybrid import hybrid_presets
from kvpool.replay.hybrid import SPLITS, best_split
from kvpool.replay.workloads import Request, builtin_trace, load_mooncake, synthetic_workload

GIB = 1 << 30
RUNS = (("marconi", "kvpool", "marconi"), ("every_block", "kvpool", "every_block"),
        ("align", "align", "every_block"), ("attention", "attention", "-"))


def _workload(name: str, requests: int | None) -> tuple[list[Request], int]:
    if name == "short":
        wl = synthetic_workload(num_requests=requests or 2000, system_prompt_tokens=300,
                                turns_per_conversation=1, agent_fraction=0.0, user_tokens=64,
                                output_tokens=64, num_system_prompts=16)
        return list(wl.requests), 8 * GIB
    wl = load_mooncake(builtin_trace("conversation"), limit=requests or 4000)
    return list(wl.requests), 40 * GIB


def run(name: str, requests: int | None, splits: tuple[float, ...],
        modes: tuple[str, ...]) -> dict[str, Any]:
    spec = hybrid_presets()["qwen3-next-80b-a3b"]
    reqs, budget = _workload(name, requests)
    rows: dict[str, Any] = {}
    for label, mode, policy in RUNS:
        if label not in modes:
            continue
        t = time.perf_counter()
        r = best_split(reqs, spec, budget, mode=mode, policy=policy, splits=splits)
        rows[label] = {"hit_rate": round(r.hit_rate, 4), "policy": r.policy,
                       "tokens_per_block": r.tokens_per_block,
                       "state_fraction": r.state_fraction,
                       "attention_blocks": r.attention_blocks, "state_slots": r.state_slots,
                       "seconds": round(time.perf_counter() - t, 1)}
        print(name, label, rows[label], flush=True)
    return {"workload": name, "requests": len(reqs), "budget_gib": budget // GIB, "rows": rows}


def checks(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    m = rows["marconi"]["hit_rate"]

    def ratio(other: str) -> float:
        o = rows[other]["hit_rate"]
        return float("inf") if o == 0 else m / o

    failed = []
    need_align = 3.0 if result["workload"] == "short" else 1.2
    if ratio("align") < need_align:
        failed.append(f"{result['workload']}: marconi/align {ratio('align'):.2f} < {need_align}")
    if ratio("every_block") < 1.3:
        failed.append(f"{result['workload']}: marconi/every_block {ratio('every_block'):.2f}")
    if result["workload"] == "short" and m < 0.9 * rows["attention"]["hit_rate"]:
        failed.append(f"short: marconi {m} < 90 % of attention-only")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["short", "conversation", "all"], default="all")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--modes", default=",".join(r[0] for r in RUNS),
                    help="runs to do, comma-separated (default: all four)")
    ap.add_argument("--splits", default=None,
                    help="state fractions to try, comma-separated (default: SPLITS)")
    args = ap.parse_args()
    names = ["short", "conversation"] if args.workload == "all" else [args.workload]
    out = Path(__file__).resolve().parent.parent / "results" / "bench_hybrid.json"
    merged: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    failed: list[str] = []
    for name in names:
        splits = tuple(map(float, args.splits.split(","))) if args.splits else SPLITS
        result = run(name, args.requests, splits, tuple(args.modes.split(",")))
        result["rows"] = {**merged.get(name, {}).get("rows", {}), **result["rows"]}
        merged[name] = result
        if len(result["rows"]) == len(RUNS):
            failed += checks(result)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
