"""Hybrid models' events (docs/hybrid.md): checkpoints are stored, moved and removed blocks of
their state group; vLLM's own decoder reads them with the right group indices and the spec
kind "mamba", and kvpool's event index reproduces the cached set, checkpoints included."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.events.index import EventIndex
from kvpool.events.vllm_msgpack import decode_vllm_batch
from kvpool.events.vllm_stream import VllmStreamEncoder

kv_events = pytest.importorskip("vllm.distributed.kv_events")

TPB = 4
ALGO = "v1_block_key"


def _run() -> tuple[KVCacheManager, list[list[object]]]:
    """Attention group 0, state group 1 (3 GPU + 2 host state slots): checkpoints saved,
    offloaded to host and dropped as later ones arrive."""
    m = KVCacheManager(CacheConfig(
        tokens_per_block=TPB, gpu_blocks=[40, 3], host_blocks=[0, 2], window_sizes=[None, None],
        state_groups=[1], checkpoint_policy="every_block", hash_algo=ALGO,
        events=EventsConfig(buffer_max_size=100_000)))
    steps = []
    for n in range(6):
        tokens = [n + 1, *range(10 * n, 10 * n + 9)]
        m.add_sequence(SequenceRequest(n, tokens))
        for p in m.checkpoint_positions(n, 0, len(tokens)):
            m.save_checkpoint(n, p)
        m.remove_sequence(n)
        m.check_invariants()
        m.flush_iteration_events()
        steps.append(m.get_latest_events(0))
    return m, steps


def test_vllm_decodes_hybrid_events_with_their_group_and_kind() -> None:
    m, steps = _run()
    enc = VllmStreamEncoder(TPB, state_groups=[1])
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    stored_kinds: dict[int | None, set[str | None]] = {}
    removed_groups: set[int | None] = set()
    mine = EventIndex(strict=True)
    for events in steps:
        payload = enc.encode(events)  # type: ignore[arg-type]
        batch = decoder.decode(payload)  # vLLM's own types
        for ev in batch.events:
            if isinstance(ev, kv_events.BlockStored) and ev.token_ids:
                stored_kinds.setdefault(ev.group_idx, set()).add(ev.kv_cache_spec_kind)
            elif isinstance(ev, kv_events.BlockRemoved):
                removed_groups.add(ev.group_idx)
        mine.apply_all(decode_vllm_batch(payload, hash_algo=ALGO).events)
    assert stored_kinds == {None: {None}, 1: {"mamba"}}  # group 0 is vLLM's default (None)
    assert 1 in removed_groups  # checkpoints left (evicted past the host tier)
    assert mine.cached == m.cached_blocks()
    assert {(g, t) for _, g, t in m.cached_blocks()} >= {(1, 0), (1, 1)}
