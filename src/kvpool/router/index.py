"""The router's index: which worker holds which block, on which tier (ARCHITECTURE §5).

The index applies KV cache events (:mod:`kvpool.events.model`) from many workers and answers
one question fast: for a block hash, which workers hold it, and at which tiers.

Modules
-------
The index is :class:`KvIndex` here (workers, event validation and dispatch, what the router
reads) over :class:`~kvpool.router.counts.BlockCounts` (the presence masks and every worker's
reference counts, compact or expanded: the layout is described there), with a worker's state in
:mod:`kvpool.router.worker`, the reorder ledger in :mod:`kvpool.router.ledger` and the token
chain with the engine hash -> token key maps in :mod:`kvpool.router.token_keys`.

Event semantics (the "event-implied set")
-----------------------------------------
* ``Stored``: +1 reference per block at its ``cache_level``.
* ``Removed``: with ``cache_levels`` (vLLM's medium, kvpool's manager), -1 reference at that
  tier; without (TensorRT-LLM), -1 reference at every tier that holds the hash.
* ``Updated`` with a cache-level diff: one reference moves from the old tier to the new one.
  Priority-only updates change nothing the router uses.
* ``AllCleared``: the worker holds nothing. A second ``Created`` for the same layer group and
  attention-DP rank means the engine restarted: the worker is reset.
* Order. Reference counts are sums of +1/-1 steps, so any arrival order gives the same counts
  except where a count would drop below zero. A step that takes a reference from a tier that
  holds none is an anomaly (counted) and is resolved by event id: per worker and attention-DP
  rank the index tracks which event ids it has not seen yet (*holes*, within a window of
  :data:`HOLE_WINDOW` events). If the step arrived after an event with a larger id, or ids
  below its own are missing, it is part of a reordering: it is kept, in a small per-entry
  ledger evaluated in event-id order, and the late store cancels it. Otherwise it refers to
  history from before the index's view (a router that joined late) and is ignored, so it can
  never swallow a later store. The result: tier moves and tiered removals that overtake the
  stores and moves they follow produce exactly the index the in-order stream produces. A
  removal without tiers acts on the tiers held when it arrives; a removal of a block held
  nowhere is an ignored anomaly.
* A malformed event (bad hash, tier out of range, unknown algorithm, wrong type) is counted and
  skipped whole: validation happens before any state changes.

Hash algorithms and tokens per block are configured per worker or learned from its events
(``hash_algo`` of each event; the longest block of its stored events). Workers can instead be
matched by their tokens (``match_by_tokens``): the index recomputes its own xxh3 chain over the
token ids that stored events carry and maps the engine's hashes onto it, so engines whose hash
the router cannot reproduce (vLLM's pickle-based hashes, per-process seeds) are routable.

The index is not thread-safe: one thread (the service's event loop) owns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvpool.errors import (
    DuplicateWorkerError,
    InvalidArgumentError,
    UnknownHashAlgorithmError,
    UnknownWorkerError,
)
from kvpool.events.keyed import (
    KeyedEvent,
    RemovedKeys,
    StoredKeys,
    StoredTokens,
    normalize_hash,
    normalize_hashes,
)
from kvpool.events.model import (
    AllCleared,
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
from kvpool.router.counts import M64, BlockCounts
from kvpool.router.ledger import HOLE_WINDOW, MAX_LEDGER, EventStream
from kvpool.router.token_keys import (
    block_chain_keys,
    chain,
    chain_get,
    chain_start,
    token_chain_keys,
    token_chain_root,
)
from kvpool.router.worker import (
    TIERS,
    GroupKey,
    IndexCounters,
    Malformed,
    Skipped,
    WorkerInfo,
    WorkerState,
    check_tpb,
    group_key,
    hash_scheme,
    info_of,
)

__all__ = [
    "HOLE_WINDOW",
    "MAX_LEDGER",
    "TIERS",
    "GroupKey",
    "IndexCounters",
    "KvIndex",
    "WorkerInfo",
    "hash_scheme",
    "normalize_hash",
    "token_chain_keys",
    "token_chain_root",
]

ResetListener = Callable[[str, int, bool], None]
"""Called with (worker id, slot, removed) when a worker's blocks are dropped: reset, all
cleared, or removal (then the slot may be reused by the next worker registered)."""


class KvIndex(BlockCounts):
    """Per-worker, per-tier, reference-counted block hashes of many workers.

    Invariant (kept by :class:`BlockCounts`): for every hash ``h``, bit ``tier * stride +
    slot`` of ``masks[h]`` is set exactly when the worker in ``slot`` has a positive reference
    count for ``h`` on ``tier`` in some layer group; hashes with no bit set are absent from
    ``masks``.
    """

    __slots__ = ("_deferred", "_groups_cache", "_listeners", "_slots", "_workers")

    def __init__(self) -> None:
        super().__init__()
        self._workers: dict[str, WorkerState] = {}
        self._slots: list[WorkerState | None] = []
        self._stride = 64
        self._groups_cache: dict[GroupKey, int] | None = None
        self._listeners: list[ResetListener] = []
        self._deferred: list[tuple[str, int, bool]] | None = None

    # ---------------------------------------------------------------------------------------
    # workers

    def add_worker(
        self,
        worker_id: str,
        *,
        hash_algo: HashAlgo | str | None = None,
        tokens_per_block: int | None = None,
        match_by_tokens: bool = False,
    ) -> None:
        """Register a worker. ``hash_algo`` / ``tokens_per_block`` given here are authoritative;
        left as None they are learned from the worker's events.

        Raises :class:`DuplicateWorkerError`, :class:`UnknownHashAlgorithmError` or
        :class:`InvalidArgumentError` before registering anything.
        """
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidArgumentError(f"worker id must be a non-empty str, got {worker_id!r}")
        if worker_id in self._workers:
            raise DuplicateWorkerError(f"worker {worker_id!r} is already registered")
        algo = parse_hash_algo(hash_algo) if hash_algo is not None else None
        check_tpb(tokens_per_block)
        slot = next((i for i, w in enumerate(self._slots) if w is None), len(self._slots))
        if slot >= self._stride:
            self._grow()
        w = WorkerState(
            worker_id=worker_id,
            slot=slot,
            algo=algo,
            algo_configured=algo is not None,
            tpb=tokens_per_block,
            tpb_configured=tokens_per_block is not None,
            match_by_tokens=bool(match_by_tokens),
        )
        if slot == len(self._slots):
            self._slots.append(w)
        else:
            self._slots[slot] = w
        self._workers[worker_id] = w
        self._groups_cache = None

    def configure_worker(
        self,
        worker_id: str,
        *,
        hash_algo: HashAlgo | str | None = None,
        tokens_per_block: int | None = None,
    ) -> None:
        """Fix a worker's algorithm and/or tokens per block (e.g. from its ``/server_info``)."""
        w = self._worker(worker_id)
        algo = parse_hash_algo(hash_algo) if hash_algo is not None else None
        check_tpb(tokens_per_block)
        if algo is not None:
            w.algo, w.algo_configured = algo, True
        if tokens_per_block is not None:
            w.tpb, w.tpb_configured = tokens_per_block, True
        self._groups_cache = None

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it held."""
        w = self._worker(worker_id)
        self._drop_blocks(w)
        del self._workers[worker_id]
        self._slots[w.slot] = None
        self._groups_cache = None
        self._notify(worker_id, w.slot, True)

    def reset_worker(self, worker_id: str) -> None:
        """Drop every block of a worker (its publisher restarted); keep its configuration."""
        w = self._worker(worker_id)
        self._reset(w)

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        """Mark a worker (un)healthy; the router never routes to unhealthy workers."""
        self._worker(worker_id).healthy = bool(healthy)

    def is_healthy(self, worker_id: str) -> bool:
        return self._worker(worker_id).healthy

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    @property
    def worker_ids(self) -> list[str]:
        """Registered workers, in registration order."""
        return list(self._workers)

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(worker_id, slot, removed)`` whenever a worker's blocks are dropped."""
        self._listeners.append(listener)

    def defer_resets(self) -> None:
        """Until :meth:`flush_resets`, the reset listeners are called later, in order: the
        index itself changes at once, the listeners' own state (the router's predictions and
        loads) not while a route runs in another thread."""
        if self._deferred is None:
            self._deferred = []

    def flush_resets(self) -> None:
        """Call the listeners deferred since :meth:`defer_resets`, and stop deferring."""
        deferred, self._deferred = self._deferred, None
        for worker_id, slot, removed in deferred or ():
            self._notify(worker_id, slot, removed)

    def _notify(self, worker_id: str, slot: int, removed: bool) -> None:
        if self._deferred is not None:
            self._deferred.append((worker_id, slot, removed))
            return
        for listener in self._listeners:
            listener(worker_id, slot, removed)

    # ---------------------------------------------------------------------------------------
    # what the router reads

    @property
    def stride(self) -> int:
        """Bits per tier in a presence mask (a multiple of 8, at least the number of slots)."""
        return self._stride

    def slot_of(self, worker_id: str) -> int:
        return self._worker(worker_id).slot

    def worker_at(self, slot: int) -> str | None:
        w = self._slots[slot] if 0 <= slot < len(self._slots) else None
        return w.worker_id if w is not None else None

    def hash_algo_of(self, worker_id: str) -> HashAlgo | None:
        return self._worker(worker_id).algo

    def tokens_per_block_of(self, worker_id: str) -> int | None:
        return self._worker(worker_id).tpb

    def group_of(self, worker_id: str) -> GroupKey | None:
        """The worker's hashing group, or None while its algorithm or tpb is unknown."""
        return group_key(self._worker(worker_id))

    def groups(self) -> dict[GroupKey, int]:
        """Hashing groups -> mask of their workers' slots (workers with a known group only)."""
        cache = self._groups_cache
        if cache is None:
            cache = {}
            for w in self._workers.values():
                key = group_key(w)
                if key is not None:
                    cache[key] = cache.get(key, 0) | (1 << w.slot)
            self._groups_cache = cache
        return cache

    def healthy_mask(self) -> int:
        """Slots of the healthy workers."""
        m = 0
        for w in self._workers.values():
            if w.healthy:
                m |= 1 << w.slot
        return m

    def healthy_workers(self) -> list[tuple[str, int]]:
        """(worker id, slot) of the healthy workers, in registration order."""
        return [(w.worker_id, w.slot) for w in self._workers.values() if w.healthy]

    def tiers_of(self, worker_id: str, block_hash: object) -> tuple[int, ...]:
        """Tiers on which the worker holds ``block_hash`` (an event hash; normalized here)."""
        w = self._worker(worker_id)
        m = self.masks.get(normalize_hash(block_hash), 0)
        s = self._stride
        return tuple(t for t in range(TIERS) if (m >> (t * s + w.slot)) & 1)

    def snapshot(self, worker_id: str) -> dict[int, frozenset[int]]:
        """Tier -> normalized hashes the worker holds there (any layer group). For tests and
        debugging: O(blocks of the index) for a compact worker."""
        w = self._worker(worker_id)
        out: dict[int, frozenset[int]] = {}
        for t in range(TIERS):
            if w.compact:
                shift = t * self._stride + w.slot
                out[t] = frozenset([h for h, m in self.masks.items() if (m >> shift) & 1])
                continue
            keys: set[int] = set()
            for tiers in w.groups.values():
                keys.update(tiers[t])
            out[t] = frozenset(keys)
        return out


    def worker_info(self, worker_id: str) -> WorkerInfo:
        return info_of(self._worker(worker_id))

    def workers(self) -> list[WorkerInfo]:
        return [self.worker_info(wid) for wid in self._workers]

    # ---------------------------------------------------------------------------------------
    # applying events

    def apply(self, worker_id: str, event: KeyedEvent) -> bool:
        """Apply one event of ``worker_id``. Returns False when the event was malformed
        (counted, nothing changed). Raises only :class:`UnknownWorkerError`."""
        w = self._worker(worker_id)
        if not self._apply(w, event):
            return False
        w.last_event_at = time.monotonic()
        return True

    def apply_many(self, worker_id: str, events: Iterable[KeyedEvent]) -> int:
        """Apply events in order; returns how many were applied (malformed ones are skipped).

        Events may be :class:`~kvpool.events.model.KVCacheEvent` objects or, from the wire
        decoders' keyed paths, :class:`~kvpool.events.keyed.StoredKeys` /
        :class:`~kvpool.events.keyed.RemovedKeys` records: both mean the same to the index.
        """
        w = self._worker(worker_id)
        apply = self._apply
        n = 0
        for ev in events:
            n += apply(w, ev)
        if n:
            w.last_event_at = time.monotonic()
        return n

    def uses_tokens(self, worker_id: str) -> bool:
        """True when the worker's stored events must carry their token ids (``match_by_tokens``):
        keyed records carry none."""
        return self._worker(worker_id).match_by_tokens

    def learns_block_size(self, worker_id: str) -> bool:
        """True when the worker's tokens per block are learned from its stored events."""
        return not self._worker(worker_id).tpb_configured

    def note_malformed(self, worker_id: str, count: int = 1) -> None:
        """Count events of ``worker_id`` that could not even be decoded."""
        w = self._worker(worker_id)
        w.counters.events_malformed += count
        self.counters.events_malformed += count

    def _apply(self, w: WorkerState, ev: KeyedEvent) -> bool:
        try:
            if (type(ev) is not StoredKeys and type(ev) is not RemovedKeys
                    and type(ev) is not StoredTokens and not isinstance(ev, KVCacheEvent)):
                raise Malformed(f"not a KVCacheEvent: {type(ev).__name__}")
            eid = ev.event_id
            group = ev.layer_group_id
            if type(eid) is not int or type(group) is not int or group < 0:
                raise Malformed("event_id and layer_group_id must be ints")
            rank = ev.attention_dp_rank
            stream = w.streams.get(rank)
            if stream is None:
                stream = w.streams[rank] = EventStream()
            # Steps of an event that arrives after a later one cannot be history (see _release).
            top = stream.top
            w.arrived_late = eid < top
            # Seen even if malformed: its id arrived and will not arrive again.
            if eid == top + 1 and not stream.holes:  # the next id, nothing missing: the usual
                stream.top = eid
                closed = False
            else:
                closed = stream.see(eid)
            learned: HashAlgo | None = None
            if not w.algo_configured and (w.algo is None or ev.hash_algo != w.algo):
                try:
                    learned = parse_hash_algo(ev.hash_algo)
                except UnknownHashAlgorithmError as exc:
                    raise Malformed(str(exc)) from None
            if type(ev) is StoredKeys:
                if ev.keys:
                    self._apply_stored_keys(w, group, eid, rank, ev)
            elif type(ev) is StoredTokens:
                if ev.keys:
                    self._apply_stored_tokens(w, group, eid, rank, ev)
            elif type(ev) is RemovedKeys:
                if w.match_by_tokens:  # engine hashes: mapped onto the index's keys first
                    self._remove_mapped(w, group, eid, rank, ev.keys, ev.cache_level, None)
                else:
                    self._remove(w, group, eid, rank, ev.keys, ev.cache_level, None)
            else:
                data = ev.data
                if type(data) is Stored:
                    self._apply_stored(w, group, eid, rank, data)
                elif type(data) is Removed:
                    self._apply_removed(w, group, eid, rank, data)
                elif type(data) is Updated:
                    self._apply_updated(w, group, eid, rank, data)
                elif type(data) is AllCleared:
                    self._drop_blocks(w)
                    self._notify(w.worker_id, w.slot, False)
                elif type(data) is Created:
                    self._apply_created(w, group, eid, rank, data)
                else:
                    raise Malformed(f"unknown event data {type(data).__name__}")
        except Malformed:
            w.counters.events_malformed += 1
            self.counters.events_malformed += 1
            return False
        except Skipped:
            w.counters.anomalies += 1
            self.counters.anomalies += 1
        if closed and w.ledger:
            self._settle(w)
        if learned is not None and learned is not w.algo:
            w.algo = learned
            self._groups_cache = None
        w.counters.events_applied += 1
        self.counters.events_applied += 1
        w.last_event_id = eid  # the callers stamp last_event_at (once per batch)
        return True

    def _apply_created(
        self, w: WorkerState, group: int, eid: int, rank: int | None, data: Created
    ) -> None:
        levels = data.num_blocks_per_cache_level
        if not all(type(n) is int and n >= 0 for n in levels):
            raise Malformed("num_blocks_per_cache_level must be non-negative ints")
        key = (group, rank)
        if key in w.created_seen:
            # The same pools announced twice: the engine restarted without us seeing a gap.
            self._reset(w)
            w.streams[rank] = EventStream()
            w.streams[rank].see(eid)
        w.created_seen.add(key)
        w.capacity[group] = tuple(levels)

    def _apply_stored(
        self, w: WorkerState, group: int, eid: int, rank: int | None, data: Stored
    ) -> None:
        blocks = data.blocks
        if not blocks:
            return
        try:
            raw = [b.block_hash for b in blocks]
            levels = [b.cache_level for b in blocks]
        except AttributeError as exc:
            raise Malformed(str(exc)) from None
        try:
            keys = normalize_hashes(raw)
        except ValueError as exc:
            raise Malformed(str(exc)) from None
        level: int | None = 0
        if any(levels):
            if not all(type(t) is int and 0 <= t < TIERS for t in levels):
                raise Malformed(f"cache levels {levels!r} out of range")
            level = levels[0]
            if levels.count(level) != len(levels):
                level = None  # mixed tiers: block by block
        if w.match_by_tokens:
            start = chain_start(w, data.parent_hash, blocks[0].lora_id)
            keys = block_chain_keys(w, start, blocks, keys)
        if not w.tpb_configured:
            self._learn_tpb(w, len(blocks[0].tokens))
        self._store(w, group, eid, rank, keys, level, levels)

    def _apply_stored_keys(
        self, w: WorkerState, group: int, eid: int, rank: int | None, ev: StoredKeys
    ) -> None:
        keys = ev.keys
        if w.match_by_tokens:
            # Records carry no tokens: only blocks the index already keyed can be re-announced.
            blocks = tuple([StoredBlock(k, (), ev.cache_level) for k in keys])
            self._apply_stored(w, group, eid, rank, Stored(None, blocks))
            return
        if not w.tpb_configured:
            self._learn_tpb(w, ev.block_tokens)
        self._store(w, group, eid, rank, keys, ev.cache_level, None)

    def _apply_stored_tokens(
        self, w: WorkerState, group: int, eid: int, rank: int | None, ev: StoredTokens
    ) -> None:
        keys = ev.keys
        if w.match_by_tokens:
            start = chain_start(w, ev.parent, ev.lora_id)
            engine, keys = keys, chain(ev.tokens, ev.block_size, start)
            w.chain.update(zip(engine, keys, strict=True))
        self._learn_tpb(w, min(ev.block_size, len(ev.tokens) // 4))
        self._store(w, group, eid, rank, keys, ev.cache_level, None)

    def _learn_tpb(self, w: WorkerState, block_tokens: int) -> None:
        """A chain's first block holds ``block_tokens`` tokens (its longest: only a chain's
        last block may be partial)."""
        if not w.tpb_configured and block_tokens > (w.tpb or 0):
            w.tpb = block_tokens
            self._groups_cache = None

    def _resolve(self, w: WorkerState, raw_hash: object) -> int | None:
        """Event hash -> index key (None when a token-matched worker never stored it)."""
        try:
            h = raw_hash & M64 if type(raw_hash) is int else normalize_hash(raw_hash)
        except ValueError as exc:
            raise Malformed(str(exc)) from None
        if w.match_by_tokens:
            return chain_get(w, h)
        return h

    def _apply_removed(
        self, w: WorkerState, group: int, eid: int, rank: int | None, data: Removed
    ) -> None:
        levels = data.cache_levels
        hashes = data.block_hashes
        level: int | None = None
        if levels is not None:
            if len(levels) != len(hashes):
                raise Malformed("cache_levels and block_hashes differ in length")
            level = 0
            if any(levels):
                if not all(type(t) is int and 0 <= t < TIERS for t in levels):
                    raise Malformed(f"cache_levels {levels!r} out of range")
                level = levels[0]
                if levels.count(level) != len(levels):
                    level = None  # mixed tiers: block by block
        try:
            keys = normalize_hashes(hashes)
        except ValueError as exc:
            raise Malformed(str(exc)) from None
        if w.match_by_tokens:
            self._remove_mapped(w, group, eid, rank, keys, level, levels)
        else:
            self._remove(w, group, eid, rank, keys, level, levels)

    def _apply_updated(
        self, w: WorkerState, group: int, eid: int, rank: int | None, data: Updated
    ) -> None:
        diff = data.cache_level
        if diff is None:
            return  # priority-only: nothing the router scores on
        if type(diff) is not EventDiff:
            raise Malformed("cache_level must be an event diff")
        old, new = diff.old_value, diff.new_value
        if not (type(old) is int and type(new) is int and 0 <= old < TIERS and 0 <= new < TIERS):
            raise Malformed(f"cache level diff {old!r} -> {new!r} out of range")
        key = self._resolve(w, data.block_hash)
        if key is None:
            raise Skipped("tier move of a block the index cannot map")
        if old == new:
            return
        self._release(w, group, eid, rank, key, old)
        self._store(w, group, eid, rank, [key], new, None)
        # _store counted a stored block; a move is not a store.
        w.counters.blocks_stored -= 1
        self.counters.blocks_stored -= 1
        w.counters.blocks_moved += 1
        self.counters.blocks_moved += 1

    # ---------------------------------------------------------------------------------------
    # internals

    def _worker(self, worker_id: str) -> WorkerState:
        w = self._workers.get(worker_id)
        if w is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        return w

    def _reset(self, w: WorkerState) -> None:
        self._drop_blocks(w)
        if not w.tpb_configured:  # a restarted engine may use another block size: relearned
            w.tpb = None
            self._groups_cache = None
        w.streams.clear()
        w.created_seen.clear()
        w.capacity.clear()
        w.counters.resets += 1
        self.counters.resets += 1
        self._notify(w.worker_id, w.slot, False)
