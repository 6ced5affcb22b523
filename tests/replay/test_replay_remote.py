"""The replay's shared remote tier (``kvpool replay --remote-mem``): one in-process LRU store
for the whole cluster, written by every worker's evictions, read by prefetch before
admission."""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main
from kvpool.errors import InvalidArgumentError
from kvpool.replay.cluster import ClusterConfig, block_cache, replay, replay_policy
from kvpool.replay.report import strip_wall, summarize, to_json
from kvpool.replay.simmodel import SchedulerConfig
from kvpool.replay.sizing import shared_store
from kvpool.replay.workloads import Workload, synthetic_workload


def _workload(n: int = 60) -> Workload:
    return synthetic_workload(
        num_requests=n, system_prompt_tokens=96, agent_prefix_tokens=192, user_tokens=40,
        output_tokens=24, tool_output_tokens=40, max_prompt_tokens=600, arrival_rate_per_s=8.0,
        think_time_s=0.5, min_think_time_s=0.2, agent_think_time_s=0.2,
    )


def _cluster(remote_blocks: int) -> ClusterConfig:
    return ClusterConfig(cache=block_cache(48, tokens_per_block=8), workers=3,
                         scheduler=SchedulerConfig(max_batch_size=8, max_num_tokens=256),
                         remote_bytes=remote_blocks)


def test_a_shared_tier_adds_hits_deterministically_and_within_the_bound() -> None:
    wl = _workload()
    without = summarize(replay_policy(wl, _cluster(0), "round-robin"))
    run = replay(wl, _cluster(2_000), ["round-robin", "cost"])
    first = strip_wall(to_json(run))
    again = strip_wall(to_json(replay(wl, _cluster(2_000), ["round-robin", "cost"])))
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    rr = first["policies"][0]
    assert without["remote_tokens"] == 0 and rr["remote_tokens"] > 0
    assert rr["token_hit_rate"] > without["token_hit_rate"]
    assert rr["remote_hit_rate"] <= rr["token_hit_rate"]
    for p in first["policies"]:  # nothing reused that no worker ever computed
        assert p["full_block_hit_rate"] <= run.bounds["unlimited"].token_hit_rate + 1e-9
    for rec in run.policies[0].records:
        assert rec.remote_tokens <= rec.reused_tokens


def test_a_tiny_shared_tier_holds_almost_nothing() -> None:
    wl = _workload(40)
    tiny = summarize(replay_policy(wl, _cluster(2), "round-robin"))
    big = summarize(replay_policy(wl, _cluster(2_000), "round-robin"))
    assert tiny["remote_tokens"] < big["remote_tokens"]


def test_shared_store_charges_the_block_size_of_each_group() -> None:
    cache = block_cache(8, tokens_per_block=4)
    store = shared_store(cache, 1000, (300,))
    assert store is not None
    store.put_many([(b"kvp:ab:cd:0", b"x" * 48)] * 1 + [(b"kvp:ab:ce:0", b"y" * 48)])
    assert store.used_bytes == 600
    store.put_many([(b"kvp:ab:cf:0", b"z")])  # a fourth block would not fit: LRU goes
    assert store.used_bytes == 900 and len(store) == 3
    store.put_many([(b"kvp:ab:d0:0", b"z")])
    assert len(store) == 3 and store.stats.evictions == 1
    with pytest.raises(InvalidArgumentError):
        ClusterConfig(cache=cache, remote_bytes=-1)
    with pytest.raises(InvalidArgumentError):
        ClusterConfig(cache=cache, remote_bytes=10, remote_block_bytes=(1, 2))


def test_cli_refuses_a_shared_tier_of_the_wrong_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--remote-blocks", "10", "--requests", "5", "--no-progress"]) != 0
    assert "--remote-blocks" in capsys.readouterr().err
    assert main(["replay", "--gpu-blocks", "400", "--remote-mem", "1GiB", "--requests", "5",
                 "--no-progress"]) != 0
    assert "--remote-blocks" in capsys.readouterr().err


def test_cli_reports_the_shared_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--requests", "40", "--policies", "round-robin",
                 "--remote-mem", "4GiB", "--no-progress", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "shared remote tier: 4.00 GiB" in out and "from shared tier" in out
