"""KvpoolTier on a real redis-server: two tiers (two vLLM instances) share blocks; a server
killed and restarted, FLUSHALL, hand-damaged values: jobs fail, wrong bytes never load, and
the tier keeps working."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from redis_server import RedisServer
from vllm_tier_helpers import CHUNK, base, key, load, loaded_ids, make_tier, payload, primary, store

RETRY, HIT, MISS = base.LookupResult.RETRY, base.LookupResult.HIT, base.LookupResult.MISS


def _lookup(tier: Any, ids: list[int], req: str = "r") -> list[Any]:
    """Lookups as vLLM's scheduler makes them: RETRY while a probe is out, asked again (a
    bounded wait, as the next steps would)."""
    ctx = base.ReqContext(req)
    deadline = time.monotonic() + 10
    while True:
        results = [tier.lookup(key(i), ctx) for i in ids]
        if RETRY not in results or time.monotonic() > deadline:
            tier.on_request_finished(ctx)
            return results
        time.sleep(0.005)


def _tier(pool: np.ndarray, url: str, **extra: Any) -> Any:
    return make_tier(pool, remote_url=url, remote_backoff_s=0.05, remote_backoff_max_s=0.1,
                     remote_timeout_s=1.0, **extra)


def test_two_tiers_on_one_server_see_each_others_blocks(redis_server: RedisServer) -> None:
    pool_a, pool_b = primary(8), primary(8)
    a, b = _tier(pool_a, redis_server.url), _tier(pool_b, redis_server.url)
    other_model = make_tier(primary(8), remote_url=redis_server.url, model="another-model")
    try:
        ctx = base.ReqContext("r")
        assert a.lookup(key(1), ctx) is RETRY  # a probe in flight never blocks the caller
        assert store(a, pool_a, [1, 2, 3]).success
        assert _lookup(b, [1, 2, 3, 4]) == [HIT, HIT, HIT, MISS]
        assert load(b, pool_b, [1, 2, 3]).success
        assert all(np.array_equal(pool_b[n], payload(i)) for n, i in enumerate([1, 2, 3]))
        assert _lookup(other_model, [1, 2, 3]) == [MISS] * 3  # another namespace
    finally:
        for t in (a, b, other_model):
            t.shutdown()


def test_disk_in_front_of_remote(tmp_path: Path, redis_server: RedisServer) -> None:
    pool = primary(8)
    writer = _tier(pool, redis_server.url, disk_path=str(tmp_path / "a"),
                   disk_bytes=2 * CHUNK)
    reader = _tier(primary(8), redis_server.url, disk_path=str(tmp_path / "b"),
                   disk_bytes=2 * CHUNK)
    try:
        assert store(writer, pool, [1, 2, 3, 4]).success  # disk keeps 2, the server all 4
        assert len(writer.disk) == 2
        assert load(writer, pool, [1, 2, 3, 4]).success
        assert all(np.array_equal(pool[n], payload(i)) for n, i in enumerate([1, 2, 3, 4]))
        assert _lookup(reader, [1, 2, 3, 4]) == [HIT] * 4
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_server_killed_and_restarted(redis_server: RedisServer) -> None:
    pool = primary(8)
    tier = _tier(pool, redis_server.url)
    try:
        assert store(tier, pool, [1, 2]).success
        redis_server.kill()
        assert not store(tier, pool, [3]).success  # server down: the store fails
        result = load(tier, pool, [1, 2])
        assert not result.success and not result.successful_keys and (pool[:2] == 0).all()
        assert _lookup(tier, [5]) == [MISS]  # down: a miss, not a wait
        redis_server.start()  # empty: it kept nothing
        time.sleep(0.15)  # the backoff runs out
        assert store(tier, pool, [1, 2]).success
        assert load(tier, pool, [1, 2]).success
        assert np.array_equal(pool[1], payload(2))
        assert tier.counters.failures["remote_error"] >= 2
    finally:
        tier.shutdown()


def test_flushall_and_damaged_values_fail_their_keys(redis_server: RedisServer) -> None:
    pool = primary(8)
    tier = _tier(pool, redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert store(tier, pool, [1, 2, 3, 4]).success
        client.setrange(tier.remote.remote_key(key(2)), 48 + 100, b"\x00garbage")
        client.append(tier.remote.remote_key(key(3)), b"trailing")
        result = load(tier, pool, [1, 2, 3, 4])
        assert loaded_ids(result, [1, 2, 3, 4]) == [1, 4]
        assert np.array_equal(pool[0], payload(1)) and np.array_equal(pool[3], payload(4))
        assert tier.counters.failures["remote_missing"] == 2
        assert tier.remote.codec.rejected["checksum"] == 1
        assert tier.remote.codec.rejected["length"] == 1
        client.flushall()
        result = load(tier, pool, [1, 4])
        assert not result.success and not result.successful_keys
        assert _lookup(tier, [1, 4]) == [MISS, MISS]
        assert store(tier, pool, [1, 2]).success  # and it goes on
        assert _lookup(tier, [1, 2]) == [HIT, HIT]
        assert load(tier, pool, [2]).success and np.array_equal(pool[0], payload(2))
    finally:
        client.close()
        tier.shutdown()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_a_server_that_never_answers_is_a_miss(url: str) -> None:
    pool = primary(4)
    tier = _tier(pool, url)
    try:
        assert _lookup(tier, [1, 2]) == [MISS, MISS]
        assert not store(tier, pool, [1]).success
    finally:
        tier.shutdown()
