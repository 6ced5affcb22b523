"""The README and docs as a newcomer reads them: the first screen says who kvpool is for and
links the comparison; their Python runs as written; every command in them parses with the
real command line, names files that exist, and runs as written from the repository root (the
quick ones to their end, the long benchmarks and trace replays for their first seconds, the
few that cannot run here named with the reason); the test command is what CI runs; every
figure table equals what ``python -m kvpool.replay.figures`` writes from the replays' JSON, and
the replays print that JSON today; every link stays inside the repository and leads
somewhere."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.cli import build_parser
from kvpool.replay import figures
from kvpool.replay.report import strip_wall

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ["README.md", "CHANGELOG.md",
        *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def commands(text: str) -> list[str]:
    """Every command of the bash blocks, continuation lines joined, split at ``&&``, ``;``
    and a trailing ``&``."""
    joined = " ".join(code.replace("\\\n", " ") for code in blocks(text, "bash")).split("\n")
    return [part.strip() for line in joined for part in re.split(r"&&|;|&(?!&)", line)
            if part.strip()]


def test_the_first_screen_names_the_users_and_links_the_comparison() -> None:
    first = "\n".join(README.splitlines()[:40])
    for who in ("Engine builders", "vLLM, SGLang or TensorRT-LLM fleets",
                "Researchers replaying traces"):
        assert who in first
    assert "](#how-kvpool-compares)" in first
    assert "## How kvpool compares" in README
    table = README.split("## How kvpool compares")[1].split("\n## ")[0]
    header = next(line for line in table.splitlines() if line.startswith("| |"))
    for other in ("vLLM", "SGLang", "LMCache", "Dynamo", "KVBM", "llm-d"):
        assert other in header


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks((ROOT / d).read_text(), "python")])
def test_the_python_fragments_run_as_written(doc: str) -> None:
    namespace: dict[str, object] = {}
    for code in blocks((ROOT / doc).read_text(), "python"):  # in order, as a reader pastes
        exec(compile(code, doc, "exec"), namespace)


def test_the_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    lines = [line for code in blocks(README, "bash") for line in code.splitlines()]
    test_command = next(c for c in lines if c.endswith("python -m pytest"))
    assert test_command in ci


@pytest.mark.parametrize("doc", DOCS)
def test_every_kvpool_command_parses_and_names_files_that_exist(doc: str) -> None:
    parser = build_parser()
    for command in commands((ROOT / doc).read_text()):
        words = shlex.split(command)
        if words[0] == ".venv/bin/kvpool":
            parser.parse_args(words[1:])  # a bad option exits 2 here
            if "--config" in words:
                assert (ROOT / words[words.index("--config") + 1]).is_file(), command
        elif words[0] == ".venv/bin/python" and words[1].startswith("benchmarks/"):
            script = ROOT / words[1]
            assert script.is_file(), command
            flags = [w for w in words[2:] if w.startswith("--")]
            if flags:
                usage = _help(script)
                assert all(f in usage for f in flags), command


def _help(script: Path) -> str:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_figure_block_equals_what_the_generator_writes() -> None:
    assert figures.check(ROOT) == []
    written = "".join((ROOT / d).read_text() for d in DOCS)
    for figure in figures.FIGURES:  # every figure is shown somewhere
        assert f"<!-- figure: {figure.name} (" in written, figure.name


NOT_FIGURES = {  # tables of words (options, fields, names): no measured figure, no generator
    ("README.md", "| | kvpool | vLLM prefix caching |"),
    ("README.md", "| command | what it does |"),
    ("docs/architecture.md", "| word | meaning |"),
    ("docs/architecture.md", "| # | invariant | checked by |"),
    ("docs/benchmarks.md", "| benchmark | what it measures |"),
    ("docs/compatibility.md", "| algorithm | tree key (digest) | what an event carries |"),
    ("docs/hybrid.md", "| call | what it does for a state group `g` |"),
    ("docs/hybrid.md", "| `checkpoint_policy` | boundaries saved |"),
    ("docs/hybrid.md", "| where | what is stored | key |"),
    ("docs/integrations.md", "| key | default | meaning |"),
    ("docs/integrations.md", "| metric | labels | what |"),
    ("docs/router.md", "| key | type | default | meaning |"),
    ("docs/router.md", "| field | type | meaning |"),
    ("docs/router.md", "| field | meaning |"),
    ("docs/router.md", "| endpoint | what it does |"),
}


def _tables_outside_figures(text: str) -> list[str]:
    """The header line of every markdown table outside a figure block and a code block."""
    text = re.sub(r"<!-- figure: (\S+) \(.*?\) -->\n.*?<!-- /figure: \1 -->", "", text,
                  flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = text.split("\n")
    return [line.lstrip() for prev, line in zip(["", *lines], lines, strict=False)
            if line.lstrip().startswith("|") and not prev.lstrip().startswith("|")]


@pytest.mark.parametrize("doc", DOCS)
def test_every_table_is_a_generated_figure_or_named_as_no_figure(doc: str) -> None:
    allowed = {h for d, h in NOT_FIGURES if d == doc}
    for header in _tables_outside_figures((ROOT / doc).read_text()):
        assert any(header.startswith(h) for h in allowed), (
            f"{doc}: the table {header!r} has no generator: put it in a figure block of "
            "kvpool.replay.figures, or name it in NOT_FIGURES if it holds no figure")


def test_a_changed_benchmark_document_makes_its_table_stale(tmp_path: Path) -> None:
    """The check reads the documents: one changed figure makes the table differ."""
    import shutil

    for doc in ("README.md", "docs"):
        src = ROOT / doc
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / doc)
    assert figures.check(tmp_path) == []
    path = tmp_path / "docs" / "figures" / "bench" / "bench_eviction.json"
    doc = json.loads(path.read_text())
    next(r for r in doc["rows"] if r["keys"] == "w1")["us_per_block"] += 1.0
    path.write_text(json.dumps(doc))
    assert figures.check(tmp_path) == ["docs/benchmarks.md"]


def test_every_benchmark_document_is_a_run_or_names_where_it_was_transcribed() -> None:
    for figure in figures.FIGURES:
        if not isinstance(figure, figures.BenchFigure):
            continue
        for path in figure.json_paths(ROOT):
            doc = json.loads(path.read_text())
            if "source" in doc:
                assert re.match(r"transcribed from [0-9a-f]{7,40} \(", doc["source"]), path
            else:  # a run: its machine, its load and its command
                machine = doc["machine"]
                assert machine["cpus"] >= 1 and len(machine["load"]) == 3, path
                assert machine["command"].startswith(".venv/bin/python benchmarks/"), path


def _replays_print_the_kept_json(name: str, tmp_path: Path) -> None:
    figure = next(f for f in figures.FIGURES
                  if isinstance(f, figures.Figure) and f.name == name)
    fresh = figures.run(figure, ROOT, out_dir=tmp_path)
    for new, kept in zip(fresh, figure.json_paths(ROOT), strict=True):
        a = strip_wall(json.loads(new.read_text()))
        b = strip_wall(json.loads(kept.read_text()))
        a.pop("kvpool_version"), b.pop("kvpool_version")
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), kept


@pytest.mark.parametrize("name", [f.name for f in figures.FIGURES
                                  if isinstance(f, figures.Figure) and f.quick])
def test_the_quick_replays_print_the_json_behind_the_tables(name: str, tmp_path: Path) -> None:
    _replays_print_the_kept_json(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["synthetic"])
def test_the_slower_replays_print_the_json_behind_the_tables(name: str,
                                                             tmp_path: Path) -> None:
    _replays_print_the_kept_json(name, tmp_path)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_links_stay_inside_the_repository_and_resolve(doc: str) -> None:
    path = ROOT / doc
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.is_relative_to(ROOT), f"{doc}: {target} leaves the repository"
        assert resolved.exists(), f"{doc}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved.read_text()), f"{doc}: no heading #{anchor}"


def _section_script(title: str) -> str:
    """The bash block of a README section, its install line left out (the suite runs in an
    installed venv), with ``.venv/bin/`` this interpreter's when the repository has none."""
    section = README.split(f"## {title}\n")[1].split("\n## ")[0]
    (code,) = blocks(section, "bash")
    lines = [line for line in code.splitlines() if not line.startswith("python3 -m venv")]
    script = "\n".join(lines)
    if not (ROOT / ".venv" / "bin" / "kvpool").exists():
        script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    return script


def _busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.parametrize(("title", "ports", "expected"), [
    ("Quickstart 2: serve a model and chat", (8000,), ["Paris", '"cached_tokens"']),
    ("Quickstart 3: a router in front of workers", (8000, 8001, 9000),
     ['"choices"', '"workers"', '"w0"', '"w1"']),
])
def test_a_quickstart_runs_as_written(title: str, ports: tuple[int, ...],
                                      expected: list[str]) -> None:
    pytest.importorskip("torch")
    if any(_busy(p) for p in ports):
        pytest.skip(f"a port of {ports} is taken on this machine")
    proc = subprocess.Popen(["bash", "-c", "set -e\n" + _section_script(title)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=540)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, err[-2000:]
    for text in expected:
        assert text in out, out[-2000:]


def test_the_licences_are_shipped_and_named() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    for name in project["license-files"]:
        assert (ROOT / name).is_file(), name
    assert "src/kvpool/data/LICENSE-mooncake-traces.txt" in project["license-files"]
    assert "LICENSE-mooncake-traces.txt" in (ROOT / "src/kvpool/data/README.md").read_text()


# Every command of README and docs is run here as written, or named below with the reason it
# is not. The quickstart sections run whole (test_a_quickstart_runs_as_written); the install
# lines are the test command's own, which CI runs before this suite exists.
_INSTALLS = ("python3 -m venv .venv", ".venv/bin/pip install", "bash tests/peers/install.sh")
NOT_RUN = {
    'pip install "kvpool[remote]"':
        "installs kvpool into an engine's own environment (the test command installs the "
        "same extra into this one)",
    "curl localhost:8000/v1/chat/completions":
        "asks a router that the reader has running (Quickstart 3 runs a router and sends it a "
        "request; tests/router/test_router_openai_cluster.py sends this chat)",
    "python -m sglang.launch_server":
        "starts SGLang itself: it needs a GPU and the model's weights (tests/integrations "
        "drives SGLang's own storage code instead)",
}
# Commands that finish within FULL_S seconds run to their end. The longer ones (benchmarks of a
# minute or more, 1,000-request trace replays: together well over the suite's ten minutes) start
# together and run for START_S seconds: long enough to import, parse their options, find their
# data and begin, which is where a command "as written" breaks (a missing module, a renamed
# flag, a moved file); then they get the reader's Ctrl-C. Replays that a figure test above
# already runs with the same options are not run twice.
FULL_S = 90.0
START_S = 20.0
LONG = ("benchmarks/bench_hashing.py", "benchmarks/bench_admission.py",
        "benchmarks/bench_events.py", "benchmarks/bench_router.py",
        "benchmarks/bench_router_service.py", "benchmarks/bench_hitrate.py",
        "benchmarks/bench_copy.py", "benchmarks/bench_persist.py", "benchmarks/bench_remote.py",
        "benchmarks/bench_engine.py", "benchmarks/bench_vllm_tier.py",
        "benchmarks/fuzz_decoders.py", "benchmarks/bench_hybrid.py",
        "benchmarks/bench_router_nats.py", "--trace conversation")


def _quickstart_lines() -> set[str]:
    titles = re.findall(r"^## (Quickstart [23]: .+)$", README, re.M)
    return {c for t in titles for c in commands(README.split(f"## {t}\n")[1].split("\n## ")[0])}


def _run_by_a_figure_test(command: str) -> bool:
    """Does a figure test run this replay (the same parsed options)?"""
    words = shlex.split(command)
    if words[:2] != [".venv/bin/kvpool", "replay"]:
        return False
    parser = build_parser()
    args = vars(parser.parse_args(words[1:]))
    run = [f for f in figures.FIGURES
           if isinstance(f, figures.Figure) and (f.quick or f.name == "synthetic")]
    return any(args == vars(parser.parse_args(["replay", *argv]))
               for f in run for argv in f.runs)


def _runnable() -> list[tuple[str, str]]:
    quick = _quickstart_lines()
    test_command = next(line for code in blocks(README, "bash") for line in code.splitlines()
                        if line.endswith("python -m pytest"))
    quick |= {part.strip() for part in test_command.split("&&")}  # this suite, CI's command
    out = []
    for doc in DOCS:
        for command in commands((ROOT / doc).read_text()):
            if (command in quick or command.startswith(_INSTALLS)
                    or any(command.startswith(k) for k in NOT_RUN)
                    or _run_by_a_figure_test(command)):
                continue
            if (doc, command) not in out:
                out.append((doc, command))
    return out


def test_every_command_is_run_or_says_why_not() -> None:
    named = [k for k in NOT_RUN if not any(c.startswith(k) for d in DOCS
                                           for c in commands((ROOT / d).read_text()))]
    assert named == [], "NOT_RUN names commands no document has any more"
    assert _runnable(), "no command found"
    for doc, command in _runnable():
        assert command.startswith((".venv/bin/kvpool ", ".venv/bin/python benchmarks/")), (
            f"{doc}: {command!r} is neither run here nor named in NOT_RUN")


def _start(command: str, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    """The command from the repository root as the reader pastes it; its results go to a
    temporary directory (KVPOOL_RESULTS_DIR) so the repository's own stay as they are."""
    if not (ROOT / ".venv" / "bin" / "kvpool").exists():
        command = command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    env = {**os.environ, "KVPOOL_RESULTS_DIR": str(tmp_path / name)}
    with open(tmp_path / f"{name}.out", "wb") as out, open(tmp_path / f"{name}.err", "wb") as err:
        return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=out,
                                stderr=err, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "command"),
                         [(d, c) for d, c in _runnable() if not any(m in c for m in LONG)])
def test_a_documented_command_runs_as_written(doc: str, command: str, tmp_path: Path) -> None:
    proc = _start(command, tmp_path, "cmd")
    try:
        proc.wait(timeout=FULL_S)
    finally:
        _stop(proc)
    err = (tmp_path / "cmd.err").read_text()
    assert proc.returncode == 0, f"{doc}: {command!r} exited {proc.returncode}: {err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert (tmp_path / "cmd.out").read_text().strip(), f"{doc}: {command!r} printed nothing"


@pytest.mark.slow
def test_the_long_commands_start_as_written(tmp_path: Path) -> None:
    long = [(d, c) for d, c in _runnable() if any(m in c for m in LONG)]
    assert len(long) >= 10
    procs = [_start(c, tmp_path, str(i)) for i, (_, c) in enumerate(long)]
    try:
        time.sleep(START_S)
        running = [p for p in procs if p.poll() is None]
        # what each printed on stderr before the Ctrl-C (its own handling of it may log)
        before = [(tmp_path / f"{i}.err").read_text() for i in range(len(long))]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)  # the reader's Ctrl-C
        deadline = time.monotonic() + 10  # 10 s for all of them to clean up, not each
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    finally:
        for proc in procs:
            _stop(proc)
    for i, ((doc, command), proc) in enumerate(zip(long, procs, strict=True)):
        err = (tmp_path / f"{i}.err").read_text()
        if proc not in running:  # it ended by itself within START_S
            assert proc.returncode == 0, f"{doc}: {command!r}: {err[-2000:]}"
        assert "Traceback" not in before[i], f"{doc}: {command!r}: {before[i][-2000:]}"
