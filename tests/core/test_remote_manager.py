"""The remote tier inside the manager: CacheConfig's remote fields, evict/store write-behind,
prefetch before admission, two managers in two processes sharing a prefix through a real
redis-server, and a property test of random interleavings across two managers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import CacheConfig, EventsConfig, KVCacheManager, RemoteConfig, SequenceRequest
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.events import REMOTE_CACHE_LEVEL, Stored
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.remote.store import RemoteStore
from kvpool.tiers.storage import GroupGeometry
from redis_server import RedisServer

TPB = 4
GEO = GroupGeometry(num_layers=2, kv_heads=2, head_dim=8)  # 512 bytes per block


def _cfg(**kw: Any) -> CacheConfig:
    args: dict[str, Any] = dict(tokens_per_block=TPB, gpu_blocks=12, host_blocks=8,
                                layer_geometry=[GEO], model_id="tiny",
                                enable_partial_reuse=False)
    args.update(kw)
    return CacheConfig(**args)


def _expected(tokens: Any, n: int) -> bytes:
    """The bytes every test engine computes for the block ending ``tokens`` (its prefix)."""
    seed = hashlib.sha256(bytes(memoryview(torch.tensor(list(tokens), dtype=torch.int64)
                                           .numpy()))).digest()
    return random.Random(seed).randbytes(n)


def _slot_bytes(m: KVCacheManager, tier: int, slot: int) -> bytes:
    return bytes(m.tensors(0, tier)[slot].contiguous().view(torch.uint8).numpy().data)


def _compute(m: KVCacheManager, seq_id: str, tokens: list[int], table: list[int],
             first: int) -> None:
    """The 'engine' computes blocks [first, ...) of a sequence: their bytes are _expected."""
    gpu = m.tensors(0, 0).view(torch.uint8).reshape(len(m.tensors(0, 0)), -1)
    n = gpu.shape[1]
    for b in range(first, len(table)):
        data = _expected(tokens[:min((b + 1) * TPB, len(tokens))], n)
        gpu[table[b]].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _serve(m: KVCacheManager, seq_id: str, tokens: list[int]) -> tuple[int, int]:
    """Admit, check the reused bytes, compute the rest, commit, release; (reused, prefetched)
    tokens. plan_batch must equal what admission does."""
    req = [SequenceRequest(seq_id, tokens)]
    got = m.prefetch(req)[0]
    plan = m.plan_batch(req)
    res = m.add_sequence_batch(req)[0]
    assert (plan.requests[0].reused_tokens, plan.requests[0].new_blocks) == \
        (res.reused_tokens, res.new_blocks)
    table = res.block_ids[0][0]
    for b in range(res.reused_tokens // TPB):
        assert _slot_bytes(m, 0, table[b]) == _expected(tokens[:(b + 1) * TPB], 512), b
    _compute(m, seq_id, tokens, table, res.reused_tokens // TPB)
    m.store_context_blocks(seq_id, len(tokens))
    m.remove_sequence(seq_id)
    return res.reused_tokens, got


def _check_bytes(m: KVCacheManager) -> None:
    """Every cached block on GPU or host holds the bytes of its token prefix."""
    n = m.storage.block_bytes(0)
    for toks, slots, tiers in m.tree_blocks():
        if slots[0] >= 0:
            assert _slot_bytes(m, tiers[0], slots[0]) == _expected(toks, n)


def _fill(m: KVCacheManager, rounds: int, base: int = 50_000) -> None:
    for k in range(rounds):
        toks = list(range(base + 100 * k, base + 100 * k + 8 * TPB + 1))
        _serve(m, f"fill{k}", toks)


PREFIX = list(range(1000, 1000 + 8 * TPB + 1))  # 8 full blocks + 1 token


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("remote, kw, match", [
    ({"url": "http://x"}, {}, r"CacheConfig\.remote\.url scheme .http. is not redis://"),
    ({"url": "redis://127.0.0.1:1/0", "store": MemoryStore(1 << 20)}, {}, "not both"),
    ({"store": object()}, {}, r"CacheConfig\.remote\.store .* is not a block store"),
    ({"store": MemoryStore(1 << 20), "write": "always"}, {}, r"CacheConfig\.remote\.write"),
    ({"store": MemoryStore(1 << 20)}, {"model_id": 3}, "model_id"),
    ({"store": MemoryStore(1 << 20), "timeout_s": 0}, {}, r"CacheConfig\.remote\.timeout_s"),
    ({"store": MemoryStore(1 << 20), "max_pending_bytes": 0}, {},
     r"CacheConfig\.remote\.max_pending_bytes"),
])
def test_config_refuses_bad_remote_settings(remote: dict[str, Any], kw: dict[str, Any],
                                            match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _cfg(remote=RemoteConfig(**remote), **kw)


def test_without_a_remote_tier_prefetch_is_zero_and_flush_is_immediate() -> None:
    m = KVCacheManager(_cfg())
    assert m.prefetch([SequenceRequest("a", PREFIX)]) == [0]
    assert m.flush_remote() and m.remote_stats() is None
    with pytest.raises(InvalidArgumentError):
        m.prefetch(SequenceRequest("a", PREFIX))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- in process


@pytest.mark.parametrize("mode", ["evict", "store"])
def test_second_manager_prefetches_what_the_first_wrote(mode: str) -> None:
    store = MemoryStore(1 << 24)
    a = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write=mode),
                            events=EventsConfig(buffer_max_size=10_000)))
    _serve(a, "a", PREFIX)
    if mode == "evict":
        assert a.remote_stats().offloaded_blocks == 0  # type: ignore[union-attr]
        _fill(a, 4)  # pushes the prefix out of GPU and host
        assert a.count_reusable_tokens(PREFIX) == 0
    assert a.flush_remote(10)
    b = KVCacheManager(_cfg(remote=RemoteConfig(store=store)))
    assert _serve(b, "b", PREFIX) == (8 * TPB, 8 * TPB)
    _check_bytes(b)
    b.check_invariants()
    st_b = b.remote_stats()
    assert st_b is not None and st_b.prefetched_blocks == 8
    assert b.stats().remote_prefetch_blocks == 8
    # the first manager announced the blocks it handed over on the remote cache level
    a.flush_iteration_events()
    levels = {blk.cache_level for e in a.get_latest_events() if isinstance(e.data, Stored)
              for blk in e.data.blocks}
    assert (REMOTE_CACHE_LEVEL in levels) == (mode == "evict")
    # an already local prefix is not fetched again
    assert b.prefetch([SequenceRequest("c", PREFIX)]) == [0]


def test_prefetch_fills_after_a_local_match_and_another_scope_shares_nothing() -> None:
    store = MemoryStore(1 << 24)
    a = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write="store")))
    _serve(a, "a", PREFIX)
    a.flush_remote(10)
    b = KVCacheManager(_cfg(remote=RemoteConfig(store=store)))
    _serve(b, "b", PREFIX[:3 * TPB + 1])  # b computed the first 3 blocks itself
    assert b.prefetch([SequenceRequest("x", PREFIX, cache_salt="other")]) == [0]
    assert b.prefetch([SequenceRequest("c", PREFIX)]) == [5 * TPB]
    assert b.count_reusable_tokens(PREFIX) == 8 * TPB
    _check_bytes(b)
    b.check_invariants()


def test_prefetch_is_bounded_by_the_host_tier_and_never_leaks_slots() -> None:
    store = MemoryStore(1 << 24)
    a = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write="store")))
    _serve(a, "a", PREFIX)
    a.flush_remote(10)
    b = KVCacheManager(_cfg(host_blocks=3, remote=RemoteConfig(store=store)))
    assert b.prefetch([SequenceRequest("b", PREFIX)]) == [3 * TPB]
    b.check_invariants()
    # without a host tier, prefetch fills GPU slots (cached, unreferenced)
    c = KVCacheManager(_cfg(host_blocks=0, remote=RemoteConfig(store=store)))
    assert c.prefetch([SequenceRequest("c", PREFIX)]) == [8 * TPB]
    assert c.slot_usage(0)["evictable"] == 8
    _check_bytes(c)
    c.check_invariants()


# ----------------------------------------------------------------------------- property


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_interleavings_across_two_managers_never_serve_a_wrong_byte(data: Any) -> None:
    store = MemoryStore(data.draw(st.sampled_from([6_000, 60_000]), label="store bytes"))
    mode = data.draw(st.sampled_from(["evict", "store"]), label="mode")
    managers = [KVCacheManager(_cfg(gpu_blocks=10, host_blocks=h,
                                    remote=RemoteConfig(store=store, write=mode))) for h in (0, 4)]
    prefixes = [list(range(100 * p, 100 * p + 3 * TPB)) for p in range(3)]
    for step in range(data.draw(st.integers(5, 25), label="steps")):
        op = data.draw(st.sampled_from(["serve", "serve", "prefetch", "delete", "damage"]),
                       label="op")
        m = managers[data.draw(st.integers(0, 1), label="manager")]
        if op in ("serve", "prefetch"):
            p = data.draw(st.integers(0, 2), label="prefix")
            tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9), label="tail")
            tokens = prefixes[p] + [p * 10 + t for t in tail]
            if op == "prefetch":
                m.prefetch([SequenceRequest(f"p{step}", tokens)])
            else:
                with contextlib.suppress(OutOfBlocksError):
                    _serve(m, f"s{step}", tokens)
        else:
            keys = store.keys()
            if keys:
                k = keys[data.draw(st.integers(0, len(keys) - 1), label="key")]
                if op == "delete":
                    store.delete_many([k])
                else:
                    value = store.get_many([k])[0] or b""
                    junk = data.draw(st.sampled_from(["truncate", "flip", "junk"]))
                    if junk == "truncate":
                        value = value[:-5]
                    elif junk == "flip" and value:  # (an earlier truncate may empty it)
                        value = value[:-1] + bytes([value[-1] ^ 1])
                    else:
                        value = b"junk"
                    store.put_many([(k, value)])
        for mm in managers:
            mm.check_invariants()
            _check_bytes(mm)
            assert mm.flush_remote(10)  # the store's content is then a function of the ops


# ----------------------------------------------------------------------------- real server

_WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from test_remote_manager import PREFIX, TPB, _cfg, _fill, _serve, _slot_bytes
    from kvpool import KVCacheManager, RemoteConfig
    m = KVCacheManager(_cfg(remote=RemoteConfig(url=sys.argv[1])))
    _serve(m, "a", PREFIX)
    path = m.tree_blocks()
    slots = {len(t) // TPB - 1: s[0] for t, s, tiers in path}
    with open(sys.argv[2], "wb") as f:
        f.write(b"".join(_slot_bytes(m, 0, slots[b]) for b in range(8)))
    _fill(m, 4)
    assert m.flush_remote(30)
    st = m.remote_stats()
    assert st.errors == 0 and st.written >= 8, st
    m.close()
""")


def _write_in_another_process(url: str, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", _WRITER, url, str(out),
                    str(Path(__file__).parent)], check=True, env=env, timeout=300)


def test_two_processes_share_a_prefix_through_a_real_server_bit_for_bit(
        redis_server: RedisServer, tmp_path: Path) -> None:
    out = tmp_path / "pool.bin"
    _write_in_another_process(redis_server.url, out)
    first = out.read_bytes()
    assert len(first) == 8 * 512 and first != bytes(len(first))
    m = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    assert m.prefetch([SequenceRequest("b", PREFIX)]) == [8 * TPB]
    req = [SequenceRequest("b", PREFIX)]
    plan = m.plan_batch(req)
    res = m.add_sequence_batch(req)[0]
    assert res.reused_tokens == plan.requests[0].reused_tokens == 8 * TPB
    table = res.block_ids[0][0]
    assert b"".join(_slot_bytes(m, 0, s) for s in table[:8]) == first
    m.close()


def test_faults_with_a_real_server_are_misses_or_counted_errors(
        redis_server: RedisServer, tmp_path: Path) -> None:
    _write_in_another_process(redis_server.url, tmp_path / "pool.bin")
    raw = redis.Redis.from_url(redis_server.url)
    keys = sorted(raw.keys("kvp:*"))
    assert len(keys) >= 8
    # a value truncated by hand and another overwritten with junk: the chain ends before them
    b = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    probe = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    assert probe.prefetch([SequenceRequest("p", PREFIX)]) == [8 * TPB]
    order = [k for k in keys if raw.get(k) is not None]
    tier = b._st.remote.tier  # type: ignore[union-attr]
    hasher_keys = _chain_keys(b, PREFIX)
    scope = tier.scope()
    k3, k5 = scope.remote_key(hasher_keys[3], 0), scope.remote_key(hasher_keys[5], 0)
    assert k3 in order and k5 in order
    raw.set(k3, raw.get(k3)[:-7])  # type: ignore[index]
    raw.set(k5, b"junk")
    assert b.prefetch([SequenceRequest("b", PREFIX)]) == [3 * TPB]
    assert b.remote_stats().rejected_values == 1  # type: ignore[union-attr]
    _check_bytes(b)
    # FLUSHALL between prefetch and admission: admission uses what prefetch made local
    c = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    assert c.prefetch([SequenceRequest("c", PREFIX)]) == [3 * TPB]
    raw.flushall()
    assert _serve(c, "c", PREFIX) == (3 * TPB, 0)
    # the server killed: writes and reads fail, are counted, the manager goes on locally
    now = [0.0]
    store = RemoteStore(redis_server.url, backoff_s=5.0, clock=lambda: now[0])
    d = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write="store")))
    _serve(d, "d0", PREFIX)
    assert d.flush_remote(10)
    redis_server.kill()
    _serve(d, "d1", PREFIX[:5] + [7] * 20)  # write-through of new blocks fails in the writer
    assert d.flush_remote(10)
    assert d.remote_stats().write_failed > 0  # type: ignore[union-attr]
    assert d.prefetch([SequenceRequest("d2", [9] * 30)]) == [0]
    # the prefetches of d1 and d2 failed (the first on the network, the second fast)
    assert d.stats().remote_errors == 2 and d.count_reusable_tokens(PREFIX) == 8 * TPB
    d.check_invariants()
    _check_bytes(d)
    # restarted (empty): after the backoff, the tier works again
    redis_server.start()
    now[0] = 10.0
    _serve(d, "d3", [11] * 30)
    assert d.flush_remote(10)
    e = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    assert e.prefetch([SequenceRequest("e", [11] * 30)]) == [7 * TPB]
    _check_bytes(e)
    raw.close()
    for m in (b, c, d, e, probe):
        m.close()


def test_a_full_noeviction_server_refuses_writes_and_prefetch_keeps_hitting(
        tmp_path: Path) -> None:
    """A redis-server with a tiny maxmemory and noeviction answers OOM to the write-through of
    new blocks: counted as refusals, and the same manager's prefetch of a resident prefix
    keeps hitting (the clock never moves: a "server down" backoff would refuse every read)."""
    server = RedisServer(tmp_path / "r", extra=("--maxmemory-policy", "noeviction")).start()
    raw = redis.Redis.from_url(server.url)
    try:
        store = RemoteStore(server.url, clock=lambda: 0.0)
        m = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write="store")))
        _serve(m, "p", PREFIX)
        assert m.flush_remote(10)
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 8192)
        reused, prefetched = [], []
        for k in range(30):
            _fill(m, 3, base=20_000 + 1000 * k)  # 24 new blocks: the prefix leaves GPU and host
            assert m.flush_remote(10)  # a refused batch is settled too
            got_reused, got = _serve(m, f"p{k}", [*PREFIX[:-1], k])
            reused.append(got_reused)
            prefetched.append(got)
        st = m.remote_stats()
        assert st is not None and st.write_refused > 0 and st.write_refused == st.write_failed
        assert store.stats.write_refusals >= 1 and store.stats.errors == 0
        assert store.stats.fast_failures == 0 and st.errors == 0
        assert reused == [8 * TPB] * 30  # the prefix, local or prefetched, every time
        assert all(p > 0 for p in prefetched)  # the fills pushed (part of) it out: prefetched
        _check_bytes(m)
        m.check_invariants()
        m.close()
    finally:
        raw.close()
        server.stop()


def _chain_keys(m: KVCacheManager, tokens: list[int]) -> list[Any]:
    from kvpool.hashing.keys import BlockHasher

    return BlockHasher(m.config.hash_algo, TPB).extend(tokens)


# ----------------------------------------------------------------------------- engine


def test_engine_logits_after_a_prefetch_equal_a_cold_run() -> None:
    """kvpool.engine over a tiny random Llama: a second engine prefetches the prompt's blocks
    the first wrote through a shared store, reuses them, and its logits equal a cold run's."""
    import copy

    transformers = pytest.importorskip("transformers")
    from kvpool.engine import Engine, SamplingParams

    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa")).float().eval()
    store = MemoryStore(1 << 26)
    base = {"tokens_per_block": TPB, "gpu_blocks": 64, "host_blocks": 32}
    shared = {**base, "remote": {"store": store, "write": "store"}, "model_id": "llama"}
    prompt = torch.randint(1, 256, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
    first = Engine(copy.deepcopy(model), cache=shared)
    first.generate([prompt], params)
    assert first.manager.flush_remote(10)
    second = Engine(copy.deepcopy(model), cache=shared)
    assert second.manager.prefetch([SequenceRequest("p", prompt)]) == [10 * TPB]
    out = second.generate([prompt], params)[0]
    assert second.manager.stats().reused_tokens >= 10 * TPB
    cold = Engine(copy.deepcopy(model), cache=base).generate([prompt], params)[0]
    assert cold.logits is not None and out.logits is not None
    assert out.token_ids == cold.token_ids
    assert float((torch.stack(out.logits) - torch.stack(cold.logits)).abs().max()) <= 1e-4


def test_server_killed_during_a_write_through_then_restarted_gives_misses(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r").start()
    now = [0.0]
    try:
        store = RemoteStore(server.url, backoff_s=5.0, clock=lambda: now[0])
        big = list(range(7000, 7000 + 40 * TPB + 1))  # 40 blocks written through at once
        a = KVCacheManager(_cfg(gpu_blocks=48, remote=RemoteConfig(store=store, write="store")))
        _serve(a, "a", big)  # the commit queues 40 writes ...
        server.kill()  # ... and the server dies while the writer sends them (or just after)
        assert a.flush_remote(10)
        st = a.remote_stats()
        assert st is not None and st.written + st.write_failed == 40
        server.start()  # back, empty but for what reached it before the kill (nothing kept)
        b = KVCacheManager(_cfg(
            host_blocks=48, gpu_blocks=48, remote=RemoteConfig(url=server.url)))
        got = b.prefetch([SequenceRequest("b", big)])[0]
        assert got == 0  # no persistence: a restarted server lost everything; a miss
        _check_bytes(b)
        # the first manager carries on locally, and writes again once the backoff is over
        now[0] = 10.0
        assert _serve(a, "a2", big) == (40 * TPB, 0)
        fresh = list(range(9000, 9000 + 12 * TPB + 1))
        _serve(a, "a3", fresh)
        assert a.flush_remote(10)
        assert b.prefetch([SequenceRequest("c", fresh)]) == [12 * TPB]
        _check_bytes(b)
        a.check_invariants()
        b.check_invariants()
        a.close()
        b.close()
    finally:
        server.stop()
