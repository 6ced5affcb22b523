"""Publishing a manager's events in vLLM's format: whole blocks only by default, as vLLM does,
for the blocks' whole life (no removal or move of a block the consumer never saw); every
block, partial ones included, with ``partial_blocks=True``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.events.index import EventIndex
from kvpool.events.model import KVCacheEvent, Stored, StoredBlock
from kvpool.events.vllm_msgpack import decode_vllm_batch, encode_vllm_batch
from kvpool.events.vllm_stream import VllmStreamEncoder

TPB = 4
ALGO = "v1_block_key"


def run_manager(seed_ops: list[tuple[int, int, bool]], host: int) -> list[list[KVCacheEvent]]:
    """A manager with partial reuse (so partial last blocks are committed), small pools and
    an optional host tier (so blocks move between tiers); the events of each step."""
    m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=10, host_blocks=host,
                                   hash_algo=ALGO, events=EventsConfig(buffer_max_size=100_000)))
    steps: list[list[KVCacheEvent]] = []
    live: list[int] = []
    for sid, (prefix, length, release) in enumerate(seed_ops):
        tokens = [prefix, *range(100 * prefix, 100 * prefix + length)]
        try:
            m.add_sequence(SequenceRequest(sid, tokens))
            live.append(sid)
        except OutOfBlocksError:
            pass
        if release or len(live) > 2:
            while live:
                m.remove_sequence(live.pop(0))
        m.flush_iteration_events()
        steps.append(m.get_latest_events(0))
    m.flush_iteration_events()
    steps.append(m.get_latest_events(0))
    return steps


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.booleans()),
               min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS, st.sampled_from([0, 6]))
def test_a_consumer_sees_exactly_the_whole_blocks_and_nothing_about_the_others(
    ops: list[tuple[int, int, bool]], host: int
) -> None:
    steps = run_manager(ops, host)
    direct, whole, every = EventIndex(strict=True), EventIndex(strict=True), EventIndex(strict=True)
    vllm_like, kvpool_like = VllmStreamEncoder(TPB), VllmStreamEncoder(TPB, partial_blocks=True)
    partial: set[object] = set()
    for events in steps:
        direct.apply_all(events)
        partial.update(b.block_hash for e in events if isinstance(e.data, Stored)
                       for b in e.data.blocks if len(b.tokens) < TPB)
        got = decode_vllm_batch(vllm_like.encode(events), hash_algo=ALGO).events
        # vLLM's shape: token ids are a whole number of blocks (none in a tier move's
        # placeholder, as vLLM's offloading connector writes it)
        assert all(len(b.tokens) in (0, TPB) for e in got if isinstance(e.data, Stored)
                   for b in e.data.blocks)
        whole.apply_all(got)  # strict: no removal or move of a block it never saw
        every.apply_all(decode_vllm_batch(kvpool_like.encode(events), hash_algo=ALGO).events)
        assert every.cached == direct.cached
        assert whole.cached == {c for c in direct.cached if c[0] not in partial}


def test_the_manager_does_commit_partial_blocks_here() -> None:
    """The property above is not vacuous: its workload announces partial blocks, and moves
    and removes some of them."""
    steps = run_manager([(1, 6, True), (2, 7, True), (3, 9, True), (1, 13, True)] * 3, 6)
    stored = [b for events in steps for e in events if isinstance(e.data, Stored)
              for b in e.data.blocks]
    assert any(len(b.tokens) < TPB for b in stored)
    vllm_like = VllmStreamEncoder(TPB)
    plain = [len(encode_vllm_batch(events, block_size=TPB, partial_blocks=True))
             for events in steps]
    assert sum(len(vllm_like.encode(events)) for events in steps) < sum(plain)


def test_one_call_leaves_a_chains_partial_last_block_out_by_default() -> None:
    chain = (StoredBlock(11, (1, 2, 3, 4)), StoredBlock(12, (5, 6, 7, 8)), StoredBlock(13, (9,)))
    event = KVCacheEvent(0, Stored(None, chain), 0, hash_algo=ALGO)
    for size in (4, None):  # the size given, or the event's longest block
        (got,) = decode_vllm_batch(encode_vllm_batch([event], block_size=size),
                                   hash_algo=ALGO).events
        assert isinstance(got.data, Stored)
        assert [b.block_hash for b in got.data.blocks] == [11, 12]
    (got,) = decode_vllm_batch(encode_vllm_batch([event], block_size=4, partial_blocks=True),
                               hash_algo=ALGO).events
    assert isinstance(got.data, Stored) and [b.block_hash for b in got.data.blocks] == [11, 12, 13]
    lone = KVCacheEvent(1, Stored(12, (StoredBlock(13, (9,)),)), 0, hash_algo=ALGO)
    assert decode_vllm_batch(encode_vllm_batch([lone], block_size=4), hash_algo=ALGO).events == []
