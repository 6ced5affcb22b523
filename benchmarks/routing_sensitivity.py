"""Routing sensitivity: hit rate and TTFT of ``cost`` routing across load weights and cluster
sizes, next to TensorRT-LLM's score (``trtllm``) and the event-less ``approx`` mode.

Replays the built-in synthetic workload (``kvpool replay``'s default: 2,000 requests, Llama-3-8B
geometry, 8 GiB of GPU KV per worker, no host tier) on 2, 4 and 8 workers; per cluster size
once with ``trtllm``, once with ``approx`` (default weights, no events at all) and once with
``cost`` per ``--load-weights`` value (the weight of a worker's queued prefill tokens, see
:mod:`kvpool.router.scoring`). The replay is deterministic: the numbers depend only on the
workload, the configuration and the code. One plot (``--plot``, default
``docs/routing_sensitivity.png``): token hit rate, TTFT p50 and TTFT p99 against the load
weight, one colour per cluster size, ``trtllm`` as a dashed line of the same colour.

    .venv/bin/python benchmarks/routing_sensitivity.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.planner import ModelSpec
from kvpool.replay.cluster import ClusterConfig, planned_cache, replay_policy
from kvpool.replay.engine_sim import SchedulerConfig
from kvpool.replay.report import summarize
from kvpool.replay.workloads import SyntheticParams, Workload, generate_synthetic
from kvpool.router.scoring import DEFAULT_LOAD_WEIGHT

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _config(workload: Workload, workers: int, options: dict[str, Any]) -> ClusterConfig:
    model = ModelSpec.preset("llama-3-8b")
    longest = max(len(r.tokens) + r.output_length for r in workload.requests)
    cache, _ = planned_cache(
        model, gpu_bytes=8 << 30, tokens_per_block=32, scheduler=SchedulerConfig(),
        max_seq_len=max(model.max_seq_len, longest),
    )
    return ClusterConfig(cache=cache, workers=workers, router_options=options)


def _run(workload: Workload, workers: int, policy: str, weight: float | None) -> dict[str, Any]:
    options = {} if weight is None else {"load_weight": weight}
    s = summarize(replay_policy(workload, _config(workload, workers, options), policy))
    return {
        "workers": workers,
        "policy": policy,
        "load_weight": weight,
        "token_hit_%": 100 * s["token_hit_rate"],
        "of_belady_%": 100 * s["vs_bounds"]["of_belady"],
        "ttft_p50_ms": 1e3 * s["ttft_s"]["p50"],
        "ttft_p99_ms": 1e3 * s["ttft_s"]["p99"],
    }


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("token_hit_%", "token hit rate (%)"), ("ttft_p50_ms", "TTFT p50 (ms)"),
               ("ttft_p99_ms", "TTFT p99 (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    sizes = sorted({r["workers"] for r in rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, n in enumerate(sizes):
        c = colours[k % len(colours)]
        cost = sorted((r for r in rows if r["workers"] == n and r["policy"] == "cost"),
                      key=lambda r: r["load_weight"])
        trt = next(r for r in rows if r["workers"] == n and r["policy"] == "trtllm")
        xs = [max(r["load_weight"], 0.01) for r in cost]  # 0 sits at the left edge
        for ax, (key, label) in zip(axes, metrics, strict=True):
            ax.plot(xs, [r[key] for r in cost], marker="o", color=c, label=f"cost, {n} workers")
            ax.axhline(trt[key], color=c, linestyle="--", linewidth=1,
                       label=f"trtllm, {n} workers")
            ax.set_xscale("log")
            ax.set_xlabel("load_weight (queued prefill tokens)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
    for ax in axes:
        ax.axvline(DEFAULT_LOAD_WEIGHT, color="grey", linewidth=0.8, linestyle=":")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=1)
    fig.suptitle("kvpool replay, synthetic workload: cost routing vs load weight "
                 "(dotted: the default)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4,8", help="cluster sizes (comma-separated)")
    ap.add_argument("--load-weights", default="0,0.05,0.1,0.25,0.5,1,2",
                    help="load weights of the cost policy (comma-separated)")
    ap.add_argument("--plot", type=Path, default=DOCS / "routing_sensitivity.png")
    ap.add_argument("--quick", action="store_true", help="300 requests, 2 and 4 workers")
    args = ap.parse_args()
    params = SyntheticParams(num_requests=300) if args.quick else SyntheticParams()
    workload = generate_synthetic(params)
    sizes = [2, 4] if args.quick else [int(x) for x in args.workers.split(",")]
    weights = [float(x) for x in args.load_weights.split(",")]
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rows.append(_run(workload, n, "trtllm", None))
        rows.append(_run(workload, n, "approx", None))
        rows.extend(_run(workload, n, "cost", w) for w in weights)
    report("routing_sensitivity", rows, title="cost routing vs load weight and cluster size",
           extra={"workload": dataclasses.asdict(params)})
    if not args.quick:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
