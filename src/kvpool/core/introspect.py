"""Read-only looks at a manager's state, for tests, debugging and event consumers.

:func:`check_invariants` asserts ARCHITECTURE §7 (1-3) over the whole state: references equal
the block tables' entries, every slot of every pool is in exactly one state, back-pointers and
tree slots agree, keys are unique, no slotless leaf survives a prune. :func:`debug_state` is a
comparable snapshot of everything a call may change (the failure-atomicity tests compare two).
All are O(state).
"""

from __future__ import annotations

from array import array
from typing import Any

from kvpool.core.radix import NO_SLOT, Run
from kvpool.core.state import CacheState
from kvpool.core.views import Scope
from kvpool.hashing.keys import BlockKey


def blocks(state: CacheState) -> list[tuple[Scope, Run, int]]:
    """(scope, run, index) of every block in the tree."""
    out: list[tuple[Scope, Run, int]] = []
    for rk, root in state.roots.items():
        for r in root.descendants():
            out += [(rk, r, j) for j in range(len(r.keys))]
    return out


def cached_blocks(state: CacheState) -> set[tuple[int | str, int, int]]:
    """(event hash, layer group, tier) of every cached block: what events describe."""
    out: set[tuple[int | str, int, int]] = set()
    for root in state.roots.values():
        for r in root.descendants():
            hashes = state.emit.hashes(r.keys)
            for g, slots in enumerate(r.slot):
                tiers = r.tier[g]
                for j, s in enumerate(slots):
                    if s != NO_SLOT:
                        out.add((hashes[j], g, tiers[j]))
    return out


def tree_blocks(state: CacheState) -> list[tuple[array[int], list[int], list[int]]]:
    """(tokens up to and including the block, slot per group, tier per group) of every block
    in the tree."""
    out: list[tuple[array[int], list[int], list[int]]] = []
    step = state.layout.step
    for _, r, j in blocks(state):
        chain = [r.tkey[:(j + 1) * step]]
        parent = r.parent
        while parent is not None:
            chain.append(parent.tkey[:len(parent.keys) * step])
            parent = parent.parent
        toks = array("I")
        toks.frombytes(b"".join(reversed(chain)))
        out.append((toks, [sl[j] for sl in r.slot], [tl[j] for tl in r.tier]))
    return out


def debug_state(state: CacheState) -> dict[str, Any]:
    """Free lists, queues, references, the tree, held colder-tier slots, the sequences and
    the stats; two snapshots are equal iff nothing observable changed between them."""
    tree = sorted(
        ((rk, r.keys[j], tuple(sl[j] for sl in r.slot), tuple(tl[j] for tl in r.tier),
          r.priority(j)) for rk, r, j in blocks(state)),
        key=repr,
    )
    return {
        "free": [[sorted(pool.free) for pool in t] for t in state.pools],
        "queue": [[pool.queue.peek_order() for pool in t] for t in state.pools],
        "ref": [list(pool.ref) for pool in state.gpu],
        "tree": tree,
        "held": [[sorted(pool.held) for pool in t] for t in state.pools],
        "seqs": {
            seq_id: (list(seq.tokens), [[list(b) for b in t] for t in seq.tables],
                seq.committed_blocks, seq.suspended, sorted(seq.moved.items()))
            for seq_id, seq in state.sequences.items()
        },
        "stats": state.stats.copy(),
    }


def check_invariants(state: CacheState) -> None:
    """Assert ARCHITECTURE §7 (1-3) over the whole state (see the module docstring)."""
    refs = [[0] * n for n in state.config.slots[0]]
    for seq in state.sequences.values():
        for g in range(state.layout.num_groups):
            for tb in seq.tables[g]:
                for s in tb:
                    if s != NO_SLOT:
                        refs[g][s] += 1
    assert refs == [pool.ref for pool in state.gpu], "reference counts differ from the block tables"
    for t in range(state.layout.tiers):
        for g in range(state.layout.num_groups):
            _check_pool(state, t, g)
    _check_tree(state)


def _check_pool(state: CacheState, t: int, g: int) -> None:
    """Every slot of pool (t, g) is in exactly one state; back-pointers name live blocks."""
    pool = state.pools[t][g]
    ref = state.gpu[g].ref
    free = set(pool.free)
    assert len(free) == len(pool.free), "a slot is free twice"
    queued = set(pool.queue.peek_order())
    assert not free & queued, "a slot is both free and queued"
    for s in range(pool.size):
        run = pool.run_at[s]
        if s in free:
            assert run is None and (t > 0 or ref[s] == 0)
        if s in queued:
            assert run is not None and (t > 0 or ref[s] == 0)
        if t == 0 and ref[s] == 0:
            assert s in free or s in queued, f"slot {s} of group {g} leaked"
        if t > 0:
            held = s in pool.held
            assert (s in free) + (s in queued) + held == 1, \
                f"tier {t} slot {s} leaked or double-booked"
        if run is not None:
            i = pool.idx_at[s]
            assert run.alive and run.slot[g][i] == s and run.tier[g][i] == t


def _check_tree(state: CacheState) -> None:
    """Runs are well formed, keys unique, tree slots agree with the back-pointers."""
    step = state.layout.step
    seen: set[tuple[Scope, BlockKey | None, BlockKey]] = set()
    for scope, root in state.roots.items():
        rk = state.view.root_key(*scope)
        assert not root.keys and root.parent is None
        for r in root.descendants():
            n = len(r.keys)
            assert r.alive and n > 0, "an empty run in the tree"
            parent = r.parent
            assert parent is not None and parent.children.get(r.ckey) is r
            assert all(len(sl) == n for sl in r.slot) and all(len(tl) == n for tl in r.tier)
            assert r.prio is None or len(r.prio) == n == len(r.dur or ())
            if len(r.ckey) != step:  # a partial block: a leaf run of its own
                assert n == 1 and len(r.tkey) == len(r.ckey) < step \
                    and not r.children, "a non-leaf block is a partial block"
            else:
                assert len(r.tkey) >= n * step, "a run lost its blocks' tokens"
            assert r.ckey == r.tkey[:step]
            pk = parent.keys[-1] if parent.keys else rk
            for j, key in enumerate(r.keys):
                assert (scope, pk, key) not in seen, "two blocks with the same key"
                seen.add((scope, pk, key))
                pk = key
                for g in range(state.layout.num_groups):
                    s = r.slot[g][j]
                    if s != NO_SLOT:
                        pool = state.pools[r.tier[g][j]][g]
                        assert pool.run_at[s] is r and pool.idx_at[s] == j
            if not r.children:
                assert r.has_slot(n - 1), "a slotless leaf block was not pruned"
