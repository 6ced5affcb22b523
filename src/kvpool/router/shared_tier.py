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
from collections.abc import Iterable
from typing import Any, Final

from kvpool.errors import InvalidArgumentError
from kvpool.events.keyed import (
    KeyedEvent,
    RemovedKeys,
    StoredKeys,
    StoredTokens,
    normalize_hash,
    normalize_hashes,
)
from kvpool.events.model import REMOTE_CACHE_LEVEL, KVCacheEvent, Removed, Stored, Updated
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

    def split(self, worker_id: str, events: list[Any]) -> list[Any]:
        """The batch the index should apply: ``events`` with their level-3 blocks taken into
        the worker's tier (see the module docstring). Returns ``events`` itself when none of
        them names level 3 (the usual batch: one pass of type tests)."""
        remote = REMOTE_CACHE_LEVEL
        for ev in events:
            t = type(ev)
            if t is StoredKeys or t is RemovedKeys or t is StoredTokens:  # the decoders' records
                if ev.cache_level == remote:
                    break
            elif t is KVCacheEvent and _remote(ev):
                break
        else:
            return events
        return [self._take(worker_id, ev) if _remote(ev) else ev for ev in events]

    def _take(self, worker_id: str, ev: Any) -> KeyedEvent:
        """One event that names level 3: its remote part applied here, what the index still
        needs returned (same id)."""
        tier = self._tier_of.get(worker_id)
        t = type(ev)
        if t is StoredKeys or t is StoredTokens:
            self._add(tier, ev.keys)
            return _nothing(ev)
        if t is RemovedKeys:
            self._drop(tier, ev.keys)
            return _nothing(ev)
        data = ev.data
        if type(data) is Stored:
            remote = [b for b in data.blocks if b.cache_level == REMOTE_CACHE_LEVEL]
            local = tuple(b for b in data.blocks if b.cache_level != REMOTE_CACHE_LEVEL)
            self._add(tier, _keys(b.block_hash for b in remote))
            if not local:
                return _nothing(ev)
            return _replace(ev, Stored(data.parent_hash, local))
        if type(data) is Removed:
            assert data.cache_levels is not None  # _remote
            pairs = list(zip(data.block_hashes, data.cache_levels, strict=True))
            self._drop(tier, _keys(h for h, lv in pairs if lv == REMOTE_CACHE_LEVEL))
            kept = [(h, lv) for h, lv in pairs if lv != REMOTE_CACHE_LEVEL]
            if not kept:
                return _nothing(ev)
            return _replace(ev, Removed(tuple(h for h, _ in kept), tuple(lv for _, lv in kept)))
        assert type(data) is Updated and data.cache_level is not None  # _remote
        diff = data.cache_level
        key = _keys([data.block_hash])
        self._add(tier, key)  # both ways the store has it: prefetched back, or written out
        if diff.old_value == REMOTE_CACHE_LEVEL and diff.new_value != REMOTE_CACHE_LEVEL:
            return StoredKeys(ev.event_id, key, diff.new_value, ev.layer_group_id,
                              ev.hash_algo, ev.attention_dp_rank)
        if diff.new_value == REMOTE_CACHE_LEVEL and diff.old_value != REMOTE_CACHE_LEVEL:
            return RemovedKeys(ev.event_id, key, diff.old_value, ev.layer_group_id,
                               ev.hash_algo, ev.attention_dp_rank)
        return _nothing(ev)

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


def _remote(ev: object) -> bool:
    """True when an event names the remote level (:data:`REMOTE_CACHE_LEVEL`)."""
    t = type(ev)
    if t is StoredKeys or t is StoredTokens or t is RemovedKeys:
        return ev.cache_level == REMOTE_CACHE_LEVEL  # type: ignore[attr-defined, no-any-return]
    if t is not KVCacheEvent:
        return False
    data = ev.data  # type: ignore[attr-defined]
    td = type(data)
    if td is Stored:
        return any(b.cache_level == REMOTE_CACHE_LEVEL for b in data.blocks)
    if td is Removed:
        return data.cache_levels is not None and REMOTE_CACHE_LEVEL in data.cache_levels
    if td is Updated:
        d = data.cache_level
        return d is not None and REMOTE_CACHE_LEVEL in (d.old_value, d.new_value)
    return False


def _keys(hashes: Iterable[Any]) -> list[int]:
    """Normalized keys of event hashes (those that do not normalize are left out: the index
    would have rejected their event)."""
    raw = list(hashes)
    try:
        return normalize_hashes(raw)
    except ValueError:
        out: list[int] = []
        for h in raw:
            try:
                out.append(normalize_hash(h))
            except ValueError:
                continue
        return out


def _nothing(ev: Any) -> StoredKeys:
    """An event with no block for the index, with ``ev``'s id (the index sees no gap)."""
    return StoredKeys(ev.event_id, [], 0, ev.layer_group_id, ev.hash_algo, ev.attention_dp_rank)


def _replace(ev: KVCacheEvent, data: Stored | Removed) -> KVCacheEvent:
    return KVCacheEvent(ev.event_id, data, ev.window_size, ev.layer_group_id, ev.hash_algo,
                        ev.attention_dp_rank)
