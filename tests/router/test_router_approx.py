"""Approximate caches: the router's own LRU model of event-less workers, and the router's
``approx`` mode (alone and mixed with workers that publish events)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.errors import InvalidArgumentError
from kvpool.events.model import KVCacheEvent, Stored, StoredBlock
from kvpool.hashing.keys import request_block_hashes
from kvpool.router.approx import ApproxCaches
from kvpool.router.index import KvIndex
from kvpool.router.scoring import Router

STRIDE = 64


class Reference:
    """One worker as one recency order: the most recent ``cap[0]`` blocks are on GPU, the next
    ``cap[1]`` on host, the next ``cap[2]`` on disk; older ones are gone."""

    def __init__(self, cap: tuple[int, int, int], ttl: float) -> None:
        self.cap = cap
        self.ttl = ttl
        self.order: dict[int, float] = {}  # oldest first

    def touch(self, keys: list[int], now: float) -> None:
        for h in reversed(keys[: self.cap[0]]):
            self.order.pop(h, None)
            self.order[h] = now
        keep = sum(self.cap)
        while len(self.order) > keep:
            del self.order[next(iter(self.order))]

    def expire(self, now: float) -> None:
        for h in [h for h, t in self.order.items() if t <= now - self.ttl]:
            del self.order[h]

    def tiers(self) -> dict[int, int]:
        newest = list(reversed(self.order))
        out: dict[int, int] = {}
        rank = 0
        for tier, c in enumerate(self.cap):
            for h in newest[rank : rank + c]:
                out[h] = tier
            rank += c
        return out


def model_tiers(caches: ApproxCaches, slot: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for h, m in caches.masks.items():
        for t in range(3):
            if (m >> (t * STRIDE + slot)) & 1:
                assert h not in out, "a block sits on two tiers of one worker"
                out[h] = t
    return out


chains = st.lists(st.integers(0, 5), min_size=1, max_size=6).map(
    lambda path: [hash(tuple(path[: i + 1])) & 0xFFFF for i in range(len(path))]
)


class ApproxMachine(RuleBasedStateMachine):
    """ApproxCaches against :class:`Reference`, two workers of different budgets."""

    def __init__(self) -> None:
        super().__init__()
        self.caps = {0: (3, 4, 0), 5: (2, 0, 3)}
        self.caches = ApproxCaches(STRIDE, ttl_s=10.0)
        self.refs = {}
        for slot, cap in self.caps.items():
            self.caches.add(slot, cap)
            self.refs[slot] = Reference(cap, 10.0)
        self.now = 0.0

    @rule(slot=st.sampled_from([0, 5]), keys=chains, dt=st.sampled_from([0.0, 1.0, 4.0]))
    def touch(self, slot: int, keys: list[int], dt: float) -> None:
        self.now += dt
        self.caches.touch(slot, keys, self.now)
        self.refs[slot].touch(keys, self.now)

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0]))
    def expire(self, dt: float) -> None:
        self.now += dt
        self.caches.expire(self.now)
        for ref in self.refs.values():
            ref.expire(self.now)

    @rule(slot=st.sampled_from([0, 5]))
    def clear(self, slot: int) -> None:
        self.caches.clear(slot)
        self.refs[slot].order.clear()

    @invariant()
    def same_blocks_on_same_tiers(self) -> None:
        for slot, ref in self.refs.items():
            assert model_tiers(self.caches, slot) == ref.tiers()
        assert len(self.caches) == sum(len(r.order) for r in self.refs.values())


TestApproxCaches = ApproxMachine.TestCase


def test_leaves_leave_first_and_a_touch_brings_blocks_back_to_gpu() -> None:
    caches = ApproxCaches(STRIDE)
    caches.add(1, (2, 1))
    caches.touch(1, [10, 11, 12], 0.0)  # a 3-block prompt: the GPU budget keeps 10, 11
    assert model_tiers(caches, 1) == {10: 0, 11: 0}
    caches.touch(1, [20], 1.0)  # 11 (the leaf, older than its parent) goes to host
    assert model_tiers(caches, 1) == {20: 0, 10: 0, 11: 1}
    caches.touch(1, [10, 11], 2.0)  # back on GPU; 20 to host
    assert model_tiers(caches, 1) == {10: 0, 11: 0, 20: 1}
    caches.touch(1, [30], 3.0)  # 11 to host, 20 out
    assert model_tiers(caches, 1) == {30: 0, 10: 0, 11: 1}


@pytest.mark.parametrize("cap", [(), (0,), (1, 2, 3, 4), (1, -1), (True,), (1.5,)])
def test_bad_capacities_raise(cap: tuple[object, ...]) -> None:
    with pytest.raises(InvalidArgumentError):
        ApproxCaches(STRIDE).add(0, cap)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ApproxCaches(STRIDE, ttl_s=0)


# ------------------------------------------------------------------------------- the router

TPB = 4
PROMPT = list(range(65))  # body of 64 tokens: 16 blocks


def make(*workers: str, **router_args: object) -> tuple[KvIndex, Router]:
    index = KvIndex()
    for w in workers:
        index.add_worker(w, hash_algo="v1_block_key", tokens_per_block=TPB)
    return index, Router(index, **router_args)  # type: ignore[arg-type]


def publish(index: KvIndex, worker: str, tokens: list[int]) -> None:
    """``worker`` reports every whole block of ``tokens`` stored on GPU."""
    hashes = request_block_hashes(tokens, TPB, "v1_block_key")
    for i in range(len(tokens) // TPB):
        data = Stored(hashes[i - 1] if i else None,
                      (StoredBlock(hashes[i], tuple(tokens[i * TPB:(i + 1) * TPB]), 0),))
        index.apply(worker, KVCacheEvent(index.worker_info(worker).events_applied, data, 0,
                                         hash_algo="v1_block_key"))


def test_approx_mode_routes_a_conversation_back_to_where_it_went_without_events() -> None:
    index, router = make("A", "B", "C", mode="approx", approx_capacity_blocks=(64,))
    first = router.route(PROMPT, request_id="t1")
    router.request_finished("t1")
    assert router.predicted_cache_blocks() == 16
    other = router.route([9000 + i for i in range(65)], request_id="u1")
    assert other.worker_id != first.worker_id  # cold: ties rotate past the last pick
    router.request_finished("u1")
    turn2 = router.route(PROMPT + list(range(500, 540)), request_id="t2")
    assert turn2.worker_id == first.worker_id
    assert turn2.matched_blocks == (16, 0, 0)
    # events are ignored in approx mode: a worker that publishes the prompt gains nothing
    publish(index, "C" if first.worker_id != "C" else "B", PROMPT)
    router.request_finished("t2")
    assert router.route(PROMPT, request_id="t3").worker_id == first.worker_id


def test_a_predicted_worker_forgets_beyond_its_budget() -> None:
    _, router = make("A", "B", mode="approx", approx_capacity_blocks=(20,))
    a = router.route(PROMPT, request_id="p").worker_id
    router.request_finished("p")
    router.index.set_healthy("B" if a == "A" else "A", False)
    router.route([7000 + i for i in range(65)], request_id="q")  # 16 more blocks on a
    router.request_finished("q")
    router.index.set_healthy("B" if a == "A" else "A", True)
    d = router.route(PROMPT, request_id="r")
    # 20 blocks of budget: the first prompt kept only its first 4 blocks (leaves left first)
    assert {c.worker_id: c.matched_blocks[0] for c in d.candidates}[a] == 4


def test_mixed_router_uses_events_for_some_workers_and_its_model_for_others() -> None:
    index, router = make("ev", "quiet", prediction_ttl_s=0)
    router.predict_cache("quiet", (64, 0, 0))
    publish(index, "quiet", PROMPT)  # ignored: quiet is predicted
    publish(index, "ev", PROMPT[:33])  # 8 blocks
    d = router.route(PROMPT, request_id="x")
    assert {c.worker_id: c.matched_blocks for c in d.candidates} == {
        "ev": (8, 0, 0), "quiet": (0, 0, 0)}
    assert d.worker_id == "ev"
    router.request_finished("x")
    index.set_healthy("ev", False)
    assert router.route(PROMPT, request_id="y").worker_id == "quiet"
    router.request_finished("y")
    index.set_healthy("ev", True)
    d2 = router.route(PROMPT, request_id="z")  # quiet now predicted with all 16 blocks
    assert {c.worker_id: c.matched_blocks for c in d2.candidates} == {
        "ev": (8, 0, 0), "quiet": (16, 0, 0)}
    assert d2.worker_id == "quiet"
    index.remove_worker("quiet")
    assert router.approx.slot_bits == 0 and router.predicted_cache_blocks() == 0


def test_config_names_event_less_workers_and_rejects_bad_budgets() -> None:
    from kvpool.errors import ConfigError
    from kvpool.router.config import parse_config

    cfg = parse_config({"router": {"mode": "approx"}, "workers": [
        {"id": "quiet", "kind": "vllm", "tokens_per_block": 16, "approx_blocks": [100, 50]},
        {"id": "ev", "kind": "vllm", "zmq_endpoint": "tcp://127.0.0.1:5557"},
    ]})
    assert cfg.router.mode == "approx"
    assert [w.approx_blocks for w in cfg.workers] == [(100, 50), None]
    for bad in ([], [0], [1, 2, 3, 4], ["x"], [5, -1]):
        with pytest.raises(ConfigError, match=r"workers\[0\]\.approx_blocks"):
            parse_config({"workers": [{"id": "q", "kind": "vllm", "approx_blocks": bad}]})
    with pytest.raises(ConfigError, match="zmq_endpoint"):  # events expected without it
        parse_config({"workers": [{"id": "q", "kind": "vllm"}]})
