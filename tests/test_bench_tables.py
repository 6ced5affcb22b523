"""Benchmark tables fit the terminal: one row per result when it is wide enough, one column per
result (as many per table as fit) when it is not, never a cut cell."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path
from types import ModuleType

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]


def common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_common", module)
    spec.loader.exec_module(module)
    return module


ROW = {  # the shape of a bench_admission.py W2 row
    "workload": "W2+host80000", "algo": "v2_sha256", "policy": "2q", "requests": 4000,
    "prompt_blocks": 1_732_465, "total_s": 27.5, "cpu_s": 27.4, "hashing_s": 1.2,
    "manager_s": 26.1, "us_per_request": 6904.1, "us_per_block_incl_hash": 15.9,
    "us_per_block_excl_hash": 15.2, "block_hit_rate": 0.136, "token_hit_rate": 0.136,
    "gpu_tier_hits": 14424, "host_tier_hits": 32679, "early_releases": 12, "gc": 0,
}


def render(width: int, rows: list[dict[str, object]]) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    for table in common()._tables(console, "kvpool admission", rows):
        console.print(table)
    return out.getvalue().splitlines()


def test_a_wide_terminal_gets_one_row_per_result() -> None:
    lines = render(400, [ROW, {**ROW, "policy": "lru"}])
    assert max(map(len, lines)) <= 400 and "…" not in "".join(lines)
    assert sum("W2+host80000" in line for line in lines) == 2  # two rows


def test_80_columns_get_one_column_per_result_with_every_cell_whole() -> None:
    rows = [{**ROW, "policy": p} for p in ("lru", "2q", "arc", "s3fifo", "lru", "2q")]
    lines = render(80, rows)
    assert max(map(len, lines)) <= 80 and "…" not in "".join(lines)
    assert sum(line.startswith("│ us_per_block_excl_hash ") for line in lines) >= 2  # split
    text = "\n".join(lines)
    for p in ("s3fifo", "1,732,465", "6,904"):
        assert p in text


def test_a_report_records_the_machine_its_load_and_the_command(tmp_path: Path) -> None:
    argv = [str(ROOT / "benchmarks" / "bench_x.py"), "--quick"]
    old, sys.argv = sys.argv, argv
    try:
        path = common().report("bench_x", [ROW], out=tmp_path / "x.json")
    finally:
        sys.argv = old
    machine = json.loads(path.read_text())["machine"]
    assert machine["command"] == ".venv/bin/python benchmarks/bench_x.py --quick"
    assert len(machine["load"]) == 3 and all(x >= 0 for x in machine["load"])
    assert machine["cpus"] >= 1 and machine["when"].endswith("Z")


def test_the_figure_extractors_read_rows_shaped_as_the_benchmarks_write_them() -> None:
    """Rows shaped as bench_engine.py's and bench_router_service.py --bus nats' (their
    committed documents are transcribed, so the generator test does not read these)."""
    from kvpool.replay.bench_figures import BENCH_TABLES, Measure

    engine = [{"measure": m, "unit": "x", "kvpool": 1.0, "reference": 1.0, "ratio": r}
              for m, r in (("TTFT, 2,048-token prompt: cached 1,920 vs cold", 9.87),
                           ("decode tokens/s, batch 1: kvpool vs generate", 0.912),
                           ("8 concurrent requests, tokens/s: kvpool vs generate_batch", 2.1))]
    nats = [{"router": "zmq x1", "per router cpu s": 3279.0, "p99 ms": 15.0},
            {"router": "nats x2", "per router cpu s": 2941.0, "p99 ms": 18.06,
             "vs zmq": 2941.0 / 3279.0}]
    docs = {"bench_engine": {"rows": engine}, "bench_router_service_nats": {"rows": nats}}
    texts = {c.key: c.text(docs) for row in BENCH_TABLES["benchmarks"].rows for c in row
             if isinstance(c, Measure) and c.json in docs}
    assert texts == {"ttft": "9.9× faster", "decode": "0.91×", "batch": "2.10×",
                     "vs_zmq": "0.897× (2,941 / 3,279)", "p99": "18.1 ms"}
