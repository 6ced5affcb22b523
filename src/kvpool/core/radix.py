"""The prefix tree, compressed into runs: a run is a stretch of blocks no request branched in.

```
root(scope) ── [K0 K1 K2] ─┬─ [K3 K4]          K = chained block key (tokens + every token before)
                           ├─ [K3' K4' K5']    children hang off a run's last block
                           └─ (K3'')           a partial (short) block: a run of its own, a leaf
```

Block i of a run is the child of block i-1; block 0 is the child of the parent run's last block
(a scope's root is a run of no blocks). So a tree of runs is exactly the tree of blocks it
compresses, and every rule about blocks still holds: keys are unique among siblings (so in the
tree, since keys chain); a block with a child is a full block.

Per block a run keeps its key, its slot and tier per layer group (parallel lists, ``NO_SLOT``
where a group holds nothing: a sliding window released it, or an ancestor's eviction dropped
it) and, when a retention policy set one, its priority and duration. Its tokens are one bytes
string (native uint32s), so matching a request compares a whole run at once and a run costs
one Python object however many blocks it holds. (After a truncation that string may still
hold the dropped blocks' bytes past the live ones, until ``live_tkey`` cuts them.)

Children are indexed by their first block's bytes (``ckey``): under one parent (one chain, one
scope) equal tokens mean an equal key, so looking a block up by its bytes costs a dict probe
where its key would cost a hash-chain step. Keys are computed once, when a block enters the
tree.

A block with no slot in any group and no child leaves the tree (``prune`` truncates a leaf
run's slotless tail, and detaches a run left with no block); slotless blocks with children
stay as path blocks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from types import MappingProxyType
from typing import Final, NewType, cast

from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey

SlotId = NewType("SlotId", int)
"""A slot number in one (tier, layer group) pool: an index into that pool's arrays."""
NO_SLOT: Final = SlotId(-1)
"""A block table's or a run's entry for a block without a slot in that layer group."""
_U32 = struct.Struct("=I")  # one token as the tree stores it (native uint32, like array("I"))
_NO_CHILDREN = cast("dict[bytes, Run]", MappingProxyType({}))


def first_token(tkey: bytes) -> int:
    """The first token of a block's bytes."""
    first: int = _U32.unpack_from(tkey)[0]
    return first


class Run:
    """A chain of cached blocks (or path blocks that lost their slots).

    ``slot[g][i]`` / ``tier[g][i]``: block i's slot and tier in layer group g. ``prio`` and
    ``dur`` are None while every block has the default priority and no duration.
    """

    __slots__ = (
        "alive", "by_first", "children", "ckey", "dur", "keys", "parent", "prio", "slot",
        "tier", "tkey",
    )

    def __init__(self, parent: Run | None, tkey: bytes, ckey: bytes, keys: list[BlockKey],
                 slot: list[list[SlotId]], tier: list[list[int]]) -> None:
        self.parent = parent
        self.tkey = tkey
        self.ckey = ckey  # the first block's bytes: what the parent indexes this run by
        self.keys = keys
        self.slot = slot
        self.tier = tier
        self.prio: list[int] | None = None
        self.dur: list[float | None] | None = None
        # a shared read-only empty mapping until the first child arrives (``add_child``)
        self.children: dict[bytes, Run] = _NO_CHILDREN
        # first token -> children starting with it; built lazily for partial matching
        self.by_first: dict[int, list[Run]] | None = None
        self.alive = True

    @classmethod
    def root(cls, groups: int) -> Run:
        return cls(None, b"", b"", [], [[] for _ in range(groups)], [[] for _ in range(groups)])

    def __repr__(self) -> str:
        return f"Run(blocks={len(self.keys)}, slot={self.slot}, tier={self.tier})"

    @property
    def first_token(self) -> int:
        """The run's first token (a root has none: ``struct.error``)."""
        return first_token(self.ckey)

    def priority(self, i: int) -> int:
        prios = self.prio
        return DEFAULT_PRIORITY if prios is None else prios[i]

    def duration(self, i: int) -> float | None:
        durations = self.dur
        return None if durations is None else durations[i]

    def block_tokens(self, i: int, step: int) -> bytes:
        """Block i's tokens as native uint32 bytes (``step`` bytes per full block)."""
        return self.tkey[i * step:(i + 1) * step]

    def has_slot(self, i: int) -> bool:
        """Does block i hold a slot in any layer group?"""
        for sl in self.slot:  # noqa: SIM110 (CPython costs: docs/architecture.md §3.10)
            if sl[i] != NO_SLOT:
                return True
        return False

    def set_retention(self, i: int, priority: int, duration: float | None) -> None:
        if priority == DEFAULT_PRIORITY and duration is None and self.prio is None:
            return
        n = len(self.keys)
        if self.prio is None:
            self.prio = [DEFAULT_PRIORITY] * n
            self.dur = [None] * n
        assert self.dur is not None
        self.prio[i] = priority
        self.dur[i] = duration

    def extend(self, tkey: bytes, keys: list[BlockKey], slot: list[list[SlotId]],
               tier: list[list[int]], step: int) -> None:
        """Append blocks (the run must be a leaf of full blocks)."""
        self.tkey = self.live_tkey(step) + tkey
        self.keys += keys
        for g, sl in enumerate(slot):
            self.slot[g] += sl
            self.tier[g] += tier[g]
        if self.prio is not None:
            assert self.dur is not None
            self.prio += [DEFAULT_PRIORITY] * len(keys)
            self.dur += [None] * len(keys)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` blocks. Their token bytes are cut lazily (``live_tkey``):
        evictions take a run's tail one block at a time, and cutting a long run's bytes for
        each would copy them again and again."""
        del self.keys[n:]
        for sl in self.slot:
            del sl[n:]
        for tl in self.tier:
            del tl[n:]
        if self.prio is not None:
            assert self.dur is not None
            del self.prio[n:]
            del self.dur[n:]

    def live_tkey(self, step: int) -> bytes:
        """The tokens of the run's blocks (``tkey`` may still hold truncated blocks' bytes
        past them; this cuts them off, once)."""
        t = self.tkey
        n = len(self.keys) * step
        if len(t) > n and len(self.ckey) == step:  # a partial block is never cut short
            t = self.tkey = t[:n]
        return t

    def split(self, m: int, step: int) -> Run:
        """Cut after block ``m`` - 1 (0 < m < blocks): the tail becomes this run's only child
        and takes its children. Returns the tail (its blocks' indices start at 0 again)."""
        tail = Run(self, self.tkey[m * step:len(self.keys) * step],
                   self.tkey[m * step:(m + 1) * step],
                   self.keys[m:], [sl[m:] for sl in self.slot], [tl[m:] for tl in self.tier])
        if self.prio is not None:
            assert self.dur is not None
            tail.prio, tail.dur = self.prio[m:], self.dur[m:]
        tail.children, tail.by_first = self.children, self.by_first
        for c in tail.children.values():
            c.parent = tail
        self.truncate(m)
        self.tkey = self.tkey[:m * step]
        self.children = {tail.ckey: tail}
        self.by_first = None
        return tail

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def add_child(self, child: Run) -> None:
        if self.children is _NO_CHILDREN:
            self.children = {}
        self.children[child.ckey] = child
        if self.by_first is not None and child.ckey:
            self.by_first.setdefault(child.first_token, []).append(child)

    def remove_child(self, child: Run) -> None:
        del self.children[child.ckey]
        if self.by_first is not None and child.ckey:
            first = child.first_token
            bucket = self.by_first[first]
            bucket.remove(child)
            if not bucket:
                del self.by_first[first]

    def children_starting_with(self, token: int) -> list[Run]:
        if self.by_first is None:
            index: dict[int, list[Run]] = {}
            for c in self.children.values():
                if c.ckey:
                    index.setdefault(c.first_token, []).append(c)
            self.by_first = index
        return self.by_first.get(token, [])

    def descendants(self) -> Iterator[Run]:
        """Every run below this one (depth first)."""
        stack = list(self.children.values())
        while stack:
            r = stack.pop()
            yield r
            stack.extend(r.children.values())


Segment = tuple[Run, int, int]
"""Blocks [start, stop) of a run: a piece of a matched path."""


def match_full(root: Run, raw: bytes, nblocks: int, step: int) -> list[Segment]:
    """The longest path of whole blocks from ``root`` whose tokens equal ``raw``'s first
    blocks (at most ``nblocks``), as segments in block order."""
    out: list[Segment] = []
    run = root
    off = 0
    end = nblocks * step
    while off < end:
        child = run.children.get(raw[off:off + step])
        if child is None:
            break
        tkey = child.live_tkey(step)
        n = len(tkey)
        if off + n <= end and raw[off:off + n] == tkey:
            out.append((child, 0, n // step))
            off += n
            run = child
            continue
        m = 1  # the first block matched (it is the child's index key)
        limit = min(n, end - off) // step
        while m < limit and raw[off + m * step:off + (m + 1) * step] == child.block_tokens(m, step):
            m += 1
        out.append((child, 0, m))
        break
    return out


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in tokens (4 bytes each) of the common prefix of two token byte strings."""
    n = min(len(a), len(b)) // 4
    if a[:4 * n] == b[:4 * n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi] (in tokens)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:4 * mid] == b[:4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def detach(run: Run) -> None:
    """Remove ``run`` (which lost every block) from its parent; a parent left a childless
    non-root run is pruned in turn (:func:`prune`)."""
    parent = run.parent
    assert parent is not None
    parent.remove_child(run)
    run.alive = False
    if not parent.children and parent.parent is not None:
        prune(parent)


def prune(run: Run | None) -> None:
    """Drop slotless blocks that have no child, from ``run``'s tail upwards.

    A leaf run's trailing blocks without a slot in any group are truncated; a run left with no
    block is detached and its parent examined next. Roots are never detached.
    """
    while run is not None and run.alive and run.parent is not None and not run.children:
        keep = len(run.keys)
        slot = run.slot
        while keep and not any(sl[keep - 1] != NO_SLOT for sl in slot):
            keep -= 1
        if keep:
            if keep < len(run.keys):
                run.truncate(keep)
            return
        parent = run.parent
        parent.remove_child(run)
        run.alive = False
        run = parent
