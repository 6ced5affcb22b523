"""``add_sequence``'s path without batch machinery (``KVCacheManager._add_simple``) against the
general two-phase path: two managers take the same calls, one with the simple path switched
off, and must agree on every result, error, state, statistic and event, step by step."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.config import CacheConfig, SequenceRequest
from kvpool.errors import KVPoolError
from kvpool.eviction import POLICIES
from kvpool.hashing import HashAlgo
from kvpool.manager import KVCacheManager

PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 50, 51, 52, 53, 54],
    [7, 7, 7, 7, 7, 7, 7, 7],
]


@st.composite
def simple_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Configurations the simple path serves: full-attention groups on the GPU tier only."""
    groups = draw(st.sampled_from([1, 2, 2, 3]))  # several groups: per-group sums differ
    return {
        "tokens_per_block": draw(st.integers(1, 4)),
        "gpu_blocks": [draw(st.integers(2, 14)) for _ in range(groups)],
        "window_sizes": [None] * groups,
        "enable_block_reuse": draw(st.booleans()),
        "enable_partial_reuse": draw(st.booleans()),
        "max_beam_width": draw(st.integers(1, 2)),
        "eviction_policy": draw(st.sampled_from(sorted(POLICIES))),
        "hash_algo": draw(st.sampled_from(list(HashAlgo))),
        "event_buffer_max_size": draw(st.sampled_from([0, 1_000_000])),
    }


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    base = list(draw(st.sampled_from(PREFIXES)))
    base = base[: draw(st.integers(1, len(base)))]
    return base + draw(st.lists(st.integers(0, 3), max_size=6))


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except KVPoolError as e:
        return ("error", type(e).__name__, str(e))


class SimplePathMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fast: KVCacheManager | None = None
        self.slow: KVCacheManager | None = None
        self.live: list[int] = []
        self.next_id = 0

    @initialize(cfg=simple_configs())
    def setup(self, cfg: dict[str, Any]) -> None:
        self.fast = KVCacheManager(CacheConfig(**cfg))
        self.slow = KVCacheManager(CacheConfig(**cfg))
        assert self.fast._simple
        self.slow._simple = False

    def both(self, call: Any) -> Any:
        assert self.fast is not None and self.slow is not None
        a = _outcome(lambda: call(self.fast))
        b = _outcome(lambda: call(self.slow))
        assert a == b, (a, b)
        return a

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        assert self.fast is not None
        req = SequenceRequest(
            self.next_id, data.draw(prompts()),
            beam_width=data.draw(st.integers(1, self.fast.config.max_beam_width)),
            cache_salt=data.draw(st.sampled_from([None, "s"])),
            lora_id=data.draw(st.sampled_from([None, 1])),
        )
        self.next_id += 1
        if self.both(lambda m: m.add_sequence(req))[0] == "ok":
            self.live.append(req.seq_id)

    @rule(data=st.data())
    def admit_taken_id(self, data: st.DataObject) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(self.live))
            self.both(lambda m: m.add_sequence(SequenceRequest(sid, [1, 2, 3])))

    @rule(data=st.data(), k=st.integers(1, 5))
    def grow(self, data: st.DataObject, k: int) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(self.live))
            toks = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
            self.both(lambda m: m.add_tokens(sid, toks))

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(self.live))
            assert self.fast is not None
            n = data.draw(st.integers(0, self.fast.sequences[sid].num_tokens))
            self.both(lambda m: m.store_context_blocks(sid, n))

    @rule(data=st.data(), store=st.booleans())
    def remove(self, data: st.DataObject, store: bool) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(self.live))
            self.both(lambda m: m.remove_sequence(sid, store_for_reuse=store))
            self.live.remove(sid)

    @invariant()
    def same_state(self) -> None:
        if self.fast is None or self.slow is None:
            return
        assert self.fast._debug_state() == self.slow._debug_state()
        assert self.fast.stats() == self.slow.stats()
        self.fast.check_invariants()
        self.fast.flush_iteration_events()
        self.slow.flush_iteration_events()
        assert self.fast.get_latest_events(0) == self.slow.get_latest_events(0)


TestSimplePath = SimplePathMachine.TestCase
# cheap steps: more examples than the profile's default, so rare agreements get tested
TestSimplePath.settings = settings(TestSimplePath.settings,
                                   max_examples=max(200, TestSimplePath.settings.max_examples))
