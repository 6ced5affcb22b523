"""``kvpool replay`` as a user runs it: a subprocess, its table, its files and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import assert_refused, kvpool

from kvpool.cli import main

# A small synthetic workload and cluster that replay in about a second.
SMALL = (
    "--requests", "30", "--system-prompt-tokens", "96", "--agent-prefix-tokens", "192",
    "--user-tokens", "40", "--output-tokens", "24", "--tool-output-tokens", "40",
    "--max-prompt-tokens", "600", "--rate", "8", "--think-time", "0.5",
    "--min-think-time", "0.2", "--agent-think-time", "0.2",
    "--workers", "2", "--gpu-blocks", "64", "--tokens-per-block", "8",
    "--max-batch-size", "8", "--max-num-tokens", "256", "--no-progress",
)


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def mooncake_lines(n: int) -> list[str]:
    """Conversations of growing hash-id prefixes (tokens_per_hash_id 16)."""
    out = []
    for i in range(n):
        conv, turn = i % 4, i // 4
        ids = [1000 * conv + k for k in range(2 + turn)]
        out.append(json.dumps({
            "timestamp": 250 * i, "input_length": 16 * len(ids) - 3, "output_length": 5,
            "hash_ids": ids,
        }))
    return out


def test_replay_prints_the_comparison_and_writes_json_markdown_plot(tmp_path: Path) -> None:
    js, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    # two policies on two processes (--jobs defaults to 2): the spawned path end to end
    res = kvpool("replay", *SMALL, "--policies", "cost,round-robin", "--jobs", "2",
                 "--json", str(js), "--markdown", str(md), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert "token hit rate" in res.stdout and "TTFT p99" in res.stdout
    assert "cost" in res.stdout and "round-robin" in res.stdout
    data = json.loads(js.read_text())
    assert [p["policy"] for p in data["policies"]] == ["cost", "round-robin"]
    assert data["workload"]["requests"] == 30
    assert data["cluster"]["workers"] == 2
    unlimited = data["bounds"]["unlimited"]["token_hit_rate"]
    for p in data["policies"]:
        assert p["finished"] + p["rejected"] == 30
        assert 0 < p["token_hit_rate"] <= 1
        assert p["full_block_hit_rate"] <= p["belady"]["token_hit_rate"]
        assert p["full_block_hit_rate"] <= unlimited
        assert p["ttft_s"]["p50"] <= p["ttft_s"]["p90"] <= p["ttft_s"]["p99"]
        assert p["events"]["applied"] > 0
    table = md.read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| policy"))
    assert table[header + 2].startswith("| `cost`")
    assert table[header + 3].startswith("| `round-robin`")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_with_limit_over_zmq(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "conv.jsonl", mooncake_lines(24))
    out = tmp_path / "t.json"
    res = kvpool("replay", "--trace", str(trace), "--limit", "20", "--tokens-per-hash-id", "16",
                 "--workers", "2", "--gpu-blocks", "40", "--tokens-per-block", "8",
                 "--policies", "cost,round-robin", "--transport", "zmq", "--jobs", "1",
                 "--no-progress", "--json", str(out), "--markdown", "-")
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["workload"]["requests"] == 20
    assert data["workload"]["metadata"]["source"] == "mooncake"
    assert data["cluster"]["transport"] == "zmq"
    cost = data["policies"][0]
    assert cost["policy"] == "cost" and cost["reused_tokens"] > 0
    assert cost["events"]["applied"] > 0
    assert "| `cost` |" in res.stdout  # --markdown - prints the table


def test_bad_trace_line_is_named_without_a_traceback(tmp_path: Path) -> None:
    lines = mooncake_lines(3)
    lines.insert(2, '{"timestamp": 5, "input_length": 10, "output_length": 2}')
    trace = write_trace(tmp_path / "bad.jsonl", lines)
    res = kvpool("replay", "--trace", str(trace), "--tokens-per-hash-id", "16", "--no-progress")
    assert_refused(res, "line 3", "hash_ids")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--trace", "no-such-trace.jsonl"), "trace file not found"),
        (("--limit", "5"), "--limit applies to --trace"),
        (("--gpu-blocks", "10", "--gpu-mem", "1GiB"), "--gpu-blocks replaces"),
        (("--host-blocks", "10"), "--host-blocks/--disk-blocks need --gpu-blocks"),
        (("--model", "llama-3-8b", "--gpu-mem", "64MiB"), "GPU"),
        (("--model", "no-such-model"), "unknown model preset 'no-such-model'"),
        (("--max-batch-size", "64", "--max-num-tokens", "32"), "max_num_tokens"),
    ],
)
def test_errors_exit_2_with_a_message(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    small = () if "--trace" in args else ("--requests", "5")
    assert main(["replay", *small, "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool replay: error: ") and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policies", "cost,fastest"), "unknown policy fastest"),
        (("--policies", "cost,cost"), "policies repeat"),
        (("--transport", "pigeon"), "invalid choice: 'pigeon'"),
        (("--workers", "0"), "expected an integer >= 1"),
        (("--rate", "-1"), "expected a finite number >= 0"),
    ],
)
def test_usage_errors_exit_2(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
