"""Blocks held in shared remote tiers, credited to every worker configured with the tier.

A remote tier (a Redis/Valkey store several engines read and write, :mod:`kvpool.tiers.remote`)
holds blocks under the same chained keys on every engine of one model, hash and block size:
a block one worker wrote there can be read by every other worker configured with that store.
Engines announce it on its own cache level, :data:`REMOTE_CACHE_LEVEL` (3: TensorRT-LLM's cache
level 3, vLLM's medium ``"REMOTE"``), below GPU (0), host (1) and disk (2).

:class:`SharedTiers` keeps, per named tier, the keys announced there by any worker, and the
slots of the workers configured with it (``shared_tier`` in the router configuration,
:meth:`~kvpool.router.scoring.Router.share_tier`). ``masks[key]`` is the slot mask of every
worker that can read the block from a tier holding it; the router's prefix walk reads it as a
fourth tier, and ``cost`` credits it at ``shared_tier_weight`` (see
:mod:`kvpool.router.scoring`).

What the index learns from the events (:meth:`SharedTiers.split`, called by the ingest before
the index sees a batch):

* a stored block on level 3 enters the tier of the worker that announced it (a worker with no
  shared tier configured: the block is ignored, counted in ``ignored_blocks``);
* a removal naming level 3 takes the keys out of that tier (a removal naming no level is a
  local eviction: the engines write a block to the remote tier after it leaves them);
* an update from level 3 to a local tier (a prefetch) keeps the key in the tier (the store
  keeps its copy) and tells the index the block is stored locally; an update from a local
  tier to level 3 removes it locally and adds it to the tier;
* the events' ids are kept (an event whose every block went to the tier reaches the index
  with no block), so the index sees no gap.

The store drops blocks on its own (its LRU, another engine, a restart) without any event: a
tier keeps at most ``max_blocks`` keys, the most recently announced (LRU by announcement),
and the lower weight prices what may be gone. A worker's reset (restart, all blocks cleared)
leaves the tier as it is: the store outlives the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import compress
from typing import Final

import msgspec

from kvpool.errors import InvalidArgumentError
from kvpool.events.keyed import MOVED, REMOVED, STORED, KeyedEvent, one_tier
from kvpool.events.model import REMOTE_CACHE_LEVEL
from kvpool.validation import check_int

__all__ = [
    "DEFAULT_SHARED_TIER_BLOCKS",
    "DEFAULT_SHARED_TIER_WEIGHT",
    "REMOTE_CACHE_LEVEL",
    "SharedTiers",
]

DEFAULT_SHARED_TIER_WEIGHT: Final = 0.3
"""``cost``/``approx``: what a matched token saves when only a shared remote tier holds it,
against 1 / 0.95 / 0.5 for GPU / host / disk. An 8B model's token of KV (128 KiB) takes about
10 µs on a 100 Gb/s link and 30-60 µs from one Redis server (2-4 GB/s to a client) against
about 40 µs to compute it; the engine prefetches it while the request waits in the queue, so
it saves some of the prefill, less than a local disk, and the store may have dropped it
without an event."""

DEFAULT_SHARED_TIER_BLOCKS: Final = 1 << 22
"""Keys a shared tier keeps at most (the most recently announced): 4 Mi blocks, 512 TiB of
KV at 128 KiB per token and 32 tokens per block, more than any one store holds."""


class SharedTiers:
    """The shared remote tiers of one router (see the module docstring)."""

    def __init__(self, max_blocks: int = DEFAULT_SHARED_TIER_BLOCKS) -> None:
        self.max_blocks = check_int("shared tier max_blocks", max_blocks, 1)
        self.masks: dict[int, int] = {}
        """key -> slots of the workers that can read it from a tier that holds it."""
        self.ignored_blocks = 0
        """Level-3 blocks announced by workers with no shared tier configured."""
        self._tier_of: dict[str, str] = {}  # worker id -> tier name
        self._slot_of: dict[str, int] = {}  # worker id -> its slot in the index
        self._members: dict[str, int] = {}  # tier name -> slot mask of its readers
        self._keys: dict[str, OrderedDict[int, None]] = {}  # tier -> keys, oldest first

    def __len__(self) -> int:
        """(tier, key) pairs held."""
        return sum(len(k) for k in self._keys.values())

    def tier_of(self, worker_id: str) -> str | None:
        return self._tier_of.get(worker_id)

    def blocks(self, tier: str) -> int:
        """Keys held in ``tier`` (0 for an unknown tier)."""
        keys = self._keys.get(tier)
        return 0 if keys is None else len(keys)

    def join(self, worker_id: str, slot: int, tier: str) -> None:
        """The worker in ``slot`` reads (and writes) the shared tier named ``tier``."""
        if not isinstance(tier, str) or not tier:
            raise InvalidArgumentError(f"shared tier name must be a non-empty str, got {tier!r}")
        self.leave(worker_id)
        self._tier_of[worker_id] = tier
        self._slot_of[worker_id] = slot
        self._members[tier] = self._members.get(tier, 0) | (1 << slot)
        self._keys.setdefault(tier, OrderedDict())
        self._rebuild(tier)

    def leave(self, worker_id: str) -> None:
        """The worker no longer reads a shared tier (removed); the tier's keys stay."""
        tier = self._tier_of.pop(worker_id, None)
        if tier is None:
            return
        slot = self._slot_of.pop(worker_id)
        self._members[tier] &= ~(1 << slot)
        self._rebuild(tier)

    # ------------------------------------------------------------------------------ events

    def split(self, worker_id: str, events: list[KeyedEvent]) -> list[KeyedEvent]:
        """The records the index should apply: ``events`` with their level-3 blocks taken into
        the worker's tier (see the module docstring). Returns ``events`` itself when none of
        them names level 3 (the usual batch: one pass of three reads per record)."""
        remote = REMOTE_CACHE_LEVEL
        for ev in events:
            if ev.cache_level == remote or ev.from_level == remote or ev.levels is not None:
                break
        else:
            return events
        return [self._take(worker_id, ev) if _remote(ev) else ev for ev in events]

    def _take(self, worker_id: str, ev: KeyedEvent) -> KeyedEvent:
        """One record that names level 3: its remote part applied here, what the index still
        needs returned (same id)."""
        tier = self._tier_of.get(worker_id)
        remote = REMOTE_CACHE_LEVEL
        if ev.op == MOVED:
            self._add(tier, ev.keys)  # both ways the store has it: prefetched back, or written out
            if ev.from_level == remote and ev.cache_level != remote:
                return msgspec.structs.replace(ev, op=STORED, from_level=0)
            if ev.cache_level == remote and ev.from_level != remote:
                return msgspec.structs.replace(ev, op=REMOVED, cache_level=ev.from_level,
                                               from_level=0)
            return _nothing(ev)
        take = self._add if ev.op == STORED else self._drop
        if ev.levels is None:  # every block on level 3
            take(tier, ev.keys)
            return _nothing(ev)
        local = [lv != remote for lv in ev.levels]
        take(tier, [k for k, kept in zip(ev.keys, local, strict=True) if not kept])
        return _kept(ev, local)

    def _add(self, tier: str | None, keys: list[int]) -> None:
        if tier is None:
            self.ignored_blocks += len(keys)
            return
        held = self._keys[tier]
        mask = self._members[tier]
        masks = self.masks
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
                masks[k] = masks.get(k, 0) | mask
        while len(held) > self.max_blocks:
            k, _ = held.popitem(last=False)
            self._unmask(k)

    def _drop(self, tier: str | None, keys: list[int]) -> None:
        if tier is None:
            return
        held = self._keys[tier]
        for k in keys:
            if k in held:
                del held[k]
                self._unmask(k)

    def _unmask(self, key: int) -> None:
        """A tier lost ``key``: its mask is what the tiers still holding it give."""
        mask = 0
        for tier, held in self._keys.items():
            if key in held:
                mask |= self._members[tier]
        if mask:
            self.masks[key] = mask
        else:
            self.masks.pop(key, None)

    def _rebuild(self, tier: str) -> None:
        """The tier's readers changed: every key it holds gets its mask again."""
        for k in self._keys.get(tier, ()):
            self._unmask(k)


def _remote(ev: KeyedEvent) -> bool:
    """True when a stored, removed or moved record names the remote level."""
    remote = REMOTE_CACHE_LEVEL
    if ev.op == MOVED:
        return remote in (ev.from_level, ev.cache_level)
    if ev.op != STORED and ev.op != REMOVED:
        return False
    return ev.cache_level == remote or (ev.levels is not None and remote in ev.levels)


def _nothing(ev: KeyedEvent) -> KeyedEvent:
    """A record with no block for the index, with ``ev``'s id (the index sees no gap)."""
    return KeyedEvent(ev.event_id, STORED, [], 0, ev.layer_group_id, ev.hash_algo,
                      ev.attention_dp_rank)


def _kept(ev: KeyedEvent, keep: list[bool]) -> KeyedEvent:
    """``ev`` with only the blocks ``keep`` marks (their tiers, their tokens); a stored chain's
    first block still tells the block size."""
    assert ev.levels is not None
    keys = list(compress(ev.keys, keep))
    if not keys:
        return _nothing(ev)
    level, levels = one_tier(list(compress(ev.levels, keep)))
    tokens = tuple(compress(ev.tokens, keep)) if ev.tokens else ()
    return msgspec.structs.replace(ev, keys=keys, cache_level=level, levels=levels,
                                   tokens=tokens)
