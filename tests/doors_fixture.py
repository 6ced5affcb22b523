"""Deliberate door violations, one per line marked VIOLATION: tests/test_doors.py parses this
file as if it were a core module (it is never imported) and must find exactly those lines."""

from __future__ import annotations

from kvpool.core.plan import RequestPlan
from kvpool.core.slots import SlotPool
from kvpool.core.state import CacheState


def writes_fields(state: CacheState) -> None:
    state.retention_seen = True  # VIOLATION: another module's field
    state.failed_copies += 1  # VIOLATION: augmented
    state.sequences["a"] = state.sequences["b"]  # VIOLATION: a container field, subscript
    state.pending_free.append((1, 0, 3))  # VIOLATION: a container field, append
    del state.roots[(None, None)]  # VIOLATION: del
    state.new_count[0] += 1  # VIOLATION: another module's container


def writes_owned_objects(state: CacheState) -> None:
    state.stats.reused_tokens += 4  # VIOLATION: the stats' counter
    state.gpu[0].free.append(3)  # VIOLATION: a pool's free list
    state.pools[1][0].queue.remove(3)  # VIOLATION: a pool's queue
    state.emit.pending = {}  # VIOLATION: the emitter's state
    state.stats.admitted_requests = 0  # VIOLATION: assigned


def writes_through_aliases(state: CacheState) -> None:
    gpu = state.gpu
    pool = gpu[0]
    ref = pool.ref
    ref[3] += 1  # VIOLATION: a reference count through aliases
    tier_hits = state.stats.tier_hits
    tier_hits[0] += 1  # VIOLATION: the stats' list
    for each in state.pools[0]:
        each.held.add(2)  # VIOLATION: a loop variable


def writes_a_pool(pool: SlotPool[object, object]) -> None:  # type: ignore[type-var]
    pool.ref[0] = 2  # VIOLATION: an annotated pool


class Holder:
    def __init__(self, state: CacheState) -> None:
        self._state = state

    def poke(self) -> None:
        self._state.copy_failure = "x"  # VIOLATION: a state held by self


def reads_privates(plan: RequestPlan, state: CacheState) -> object:
    return state.copies._dst, state._hashers  # VIOLATION: two private reads


def goes_through_doors(state: CacheState, plan: RequestPlan) -> None:
    """What the doors allow: methods, reads, and local objects."""
    pool = state.gpu[0]
    pool.hold_one(3, 1)
    pool.dequeue(3)
    state.stats.offloaded(1, 64)
    state.add_sequence(state.seq("a"))
    run = pool.run_at[3]
    if run is not None:
        run.slot[0][0] = 3  # a tree run, not the pool
    n = state.failed_copies + len(pool.free)
    plan.partial_loc[0] = (0, n)
