"""FlopAware (kvpool.eviction.flops): Marconi's checkpoint eviction score.

A hypothesis model test checks every operation against a plain reference (the lowest
priority level first, then the lowest ``recency + alpha x FLOPs saved`` with both terms
min-max normalised, ties to the oldest push): a claimed slot is never a victim, ``peek_order``
is the order of successive pops, errors change nothing. Then the manager: with
``EvictionConfig.checkpoint_alpha`` the state pools use it, shallow recently used checkpoints
go before a deep one, and the hybrid replay's hit rate on shared system prompts beats LRU's.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import CacheConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import InvalidArgumentError
from kvpool.eviction.flops import FlopAware, prefix_flops
from kvpool.planner.hybrid import hybrid_presets
from kvpool.replay.hybrid import hybrid_hit_rate
from kvpool.replay.workloads import synthetic_workload

SIZE = 8


def _norm(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in xs]


def reference_victim(queued: dict[int, tuple[int, int, float]], alpha: float) -> int:
    """queued: slot -> (priority, push tick, FLOPs saved)."""
    low = min(p for p, _, _ in queued.values())
    cand = sorted(s for s, (p, _, _) in queued.items() if p == low)
    rec = _norm([float(queued[s][1]) for s in cand])
    sav = _norm([queued[s][2] for s in cand])
    return min(zip(cand, rec, sav, strict=True),
               key=lambda c: (c[1] + alpha * c[2], queued[c[0]][1]))[0]


OPS = st.lists(st.tuples(st.sampled_from(["push", "push", "remove", "pop"]),
                         st.integers(0, SIZE - 1), st.sampled_from([10, 35, 35, 80]),
                         st.integers(0, 40), st.integers(0, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_matches_reference(ops: list[tuple[str, int, int, int, int]], alpha: float) -> None:
    spans: dict[int, tuple[int, int]] = {}
    q = FlopAware(lambda: 0.0, capacity=SIZE, alpha=alpha, crossover=64,
                  span_of=lambda s: spans[s])
    ref: dict[int, tuple[int, int, float]] = {}
    claimed: set[int] = set()
    tick = 0
    for op, slot, prio, a, b in ops:
        if op == "push":
            start, end = sorted((a, b))
            spans[slot] = (end * 16, start * 16)
            if slot in ref:
                with pytest.raises(InvalidArgumentError):
                    q.push(slot, prio)
                continue
            q.push(slot, prio)
            tick += 1
            ref[slot] = (prio, tick, float(prefix_flops(end * 16.0, 64)
                                           - prefix_flops(start * 16.0, 64)))
            claimed.discard(slot)
        elif op == "remove":
            if slot not in ref:
                with pytest.raises(KeyError):
                    q.remove(slot)
                continue
            q.remove(slot)
            del ref[slot]
            claimed.add(slot)
        elif not ref:
            with pytest.raises(IndexError):
                q.pop()
        else:
            want = reference_victim(ref, alpha)
            assert q.peek_order()[0] == want
            got, p = q.pop()
            assert (got, p) == (want, ref[want][0])
            assert got not in claimed
            del ref[got]
        assert len(q) == len(ref)
        assert sorted(q.peek_order()) == sorted(ref)
        assert all(s not in q for s in claimed)
    order = q.peek_order()
    assert q.pop_slots(len(q)) == order


def test_alpha_zero_is_lru_and_alpha_keeps_deep_checkpoints() -> None:
    spans = {0: (4096, 0), 1: (64, 0), 2: (128, 64)}
    for alpha, first in ((0.0, 0), (1.0, 1)):
        q = FlopAware(lambda: 0.0, capacity=3, alpha=alpha, span_of=lambda s: spans[s])
        for s in (0, 1, 2):
            q.push(s, 35)
        assert q.pop()[0] == first
    with pytest.raises(InvalidArgumentError):
        FlopAware(lambda: 0.0, alpha=-1.0)


def test_expired_priority_falls_back_to_default_at_the_recent_end() -> None:
    now = [0.0]
    q = FlopAware(lambda: now[0], capacity=4, alpha=0.0)
    q.push(0, 80, expires_at=5.0)
    q.push(1, 35)
    assert q.pop()[0] == 1
    q.push(1, 35)
    now[0] = 6.0
    assert q.pop() == (1, 35) and q.pop() == (0, 35)


def _hybrid(alpha: float | None) -> KVCacheManager:
    return KVCacheManager(CacheConfig(
        tokens_per_block=4, gpu_blocks=[64, 3], window_sizes=[None, None], state_groups=[1],
        checkpoint_policy="every_block", enable_partial_reuse=False,
        eviction=EvictionConfig(policy="lru", checkpoint_alpha=alpha)))


@pytest.mark.parametrize("alpha", [None, 4.0])
def test_manager_keeps_the_deep_checkpoint(alpha: float | None) -> None:
    """Two state slots for checkpoints (one runs): a 16-token prefix's deep checkpoint, then
    a 4-token one used recently. LRU evicts the deep one; the FLOP score the shallow one."""
    m = _hybrid(alpha)
    deep = list(range(100, 117))
    m.add_sequence(SequenceRequest("a", deep))
    assert m.save_checkpoint("a", 16)
    m.remove_sequence("a")
    m.add_sequence(SequenceRequest("b", [1, 2, 3, 4, 5]))
    assert m.save_checkpoint("b", 4)
    m.remove_sequence("b")
    m.add_sequence(SequenceRequest("c", [9, 9, 9, 9, 9]))
    assert m.save_checkpoint("c", 4)  # evicts one of the two
    m.remove_sequence("c")
    hit = m.add_sequence(SequenceRequest("d", deep)).reused_tokens
    assert hit == (16 if alpha is not None else 0)


def test_replay_short_prompts_beat_lru() -> None:
    spec = hybrid_presets()["qwen3-next-80b-a3b"]
    reqs = list(synthetic_workload(num_requests=200, system_prompt_tokens=300,
                                   turns_per_conversation=1, agent_fraction=0.0,
                                   user_tokens=64, output_tokens=64,
                                   num_system_prompts=16).requests)
    lru, flops = (hybrid_hit_rate(reqs, spec, 8 << 30, state_fraction=0.2, checkpoint_alpha=a)
                  for a in (None, 1.0))
    assert flops.hit_rate > 1.2 * lru.hit_rate
