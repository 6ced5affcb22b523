"""Stateful property tests of the block manager (ARCHITECTURE §7, invariants 1-7).

Random configurations (1-3 layer groups, windows, sinks, beams, reuse on/off, tiny pools,
optional host/disk tiers, events on/off) and random interleavings of every public call. After
every step the manager's internal invariants hold; every admission realises exactly its plan;
every failed call leaves the state unchanged and emits no event; the events flushed so far,
applied to an independent index, reproduce exactly the manager's cached (hash, group, tier)
set; removing everything and clearing the cache frees every slot.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.config import CacheConfig, EventsConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import KVPoolError, OutOfBlocksError
from kvpool.events.index import EventIndex
from kvpool.eviction import POLICIES
from kvpool.hashing.keys import HashAlgo

PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 50, 51, 52, 53, 54],
    [7, 7, 7, 7, 7, 7, 7, 7],
]


SCOPES = [(None, None), (None, None), (None, "s"), (1, None)]
"""The (LoRA id, cache salt) scopes requests use (``scopes_are_isolated`` relies on it)."""


@st.composite
def configs(draw: st.DrawFn, tiers: bool) -> CacheConfig:
    groups = draw(st.integers(1, 3))
    windows = [draw(st.one_of(st.none(), st.integers(1, 12))) for _ in range(groups)]
    if all(w is not None for w in windows) and draw(st.booleans()):
        windows[0] = None
    sinks = [draw(st.integers(0, 4)) if w is not None else 0 for w in windows]
    host = draw(st.integers(0, 6)) if tiers else 0
    disk = draw(st.integers(0, 6)) if tiers and host else 0
    return CacheConfig(
        tokens_per_block=draw(st.integers(1, 4)),
        gpu_blocks=[draw(st.integers(2, 14)) for _ in range(groups)],
        window_sizes=windows,
        sink_tokens=sinks,
        enable_block_reuse=draw(st.booleans()),
        enable_partial_reuse=draw(st.booleans()),
        max_beam_width=draw(st.integers(1, 3)),
        host_blocks=host,
        disk_blocks=disk,
        eviction=EvictionConfig(
            offload_min_priority=draw(st.sampled_from([0, 35, 50])),
            policy=draw(st.sampled_from(sorted(POLICIES))),
            offload_gate=draw(st.sampled_from(["all", "reused"])),
        ),
        hash_algo=draw(st.sampled_from(list(HashAlgo))),
    )


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    base = list(draw(st.sampled_from(PREFIXES)))
    base = base[: draw(st.integers(1, len(base)))]
    tail = draw(st.lists(st.integers(0, 3), max_size=6))
    return base + tail


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager through random calls, checking the invariants after each."""

    tiers = False

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.next_id = 0
        self.live: dict[int, int] = {}  # seq id -> beam width (not suspended)
        self.suspended: set[int] = set()
        self.index = EventIndex(strict=True)

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        cfg = data.draw(configs(self.tiers))
        kw = _kwargs(cfg)
        if not data.draw(st.booleans()):
            kw["enable_block_reuse"] = False
        if data.draw(st.booleans()):
            kw["events"] = EventsConfig(buffer_max_size=1_000_000)
        self.m = KVCacheManager(CacheConfig(**kw))

    @property
    def mgr(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    def _event_mark(self) -> tuple[int, int]:
        ev = self.mgr.events
        if ev is None:
            return (0, 0)
        return (ev.num_pending, ev.next_event_id)  # type: ignore[attr-defined]

    def _unchanged_on_failure(self, call: Any) -> bool:
        before = self.mgr.debug_state()
        stats_before = self.mgr.stats()
        events_before = self._event_mark()
        try:
            call()
        except KVPoolError:
            assert self.mgr.debug_state() == before, "a failed call changed the manager"
            assert self.mgr.stats() == stats_before
            assert self._event_mark() == events_before, "a failed call emitted events"
            return False
        return True

    @rule(data=st.data(), n=st.integers(1, 3))
    def admit_batch(self, data: st.DataObject, n: int) -> None:
        reqs = []
        for _ in range(n):
            beams = data.draw(st.integers(1, self.mgr.config.max_beam_width))
            lora, salt = data.draw(st.sampled_from(SCOPES))
            reqs.append(SequenceRequest(self.next_id, data.draw(prompts()), beam_width=beams,
                                        cache_salt=salt, lora_id=lora))
            self.next_id += 1
        plan = self.mgr.plan_batch(reqs)
        state = self.mgr.debug_state()
        assert self.mgr.debug_state() == state  # planning is pure
        events_before = self._event_mark()
        try:
            results = self.mgr.add_sequence_batch(reqs)
        except OutOfBlocksError as e:
            assert not plan.fits
            assert e.deficit == plan.deficit
            assert self.mgr.debug_state() == state
            assert self._event_mark() == events_before
            return
        assert plan.fits
        for p, r in zip(plan.requests, results, strict=True):
            assert r.reused_tokens == p.reused_tokens
            assert r.new_blocks == p.new_blocks, (r.new_blocks, p.new_blocks)
            assert r.reused_tokens <= len(p.request.tokens) - 1
        for q in reqs:
            assert isinstance(q.seq_id, int)
            self.live[q.seq_id] = q.beam_width

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data: st.DataObject, k: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        need = self.mgr.needed_blocks_one_step(sid, k)
        toks = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
        before = {g: self.mgr.num_free_blocks(g) for g in need}
        ok = self._unchanged_on_failure(lambda: self.mgr.add_tokens(sid, toks))
        if ok:
            assert len(self.mgr.block_ids(sid, 0)) == -(-len(self.mgr.sequences[sid].tokens)
                                                       // self.mgr.tpb)
        elif all(need[g] <= before[g] for g in need):
            raise AssertionError("add_tokens failed although the pool had the blocks")

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), k=st.integers(0, 3))
    def rewind(self, data: st.DataObject, k: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self._unchanged_on_failure(lambda: self.mgr.rewind_tokens(sid, k))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        before = {g: self.mgr.num_free_blocks(g) for g in range(self.mgr.config.num_groups)}
        freed = self.mgr.suspend(sid)
        for g, n in freed.items():
            assert self.mgr.num_free_blocks(g) >= before[g] + n
        self.suspended.add(sid)
        del self.live[sid]

    @precondition(lambda self: bool(self.suspended))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.suspended)))
        if self._unchanged_on_failure(lambda: self.mgr.resume(sid)):
            self.suspended.discard(sid)
            self.live[sid] = self.mgr.sequences[sid].beam_width

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        n = data.draw(st.integers(0, len(self.mgr.sequences[sid].tokens)))
        self.mgr.store_context_blocks(sid, n)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), store=st.booleans())
    def remove(self, data: st.DataObject, store: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.mgr.remove_sequence(sid, store_for_reuse=store)
        del self.live[sid]

    @rule(data=st.data())
    def count_matches_plan(self, data: st.DataObject) -> None:
        toks = data.draw(prompts())
        n = self.mgr.count_reusable_tokens(toks)
        plan = self.mgr.plan_batch([SequenceRequest(-1, toks)])
        assert n == plan.requests[0].reused_tokens

    @rule(data=st.data())
    def scopes_are_isolated(self, data: st.DataObject) -> None:
        # requests only ever use the scopes (None, None), (None, "s") and (1, None): a scope
        # no request used must match nothing, whatever the hash algorithm
        toks = data.draw(prompts())
        assert self.mgr.count_reusable_tokens(toks, cache_salt="never") == 0
        assert self.mgr.count_reusable_tokens(toks, lora_id=7) == 0
        assert self.mgr.count_reusable_tokens(toks, lora_id=1, cache_salt="s") == 0

    @invariant()
    def internal_invariants(self) -> None:
        if self.m is not None:
            self.m.check_invariants()

    @invariant()
    def events_reproduce_the_cache(self) -> None:
        if self.m is None or self.m.events is None:
            return
        self.m.flush_iteration_events()
        self.index.apply_all(self.m.get_latest_events(0))
        assert set(self.index.cached) == self.m.cached_blocks()

    def teardown(self) -> None:
        if self.m is None:
            return
        for sid in list(self.live):
            self.m.remove_sequence(sid)
        for sid in sorted(self.suspended):
            if self._unchanged_on_failure(lambda: self.mgr.resume(sid)):  # noqa: B023
                self.m.check_invariants()
            self.m.remove_sequence(sid)
        self.m.clear_cache()
        self.m.check_invariants()
        self.events_reproduce_the_cache()
        for t, per_group in enumerate(self.m.config.slots):
            for g, n in enumerate(per_group):
                usage = self.m.slot_usage(t, g)
                assert usage["free"] == n, f"tier {t} group {g} leaked: {usage}"


def _kwargs(cfg: CacheConfig) -> dict[str, Any]:
    names = ("tokens_per_block", "gpu_blocks", "window_sizes", "sink_tokens",
             "enable_block_reuse", "enable_partial_reuse", "max_beam_width", "host_blocks",
             "disk_blocks", "eviction")
    return {n: getattr(cfg, n) for n in names}


class TieredManagerMachine(ManagerMachine):
    tiers = True


TestManager = ManagerMachine.TestCase
TestTieredManager = TieredManagerMachine.TestCase
