"""``kvpool plan`` for hybrid models (docs/hybrid.md): state pools beside attention pools, in
80 columns, and a plan that builds a working manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.config import CacheConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import InvalidArgumentError
from kvpool.planner.hybrid import hybrid_presets, plan_hybrid

GIB = 1 << 30


def test_plan_shows_the_state_pools_in_80_columns(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    res = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "plan", "--model", "qwen3-next-80b-a3b",
         "--gpu-mem", "40GiB", "--host-mem", "200GiB", "--max-batch-size", "64",
         "--json", str(out)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert any("1 state" in line and "37.69 MiB" in line for line in lines)
    assert "64 running" in res.stdout
    doc = json.loads(out.read_text())
    spec = hybrid_presets()["qwen3-next-80b-a3b"]
    assert doc["state_bytes"] == spec.state_bytes == 36 * (8192 * 3 + 32 * 128 * 128) * 2
    assert doc["vllm_block_size"] == 544
    assert doc["state_slots"][0] >= 64
    assert sum(doc["attention_blocks"][0:1]) * doc["attention_block_bytes"] \
        + doc["state_slots"][0] * doc["state_bytes"] <= 40 * GIB


def test_catalogue_geometry_and_vllm_block_sizes() -> None:
    p = hybrid_presets()
    assert p["qwen3-next-80b-a3b"].attention_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert p["jamba-v0.1"].state_bytes == 28 * (8192 * 3 + 8192 * 16) * 2
    assert p["nemotron-h-8b"].state_layer_bytes == 10240 * 3 * 2 + 128 * 64 * 128 * 4
    for spec in p.values():
        b = spec.vllm_block_size()
        assert b % 16 == 0 and b * spec.layer_bytes_per_token >= spec.state_layer_bytes
        assert (b - 16) * spec.layer_bytes_per_token < spec.state_layer_bytes


def test_a_plan_builds_a_hybrid_manager() -> None:
    spec = hybrid_presets()["jamba-v0.1"]
    plan = plan_hybrid(spec, 16, 8 * GIB, 16 * GIB, max_batch_size=8)
    m = KVCacheManager(CacheConfig(**plan.cache_config_kwargs()))
    r = m.add_sequence(SequenceRequest("a", list(range(40))))
    assert r.block_ids[1] == [[m.block_ids("a", 1)[0]]]
    with pytest.raises(InvalidArgumentError):
        plan_hybrid(spec, 16, 1 << 20, max_batch_size=8)
