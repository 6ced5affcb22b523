"""What a replay reports: per-policy summaries, a rich table, markdown, JSON and a plot.

:func:`summarize` turns a :class:`~kvpool.replay.cluster.PolicyResult` into a JSON-able dict.
Every value that depends on wall-clock time sits under a ``"wall"`` key (the replay's own
results are deterministic: equal workloads, configurations and seeds give equal summaries once
the ``"wall"`` entries are dropped, see :func:`strip_wall`).

Definitions (over the requests that were not rejected):

* token hit rate = tokens reused at first admission / prompt tokens (whole and partial
  blocks, any tier); the per-tier rates split it by the tier the blocks were found on;
* full-block hit rate = the whole-block part: what the bounds (which count whole blocks)
  compare with; ``belady`` is the run's own Belady bound (see :mod:`kvpool.replay.cluster`)
  and ``of_belady`` = full-block hit rate / that bound;
* prefill computed = every prompt token computed, recomputation after preemption included;
* TTFT = first token time - arrival (queueing included); throughput = output tokens /
  makespan (first arrival to last finish).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvpool import __version__
from kvpool.errors import KVPoolError
from kvpool.replay.bounds import HitRateBound
from kvpool.replay.cluster import PolicyResult, ReplayResult
from kvpool.replay.simmodel import reference_group

__all__ = [
    "TIMELINE_BINS",
    "best_marks",
    "fmt_ms",
    "fmt_pct",
    "render",
    "strip_wall",
    "summarize",
    "to_json",
    "to_markdown",
    "wrap_phrases",
    "write_plot",
]

TIMELINE_BINS: Final = 24
"""Arrival-time bins of the timeline (hit rate and TTFT over time)."""

_TIERS: Final = ("gpu", "host", "disk")


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


def _as_int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _timeline(result: PolicyResult, start: float, width: float) -> dict[str, Any]:
    hits = np.zeros(TIMELINE_BINS)
    prompts = np.zeros(TIMELINE_BINS)
    ttfts: list[list[float]] = [[] for _ in range(TIMELINE_BINS)]
    for r in result.records:
        if r.rejected or r.first_token_s is None:
            continue
        b = min(int((r.arrival_s - start) / width), TIMELINE_BINS - 1) if width > 0 else 0
        hits[b] += r.reused_tokens
        prompts[b] += r.prompt_tokens
        ttfts[b].append(r.first_token_s - r.arrival_s)
    return {
        "start_s": start,
        "bin_s": width,
        "requests": [len(t) for t in ttfts],
        "token_hit_rate": [
            _rate(h, p) for h, p in zip(hits.tolist(), prompts.tolist(), strict=True)
        ],
        "ttft_p50_s": [float(np.median(t)) if t else None for t in ttfts],
    }


def summarize(
    result: PolicyResult, bounds: Mapping[str, HitRateBound] | None = None
) -> dict[str, Any]:
    """The JSON-able summary of one policy's replay (see the module docstring)."""
    done = result.finished
    prompt = sum(r.prompt_tokens for r in done)
    reused = sum(r.reused_tokens for r in done)
    full = sum(r.reused_full_tokens for r in done)
    partial = sum(r.reused_partial_tokens for r in done)
    tiers = [sum(r.tier_tokens[t] for r in done) for t in range(3)]
    makespan = result.makespan_s
    out_tokens = sum(r.output_tokens for r in done)
    cache_totals: dict[str, int] = {}
    for key in ("evicted_blocks", "dropped_blocks", "offload_blocks", "onboard_blocks"):
        cache_totals[key] = sum(_as_int(w.cache_stats[key]) for w in result.workers)
    arrivals = [r.arrival_s for r in result.records]
    start = min(arrivals) if arrivals else 0.0
    width = (max(arrivals) - start) / TIMELINE_BINS if arrivals else 0.0
    full_rate = _rate(full, prompt)
    vs: dict[str, float] = {}
    for name, b in {**(bounds or {}), "belady": result.belady}.items():
        vs[f"{name}_token_hit_rate"] = b.token_hit_rate
        vs[f"of_{name}"] = _rate(full_rate, b.token_hit_rate)
    lat = result.decision_latency_s
    summary: dict[str, Any] = {
        "policy": result.policy,
        "requests": len(result.records),
        "finished": len(done),
        "rejected": len(result.records) - len(done),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "reused_full_tokens": full,
        "reused_partial_tokens": partial,
        "token_hit_rate": _rate(reused, prompt),
        "full_block_hit_rate": full_rate,
        "tier_hit_rate": {name: _rate(tiers[t], prompt) for t, name in enumerate(_TIERS)},
        "remote_tokens": sum(r.remote_tokens for r in done),
        "remote_hit_rate": _rate(sum(r.remote_tokens for r in done), prompt),
        "prefill_tokens_computed": sum(r.computed_tokens for r in done),
        "preemptions": sum(r.preemptions for r in done),
        "ttft_s": _percentiles([r.first_token_s - r.arrival_s for r in done
                                if r.first_token_s is not None]),
        "e2e_s": _percentiles([r.finish_s - r.arrival_s for r in done if r.finish_s is not None]),
        "makespan_s": makespan,
        "gpu_busy": _rate(sum(w.busy_s for w in result.workers),
                          makespan * len(result.workers)),
        "throughput": {
            "output_tokens_per_s": _rate(out_tokens, makespan),
            "requests_per_s": _rate(len(done), makespan),
        },
        "cache": cache_totals,
        "events": {
            "emitted": result.events_emitted,
            "applied": result.events_applied,
            "applied_per_s": _rate(result.events_applied, makespan),
        },
        "belady": result.belady.as_dict(),
        "vs_bounds": vs,
        "workers": [
            {
                "worker": w.worker_id,
                "requests": w.requests,
                "steps": w.steps,
                "busy_fraction": _rate(w.busy_s, makespan),
                "preemptions": w.preemptions,
                "token_hit_rate": _rate(
                    sum(r.reused_tokens for r in done if r.worker == w.worker_id),
                    sum(r.prompt_tokens for r in done if r.worker == w.worker_id),
                ),
            }
            for w in result.workers
        ],
        "timeline": _timeline(result, start, width),
        "wall": {
            "replay_s": result.wall_s,
            "decision_latency_us": {k: v * 1e6 for k, v in _percentiles(lat).items()},
            "events_applied_per_s": _rate(result.events_applied, result.wall_s),
        },
    }
    return summary


def to_json(result: ReplayResult) -> dict[str, Any]:
    """The whole replay as a JSON-able dict (``"wall"`` entries hold the wall-clock values)."""
    return {
        "kvpool_version": __version__,
        "workload": result.workload,
        "cluster": result.config.as_dict(),
        "bounds": {name: b.as_dict() for name, b in result.bounds.items()},
        "policies": [summarize(p, result.bounds) for p in result.policies],
        "wall": {"bounds_s": result.bounds_wall_s},
    }


def strip_wall(obj: Any) -> Any:
    """``obj`` without its ``"wall"`` entries (recursively): the deterministic part."""
    if isinstance(obj, dict):
        return {k: strip_wall(v) for k, v in obj.items() if k != "wall"}
    if isinstance(obj, list):
        return [strip_wall(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- formatting


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _tokens(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} G"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e4:
        return f"{n / 1e3:.1f} k"
    return f"{n:,.0f}"


def fmt_ms(s: float) -> str:
    return f"{1e3 * s:,.0f} ms" if s >= 0.1 else f"{1e3 * s:.1f} ms"


def _describe(result: ReplayResult) -> list[list[str]]:
    """What ran, as lines of phrases: a terminal breaks a line only between its phrases
    (:func:`wrap_phrases`), markdown joins them."""
    w = result.workload
    cfg = result.config
    cache = cfg.cache
    sizing = cfg.description
    g = reference_group(cache)
    blocks = " + ".join(f"{t[g]:,}" for t in cache.slots)
    tpb = cache.tokens_per_block
    if sizing.get("model"):
        mem = f"{sizing.get('gpu_mem', '?')} GPU"
        if sizing.get("host_mem"):
            mem += f" + {sizing['host_mem']} host"
        if sizing.get("disk_mem"):
            mem += f" + {sizing['disk_mem']} disk"
        each = [f"each {sizing['model']} with {mem} KV", f"({blocks} blocks of {tpb} tokens);"]
    else:
        each = [f"each {blocks} blocks of {tpb} tokens;"]
    sched = cfg.scheduler
    b = result.bounds
    lines = [
        [f"workload {w['name']}:", f"{w['requests']:,} requests,",
         f"{_tokens(w['prompt_tokens'])} prompt + {_tokens(w['output_tokens'])} output tokens",
         f"over {w['duration_s']:,.0f} s"],
        [f"cluster: {cfg.workers} workers,", *each, f"batch {sched.max_batch_size},",
         f"{sched.max_num_tokens} tokens/step{',' if sched.chunked_prefill else ';'}",
         *(["chunked;"] if sched.chunked_prefill else []), f"events {cfg.transport}"],
    ]
    if cfg.remote_bytes:
        shared = sizing.get("remote_mem") or f"{cfg.remote_bytes:,} blocks"
        lines.append([f"shared remote tier: {shared} for the cluster", "(in-process, LRU;",
                      "every worker writes what leaves its tiers", "and prefetches before "
                      "admission)"])
    lines.append(
        ([f"unlimited-cache bound {fmt_pct(b['unlimited'].token_hit_rate)};"] if b else [])
        + [f"Belady bound per run for {cfg.capacity_blocks:,} blocks in all", "(whole blocks)"]
    )
    return lines


def wrap_phrases(phrases: Sequence[str], width: int, indent: str = "  ") -> list[str]:
    """``phrases`` joined by spaces into lines of at most ``width`` characters, broken only
    between two phrases (continuation lines indented); a phrase longer than a line stands
    alone on its own."""
    lines: list[str] = []
    for phrase in phrases:
        if lines and len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        else:
            lines.append((indent if lines else "") + phrase)
    return lines


_Row = tuple[str, list[str], list[float], str]


def _rows(result: ReplayResult, sums: list[dict[str, Any]]) -> list[_Row]:
    """(label, cells, sort keys, 'max'|'min'|'') per row of the comparison table. Units sit
    in the labels so that cells stay narrow (five policies fit 80 columns)."""
    tiers = result.config.cache.num_tiers
    rows: list[_Row] = []

    def row(label: str, values: Iterable[float], fmt: Any, best: str = "") -> None:
        vals = list(values)
        rows.append((label, [fmt(v) for v in vals], vals, best))

    def pct(v: float) -> str:
        return f"{100 * v:.1f}"

    def count(v: float) -> str:
        return f"{v:,.0f}" if v < 1e6 else _tokens(v)

    def ms(v: float) -> str:
        return f"{1e3 * v:,.0f}" if v >= 0.1 else f"{1e3 * v:.1f}"

    def us(v: float) -> str:
        return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"

    row("token hit rate %", (s["token_hit_rate"] for s in sums), pct, "max")
    for t in range(tiers if tiers > 1 else 0):
        row(f"  on {_TIERS[t]} %", (s["tier_hit_rate"][_TIERS[t]] for s in sums), pct)
    if result.config.remote_bytes:
        row("  from shared tier %", (s["remote_hit_rate"] for s in sums), pct, "max")
    row("  partial blocks %",
        (_rate(s["reused_partial_tokens"], s["prompt_tokens"]) for s in sums), pct)
    row("full-block hit %", (s["full_block_hit_rate"] for s in sums), pct, "max")
    row("  Belady bound %", (s["belady"]["token_hit_rate"] for s in sums), pct)
    row("  of Belady %", (s["vs_bounds"]["of_belady"] for s in sums), pct, "max")
    row("prefill computed", (s["prefill_tokens_computed"] for s in sums), _tokens, "min")
    row("preemptions", (s["preemptions"] for s in sums), count, "min")
    for q in ("p50", "p90", "p99"):
        row(f"TTFT {q} (ms)", (s["ttft_s"][q] for s in sums), ms, "min")
    row("output tok/s", (s["throughput"]["output_tokens_per_s"] for s in sums), count, "max")
    row("GPU busy %", (s["gpu_busy"] for s in sums), pct)  # better neither way
    row("makespan (s)", (s["makespan_s"] for s in sums), lambda v: f"{v:,.1f}", "min")
    row("evicted blocks", (s["cache"]["evicted_blocks"] for s in sums), count)
    if tiers > 1:
        row("  offloaded", (s["cache"]["offload_blocks"] for s in sums), count)
        row("  onboarded", (s["cache"]["onboard_blocks"] for s in sums), count)
    row("events applied", (s["events"]["applied"] for s in sums), count)
    row("  per sim. second", (s["events"]["applied_per_s"] for s in sums), count)
    row("route p50 (µs)", (s["wall"]["decision_latency_us"]["p50"] for s in sums), us)
    row("route p99 (µs)", (s["wall"]["decision_latency_us"]["p99"] for s in sums), us)
    row("wall time (s)", (s["wall"]["replay_s"] for s in sums), lambda v: f"{v:,.1f}")
    if any(s["rejected"] for s in sums):
        row("rejected (too long)", (s["rejected"] for s in sums), count)
    return rows


def best_marks(shown: list[str], vals: list[float], best: str) -> list[bool]:
    """Which cells of a row are its best, as printed (equal text, equal mark): none when the
    row is better neither way (``best`` empty) or every cell reads the same."""
    if not best or len(set(shown)) < 2:
        return [False] * len(shown)
    target = shown[vals.index(max(vals) if best == "max" else min(vals))]
    return [t == target for t in shown]


def render(result: ReplayResult, console: Any) -> None:
    """Print the replay: what ran, the bounds, and one column per policy (the best of a row
    in bold and marked ``*``). Policies that do not fit the console's width side by side go on
    into further tables, so no cell is ever cut."""
    sums = [summarize(p, result.bounds) for p in result.policies]
    for phrases in _describe(result):
        for line in wrap_phrases(phrases, console.width):
            console.print(line, highlight=False, soft_wrap=True)
    rows = []
    for label, cells, vals, best in _rows(result, sums):
        marks = best_marks(cells, vals, best)
        if any(marks):
            cells = [f"[bold green]{c}*[/]" if m else f"{c} "
                     for c, m in zip(cells, marks, strict=True)]
        rows.append((label, cells))
    names = [s["policy"] for s in sums]
    start = 0
    while start < len(names):
        stop = len(names)
        while stop > start + 1 and _width(console, names, rows, start, stop) > console.width:
            stop -= 1
        title = "kvpool replay" if start == 0 else "kvpool replay (continued)"
        console.print(_table(console, names, rows, start, stop, title))
        start = stop
    for line in wrap_phrases(_FOOTNOTE, console.width, indent=""):
        console.print(f"[dim]{line}[/]", highlight=False, soft_wrap=True)


_FOOTNOTE: Final = (
    "* best of the row", "(rows with no mark are better neither way).",
    "Hit rates: tokens each request reused", "at its first admission / prompt tokens.",
    "Bounds count whole blocks;", "a run's Belady bound is the offline optimum",
    "over its own lookups and commits.", "Times are simulated (TimeModel);",
    "route decisions and wall time are measured.",
)


def _table(console: Any, names: list[str], rows: list[tuple[str, list[str]]], start: int,
           stop: int, title: str) -> Any:
    """The policies ``names[start:stop]`` as columns of one rich table."""
    from rich.table import Table

    table = Table(title=title, title_style="bold")
    table.add_column("metric", no_wrap=True)
    narrow = console.width < 110
    for name in names[start:stop]:
        table.add_column(name.replace("-", "-\n") if narrow else name, justify="right",
                         no_wrap=True)
    for label, cells in rows:
        table.add_row(label, *cells[start:stop])
    return table


def _width(console: Any, names: list[str], rows: list[tuple[str, list[str]]], start: int,
           stop: int) -> int:
    """The width the table of ``names[start:stop]`` needs with no cell cut."""
    from rich.measure import Measurement

    table = _table(console, names, rows, start, stop, "")
    # measured without the console's limit: Measurement clamps to the width it is given
    wide = console.options.update_width(10_000)
    return int(Measurement.get(console, wide, table).maximum)


def to_markdown(result: ReplayResult) -> str:
    """Markdown: what ran and the bounds, a table of the headline figures (one row per
    policy), and every row of the terminal table (one column per policy)."""
    sums = [summarize(p, result.bounds) for p in result.policies]
    lines = [f"- {' '.join(phrases)}" for phrases in _describe(result)]
    lines.append("")
    # (header, value, text, which is best: "max", "min" or "")
    columns: list[tuple[str, Any, Any, str]] = [
        ("token hit rate", lambda s: s["token_hit_rate"], fmt_pct, "max"),
        ("full-block hit rate", lambda s: s["full_block_hit_rate"], fmt_pct, "max"),
        ("Belady bound", lambda s: s["belady"]["token_hit_rate"], fmt_pct, ""),
        ("of Belady", lambda s: s["vs_bounds"]["of_belady"], fmt_pct, "max"),
        ("prefill computed", lambda s: s["prefill_tokens_computed"], _tokens, "min"),
        ("TTFT p50", lambda s: s["ttft_s"]["p50"], fmt_ms, "min"),
        ("TTFT p99", lambda s: s["ttft_s"]["p99"], fmt_ms, "min"),
        ("GPU busy", lambda s: s["gpu_busy"], fmt_pct, ""),
        ("throughput", lambda s: s["throughput"]["output_tokens_per_s"],
         lambda v: f"{v:,.0f} tok/s", "max"),
        ("evicted blocks", lambda s: s["cache"]["evicted_blocks"], lambda v: f"{v:,}", ""),
        ("preemptions", lambda s: s["preemptions"], lambda v: f"{v:,}", "min"),
    ]
    if result.config.remote_bytes:
        columns.insert(1, ("from shared tier", lambda s: s["remote_hit_rate"], fmt_pct, "max"))
    lines.append("| policy | " + " | ".join(c[0] for c in columns) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * len(columns)) + "|")
    table = [[f"`{s['policy']}`"] for s in sums]
    for _, value, text, best in columns:
        vals = [value(s) for s in sums]
        shown = [text(v) for v in vals]
        marks = best_marks(shown, vals, best)
        for row, t, m in zip(table, shown, marks, strict=True):
            row.append(f"**{t}**" if m else t)
    lines.extend("| " + " | ".join(row) + " |" for row in table)
    lines.append("")
    lines.append("Every figure, as the terminal prints it:")
    lines.append("")
    lines.append("| metric | " + " | ".join(f"`{s['policy']}`" for s in sums) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * len(sums)) + "|")
    for label, cells, vals, best in _rows(result, sums):
        marks = best_marks(cells, vals, best)
        shown = [f"**{c}**" if m else c for c, m in zip(cells, marks, strict=True)]
        name = f"↳ {label.strip()}" if label.startswith(" ") else label
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    lines.append("")
    lines.append("Best of each column and row in bold, where better is defined (the bounds, "
                 "the tier split, GPU busy, evictions and the counts of work done are better "
                 "neither way).")
    return "\n".join(lines) + "\n"


def write_plot(result: ReplayResult, path: str | Path) -> None:
    """Token hit rate and median TTFT per policy over arrival time, as an image (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sums = [summarize(p, result.bounds) for p in result.policies]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for s in sums:
        tl = s["timeline"]
        xs = [tl["start_s"] + (i + 0.5) * tl["bin_s"] for i in range(len(tl["requests"]))]
        rate = [100 * v if n else math.nan
                for v, n in zip(tl["token_hit_rate"], tl["requests"], strict=True)]
        ttft = [1e3 * v if v is not None else math.nan for v in tl["ttft_p50_s"]]
        ax1.plot(xs, rate, marker="o", markersize=3, label=s["policy"])
        ax2.plot(xs, ttft, marker="o", markersize=3, label=s["policy"])
    if result.bounds:
        ax1.axhline(100 * result.bounds["unlimited"].token_hit_rate, color="grey",
                    linestyle="--", linewidth=1, label="unlimited-cache bound (whole run)")
    ax1.set_ylabel("token hit rate (%)")
    ax1.set_ylim(0, 100)
    ax1.legend(fontsize=8, ncol=3)
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("TTFT p50 (ms)")
    ax2.set_yscale("log")
    ax2.set_xlabel("arrival time (s)")
    ax2.grid(alpha=0.3, which="both")
    fig.suptitle(f"kvpool replay: {result.workload['name']}, {result.config.workers} workers")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise KVPoolError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
