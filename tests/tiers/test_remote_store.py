"""RemoteStore against a real redis-server on loopback: round trips, damaged values, FLUSHALL,
a server killed and restarted, and a three-node cluster."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import redis

from kvpool.errors import (
    InvalidArgumentError,
    RemoteTierError,
    RemoteWriteRefusedError,
    StorageError,
)
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.store import RemoteStore
from redis_server import RedisServer

NS = b"N" * 16


def _blocks(rng: random.Random, sizes: list[int]) -> list[tuple[bytes, bytes]]:
    return [(b"kvp:test:%d" % i, rng.randbytes(n)) for i, n in enumerate(sizes)]


def test_round_trip_bit_for_bit_1_byte_to_2_mib(redis_server: RedisServer) -> None:
    rng = random.Random(7)
    sizes = [1, 2, 4095, 6000, 6001, 65536, 1 << 20, 2 << 20] + [rng.randint(1, 2 << 20)
                                                                 for _ in range(8)]
    blocks = _blocks(rng, sizes)
    codec = ValueCodec()
    # a small byte budget: the call is cut into many round trips
    with RemoteStore(redis_server.url, batch_bytes=3 << 20) as store:
        store.put_many([(k, codec.encode(NS, k, v)) for k, v in blocks])
        keys = [k for k, _ in blocks] + [b"kvp:test:absent"]
        values = store.get_many(keys)
        assert values[-1] is None
        for (k, v), got in zip(blocks, values, strict=False):
            payload = codec.decode(got, NS, k)
            assert payload is not None and bytes(payload) == v
        assert store.stats.round_trips > 4
        assert store.exists_many(keys) == [True] * len(blocks) + [False]
        assert store.delete_many(keys[:3]) == 3
        assert store.get_many(keys[:4]) == [None, None, None, values[3]]
        assert not store.is_cluster


def test_damaged_values_set_by_hand_are_misses(redis_server: RedisServer) -> None:
    codec = ValueCodec()
    good = codec.encode(NS, b"k", b"x" * 1000)
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(b"k1", codec.encode(b"F" * 16, b"k1", b"x" * 1000))  # a foreign namespace
    raw.set(b"k2", codec.encode(NS, b"k2", b"x" * 1000)[:500])  # truncated
    raw.set(b"k3", b"junk")
    raw.set(b"k4", good)  # copied under another key
    k5 = codec.encode(NS, b"k5", b"x" * 1000)
    raw.set(b"k5", k5[:60] + b"y" + k5[61:])  # one byte of the payload overwritten
    raw.rpush(b"k6", b"a list, not a string")
    raw.close()
    with RemoteStore(redis_server.url) as store:
        keys = [b"k1", b"k2", b"k3", b"k4", b"k5", b"k6"]
        got = [codec.decode(v, NS, k) for k, v in zip(keys, store.get_many(keys), strict=True)]
        assert store.stats.errors == 0
    assert got == [None] * 6
    assert codec.rejected == {"namespace": 1, "short": 2, "key": 1, "checksum": 1, "missing": 1}


def test_flushall_between_put_and_get_gives_misses(redis_server: RedisServer) -> None:
    with RemoteStore(redis_server.url) as store:
        store.put_many([(b"a", b"1"), (b"b", b"2")])
        redis.Redis.from_url(redis_server.url).flushall()
        assert store.get_many([b"a", b"b"]) == [None, None]
        assert store.stats.values_missing == 2


def test_killed_server_fails_fast_then_reconnects_after_backoff(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r").start()
    now = [0.0]
    store = RemoteStore(server.url, backoff_s=5.0, backoff_max_s=20.0, timeout_s=1.0,
                        clock=lambda: now[0])
    try:
        store.put_many([(b"a", b"1")])
        server.kill()
        with pytest.raises(RemoteTierError) as e:
            store.put_many([(b"b", b"x" * (1 << 20))])
        assert isinstance(e.value, StorageError) and e.value.retry_in_s == 5.0
        assert store.stats.errors == 1
        server.start()  # back on the same port, empty
        with pytest.raises(RemoteTierError, match="unavailable"):
            store.get_many([b"a"])  # within the backoff: refused without a try
        assert store.stats.fast_failures == 1 and store.stats.errors == 1
        now[0] = 5.0  # backoff over: reconnects
        assert store.get_many([b"a"]) == [None]
        store.put_many([(b"a", b"2")])
        assert store.get_many([b"a"]) == [b"2"]
        assert store.stats.connects == 2
        server.kill()  # failures in a row back off longer: 5 s again after a success
        with pytest.raises(RemoteTierError):
            store.get_many([b"a"])
        now[0] = 9.0
        with pytest.raises(RemoteTierError, match="unavailable"):
            store.get_many([b"a"])
        now[0] = 10.0
        with pytest.raises(RemoteTierError) as e:
            store.get_many([b"a"])  # tried, failed again: the backoff doubles
        assert e.value.retry_in_s == 10.0
    finally:
        store.close()
        server.stop()


def test_slow_server_is_a_timeout_error(redis_server: RedisServer) -> None:
    assert redis_server.proc is not None
    with RemoteStore(redis_server.url, timeout_s=0.2, backoff_s=0.05) as store:
        store.put_many([(b"a", b"1")])
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the server stops answering
        try:
            with pytest.raises(RemoteTierError, match="Timeout"):
                store.get_many([b"a"])
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        time.sleep(0.06)
        assert store.get_many([b"a"]) == [b"1"]


def _used_memory(url: str) -> int:
    raw = redis.Redis.from_url(url)
    try:
        return int(raw.info("memory")["used_memory"])
    finally:
        raw.close()


def test_a_full_noeviction_server_refuses_writes_and_reads_go_on(tmp_path: Path) -> None:
    """maxmemory + noeviction: the server answers OOM to SET. That is a refusal, not a server
    down: no backoff for reads, the client is kept, only writes pause (doubling), counted."""
    server = RedisServer(tmp_path / "r", extra=("--maxmemory-policy", "noeviction")).start()
    now = [0.0]
    store = RemoteStore(server.url, backoff_s=1.0, backoff_max_s=4.0, clock=lambda: now[0])
    raw = redis.Redis.from_url(server.url)
    try:
        kept = [(b"kvp:kept:%d" % i, bytes([i]) * 4096) for i in range(8)]
        store.put_many(kept)
        raw.config_set("maxmemory", _used_memory(server.url) + 16384)  # a tiny headroom
        refusal = None
        for i in range(64):  # 16 KiB of headroom cannot take 64 values of 4 KiB
            try:
                store.put_many([(b"kvp:new:%d:%d" % (i, j), b"x" * 4096) for j in range(4)])
            except RemoteWriteRefusedError as e:
                refusal = e
                break
        assert refusal is not None and "OutOfMemoryError" in str(refusal)
        assert refusal.retry_in_s == 1.0 and isinstance(refusal, RemoteTierError)
        s = store.stats
        assert (s.write_refusals, s.errors, s.fast_failures, s.connects) == (1, 0, 0, 1)
        assert 1 <= s.values_refused <= 4
        # reads go on, on the same connection, as often as asked
        for _ in range(3):
            assert store.get_many([k for k, _ in kept]) == [v for _, v in kept]
        assert store.exists_many([kept[0][0]]) == [True]
        assert (s.errors, s.fast_failures, s.connects) == (0, 0, 1)
        # writes pause: skipped without a try, then tried again and refused again (doubling)
        with pytest.raises(RemoteWriteRefusedError, match="skipping"):
            store.put_many([(b"kvp:skipped", b"x")])
        assert s.writes_skipped == 1
        now[0] = 1.0
        with pytest.raises(RemoteWriteRefusedError) as again:
            store.put_many([(b"kvp:again", b"x" * 4096)])
        assert again.value.retry_in_s == 2.0 and s.write_refusals == 2
        # room again: after the pause a write is stored and the pause resets
        raw.config_set("maxmemory", 0)
        now[0] = 3.0
        store.put_many([(b"kvp:after", b"y")])
        assert store.get_many([b"kvp:after"]) == [b"y"]
        raw.config_set("maxmemory", 1)
        with pytest.raises(RemoteWriteRefusedError) as third:
            store.put_many([(b"kvp:third", b"x")])
        assert third.value.retry_in_s == 1.0
        assert (s.errors, s.fast_failures, s.connects) == (0, 0, 1)
    finally:
        raw.close()
        store.close()
        server.stop()


def test_a_read_only_replica_refuses_writes_and_serves_reads(tmp_path: Path) -> None:
    """A replica (here of a master that never answers) serves reads and answers READONLY to
    writes: a refusal; a server killed afterwards is a server down, with the backoff."""
    replica = RedisServer(tmp_path / "replica", extra=("--replicaof", "127.0.0.1", "1")).start()
    now = [0.0]
    store = RemoteStore(replica.url, backoff_s=2.0, clock=lambda: now[0])
    try:
        with pytest.raises(RemoteWriteRefusedError, match="ReadOnlyError") as e:
            store.put_many([(b"a", b"1"), (b"b", b"2")])
        assert e.value.retry_in_s == 2.0
        assert store.get_many([b"a"]) == [None]  # read from the replica, not refused
        s = store.stats
        assert (s.write_refusals, s.values_refused, s.values_written) == (1, 2, 0)
        assert (s.errors, s.fast_failures) == (0, 0)
        replica.kill()
        with pytest.raises(RemoteTierError) as down:
            store.get_many([b"a"])
        assert not isinstance(down.value, RemoteWriteRefusedError) and s.errors == 1
        with pytest.raises(RemoteTierError, match="unavailable"):
            store.get_many([b"a"])
        assert s.fast_failures == 1
    finally:
        store.close()
        replica.stop()


def test_bad_urls_and_sizes_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        RemoteStore("http://127.0.0.1:1")
    with pytest.raises(InvalidArgumentError):
        RemoteStore("redis://127.0.0.1:1", batch_bytes=0)
    with pytest.raises(InvalidArgumentError):
        RemoteStore("redis://127.0.0.1:1", timeout_s=-1)


def _cluster(tmp_path: Path, nodes: int = 3) -> list[RedisServer]:
    servers = [RedisServer(tmp_path / f"c{i}", extra=(
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", "2000")).start() for i in range(nodes)]
    per = 16384 // nodes
    clients = [redis.Redis(port=s.port) for s in servers]
    for i, c in enumerate(clients):
        last = 16383 if i == nodes - 1 else (i + 1) * per - 1
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        if i:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
        if all(b"cluster_state:ok" in i and b"cluster_known_nodes:%d" % nodes in i
               for i in infos):
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("the test cluster did not come up in 20 s")
    for c in clients:
        c.close()
    return servers


def test_cluster_spreads_keys_over_its_nodes(tmp_path: Path) -> None:
    servers = _cluster(tmp_path)
    rng = random.Random(3)
    try:
        blocks = [(b"kvp:%032x:%064x:0" % (i, rng.getrandbits(256)), rng.randbytes(5000))
                  for i in range(60)]
        with RemoteStore(servers[0].url) as store:  # a plain URL: the server says "cluster"
            store.put_many(blocks)
            assert store.is_cluster
            assert store.get_many([k for k, _ in blocks]) == [v for _, v in blocks]
            assert store.exists_many([blocks[0][0], b"absent"]) == [True, False]
            raw = redis.RedisCluster(host="127.0.0.1", port=servers[0].port)
            raw.rpush(b"a-list", b"x")  # another type than a string: read as missing
            raw.close()
            assert store.get_many([b"a-list", blocks[1][0]]) == [None, blocks[1][1]]
        counts = [redis.Redis(port=s.port).dbsize() for s in servers]
        assert sum(counts) == 61 and min(counts) >= 5
        url = f"redis+cluster://127.0.0.1:{servers[1].port}"
        with RemoteStore(url) as store:
            assert store.get_many([blocks[7][0]]) == [blocks[7][1]]
            assert store.delete_many([k for k, _ in blocks]) == 60
    finally:
        for s in servers:
            s.stop()
