"""The prefix tree of runs alone (kvpool.core.radix), against a reference model: the set of block
paths present. Random inserts (walk, split, new run), tail evictions of leaf runs (slots cleared,
``prune``) and lookups: ``match_full`` must find the longest present path, and every run must be
indexed by its parent under its first block's bytes."""

from __future__ import annotations

from array import array

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.core.radix import NO_SLOT, Run, match_full, prune
from kvpool.hashing.keys import BlockKey

TPB = 2
STEP = 4 * TPB
blocks_st = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 2)), min_size=1, max_size=6)


def raw(blocks: list[tuple[int, int]]) -> bytes:
    return array("I", [t for b in blocks for t in b]).tobytes()


class RadixMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.root = Run.root(1)
        self.present: set[tuple[tuple[int, int], ...]] = set()  # model: every path present
        self.next_slot = 0

    def _longest(self, blocks: list[tuple[int, int]]) -> int:
        d = 0
        while d < len(blocks) and tuple(blocks[:d + 1]) in self.present:
            d += 1
        return d

    @rule(blocks=blocks_st)
    def insert(self, blocks: list[tuple[int, int]]) -> None:
        data = raw(blocks)
        path = match_full(self.root, data, len(blocks), STEP)
        d = sum(b - a for _, a, b in path)
        assert d == self._longest(blocks)
        if d == len(blocks):
            return
        run, n = (self.root, 0) if not path else (path[-1][0], path[-1][2])
        if n < len(run.keys):
            run.split(n, STEP)
        rest = data[d * STEP:]
        k = len(blocks) - d
        slots = list(range(self.next_slot, self.next_slot + k))
        self.next_slot += k
        keys: list[BlockKey] = [rest[i * STEP:(i + 1) * STEP] for i in range(k)]  # any keys
        run.add_child(Run(run, rest, rest[:STEP], keys, [slots], [[0] * k]))
        for i in range(d, len(blocks)):
            self.present.add(tuple(blocks[:i + 1]))

    @rule(data=st.data())
    def evict_leaf_tail(self, data: st.DataObject) -> None:
        leaves = [r for r in self.root.descendants() if not r.children]
        if not leaves:
            return
        run = data.draw(st.sampled_from(leaves))
        k = data.draw(st.integers(1, len(run.keys)))
        path = self._path(run)
        n = len(run.keys)
        for j in range(n - k, n):
            run.slot[0][j] = NO_SLOT
        prune(run)
        for j in range(k):
            self.present.discard(path[:len(path) - j])

    @rule(blocks=blocks_st)
    def lookup(self, blocks: list[tuple[int, int]]) -> None:
        path = match_full(self.root, raw(blocks), len(blocks), STEP)
        assert sum(b - a for _, a, b in path) == self._longest(blocks)
        assert len(path) == len({id(r) for r, _, _ in path})  # each run once

    def _path(self, run: Run) -> tuple[tuple[int, int], ...]:
        out: list[tuple[int, int]] = []
        chain = []
        r: Run | None = run
        while r is not None and r.parent is not None:
            chain.append(r)
            r = r.parent
        for r in reversed(chain):
            toks = array("I", r.live_tkey(STEP)).tolist()
            out += [(toks[i], toks[i + 1]) for i in range(0, len(toks), 2)]
        return tuple(out)

    @invariant()
    def tree_matches_model(self) -> None:
        if not hasattr(self, "root"):
            return
        seen: set[tuple[tuple[int, int], ...]] = set()
        for r in self.root.descendants():
            assert r.alive and r.keys, "an empty run stays in the tree"
            assert r.parent is not None and r.parent.children[r.ckey] is r
            assert r.ckey == r.live_tkey(STEP)[:STEP]
            assert all(s != NO_SLOT for s in r.slot[0]), "a slotless leaf tail was not pruned"
            path = self._path(r)
            base = len(path) - len(r.keys)
            seen.update(path[:i + 1] for i in range(base, len(path)))
        assert seen == self.present


TestRadix = RadixMachine.TestCase
TestRadix.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
