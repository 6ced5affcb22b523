"""The event manager: the block manager's hooks become batched KV cache events (ARCHITECTURE §4).

The block manager calls one hook per change of what it caches (``on_created``, ``on_stored``,
``on_removed``, ``on_updated``, ``on_all_cleared``); the engine calls
:meth:`EventManager.flush_iteration_events` once per scheduler step, which publishes the step's
events into a bounded buffer that :meth:`EventManager.get_latest_events` drains.

Batching and ordering rules (each one is tested):

* **Removals batch per layer group.** Removed hashes of one group accumulate and leave as ONE
  removed event: before that group's next stored event, before any event of another type
  (created, updated, all-cleared: every group's batch is flushed then) and at flush. A batch
  never mixes layer groups. The batch takes its event id when it is flushed, so ids stay in
  emission order.
* **Chains coalesce.** A stored event whose parent is the tail of the group's still-open stored
  event (the group's latest event in this step) extends it instead of starting a new event, so
  a committed chain is one event however many calls built it.
* **Only announced blocks.** The manager keeps a registry of the (layer group, hash) pairs it
  announced as stored, with their tier. Removed and updated hooks for unannounced blocks emit
  nothing; a removed block is unannounced afterwards. A stored hook for a block already
  announced emits nothing for it (the chain is split around it; a different tier becomes an
  updated event), so consumers never see a hash stored twice.
* **Tier moves are updated events** (cache level diff, old value taken from the registry).
* **Bounded buffer.** Past ``max_entries`` published-but-unread events the oldest are dropped,
  counted in :attr:`EventManager.dropped_events` and logged as a warning.
* **Event ids** increase by one per emitted event, from 0.
* **Attention data parallelism.** Each rank passes its flushed events (at most ``max_entries``)
  to ``attention_dp_gather``, which returns every rank's list on rank 0 and None elsewhere. Only
  rank 0 publishes; its buffer holds ``max_entries * attention_dp_size`` events.

Thread safety: hooks, flush and reads may come from different threads. Hooks and flush share
one lock; readers wait on a second one, so a blocked reader never stalls the block manager.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import attrgetter

from kvpool.errors import InvalidArgumentError
from kvpool.events.model import (
    AllCleared,
    BlockHash,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.hashing.keys import HashAlgo
from kvpool.hashing.keys import hash_algo as parse_hash_algo
from kvpool.validation import check_int

__all__ = ["AttentionDpGather", "EventManager"]

logger = logging.getLogger(__name__)

_CACHE_LEVEL = attrgetter("cache_level")

AttentionDpGather = Callable[[list[KVCacheEvent]], list[list[KVCacheEvent]] | None]
"""Collective over attention-DP ranks: every rank's list on rank 0, None on the others."""


class _OpenStored:
    """A stored event of this step that later calls may still extend (mutable until flush)."""

    __slots__ = ("blocks", "event_id", "layer_group", "parent_hash", "window_size")

    def __init__(
        self,
        event_id: int,
        layer_group: int,
        window_size: int,
        parent_hash: BlockHash | None,
        blocks: list[StoredBlock],
    ) -> None:
        self.event_id = event_id
        self.layer_group = layer_group
        self.window_size = window_size
        self.parent_hash = parent_hash
        self.blocks = blocks


class _PendingRemoved:
    """Removed hashes of one layer group waiting to leave as one event."""

    __slots__ = ("block_hashes", "cache_levels", "window_size")

    def __init__(self, window_size: int) -> None:
        self.window_size = window_size
        self.block_hashes: list[BlockHash] = []
        self.cache_levels: list[int] = []


class EventManager:
    """Batches the block manager's cache changes into KV cache events.

    Args:
        max_entries: capacity of the published-event buffer (>= 1); rank 0 of an attention-DP
            group holds ``max_entries * attention_dp_size``.
        hash_algo: the algorithm of the hashes the hooks pass (stamped on every event).
        attention_dp_rank: this rank, or None without attention data parallelism.
        attention_dp_gather: the gather collective (required when ``attention_dp_size > 1``).
        attention_dp_size: number of attention-DP ranks.

    Raises:
        InvalidArgumentError: a bad size, rank, or a missing gather callable.
        UnknownHashAlgorithmError: ``hash_algo`` is not a :class:`HashAlgo`.
    """

    def __init__(
        self,
        max_entries: int,
        hash_algo: HashAlgo | str = HashAlgo.V2_SHA256,
        attention_dp_rank: int | None = None,
        attention_dp_gather: AttentionDpGather | None = None,
        attention_dp_size: int = 1,
    ) -> None:
        check_int("max_entries", max_entries, 1)
        check_int("attention_dp_size", attention_dp_size, 1)
        if attention_dp_rank is None:
            if attention_dp_size != 1 or attention_dp_gather is not None:
                raise InvalidArgumentError(
                    "attention_dp_size/attention_dp_gather need attention_dp_rank; got rank None "
                    f"with size {attention_dp_size}"
                )
        elif not 0 <= attention_dp_rank < attention_dp_size:
            raise InvalidArgumentError(
                f"attention_dp_rank must be in [0, {attention_dp_size}), got {attention_dp_rank!r}"
            )
        elif attention_dp_size > 1 and attention_dp_gather is None:
            raise InvalidArgumentError(
                f"attention_dp_size {attention_dp_size} > 1 needs an attention_dp_gather callable"
            )
        self._algo = str(parse_hash_algo(hash_algo))
        self._max_entries = max_entries
        self._rank = attention_dp_rank
        self._gather = attention_dp_gather
        self._dp_size = attention_dp_size
        self._capacity = max_entries * attention_dp_size if attention_dp_rank == 0 else max_entries

        # Hook-side state, under _lock.
        self._lock = threading.Lock()
        self._announced: dict[int, dict[BlockHash, int]] = {}  # group -> {hash: tier}
        self._pending: list[KVCacheEvent | _OpenStored] = []
        self._removed: dict[int, _PendingRemoved] = {}  # insertion order = flush order
        self._open: dict[int, _OpenStored] = {}  # group -> its extendable stored event
        self._windows: dict[int, int] = {}
        self._next_id = 0

        # Reader-side state, under _cond. _flush_lock keeps concurrent flushes in order.
        self._flush_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._published: deque[KVCacheEvent] = deque(maxlen=self._capacity)
        self._dropped = 0

    # ---------------------------------------------------------------------------- properties

    @property
    def hash_algo(self) -> str:
        """The algorithm name stamped on every event."""
        return self._algo

    @property
    def capacity(self) -> int:
        """How many published events the buffer holds before dropping the oldest."""
        return self._capacity

    @property
    def dropped_events(self) -> int:
        """Events dropped so far because the buffer (or a rank's gather share) was full."""
        with self._cond:
            return self._dropped

    @property
    def next_event_id(self) -> int:
        """The id the next emitted event will take."""
        with self._lock:
            return self._next_id

    @property
    def num_pending(self) -> int:
        """Events of the current step not yet flushed (a pending removal batch counts as one)."""
        with self._lock:
            return len(self._pending) + len(self._removed)

    @property
    def num_published(self) -> int:
        """Events published and not yet read by :meth:`get_latest_events`."""
        with self._cond:
            return len(self._published)

    def announced_tier(self, layer_group: int, block_hash: BlockHash) -> int | None:
        """The tier a block was last announced on, or None when it is not announced."""
        with self._lock:
            group = self._announced.get(layer_group)
            return None if group is None else group.get(block_hash)

    def announced_blocks(self) -> frozenset[tuple[BlockHash, int, int]]:
        """Every announced (hash, layer group, tier): what a consumer of all events will hold."""
        with self._lock:
            return frozenset(
                (h, g, tier) for g, blocks in self._announced.items() for h, tier in blocks.items()
            )

    # ---------------------------------------------------------------------------------- hooks

    def on_created(
        self, layer_group: int, window_size: int, num_blocks_per_cache_level: Sequence[int]
    ) -> None:
        """A layer group's pools came up with these slots per tier (tier 0 first)."""
        _check_group(layer_group, window_size)
        levels = tuple(num_blocks_per_cache_level)
        if not levels or any(not isinstance(n, int) or n < 0 for n in levels):
            raise InvalidArgumentError(
                f"num_blocks_per_cache_level must be non-negative ints, got {levels!r}"
            )
        with self._lock:
            self._windows[layer_group] = window_size
            self._flush_all_removed()
            self._append(Created(levels), layer_group, window_size)

    def on_stored(
        self,
        layer_group: int,
        window_size: int,
        parent_hash: BlockHash | None,
        blocks: Sequence[StoredBlock],
    ) -> None:
        """A chain of blocks entered the cache, parent first; ``parent_hash`` precedes blocks[0].

        Blocks already announced in this group are skipped (the chain is split around them);
        one announced on another tier becomes an updated event.
        """
        if not blocks:
            return
        if layer_group < 0 or window_size < 0:
            _check_group(layer_group, window_size)
        with self._lock:
            self._windows[layer_group] = window_size
            registry = self._announced.get(layer_group)
            if registry is None:
                registry = self._announced[layer_group] = {}
            hashes = [b.block_hash for b in blocks]
            if registry.keys().isdisjoint(hashes):
                # The common case, checked in C: no block announced yet. The registry grows by
                # one entry per block unless the chain repeats a hash (then undone, below).
                before = len(registry)
                registry.update(zip(hashes, map(_CACHE_LEVEL, blocks), strict=True))
                if len(registry) - before == len(hashes):
                    self._emit_stored(layer_group, window_size, parent_hash, list(blocks))
                    return
                for h in hashes:
                    registry.pop(h, None)
            run: list[StoredBlock] = []
            run_parent = parent_hash
            for block in blocks:
                h = block.block_hash
                tier = registry.get(h)
                if tier is None:
                    registry[h] = block.cache_level
                    run.append(block)
                    continue
                if run:
                    self._emit_stored(layer_group, window_size, run_parent, run)
                    run = []
                if tier != block.cache_level:
                    registry[h] = block.cache_level
                    self._flush_all_removed()
                    diff = EventDiff(old_value=tier, new_value=block.cache_level)
                    self._append(Updated(h, cache_level=diff), layer_group, window_size)
                run_parent = h
            if run:
                self._emit_stored(layer_group, window_size, run_parent, run)

    def on_removed(
        self, layer_group: int, window_size: int, block_hashes: Sequence[BlockHash]
    ) -> None:
        """Blocks left the cache (every tier). Unannounced hashes are ignored."""
        if layer_group < 0 or window_size < 0:
            _check_group(layer_group, window_size)
        with self._lock:
            registry = self._announced.get(layer_group)
            if not registry:
                return
            before = len(registry)
            tiers = list(map(registry.pop, block_hashes, repeat(None)))
            if before - len(registry) != len(tiers):  # skip the unannounced (or repeated) ones
                kept = [(h, t) for h, t in zip(block_hashes, tiers, strict=True) if t is not None]
                if not kept:
                    return
                block_hashes = [h for h, _ in kept]
                tiers = [t for _, t in kept]
            elif not tiers:
                return
            batch = self._removed.get(layer_group)
            if batch is None:
                batch = self._removed[layer_group] = _PendingRemoved(window_size)
            batch.window_size = window_size
            batch.block_hashes.extend(block_hashes)
            batch.cache_levels.extend(tiers)  # type: ignore[arg-type]

    def on_updated(
        self,
        layer_group: int,
        window_size: int,
        block_hash: BlockHash,
        *,
        cache_level: EventDiff | None = None,
        priority: EventDiff | None = None,
    ) -> None:
        """An announced block changed tier and/or priority; anything else emits nothing.

        The cache-level diff's old value is the registry's (the tier consumers know); a "move"
        to the tier the block is already on is not an event.
        """
        if cache_level is None and priority is None:
            return
        _check_group(layer_group, window_size)
        if cache_level is not None and cache_level.new_value < 0:
            raise InvalidArgumentError(f"cache level must be >= 0, got {cache_level.new_value}")
        with self._lock:
            registry = self._announced.get(layer_group)
            tier = None if registry is None else registry.get(block_hash)
            if registry is None or tier is None:
                return
            if cache_level is not None:
                if cache_level.new_value == tier:
                    cache_level = None
                else:
                    registry[block_hash] = cache_level.new_value
                    if cache_level.old_value != tier:
                        cache_level = EventDiff(old_value=tier, new_value=cache_level.new_value)
            if cache_level is None and priority is None:
                return
            self._windows[layer_group] = window_size
            self._flush_all_removed()
            self._append(Updated(block_hash, cache_level, priority), layer_group, window_size)

    def on_all_cleared(self) -> None:
        """Every block left the cache: one all-cleared event (layer group 0); nothing announced."""
        with self._lock:
            self._flush_all_removed()
            self._append(AllCleared(), 0, self._windows.get(0, 0))
            self._announced.clear()

    # ------------------------------------------------------------------------ flush and read

    def flush_iteration_events(self) -> None:
        """Publish the step's events (pending removals included) into the read buffer.

        With attention DP every rank must call this each step (the gather is a collective);
        only rank 0's buffer receives events.
        """
        with self._flush_lock:
            with self._lock:
                self._flush_all_removed()
                pending, self._pending = self._pending, []
                self._open.clear()
            events = [self._materialize(p) for p in pending]
            if self._gather is not None:
                local_dropped = max(0, len(events) - self._max_entries)
                if local_dropped:
                    events = events[local_dropped:]
                    self._count_dropped(local_dropped, self._max_entries)
                gathered = self._gather(events)
                if self._rank != 0:
                    return
                if gathered is None:
                    raise InvalidArgumentError(
                        "attention_dp_gather returned None on rank 0; it must return every "
                        "rank's event list there"
                    )
                events = [event for rank_events in gathered for event in rank_events]
            if not events:
                return
            with self._cond:
                overflow = len(self._published) + len(events) - self._capacity
                # The deque's maxlen drops the oldest; only the count and warning are ours.
                self._published.extend(events)
                self._cond.notify_all()
            if overflow > 0:
                self._count_dropped(overflow, self._capacity)

    def get_latest_events(self, timeout_s: float | None = None) -> list[KVCacheEvent]:
        """Take every published event, oldest first.

        ``timeout_s`` None blocks until an event is there; > 0 waits up to that many seconds;
        <= 0 returns at once. Returns an empty list when nothing arrived in time. Attention-DP
        ranks other than 0 never publish: read rank 0 (None would wait forever elsewhere).
        """
        with self._cond:
            if not self._published and (timeout_s is None or timeout_s > 0):
                self._cond.wait_for(lambda: bool(self._published), timeout_s)
            events = list(self._published)
            self._published.clear()
        return events

    # ------------------------------------------------------------------------------ internal

    def _append(
        self, data: Created | Updated | AllCleared | Removed, group: int, window: int
    ) -> None:
        """Emit a finished event (caller holds _lock)."""
        self._pending.append(
            KVCacheEvent(
                event_id=self._next_id,
                data=data,
                window_size=window,
                layer_group_id=group,
                hash_algo=self._algo,
                attention_dp_rank=self._rank,
            )
        )
        self._next_id += 1
        # Any other event of the group closes its stored event; an all-cleared closes them all.
        if type(data) is AllCleared:
            self._open.clear()
        else:
            self._open.pop(group, None)

    def _emit_stored(
        self, group: int, window: int, parent: BlockHash | None, run: list[StoredBlock]
    ) -> None:
        """Emit or extend a stored event for a run of new blocks (caller holds _lock)."""
        batch = self._removed.pop(group, None)
        if batch is not None:
            self._append_removed(group, batch)
        current = self._open.get(group)
        if (
            current is not None
            and current.window_size == window
            and parent is not None
            and current.blocks[-1].block_hash == parent
        ):
            current.blocks.extend(run)
            return
        opened = _OpenStored(self._next_id, group, window, parent, run)
        self._next_id += 1
        self._pending.append(opened)
        self._open[group] = opened

    def _append_removed(self, group: int, batch: _PendingRemoved) -> None:
        removed = Removed(tuple(batch.block_hashes), tuple(batch.cache_levels))
        self._append(removed, group, batch.window_size)

    def _flush_all_removed(self) -> None:
        if self._removed:
            batches, self._removed = self._removed, {}
            for group, batch in batches.items():
                self._append_removed(group, batch)

    def _materialize(self, item: KVCacheEvent | _OpenStored) -> KVCacheEvent:
        if type(item) is KVCacheEvent:
            return item
        assert isinstance(item, _OpenStored)
        return KVCacheEvent(
            event_id=item.event_id,
            data=Stored(item.parent_hash, tuple(item.blocks)),
            window_size=item.window_size,
            layer_group_id=item.layer_group,
            hash_algo=self._algo,
            attention_dp_rank=self._rank,
        )

    def _count_dropped(self, n: int, capacity: int) -> None:
        with self._cond:
            self._dropped += n
            total = self._dropped
        logger.warning(
            "KV event buffer full (%d entries): dropped the %d oldest events (%d dropped in total)",
            capacity,
            n,
            total,
        )


def _check_group(layer_group: int, window_size: int) -> None:
    if layer_group < 0 or window_size < 0:
        raise InvalidArgumentError(
            f"layer_group and window_size must be >= 0, got {layer_group!r} and {window_size!r}"
        )
