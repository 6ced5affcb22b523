"""RemoteTier (kvpool.tiers.remote.tier): offload through write-behind, the longest resident
continuation back, over a real redis-server and the in-process store."""

from __future__ import annotations

import random

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from kvpool import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import BlockHasher
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.remote.namespace import RemoteNamespace
from kvpool.tiers.remote.store import RemoteStore
from kvpool.tiers.remote.tier import RemoteTier
from kvpool.tiers.remote.writer import RemoteWriter
from kvpool.tiers.storage import GroupGeometry
from redis_server import RedisServer

CFG = CacheConfig(tokens_per_block=4, gpu_blocks=8, window_sizes=[None, 8],
                  layer_geometry=[GroupGeometry(num_layers=1, kv_heads=1, head_dim=8)] * 2)
NS = RemoteNamespace.from_config(CFG, model="tiny")
KEYS = BlockHasher(CFG.hash_algo, 4).extend(list(range(40)))  # 10 blocks


def _payload(i: int, g: int) -> bytes:
    return random.Random(i * 2 + g).randbytes(64)


def test_two_engines_share_a_chain_through_a_real_server(redis_server: RedisServer) -> None:
    writer_store = RemoteStore(redis_server.url)
    with RemoteWriter(writer_store) as writer:
        engine_a = RemoteTier(writer_store, NS, writer=writer)
        scope = engine_a.scope(cache_salt="t")
        for i, k in enumerate(KEYS[:6]):
            for g in (0, 1):
                engine_a.offload(scope, k, g, _payload(i, g))
        assert writer.flush(10)
    engine_b = RemoteTier(RemoteStore(redis_server.url), NS)
    got = engine_b.fetch_continuation(engine_b.scope(cache_salt="t"), KEYS, [0, 1])
    assert [[bytes(p) for p in block] for block in got] == [
        [_payload(i, 0), _payload(i, 1)] for i in range(6)]
    # another scope, another namespace: nothing shared
    assert engine_b.fetch_continuation(engine_b.scope(), KEYS, [0, 1]) == []
    # a key deleted by another engine and one overwritten with junk by hand cut the chain
    raw = redis.Redis.from_url(redis_server.url)
    raw.delete(scope.remote_key(KEYS[4], 1))
    assert len(engine_b.fetch_continuation(scope, KEYS, [0, 1])) == 4
    assert len(engine_b.fetch_continuation(scope, KEYS, [0])) == 6
    raw.set(scope.remote_key(KEYS[2], 0), b"junk")
    assert len(engine_b.fetch_continuation(scope, KEYS, [0, 1])) == 2
    assert engine_b.codec.rejected["short"] == 1
    raw.flushall()
    assert engine_b.fetch_continuation(scope, KEYS, [0, 1]) == []
    raw.close()
    with pytest.raises(InvalidArgumentError):
        engine_b.offload(scope, KEYS[0], 0, b"x")


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1)), max_size=12),
       st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1)), max_size=4))
def test_continuation_is_the_longest_gapless_verified_prefix(
    present: list[tuple[int, int]], damaged: list[tuple[int, int]]
) -> None:
    store = MemoryStore(1 << 20)
    tier = RemoteTier(store, NS)
    scope = tier.scope()
    items = [(scope.remote_key(KEYS[i], g), tier.codec.encode(scope.digest,
              scope.remote_key(KEYS[i], g), _payload(i, g))) for i, g in set(present)]
    store.put_many(items)
    store.put_many([(scope.remote_key(KEYS[i], g), b"damaged") for i, g in damaged])
    good = set(present) - set(damaged)
    expect = 0
    while (expect, 0) in good and (expect, 1) in good:
        expect += 1
    got = tier.fetch_continuation(scope, KEYS, [0, 1])
    assert [[bytes(p) for p in b] for b in got] == [
        [_payload(i, 0), _payload(i, 1)] for i in range(expect)]
