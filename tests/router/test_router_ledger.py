"""kvpool.router.ledger alone: event streams' holes and the ledger's ordering of steps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.router.ledger import (
    HOLE_WINDOW,
    LATE_RELEASE,
    EventStream,
    LedgerEntry,
    evaluate,
    settled,
)

# ids well inside one hole window: every missing id below the newest one is a hole
ids_in_window = st.lists(st.integers(0, 80), unique=True, max_size=40)


@given(ids=ids_in_window)
def test_a_stream_holes_are_the_missing_ids_below_the_newest(ids: list[int]) -> None:
    stream = EventStream()
    seen: set[int] = set()
    for eid in ids:
        was_hole = eid < stream.top and eid not in seen
        assert stream.see(eid) == was_hole
        seen.add(eid)
        top = max(seen)
        assert stream.top == top
        assert stream.holes == {x for x in range(top) if x not in seen}
        for below in range(top + 2):
            assert stream.complete_below(below) == all(x in seen for x in range(min(below + 1,
                                                                                    top)))


@given(gap=st.integers(HOLE_WINDOW + 1, 4 * HOLE_WINDOW), late=st.integers(1, HOLE_WINDOW))
def test_ids_missing_beyond_the_window_are_lost_not_late(gap: int, late: int) -> None:
    stream = EventStream()
    stream.see(0)
    stream.see(gap + 1)  # more than HOLE_WINDOW ids missing at once: taken as lost
    assert stream.holes == set()
    stream.see(gap + 1 + late + 1)  # within the window: ``late`` ids are holes
    assert stream.holes == set(range(gap + 2, gap + 2 + late))
    assert not stream.complete_below(gap + 1 + late + 1)


def in_order(base: int, steps: list[tuple[int, int]]) -> int:
    """A count's +1/-1 steps applied in event-id order, a -1 at zero ignored (history)."""
    count = base
    for _, delta in sorted(steps):
        if delta > 0:
            count += 1
        elif count > 0:
            count -= 1
    return count


steps_st = st.lists(st.tuples(st.integers(0, 60), st.sampled_from([1, -1])),
                    unique_by=lambda s: s[0], max_size=20)


@given(base=st.integers(0, 3), steps=steps_st, order=st.randoms(use_true_random=False))
def test_a_complete_stream_evaluates_steps_in_id_order_whatever_their_arrival(
    base: int, steps: list[tuple[int, int]], order: object
) -> None:
    stream = EventStream()
    for eid in range(61):
        stream.see(eid)
    entry = LedgerEntry(base)
    arrived = list(steps)
    order.shuffle(arrived)  # type: ignore[attr-defined]
    entry.steps = [(eid, None, delta) for eid, delta in arrived]
    assert evaluate(entry, {None: stream}) == in_order(base, steps)
    if steps:
        assert settled(entry, evaluate(entry, {None: stream}), {None: stream})


@given(eid=st.integers(2, 60), hole=st.integers(0, 59))
def test_a_release_with_a_missing_id_below_waits_for_its_store(eid: int, hole: int) -> None:
    hole = hole % eid
    stream = EventStream()
    for x in range(eid + 1):
        if x != hole:
            stream.see(x)
    entry = LedgerEntry(0)
    entry.steps = [(eid, None, -1)]
    assert evaluate(entry, {None: stream}) == -1  # kept: its store may still arrive
    assert not settled(entry, -1, {None: stream})
    entry.steps.append((hole, None, 1))  # the late store arrives
    stream.see(hole)
    assert evaluate(entry, {None: stream}) == 0
    assert settled(entry, 0, {None: stream})


@given(eid=st.integers(0, 60))
def test_a_late_release_is_never_taken_as_history(eid: int) -> None:
    stream = EventStream()
    for x in range(61):
        stream.see(x)
    entry = LedgerEntry(0)
    entry.steps = [(eid, None, LATE_RELEASE)]
    assert evaluate(entry, {None: stream}) == -1
    entry.steps[0] = (eid, None, -1)
    assert evaluate(entry, {None: stream}) == 0
