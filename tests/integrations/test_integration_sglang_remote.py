"""KvpoolHiCacheStorage's shared remote tier on a real redis-server, and its contract as a
hypothesis property against a dict, all through SGLang 0.5.23's own calls and host pool
(the helpers of test_integration_sglang, which imports SGLang)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from test_integration_sglang import (
    PS,
    Controller,
    fill,
    hashes_of,
    indices,
    read,
    sglang_env,
    tokens,
    wipe,
)

from kvpool.integrations.sglang.hostpages import page_keys
from redis_server import RedisServer


@pytest.fixture(scope="module")
def pools() -> tuple[Any, Any]:
    """Two host pools of one geometry: two SGLang processes' host memory."""
    return (sglang_env.host_pool("page_first", page_size=PS),
            sglang_env.host_pool("page_first", page_size=PS))


def test_two_instances_on_one_redis_share_pages_within_one_namespace(
        redis_server: RedisServer, tmp_path: Path, pools: tuple[Any, Any]) -> None:
    first, second = pools
    url = redis_server.url
    a = sglang_env.create({"remote_url": url}, first)
    b = sglang_env.create({"remote_url": url, "disk_path": str(tmp_path / "b"),
                           "disk_bytes": 64 * 512}, second)
    others = [sglang_env.create({"remote_url": url}, first, model="another/model"),
              sglang_env.create({"remote_url": url, "namespace": "rev2"}, first),
              sglang_env.create({"remote_url": url}, first, tp_rank=1, tp_size=2)]
    try:
        ids = tokens(5, 3)
        want = fill(first, list(range(5)), seed=3)
        assert Controller(a, first).backup(indices(list(range(5))), hashes_of(ids)) == 5 * PS
        reader = Controller(b, second)
        found, count = reader.query(ids)
        assert count == 5 * PS
        wipe(second, list(range(10, 15)))
        assert reader.load(found, indices(list(range(10, 15)))) == 5
        assert [read(second, p) for p in range(10, 15)] == want
        stats = b.stats()
        assert stats["remote"]["hits"] == 5 and stats["disk"]["pages"] == 5  # promoted
        wipe(second, list(range(10, 15)))
        assert reader.load(found, indices(list(range(10, 15)))) == 5
        assert [read(second, p) for p in range(10, 15)] == want
        stats = b.stats()
        assert stats["remote"]["hits"] == 5 and stats["disk"]["hits"] == 5  # from disk now
        for other in others:  # another model, namespace or shard never sees them
            assert Controller(other, first).query(ids) == ([], 0)
    finally:
        for backend in (a, b, *others):
            backend.close()


def test_damaged_values_flushall_and_a_dead_server_are_misses_never_wrong_bytes(
        redis_server: RedisServer, pools: tuple[Any, Any]) -> None:
    pool = pools[0]
    backend = sglang_env.create({"remote_url": redis_server.url, "remote_backoff_s": 0.05,
                                 "remote_timeout_s": 0.5}, pool)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [f"r{i}" for i in range(4)]
        want = fill(pool, list(range(4)), seed=11)
        assert backend.batch_set_v1(keys, indices(list(range(4)))) == [True] * 4
        assert backend.remote is not None
        rkeys = backend.remote.remote_keys(page_keys(keys))
        value = raw.get(rkeys[1])
        assert value is not None
        raw.set(rkeys[1], value[:-1] + bytes([value[-1] ^ 1]))  # one bit of the payload
        raw.set(rkeys[2], bytes(raw.get(rkeys[2]) or b"")[:100])  # truncated
        raw.set(rkeys[3], raw.get(rkeys[0]))  # another page's value under this key
        wipe(pool, list(range(10, 14)))
        assert backend.batch_get_v1(keys, indices(list(range(10, 14)))) == [True] + [False] * 3
        assert read(pool, 10) == want[0]
        assert Controller(backend, pool).load(keys, indices(list(range(10, 14)))) == 1
        rejected = backend.stats()["remote"]["rejected_by_reason"]
        assert rejected["checksum"] >= 1 and rejected["short"] >= 1 and rejected["key"] >= 1

        raw.flushall()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(list(range(10, 14)))) == [False] * 4
        assert backend.batch_set_v1(keys, indices(list(range(4)))) == [True] * 4
        wipe(pool, list(range(10, 14)))
        assert backend.batch_get_v1(keys, indices(list(range(10, 14)))) == [True] * 4
        assert [read(pool, p) for p in range(10, 14)] == want

        redis_server.kill()  # no answer: misses and failed stores, no exception
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(list(range(10, 14)))) == [False] * 4
        assert backend.batch_set_v1(["new"], indices([0])) == [False]
        assert backend.stats()["remote"]["errors"] >= 1
        redis_server.start()  # empty again (no persistence); the tier reconnects
        deadline = time.monotonic() + 10
        while backend.batch_set_v1(keys, indices(list(range(4)))) != [True] * 4:
            assert time.monotonic() < deadline, "the remote tier did not come back"
            time.sleep(0.05)
        wipe(pool, list(range(10, 14)))
        assert backend.batch_get_v1(keys, indices(list(range(10, 14)))) == [True] * 4
        assert [read(pool, p) for p in range(10, 14)] == want
    finally:
        raw.close()
        backend.close()


# ---------------------------------------------------------------------- the contract

KEYS = [f"h{i}" for i in range(6)]
op = st.one_of(
    st.tuples(st.just("set"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
              st.integers(0, 1 << 16)),
    st.tuples(st.just("exists"), st.lists(st.sampled_from(KEYS), max_size=5), st.just(0)),
    st.tuples(st.just("get"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
              st.just(0)),
    st.tuples(st.just("restart"), st.just([]), st.just(0)),
)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(op, max_size=12))
def test_batch_calls_agree_with_a_dict(pools: tuple[Any, Any], ops: list[Any]) -> None:
    """batch_exists is the length of the stored prefix, batch_get_v1 gives back the bytes of
    a key's first stored page (a page already held is not rewritten), batch_set_v1 stores,
    and all of it survives a close and reopen on the same path, as a dict of pages would."""
    pool = pools[0]
    model: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"disk_path": tmp, "disk_bytes": 16 * 512}
        backend = sglang_env.create(extra, pool)
        try:
            for kind, keys, seed in ops:
                if kind == "set":
                    pages = fill(pool, list(range(len(keys))), seed=seed)
                    assert backend.batch_set_v1(keys, indices(list(range(len(keys))))) == \
                        [True] * len(keys)
                    for key, page in zip(keys, pages, strict=True):
                        model.setdefault(key, page)
                elif kind == "exists":
                    held = [k in model for k in keys]
                    assert backend.batch_exists(keys) == (
                        held.index(False) if False in held else len(keys))
                elif kind == "get":
                    dest = list(range(16, 16 + len(keys)))
                    wipe(pool, dest)
                    assert backend.batch_get_v1(keys, indices(dest)) == [k in model for k in keys]
                    for key, page in zip(keys, dest, strict=True):
                        if key in model:
                            assert read(pool, page) == model[key]
                else:
                    backend.close()
                    backend = sglang_env.create(extra, pool)
        finally:
            backend.close()
