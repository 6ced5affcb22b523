"""SlotPool alone, against a reference model: a stack of free slots (the last given back is
taken first; a new pool hands out its lowest slots first), a reference count and an owner per
slot. Random bulk takes, gives, holds, releases, placements and clears must agree with the model
step by step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.core.radix import NO_SLOT
from kvpool.core.slots import SlotPool


class Queue:
    """A queue that holds nothing (the pool only asks its length and membership)."""

    def __len__(self) -> int:
        return 0

    def __contains__(self, slot: object) -> bool:
        return False


class SlotPoolMachine(RuleBasedStateMachine):
    @initialize(size=st.integers(1, 24))
    def start(self, size: int) -> None:
        self.size = size
        self.pool: SlotPool[str, Queue] = SlotPool(size, Queue())
        self.free = list(range(size - 1, -1, -1))  # model: the free stack, top last
        self.refs = [0] * size
        self.owner: dict[int, tuple[str, int]] = {}
        self.taken: list[int] = []  # slots out of the free list, in the order taken

    @rule(n=st.integers(0, 30))
    def take(self, n: int) -> None:
        out = self.pool.take(n)
        want = self.free[::-1][:max(n, 0)]
        assert out == want
        del self.free[len(self.free) - len(out):]
        self.taken += out

    @precondition(lambda self: self.taken)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, len(self.taken)))
        back, self.taken = self.taken[:k], self.taken[k:]
        self.pool.give(back)
        self.free += back

    @precondition(lambda self: self.taken)
    @rule(data=st.data(), refs=st.integers(1, 3))
    def hold(self, data: st.DataObject, refs: int) -> None:
        slots = data.draw(st.lists(st.sampled_from(self.taken), max_size=8))
        self.pool.hold(slots, refs)
        for s in slots:
            self.refs[s] += refs

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        # referenced slots out of the free list (the pool never frees a referenced slot)
        held = [s for s in range(self.size) if self.refs[s] and s not in self.free]
        slots = data.draw(st.lists(st.sampled_from([*held, NO_SLOT]), unique=True, min_size=1))
        free_before = list(self.pool.free)
        gone = self.pool.release(slots)
        for s in slots:
            if s != NO_SLOT:
                self.refs[s] -= 1
        last = [s for s in reversed(slots) if s != NO_SLOT and not self.refs[s]]
        # the cached ones come back tail first; the others went to the free list
        assert gone == [s for s in last if s in self.owner]
        freed = [s for s in last if s not in self.owner]
        assert self.pool.free == free_before + freed
        self.free += freed
        self.taken = [s for s in self.taken if s not in freed]

    @precondition(lambda self: self.taken)
    @rule(data=st.data(), name=st.sampled_from(["a", "b"]), first=st.integers(0, 5))
    def place_all(self, data: st.DataObject, name: str, first: int) -> None:
        slots = data.draw(st.lists(st.sampled_from([*self.taken, NO_SLOT]), max_size=6))
        self.pool.place_all(slots, name, first)
        for j, s in enumerate(slots, first):
            if s != NO_SLOT:
                self.owner[s] = (name, j)

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.owner)))
        self.pool.clear(s)
        del self.owner[s]

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert sorted(self.pool.free) == sorted(self.free)
        assert len(self.pool.free) == len(set(self.pool.free))  # no slot twice
        assert self.pool.ref == self.refs
        assert self.pool.available() == len(self.free)
        for s in range(self.size):
            assert self.pool.owner(s) == self.owner.get(s)
            state = self.pool.state_of(s)
            if self.refs[s]:
                assert state == "referenced"
            else:
                assert state == ("free" if s in self.free else "claimed")


TestSlotPool = SlotPoolMachine.TestCase
TestSlotPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
