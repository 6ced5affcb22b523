"""The reference consumer of a KV event stream: what an engine holds, rebuilt from its events.

:class:`EventIndex` applies events in order and keeps the set of (event hash, layer group, tier)
the producer holds. The completeness invariant (ARCHITECTURE §4) says that, applied to every
event a kvpool manager flushed, it equals the manager's cached set after every flush.

Semantics, per event type:

* stored: each block enters (hash, group, its cache level);
* removed: without ``cache_levels`` the hashes leave every tier of the group (TensorRT-LLM);
  with them, each hash leaves the tier given next to it (vLLM's per-medium removal);
* updated with a cache-level diff: the block moves from the old tier to the new one;
* all-cleared: everything leaves, every group;
* created: records the group's slots per tier and window size.

vLLM does not de-duplicate (a hash can be stored twice and removed twice), so holdings are
reference counted. A lenient index (the default) counts events that refer to blocks it does
not hold in :attr:`EventIndex.anomalies` and ignores them; a strict one raises
:class:`~kvpool.errors.EventStreamError` on those and on a second store of a held block.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.errors import EventStreamError
from kvpool.events.model import (
    AllCleared,
    BlockHash,
    Created,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
)

__all__ = ["EventIndex"]


class EventIndex:
    """The (hash, layer group, tier) holdings a stream of :class:`KVCacheEvent` describes."""

    __slots__ = (
        "_held",
        "anomalies",
        "created",
        "events_applied",
        "id_gaps",
        "last_event_id",
        "strict",
        "window_sizes",
    )

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        # (group, hash) -> {tier: reference count}
        self._held: dict[tuple[int, BlockHash], dict[int, int]] = {}
        self.created: dict[int, tuple[int, ...]] = {}
        self.window_sizes: dict[int, int] = {}
        self.anomalies = 0
        self.events_applied = 0
        self.id_gaps = 0
        self.last_event_id: dict[int | None, int] = {}  # per attention-DP rank

    # --------------------------------------------------------------------------------- reads

    @property
    def cached(self) -> frozenset[tuple[BlockHash, int, int]]:
        """Every held (event hash, layer group, tier)."""
        return frozenset((h, g, tier) for (g, h), tiers in self._held.items() for tier in tiers)

    def tiers_of(self, block_hash: BlockHash, layer_group: int = 0) -> frozenset[int]:
        """The tiers holding a block (empty when it is not held)."""
        return frozenset(self._held.get((layer_group, block_hash), ()))

    def __len__(self) -> int:
        return sum(len(tiers) for tiers in self._held.values())

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, tuple) or len(item) != 3:
            return False
        h, g, tier = item
        return tier in self._held.get((g, h), ())

    # -------------------------------------------------------------------------------- writes

    def apply_all(self, events: Iterable[KVCacheEvent]) -> None:
        """Apply events in order."""
        for event in events:
            self.apply(event)

    def apply(self, event: KVCacheEvent) -> None:
        """Apply one event. Strict mode raises EventStreamError before changing anything."""
        data = event.data
        group = event.layer_group_id
        if type(data) is Stored:
            self._stored(group, data)
        elif type(data) is Removed:
            self._removed(group, data)
        elif type(data) is Updated:
            self._updated(group, data)
        elif type(data) is AllCleared:
            self._held.clear()
        elif type(data) is Created:
            self.created[group] = data.num_blocks_per_cache_level
        self.window_sizes.setdefault(group, event.window_size)
        last = self.last_event_id.get(event.attention_dp_rank)
        if last is not None and event.event_id != last + 1:
            self.id_gaps += 1
        self.last_event_id[event.attention_dp_rank] = event.event_id
        self.events_applied += 1

    def _anomaly(self, message: str) -> None:
        if self.strict:
            raise EventStreamError(message)
        self.anomalies += 1

    def _stored(self, group: int, data: Stored) -> None:
        held = self._held
        if self.strict:
            seen: set[tuple[BlockHash, int]] = set()
            for block in data.blocks:
                key = (block.block_hash, block.cache_level)
                tiers = held.get((group, block.block_hash))
                if key in seen or (tiers is not None and block.cache_level in tiers):
                    raise EventStreamError(
                        f"block {block.block_hash!r} stored again on tier {block.cache_level} "
                        f"of layer group {group}"
                    )
                seen.add(key)
        for block in data.blocks:
            tiers = held.get((group, block.block_hash))
            if tiers is None:
                held[(group, block.block_hash)] = {block.cache_level: 1}
            else:
                tiers[block.cache_level] = tiers.get(block.cache_level, 0) + 1

    def _removed(self, group: int, data: Removed) -> None:
        held = self._held
        levels = data.cache_levels
        if levels is None:
            if self.strict:
                missing = [h for h in data.block_hashes if (group, h) not in held]
                if missing:
                    raise EventStreamError(
                        f"removed blocks {missing!r} of layer group {group} are not held"
                    )
            for h in data.block_hashes:
                if held.pop((group, h), None) is None:
                    self.anomalies += 1
            return
        if len(levels) != len(data.block_hashes):
            raise EventStreamError(
                f"removed event has {len(data.block_hashes)} hashes but {len(levels)} levels"
            )
        if self.strict:
            for h, tier in zip(data.block_hashes, levels, strict=True):
                if tier not in held.get((group, h), ()):
                    raise EventStreamError(
                        f"removed block {h!r} is not held on tier {tier} of layer group {group}"
                    )
        for h, tier in zip(data.block_hashes, levels, strict=True):
            self._release(group, h, tier)

    def _release(self, group: int, h: BlockHash, tier: int) -> bool:
        tiers = self._held.get((group, h))
        count = None if tiers is None else tiers.get(tier)
        if tiers is None or count is None:
            self.anomalies += 1
            return False
        if count > 1:
            tiers[tier] = count - 1
        else:
            del tiers[tier]
            if not tiers:
                del self._held[(group, h)]
        return True

    def _updated(self, group: int, data: Updated) -> None:
        h = data.block_hash
        tiers = self._held.get((group, h))
        diff = data.cache_level
        if diff is None:
            if tiers is None:
                self._anomaly(f"updated block {h!r} of layer group {group} is not held")
            return
        if tiers is None or diff.old_value not in tiers:
            self._anomaly(
                f"updated block {h!r} of layer group {group} is not held on tier {diff.old_value}"
            )
            return
        if self.strict and diff.new_value in tiers and diff.new_value != diff.old_value:
            raise EventStreamError(
                f"updated block {h!r} of layer group {group} is already on tier {diff.new_value}"
            )
        self._release(group, h, diff.old_value)
        tiers = self._held.setdefault((group, h), {})
        tiers[diff.new_value] = tiers.get(diff.new_value, 0) + 1
