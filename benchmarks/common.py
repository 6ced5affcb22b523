"""Shared benchmark plumbing: a rich table on stdout and a JSON file under results/.

Every benchmark runs with one command (``python benchmarks/bench_X.py``) and calls
:func:`report` once with its rows.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(
    os.environ.get("KVPOOL_RESULTS_DIR", Path(__file__).resolve().parent.parent / "results")
)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def report(
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str | None = None,
    extra: Mapping[str, Any] | None = None,
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Print ``rows`` as a table and write them (with machine facts) to ``results/<name>.json``."""
    table = Table(title=title or name)
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    for col in columns:
        table.add_column(
            col, justify="right" if rows and isinstance(rows[0].get(col), int | float) else "left"
        )
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    Console(width=max(120, Console().width)).print(table)
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), "rows": list(rows), **(extra or {})}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    Console().print(f"wrote {path}")
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)
