"""What a replay prints and writes reads right: "best" only where better is defined, the
markdown holds every row of the terminal table, header lines and titles fit 80 columns and
break only between phrases; bad flags and bad YAML name the flag or the key path in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from kvpool.cli import main
from kvpool.replay import synthetic_workload
from kvpool.replay.cluster import ClusterConfig, ReplayResult, block_cache, replay
from kvpool.replay.report import _describe, render, to_markdown, wrap_phrases
from kvpool.replay.simmodel import SchedulerConfig


def small_replay(**kw: object) -> ReplayResult:
    wl = synthetic_workload(
        num_requests=30, system_prompt_tokens=96, agent_prefix_tokens=192, user_tokens=40,
        output_tokens=24, tool_output_tokens=40, max_prompt_tokens=600, arrival_rate_per_s=8.0,
        think_time_s=0.5, min_think_time_s=0.2, agent_think_time_s=0.2,
    )
    cluster = ClusterConfig(cache=block_cache(48, tokens_per_block=8), workers=2,
                            scheduler=SchedulerConfig(max_batch_size=8, max_num_tokens=256),
                            **kw)  # type: ignore[arg-type]
    return replay(wl, cluster, ["cost", "round-robin", "random"])


@pytest.fixture(scope="module")
def shared() -> ReplayResult:
    """A replay with a shared remote tier: its table has the "from shared tier" row."""
    return small_replay(remote_bytes=64, remote_block_bytes=(1,))


def terminal(result: ReplayResult, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    render(result, console)
    return console.export_text().splitlines()


def test_gpu_busy_is_never_marked_best_and_a_latency_row_is(shared: ReplayResult) -> None:
    lines = terminal(shared, width=200)
    busy = next(line for line in lines if line.startswith("│ GPU busy %"))
    assert "*" not in busy
    md = to_markdown(shared)
    busy_md = next(line for line in md.splitlines() if line.startswith("| GPU busy %"))
    assert "**" not in busy_md
    bound = next(line for line in md.splitlines() if line.startswith("| ↳ Belady bound %"))
    assert "**" not in bound
    header = next(line for line in md.splitlines() if line.startswith("| policy"))
    for name in ("GPU busy", "Belady bound", "evicted blocks"):  # better neither way
        column = header.split(" | ").index(name)
        cells = [line.split(" | ")[column] for line in md.splitlines()
                 if line.startswith("| `")]
        assert cells and not any("**" in c for c in cells), name
    ttft = next(line for line in lines if line.startswith("│ TTFT p99 (ms)"))
    ttft_md = next(line for line in md.splitlines() if line.startswith("| TTFT p99 (ms)"))
    assert ("*" in ttft) == ("**" in ttft_md)  # the same rule in both


def test_the_markdown_has_every_row_of_the_terminal_table(shared: ReplayResult) -> None:
    lines = terminal(shared, width=200)
    labels = [line.split("│")[1].strip() for line in lines
              if line.startswith("│ ") and "metric" not in line]
    assert "from shared tier %" in labels
    md = to_markdown(shared)
    md_labels = [line.split("|")[1].strip().removeprefix("↳ ") for line in md.splitlines()
                 if line.startswith("| ") and not line.startswith(("| policy", "| `"))]
    assert md_labels[1:] == labels  # after the header row "metric"
    headline = next(line for line in md.splitlines() if line.startswith("| policy"))
    assert "from shared tier" in headline


@pytest.mark.parametrize("width", [60, 80])
def test_header_lines_fit_and_break_only_between_phrases(shared: ReplayResult,
                                                         width: int) -> None:
    lines = terminal(shared, width=width)
    assert max(map(len, lines)) <= width
    text = [line.strip() for line in lines]
    for phrases in _describe(shared):  # each line is whole phrases, in order
        joined = " ".join(phrases)
        start = next(i for i, line in enumerate(text) if joined.startswith(line))
        got = []
        for line in text[start:]:
            got.append(line)
            if " ".join(got) == joined:
                break
            assert joined.startswith(" ".join(got)), (got, joined)
        assert " ".join(got) == joined
        assert all(" ".join(got[: i + 1]).removeprefix(" ") in _prefixes(phrases)
                   for i in range(len(got)))


def _prefixes(phrases: list[str]) -> set[str]:
    return {" ".join(phrases[:n]) for n in range(1, len(phrases) + 1)}


@given(st.lists(st.text(alphabet="abc xyz,;", min_size=1, max_size=30).map(str.strip)
                .filter(bool), min_size=1, max_size=12),
       st.integers(20, 100))
def test_wrap_phrases_keeps_each_phrase_whole(phrases: list[str], width: int) -> None:
    lines = wrap_phrases(phrases, width)
    assert " ".join(line.strip() for line in lines) == " ".join(phrases)
    for line in lines:
        assert len(line) <= width or line.strip() in phrases  # only a lone long phrase


def test_the_plan_heading_fits_80_columns(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--model", "llama-3-8b", "--gpu-mem", "40GiB", "--host-mem",
                 "200GiB", "--max-batch-size", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(map(len, out)) <= 80
    assert out[0].startswith("llama-3-8b: 32 tokens/block, GPU 40.00 GiB, host 200.00 GiB;")
    assert out[1].strip().startswith("8192 tokens/step")


def error_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = err.splitlines()
    assert 1 <= len(lines) <= 2, err
    return err


@pytest.mark.parametrize(("args", "named"), [
    (["replay", "--rate", "0"], "argument --rate: expected a number > 0"),
    (["replay", "--max-prompt-tokens", "10"], "--max-prompt-tokens 10 is shorter"),
    (["replay", "--agent-fraction", "2"], "--agent-fraction"),
])
def test_a_replay_flag_error_names_the_flag(args: list[str], named: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(args, capsys)
    assert named in err
    assert "arrival_rate_per_s" not in err and "_" not in err.split("error:")[1]


@pytest.mark.parametrize(("yaml_text", "named"), [
    ("listen: [\n", "not valid YAML: line 2, column 1:"),
    ("a: 1\n  b: 2\n", "not valid YAML: line 2, column 4: mapping values are not allowed"),
    ("listen: {host: 127.0.0.1, port: 99999}\nworkers: []\n", "listen.port:"),
    ("workers:\n  - {id: w0, kind: kvpool, zmq_endpont: 'tcp://127.0.0.1:1'}\n",
     "workers[0].zmq_endpont: unknown key"),
])
def test_a_yaml_error_is_one_line_with_the_key_path(yaml_text: str, named: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml_text)
    err = error_of(["router", "--config", str(path)], capsys)
    assert named in err and len(err.splitlines()) == 1
