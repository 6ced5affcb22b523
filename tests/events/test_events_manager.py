"""EventManager batching rules, registry, buffer, attention DP, reads; EventIndex completeness."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.errors import EventStreamError, InvalidArgumentError, UnknownHashAlgorithmError
from kvpool.events import (
    AllCleared,
    AttentionDpGather,
    Created,
    EventDiff,
    EventIndex,
    EventManager,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)


def blk(h: int, tier: int = 0, priority: int = 35) -> StoredBlock:
    return StoredBlock(block_hash=h, tokens=(h, h + 1), cache_level=tier, priority=priority)


def chain(*hashes: int, tier: int = 0) -> list[StoredBlock]:
    return [blk(h, tier) for h in hashes]


def flushed(em: EventManager) -> list[KVCacheEvent]:
    em.flush_iteration_events()
    return em.get_latest_events(0)


def kinds(events: Sequence[KVCacheEvent]) -> list[tuple[str, int]]:
    return [(type(e.data).__name__, e.layer_group_id) for e in events]


def stored_hashes(event: KVCacheEvent) -> list[int | str]:
    assert isinstance(event.data, Stored)
    return [b.block_hash for b in event.data.blocks]


@pytest.fixture
def em() -> EventManager:
    return EventManager(1000, hash_algo="v1_block_key")


# ------------------------------------------------------------------------------ removal batching


def test_removals_of_a_group_leave_as_one_event_at_flush(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2, 3, 4))
    flushed(em)
    em.on_removed(0, 64, [4])
    em.on_removed(0, 64, [3, 2])
    events = flushed(em)
    assert len(events) == 1
    assert events[0].data == Removed((4, 3, 2), (0, 0, 0))
    assert events[0].window_size == 64


def test_removals_flush_before_the_same_groups_next_stored_event(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    flushed(em)
    em.on_removed(0, 64, [2])
    em.on_removed(0, 64, [1])
    em.on_stored(0, 64, None, chain(7))
    events = flushed(em)
    assert kinds(events) == [("Removed", 0), ("Stored", 0)]
    assert events[0].data == Removed((2, 1), (0, 0))
    assert stored_hashes(events[1]) == [7]


def test_another_groups_stored_event_does_not_flush_removals(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    flushed(em)
    em.on_removed(0, 64, [1])
    em.on_stored(1, 32, None, chain(9))  # group 1: group 0's batch stays open
    em.on_removed(0, 64, [2])
    events = flushed(em)
    assert kinds(events) == [("Stored", 1), ("Removed", 0)]
    assert events[1].data == Removed((1, 2), (0, 0))


@pytest.mark.parametrize("other", ["created", "updated", "all_cleared"])
def test_every_groups_removals_flush_before_an_event_of_another_type(
    em: EventManager, other: str
) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    em.on_stored(1, 32, None, chain(5, 6))
    flushed(em)
    em.on_removed(1, 32, [5])
    em.on_removed(0, 64, [1])
    if other == "created":
        em.on_created(2, 16, [10])
    elif other == "updated":
        em.on_updated(0, 64, 2, cache_level=EventDiff(0, 1))
    else:
        em.on_all_cleared()
    em.on_removed(1, 32, [6])  # after the other event: a new batch
    events = flushed(em)
    expected_other = {"created": "Created", "updated": "Updated", "all_cleared": "AllCleared"}
    assert [type(e.data).__name__ for e in events[:3]] == [
        "Removed",
        "Removed",
        expected_other[other],
    ]
    assert events[0].layer_group_id == 1 and events[0].data == Removed((5,), (0,))
    assert events[1].layer_group_id == 0 and events[1].data == Removed((1,), (0,))
    if other == "all_cleared":
        assert len(events) == 3  # everything was unannounced: removing 6 emits nothing
    else:
        assert events[3].layer_group_id == 1 and events[3].data == Removed((6,), (0,))


def test_removal_batches_never_mix_groups(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2, 3))
    em.on_stored(1, 32, None, chain(1, 2, 3))  # the same hashes in another group
    flushed(em)
    em.on_removed(0, 64, [1])
    em.on_removed(1, 32, [1, 2])
    em.on_removed(0, 64, [3])
    events = flushed(em)
    by_group = {e.layer_group_id: e.data for e in events}
    assert len(events) == 2
    assert by_group == {0: Removed((1, 3), (0, 0)), 1: Removed((1, 2), (0, 0))}


def test_removed_event_carries_each_blocks_tier(em: EventManager) -> None:
    em.on_stored(0, 64, None, [blk(1, 0), blk(2, 1), blk(3, 2)])
    flushed(em)
    em.on_removed(0, 64, [3, 1, 2])
    (event,) = flushed(em)
    assert event.data == Removed((3, 1, 2), (2, 0, 1))


# ------------------------------------------------------------------------------- chain merging


def test_a_chain_built_by_several_calls_is_one_stored_event(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    em.on_stored(0, 64, 2, chain(3))
    em.on_stored(0, 64, 3, chain(4, 5))
    events = flushed(em)
    assert len(events) == 1
    assert events[0].data.parent_hash is None  # type: ignore[union-attr]
    assert stored_hashes(events[0]) == [1, 2, 3, 4, 5]


def test_a_stored_event_whose_parent_is_not_the_tail_starts_a_new_event(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    em.on_stored(0, 64, 1, chain(8))  # a branch off block 1
    events = flushed(em)
    assert [stored_hashes(e) for e in events] == [[1, 2], [8]]
    assert events[1].data.parent_hash == 1  # type: ignore[union-attr]
    assert [e.event_id for e in events] == [0, 1]


def test_chains_do_not_merge_across_groups_flushes_or_other_events(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1))
    em.on_stored(1, 32, 1, chain(2))  # parent is group 0's tail, but another group
    flushed(em)
    em.on_stored(0, 64, 1, chain(3))  # after a flush
    em.on_updated(0, 64, 1, priority=EventDiff(35, 80))
    em.on_stored(0, 64, 3, chain(4))  # after another event of the group
    events = flushed(em)
    assert kinds(events) == [("Stored", 0), ("Updated", 0), ("Stored", 0)]
    assert [stored_hashes(events[0]), stored_hashes(events[2])] == [[3], [4]]


def test_merging_does_not_consume_event_ids(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1))
    em.on_stored(0, 64, 1, chain(2))
    em.on_stored(0, 64, None, chain(10))
    em.on_removed(0, 64, [10])
    em.on_created(1, 64, [4])
    ids = [e.event_id for e in flushed(em)]
    assert ids == [0, 1, 2, 3]
    em.on_stored(1, 64, None, chain(20))
    assert [e.event_id for e in flushed(em)] == [4]
    assert em.next_event_id == 5


# ----------------------------------------------------------------------------------- registry


def test_hooks_for_unannounced_blocks_emit_nothing(em: EventManager) -> None:
    em.on_removed(0, 64, [1, 2])
    em.on_updated(0, 64, 1, cache_level=EventDiff(0, 1))
    em.on_updated(0, 64, 1, priority=EventDiff(35, 50))
    em.on_stored(1, 64, None, chain(1))
    em.on_removed(0, 64, [1])  # announced in group 1, not in group 0
    events = flushed(em)
    assert kinds(events) == [("Stored", 1)]


def test_a_removed_block_is_unannounced_afterwards(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    em.on_removed(0, 64, [1])
    em.on_removed(0, 64, [1])
    em.on_updated(0, 64, 1, cache_level=EventDiff(0, 1))
    events = flushed(em)
    assert kinds(events) == [("Stored", 0), ("Removed", 0)]
    assert events[1].data == Removed((1,), (0,))
    assert em.announced_tier(0, 1) is None and em.announced_tier(0, 2) == 0


def test_stored_again_is_not_announced_twice_and_splits_the_chain(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    flushed(em)
    em.on_stored(0, 64, None, chain(1, 2))  # a concurrent commit of the same blocks
    assert flushed(em) == []
    em.on_stored(0, 64, None, [blk(5), blk(1), blk(2), blk(6)])  # 1, 2 already announced
    events = flushed(em)
    assert [(e.data.parent_hash, stored_hashes(e)) for e in events] == [  # type: ignore[union-attr]
        (None, [5]),
        (2, [6]),
    ]


def test_stored_again_on_another_tier_becomes_an_updated_event(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1))
    flushed(em)
    em.on_stored(0, 64, None, [blk(1, tier=1), blk(2, tier=1)])
    events = flushed(em)
    assert kinds(events) == [("Updated", 0), ("Stored", 0)]
    assert events[0].data == Updated(1, cache_level=EventDiff(old_value=0, new_value=1))
    assert events[1].data.parent_hash == 1  # type: ignore[union-attr]
    assert em.announced_tier(0, 1) == 1


def test_all_cleared_unannounces_everything(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1))
    em.on_stored(1, 32, None, chain(2))
    em.on_all_cleared()
    em.on_removed(0, 64, [1])
    em.on_removed(1, 32, [2])
    events = flushed(em)
    assert kinds(events) == [("Stored", 0), ("Stored", 1), ("AllCleared", 0)]
    assert events[2].window_size == 64  # group 0's window
    assert em.announced_blocks() == frozenset()


# --------------------------------------------------------------------------------- tier moves


def test_tier_moves_are_updated_events_with_the_announced_old_tier(em: EventManager) -> None:
    em.on_stored(0, 64, None, chain(1, 2))
    flushed(em)
    em.on_updated(0, 64, 1, cache_level=EventDiff(0, 1))
    em.on_updated(0, 64, 1, cache_level=EventDiff(7, 2))  # a stale old value is corrected
    em.on_updated(0, 64, 2, cache_level=EventDiff(0, 0))  # not a move: nothing
    em.on_updated(0, 64, 2, priority=EventDiff(35, 90))
    events = flushed(em)
    assert [e.data for e in events] == [
        Updated(1, cache_level=EventDiff(old_value=0, new_value=1)),
        Updated(1, cache_level=EventDiff(old_value=1, new_value=2)),
        Updated(2, priority=EventDiff(old_value=35, new_value=90)),
    ]
    em.on_removed(0, 64, [1])
    assert flushed(em)[0].data == Removed((1,), (2,))


def test_every_event_carries_its_metadata() -> None:
    em = EventManager(100, hash_algo="v2_sha256")
    h = "ab" * 32
    em.on_created(1, 4096, [100, 400])
    em.on_stored(1, 4096, None, [StoredBlock(block_hash=h, tokens=(1, 2))])
    (created, stored) = flushed(em)
    assert created == KVCacheEvent(
        event_id=0,
        data=Created((100, 400)),
        window_size=4096,
        layer_group_id=1,
        hash_algo="v2_sha256",
        attention_dp_rank=None,
    )
    assert (stored.event_id, stored.window_size, stored.layer_group_id, stored.hash_algo) == (
        1,
        4096,
        1,
        "v2_sha256",
    )


# ------------------------------------------------------------------------------------- buffer


def test_full_buffer_drops_the_oldest_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    em = EventManager(3, hash_algo="v1_block_key")
    for h in range(5):
        em.on_stored(0, 64, None, chain(100 + h))  # five separate chains: five events
    with caplog.at_level(logging.WARNING, logger="kvpool.events.manager"):
        em.flush_iteration_events()
    assert em.dropped_events == 2
    assert any("dropped" in r.getMessage() for r in caplog.records)
    em.on_stored(0, 64, None, chain(200))
    em.flush_iteration_events()  # unread events count against the buffer too
    events = em.get_latest_events(0)
    assert [e.event_id for e in events] == [3, 4, 5]
    assert em.dropped_events == 3


def test_no_drop_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    em = EventManager(3, hash_algo="v1_block_key")
    em.on_stored(0, 64, None, chain(1))
    with caplog.at_level(logging.WARNING, logger="kvpool.events.manager"):
        flushed(em)
        flushed(em)
    assert em.dropped_events == 0 and not caplog.records


# ---------------------------------------------------------------------------------- reading


def test_get_latest_events_nonpositive_timeout_returns_at_once(em: EventManager) -> None:
    for timeout in (0, -1.0):
        start = time.monotonic()
        assert em.get_latest_events(timeout) == []
        assert time.monotonic() - start < 0.05


def test_get_latest_events_positive_timeout_waits_then_gives_up(em: EventManager) -> None:
    start = time.monotonic()
    assert em.get_latest_events(0.2) == []
    assert time.monotonic() - start >= 0.19


def _flush_later(em: EventManager, delay: float) -> threading.Thread:
    def work() -> None:
        time.sleep(delay)
        em.on_stored(0, 64, None, chain(1))
        em.flush_iteration_events()

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_get_latest_events_positive_timeout_returns_when_events_arrive(em: EventManager) -> None:
    thread = _flush_later(em, 0.1)
    start = time.monotonic()
    events = em.get_latest_events(5.0)
    thread.join()
    assert [stored_hashes(e) for e in events] == [[1]]
    assert time.monotonic() - start < 4.0


def test_get_latest_events_none_blocks_until_events_arrive(em: EventManager) -> None:
    thread = _flush_later(em, 0.2)
    start = time.monotonic()
    events = em.get_latest_events(None)
    thread.join()
    assert len(events) == 1 and time.monotonic() - start >= 0.19
    assert em.get_latest_events(0) == []  # the read drained the buffer


def test_hooks_from_many_threads_lose_nothing() -> None:
    em = EventManager(100_000, hash_algo="v1_block_key")
    index = EventIndex(strict=True)

    def work(base: int) -> None:
        for i in range(200):
            em.on_stored(0, 64, None, chain(base + i))
            if i % 2:
                em.on_removed(0, 64, [base + i - 1])

    threads = [threading.Thread(target=work, args=(1000 * t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    reader_events: list[KVCacheEvent] = []
    while any(t.is_alive() for t in threads):
        em.flush_iteration_events()
        reader_events += em.get_latest_events(0.01)
    for thread in threads:
        thread.join()
    em.flush_iteration_events()
    reader_events += em.get_latest_events(0)
    index.apply_all(reader_events)
    assert [e.event_id for e in reader_events] == list(range(len(reader_events)))
    assert index.cached == em.announced_blocks()
    assert len(index) == 4 * 100


# ------------------------------------------------------------------------- attention DP


class ThreadGather:
    """An all-to-rank-0 gather collective for ranks running in threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[list[KVCacheEvent]] = [[] for _ in range(size)]

    def for_rank(self, rank: int) -> AttentionDpGather:
        def gather(events: list[KVCacheEvent]) -> list[list[KVCacheEvent]] | None:
            self.slots[rank] = list(events)
            self.barrier.wait()
            result = [list(s) for s in self.slots] if rank == 0 else None
            self.barrier.wait()  # nobody overwrites a slot before rank 0 copied it
            return result

        return gather


def dp_ranks(capacity: int) -> list[EventManager]:
    """Two attention-DP ranks' event managers, gathering to rank 0 across threads."""
    gather = ThreadGather(2)
    return [
        EventManager(
            capacity,
            hash_algo="v1_block_key",
            attention_dp_rank=r,
            attention_dp_gather=gather.for_rank(r),
            attention_dp_size=2,
        )
        for r in range(2)
    ]


def flush_ranks(ranks: list[EventManager]) -> None:
    """Every rank flushes at once (each in a thread), as ranks of one engine step do."""
    threads = [threading.Thread(target=em.flush_iteration_events) for em in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_attention_dp_ranks_publish_through_rank_0() -> None:
    ranks = dp_ranks(4)
    assert ranks[0].capacity == 8 and ranks[1].capacity == 4
    ranks[0].on_stored(0, 64, None, chain(1))
    ranks[1].on_stored(0, 64, None, chain(2))
    ranks[1].on_stored(0, 64, None, chain(3))
    flush_ranks(ranks)
    events = ranks[0].get_latest_events(0)
    assert [(e.attention_dp_rank, e.event_id, stored_hashes(e)) for e in events] == [
        (0, 0, [1]),
        (1, 0, [2]),
        (1, 1, [3]),
    ]
    assert ranks[1].get_latest_events(0) == []


def test_attention_dp_rank_0_buffer_scales_and_each_rank_share_is_capped() -> None:
    ranks = dp_ranks(2)
    for r, em in enumerate(ranks):
        for i in range(3):  # 3 events per rank; each rank may send 2
            em.on_stored(0, 64, None, chain(10 * r + i))
    flush_ranks(ranks)
    events = ranks[0].get_latest_events(0)
    assert [(e.attention_dp_rank, e.event_id) for e in events] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert ranks[0].dropped_events == 1 and ranks[1].dropped_events == 1


def test_attention_dp_gather_returning_none_on_rank_0_is_an_error() -> None:
    em = EventManager(
        4, attention_dp_rank=0, attention_dp_gather=lambda events: None, attention_dp_size=2
    )
    with pytest.raises(InvalidArgumentError, match="rank 0"):
        em.flush_iteration_events()


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_entries": 0}, "max_entries"),
        ({"max_entries": 4, "attention_dp_size": 0}, "attention_dp_size"),
        ({"max_entries": 4, "attention_dp_size": 2}, "attention_dp_rank"),
        ({"max_entries": 4, "attention_dp_rank": 2, "attention_dp_size": 2}, r"\[0, 2\)"),
        ({"max_entries": 4, "attention_dp_rank": 1, "attention_dp_size": 2}, "gather"),
    ],
)
def test_bad_construction_is_rejected(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        EventManager(**kwargs)  # type: ignore[arg-type]


def test_unknown_hash_algo_is_rejected() -> None:
    with pytest.raises(UnknownHashAlgorithmError, match="md5"):
        EventManager(4, hash_algo="md5")


def test_bad_hook_arguments_change_nothing(em: EventManager) -> None:
    with pytest.raises(InvalidArgumentError, match="-1"):
        em.on_stored(-1, 64, None, chain(1))
    with pytest.raises(InvalidArgumentError, match="num_blocks_per_cache_level"):
        em.on_created(0, 64, [-5])
    with pytest.raises(InvalidArgumentError, match="cache level"):
        em.on_updated(0, 64, 1, cache_level=EventDiff(0, -1))
    assert em.num_pending == 0 and em.announced_blocks() == frozenset()


# ---------------------------------------------------------------------------------- EventIndex


def test_index_applies_each_event_type() -> None:
    index = EventIndex(strict=True)
    ev = [
        KVCacheEvent(0, Created((8, 16)), 64, 0),
        KVCacheEvent(1, Stored(None, (blk(1), blk(2), blk(3, tier=1))), 64, 0),
        KVCacheEvent(2, Updated(1, cache_level=EventDiff(0, 2)), 64, 0),
        KVCacheEvent(3, Removed((2,)), 64, 0),
        KVCacheEvent(4, Removed((3,), (1,)), 64, 0),
    ]
    index.apply_all(ev)
    assert index.cached == {(1, 0, 2)}
    assert index.created == {0: (8, 16)}
    index.apply(KVCacheEvent(5, AllCleared(), 64, 0))
    assert index.cached == frozenset() and len(index) == 0


def test_index_reference_counts_duplicates_and_per_tier_removals() -> None:
    index = EventIndex()
    stored = KVCacheEvent(0, Stored(None, (blk(1),)), 0, 0)
    index.apply_all([stored, stored, KVCacheEvent(1, Stored(None, (blk(1, tier=1),)), 0, 0)])
    index.apply(KVCacheEvent(2, Removed((1,), (0,)), 0, 0))
    assert index.tiers_of(1) == {0, 1}
    index.apply(KVCacheEvent(3, Removed((1,), (0,)), 0, 0))
    assert index.tiers_of(1) == {1}
    index.apply(KVCacheEvent(4, Removed((1,), (0,)), 0, 0))  # not held on tier 0 any more
    assert index.anomalies == 1 and (1, 0, 1) in index


def test_strict_index_rejects_inconsistent_streams_before_changing() -> None:
    index = EventIndex(strict=True)
    index.apply(KVCacheEvent(0, Stored(None, (blk(1),)), 0, 0))
    bad = [
        KVCacheEvent(1, Stored(None, (blk(1),)), 0, 0),
        KVCacheEvent(1, Removed((1, 9)), 0, 0),
        KVCacheEvent(1, Removed((1,), (1,)), 0, 0),
        KVCacheEvent(1, Updated(1, cache_level=EventDiff(2, 0)), 0, 0),
        KVCacheEvent(1, Updated(9, priority=EventDiff(35, 0)), 0, 0),
    ]
    for event in bad:
        with pytest.raises(EventStreamError):
            index.apply(event)
        assert index.cached == {(1, 0, 0)}


def test_index_counts_event_id_gaps_per_rank() -> None:
    index = EventIndex()
    for event_id, rank in [(0, 0), (0, 1), (1, 0), (3, 0), (1, 1)]:
        index.apply(KVCacheEvent(event_id, AllCleared(), 0, 0, attention_dp_rank=rank))
    assert index.id_gaps == 1


# ------------------------------------------------------------------- completeness (stateful)

HASHES = st.integers(1, 24)
GROUPS = st.integers(0, 1)
TIERS = st.integers(0, 2)


class HookMachine(RuleBasedStateMachine):
    """Random hook sequences: the flushed stream rebuilds exactly what the hooks declared."""

    @initialize()
    def setup(self) -> None:
        self.em = EventManager(10_000, hash_algo="v1_block_key")
        self.index = EventIndex(strict=True)
        self.model: dict[int, dict[int, int]] = {0: {}, 1: {}}  # group -> {hash: tier}
        self.next_id = 0

    @rule(
        group=GROUPS,
        parent=st.none() | HASHES,
        hashes=st.lists(HASHES, min_size=1, max_size=5),
        tier=TIERS,
    )
    def store(self, group: int, parent: int | None, hashes: list[int], tier: int) -> None:
        self.em.on_stored(group, 64 * (group + 1), parent, chain(*hashes, tier=tier))
        for h in hashes:
            self.model[group][h] = tier

    @rule(group=GROUPS, hashes=st.lists(HASHES, max_size=6))
    def remove(self, group: int, hashes: list[int]) -> None:
        self.em.on_removed(group, 64 * (group + 1), hashes)
        for h in hashes:
            self.model[group].pop(h, None)

    @rule(group=GROUPS, h=HASHES, tier=st.none() | TIERS, prio=st.none() | st.integers(0, 100))
    def update(self, group: int, h: int, tier: int | None, prio: int | None) -> None:
        self.em.on_updated(
            group,
            64 * (group + 1),
            h,
            cache_level=None if tier is None else EventDiff(0, tier),
            priority=None if prio is None else EventDiff(35, prio),
        )
        if tier is not None and h in self.model[group]:
            self.model[group][h] = tier

    @rule()
    def clear(self) -> None:
        self.em.on_all_cleared()
        self.model = {0: {}, 1: {}}

    @rule()
    def flush(self) -> None:
        self.em.flush_iteration_events()
        events = self.em.get_latest_events(0)
        assert [e.event_id for e in events] == list(range(self.next_id, self.next_id + len(events)))
        self.next_id += len(events)
        check_batching(events)
        self.index.apply_all(events)
        expected = {(h, g, t) for g, blocks in self.model.items() for h, t in blocks.items()}
        assert self.index.cached == expected

    @invariant()
    def registry_matches_model(self) -> None:
        expected = {(h, g, t) for g, blocks in self.model.items() for h, t in blocks.items()}
        assert self.em.announced_blocks() == expected


def check_batching(events: Sequence[KVCacheEvent]) -> None:
    """No two removed events of a group without a stored event of that group or an event of
    another type between them; no two mergeable stored events left unmerged."""
    open_removed: set[int] = set()
    open_stored: dict[int, KVCacheEvent] = {}
    for event in events:
        data, group = event.data, event.layer_group_id
        if isinstance(data, Removed):
            assert group not in open_removed, "removals of one group split without a reason"
            open_removed.add(group)
            open_stored.pop(group, None)
        elif isinstance(data, Stored):
            open_removed.discard(group)
            previous = open_stored.get(group)
            if previous is not None:
                assert isinstance(previous.data, Stored)
                assert data.parent_hash != previous.data.blocks[-1].block_hash
            open_stored[group] = event
        else:
            open_removed.clear()
            if isinstance(data, AllCleared):
                open_stored.clear()
            else:
                open_stored.pop(group, None)


TestHookMachine = HookMachine.TestCase
