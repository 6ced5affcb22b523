"""kvpool's vLLM CachePolicy classes against vLLM 0.33's own LRU: a stateful test drives both
with the same calls (as vLLM's CPUOffloadingManager makes them) and checks the contract they
share: what ``get`` returns, ``evict(n, protected)`` giving exactly n idle, unprotected,
resident chunks or None exactly when vLLM's LRU does (and then changing nothing), ``clear``;
and, through vLLM's CPUOffloadingManager, capacity and hits on a looping scan."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_peer import vllm_module

base = vllm_module("vllm.v1.kv_offload.base")
policies_base = vllm_module("vllm.v1.kv_offload.cpu.policies.base")
lru_mod = vllm_module("vllm.v1.kv_offload.cpu.policies.lru")
cpu_manager = vllm_module("vllm.v1.kv_offload.cpu.manager")
from kvpool.integrations.vllm.policies import (  # noqa: E402  (after the vLLM check)
    KvpoolARC,
    KvpoolCachePolicy,
    KvpoolLRU,
    KvpoolPriorityS3FIFO,
    KvpoolS3FIFO,
    KvpoolTwoQ,
)

CAPACITY = 6
KEYS = [bytes([i]) * 8 for i in range(12)]
ChunkStatus = policies_base.ChunkStatus


def _machine(policy_cls: type[KvpoolCachePolicy]) -> type[RuleBasedStateMachine]:
    class Contract(RuleBasedStateMachine):
        """One model of the chunks (resident, ready, pins); vLLM's LRU and a kvpool policy
        get the same calls; after an eviction the kvpool policy is brought to the same
        resident set (remove / insert, both legal calls)."""

        def __init__(self) -> None:
            super().__init__()
            self.ctx = base.ReqContext("r")
            self.theirs = lru_mod.LRUCachePolicy(CAPACITY)
            self.ours = policy_cls(CAPACITY)
            self.status: dict[bytes, tuple[Any, Any]] = {}  # key -> (their chunk, our chunk)
            self.free = list(range(CAPACITY))

        def both(self, name: str, *args: Any) -> tuple[Any, Any]:
            return getattr(self.theirs, name)(*args), getattr(self.ours, name)(*args)

        @precondition(lambda self: self.free)
        @rule(k=st.sampled_from(KEYS), ready=st.booleans())
        def insert(self, k: bytes, ready: bool) -> None:
            if k in self.status:
                return
            cid = self.free.pop()
            pair = (ChunkStatus(cid), ChunkStatus(cid))
            if ready:
                for c in pair:
                    c.ref_cnt = 0
            self.status[k] = pair
            self.theirs.insert(k, pair[0], self.ctx)
            self.ours.insert(k, pair[1], self.ctx)

        @rule(k=st.sampled_from(KEYS), ok=st.booleans())
        def complete_store(self, k: bytes, ok: bool) -> None:
            pair = self.status.get(k)
            if pair is None or pair[0].ref_cnt != -1:
                return
            if ok:
                for c in pair:
                    c.ref_cnt = 0
                self.both("mark_evictable", k)
            else:
                self.both("remove", k)
                del self.status[k]
                self.free.append(pair[0].chunk_id)

        @rule(k=st.sampled_from(KEYS), pin=st.booleans())
        def pin_or_unpin(self, k: bytes, pin: bool) -> None:
            pair = self.status.get(k)
            if pair is None or pair[0].ref_cnt < 0 or (not pin and pair[0].ref_cnt == 0):
                return
            for c in pair:
                c.ref_cnt += 1 if pin else -1
            if pin and pair[0].ref_cnt == 1:
                self.both("mark_non_evictable", k)
            if not pin and pair[0].ref_cnt == 0:
                self.both("mark_evictable", k)

        @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=5),
              finished=st.booleans())
        def use(self, keys: list[bytes], finished: bool) -> None:
            ready = {k for k in keys if k in self.status and self.status[k][0].ref_cnt >= 0}
            if finished:
                self.both("on_request_finished", (tuple(keys),), set(), ready,
                          base.ReqContext("u"))
            else:
                self.both("touch", keys, self.ctx)

        @rule(n=st.integers(0, CAPACITY + 1),
              protected=st.lists(st.sampled_from(KEYS), unique=True, max_size=4))
        def evict(self, n: int, protected: list[bytes]) -> None:
            guard = set(protected)
            before = {k: self.ours.get(k) for k in KEYS}
            theirs, ours = self.both("evict", n, set(guard))
            idle = [k for k, (c, _) in self.status.items() if c.ref_cnt == 0 and k not in guard]
            assert (theirs is None) == (ours is None) == (len(idle) < n)
            if ours is None:
                assert {k: self.ours.get(k) for k in KEYS} == before  # atomic: no change
                return
            for victims, side in ((theirs, 0), (ours, 1)):
                keys = [k for k, _ in victims]
                assert len(keys) == len(set(keys)) == n
                assert set(keys) <= set(idle)
                assert all(chunk is self.status[k][side] for k, chunk in victims)
            gone_theirs = {k for k, _ in theirs}
            gone_ours = {k for k, _ in ours}
            for k in gone_ours - gone_theirs:  # keep both on one resident set
                self.ours.insert(k, self.status[k][1], self.ctx)
            for k in gone_theirs - gone_ours:
                self.ours.remove(k)
            for k in gone_theirs:
                self.free.append(self.status.pop(k)[0].chunk_id)

        @rule()
        def clear(self) -> None:
            self.both("clear")
            self.status.clear()
            self.free = list(range(CAPACITY))

        @invariant()
        def get_agrees(self) -> None:
            for k in KEYS:
                pair = self.status.get(k)
                assert self.theirs.get(k) is (pair[0] if pair else None)
                assert self.ours.get(k) is (pair[1] if pair else None)

    Contract.__name__ = f"Contract{policy_cls.__name__}"
    return Contract


@pytest.mark.parametrize("policy", [KvpoolS3FIFO, KvpoolTwoQ, KvpoolARC, KvpoolLRU,
                                    KvpoolPriorityS3FIFO])
def test_the_cache_policy_contract_against_vllms_lru(policy: type[KvpoolCachePolicy]) -> None:
    machine = _machine(policy)
    machine.TestCase.settings = settings(max_examples=15, stateful_step_count=40,
                                         deadline=None)
    machine.TestCase().runTest()


@pytest.mark.parametrize("name", ["KvpoolS3FIFO", "KvpoolTwoQ", "KvpoolARC", "KvpoolLRU",
                                  "KvpoolPriorityS3FIFO"])
def test_loaded_by_vllms_cpu_manager_from_the_module_path(name: str) -> None:
    manager = cpu_manager.CPUOffloadingManager(
        4, cache_policy=name, cache_policy_module_path="kvpool.integrations.vllm")
    ctx = base.ReqContext("r")
    manager.on_new_request(ctx)
    for start in range(0, 12, 2):
        out = manager.prepare_store(KEYS[start:start + 2], ctx)
        assert out is not None and len(out.keys_to_store) == 2
        manager.complete_store(out.keys_to_store, ctx)
        resident = [k for k in KEYS if manager.lookup(k, ctx) is base.LookupResult.HIT]
        assert len(resident) == min(4, start + 2)  # never above capacity
    assert resident == KEYS[8:12]


def _ctx(req: str, priority: object | None) -> Any:
    params = None if priority is None else {"kvpool_priority": priority}
    return base.ReqContext(req, kv_transfer_params=params)


@settings(max_examples=20, deadline=None)
@given(priorities=st.lists(st.one_of(st.none(), st.integers(0, 100)), min_size=8, max_size=8),
       n=st.integers(1, 4))
def test_priority_policy_evicts_the_lowest_priority_first(
        priorities: list[int | None], n: int) -> None:
    """Through vLLM's own CPUOffloadingManager: a request's kv_transfer_params priority
    decides which chunks go first (the lowest; stored order within a priority)."""
    manager = cpu_manager.CPUOffloadingManager(
        8, cache_policy="KvpoolPriorityS3FIFO", cache_policy_module_path="kvpool.integrations.vllm")
    for i, p in enumerate(priorities):
        ctx = _ctx(f"r{i}", p)
        manager.on_new_request(ctx)
        out = manager.prepare_store([KEYS[i]], ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    ctx = base.ReqContext("new")
    manager.on_new_request(ctx)
    out = manager.prepare_store(KEYS[8:8 + n], ctx)
    assert out is not None and len(out.keys_to_store) == n
    level = [35 if p is None else p for p in priorities]
    expected = sorted(range(8), key=lambda i: (level[i], i))[:n]
    gone = {i for i in range(8) if manager.lookup(KEYS[i], ctx) is not base.LookupResult.HIT}
    assert gone == set(expected)


def test_priority_policy_takes_a_bad_priority_as_the_default() -> None:
    policy = KvpoolPriorityS3FIFO(4)
    for bad in (-1, 101, "high", 2.5, True):
        assert policy._priority(_ctx("r", bad)) == 35
    assert policy.invalid_priorities == 5
    assert policy._priority(_ctx("r", 90)) == 90 and policy._priority(_ctx("r", None)) == 35
