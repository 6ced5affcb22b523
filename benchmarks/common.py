"""Shared benchmark plumbing: a rich table on stdout and a JSON file under results/, and the
held-window admission loop of the trace workloads.

Every benchmark runs with one command (``.venv/bin/python benchmarks/bench_X.py``) and calls
:func:`report` once with its rows.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

# the public API only: bench_admission --baseline runs this with another checkout's kvpool
from kvpool import KVCacheManager, OutOfBlocksError, SequenceRequest

RESULTS_DIR = Path(
    os.environ.get("KVPOOL_RESULTS_DIR", Path(__file__).resolve().parent.parent / "results")
)


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and how loaded it was (the 1/5/15-minute load
    averages when the run ended), and the command that measured them."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": [round(x, 2) for x in os.getloadavg()],
        "command": shlex.join([".venv/bin/python", _script(), *sys.argv[1:]]),
    }


def _script() -> str:
    """The running benchmark as the repository root names it (benchmarks/bench_x.py)."""
    path = Path(sys.argv[0]).resolve()
    return f"{path.parent.name}/{path.name}" if path.parent.name == "benchmarks" else sys.argv[0]


def report(
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str | None = None,
    extra: Mapping[str, Any] | None = None,
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Print ``rows`` as a table and write them (with machine facts) to ``results/<name>.json``.

    Consecutive rows with the same keys share a table; rows of another shape (a benchmark's
    second part) start a new one, so that no table carries columns empty for most of its rows.
    """
    console = Console()
    groups: list[list[Mapping[str, Any]]] = []
    for row in rows:
        if groups and list(groups[-1][0]) == list(row):
            groups[-1].append(row)
        else:
            groups.append([row])
    for i, group in enumerate(groups):
        label = title or name
        label = label if len(groups) == 1 else f"{label} ({i + 1}/{len(groups)})"
        for table in _tables(console, label, group):
            console.print(table)
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), "rows": list(rows), **(extra or {})}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    Console().print(f"wrote {path}")
    return path


def _tables(console: Console, title: str, rows: Sequence[Mapping[str, Any]]) -> list[Table]:
    """One row per result when that fits the console; else one column per result (a field
    per line), as many results per table as fit, so that no cell is ever cut."""
    columns = list(rows[0])
    wide = Table(title=title)
    for col in columns:
        numeric = isinstance(rows[0].get(col), int | float)
        wide.add_column(col, justify="right" if numeric else "left", no_wrap=True)
    for row in rows:
        wide.add_row(*(_fmt(row.get(c)) for c in columns))
    if _fits(console, wide):
        return [wide]
    tables: list[Table] = []
    start = 0
    while start < len(rows):
        count = len(rows) - start
        while True:
            tall = Table(title=title, show_header=count > 1 or len(rows) > 1)
            tall.add_column("", no_wrap=True)
            for k in range(start, start + count):
                tall.add_column(f"#{k + 1}", justify="right", no_wrap=True)
            for col in columns:
                tall.add_row(col, *(_fmt(rows[k].get(col)) for k in range(start, start + count)))
            if count == 1 or _fits(console, tall):
                break
            count -= 1
        tables.append(tall)
        start += count
    return tables


def _fits(console: Console, table: Table) -> bool:
    unbounded = console.options.update_width(1 << 20)
    return Measurement.get(console, unbounded, table).maximum <= console.width


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


def admit_held(manager: KVCacheManager, add: Callable[[SequenceRequest], object],
               requests: Sequence[Sequence[int]], window: int) -> int:
    """Admit the token lists in order through ``add`` (request i as ``SequenceRequest(i,
    tokens)``), store each one's context blocks and hold it while the next ``window - 1`` are
    admitted; a request that does not fit releases the oldest held request early and retries.
    Every request is removed at the end. Returns the number of early releases."""
    held: collections.deque[int] = collections.deque()
    early = 0
    for i, toks in enumerate(requests):
        while True:
            try:
                add(SequenceRequest(i, toks))
                break
            except OutOfBlocksError:
                if not held:
                    raise
                manager.remove_sequence(held.popleft())
                early += 1
        manager.store_context_blocks(i, len(toks))
        held.append(i)
        if len(held) >= window:
            manager.remove_sequence(held.popleft())
    while held:
        manager.remove_sequence(held.popleft())
    return early
