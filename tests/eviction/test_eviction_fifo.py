"""kvpool.eviction.fifo alone: one lazy FIFO against a reference deque of live slots."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import InvalidArgumentError
from kvpool.eviction.fifo import (
    ID_MASK,
    NOT_QUEUED,
    STEP,
    Fifo,
    compact,
    cut_tail,
    live_slots,
    stamp_of,
    take,
    take_one,
)

POOL = 24
FID = 3


class LazyFifoMachine(RuleBasedStateMachine):
    """Batches appended, slots claimed (entries left dead), victims taken, tails cut and the
    FIFO compacted, in any order: the live slots are always the model's deque, and ``dead``
    counts the dead entries from ``head`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.fifo = Fifo(FID, 35, False)
        self.stamp = [NOT_QUEUED] * POOL
        self.model: deque[int] = deque()
        self.next = 0

    def free(self) -> list[int]:
        return [s for s in range(POOL) if s not in self.model]

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        free = self.free()
        if not free:
            return
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=6, unique=True))
        b = self.next | FID
        self.next += STEP
        for s in slots:
            self.stamp[s] = b
        self.fifo.batches.append((b, slots))
        self.model.extend(slots)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(list(self.model)))
        assert stamp_of(self.stamp, slot) & ID_MASK == FID
        self.stamp[slot] = NOT_QUEUED
        self.fifo.dead += 1
        self.model.remove(slot)

    @rule(k=st.integers(1, 8))
    def take_k(self, k: int) -> None:
        got, used = take(self.fifo, k, self.stamp)
        want = [self.model.popleft() for _ in range(min(k, len(self.model)))]
        assert got == want
        assert used >= len(got)
        assert all(self.stamp[s] == NOT_QUEUED for s in got)

    @rule()
    def take_single(self) -> None:
        slot, used = take_one(self.fifo, self.stamp)
        if self.model:
            assert slot == self.model.popleft()
            assert used >= 1
        else:
            assert slot == -1
            assert not self.fifo.batches

    @rule(k=st.integers(1, 5), exact=st.booleans())
    def cut(self, k: int, exact: bool) -> None:
        tail = list(self.model)[-k:][::-1]
        if not tail:
            return
        slots = tail if exact else tail[::-1]
        before = self.entries()
        got = cut_tail([self.fifo] * (FID + 1), self.stamp, slots)
        if got is None:  # declined (not the newest entries of one batch): nothing changed
            assert self.entries() == before
            return
        assert got is self.fifo
        assert exact or len(slots) == 1
        assert self.entries() == before[:len(before) - len(slots)]
        for s in slots:
            self.stamp[s] = NOT_QUEUED
            self.model.remove(s)

    def entries(self) -> list[int]:
        """Every entry from ``head`` on, live or dead."""
        return [s for i, (_, sl) in enumerate(self.fifo.batches)
                for s in (sl[self.fifo.head:] if i == 0 else sl)]

    @rule()
    def compact_all(self) -> None:
        compact([self.fifo], self.stamp)
        assert self.fifo.dead == 0
        assert sum(len(sl) for _, sl in self.fifo.batches) == len(self.model)

    @invariant()
    def live_is_the_model(self) -> None:
        assert live_slots(self.fifo, self.stamp) == list(self.model)
        entries = self.entries()
        dead = [s for i, (b, sl) in enumerate(self.fifo.batches)
                for s in (sl[self.fifo.head:] if i == 0 else sl) if self.stamp[s] != b]
        assert self.fifo.dead == len(dead)
        assert len(entries) - len(dead) == len(self.model)
        assert all(sl for _, sl in self.fifo.batches), "an empty batch is kept"
        if self.fifo.batches:
            assert self.fifo.head < len(self.fifo.batches[0][1])
        else:
            assert self.fifo.head == 0


LazyFifoMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                             deadline=None)
TestLazyFifo = LazyFifoMachine.TestCase


def test_stamp_of_a_slot_not_queued_is_a_key_error() -> None:
    stamp = [NOT_QUEUED] * 4
    with pytest.raises(KeyError):
        stamp_of(stamp, 2)
    with pytest.raises(KeyError):
        stamp_of(stamp, 9)


def test_fifo_ids_are_bounded() -> None:
    with pytest.raises(InvalidArgumentError, match="priority levels"):
        Fifo(ID_MASK + 1, 35, False)
