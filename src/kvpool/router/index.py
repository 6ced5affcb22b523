"""The router's index: which worker holds which block, on which tier (ARCHITECTURE §5).

The index applies KV cache events from many workers and answers one question fast: for a block
hash, which workers hold it, and at which tiers. It applies one record type,
:class:`~kvpool.events.keyed.KeyedEvent`, into which every source converts its events once, where
they enter (:mod:`kvpool.router.ingest`: the wire decoders' keyed paths read records straight
from the wire; an in-process source's :class:`~kvpool.events.model.KVCacheEvent` is converted by
:func:`~kvpool.events.keyed.keyed`, here too when it is handed to :meth:`KvIndex.apply`).

Modules
-------
The index is :class:`KvIndex` here (workers, event order and dispatch, what the router reads)
over :class:`~kvpool.router.counts.BlockCounts` (the presence masks and every worker's
reference counts, compact or expanded: the layout is described there), with a worker's state in
:mod:`kvpool.router.worker`, the reorder ledger in :mod:`kvpool.router.ledger` and the token
chain with the engine hash -> token key maps in :mod:`kvpool.router.token_keys`.

Event semantics (the "event-implied set")
-----------------------------------------
* Stored: +1 reference per block at its cache level.
* Removed: with tiers (vLLM's medium, kvpool's manager), -1 reference at that tier; without
  (TensorRT-LLM), -1 reference at every tier that holds the hash.
* Moved (an update with a cache-level diff): one reference moves from the old tier to the new
  one. Priority-only updates change nothing the router uses (their records hold no block).
* Cleared: the worker holds nothing. A second Created for the same layer group and
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
* A malformed event (bad hash, tier out of range, unknown algorithm, wrong type: a
  :data:`~kvpool.events.keyed.MALFORMED` record, or one naming a tier the index does not track)
  is counted and skipped whole: it is found malformed before any state changes (its id counts
  as seen). An event both malformed and an anomaly is malformed.

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
    CLEARED,
    CREATED,
    MOVED,
    REMOVED,
    STORED,
    KeyedEvent,
    keyed,
    normalize_hash,
)
from kvpool.events.model import KVCacheEvent
from kvpool.hashing.keys import HashAlgo
from kvpool.hashing.keys import hash_algo as parse_hash_algo
from kvpool.router.counts import BlockCounts
from kvpool.router.ledger import HOLE_WINDOW, MAX_LEDGER, EventStream
from kvpool.router.token_keys import (
    chain_get,
    chain_start,
    record_chain_keys,
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

    def apply(self, worker_id: str, event: KeyedEvent | KVCacheEvent) -> bool:
        """Apply one event of ``worker_id``. Returns False when the event was malformed
        (counted, nothing changed). Raises only :class:`UnknownWorkerError`.

        The index applies :class:`~kvpool.events.keyed.KeyedEvent` records; anything else
        (an in-process source's :class:`~kvpool.events.model.KVCacheEvent`) is converted first
        (:func:`~kvpool.events.keyed.keyed`, with the tokens a token-matched worker needs)."""
        w = self._worker(worker_id)
        if not self._apply(w, event):
            return False
        w.last_event_at = time.monotonic()
        return True

    def apply_many(self, worker_id: str, events: Iterable[KeyedEvent | KVCacheEvent]) -> int:
        """Apply events in order (as :meth:`apply`); returns how many were applied (malformed
        ones are skipped)."""
        w = self._worker(worker_id)
        apply = self._apply
        n = 0
        for ev in events:
            n += apply(w, ev)
        if n:
            w.last_event_at = time.monotonic()
        return n

    def uses_tokens(self, worker_id: str) -> bool:
        """True when the worker's stored records must carry their token ids
        (``match_by_tokens``: :func:`~kvpool.events.keyed.keyed` with ``tokens=True``)."""
        return self._worker(worker_id).match_by_tokens

    def learns_block_size(self, worker_id: str) -> bool:
        """True when the worker's tokens per block are learned from its stored events."""
        return not self._worker(worker_id).tpb_configured

    def note_malformed(self, worker_id: str, count: int = 1) -> None:
        """Count events of ``worker_id`` that could not even be decoded."""
        w = self._worker(worker_id)
        w.counters.events_malformed += count
        self.counters.events_malformed += count

    def _apply(self, w: WorkerState, ev: KeyedEvent | KVCacheEvent) -> bool:
        if type(ev) is not KeyedEvent:
            ev = keyed(ev, w.match_by_tokens)
        try:
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
            op = ev.op
            if op == STORED:
                if ev.keys:
                    self._apply_stored(w, group, eid, rank, ev)
            elif op == REMOVED:
                level, levels = ev.cache_level, ev.levels
                if level is None or level >= TIERS:
                    _check_tiers(level, levels)
                if w.match_by_tokens:  # engine hashes: mapped onto the index's keys first
                    self._remove_mapped(w, group, eid, rank, ev.keys, level, levels)
                else:
                    self._remove(w, group, eid, rank, ev.keys, level, levels)
            elif op == MOVED:
                self._apply_moved(w, group, eid, rank, ev)
            elif op == CLEARED:
                self._drop_blocks(w)
                self._notify(w.worker_id, w.slot, False)
            elif op == CREATED:
                self._apply_created(w, group, eid, rank, ev.capacity)
            else:
                raise Malformed(f"event {eid} is malformed")
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
        self, w: WorkerState, group: int, eid: int, rank: int | None, capacity: tuple[int, ...]
    ) -> None:
        key = (group, rank)
        if key in w.created_seen:
            # The same pools announced twice: the engine restarted without us seeing a gap.
            self._reset(w)
            w.streams[rank] = EventStream()
            w.streams[rank].see(eid)
        w.created_seen.add(key)
        w.capacity[group] = capacity

    def _apply_stored(
        self, w: WorkerState, group: int, eid: int, rank: int | None, ev: KeyedEvent
    ) -> None:
        level, levels = ev.cache_level, ev.levels
        if level is None or level >= TIERS:
            _check_tiers(level, levels)
        keys = ev.keys
        if w.match_by_tokens:  # engine hashes: the index keys the blocks by their tokens
            start = chain_start(w, ev.parent, ev.lora_id)
            keys = record_chain_keys(w, start, keys, ev.tokens)
        if not w.tpb_configured and ev.block_tokens > (w.tpb or 0):
            # A chain's first block is its longest (only a chain's last may be partial).
            w.tpb = ev.block_tokens
            self._groups_cache = None
        self._store(w, group, eid, rank, keys, level, levels)

    def _apply_moved(
        self, w: WorkerState, group: int, eid: int, rank: int | None, ev: KeyedEvent
    ) -> None:
        old, new = ev.from_level, ev.cache_level
        if new is None or not (0 <= old < TIERS and 0 <= new < TIERS):
            raise Malformed(f"cache level move {old!r} -> {new!r} out of range")
        key = ev.keys[0]
        if w.match_by_tokens:
            mapped = chain_get(w, key)
            if mapped is None:
                raise Skipped("tier move of a block the index cannot map")
            key = mapped
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


def _check_tiers(level: int | None, levels: list[int] | None) -> None:
    """A stored or removed record must name tiers the index tracks (the remote level is the
    shared tier's: :mod:`kvpool.router.shared_tier`)."""
    if (level is not None and level >= TIERS) or (levels is not None and max(levels) >= TIERS):
        raise Malformed(f"cache level {level if levels is None else levels!r} out of range")
