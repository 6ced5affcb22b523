"""The manager's event stream, end to end: through vLLM msgpack over a real ZMQ PUB/SUB pair
on 127.0.0.1 with a deliberately dropped message, a consumer reproduces the cache exactly."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.config import CacheConfig, EventsConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.events.index import EventIndex
from kvpool.events.model import Removed, Stored
from kvpool.events.vllm_msgpack import decode_vllm_batch, encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher, ZmqEventSubscriber
from kvpool.hashing.keys import HashAlgo, request_block_hashes, v1_block_key


def workload_step(m: KVCacheManager, rng: random.Random, live: list[int], sid: int) -> None:
    prefix = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4, 40, 41]])
    toks = prefix[: rng.randint(1, len(prefix))] + [rng.randrange(3) for _ in range(5)]
    try:
        m.add_sequence(SequenceRequest(sid, toks))
        live.append(sid)
    except OutOfBlocksError:
        pass
    while len(live) > 2 or (live and rng.random() < 0.3):
        m.remove_sequence(live.pop(0))


def test_events_over_zmq_with_a_dropped_message_reproduce_the_cache() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=8, host_blocks=6,
                                   hash_algo="v1_block_key",
                                   events=EventsConfig(buffer_max_size=10_000)))
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint)
    index = EventIndex(strict=True)
    try:
        sub.catch_up()
        rng = random.Random(7)
        live: list[int] = []
        pub.skip_on_pub(5)  # batch 5 never reaches SUB; the subscriber must replay it
        seq = 0
        for step in range(60):
            workload_step(m, rng, live, step)
            m.flush_iteration_events()
            events = m.get_latest_events(0)
            if events:
                pub.publish(encode_vllm_batch(events, block_size=2, partial_blocks=True))
                seq += 1
        got: list[int] = []
        while len(got) < seq:
            batches = sub.recv(timeout_s=5.0)
            assert batches, f"only {len(got)} of {seq} batches arrived"
            for b in batches:
                got.append(b.seq)
                index.apply_all(decode_vllm_batch(b.payload, hash_algo="v1_block_key").events)
        assert got == list(range(seq))
        assert sub.replayed >= 1
        assert set(index.cached) == m.cached_blocks()
        assert m.stats().offload_blocks > 0  # tier moves were part of the stream
    finally:
        sub.close()
        pub.close()


def test_committed_chain_is_one_stored_event_and_eviction_removes() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=4, enable_partial_reuse=False,
                                   events=EventsConfig(buffer_max_size=100)))
    m.add_sequence(SequenceRequest(0, [1, 2, 3, 4, 5, 6, 7]))
    m.remove_sequence(0)  # commits 3 full blocks as one chain
    m.flush_iteration_events()
    stored = [e for e in m.get_latest_events(0) if isinstance(e.data, Stored)]
    assert len(stored) == 1 and len(stored[0].data.blocks) == 3
    assert stored[0].data.parent_hash is None
    m.add_sequence(SequenceRequest(1, [50, 51, 52, 53, 54, 55, 56]))  # evicts all three
    m.flush_iteration_events()
    removed = [e for e in m.get_latest_events(0) if isinstance(e.data, Removed)]
    assert sorted(h for e in removed for h in e.data.block_hashes) == sorted(
        b.block_hash for b in stored[0].data.blocks
    )


def test_failed_admission_emits_nothing() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=3,
                                   events=EventsConfig(buffer_max_size=100)))
    m.add_sequence(SequenceRequest(0, [1, 2, 3]))
    m.remove_sequence(0)
    m.flush_iteration_events()
    m.get_latest_events(0)
    try:
        m.add_sequence(SequenceRequest(1, list(range(10, 20))))
    except OutOfBlocksError:
        pass
    else:  # pragma: no cover - the pool is too small by construction
        raise AssertionError("expected OutOfBlocksError")
    m.flush_iteration_events()
    assert m.get_latest_events(0) == []


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("salt", [None, "tenant"])
def test_stored_event_hashes_are_what_a_router_computes(algo: HashAlgo, salt: str | None) -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=16, hash_algo=algo,
                                   enable_partial_reuse=False,
                                   events=EventsConfig(buffer_max_size=100)))
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks of the prompt minus its last
    m.add_sequence(SequenceRequest(0, prompt, cache_salt=salt))
    m.remove_sequence(0)
    m.flush_iteration_events()
    stored = [b.block_hash for e in m.get_latest_events(0) if isinstance(e.data, Stored)
              for b in e.data.blocks]
    routed = request_block_hashes(prompt, 4, algo, cache_salt=salt)
    assert stored[:4] == routed[:4]


def test_decoding_without_tokens_keeps_every_hash_and_tier() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=6, host_blocks=4,
                                   hash_algo="v1_block_key",
                                   events=EventsConfig(buffer_max_size=1000)))
    for sid in range(6):
        m.add_sequence(SequenceRequest(sid, [sid % 2, *range(10 * sid, 10 * sid + 12)]))
        m.remove_sequence(sid)
    m.flush_iteration_events()
    payload = encode_vllm_batch(m.get_latest_events(0), block_size=4)
    full = decode_vllm_batch(payload, hash_algo="v1_block_key").events
    lean = decode_vllm_batch(payload, hash_algo="v1_block_key", tokens=False).events
    assert len(full) == len(lean) and any(isinstance(e.data, Removed) for e in full)
    assert any(x.tokens for e in full if isinstance(e.data, Stored) for x in e.data.blocks)
    for a, b in zip(full, lean, strict=True):
        if isinstance(a.data, Stored):
            assert isinstance(b.data, Stored)
            assert [x.block_hash for x in a.data.blocks] == [x.block_hash for x in b.data.blocks]
            assert [x.cache_level for x in a.data.blocks] == [x.cache_level for x in b.data.blocks]
            assert not any(x.tokens for x in b.data.blocks)
        else:
            assert a == b


@given(
    tpb=st.integers(1, 5),
    partial=st.booleans(),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=23), min_size=1,
                     max_size=6),
)
def test_stored_blocks_carry_their_own_tokens(
    tpb: int, partial: bool, prompts: list[list[int]]
) -> None:
    """Every stored block's tokens are the tokens its key was computed over: full blocks and,
    with partial reuse, a trailing partial block (the key is chained here with the public
    v1_block_key, block by block, not by the manager's hasher)."""
    m = KVCacheManager(CacheConfig(tokens_per_block=tpb, gpu_blocks=64, hash_algo="v1_block_key",
                                   enable_partial_reuse=partial,
                                   events=EventsConfig(buffer_max_size=10_000)))
    expected: dict[int, tuple[int, ...]] = {}
    for sid, prompt in enumerate(prompts):
        parent = 0
        for start in range(0, len(prompt), tpb):
            chunk = tuple(prompt[start:start + tpb])
            key = v1_block_key(list(chunk), parent)
            expected[key] = chunk
            parent = key
        m.add_sequence(SequenceRequest(sid, prompt))
        m.remove_sequence(sid)
    m.flush_iteration_events()
    blocks = [b for e in m.get_latest_events(0) if isinstance(e.data, Stored)
              for b in e.data.blocks]
    assert bool(blocks) == (partial or any(len(p) >= tpb for p in prompts))
    for b in blocks:
        assert b.tokens == expected[b.block_hash]
    stored_partial = any(len(b.tokens) < tpb for b in blocks)
    assert stored_partial == (partial and any(len(p) % tpb for p in prompts))


@pytest.mark.parametrize("policy", ["lru", "2q", "arc", "s3fifo"])
@pytest.mark.parametrize("needed", [1, 2, 3, 5])
def test_evicted_blocks_are_removed_in_eviction_order(policy: str, needed: int) -> None:
    """A released chain is evicted tail first, and its removed event lists the hashes in that
    order: a whole chain (needed >= its length, the next one's tail too) or only its tail."""
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=6, enable_partial_reuse=False,
                                   events=EventsConfig(buffer_max_size=100),
                                   eviction=EvictionConfig(policy=policy)))
    chains = []
    for sid, first in enumerate((10, 20)):
        m.add_sequence(SequenceRequest(sid, list(range(first, first + 6))))
        m.remove_sequence(sid)  # 3 blocks each (the pool's 6 slots), released tail first
        m.flush_iteration_events()
        (stored,) = [e for e in m.get_latest_events(0) if isinstance(e.data, Stored)]
        chains.append([b.block_hash for b in stored.data.blocks])
    m.add_sequence(SequenceRequest(9, list(range(100, 100 + 2 * needed))))
    m.flush_iteration_events()
    removed = [h for e in m.get_latest_events(0) if isinstance(e.data, Removed)
               for h in e.data.block_hashes]
    assert removed == (chains[0][::-1] + chains[1][::-1])[:needed]
