"""The README as a newcomer reads it: its Python runs as written, its commands parse with the
real command line, its test command is what CI runs, and every link stays inside the
repository and leads somewhere."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvpool.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_the_python_fragments_run_as_written() -> None:
    fragments = blocks("python")
    assert len(fragments) == 3
    namespace: dict[str, object] = {}
    for code in fragments:  # in order, as a reader pastes them into one session
        exec(compile(code, "README.md", "exec"), namespace)


def test_the_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for code in blocks("bash") for line in code.splitlines()]
    test_command = next(c for c in commands if c.endswith("python -m pytest"))
    assert test_command in ci


def test_every_kvpool_command_parses_and_names_files_that_exist() -> None:
    lines = " ".join(code.replace("\\\n", " ") for code in blocks("bash")).split("\n")
    commands = [part.strip() for line in lines for part in re.split(r"&&|;|&(?!&)", line)]
    shown = [shlex.split(c)[1:] for c in commands if c.startswith(".venv/bin/kvpool")]
    assert {args[0] for args in shown if args} >= {"replay", "router"}
    parser = build_parser()
    for args in shown:
        parser.parse_args(args)  # a bad option exits 2 here
        if "--config" in args:
            assert (ROOT / args[args.index("--config") + 1]).is_file()


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]
)
def test_links_stay_inside_the_repository_and_resolve(doc: str) -> None:
    path = ROOT / doc
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if target.startswith(("http://", "https://")):
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc}: {target} leaves the repository"
        assert resolved.exists(), f"{doc}: {target} does not exist"
