"""PlanView: the read-only view of a manager's tree and GPU pools that admission plans against.

Admission (:mod:`kvpool.core.plan`) decides what a batch reuses and needs without changing
anything; it reads the reuse trees, the sequence ids in use and the GPU slots' reference counts
and availability through this view, never through the manager, so the two modules do not import
each other and the manager carries no planning-only methods. The view holds the manager's own
containers (it copies nothing: a plan sees the state the call that asked for it starts from) and
offers only queries.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Protocol

from kvpool.config import CacheConfig
from kvpool.core.layout import Layout
from kvpool.core.radix import NO_SLOT, Run
from kvpool.hashing.keys import BlockHasher, BlockKey, cache_salt_id

Scope = tuple[int | None, str | None]
"""A reuse scope: (LoRA id, cache salt)."""


class Sized(Protocol):
    """A pool's eviction queue as the view sees it: how many slots it holds."""

    def __len__(self) -> int: ...


class PlanView:
    """What admission may read of one manager (see the module docstring)."""

    __slots__ = ("_free", "_queued", "_refs", "_root_keys", "config", "layout", "roots",
                 "sequences")

    def __init__(self, config: CacheConfig, layout: Layout, roots: Mapping[Scope, Run],
                 sequences: Container[int | str], refs: Sequence[Sequence[int]],
                 free: Sequence[Sized], queued: Sequence[Sized]) -> None:
        self.config = config
        self.layout = layout  # the manager's (kvpool.core.layout)
        self.roots = roots
        self.sequences = sequences
        self._refs = refs
        self._free = free
        self._queued = queued
        self._root_keys: dict[Scope, BlockKey] = {}

    def root_key(self, lora_id: int | None, cache_salt: str | None) -> BlockKey:
        """The root key of a reuse scope (cached: v2 roots are a sha256 each)."""
        scope = (lora_id, cache_salt)
        key = self._root_keys.get(scope)
        if key is None:
            salt = cache_salt_id(cache_salt) if cache_salt is not None else None
            key = BlockHasher.root_key(self.config.hash_algo, lora_id=lora_id, salt_id=salt)
            self._root_keys[scope] = key
        return key

    def refs(self, g: int) -> Sequence[int]:
        """Reference counts of layer group g's GPU slots."""
        return self._refs[g]

    def available(self, g: int) -> int:
        """Free plus evictable GPU slots of layer group g."""
        return len(self._free[g]) + len(self._queued[g])

    def evictable(self, run: Run, i: int, g: int) -> bool:
        """Does block i of ``run`` hold a queued (cached, unreferenced) GPU slot in group g?"""
        s = run.slot[g][i]
        return s != NO_SLOT and run.tier[g][i] == 0 and self._refs[g][s] == 0

    def unreferenced_on_gpu(self, run: Run, i: int) -> bool:
        """Does block i of ``run`` hold an unreferenced GPU slot in every self-attention group?"""
        return all(self.evictable(run, i, g) for g in self.layout.self_groups)
