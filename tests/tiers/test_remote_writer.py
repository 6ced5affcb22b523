"""Write-behind (kvpool.tiers.remote.writer) and the in-process LRU store (.memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgumentError, RemoteWriteRefusedError
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.remote.store import Item, RemoteStore
from kvpool.tiers.remote.writer import RemoteWriter
from redis_server import RedisServer

NS = b"W" * 16


class GatedStore(MemoryStore):
    """A MemoryStore whose writes wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_many(self, items: Sequence[Item]) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        super().put_many(items)


def _decoded(store: MemoryStore | RemoteStore, keys: list[bytes]) -> list[bytes | None]:
    codec = ValueCodec()
    out = []
    for k, v in zip(keys, store.get_many(keys), strict=True):
        payload = codec.decode(v, NS, k)
        out.append(None if payload is None else bytes(payload))
    return out


def test_flush_writes_every_block_to_a_real_server(redis_server: RedisServer) -> None:
    store = RemoteStore(redis_server.url)
    blocks = [(b"b%d" % i, bytes([i]) * (1000 + i)) for i in range(200)]
    with RemoteWriter(store, batch_bytes=20_000) as writer:
        for k, v in blocks:
            writer.put(NS, k, v)
        assert writer.flush(10)
        stats = writer.stats
        assert stats.written == 200 and stats.dropped == stats.failed == 0
        assert stats.batches > 5  # cut by batch_bytes
        assert _decoded(store, [k for k, _ in blocks]) == [v for _, v in blocks]
    store.close()


def test_full_queue_drops_the_oldest_and_put_never_blocks() -> None:
    store = GatedStore()
    writer = RemoteWriter(store, max_pending_bytes=10_000, batch_bytes=1)
    writer.put(NS, b"first", b"x" * 100)
    assert store.entered.wait(5)  # the thread is stuck writing "first"
    keys = [b"k%d" % i for i in range(50)]
    for k in keys:
        writer.put(NS, k, b"y" * 1000)  # returns although nothing can be written
    assert writer.pending == 10
    stats = writer.stats
    assert stats.dropped == 40 and stats.dropped_bytes == 40_000
    store.gate.set()
    assert writer.close(10)
    assert _decoded(store, [b"first", *keys]) == [b"x" * 100] + [None] * 40 + [b"y" * 1000] * 10
    assert writer.stats.written == 11
    with pytest.raises(InvalidArgumentError):
        writer.put(NS, b"late", b"z")


def test_close_drains_the_queue() -> None:
    store = GatedStore()
    writer = RemoteWriter(store, batch_bytes=1)
    for i in range(20):
        writer.put(NS, b"k%d" % i, b"v%d" % i)
    store.gate.set()
    assert writer.close(10)
    assert _decoded(store, [b"k%d" % i for i in range(20)]) == [b"v%d" % i for i in range(20)]


def test_flush_times_out_while_the_store_hangs() -> None:
    store = GatedStore()
    writer = RemoteWriter(store)
    writer.put(NS, b"k", b"v")
    assert not writer.flush(0.05)
    store.gate.set()
    assert writer.flush(5)
    writer.close()


def test_a_dead_server_fails_batches_and_drains(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r").start()
    store = RemoteStore(server.url, backoff_s=60)
    writer = RemoteWriter(store, batch_bytes=1)
    writer.put(NS, b"a", b"1")
    assert writer.flush(10) and writer.stats.written == 1
    server.kill()
    for i in range(30):
        writer.put(NS, b"k%d" % i, b"v")
    assert writer.flush(10)  # fails fast during the backoff: no stall
    stats = writer.stats
    assert stats.failed == 30 and stats.written == 1 and stats.refused == 0
    assert writer.last_error is not None and store.stats.errors == 1
    writer.close()
    store.close()


def test_a_read_only_replica_refuses_batches_counted_apart(tmp_path: Path) -> None:
    replica = RedisServer(tmp_path / "r", extra=("--replicaof", "127.0.0.1", "1")).start()
    store = RemoteStore(replica.url, backoff_s=60)
    try:
        with RemoteWriter(store, batch_bytes=1) as writer:
            for i in range(10):
                writer.put(NS, b"k%d" % i, b"v")
            assert writer.flush(10)
            stats = writer.stats
            assert (stats.failed, stats.refused, stats.written) == (10, 10, 0)
            assert isinstance(writer.last_error, RemoteWriteRefusedError)
        # the first batch was refused by the server, the others skipped during the pause
        assert store.stats.write_refusals == 1 and store.stats.writes_skipped == 9
        assert store.stats.errors == 0 and _decoded(store, [b"k0"]) == [None]
    finally:
        store.close()
        replica.stop()


def test_a_bad_item_fails_its_batch_and_the_thread_carries_on() -> None:
    store = MemoryStore(1 << 20)
    with RemoteWriter(store, batch_bytes=1) as writer:
        writer.put(b"not 16 bytes", b"bad", b"v")
        assert writer.flush(5)
        writer.put(NS, b"good", b"v")
        assert writer.flush(5)
        assert isinstance(writer.last_error, InvalidArgumentError)
        assert (writer.stats.failed, writer.stats.written) == (1, 1)
    assert _decoded(store, [b"bad", b"good"]) == [None, b"v"]


def test_everything_but_remote_store_works_without_redis_py() -> None:
    """The remote extra is optional: tiers.remote and tiers.manifest import without it."""
    script = textwrap.dedent("""
        import sys
        sys.modules["redis"] = None  # as if redis-py were not installed
        import kvpool.tiers.manifest, kvpool.tiers.remote
        from kvpool.errors import StorageError
        from kvpool.tiers.remote import MemoryStore, RemoteWriter
        with RemoteWriter(MemoryStore(1000)) as w:
            w.put(b"N" * 16, b"k", b"v")
        try:
            kvpool.tiers.remote.RemoteStore("redis://127.0.0.1:1")
        except StorageError as e:
            assert "remote" in str(e)
        else:
            raise AssertionError("RemoteStore without redis-py")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="remote_write"):
        RemoteWriter(MemoryStore(10), mode="always")
    with pytest.raises(InvalidArgumentError):
        RemoteWriter(MemoryStore(10), max_pending_bytes=0)
    with pytest.raises(InvalidArgumentError):
        MemoryStore(0)


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7), st.integers(0, 60)),
    max_size=80,
)


@given(st.integers(1, 120), OPS)
def test_memory_store_is_an_lru_by_bytes(capacity: int, ops: list[tuple[str, int, int]]) -> None:
    """Against a reference: a list in recency order, evicting from its front."""
    store = MemoryStore(capacity)
    ref: list[tuple[bytes, bytes]] = []
    for op, k, n in ops:
        key = b"k%d" % k
        entry = next((e for e in ref if e[0] == key), None)
        if op == "get":
            assert store.get_many([key]) == [entry[1] if entry else None]
            if entry:
                ref.remove(entry)
                ref.append(entry)
        elif op == "delete":
            assert store.delete_many([key]) == (1 if entry else 0)
            if entry:
                ref.remove(entry)
        else:
            value = bytes([k]) * n
            store.put_many([(key, value)])
            if entry:
                ref.remove(entry)
            if len(key) + n <= capacity:
                while sum(len(a) + len(b) for a, b in ref) + len(key) + n > capacity:
                    ref.pop(0)
                ref.append((key, value))
        assert store.keys() == [a for a, _ in ref]
        assert store.used_bytes == sum(len(a) + len(b) for a, b in ref) <= capacity
    assert store.get_many([a for a, _ in ref]) == [b for _, b in ref]
