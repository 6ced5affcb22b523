"""Equal logits (fp32, against transformers' own forward, greedy tokens identical) on a tiny
Qwen3-Next whose reused prefix resumes from a checkpoint that came from the remote tier (a real
redis-server, after the GPU and host copies were dropped; the engine prefetches it before
admission) or from the persistent disk tier after a restart (docs/hybrid.md: checkpoints
through the tiers). Two engines sharing the store: test_engine_remote.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import test_engine_hybrid as hybrid

from kvpool import SequenceRequest
from redis_server import RedisServer

STATE = 1  # the state group (after Qwen3-Next's one attention group)
CACHE: dict[str, Any] = {"gpu_blocks": {0: 24, STATE: 4}, "host_blocks": {0: 32, STATE: 2},
                         "checkpoint_policy": "every_block", "model_id": "tiny-qwen3-next"}


def test_checkpoint_from_the_remote_tier(redis_server: RedisServer) -> None:
    pair = hybrid.Pair("qwen3_next", {**CACHE, "remote": {"url": redis_server.url,
                                                          "write": "store"}})
    m = pair.engine.manager
    base = hybrid.tokens(40, 14)
    pair.run([base], max_tokens=2)
    assert m.flush_remote(10)
    m.clear_cache()  # the GPU and host copies are gone; the store keeps them
    query = base[:12] + hybrid.tokens(41, 3)
    assert m.count_reusable_tokens(query) == 0
    before = m.stats()
    out = pair.run([query])[0]  # the engine prefetches before admitting it
    assert out.cached_tokens == 12 and pair.engine.scheduler.remote_tokens == 12
    stats = m.remote_stats()
    assert stats is not None and stats.prefetched_checkpoints == 1
    assert m.stats().tier_hits[1] > before.tier_hits[1]  # the prefetched host checkpoint
    m.close()


def test_checkpoint_from_the_persistent_disk_after_a_restart(tmp_path: Path) -> None:
    cache = {**CACHE, "disk_blocks": {0: 48, STATE: 4},
             "disk": {"path": str(tmp_path), "persistent": True}}
    pair = hybrid.Pair("qwen3_next", cache)
    base = hybrid.tokens(42, 14)
    pair.run([base], max_tokens=2)
    pair.engine.manager.close()  # spills the GPU and host tiers to the disk tier
    pair = hybrid.Pair("qwen3_next", cache)  # a new engine: restart recovery
    m = pair.engine.manager
    disk = m.persistent_disk
    assert disk is not None and disk.restored.slots > 0
    query = base[:12] + hybrid.tokens(43, 3)
    assert m.plan_batch([SequenceRequest("p", query)]).requests[0].claim_tiers[STATE] == [2]
    before = m.stats()
    out = pair.run([query])[0]
    assert out.cached_tokens == 12
    assert m.stats().tier_hits[2] > before.tier_hits[2]  # the checkpoint came from disk
    m.close()
