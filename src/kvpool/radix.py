"""The prefix tree: one node per block key, each holding at most one slot per layer group.

```
root(scope) ── K0 ── K1 ── K2          K = chained block key (tokens + every token before)
                 │      └── K2'        a partial (short) block is always a leaf
                 └── K1'
```

Children are indexed by their tokens' bytes: under one parent (one chain, one scope) equal
tokens mean an equal key, and looking a block up by its bytes costs a dict probe where its
key would cost a hash-chain step. Keys are computed once, when a block enters the tree.

A node may hold a slot in some layer groups and not in others (a sliding-window group drops
blocks that left its window; a full-attention group drops a block's descendants with it). A
node with no slot left and no child leaves the tree (``prune``). Invariants: keys are unique
among siblings (so in the tree, since keys chain); a non-leaf node is a full block.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from types import MappingProxyType
from typing import cast

from kvpool.hashing import BlockKey

NO_SLOT = -1
_U32 = struct.Struct("=I")  # one token as the tree stores it (native uint32, like array("I"))
_NO_SLOTS = array("i", [NO_SLOT])
_GPU_TIER = array("i", [0])
_NO_CHILDREN = cast("dict[bytes, Node]", MappingProxyType({}))


class Node:
    """One cached block (or a path node with no slot left).

    A node keeps its tokens as bytes (``tkey``, native uint32s: what its parent indexes it
    by); ``tokens`` decodes them when needed (partial matching, stored events).
    """

    __slots__ = (
        "alive", "by_first", "children", "duration", "key", "parent", "priority", "slot", "tier",
        "tkey",
    )

    def __init__(self, key: BlockKey, parent: Node | None, tkey: bytes, groups: int) -> None:
        self.key = key
        self.parent = parent
        self.tkey = tkey
        # a shared read-only empty mapping until the first child arrives (``add_child``)
        self.children: dict[bytes, Node] = _NO_CHILDREN
        # first token -> children starting with it; built lazily for partial matching
        self.by_first: dict[int, list[Node]] | None = None
        # slot and tier per layer group: arrays hold no references, so the garbage collector
        # does not track them (a node is one tracked object, not four)
        self.slot: array[int] = _NO_SLOTS * groups
        self.tier: array[int] = _GPU_TIER * groups
        self.priority = 35
        self.duration: float | None = None
        self.alive = True

    @property
    def tokens(self) -> array[int]:
        out = array("I")
        out.frombytes(self.tkey)
        return out

    @property
    def first_token(self) -> int:
        """The block's first token (a root has no tokens: ``struct.error``)."""
        first: int = _U32.unpack_from(self.tkey)[0]
        return first

    def __repr__(self) -> str:
        return f"Node(tokens={len(self.tkey) // 4}, slot={self.slot}, tier={self.tier})"

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def has_any_slot(self) -> bool:
        return max(self.slot) != NO_SLOT  # slots are >= NO_SLOT

    def add_child(self, child: Node) -> None:
        if self.children is _NO_CHILDREN:
            self.children = {}
        self.children[child.tkey] = child
        if self.by_first is not None and child.tkey:
            self.by_first.setdefault(child.first_token, []).append(child)

    def remove_child(self, child: Node) -> None:
        del self.children[child.tkey]
        if self.by_first is not None and child.tkey:
            first = child.first_token
            bucket = self.by_first[first]
            bucket.remove(child)
            if not bucket:
                del self.by_first[first]

    def children_starting_with(self, token: int) -> list[Node]:
        if self.by_first is None:
            index: dict[int, list[Node]] = {}
            for c in self.children.values():
                if c.tkey:
                    index.setdefault(c.first_token, []).append(c)
            self.by_first = index
        return self.by_first.get(token, [])

    def descendants(self) -> Iterator[Node]:
        """Every node below this one (depth first, children before grandchildren)."""
        stack = list(self.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def common_prefix(a: array[int], b: array[int]) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def best_partial_child(
    parent: Node, tokens: array[int], groups: tuple[int, ...]
) -> tuple[Node | None, int]:
    """The child sharing the longest token prefix with ``tokens`` that holds a slot in every
    group of ``groups``; returns (child, shared tokens) or (None, 0).
    """
    if not tokens:
        return None, 0
    best: Node | None = None
    best_k = 0
    for c in parent.children_starting_with(tokens[0]):
        if any(c.slot[g] == NO_SLOT for g in groups):
            continue
        k = common_prefix(c.tokens, tokens)
        if k > best_k:
            best, best_k = c, k
    return best, best_k


def prune(node: Node | None) -> list[Node]:
    """Detach ``node`` and then its ancestors while they hold no slot and no child.

    Roots (nodes without a parent) are never detached. Returns the detached nodes.
    """
    out: list[Node] = []
    while node is not None and node.alive:
        parent = node.parent
        if parent is None or node.children or max(node.slot) != NO_SLOT:
            break
        parent.remove_child(node)
        node.alive = False
        out.append(node)
        node = parent
    return out
