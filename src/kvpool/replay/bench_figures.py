"""The benchmark figure table of docs/benchmarks.md, written from the benchmarks' own JSON.

Each benchmark (``benchmarks/*.py``) writes its rows to ``results/<name>.json``, or to
``$KVPOOL_RESULTS_DIR/<name>.json``. The documents kept in ``docs/figures/bench`` are those of
the run the table shows: ``KVPOOL_RESULTS_DIR=docs/figures/bench .venv/bin/python
benchmarks/bench_x.py`` (or ``python -m kvpool.replay.figures --run benchmarks``) replaces
one, and ``python -m kvpool.replay.figures`` rewrites the table from them. Unlike the replays,
these figures depend on the machine (each document records it); the table names the machine
and the day of every run, so a figure never outlives the run that measured it unnoticed.

A row of the table is a :class:`Measure`: which document, which of its rows (by the values of
some of their fields), which field, how it is shown, and the target it is judged against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["BENCH_RUNS", "MEASURES", "BenchRun", "Measure", "bench_table"]


@dataclass(frozen=True)
class BenchRun:
    """One benchmark command and the document it writes (``<json>.json``)."""

    script: str
    json: str
    args: tuple[str, ...] = ()

    def command(self) -> str:
        return " ".join([".venv/bin/python", f"benchmarks/{self.script}", *self.args])


@dataclass(frozen=True)
class Measure:
    """A row: the value of ``field`` in the rows of document ``json`` whose fields equal each
    ``where`` (one value per ``where``, joined by " / ")."""

    json: str
    label: str
    field: str
    where: tuple[Mapping[str, Any], ...]
    fmt: str = "{:,.1f}"
    target: str = "–"
    also: tuple[str, ...] = ()
    """Fields of the same row shown after the first ("p99 ms", "errors")."""
    total: bool = False
    """Sum the field over every row that matches (else exactly one row must)."""

    def value(self, docs: Mapping[str, Mapping[str, Any]]) -> str:
        rows: Sequence[Mapping[str, Any]] = docs[self.json]["rows"]
        shown = []
        for where in self.where:
            found = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
            if self.total:
                shown.append(self.fmt.format(sum(r[self.field] for r in found)))
                continue
            if len(found) != 1:
                raise KeyError(f"{self.json}.json has {len(found)} rows with {dict(where)}")
            shown.append(self.fmt.format(found[0][self.field]))
            shown.extend(self.fmt.format(found[0][f]) for f in self.also)
        return " / ".join(shown)


BENCH_RUNS: Final[tuple[BenchRun, ...]] = (
    BenchRun("bench_hashing.py", "hashing"),
    BenchRun("bench_admission.py", "bench_admission"),
    BenchRun("bench_events.py", "bench_events"),
    BenchRun("bench_router.py", "router"),
    BenchRun("bench_router_service.py", "bench_router_service"),
    BenchRun("bench_eviction.py", "bench_eviction"),
    BenchRun("bench_copy.py", "copy"),
    BenchRun("bench_persist.py", "persist"),
    BenchRun("bench_remote.py", "bench_remote"),
    BenchRun("fuzz_decoders.py", "fuzz_decoders", ("--count", "100000")),
)

_PROMPT = "extend(prompt)"
_POLICIES = tuple({"policy": p, "keys": "w1"} for p in ("lru", "2q", "s3fifo", "arc"))
_FULL_PATH = "full path (2 processes)"
MEASURES: Final[tuple[Measure, ...]] = (
    Measure("hashing", "M tokens/s, `v2_sha256`", "Mtok/s",
            ({"algorithm": "v2_sha256", "mode": _PROMPT},), target="≥ 20"),
    Measure("hashing", "M tokens/s, `vllm_sha256_cbor`", "Mtok/s",
            ({"algorithm": "vllm_sha256_cbor", "mode": _PROMPT},), target="≥ 3"),
    Measure("hashing", "M tokens/s, `v1_block_key` (numba)", "Mtok/s",
            ({"algorithm": "v1_block_key", "mode": _PROMPT},), target="≥ 4"),
    Measure("bench_admission", "W1, 2,000 requests, CPU s, hashing included (`2q`)", "cpu_s",
            ({"workload": "W1", "policy": "2q"},), "{:.2f}", "≤ 0.35"),
    Measure("bench_admission", "µs per block without hashing, W1 / W2 (`2q`)",
            "us_per_block_excl_hash",
            ({"workload": "W1", "policy": "2q"}, {"workload": "W2", "policy": "2q"}), "{:.2f}"),
    Measure("bench_events", "block events/s, manager → msgpack → ZMQ → decode (k)",
            "block_events_per_s", ({"source": "manager", "stage": _FULL_PATH},), "{:,.0f}",
            "≥ 500 k"),
    Measure("bench_events", "delivery lag p50 / p99, ms", "lag_p50_ms",
            ({"source": "manager", "stage": _FULL_PATH},), "{:.1f}", also=("lag_p99_ms",)),
    Measure("router", "ingestion k block events/s: vLLM msgpack / TensorRT-LLM JSON", "k ev/s",
            ({"bench": "ingest", "algo": "v2_sha256", "format": "vllm msgpack"},
             {"bench": "ingest", "algo": "v2_sha256", "format": "trtllm json"}), "{:,.0f}",
            "≥ 500"),
    Measure("router", "decision p99 ms, 32 workers × 100k blocks", "p99 ms",
            ({"bench": "route", "algo": "v2_sha256"},), "{:.2f}", "≤ 2"),
    Measure("bench_router_service", "routes/s over HTTP / p99 ms / errors", "routes/s",
            ({},), "{:,.0f}", "≥ 3,000 / ≤ 20 / 0", also=("p99 ms", "errors")),
    Measure("bench_eviction", "µs per block: `lru` / `2q` / `s3fifo` / `arc`", "us_per_block",
            _POLICIES, "{:.2f}"),
    Measure("copy", "batched copies GB/s: GPU tier → host / host → GPU tier (CPU torch)",
            "batched GB/s",
            ({"path": "tier0→host (offload)"}, {"path": "host→tier0 (onboard)"}), "{:.2f}"),
    Measure("copy", "batched copies GB/s: host → disk / disk → host", "batched GB/s",
            ({"path": "host→disk (offload)"}, {"path": "disk→host (onboard)"}), "{:.2f}"),
    Measure("persist", "persistent disk tier: µs per disk block over a plain one",
            "µs per disk block over plain", ({"disk tier": "persistent"},), "{:.0f}"),
    Measure("persist", "warm restart: µs per restored block", "µs per restored block",
            ({"restored slots": 4096},), "{:.0f}"),
    Measure("bench_remote", "remote reads vs redis-py's GETs, 2 MiB / 64 KiB blocks",
            "vs redis-py", ({"block": "2048 KiB", "reader": "RemoteStore.get_many + verify"},
                            {"block": "64 KiB", "reader": "RemoteStore.get_many + verify"}),
            "{:.2f}×", "≥ 0.8×"),
    Measure("fuzz_decoders", "errors escaping the decoders (100,000 inputs each)", "escaped",
            ({},), "{:,}", "0", total=True),
)
"""The rows of the table, in order; several values in a row are joined by " / "."""


def bench_table(docs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table: one row a measure, then one line per run naming its machine."""
    lines = ["| benchmark | figure | measured | target |", "|---|---|---:|---|"]
    scripts = {run.json: run.script for run in BENCH_RUNS}
    last = ""
    for m in MEASURES:
        value = m.value(docs)
        name = f"`{scripts[m.json]}`" if m.json != last else ""
        last = m.json
        lines.append(f"| {name} | {m.label} | {value} | {m.target} |")
    lines.append("")
    when = sorted({(d["machine"]["when"][:10], d["machine"]["cpus"]) for d in docs.values()})
    days = ", ".join(sorted({w for w, _ in when}))
    cpus = ", ".join(str(c) for c in sorted({c for _, c in when}))
    lines.append(f"Measured on {days}, {cpus} CPUs (each document in docs/figures/bench names "
                 "its machine).")
    return lines
