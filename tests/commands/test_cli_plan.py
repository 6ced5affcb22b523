"""``kvpool plan`` as a user runs it: a subprocess, its table, its JSON and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import assert_refused, kvpool

from kvpool.errors import CapacityError
from kvpool.planner.capacity import ModelSpec, plan_pools, presets


def test_table_and_json_match_plan_pools(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    res = kvpool(
        "plan",
        "--model",
        "gemma-3-12b",
        "--gpu-mem",
        "40GiB",
        "--host-mem",
        "64GB",
        "--max-batch-size",
        "128",
        "--max-num-tokens",
        "4096",
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    expected = plan_pools(
        ModelSpec.preset("gemma-3-12b"),
        32,
        40 * 2**30,
        64 * 10**9,
        max_batch_size=128,
        max_num_tokens=4096,
        max_seq_len=131072,
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(expected.to_dict()))

    rows = {}
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 1 + len(expected.groups):
            rows[cells[0]] = cells[1:]
    assert rows["attention"] == [g.label for g in expected.groups]
    assert rows["GPU slots"] == [f"{g.slots_per_tier[0]:,}" for g in expected.groups]
    assert rows["host slots"] == [f"{g.slots_per_tier[1]:,}" for g in expected.groups]
    assert "disk slots" not in rows  # no disk budget
    assert rows["GPU floor"] == [f"{g.min_slots:,}" for g in expected.groups]
    assert rows["floor set by"] == [g.floor_reason for g in expected.groups]
    assert rows["typical step need"] == [f"{g.typical_need:,}" for g in expected.groups]


def test_list_models_names_every_preset() -> None:
    res = kvpool("plan", "--list-models")
    assert res.returncode == 0, res.stderr
    for name in presets():
        assert name in res.stdout


def test_bad_preset_lists_valid_ones() -> None:
    res = kvpool("plan", "--model", "gpt-9", "--gpu-mem", "1GiB", "--max-batch-size", "8")
    assert_refused(res, "gpt-9", *presets())


def test_bad_size() -> None:
    res = kvpool("plan", "--model", "tiny", "--gpu-mem", "40 gigs", "--max-batch-size", "8")
    assert_refused(res, "bad size")


def test_infeasible_budget_says_the_minimum() -> None:
    model = ModelSpec.preset("llama-3-8b")
    with pytest.raises(CapacityError) as err:
        plan_pools(model, 32, 512 * 2**20, max_batch_size=8, max_num_tokens=8192, max_seq_len=8192)
    res = kvpool("plan", "--model", "llama-3-8b", "--gpu-mem", "512MiB", "--max-batch-size", "8")
    assert_refused(res, f"{err.value.min_budget_bytes} bytes")
