"""The figure tables of the README and docs, written from the replays' and the benchmarks'
JSON, so that no table can say what its run does not.

Each figure is one or more ``kvpool replay`` runs whose ``--json`` output is kept in
``docs/figures/<figure>.json`` (``<figure>-<i>.json`` for a figure of several runs), and a
markdown table made from those documents. In a markdown file, a figure sits between two
comments that this module rewrites::

    <!-- figure: trace (python -m kvpool.replay.figures writes this block) -->
    ...the command that reproduces it and the table...
    <!-- /figure: trace -->

From the repository root:

* ``python -m kvpool.replay.figures`` rewrites every block from the JSON files;
* ``python -m kvpool.replay.figures --run quick trace`` replays those figures first (their
  JSON files are rewritten; ``--run all`` replays every figure);
* ``python -m kvpool.replay.figures --bench hashing copy`` runs those benchmarks first, each
  replacing its document in ``docs/figures/bench`` (the benchmark tables:
  :mod:`kvpool.replay.bench_figures`);
* ``python -m kvpool.replay.figures --check`` rewrites nothing and exits 1 naming every block
  that differs from what the JSON says (the test suite runs it, and replays the quick figures
  to compare their JSON with what the replay prints now).

Replays are deterministic (see :func:`kvpool.replay.report.strip_wall`): the same command
gives the same figures on any machine, except the wall-clock ones, which no table here shows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvpool.replay.bench_figures import BENCH_TABLES, RUNS, bench_table
from kvpool.replay.report import best_marks, fmt_ms, fmt_pct

__all__ = ["FIGURES", "BenchFigure", "Figure", "block_pattern", "check", "render_block", "run",
           "run_bench", "write"]

FIGURE_DIR: Final = Path("docs") / "figures"
BENCH_DIR: Final = FIGURE_DIR / "bench"
DOCUMENTS: Final = ("README.md", "docs/*.md")
"""The markdown files (relative to the root, globs allowed) whose blocks this module owns."""

Table = Callable[[Sequence[dict[str, Any]]], list[str]]


@dataclass(frozen=True)
class Figure:
    """A figure: the ``kvpool replay`` arguments of each run, and its table."""

    name: str
    runs: tuple[tuple[str, ...], ...]
    table: Table
    quick: bool = False
    """Replayed by the test suite in seconds (the others take minutes and are replayed by
    ``--run``)."""

    def json_paths(self, root: Path) -> list[Path]:
        if len(self.runs) == 1:
            return [root / FIGURE_DIR / f"{self.name}.json"]
        return [root / FIGURE_DIR / f"{self.name}-{i}.json" for i in range(len(self.runs))]

    def commands(self) -> list[str]:
        return [" ".join([".venv/bin/kvpool", "replay", *args]) for args in self.runs]

    def body(self, docs: Sequence[dict[str, Any]]) -> list[str]:
        return ["```bash", *self.commands(), "```", "", *self.table(docs)]


@dataclass(frozen=True)
class BenchFigure:
    """A benchmark figure: :data:`~kvpool.replay.bench_figures.BENCH_TABLES`' table of this
    name, from the documents in ``docs/figures/bench`` (rerun by ``--bench``)."""

    name: str
    quick: bool = False

    def documents(self) -> list[str]:
        return BENCH_TABLES[self.name].documents()

    def json_paths(self, root: Path) -> list[Path]:
        return [root / BENCH_DIR / f"{name}.json" for name in self.documents()]

    def body(self, docs: Sequence[dict[str, Any]]) -> list[str]:
        return bench_table(BENCH_TABLES[self.name],
                           dict(zip(self.documents(), docs, strict=True)))


def _policy_table(docs: Sequence[dict[str, Any]]) -> list[str]:
    """Token hit rate, its share of the run's Belady bound and TTFT p50 / p99 per policy, the
    best of each column in bold."""
    sums = docs[0]["policies"]
    columns: list[tuple[str, Callable[[dict[str, Any]], float], Callable[[float], str], str]] = [
        ("token hit rate", lambda s: s["token_hit_rate"], fmt_pct, "max"),
        ("of Belady", lambda s: s["vs_bounds"]["of_belady"], fmt_pct, "max"),
        ("TTFT p50", lambda s: s["ttft_s"]["p50"], fmt_ms, "min"),
        ("TTFT p99", lambda s: s["ttft_s"]["p99"], fmt_ms, "min"),
    ]
    cells = [[f"`{s['policy']}`"] for s in sums]
    for _, value, text, best in columns:
        vals = [value(s) for s in sums]
        shown = [text(v) for v in vals]
        for row, t, m in zip(cells, shown, best_marks(shown, vals, best), strict=True):
            row.append(f"**{t}**" if m else t)
    return [
        "| policy | " + " | ".join(c[0] for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
        *("| " + " | ".join(row) + " |" for row in cells),
    ]


def _shared_tier_table(docs: Sequence[dict[str, Any]]) -> list[str]:
    """Local tiers only (the first run) against a shared remote tier (the second)."""
    local, shared = docs[0]["policies"], docs[1]["policies"]
    lines = [
        "| policy | token hit rate, local tiers | with the shared tier | from the shared tier "
        "| TTFT p50 | TTFT p99 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(local, shared, strict=True):
        lines.append(
            f"| `{a['policy']}` | {fmt_pct(a['token_hit_rate'])} | "
            f"{fmt_pct(b['token_hit_rate'])} | {fmt_pct(b['remote_hit_rate'])} | "
            f"{fmt_ms(a['ttft_s']['p50'])} → {fmt_ms(b['ttft_s']['p50'])} | "
            f"{fmt_ms(a['ttft_s']['p99'])} → {fmt_ms(b['ttft_s']['p99'])} |"
        )
    return lines


_TRACE: Final = ("--trace", "conversation", "--limit")
FIGURES: Final[tuple[Figure | BenchFigure, ...]] = (
    Figure("quick", (("--requests", "300", "--workers", "2",
                      "--policies", "cost,trtllm,approx,round-robin"),),
           _policy_table, quick=True),
    Figure("synthetic", (("--policies", "cost,trtllm,approx,round-robin"),), _policy_table),
    Figure("trace", ((*_TRACE, "1000", "--gpu-mem", "16GiB", "--host-mem", "64GiB",
                      "--policies", "cost,trtllm,approx,round-robin"),), _policy_table),
    Figure("shared-tier", (
        (*_TRACE, "1000", "--gpu-mem", "16GiB", "--policies", "cost,trtllm,round-robin"),
        (*_TRACE, "1000", "--gpu-mem", "16GiB", "--policies", "cost,trtllm,round-robin",
         "--remote-mem", "256GiB"),
    ), _shared_tier_table),
    *(BenchFigure(name) for name in BENCH_TABLES),
)


def block_pattern(name: str) -> re.Pattern[str]:
    """A figure's block in a markdown file, its two comments included."""
    return re.compile(
        rf"<!-- figure: {re.escape(name)} \(.*?\) -->\n.*?<!-- /figure: {re.escape(name)} -->",
        re.S,
    )


def render_block(figure: Figure | BenchFigure, root: Path) -> str:
    """The block as this module writes it: the commands, then the table."""
    docs = [json.loads(p.read_text()) for p in figure.json_paths(root)]
    return "\n".join([
        f"<!-- figure: {figure.name} (python -m kvpool.replay.figures writes this block) -->",
        *figure.body(docs),
        f"<!-- /figure: {figure.name} -->",
    ])


def _documents(root: Path) -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern)})


def _rewritten(root: Path) -> dict[Path, tuple[str, str]]:
    """Per markdown file holding a figure block: (its text, its text with every block
    rewritten). A block whose figure is unknown raises ``KeyError``."""
    figures = {f.name: f for f in FIGURES}
    out: dict[Path, tuple[str, str]] = {}
    for path in _documents(root):
        text = path.read_text()
        names = re.findall(r"<!-- figure: (\S+) \(", text)
        new = text
        for name in names:
            block = render_block(figures[name], root)
            new = block_pattern(name).sub(lambda _m, b=block: b, new)  # type: ignore[misc]
        if names:
            out[path] = (text, new)
    return out


def check(root: Path) -> list[str]:
    """The files (relative to ``root``) whose figure blocks differ from the JSON."""
    return [str(p.relative_to(root)) for p, (old, new) in _rewritten(root).items()
            if old != new]


def write(root: Path) -> list[str]:
    """Rewrite every figure block from the JSON; the files that changed."""
    changed = []
    for path, (old, new) in _rewritten(root).items():
        if old != new:
            path.write_text(new)
            changed.append(str(path.relative_to(root)))
    return changed


def run(figure: Figure, root: Path, out_dir: Path | None = None) -> list[Path]:
    """Replay ``figure``'s runs (their tables print), writing their JSON into ``out_dir``
    (default: the figure's files under ``root``)."""
    paths = figure.json_paths(root)
    if out_dir is not None:
        paths = [out_dir / p.name for p in paths]
    for args, path in zip(figure.runs, paths, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        # the command itself, in a child: the replay layer does not import the CLI above it
        code = subprocess.call([sys.executable, "-m", "kvpool.cli", "replay", *args,
                                "--no-progress", "--json", str(path)])
        if code != 0:
            raise SystemExit(f"kvpool replay {' '.join(args)} exited {code}")
    return paths


def run_bench(name: str, root: Path) -> Path:
    """Run the benchmark of document ``name`` (its table prints) from ``root`` and keep what it
    wrote as ``docs/figures/bench/<name>.json``. A benchmark with ``--out`` writes there itself
    (the command its document records then names that path, not a temporary one); the others
    write into a temporary results directory, moved there. A benchmark writes its document
    only once it has finished: one that fails leaves the old document as it was."""
    bench = RUNS[name]
    document = BENCH_DIR / f"{name}.json"  # relative to root, as the command names it
    path = root / document
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, f"benchmarks/{bench.script}", *bench.args]
        argv += ["--out", document.as_posix()] if bench.out else []
        code = subprocess.call(argv, cwd=root, env={**os.environ, "KVPOOL_RESULTS_DIR": tmp})
        if code != 0:
            raise SystemExit(f"{bench.command()} exited {code}")
        if not bench.out:
            shutil.move(Path(tmp) / f"{bench.writes or name}.json", path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.replay.figures",
        description="Rewrite the figure tables of README.md and docs/*.md from the replays' "
        "JSON in docs/figures (run from the repository root).",
    )
    names = [f.name for f in FIGURES if isinstance(f, Figure)]
    parser.add_argument("--run", nargs="+", metavar="FIGURE", choices=[*names, "all"],
                        help=f"replay these figures first ({', '.join(names)}, or all)")
    parser.add_argument("--bench", nargs="+", metavar="DOC", choices=sorted(RUNS),
                        help="run these benchmarks first, each replacing its document "
                        f"docs/figures/bench/DOC.json ({', '.join(sorted(RUNS))})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a block differs from the JSON")
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository root (default: the current directory)")
    args = parser.parse_args(argv)
    root: Path = args.root
    for figure in FIGURES:
        if isinstance(figure, Figure) and args.run and ("all" in args.run
                                                        or figure.name in args.run):
            run(figure, root)
    for name in args.bench or ():
        run_bench(name, root)
    if args.check:
        stale = check(root)
        for name in stale:
            print(f"{name}: a figure block differs from docs/figures (run python -m "
                  "kvpool.replay.figures)", file=sys.stderr)
        return 1 if stale else 0
    for name in write(root):
        print(f"rewrote the figures of {name}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
