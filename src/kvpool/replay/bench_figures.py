"""The benchmark figure tables of README and docs, written from the benchmarks' own JSON.

Each benchmark (``benchmarks/*.py``) writes its rows, the machine, its load averages and its
command to ``results/<name>.json`` (``$KVPOOL_RESULTS_DIR/<name>.json``). The documents the
tables show are kept in ``docs/figures/bench/<json>.json``; ``python -m kvpool.replay.figures
--run bench-<json>`` reruns one benchmark into its document, and ``python -m
kvpool.replay.figures`` rewrites every table from the documents.

A cell of a table is a :class:`Measure`: which document, and how its rows give the text. A
document whose run took longer than a benchmark run here may take (30 min for
``bench_hybrid.py``) or needed a machine the project does not always have (vLLM, NATS) may be
*transcribed*: ``"source": "transcribed from <commit>"`` and ``"figures": {key: text}``,
the text as the docs carried it at that commit; the table's caption says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["BENCH_RUNS", "BENCH_TABLES", "BenchRun", "BenchTable", "Measure", "bench_table"]

Row = Mapping[str, Any]
Extract = Callable[[Sequence[Row]], str]


@dataclass(frozen=True)
class BenchRun:
    """One benchmark command and its document, ``docs/figures/bench/<json>.json``."""

    json: str
    script: str
    args: tuple[str, ...] = ()
    out: bool = False
    """The script takes ``--out PATH`` (two runs of it keep two documents); else it writes
    ``$KVPOOL_RESULTS_DIR/<writes>.json``."""
    writes: str = ""

    def command(self) -> str:
        return " ".join([".venv/bin/python", f"benchmarks/{self.script}", *self.args])


@dataclass(frozen=True)
class Measure:
    """A cell: ``extract`` applied to the rows of document ``json``, or, for a transcribed
    document, its ``figures[key]``."""

    json: str
    key: str
    extract: Extract | None = None
    """None: the figure exists only transcribed (no extractor reads the benchmark's rows yet)."""

    def text(self, docs: Mapping[str, Mapping[str, Any]]) -> str:
        doc = docs[self.json]
        if "source" in doc:
            figures: Mapping[str, str] = doc["figures"]
            if self.key not in figures:
                raise KeyError(f"{self.json}.json ({doc['source']}) has no figure {self.key!r}")
            return figures[self.key]
        if self.extract is None:
            raise KeyError(f"{self.json}.json is a run of its benchmark, but figure {self.key!r} "
                           "has only been transcribed: give its Measure an extractor")
        return self.extract(doc["rows"])


Cell = str | Measure


@dataclass(frozen=True)
class BenchTable:
    """A figure table: its header and rows of cells."""

    header: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]

    def documents(self) -> list[str]:
        """The documents its cells read, in order of first use."""
        seen: dict[str, None] = {}
        for row in self.rows:
            for cell in row:
                if isinstance(cell, Measure):
                    seen.setdefault(cell.json)
        return list(seen)


def one(rows: Sequence[Row], **where: Any) -> Row:
    """The one row whose fields equal ``where``."""
    found = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows with {where} (expected 1)")
    return found[0]


def pick(field: str, fmt: str, *wheres: Mapping[str, Any], unit: str = "") -> Extract:
    """``field`` of the row matching each of ``wheres``, formatted, joined by " / "."""
    def extract(rows: Sequence[Row]) -> str:
        return " / ".join(fmt.format(one(rows, **w)[field]) for w in wheres) + unit
    return extract


def _starting(prefix: str, field: str, fmt: str) -> Extract:
    """``field`` of the one row whose ``measure`` starts with ``prefix`` (bench_engine.py)."""
    def extract(rows: Sequence[Row]) -> str:
        found = [r for r in rows if str(r["measure"]).startswith(prefix)]
        if len(found) != 1:
            raise KeyError(f"{len(found)} rows whose measure starts with {prefix!r}")
        return fmt.format(found[0][field])
    return extract


def _replicas(rows: Sequence[Row]) -> str:
    """bench_router_service.py --bus nats: the replicas' routes per router CPU second against
    the single ZMQ router's (its first row)."""
    nats = next(r for r in rows if "vs zmq" in r)
    return "{:.3f}× ({:,.0f} / {:,.0f})".format(nats["vs zmq"], nats["per router cpu s"],
                                              rows[0]["per router cpu s"])


def _total(field: str) -> Extract:
    def extract(rows: Sequence[Row]) -> str:
        return f"{sum(int(r[field]) for r in rows):,}"
    return extract


BENCH_RUNS: Final[tuple[BenchRun, ...]] = (
    BenchRun("hashing", "bench_hashing.py"),
    BenchRun("bench_admission", "bench_admission.py"),
    BenchRun("bench_admission_policies", "bench_admission.py",
             ("--compare-policies", "lru,2q,arc,s3fifo")),
    BenchRun("admission_vs_vllm", "bench_admission.py"),
    BenchRun("bench_events", "bench_events.py"),
    BenchRun("router", "bench_router.py"),
    BenchRun("bench_router_service", "bench_router_service.py", out=True),
    BenchRun("bench_router_service_text", "bench_router_service.py", ("--text",), out=True),
    BenchRun("bench_router_service_nats", "bench_router_service.py",
             ("--bus", "nats", "--replicas", "2"), out=True),
    BenchRun("bench_router_nats", "bench_router_nats.py", out=True),
    BenchRun("bench_eviction", "bench_eviction.py"),
    BenchRun("copy", "bench_copy.py"),
    BenchRun("persist", "bench_persist.py"),
    BenchRun("bench_remote", "bench_remote.py"),
    BenchRun("bench_engine", "bench_engine.py", out=True),
    BenchRun("bench_engine_overhead", "bench_engine.py", ("--overhead",), out=True),
    BenchRun("bench_vllm_tier", "bench_vllm_tier.py"),
    BenchRun("bench_hybrid", "bench_hybrid.py"),
    BenchRun("fuzz_decoders", "fuzz_decoders.py", ("--count", "100000")),
)
RUNS: Final = {r.json: r for r in BENCH_RUNS}

_PROMPT = "extend(prompt)"
_FULL = "full path (2 processes)"
_GET = "RemoteStore.get_many + verify"
_FORMATS = ("vllm msgpack", "trtllm json")


def _m(json: str, key: str, extract: Extract | None = None) -> Measure:
    return Measure(json, key, extract)


def _hash(algo: str) -> Measure:
    return _m("hashing", algo, pick("Mtok/s", "{:.1f}", {"algorithm": algo, "mode": _PROMPT}))


_ADM = "bench_admission"
_POL = "bench_admission_policies"
_RS = "bench_router_service"
_VT = "bench_vllm_tier"
_HY = "bench_hybrid"
_EN = "bench_engine"

BENCHMARKS: Final = BenchTable(("benchmark", "figure", "measured", "target"), (
    ("`bench_hashing.py`", "M tokens/s, `v2_sha256`", _hash("v2_sha256"), "20"),
    ("", "M tokens/s, `vllm_sha256_cbor`", _hash("vllm_sha256_cbor"), "3"),
    ("", "M tokens/s, `v1_block_key` (numba)", _hash("v1_block_key"), "4"),
    ("`bench_admission.py`", "W1, 2,000 requests, hashing included, CPU s: `2q`",
     _m(_ADM, "w1_cpu_s", pick("cpu_s", "{:.2f}", {"workload": "W1"}, unit=" s")), "0.35 s"),
    ("", "µs per block without hashing, `2q`: W1 / W2",
     _m(_ADM, "us_per_block", pick("us_per_block_excl_hash", "{:.1f}", {"workload": "W1"},
                                   {"workload": "W2"})), "1.0 / –"),
    ("`bench_admission.py --compare-policies lru,2q,arc,s3fifo`",
     "W1, median CPU s, hashing included: `lru` / `2q`",
     _m(_POL, "w1_cpu_s", pick("median_cpu_s", "{:.2f}", {"policy": "lru"}, {"policy": "2q"},
                               unit=" s")), "0.35 s"),
    ("", "W1 against vLLM 0.33's `KVCacheManager` (its harness)",
     _m("admission_vs_vllm", "vs_vllm"), "≤ 0.5×"),
    ("`bench_events.py`", "block events/s, manager → msgpack → ZMQ → decode, 2 processes",
     _m("bench_events", "full_path", pick("block_events_per_s", "{:,.0f}",
                                          {"source": "manager", "stage": _FULL})), "500 k"),
    ("", "block events/s, synthetic chains, 2 processes",
     _m("bench_events", "synthetic", pick("block_events_per_s", "{:,.0f}",
                                          {"source": "synthetic", "stage": _FULL})), "500 k"),
    ("", "delivery p50 / p99, ms",
     _m("bench_events", "lag", lambda rows: "{:.1f} / {:.1f}".format(
         one(rows, source="manager", stage=_FULL)["lag_p50_ms"],
         one(rows, source="manager", stage=_FULL)["lag_p99_ms"])), "–"),
    ("`bench_router.py`", "ingestion, k block events/s: vLLM msgpack / TensorRT-LLM JSON",
     _m("router", "ingest", pick("k ev/s", "{:,.0f}", *({"bench": "ingest", "algo": "v2_sha256",
                                                         "format": f} for f in _FORMATS))),
     "500"),
    ("", "decision p99, 32 workers × 100k blocks, 8k-token prompt, ms",
     _m("router", "route_p99", pick("p99 ms", "{:.2f}", {"bench": "route", "algo": "v2_sha256"})),
     "2–5"),
    ("`bench_router_service.py`", "routes/s (uvloop) / p99 ms / errors",
     _m(_RS, "routes", lambda rows: "{:,.0f} / {:.1f} / {}".format(
         rows[0]["routes/s"], rows[0]["p99 ms"], rows[0]["errors"])), "3,000 / 20 / 0"),
    ("`bench_router_service.py --text`", "tokenizing's share of a chat route's router CPU, "
     "1,024 tokens (SmolLM2's tokenizer), 16 / 64 / 512 of them new",
     _m("bench_router_service_text", "tokenizing"), "≤ 15 %"),
    ("`bench_router_service.py --bus nats --replicas 2`",
     "routes per router CPU s, 2 replicas / 1 ZMQ router",
     _m("bench_router_service_nats", "vs_zmq", _replicas), "≥ 0.9×"),
    ("", "p99, 2 replicas", _m("bench_router_service_nats", "p99", lambda rows: "{:.1f} ms".format(
        next(r for r in rows if "vs zmq" in r)["p99 ms"])), "20 ms"),
    ("`bench_router_nats.py`", "a new replica matches, 1,000,000 block events",
     _m("bench_router_nats", "late", pick("late replica s", "{:.1f}", {}, unit=" s")), "≤ 5 s"),
    ("", "a new replica matches after 2 of 3 replicas died and nats-server restarted",
     _m("bench_router_nats", "restart", pick("after restart s", "{:.2f}", {}, unit=" s")),
     "≤ 5 s"),
    ("`bench_eviction.py`", "µs per block: `lru` / `2q` / `s3fifo` / `arc`",
     _m("bench_eviction", "w1", pick("us_per_block", "{:.2f}",
                                     *({"policy": p, "keys": "w1"}
                                       for p in ("lru", "2q", "s3fifo", "arc")))), "–"),
    ("`bench_copy.py`", "batched copies GB/s, CPU torch: tier 0 → host / host → tier 0",
     _m("copy", "host", pick("batched GB/s", "{:.2f}", {"path": "tier0→host (offload)"},
                             {"path": "host→tier0 (onboard)"})), "–"),
    ("", "batched copies GB/s: host → disk / disk → host",
     _m("copy", "disk", pick("batched GB/s", "{:.2f}", {"path": "host→disk (offload)"},
                             {"path": "disk→host (onboard)"})), "–"),
    ("`bench_persist.py`", "persistent disk tier: µs per disk block over a plain one",
     _m("persist", "over_plain", pick("µs per disk block over plain", "{:.0f}",
                                      {"disk tier": "persistent"})), "–"),
    ("", "warm restart: µs per restored block",
     _m("persist", "restart", pick("µs per restored block", "{:.0f}",
                                   {"restored slots": 4096})), "–"),
    ("`bench_remote.py`", "reads against redis-py's GETs, 2 MiB / 64 KiB blocks",
     _m("bench_remote", "reads", pick("vs redis-py", "{:.2f}×",
                                      {"block": "2048 KiB", "reader": _GET},
                                      {"block": "64 KiB", "reader": _GET})), "0.8×"),
    ("`bench_engine.py`", "TTFT, 2,048-token prompt, 1,920 tokens cached vs cold",
     _m(_EN, "ttft", _starting("TTFT", "ratio", "{:.1f}× faster")), "≥ 8×"),
    ("", "decode tokens/s, batch 1, vs transformers' `generate`",
     _m(_EN, "decode", _starting("decode", "ratio", "{:.2f}×")), "≥ 0.8×"),
    ("", "8 concurrent requests, tokens/s vs `generate_batch`",
     _m(_EN, "batch", _starting("8 concurrent", "ratio", "{:.2f}×")), "≥ 1.0×"),
    ("`bench_engine.py --overhead`",
     "engine's own CPU per decode step at batch 1 / 8 / 32, vs the commit before",
     _m("bench_engine_overhead", "overhead"), "≤ 0.5×"),
    ("`bench_vllm_tier.py`", "CPU-tier hit rate at 4,000 / 8,000 / 16,000 chunks: best kvpool "
     "policy vs vLLM LRU", _m(_VT, "hitrate_vs_lru"), "≥ 1.15×"),
    ("", "`KvpoolTier` store / load vs vLLM `fs` (256 KiB chunks, every chunk hashed and "
     "verified)", _m(_VT, "tier_vs_fs"), "≥ 1.0×"),
    ("", "chunks found after a restart, `KvpoolTier` / `fs`", _m(_VT, "restart"), "≥ 95 %"),
    ("", "calling-thread p99, 32-chunk job: `lookup` / `submit_store` / `submit_load`, thread "
     "CPU (wall, quiet moment)", _m(_VT, "latency"), "200 µs"),
    ("`bench_hybrid.py`", "short shared prompts (2,000 requests, 8 GiB): `marconi` / `align` / "
     "`every_block` / attention-only (checkpoints by Marconi's FLOP-aware score, the default)",
     _m(_HY, "short"), "≥ 3× align, ≥ 1.3× every_block, ≥ 90 %"),
    ("", "the same with LRU checkpoints: `marconi` / `every_block`", _m(_HY, "short_lru"),
     "≥ 1.3× every_block"),
    ("", "conversation trace, first 4,000 requests, 40 GiB (`--splits 0.2,0.5`): `marconi` / "
     "`align` / `every_block` / attention-only", _m(_HY, "conversation"),
     "≥ 1.2× align, ≥ 1.3× every_block"),
    ("", "the same with LRU checkpoints: `marconi` / `every_block`", _m(_HY, "conversation_lru"),
     "≥ 1.3× every_block"),
    ("`fuzz_decoders.py`", "escaped errors in 100,000 inputs per decoder",
     _m("fuzz_decoders", "escaped", _total("escaped")), "0"),
))
"""docs/benchmarks.md's table of every benchmark's figures."""

def _vllm_vs_kvpool(prefix: str, rows: Sequence[tuple[str, str]]) -> BenchTable:
    """A bench_vllm_tier.py table: per (label, key), vLLM's figure and kvpool's."""
    return BenchTable(("figure", "vLLM", "kvpool"), tuple(
        (label, _m(_VT, f"{prefix}{key}_vllm"), _m(_VT, f"{prefix}{key}_kvpool"))
        for label, key in rows))


VLLM_TIER: Final = _vllm_vs_kvpool("", (
    ("CPU-tier hit rate, first 4,000 conversation requests, 4,000 chunks", "hit4k"),
    ("same at 8,000 / 16,000 chunks", "hit8k16k"),
    ("store / load MB/s, 32-chunk jobs of 256 KiB", "mbps"),
    ("chunks found after a restart", "restart"),
    ("calling-thread p99 `lookup` / `submit_store` / `submit_load`, thread CPU", "p99"),
))
"""README's summary of bench_vllm_tier.py."""

VLLM_TIER_DETAIL: Final = _vllm_vs_kvpool("d_", (
    ("CPU-tier hit rate, 4,000 chunks", "hit4k"),
    ("CPU-tier hit rate, 8,000 chunks", "hit8k"),
    ("CPU-tier hit rate, 16,000 chunks", "hit16k"),
    ("store, 32-chunk jobs of 256 KiB", "store"),
    ("load", "load"),
    ("chunks found after a restart", "restart"),
    ("`lookup` p99 (per key), wall (thread CPU)", "lookup"),
    ("`submit_store` p99, wall (thread CPU); p50", "submit_store"),
    ("`submit_load` p99, wall (thread CPU); p50", "submit_load"),
))
"""docs/integrations.md's table of bench_vllm_tier.py."""

HYBRID: Final = BenchTable(
    ("workload", "kvpool `marconi` (default)", "kvpool `every_block`", "`marconi`, LRU checkpoints",
     "`every_block`, LRU checkpoints", "vLLM-style `align` (544)", "attention-only model"),
    tuple((label, *(_m(_HY, f"{key}_{p}") for p in ("marconi", "every_block", "marconi_lru",
                                                     "every_block_lru", "align", "attn")))
          for label, key in (
              ("300-token shared system prompts + questions, 2,000 requests, 8 GiB", "t_short"),
              ("conversation trace, first 4,000 requests, 40 GiB (splits 0.2, 0.5)", "t_conv"),
          )))
"""README's table of bench_hybrid.py."""

HYBRID_ALPHA: Final = BenchTable(
    ("alpha", "short prompts, 2,000 requests, 8 GiB", "conversation, 1,000 requests, 40 GiB"),
    tuple((label, _m(_HY, f"alpha_{key}_short"), _m(_HY, f"alpha_{key}_conv1000"))
          for label, key in (("LRU (`None`)", "lru"), ("0.5", "0.5"), ("1", "1"), ("2", "2"),
                             ("4", "4"))))
"""docs/hybrid.md's table of checkpoint_alpha (bench_hybrid.py --alpha, marconi, split 0.2)."""

BENCH_TABLES: Final[Mapping[str, BenchTable]] = {
    "benchmarks": BENCHMARKS, "vllm-tier": VLLM_TIER, "vllm-tier-detail": VLLM_TIER_DETAIL,
    "hybrid": HYBRID, "hybrid-alpha": HYBRID_ALPHA,
}
"""Each figure block of benchmarks, by its name in the markdown."""


def _run_line(name: str, doc: Mapping[str, Any]) -> str:
    run = RUNS[name]
    if "source" in doc:
        command = doc.get("command", run.command())
        return f"- `{name}.json`: {doc['source']}" + (f"; `{command}`" if command else "")
    m = doc["machine"]
    load = " / ".join(f"{x:.1f}" for x in m.get("load", ())) or "not recorded"
    return (f"- `{name}.json`: `{m.get('command', run.command())}`, {m['when'][:10]}, "
            f"{m['cpus']} CPUs, load averages at its end {load} (1 / 5 / 15 min)")


def bench_table(table: BenchTable, docs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table, then one line per document: its command and machine, or where its
    figures were transcribed from."""
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    for row in table.rows:
        cells = [c.text(docs) if isinstance(c, Measure) else c for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Runs behind this table (in `docs/figures/bench`):", ""]
    lines += [_run_line(name, docs[name]) for name in table.documents()]
    return lines
