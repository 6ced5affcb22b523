"""The command line explains itself: every bad option is one line on stderr and exit 2 (no
traceback, no work done), a replay that could admit nothing exits 1 saying what to change,
warnings and notes are one line each, tables fit 80 columns, and without a terminal a replay
logs progress lines."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.commands import replay as replay_command
from kvpool.commands.router import GC_THRESHOLDS, loop_factory, settle_gc

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "router-vllm.yaml")
# A synthetic workload and cluster that replay in well under a second.
SMALL = (
    "--requests", "30", "--system-prompt-tokens", "96", "--agent-prefix-tokens", "192",
    "--user-tokens", "40", "--output-tokens", "24", "--tool-output-tokens", "40",
    "--max-prompt-tokens", "600", "--rate", "8", "--workers", "2", "--tokens-per-block", "8",
    "--max-batch-size", "8", "--max-num-tokens", "256", "--jobs", "1",
)


def kvpool(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it, output piped (no terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
        env={**os.environ, "COLUMNS": str(columns)}, timeout=120,
    )


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_kvpool_alone_prints_usage_and_exits_2() -> None:
    res = kvpool()
    assert res.returncode == 2
    assert res.stderr.startswith("usage: kvpool") and "a command is required" in res.stderr
    assert res.stdout == ""


def test_router_port_out_of_range_is_one_line_from_the_real_command() -> None:
    res = kvpool("router", "--config", EXAMPLE, "--port", "99999")
    assert res.returncode == 2 and res.stdout == ""
    assert one_line(res.stderr) == (
        "kvpool router: error: argument --port: expected an integer in [0, 65535], got "
        "'99999' (see kvpool router --help)"
    )


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_router_port_out_of_range_is_one_line(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(["router", "--config", EXAMPLE, "--port", port], capsys)
    assert code == 2
    line = one_line(err)
    assert line.startswith("kvpool router: error: argument --port: expected an integer")
    assert "[0, 65535]" in line or "http" in line


def test_router_port_with_equals_and_unknown_log_level(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_main(["router", "--config", EXAMPLE, "--port=-1"], capsys)
    assert code == 2 and "argument --port" in one_line(err)
    code, _, err = run_main(["router", "--config", EXAMPLE, "--log-level", "CHATTY"], capsys)
    assert code == 2
    assert "unknown log level 'CHATTY'; expected one of DEBUG, INFO" in one_line(err)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "tiny", "--gpu-mem", "-5GiB", "--max-batch-size", "4"],
         "argument --gpu-mem: a size cannot be negative, got '-5GiB'"),
        (["replay", "--gpu-mem", "-5GiB"], "argument --gpu-mem: a size cannot be negative"),
        (["replay", "--host-mem=-1"], "argument --host-mem: a size cannot be negative"),
        (["replay", "--workers", "-2"], "argument --workers: expected an integer >= 1, got '-2'"),
        (["replay", "--trace", "conversation", "--requests", "50"],
         "--requests shape the synthetic workload, not a --trace"),
        (["replay", "--trace", "conversation", "--turns", "3", "--rate", "2"],
         "--turns, --rate shape the synthetic workload"),
        (["replay", "--tokens-per-hash-id", "16"], "--tokens-per-hash-id applies to --trace"),
        (["replay", "--gpu-blocks", "100", "--model", "tiny"], "--gpu-blocks replaces --model"),
        (["replay", "--gpu-blocks", "100", "--host-mem", "1GiB"],
         "--gpu-blocks replaces --host-mem"),
        (["replay", "--trace", "chat"], "trace file not found: chat"),
        (["replay", "--requets", "5"],
         "kvpool replay: error: unrecognized arguments: --requets 5 (see kvpool replay --help)"),
        (["router"], "kvpool router: error: the following arguments are required: --config"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(args, capsys)
    assert code == 2
    assert message in one_line(err) and out == ""


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_replay_output_files_are_checked_before_the_work(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing" / "out"
    code, out, err = run_main(["replay", *SMALL, flag, str(missing)], capsys)
    assert code == 2 and out == ""  # nothing replayed, nothing printed
    assert one_line(err) == (
        f"kvpool replay: error: {flag} {missing}: directory {missing.parent} does not exist"
    )
    code, out, err = run_main(["replay", *SMALL, flag, str(tmp_path)], capsys)
    assert code == 2 and out == "" and "is a directory" in one_line(err)


def test_plan_json_is_checked_before_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "nope" / "plan.json"
    args = ["plan", "--model", "tiny", "--gpu-mem", "1GiB", "--max-batch-size", "4"]
    code, out, err = run_main([*args, "--json", str(target)], capsys)
    assert code == 2 and out == "" and "does not exist" in one_line(err)


def test_replay_that_can_admit_nothing_exits_1_saying_what_to_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_main(["replay", "--gpu-blocks", "10", "--requests", "50"], capsys)
    assert code == 1 and out == ""
    line = one_line(err)
    assert line.startswith("kvpool replay: error: no request can ever be admitted")
    assert "a worker has 10" in line and "raise --gpu-blocks to at least" in line


def test_replay_warns_once_when_some_requests_can_never_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_main(
        ["replay", *SMALL, "--gpu-blocks", "40", "--policies", "round-robin", "--no-progress"],
        capsys,
    )
    assert code == 0 and "rejected (too long)" in out
    line = one_line(err)
    assert line.startswith("kvpool replay: warning: 8 of 30 requests need more than a worker's "
                           "40 GPU blocks")


def test_replay_says_when_it_raises_the_gpu_budget_for_a_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # request 12 of the conversation trace holds 87,169 prompt tokens: 8 GiB is too small
    code, out, err = run_main(["replay", "--trace", "conversation", "--limit", "12",
                               "--policies", "round-robin", "--no-progress"], capsys)
    assert code == 0 and "conversation_trace: 12 requests" in out
    line = one_line(err)
    assert line.startswith("kvpool replay: note: GPU budget raised from 8.00 GiB to 11.00 GiB")
    assert "--gpu-mem" in line


def test_plan_warns_when_the_gpu_pool_holds_far_less_than_a_typical_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model", "gemma-2-9b", "--max-batch-size", "64"]
    code, out, err = run_main([*args, "--gpu-mem", "40GiB"], capsys)
    assert code == 0 and "typical step need" in out
    line = one_line(err)
    assert line.startswith("kvpool plan: warning: layer group ")
    assert "of the 8,320 a typical step needs" in line
    code, _, err = run_main([*args, "--gpu-mem", "120GiB"], capsys)
    assert code == 0 and err == ""


def test_replay_without_a_terminal_logs_progress_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay_command, "PROGRESS_INTERVAL_S", 0.01)
    code, _, err = run_main(["replay", *SMALL, "--gpu-blocks", "200", "--requests", "400",
                             "--policies", "cost,round-robin"], capsys)
    assert code == 0
    lines = err.splitlines()
    assert lines[0] == "kvpool replay: 400 requests, policies cost, round-robin"
    ticks = [line for line in lines[1:] if "requests done of 400: cost" in line]
    assert len(ticks) >= 2 and len(ticks) == len(lines) - 1


def assert_fits_80(text: str) -> None:
    assert text.strip()
    for line in text.splitlines():
        assert len(line) <= 80, line
        assert "…" not in line, line


def test_plan_fits_80_columns_with_every_tier() -> None:
    res = kvpool("plan", "--model", "gemma-3-12b", "--gpu-mem", "40GiB", "--host-mem",
                 "100GiB", "--disk-mem", "1TiB", "--max-batch-size", "128")
    assert res.returncode == 0, res.stderr
    assert "disk slots" in res.stdout and "longest_sequence" in res.stdout
    assert_fits_80(res.stdout)
    assert_fits_80(kvpool("plan", "--list-models").stdout)


def test_replay_fits_80_columns_with_every_policy_and_tier() -> None:
    res = kvpool("replay", *SMALL, "--requests", "40", "--gpu-blocks", "48",
                 "--host-blocks", "64", "--disk-blocks", "64", "--no-progress")
    assert res.returncode == 0, res.stderr
    for policy in ("cost", "trtllm", "round-", "least-", "random"):
        assert policy in res.stdout
    assert_fits_80(res.stdout)


def test_router_event_loop_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert loop_factory("asyncio") is None
    if importlib.util.find_spec("uvloop") is None:
        assert loop_factory("auto") is None  # falls back to asyncio's
        code, _, err = run_main(["router", "--config", EXAMPLE, "--event-loop", "uvloop"], capsys)
        assert code == 2 and "needs uvloop" in err and len(err.strip().splitlines()) == 1
    else:
        factory = loop_factory("auto")
        assert factory is not None
        loop = factory()
        try:
            assert type(loop).__module__.startswith("uvloop")
        finally:
            loop.close()


def test_router_settles_the_collector_once_listening() -> None:
    """What exists once the router listens is frozen, and the collector runs on the
    router's thresholds (young generation well above Python's 700)."""
    before = gc.get_threshold()
    gc.unfreeze()
    try:
        obj = [object()]
        settle_gc()
        assert gc.get_threshold() == GC_THRESHOLDS != before
        assert GC_THRESHOLDS[0] > 700
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(obj) and all(o is not obj for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _typed_options() -> list[tuple[str, str]]:
    """(command, flag) for every option of every command whose value is checked when parsed
    (a type or a list of choices)."""
    from kvpool.cli import build_parser

    parser = build_parser()
    commands = parser.parse_args(["plan"]).command_parsers
    out = []
    for name, sub in commands.items():
        for action in sub._actions:
            if action.option_strings and action.nargs != 0 and (
                action.type not in (None, str, Path) or action.choices is not None
            ):
                out.append((name, action.option_strings[-1]))
    return out


TYPED_OPTIONS = _typed_options()


def test_every_command_has_typed_options() -> None:
    commands = {name for name, _ in TYPED_OPTIONS}
    assert commands == {"bridge", "plan", "replay", "router", "serve"}
    assert ("serve", "--log-level") in TYPED_OPTIONS and ("serve", "--port") in TYPED_OPTIONS
    assert ("serve", "--shutdown-grace") in TYPED_OPTIONS


@pytest.mark.parametrize("value", ["banana", "-1"])
@pytest.mark.parametrize(("command", "flag"), TYPED_OPTIONS,
                         ids=[f"{c}{f}" for c, f in TYPED_OPTIONS])
def test_every_bad_option_value_is_one_line_and_exit_2(
    command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever the command and the option, a value it cannot take is one line naming the
    option, exit 2, before any work (``--config`` is given so that the router's required
    option is not what fails)."""
    required = ["--config", EXAMPLE] if command == "router" else []
    code, out, err = run_main([command, *required, flag, value], capsys)
    assert code == 2 and out == ""
    line = one_line(err)
    assert line.startswith(f"kvpool {command}: error: argument {flag}"), line
    assert line.endswith(f"(see kvpool {command} --help)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--log-level", "banana"],
         "kvpool serve: error: argument --log-level: unknown log level 'banana'; expected one "
         "of DEBUG, INFO, WARNING, ERROR, CRITICAL (see kvpool serve --help)"),
        (["serve", "--port", "70000"],
         "kvpool serve: error: argument --port: expected an integer in [0, 65535], got "
         "'70000' (see kvpool serve --help)"),
        (["serve", "--shutdown-grace", "-3"],
         "kvpool serve: error: argument --shutdown-grace: expected a finite number >= 0, got "
         "'-3' (see kvpool serve --help)"),
    ],
    ids=["log-level", "port", "shutdown-grace"],
)
def test_flag_errors_from_the_real_command(args: list[str], message: str) -> None:
    """As a user sees them: one line on stderr, nothing on stdout, exit 2, no traceback (the
    serve cases fail before torch or a model is loaded)."""
    res = kvpool(*args)
    assert res.returncode == 2 and res.stdout == ""
    assert message in one_line(res.stderr)


@pytest.mark.parametrize("command", [[], ["replay"], ["serve"], ["router"]],
                         ids=["kvpool", "replay", "serve", "router"])
def test_exit_statuses_are_in_every_commands_help(
    command: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_main([*command, "--help"], capsys)
    assert code == 0
    text = out.split("exit status:")[1]
    for status in ("0", "2", "130", "143"):
        assert f"\n  {status} " in text, (command, text)
    assert_fits_80(out)
