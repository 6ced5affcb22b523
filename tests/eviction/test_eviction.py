"""Eviction policies (kvpool.eviction): hand-computed victim orders, prefix chains,
priority dominance and expiry, the bounded history, tiers sharing it, the offload gate,
hit rates on two traffic shapes (a hot set under a scan; blocks reused once, soon), scan
resistance through a real manager, and a stateful property test of every policy against a
model of what is queued at which priority."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.config import CacheConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import InvalidArgumentError
from kvpool.eviction import (
    ARC,
    POLICIES,
    S3FIFO,
    EvictionPolicy,
    KeyHistory,
    PrioritizedLRU,
    SegmentedPolicy,
    TwoQueue,
    make_policies,
    make_policy,
    queue,
)
from kvpool.eviction.segmented import frequent_run, recent_run

SEGMENTED = sorted(n for n, c in POLICIES.items() if issubclass(c, SegmentedPolicy))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    # bytes keys, rebuilt on every call: the policies must compare keys by value
    return b"k%06d" % i


def drain(p: EvictionPolicy) -> list[tuple[int, int]]:
    out = []
    while len(p):
        out.append(p.pop())
    return out


def release_again(p: EvictionPolicy, slot: int, times: int = 1) -> None:
    """A hit: the queued block at ``slot`` is claimed and released again, ``times`` times."""
    for _ in range(times):
        p.remove(slot)
        p.push(slot, 35, key=key(slot))


# ---------------------------------------------------------------------------- orders


@given(
    nr=st.integers(0, 5000),
    nf=st.integers(0, 5000),
    share=st.one_of(st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0]),
                    st.floats(0.0, 1.0, allow_nan=False)),
    left=st.integers(1, 6000),
)
def test_recent_run_is_the_victim_test_applied_one_by_one(
    nr: int, nf: int, share: float, left: int
) -> None:
    # the segmented policies' rule, one victim at a time: the recent segment gives it while
    # it holds more than ``share`` of the level, or the frequent segment is empty
    run = 0
    while run < min(left, nr) and (not nf or nr - run > share * (nr - run + nf)):
        run += 1
    assert recent_run(nr, nf, share, left) == run


@given(
    nr=st.integers(0, 5000),
    nf=st.integers(0, 5000),
    share=st.one_of(st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0]),
                    st.floats(0.0, 1.0, allow_nan=False)),
    left=st.integers(1, 6000),
)
def test_frequent_run_is_the_victim_test_applied_one_by_one(
    nr: int, nf: int, share: float, left: int
) -> None:
    # the frequent segment gives victims while the recent one does not: while the recent
    # segment is empty or holds no more than ``share`` of the level
    run = 0
    while run < min(left, nf) and not (nr and nr > share * (nr + nf - run)):
        run += 1
    assert frequent_run(nr, nf, share, left) == run


_COUNTS = st.sampled_from([1, 2, 3, 254, 255, 256]) | st.integers(1, 300)


@given(
    count_ghosts=st.booleans(),
    before=st.lists(st.tuples(st.integers(0, 30), _COUNTS), max_size=20),
    batch=st.lists(st.tuples(st.integers(0, 30), _COUNTS), min_size=1, max_size=20),
)
def test_history_add_ghosts_is_add_one_by_one(
    count_ghosts: bool, before: list[tuple[int, int]], batch: list[tuple[int, int]]
) -> None:
    # keys may repeat (an entry is then overwritten in place, as dict assignment does)
    one, bulk = (KeyHistory(100, 0.25, count_ghosts=count_ghosts) for _ in range(2))
    for h in (one, bulk):
        for k, c in before:
            h.add(k.to_bytes(2, "big"), c, ghost=c % 2 == 0)
    for k, c in batch:
        one.add(k.to_bytes(2, "big"), c, ghost=True)
    bulk.add_ghosts([k.to_bytes(2, "big") for k, _ in batch], [c for _, c in batch])
    assert list(bulk.entries.items()) == list(one.entries.items())
    assert (bulk.seq, bulk.ghosts) == (one.seq, one.ghosts)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.lists(st.integers(0, 11), unique=True, min_size=1, max_size=4),
              st.integers(0, 15), st.sampled_from([10, 35])),
    st.tuples(st.just("remove"), st.integers(0, 11), st.just(0), st.just(0)),
    st.tuples(st.just("pop"), st.just(0), st.just(0), st.just(0)),
), max_size=60)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(ops=_OPS)
def test_pop_is_pop_many_of_one(name: str, ops: list[tuple[str, object, int, int]]) -> None:
    # pop has its own single-victim path: same victims, same history, same later orders
    factory = POLICIES[name]
    one, many = (factory(Clock(), capacity=12) for _ in range(2))
    for op, arg, k, prio in ops:
        if op == "push":
            assert isinstance(arg, list)
            slots = [s for s in arg if s not in one]
            keys = [key(k + i) for i in range(len(slots))]
            one.push_many(slots, prio, keys)
            many.push_many(slots, prio, keys)
        elif op == "remove" and arg in one:
            assert isinstance(arg, int)
            one.remove(arg)
            many.remove(arg)
        elif op == "pop" and len(one):
            victim = one.pop()
            assert [victim] == many.pop_many(1)
            assert one.should_offload(victim[0]) == many.should_offload(victim[0])
        assert one.peek_order() == many.peek_order()
        if isinstance(one, SegmentedPolicy) and isinstance(many, SegmentedPolicy):
            h1, h2 = one.history, many.history
            assert list(h1.entries.items()) == list(h2.entries.items())
            assert (h1.seq, h1.ghosts, h1.share) == (h2.seq, h2.ghosts, h2.share)


def test_lru_order_and_priority() -> None:
    p = PrioritizedLRU(Clock())
    p.push_many([1, 2, 3], 35)
    p.push(4, 10)
    p.push(5, 80)
    p.remove(2)
    p.push(2, 35)
    assert p.peek_order() == [4, 1, 3, 2, 5]
    assert drain(p) == [(4, 10), (1, 35), (3, 35), (2, 35), (5, 80)]


def test_2q_recent_fifo_keeps_a_quarter() -> None:
    p = TwoQueue(Clock(), capacity=16)
    p.push_many([10, 11, 12, 13, 14, 15], 35, [key(s) for s in range(10, 16)])
    for s in range(10, 16):
        release_again(p, s)  # count 2: frequent, in this order
    p.push_many([1, 2], 35, [key(1), key(2)])  # count 1: recent
    assert p.is_frequent(10) and not p.is_frequent(1)
    # recent 2 of 8 is not more than 25% -> frequent head; then recent 2 of 7 > 1.75 -> 1;
    # recent 1 of 6, 5, 4 is within 25% -> 11, 12, 13; 1 of 3 is more -> 2; then 14, 15
    expected = [10, 1, 11, 12, 13, 2, 14, 15]
    assert p.peek_order() == expected
    assert [s for s, _ in drain(p)] == expected


def test_s3fifo_laps_outlast_lower_counts() -> None:
    p = S3FIFO(Clock(), capacity=8)
    for s in (22, 21, 20):
        p.push(s, 35, key=key(s))
    release_again(p, 22, 4)  # count 5: 3 laps
    release_again(p, 21, 2)  # count 3: 1 lap
    release_again(p, 20, 1)  # count 2: no lap
    assert [p.count_of(s) for s in (22, 21, 20)] == [5, 3, 2]
    # frequent FIFO 22, 21, 20: 22 laps (2 left), 21 laps (0 left), 20 goes;
    # 22 laps (1 left), 21 goes; 22 laps (0 left) and goes. LRU would give 22, 21, 20.
    assert p.peek_order() == [20, 21, 22]
    p.push(1, 35, key=key(1))  # recent 1 of 4 > 10%: the new block goes first
    assert [s for s, _ in drain(p)] == [1, 20, 21, 22]


def test_arc_target_moves_on_ghost_hits_no_older_than_the_pool() -> None:
    p = ARC(Clock(), capacity=10)
    assert p.target == 0.0  # as ARC: the recent segment gives every victim at first
    p.push(0, 35, key=key(0))
    assert p.pop() == (0, 35)
    p.push(0, 35, key=key(0))  # recomputed, 1 eviction ago: the recent segment was too small
    assert p.target == pytest.approx(0.1)  # + max(1, B2/B1) / 10 with no other ghosts
    assert p.is_frequent(0)
    assert p.pop() == (0, 35)  # evicted with count 2
    p.push(0, 35, key=key(0))
    assert p.target == pytest.approx(0.0)  # - max(1, B1/B2) / 10
    p.push(1, 35, key=key(1))
    assert p.pop() == (1, 35)
    for i in range(100, 111):  # 11 evictions: the ghost of key 1 is older than the pool
        p.push(2, 35, key=key(i))
        assert p.pop() == (2, 35)
    p.push(1, 35, key=key(1))
    assert p.count_of(1) == 2  # still remembered (the history holds 4 pools of ghosts) ...
    assert p.target == pytest.approx(0.0)  # ... but a pool twice the size would have missed too


def test_arc_split_follows_target() -> None:
    p = ARC(Clock(), capacity=2)
    p.push(0, 35, key=key(100))
    p.pop()
    p.push(0, 35, key=key(100))  # a recent ghost hit in a 2-slot pool: + 1/2
    assert p.target == pytest.approx(0.5)
    p.remove(0)
    p.push_many([1, 2, 3, 4], 35, [key(s) for s in (1, 2, 3, 4)])
    for s in (1, 2):
        release_again(p, s)
    p.push_many([5, 6], 35, [key(5), key(6)])
    # recent [3, 4, 5, 6], frequent [1, 2]: the recent segment gives while > half the level
    assert p.peek_order() == [3, 4, 1, 5, 2, 6]


# ---------------------------------------------------------------------------- prefix chains


@pytest.mark.parametrize("name", SEGMENTED)
def test_chain_released_tail_first_keeps_parents_at_least_as_frequent(name: str) -> None:
    p = make_policy(name, Clock(), capacity=16)
    assert isinstance(p, SegmentedPolicy)
    # a chain 0 <- 1 <- 2 <- 3 (0 is the root) whose tail block 3 was hit before
    p.push(3, 35, key=key(3))
    release_again(p, 3)
    p.remove(3)
    p.push_many([3, 2, 1, 0], 35, [key(s) for s in (3, 2, 1, 0)])
    assert [p.count_of(s) for s in (3, 2, 1, 0)] == [3, 3, 3, 3]
    # in one segment, the tail goes before the head
    assert p.peek_order() == [3, 2, 1, 0]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policy_evicts_the_tail_of_a_released_chain_first(name: str) -> None:
    p = make_policy(name, Clock(), capacity=16)
    p.push_many([7, 6, 5, 4], 35, [key(s) for s in (7, 6, 5, 4)])
    assert p.peek_order() == [7, 6, 5, 4]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_claim_of_a_release_takes_each_block_from_where_it_is_now(name: str) -> None:
    # block 1 of the release [1, 0] was hit and released again on its own (2Q and the like:
    # into the frequent segment); a root-first claim of the release then takes block 0 from
    # the release and block 1 from where it went
    p = make_policy(name, Clock(), capacity=8)
    p.push_many([1, 0], 80, [key(1), key(0)])
    release_again(p, 1)
    p.push(3, 10, key=key(3))
    p.remove_many([0, 1])
    p.push_many([2], 80, [key(2)])
    assert len(p) == 2 and p.peek_order() == [3, 2]
    assert drain(p) == [(3, 10), (2, 80)]


# ---------------------------------------------------------------------------- priority


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_priority_dominates_frequency(name: str) -> None:
    p = make_policy(name, Clock(), capacity=16)
    p.push_many([1, 2], 35, [key(1), key(2)])
    release_again(p, 1, 3)  # frequent at 35
    p.push(3, 80, key=key(3))  # new, but high priority
    p.push(4, 10, key=key(4))  # new, low priority
    p.push(5, 10, key=key(5))
    out = drain(p)
    assert [prio for _, prio in out] == [10, 10, 35, 35, 80]
    assert {s for s, _ in out[:2]} == {4, 5} and out[-1] == (3, 80)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_expired_priority_falls_back_to_default_at_the_recent_end(name: str) -> None:
    clock = Clock()
    p = make_policy(name, clock, capacity=16)
    p.push(1, 80, expires_at=10.0, key=key(1))
    p.push(2, 35, key=key(2))
    assert p.priority_of(1) == 80
    assert p.peek_order() == [2, 1]
    clock.now = 10.0
    assert p.priority_of(1) == 35
    p.push(3, 35, key=key(3))
    assert p.peek_order() == [2, 1, 3]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_expiry_survives_a_stale_entry_at_another_level(name: str) -> None:
    clock = Clock()
    p = make_policy(name, clock, capacity=16)
    p.push(1, 10, expires_at=3.0, key=key(1))
    assert p.pop() == (1, 10)
    p.push(1, 80, expires_at=3.0, key=key(1))  # same slot and expiry, another level
    clock.now = 3.0
    assert p.priority_of(1) == 35


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_stale_expiry_does_not_expire_a_later_push(name: str) -> None:
    clock = Clock()
    p = make_policy(name, clock, capacity=16)
    p.push(1, 80, expires_at=10.0, key=key(1))
    p.remove(1)
    p.push(1, 80, expires_at=20.0, key=key(1))
    clock.now = 15.0
    assert p.priority_of(1) == 80
    clock.now = 20.0
    assert p.priority_of(1) == 35


# ---------------------------------------------------------------------------- history


@pytest.mark.parametrize("name", SEGMENTED)
def test_ghost_recalls_evicted_key_until_forgotten(name: str) -> None:
    p = make_policy(name, Clock(), capacity=4)
    assert isinstance(p, SegmentedPolicy)
    bound = p.history.bound
    assert bound == 4 * 4  # DEFAULT_GHOST_MULTIPLE x pool size
    fresh = iter(range(100, 1000))

    def churn(n: int) -> None:  # n other keys evicted
        for _ in range(n):
            p.push(1, 35, key=key(next(fresh)))
            p.pop()
            assert len(p.history) <= bound

    churn(bound)  # a full history
    p.push(0, 35, key=key(0))
    p.pop()
    churn(bound // 2 - 1)  # the history keeps at least the last bound // 2 entries
    p.push(0, 35, key=key(0))  # recomputed while remembered: released twice
    assert p.count_of(0) == 2 and p.is_frequent(0)
    p.pop()
    churn(bound)  # the history forgets all but the newest half whenever it is full
    p.push(0, 35, key=key(0))
    assert p.count_of(0) == 1


def test_history_bound_is_a_multiple_of_the_pool() -> None:
    p = TwoQueue(Clock(), capacity=10, ghost_multiple=2.0)
    assert p.history.bound == 20
    q = TwoQueue(Clock(), ghost_multiple=2.0)  # unknown pool: learnt from the slots pushed
    q.push(29, 35, key=key(1))
    assert q.history.bound == 60


def test_tiers_share_counts() -> None:
    clock = Clock()
    cfg = CacheConfig(
        tokens_per_block=1, gpu_blocks=4, host_blocks=4, clock=clock,
        eviction=EvictionConfig(policy="2q", offload_gate="reused", history_multiple=2))
    (gpu,), (host,) = make_policies(
        cfg.eviction.policy, cfg.slots, clock, offload_gate=cfg.eviction.offload_gate,
        history_multiple=cfg.eviction.history_multiple)
    assert isinstance(gpu, SegmentedPolicy) and isinstance(host, SegmentedPolicy)
    assert gpu.history is host.history
    assert gpu.history.bound == 2 * (4 + 4)
    gpu.push(0, 35, key=key(7))
    gpu.push(1, 35, key=key(8))
    assert gpu.pop() == (0, 35)
    assert not gpu.should_offload(0)  # released once: the reused gate drops it
    for _ in range(2):  # two hits: the third release makes count 3
        gpu.remove(1)
        gpu.push(1, 35, key=key(8))
    assert gpu.pop() == (1, 35)
    assert gpu.should_offload(1)
    host.push(2, 35, key=key(8))  # offloaded: arrives with its count, not a new use
    assert host.count_of(2) == 3 and host.is_frequent(2)
    host.remove(2)  # claimed for onboarding
    gpu.push(3, 35, key=key(8))  # released on the GPU after the host hit
    assert gpu.count_of(3) == 4


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_offload_gate_all_offloads_every_victim(name: str) -> None:
    p = make_policy(name, Clock(), capacity=4, offload_gate="all")
    p.push(0, 35, key=key(0))
    s, _ = p.pop()
    assert p.should_offload(s)


# ---------------------------------------------------------------------------- errors


def test_bad_arguments_raise_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="'mru'"):
        make_policy("mru", Clock())
    with pytest.raises(InvalidArgumentError, match="'some'"):
        make_policy("2q", Clock(), offload_gate="some")
    with pytest.raises(InvalidArgumentError, match="ghost_multiple"):
        TwoQueue(Clock(), ghost_multiple=-1)
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.eviction\.policy must be one of"):
        CacheConfig(tokens_per_block=4, gpu_blocks=8, eviction=EvictionConfig(policy="mru"))
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.eviction\.offload_gate"):
        CacheConfig(tokens_per_block=4, gpu_blocks=8,
                    eviction=EvictionConfig(offload_gate="never"))
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.eviction\.history_multiple"):
        CacheConfig(tokens_per_block=4, gpu_blocks=8, eviction=EvictionConfig(history_multiple=-1))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pushing_a_queued_slot_changes_nothing(name: str) -> None:
    p = make_policy(name, Clock(), capacity=8)
    p.push_many([1, 2, 3], 35, [key(1), key(2), key(3)])
    before = p.peek_order()
    with pytest.raises(InvalidArgumentError, match="2"):
        p.push(2, 35, key=key(2))
    if name != "lru":  # LRU's bulk push trusts the manager (it never repeats a slot)
        with pytest.raises(InvalidArgumentError, match="already evictable"):
            p.push_many([4, 3], 35, [key(4), key(3)])
    assert p.peek_order() == before and 4 not in p


# ---------------------------------------------------------------------------- traffic shapes


def _hit_rate(name: str, trace: list[bytes], slots: int) -> float:
    """A cache of ``slots`` blocks driven straight through the policy: a hit is claimed and
    released again, a miss takes a free slot or the victim's."""
    p = make_policy(name, Clock(), capacity=slots)
    where: dict[bytes, int] = {}
    held: dict[int, bytes] = {}
    free = list(range(slots))
    hits = 0
    for k in trace:
        s = where.get(k)
        if s is not None:
            hits += 1
            p.remove(s)
        else:
            if free:
                s = free.pop()
            else:
                s, _ = p.pop()
                del where[held[s]]
            where[k] = s
            held[s] = k
        p.push(s, 35, key=k)
    return hits / len(trace)


def _reuse_once(n: int, lo: int, hi: int, seed: int) -> list[bytes]:
    """Every key used twice, the second use ``lo``..``hi`` accesses after the first."""
    rng = random.Random(seed)
    trace: list[bytes] = []
    due: dict[int, bytes] = {}
    for t in range(n):
        if t in due:
            trace.append(due.pop(t))
            continue
        k = b"r%d" % t
        trace.append(k)
        due.setdefault(t + rng.randrange(lo, hi), k)
    return trace


def _hot_set_and_scan(n: int, hot: int, seed: int) -> list[bytes]:
    """Half the accesses go to ``hot`` keys, half to keys never seen again."""
    rng = random.Random(seed)
    return [b"h%d" % rng.randrange(hot) if rng.random() < 0.5 else b"s%d" % t
            for t in range(n)]


def test_scan_resistant_policies_beat_lru_on_a_hot_set_under_a_scan() -> None:
    trace = _hot_set_and_scan(6000, 30, seed=1)
    lru = _hit_rate("lru", trace, 100)
    for name in SEGMENTED:
        # the 30 hot keys stay; LRU lets the scan flush them
        assert _hit_rate(name, trace, 100) > lru + 0.03, name


def test_arc_follows_recency_where_static_splits_fail() -> None:
    trace = _reuse_once(6000, 30, 80, seed=2)  # reuse within 30..80% of a 100-block cache
    lru = _hit_rate("lru", trace, 100)
    assert lru > 0.4  # every second use hits under LRU, but for slot races
    assert _hit_rate("arc", trace, 100) > 0.9 * lru  # the recent share grows to fit
    assert _hit_rate("s3fifo", trace, 100) < 0.5 * lru  # 10% for new blocks is too little


# ---------------------------------------------------------------------------- through a manager


def _scan_then_reuse(policy: str) -> int:
    """A prompt reused twice, then a scan of one-off prompts larger than the pool, then the
    prompt again: the blocks it reuses."""
    m = KVCacheManager(CacheConfig(tokens_per_block=1, gpu_blocks=24,
                                   eviction=EvictionConfig(policy=policy)))
    hot = list(range(1000, 1009))  # 8 reusable blocks (the last prompt token is not)
    sid = 0

    def run(tokens: list[int]) -> int:
        nonlocal sid
        sid += 1
        r = m.add_sequence(SequenceRequest(sid, tokens))
        m.store_context_blocks(sid, len(tokens))
        m.remove_sequence(sid)
        return r.reused_tokens

    run(hot)
    assert run(hot) == 8
    for i in range(6):  # 6 x 8 = 48 one-off blocks through a 24-block pool
        run([2000 + 10 * i + j for j in range(9)])
    return run(hot)


def test_scan_resistance_through_the_manager() -> None:
    assert _scan_then_reuse("lru") == 0
    for name in SEGMENTED:
        assert _scan_then_reuse(name) == 8, name


# ---------------------------------------------------------------------------- stateful


class PolicyMachine(RuleBasedStateMachine):
    """Random pushes, claims, pops and clock steps against a model of the queued slots."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.p: EvictionPolicy | None = None
        self.gate = "all"
        self.model: dict[int, tuple[int, float | None]] = {}  # slot -> (priority, expiry)

    @initialize(name=st.sampled_from(sorted(POLICIES)), gate=st.sampled_from(["all", "reused"]))
    def start(self, name: str, gate: str) -> None:
        self.gate = gate
        factory = POLICIES[name]
        if issubclass(factory, SegmentedPolicy):  # a history of 6 keys: forgetting happens
            self.p = factory(self.clock, capacity=12, offload_gate=gate, ghost_multiple=0.5)
        else:
            self.p = factory(self.clock, capacity=12, offload_gate=gate)

    @property
    def pol(self) -> EvictionPolicy:
        assert self.p is not None
        return self.p

    def _prio(self, slot: int) -> int:
        prio, at = self.model[slot]
        return 35 if at is not None and self.clock.now >= at else prio

    @rule(slot=st.integers(0, 11), k=st.integers(0, 20), prio=st.sampled_from([10, 35, 80]),
          duration=st.one_of(st.none(), st.sampled_from([1.0, 3.0])))
    def push(self, slot: int, k: int, prio: int, duration: float | None) -> None:
        at = None if duration is None else self.clock.now + duration
        if slot in self.model:
            before = self.pol.peek_order()
            with pytest.raises(InvalidArgumentError):
                self.pol.push(slot, prio, at, key(k))
            assert self.pol.peek_order() == before
            return
        self.pol.push(slot, prio, at, key(k))
        self.model[slot] = (prio, at if prio != 35 else None)

    @rule(data=st.data(), prio=st.sampled_from([10, 35, 80]))
    def push_many(self, data: st.DataObject, prio: int) -> None:
        free = [s for s in range(12) if s not in self.model]
        slots = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=4)) if free else []
        keys = [key(data.draw(st.integers(0, 20))) for _ in slots]
        self.pol.push_many(slots, prio, keys)
        for s in slots:
            self.model[s] = (prio, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.model)))
        self.pol.remove(slot)
        del self.model[slot]

    @precondition(lambda self: bool(self.model))
    @rule()
    def pop(self) -> None:
        order = self.pol.peek_order()
        lowest = min(self._prio(s) for s in self.model)
        slot, prio = self.pol.pop()
        assert slot == order[0], "pop disagrees with peek_order"
        assert prio == self._prio(slot) == lowest, "a victim above the lowest priority"
        del self.model[slot]
        if self.gate == "all":
            assert self.pol.should_offload(slot)

    @rule(n=st.integers(0, 5))
    def pop_many(self, n: int) -> None:
        order = self.pol.peek_order()
        if n > len(order):
            with pytest.raises(IndexError):
                self.pol.pop_many(n)
            assert self.pol.peek_order() == order, "a failed pop_many changed the queue"
            return
        expected = [(s, self._prio(s)) for s in order[:n]]
        assert self.pol.pop_many(n) == expected, "pop_many is not n pops in victim order"
        for s, _ in expected:
            del self.model[s]

    @rule(n=st.integers(0, 5))
    def pop_slots(self, n: int) -> None:
        order = self.pol.peek_order()
        if n > len(order):
            with pytest.raises(IndexError):
                self.pol.pop_slots(n)
            assert self.pol.peek_order() == order, "a failed pop_slots changed the queue"
            return
        assert self.pol.pop_slots(n) == order[:n], "pop_slots is not pop_many's slots"
        for s in order[:n]:
            del self.model[s]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove_many(self, data: st.DataObject) -> None:
        slots = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=4))
        self.pol.remove_many(slots)
        for s in slots:
            del self.model[s]

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def agrees_with_model(self) -> None:
        p = self.pol
        assert len(p) == len(self.model)
        order = p.peek_order()
        assert sorted(order) == sorted(self.model)
        for s in range(12):
            assert (s in p) == (s in self.model)
        prios = [p.priority_of(s) for s in order]
        assert prios == sorted(prios), "victim order is not by priority first"
        for s in self.model:
            assert p.priority_of(s) == self._prio(s)
        if isinstance(p, SegmentedPolicy):
            assert len(p.history) <= p.history.bound
            assert 0.0 <= p.history.share <= 1.0


TestPolicyMachine = PolicyMachine.TestCase


# ---------------------------------------------------------------------------- differential


@dataclass
class Queued:
    """A queued block of :class:`RefPolicy`: blocks of count > 1 are in the frequent segment."""

    prio: int
    at: float | None  # when the priority falls back to 35
    count: int
    laps: int  # S3-FIFO's laps left
    place: int  # a later place is more recent


class RefPolicy:
    """A plain reference for every policy, written from the contracts rather than for speed.

    Each queued block is one record; the victim is found by sorting the records of the lowest
    level. The history is a dict in insertion order, trimmed to its newest half when it
    outgrows its bound.
    """

    def __init__(self, name: str, clock: Clock, *, capacity: int | None, gate: str, tier: int,
                 multiple: float) -> None:
        self.name = name
        self.clock = clock
        self.lru = name == "lru"
        self.share = {"lru": 0.0, "2q": 0.25, "s3fifo": 0.10, "arc": 0.0}[name]
        self.laps = 3 if name == "s3fifo" else 0
        self.arc = name == "arc"
        self.gate_all = gate == "all" or self.lru
        self.tier0 = tier == 0
        self.multiple = multiple
        self.capacity = capacity or 0
        self.bound = int(multiple * self.capacity)
        self.queued: dict[int, Queued] = {}
        self.place = 0  # records sort by place within a segment: a later place is more recent
        self.claimed: dict[int, tuple[object, int]] = {}  # slot -> (key, count) at its remove
        self.keys: dict[int, object] = {}  # queued slot -> key pushed (None: none)
        self.history: dict[object, int] = {}
        self.seq = 0
        self.ghosts = [0, 0]
        self.last = (-1, 0)

    # --------------------------------------------------------------- history

    def remember(self, key: object, count: int, ghost: bool) -> None:
        v = min(count, 255)
        if self.arc:
            self.seq += 1
            v |= self.seq << 8
        self.history[key] = v if ghost else -v
        if ghost and self.arc:
            self.ghosts[count > 1] += 1
        if len(self.history) > self.bound:
            items = list(self.history.items())
            keep = len(items) - self.bound // 2
            for _, old in items[:keep]:
                if self.arc and old > 0:
                    self.ghosts[(old & 255) > 1] -= 1
            self.history = dict(items[keep:])

    # --------------------------------------------------------------- queue

    def _record(self, slot: int, prio: int, at: float | None, count: int) -> None:
        self.place += 1
        laps = min(count - 2, self.laps) if count > 1 else 0
        self.queued[slot] = Queued(prio, at if prio != 35 else None, count, laps, self.place)

    def _grow(self, slot: int) -> None:
        if slot >= self.capacity:
            self.capacity = slot + 1
            self.bound = max(self.bound, int(self.multiple * self.capacity))

    def _count(self, slot: int, key: object) -> int:
        """A released block's count before the chain floor."""
        bump = 1 if self.tier0 else 0
        old = self.claimed.get(slot)
        if old is not None and old[0] is not None and old[0] == key:
            if not self.tier0:
                self.history.pop(key, None)
            return old[1] + bump
        v = self.history.pop(key, 0)
        if v == 0:
            return 1
        if v > 0 and self.arc:
            count, age = v & 255, self.seq - (v >> 8)
            self.ghosts[count > 1] -= 1
            if self.tier0 and self.capacity and age <= self.capacity:
                b1, b2 = max(self.ghosts[0], 1), max(self.ghosts[1], 1)
                if count == 1:
                    self.share = min(1.0, self.share + max(1.0, b2 / b1) / self.capacity)
                else:
                    self.share = max(0.0, self.share - max(1.0, b1 / b2) / self.capacity)
        return (abs(v) & 255) + bump

    def push_many(self, slots: list[int], prio: int, keys: list[object] | None,
                  at: float | None = None) -> None:
        if not self.lru and any(s in self.queued for s in slots):
            raise InvalidArgumentError("already evictable")
        for s in slots:
            self._grow(s)
        floor = 1
        for i, s in enumerate(slots):
            key = None if keys is None else keys[i]
            count = 1 if self.lru or key is None else self._count(s, key)
            floor = count = max(count, floor)
            self.claimed.pop(s, None)
            self.keys[s] = key
            self._record(s, prio, at, count)

    def push(self, slot: int, prio: int, at: float | None, key: object) -> None:
        if slot in self.queued:
            raise InvalidArgumentError("already evictable")
        self.push_many([slot], prio, None if key is None else [key], at)

    def remove(self, slot: int) -> None:
        count = self.queued.pop(slot).count  # KeyError if not queued
        key = self.keys.pop(slot)
        self.claimed[slot] = (key, count)
        if not self.lru and not self.tier0 and key is not None:
            self.remember(key, count, ghost=False)

    def expire(self) -> None:
        now = self.clock.now
        due = sorted((r.at, s) for s, r in self.queued.items() if r.at is not None and r.at <= now)
        for _, s in due:
            self.place += 1
            self.queued[s].prio, self.queued[s].at, self.queued[s].place = 35, None, self.place

    def _victim(self) -> int:
        lowest = min(r.prio for r in self.queued.values())
        level = sorted((r.place, s) for s, r in self.queued.items() if r.prio == lowest)
        if self.lru:
            return level[0][1]
        recent = [s for _, s in level if self.queued[s].count == 1]
        frequent = [s for _, s in level if self.queued[s].count > 1]
        nr, nf = len(recent), len(frequent)
        if nr and (not nf or nr > self.share * (nr + nf)):
            return recent[0]
        while True:  # S3-FIFO: a block with laps left goes round again
            slot = frequent.pop(0)
            head = self.queued[slot]
            if not head.laps:
                return slot
            self.place += 1
            head.laps, head.place = head.laps - 1, self.place
            frequent.append(slot)

    def pop(self) -> tuple[int, int]:
        if not self.queued:
            raise IndexError
        self.expire()
        slot = self._victim()
        rec = self.queued.pop(slot)
        key = self.keys.pop(slot)
        if not self.lru and key is not None:
            self.remember(key, rec.count, ghost=True)
        self.claimed.pop(slot, None)
        self.last = (slot, rec.count)
        return slot, rec.prio

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        if self.lru:
            self.expire()  # LRU expires before it checks the size, the others after
        if n > len(self.queued):
            raise IndexError
        return [self.pop() for _ in range(n)]

    def pop_slots(self, n: int) -> list[int]:
        return [s for s, _ in self.pop_many(n)]

    def peek_order(self) -> list[int]:
        self.expire()
        saved = {s: replace(r) for s, r in self.queued.items()}, self.place
        out = []
        while self.queued:  # pop with the queue's state put back after (laps move blocks)
            slot = self._victim()
            del self.queued[slot]
            out.append(slot)
        self.queued, self.place = saved
        return out

    def priority_of(self, slot: int) -> int:
        self.expire()
        return self.queued[slot].prio

    def should_offload(self, slot: int) -> bool:
        return self.gate_all or (slot == self.last[0] and self.last[1] > 1)


SLOTS = 14  # slots 0..13; a pool of 10 when the capacity is given, so some pushes grow it


class DifferentialMachine(RuleBasedStateMachine):
    """Every operation, interleaved at random, on a policy and on :class:`RefPolicy`."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.p: EvictionPolicy | None = None
        self.ref: RefPolicy | None = None
        self.released: list[int] = []  # the slots of the last push_many, as listed

    @initialize(name=st.sampled_from(sorted(POLICIES)), gate=st.sampled_from(["all", "reused"]),
                capacity=st.sampled_from([None, 10]), tier=st.sampled_from([0, 0, 1]),
                multiple=st.sampled_from([0.5, 1.0, 4.0]), slack=st.sampled_from([0, 3, None]))
    def start(self, name: str, gate: str, capacity: int | None, tier: int, multiple: float,
              slack: int | None) -> None:
        if slack is not None:  # compact the lazy queues often
            self._slack = queue.SLACK
            queue.SLACK = slack
        factory = POLICIES[name]
        if issubclass(factory, SegmentedPolicy):
            self.p = factory(self.clock, capacity=capacity, offload_gate=gate, tier=tier,
                             ghost_multiple=multiple)
        else:
            self.p = factory(self.clock, capacity=capacity, offload_gate=gate)
        self.ref = RefPolicy(name, self.clock, capacity=capacity, gate=gate,
                             tier=tier if name != "lru" else 0, multiple=multiple)

    def teardown(self) -> None:
        if hasattr(self, "_slack"):
            queue.SLACK = self._slack

    @property
    def pol(self) -> EvictionPolicy:
        assert self.p is not None
        return self.p

    @property
    def model(self) -> RefPolicy:
        assert self.ref is not None
        return self.ref

    def _both(self, op: str, *args: object) -> object:
        """Call ``op`` on both; they must return the same or raise the same error type."""
        try:
            expected = getattr(self.model, op)(*args)
        except (InvalidArgumentError, KeyError, IndexError) as e:
            with pytest.raises(type(e)):
                getattr(self.pol, op)(*args)
            return None
        assert getattr(self.pol, op)(*args) == expected, op
        return expected

    @rule(data=st.data(), k=st.none() | st.integers(-1, 12), prio=st.sampled_from([10, 35, 80]),
          duration=st.none() | st.sampled_from([1.0, 2.0]))
    def push(self, data: st.DataObject, k: int | None, prio: int, duration: float | None) -> None:
        """``k`` -1: a claimed block released again with its key (a hit), if there is one."""
        at = None if duration is None else self.clock.now + duration
        claimed = sorted(self.model.claimed)
        if k == -1 and claimed:
            slot = data.draw(st.sampled_from(claimed))
            block = self.model.claimed[slot][0]
        else:
            slot = data.draw(st.integers(0, SLOTS - 1))
            block = None if k is None or k < 0 else key(k)
        self._both("push", slot, prio, at, block)

    @rule(data=st.data(), prio=st.sampled_from([10, 35, 80]), keyed=st.booleans())
    def push_many(self, data: st.DataObject, prio: int, keyed: bool) -> None:
        pool = range(SLOTS) if not self.model.lru else [
            s for s in range(SLOTS) if s not in self.model.queued]  # LRU trusts the manager
        slots = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=6)) if pool else []
        ks = [key(data.draw(st.integers(0, 12))) for _ in slots] if keyed else None
        self._both("push_many", slots, prio, ks)
        self.released = slots

    @rule(data=st.data(), prio=st.sampled_from([10, 35, 80]), suffix=st.booleans())
    def release_claimed(self, data: st.DataObject, prio: int, suffix: bool) -> None:
        """A block table released after a hit: new blocks, then (``suffix``) or among them
        claimed blocks coming back with their keys."""
        m = self.model
        claimed = [s for s in sorted(m.claimed) if s not in m.queued]
        back = data.draw(st.lists(st.sampled_from(claimed), unique=True, min_size=1,
                                  max_size=5)) if claimed else []
        free = [s for s in range(SLOTS) if s not in m.queued and s not in back]
        new = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=3)) if free else []
        slots = new + back if suffix else data.draw(st.permutations(new + back))
        ks = [m.claimed[s][0] if s in back else key(data.draw(st.integers(0, 12)))
              for s in slots]
        if None not in ks:
            self._both("push_many", slots, prio, ks)
            self.released = slots

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.model.queued) or [0]) | st.integers(0, 13))
        self._both("remove", slot)

    @rule(data=st.data())
    def remove_many(self, data: st.DataObject) -> None:
        queued = sorted(self.model.queued)
        slots = (data.draw(st.lists(st.sampled_from(queued), unique=True, max_size=5))
                 if queued else [])
        for s in slots:
            self.model.remove(s)
        self.pol.remove_many(slots)

    @rule(n=st.integers(1, 6))
    def claim_released(self, n: int) -> None:
        """A hit on the last released block table: its queued blocks claimed root first
        (the manager's ``remove_many`` after a release, tail first, of the same sequence)."""
        slots = [s for s in reversed(self.released) if s in self.model.queued][:n]
        for s in slots:
            self.model.remove(s)
        self.pol.remove_many(slots)

    @rule()
    def pop(self) -> None:
        self._both("pop")

    @rule(n=st.integers(0, 6))
    def pop_many(self, n: int) -> None:
        self._both("pop_many", n)

    @rule(n=st.integers(0, 6))
    def pop_slots(self, n: int) -> None:
        self._both("pop_slots", n)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def agrees(self) -> None:
        p, m = self.pol, self.model
        assert len(p) == len(m.queued)
        assert p.peek_order() == m.peek_order()
        for s in range(-1, SLOTS + 2):
            assert (s in p) == (s in m.queued)
            assert p.should_offload(s) == m.should_offload(s)
            if s in m.queued:
                assert p.priority_of(s) == m.priority_of(s)
            elif s >= 0:
                with pytest.raises(KeyError):
                    p.priority_of(s)
        if isinstance(p, SegmentedPolicy):
            for s, r in m.queued.items():
                assert (p.count_of(s), p.is_frequent(s)) == (r.count, r.count > 1)
            h = p.history
            assert list(h.entries.items()) == list(m.history.items())
            assert (h.seq, h.ghosts, h.share, h.bound) == (m.seq, m.ghosts, m.share, m.bound)


TestDifferential = DifferentialMachine.TestCase
TestDifferential.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
