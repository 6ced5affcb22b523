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

``--trace FILE --limit N`` adds a series on a Mooncake trace: 4 workers with 40 GiB of GPU and
200 GiB of host KV each (the README's trace configuration), where the cluster is saturated and
the load weight matters. ``--jobs`` replays that many runs at once (processes).

    .venv/bin/python benchmarks/routing_sensitivity.py [--quick] [--trace FILE --limit 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.planner.capacity import ModelSpec
from kvpool.replay.cluster import ClusterConfig, planned_cache, replay_policy
from kvpool.replay.report import summarize
from kvpool.replay.simmodel import SchedulerConfig
from kvpool.replay.workloads import SyntheticParams, Workload, generate_synthetic, load_mooncake
from kvpool.router.scoring import DEFAULT_LOAD_WEIGHT

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _config(
    workload: Workload, workers: int, options: dict[str, Any], gpu: int, host: int
) -> ClusterConfig:
    model = ModelSpec.preset("llama-3-8b")
    longest = max(len(r.tokens) + r.output_length for r in workload.requests)
    cache, _ = planned_cache(
        model, gpu_bytes=gpu, host_bytes=host, tokens_per_block=32, scheduler=SchedulerConfig(),
        max_seq_len=max(model.max_seq_len, longest),
    )
    return ClusterConfig(cache=cache, workers=workers, router_options=options)


_WORKLOADS: dict[str, Workload] = {}


def _run(series: str, workers: int, policy: str, weight: float | None) -> dict[str, Any]:
    """One replay; ``series`` is "synthetic" or a trace path (``_WORKLOADS`` holds both)."""
    workload = _WORKLOADS[series]
    gpu, host = (8 << 30, 0) if series == "synthetic" else (40 << 30, 200 << 30)
    options = {} if weight is None else {"load_weight": weight}
    s = summarize(replay_policy(workload, _config(workload, workers, options, gpu, host),
                                policy))
    return {
        "series": "synthetic" if series == "synthetic" else "trace",
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
    groups = sorted({(r["series"], r["workers"]) for r in rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (series, n) in enumerate(groups):
        c = colours[k % len(colours)]
        mine = [r for r in rows if (r["series"], r["workers"]) == (series, n)]
        cost = sorted((r for r in mine if r["policy"] == "cost"), key=lambda r: r["load_weight"])
        trt = next(r for r in mine if r["policy"] == "trtllm")
        xs = [max(r["load_weight"], 0.005) for r in cost]  # 0 sits at the left edge
        name = f"{series}, {n} workers"
        for ax, (key, label) in zip(axes, metrics, strict=True):
            ax.plot(xs, [r[key] for r in cost], marker="o", color=c, label=f"cost, {name}")
            ax.axhline(trt[key], color=c, linestyle="--", linewidth=1,
                       label=f"trtllm, {name}")
            ax.set_xscale("log")
            ax.set_xlabel("load_weight (queued prefill tokens)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
    for ax in axes:
        ax.axvline(DEFAULT_LOAD_WEIGHT, color="grey", linewidth=0.8, linestyle=":")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=1)
    fig.suptitle("kvpool replay: cost routing vs load weight, trtllm dashed "
                 "(dotted: the default weight; 0 plotted at the left edge)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4,8", help="cluster sizes (comma-separated)")
    ap.add_argument("--load-weights", default="0,0.02,0.1,0.5,2",
                    help="load weights of the cost policy (comma-separated)")
    ap.add_argument("--trace", type=Path, help="also sweep a Mooncake trace on 4 workers")
    ap.add_argument("--limit", type=int, default=2000, help="first N requests of --trace")
    ap.add_argument("--jobs", type=int, default=1, help="replays at once (processes)")
    ap.add_argument("--plot", type=Path, default=DOCS / "routing_sensitivity.png")
    ap.add_argument("--quick", action="store_true", help="300 requests, 2 and 4 workers")
    args = ap.parse_args()
    params = SyntheticParams(num_requests=300) if args.quick else SyntheticParams()
    _WORKLOADS["synthetic"] = generate_synthetic(params)
    sizes = [2, 4] if args.quick else [int(x) for x in args.workers.split(",")]
    weights = [float(x) for x in args.load_weights.split(",")]
    runs: list[tuple[str, int, str, float | None]] = []
    series = [("synthetic", n) for n in sizes]
    if args.trace is not None:
        _WORKLOADS[str(args.trace)] = load_mooncake(args.trace, limit=args.limit)
        series.append((str(args.trace), 4))
    for name, n in series:
        runs.append((name, n, "trtllm", None))
        runs.append((name, n, "approx", None))
        runs.extend((name, n, "cost", w) for w in weights)
    if args.jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            rows = list(pool.map(_run_args, runs))
    else:
        rows = [_run(*r) for r in runs]
    report("routing_sensitivity", rows, title="cost routing vs load weight and cluster size",
           extra={"workload": dataclasses.asdict(params), "trace": str(args.trace or ""),
                  "trace_limit": args.limit if args.trace else None})
    if not args.quick:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")


def _run_args(run: tuple[str, int, str, float | None]) -> dict[str, Any]:
    return _run(*run)


if __name__ == "__main__":
    main()
