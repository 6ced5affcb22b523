"""Two engines sharing a remote tier (a real redis-server on loopback): engine A serves a
prompt and its blocks (and a hybrid model's checkpoints) reach the store; engine B, a second
engine over its own manager, admits a prompt sharing that prefix and fetches it from the store
before admission (the scheduler calls ``manager.prefetch``), so it reuses A's prefix; its
logits equal transformers' own forward (fp32, <= 1e-4, greedy tokens identical). With the
store gone, or its values damaged, B computes cold and its logits are still right.

A tiny Llama (attention only) and a tiny Qwen3-Next (gated delta net + attention, reuse needs
a checkpoint) as the engine tests build them."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
redis = pytest.importorskip("redis")

import test_engine_hybrid as hybrid  # noqa: E402
import test_engine_logits as logits  # noqa: E402
from test_engine_hybrid_tiers import CACHE as HYBRID_CACHE  # noqa: E402
from test_engine_hybrid_tiers import STATE  # noqa: E402

from kvpool import SequenceRequest  # noqa: E402
from kvpool.core.remote_hooks import RemoteStats  # noqa: E402
from kvpool.engine import SamplingParams  # noqa: E402
from redis_server import RedisServer  # noqa: E402

CACHES: dict[str, dict[str, Any]] = {
    "llama": {"gpu_blocks": 32, "host_blocks": 32},
    "qwen3_next": HYBRID_CACHE,
}
SHARED = 12  # the prompts' common prefix: three blocks (TPB 4), a checkpoint at its end


def pair(name: str, url: str, write: str = "store") -> logits.Pair:
    cache = {**CACHES[name], "remote": {"url": url, "write": write}}
    if name == "llama":
        return logits.Pair(name, cache)
    return hybrid.Pair(name, cache)


def remote(p: logits.Pair) -> RemoteStats:
    stats = p.engine.manager.remote_stats()
    assert stats is not None
    return stats


def served_by_a(name: str, url: str) -> list[int]:
    """Engine A serves a prompt; its blocks and checkpoints are in the store when this
    returns. The prompt B's shares its first ``SHARED`` tokens with."""
    a = pair(name, url)
    base = hybrid.tokens(40, SHARED + 2)
    a.run([base], max_tokens=2)
    assert a.engine.manager.flush_remote(10)
    assert remote(a).written >= SHARED // logits.TPB
    a.engine.manager.close()
    return base[:SHARED] + hybrid.tokens(41, 3)


@pytest.fixture(params=list(CACHES))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_second_engine_reuses_the_first_ones_prefix_from_the_store(
        redis_server: RedisServer, name: str) -> None:
    query = served_by_a(name, redis_server.url)
    b = pair(name, redis_server.url)
    m = b.engine.manager
    assert m.count_reusable_tokens(query) == 0  # nothing local: the prefix is in the store
    out = b.run([query])[0]  # logits and greedy tokens against the dense forward
    assert out.cached_tokens == SHARED
    assert b.engine.scheduler.remote_tokens == SHARED
    stats = remote(b)
    assert stats.prefetch_calls == 1  # once, before the first admission; not per step
    assert stats.prefetched_blocks == SHARED // logits.TPB
    assert stats.prefetched_checkpoints == (1 if name == "qwen3_next" else 0)
    assert stats.errors == stats.rejected_values == 0
    assert m.stats().tier_hits[1] > 0  # prefetched into the host tier, claimed from there
    m.check_invariants()
    m.close()


def damage(url: str, name: str) -> int:
    """Flip the last byte of stored values: every one for the attention model; for the hybrid
    model only its checkpoints (its attention blocks are still fetched: without a checkpoint
    at their end they give nothing)."""
    client = redis.Redis.from_url(url)
    keys = [k for k in client.keys("kvp:*")
            if name == "llama" or k.endswith(b":%d" % STATE)]
    for k in keys:
        value = client.get(k)
        assert value is not None
        client.set(k, value[:-1] + bytes([value[-1] ^ 1]))
    client.close()
    return len(keys)


@pytest.mark.parametrize("failure", ["down", "damaged"])
def test_a_failing_store_is_a_miss_and_the_engine_computes_cold(
        redis_server: RedisServer, name: str, failure: str) -> None:
    query = served_by_a(name, redis_server.url)
    if failure == "down":
        redis_server.kill()
    else:
        assert damage(redis_server.url, name) >= 1
    b = pair(name, redis_server.url)
    out = b.run([query])[0]  # right logits all the same
    assert out.cached_tokens == 0 and b.engine.scheduler.remote_tokens == 0
    stats = remote(b)
    assert stats.prefetch_calls == 1 and stats.prefetched_checkpoints == 0
    if failure == "down":
        assert stats.errors >= 1 and stats.prefetched_blocks == 0
    else:
        assert stats.rejected_values >= 1
    b.engine.manager.check_invariants()
    b.engine.manager.close()


def test_without_a_remote_tier_the_engine_never_prefetches() -> None:
    p = logits.Pair("llama", CACHES["llama"])

    def refuse(requests: object) -> list[int]:
        raise AssertionError("prefetch called without a remote tier")

    p.engine.manager.prefetch = refuse  # type: ignore[method-assign]
    assert not p.engine.scheduler.remote
    p.engine.generate([hybrid.tokens(1, 9)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert p.engine.scheduler.remote_tokens == 0


@pytest.mark.parametrize("host", [0, 64])  # preempted by recomputation / by suspension
def test_each_request_is_prefetched_once_however_often_it_is_admitted(
        redis_server: RedisServer, host: int) -> None:
    gpu, prompts = logits.tight_pool("llama")
    cache = {"gpu_blocks": gpu, "remote": {"url": redis_server.url}}
    p = logits.Pair("llama", {**cache, "host_blocks": host} if host else cache,
                    max_batch_size=3)
    m = p.engine.manager
    asked: list[int | str] = []
    prefetch = m.prefetch

    def recording(requests: list[SequenceRequest]) -> list[int]:
        asked.extend(r.seq_id for r in requests)
        return prefetch(requests)

    m.prefetch = recording  # type: ignore[method-assign]
    p.run(prompts, max_tokens=20)  # logits against the dense forward
    sched = p.engine.scheduler
    assert sched.preemptions > 0 and (sched.recomputations > 0) == (not host)
    assert sorted(asked) == sorted(set(asked)) and len(asked) == len(prompts)
    m.close()
