"""PublishedState: a snapshot, applied to a fresh consumer, equals what every event built."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.events.index import EventIndex
from kvpool.events.model import AllCleared, KVCacheEvent, Stored, StoredBlock
from kvpool.events.snapshot import PublishedState
from kvpool.events.vllm_msgpack import decode_vllm_batch, encode_vllm_batch
from kvpool.hashing.keys import HashAlgo

TPB = 4
OPS = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6), st.booleans()),
               min_size=1, max_size=20)


def _manager(window_sizes: tuple[int | None, ...] = (None,)) -> KVCacheManager:
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=[16] * len(window_sizes),
                                      host_blocks=[8] * len(window_sizes),
                                      window_sizes=window_sizes, hash_algo=HashAlgo.V2_SHA256_64,
                                      enable_partial_reuse=False,
                                      events=EventsConfig(buffer_max_size=100_000)))


def _consumer(events: list[KVCacheEvent]) -> frozenset[tuple[object, int, int]]:
    index = EventIndex(strict=True)
    index.apply_all(events)
    return index.cached


@settings(max_examples=40, deadline=None)
@given(OPS, st.booleans())
def test_snapshot_equals_the_stream_and_the_cache(
    ops: list[tuple[int, int, bool]], two_groups: bool
) -> None:
    m = _manager((None, 8) if two_groups else (None,))
    state, stream = PublishedState(), EventIndex(strict=True)
    live: list[int] = []
    for seq_id, (family, n_blocks, keep) in enumerate(ops):
        # families share prefixes, so chains continue cached blocks
        tokens = [family * 100 + i for i in range(n_blocks * TPB + 1)]
        try:
            m.add_sequence(SequenceRequest(seq_id, tokens))
        except OutOfBlocksError:
            pass
        else:
            live.append(seq_id)
        if not keep and live:
            m.remove_sequence(live.pop(0))
        m.flush_iteration_events()
        events = m.get_latest_events(0)
        state.apply(events)
        stream.apply_all(events)
        snapshot = state.events()
        assert isinstance(snapshot[0].data, AllCleared)
        cache = frozenset(m.cached_blocks())
        assert _consumer(snapshot) == stream.cached == cache
        # through the wire, as a router receives it
        wire = decode_vllm_batch(encode_vllm_batch(snapshot, block_size=TPB)).events
        assert {(b.block_hash, e.layer_group_id, b.cache_level) for e in wire
                if isinstance(e.data, Stored) for b in e.data.blocks} == cache
    # a publisher restarted under the live manager starts from what it announced
    seeded = PublishedState()
    seeded.seed(m.cached_blocks())
    assert _consumer(seeded.events()) == frozenset(m.cached_blocks())


def test_snapshot_keeps_chains_as_chains() -> None:
    state = PublishedState()
    blocks = tuple(StoredBlock(h, (h, h), 0) for h in (1, 2, 3))
    state.apply([KVCacheEvent(0, Stored(None, blocks), 0),
                 KVCacheEvent(1, Stored(3, (StoredBlock(4, (4,), 1),)), 0)])
    moved = Stored(3, (StoredBlock(4, (4,), 1),))
    assert [e.data for e in state.events()[1:]] == [Stored(None, blocks), moved]
