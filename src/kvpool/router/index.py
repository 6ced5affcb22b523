"""The router's index: which worker holds which block, on which tier (ARCHITECTURE §5).

The index applies KV cache events (:mod:`kvpool.events.model`) from many workers and answers
one question fast: for a block hash, which workers hold it, and at which tiers.

Layout
------
* One global dict maps a normalized block hash (an unsigned 64-bit int, see
  :func:`normalize_hash`) to a packed presence mask: bit ``tier * stride + slot`` is set when
  the worker in ``slot`` holds the hash on ``tier`` (0 = GPU, 1 = host, 2 = disk) in any of
  its layer groups. Walking a 256-block request over 32 workers is then 256 dict lookups and a
  few integer operations per block (:mod:`kvpool.router.scoring`).
* Reference counts per worker, layer group and tier: vLLM does not de-duplicate, so a hash
  stored twice is removed twice before it is gone. A worker with one layer group (the usual
  case) is *compact*: its presence bits in the global dict are its counts of one, and it keeps
  only the counts above one (per tier, usually empty). Applying a block event then touches one
  large dict instead of two, which halves its cost once the index outgrows the CPU caches.
  Dropping a compact worker's blocks (reset, all cleared, removal) scans the global dict
  instead of the worker's own. The first event of a second layer group expands the worker
  into per group, per tier dicts of counts.

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

import struct
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import compress, repeat, starmap
from operator import and_
from typing import Final, cast

import xxhash

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
    token_bytes,
)
from kvpool.events.model import (
    AllCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    TokenIds,
    Updated,
)
from kvpool.hashing import HashAlgo
from kvpool.hashing import hash_algo as parse_hash_algo

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

TIERS: Final = 3
"""Tiers the index tracks: 0 = GPU, 1 = host, 2 = disk."""

HOLE_WINDOW: Final = 256
"""Event ids missing for more than this many events are taken as lost, not late."""

MAX_LEDGER: Final = 1 << 16
"""Out-of-order ledger entries kept per worker before the oldest are settled as they stand.
Token-matched workers also remember their recently removed hash mappings: between
MAX_LEDGER and 2 * MAX_LEDGER of them (two generations, the older dropped whole)."""

_M64: Final = (1 << 64) - 1
_LATE_RELEASE: Final = -2
_XXH3: Final = xxhash.xxh3_64_intdigest
_LITTLE: Final = sys.byteorder == "little"

GroupKey = tuple[str, int]
"""How a worker's blocks are hashed: (scheme, tokens_per_block). Workers of one group share
the request's hashes. Schemes: ``v1``, ``v2`` (both v2 algorithms: the same digest),
``vllm`` and ``tokens`` (the index's own chain, for ``match_by_tokens`` workers)."""

_SCHEMES: Final = {
    HashAlgo.V1_BLOCK_KEY: "v1",
    HashAlgo.V2_SHA256: "v2",
    HashAlgo.V2_SHA256_64: "v2",
    HashAlgo.VLLM_SHA256_CBOR: "vllm",
}


def hash_scheme(algo: HashAlgo) -> str:
    """The hash space of an algorithm after normalization (both v2 encodings share one)."""
    return _SCHEMES[algo]


class _Malformed(Exception):
    """An event cannot be applied; nothing was changed."""


class _Skipped(Exception):
    """An event is well formed but refers to something unknown; counted as an anomaly."""


def _scope_bytes(lora_id: int | None, salt_id: int | None) -> bytes:
    mask = (lora_id is not None) | ((salt_id is not None) << 1)
    out = bytes([mask])
    if lora_id is not None:
        out += (lora_id & _M64).to_bytes(8, "little")
    if salt_id is not None:
        out += (salt_id & _M64).to_bytes(8, "little")
    return out


def token_chain_root(lora_id: int | None = None, salt_id: int | None = None) -> int:
    """Root of the index's token chain for a reuse scope (0 for the default scope)."""
    if lora_id is None and salt_id is None:
        return 0
    return _XXH3(_scope_bytes(lora_id, salt_id))


def _u32_bytes(tokens: Sequence[int] | array[int]) -> bytes:
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def token_chain_keys(
    tokens: Sequence[int] | array[int], tokens_per_block: int, root: int = 0
) -> list[int]:
    """The index's own chained block keys: ``key_i = xxh3_64(block_i as u32 LE, seed=key_{i-1})``.

    Every block of ``tokens`` is keyed, a trailing partial one included (its shorter byte
    string keys differently from any full block). Used for ``match_by_tokens`` workers.
    """
    return _chain(_u32_bytes(tokens), tokens_per_block, root)


def _chain(raw: bytes, tokens_per_block: int, key: int) -> list[int]:
    """The chained keys of ``raw`` (u32 LE token ids) cut into blocks, after the key ``key``."""
    step = 4 * tokens_per_block
    n, tail = divmod(len(raw), step)
    return _chain_blocks(_cutter(step, n, tail)(raw), key)


def _chain_blocks(blocks: Iterable[bytes], key: int) -> list[int]:
    """The chained keys of ``blocks`` (each a block's u32 LE token ids), after the key ``key``."""
    out: list[int] = []
    append = out.append
    for block in blocks:
        key = _XXH3(block, key)
        append(key)
    return out


@lru_cache(maxsize=1024)
def _cutter(step: int, n: int, tail: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Cuts ``n * step + tail`` bytes into ``n`` blocks of ``step`` bytes and a ``tail`` (when
    not 0), in one C call: no Python-level slice per block."""
    return struct.Struct(f"{step}s" * n + (f"{tail}s" if tail else "")).unpack


@lru_cache(maxsize=256)
def _packer(size: int) -> Callable[..., bytes]:
    """Packs ``size`` token ids as u32 LE (:class:`struct.error` unless all are in
    ``[0, 2**32)``)."""
    return struct.Struct(f"<{size}I").pack


@dataclass(slots=True)
class IndexCounters:
    """Event counters (monotonic). ``anomalies`` counts references taken from tiers that held
    none, removals of unknown hashes and stores under unknown parents (token matching)."""

    events_applied: int = 0
    events_malformed: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_moved: int = 0
    anomalies: int = 0
    resets: int = 0


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """A snapshot of one worker's place in the index (what ``GET /workers`` shows)."""

    worker_id: str
    hash_algo: str | None
    tokens_per_block: int | None
    match_by_tokens: bool
    healthy: bool
    blocks_per_tier: tuple[int, ...]
    capacity_per_tier: tuple[int, ...] | None
    layer_groups: tuple[int, ...]
    events_applied: int
    events_malformed: int
    anomalies: int
    resets: int
    last_event_id: int | None
    last_event_age_s: float | None


class _Stream:
    """The event ids seen from one publisher (one attention-DP rank of a worker)."""

    __slots__ = ("holes", "top")

    def __init__(self) -> None:
        self.top = -1  # streams start at event id 0
        self.holes: set[int] = set()

    def see(self, eid: int) -> bool:
        """Record ``eid``; True when a hole closed (ledgers may then resolve)."""
        top = self.top
        if eid > top:
            if 0 < eid - top - 1 <= HOLE_WINDOW:
                self.holes.update(range(top + 1, eid))
            self.top = eid
            holes = self.holes
            if holes and min(holes) < eid - HOLE_WINDOW:
                self.holes = {x for x in holes if x >= eid - HOLE_WINDOW}
                return True
            return False
        if eid in self.holes:
            self.holes.discard(eid)
            return True
        return False

    def complete_below(self, eid: int) -> bool:
        """No id below ``eid`` is still missing."""
        return not self.holes or min(self.holes) > eid


class _Entry:
    """A (group, tier, hash) count with steps whose order is not settled yet."""

    __slots__ = ("base", "steps")

    def __init__(self, base: int) -> None:
        self.base = base
        # (event id, rank, delta): +1, -1, or _LATE_RELEASE (-1 that arrived after a later event)
        self.steps: list[tuple[int, int | None, int]] = []


@dataclass(slots=True, eq=False)
class _Worker:
    worker_id: str
    slot: int
    algo: HashAlgo | None
    algo_configured: bool
    tpb: int | None
    tpb_configured: bool
    match_by_tokens: bool
    healthy: bool = True
    # Compact (one layer group, ``group`` once seen): a count is 1 + extras[tier].get(hash, 0)
    # where the worker's bit of (tier, hash) is set in KvIndex.masks, else 0; ``groups`` is
    # empty. Expanded (several layer groups): layer group -> per tier {hash: positive count}.
    compact: bool = True
    group: int | None = None
    extras: list[dict[int, int]] = field(default_factory=lambda: [{} for _ in range(TIERS)])
    groups: dict[int, list[dict[int, int]]] = field(default_factory=dict)
    # (layer group, tier, hash) -> steps still to be put in event-id order
    ledger: dict[tuple[int, int, int], _Entry] = field(default_factory=dict)
    # attention-DP rank -> which event ids have been seen
    streams: dict[int | None, _Stream] = field(default_factory=dict)
    arrived_late: bool = False  # the event being applied came after one with a larger id
    # match_by_tokens: engine hash -> the index's chain key, for held blocks (``chain``) and
    # recently removed ones, in two generations: ``chain_recent`` takes removed mappings in
    # bulk until it holds MAX_LEDGER, then becomes ``chain_older`` (the older one is dropped
    # whole). The last MAX_LEDGER to 2 * MAX_LEDGER removed mappings are kept, with no
    # per-entry bookkeeping of their order.
    chain: dict[int, int] = field(default_factory=dict)
    chain_recent: dict[int, int] = field(default_factory=dict)
    chain_older: dict[int, int] = field(default_factory=dict)
    present: list[int] = field(default_factory=lambda: [0] * TIERS)
    capacity: dict[int, tuple[int, ...]] = field(default_factory=dict)
    created_seen: set[tuple[int, int | None]] = field(default_factory=set)
    counters: IndexCounters = field(default_factory=IndexCounters)
    last_event_id: int | None = None
    last_event_at: float | None = None


ResetListener = Callable[[str, int, bool], None]
"""Called with (worker id, slot, removed) when a worker's blocks are dropped: reset, all
cleared, or removal (then the slot may be reused by the next worker registered)."""


class KvIndex:
    """Per-worker, per-tier, reference-counted block hashes of many workers.

    Invariant: for every hash ``h``, bit ``tier * stride + slot`` of ``masks[h]`` is set exactly
    when the worker in ``slot`` has a positive reference count for ``h`` on ``tier`` in some
    layer group; hashes with no bit set are absent from ``masks``.
    """

    __slots__ = ("_groups_cache", "_listeners", "_slots", "_stride", "_workers", "counters",
                 "masks")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        """Normalized hash -> packed presence mask (read-only for callers)."""
        self.counters = IndexCounters()
        """Totals over every worker, past and present."""
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._stride = 64
        self._groups_cache: dict[GroupKey, int] | None = None
        self._listeners: list[ResetListener] = []

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
        _check_tpb(tokens_per_block)
        slot = next((i for i, w in enumerate(self._slots) if w is None), len(self._slots))
        if slot >= self._stride:
            self._grow()
        w = _Worker(
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
        _check_tpb(tokens_per_block)
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
        for listener in self._listeners:
            listener(worker_id, w.slot, True)

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
        return _group_key(self._worker(worker_id))

    def groups(self) -> dict[GroupKey, int]:
        """Hashing groups -> mask of their workers' slots (workers with a known group only)."""
        cache = self._groups_cache
        if cache is None:
            cache = {}
            for w in self._workers.values():
                key = _group_key(w)
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
        w = self._worker(worker_id)
        cap: tuple[int, ...] | None = None
        if w.capacity:
            levels = max(len(c) for c in w.capacity.values())
            cap = tuple(
                sum(c[i] for c in w.capacity.values() if i < len(c)) for i in range(levels)
            )
        c = w.counters
        return WorkerInfo(
            worker_id=w.worker_id,
            hash_algo=w.algo.value if w.algo is not None else None,
            tokens_per_block=w.tpb,
            match_by_tokens=w.match_by_tokens,
            healthy=w.healthy,
            blocks_per_tier=tuple(w.present),
            capacity_per_tier=cap,
            layer_groups=(
                tuple(sorted(w.groups)) if not w.compact
                else () if w.group is None else (w.group,)
            ),
            events_applied=c.events_applied,
            events_malformed=c.events_malformed,
            anomalies=c.anomalies,
            resets=c.resets,
            last_event_id=w.last_event_id,
            last_event_age_s=(
                time.monotonic() - w.last_event_at if w.last_event_at is not None else None
            ),
        )

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

    def _apply(self, w: _Worker, ev: KeyedEvent) -> bool:
        try:
            if (type(ev) is not StoredKeys and type(ev) is not RemovedKeys
                    and type(ev) is not StoredTokens and not isinstance(ev, KVCacheEvent)):
                raise _Malformed(f"not a KVCacheEvent: {type(ev).__name__}")
            eid = ev.event_id
            group = ev.layer_group_id
            if type(eid) is not int or type(group) is not int or group < 0:
                raise _Malformed("event_id and layer_group_id must be ints")
            rank = ev.attention_dp_rank
            stream = w.streams.get(rank)
            if stream is None:
                stream = w.streams[rank] = _Stream()
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
                    raise _Malformed(str(exc)) from None
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
                    for listener in self._listeners:
                        listener(w.worker_id, w.slot, False)
                elif type(data) is Created:
                    self._apply_created(w, group, eid, rank, data)
                else:
                    raise _Malformed(f"unknown event data {type(data).__name__}")
        except _Malformed:
            w.counters.events_malformed += 1
            self.counters.events_malformed += 1
            return False
        except _Skipped:
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
        self, w: _Worker, group: int, eid: int, rank: int | None, data: Created
    ) -> None:
        levels = data.num_blocks_per_cache_level
        if not all(type(n) is int and n >= 0 for n in levels):
            raise _Malformed("num_blocks_per_cache_level must be non-negative ints")
        key = (group, rank)
        if key in w.created_seen:
            # The same pools announced twice: the engine restarted without us seeing a gap.
            self._reset(w)
            w.streams[rank] = _Stream()
            w.streams[rank].see(eid)
        w.created_seen.add(key)
        w.capacity[group] = tuple(levels)

    def _apply_stored(
        self, w: _Worker, group: int, eid: int, rank: int | None, data: Stored
    ) -> None:
        blocks = data.blocks
        if not blocks:
            return
        try:
            raw = [b.block_hash for b in blocks]
            levels = [b.cache_level for b in blocks]
        except AttributeError as exc:
            raise _Malformed(str(exc)) from None
        try:
            keys = normalize_hashes(raw)
        except ValueError as exc:
            raise _Malformed(str(exc)) from None
        level: int | None = 0
        if any(levels):
            if not all(type(t) is int and 0 <= t < TIERS for t in levels):
                raise _Malformed(f"cache levels {levels!r} out of range")
            level = levels[0]
            if levels.count(level) != len(levels):
                level = None  # mixed tiers: block by block
        if w.match_by_tokens:
            keys = self._chain_keys(w, data.parent_hash, blocks, keys)
        if not w.tpb_configured:
            self._learn_tpb(w, len(blocks[0].tokens))
        self._store(w, group, eid, rank, keys, level, levels)

    def _apply_stored_keys(
        self, w: _Worker, group: int, eid: int, rank: int | None, ev: StoredKeys
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
        self, w: _Worker, group: int, eid: int, rank: int | None, ev: StoredTokens
    ) -> None:
        keys = ev.keys
        if w.match_by_tokens:
            start = self._chain_start(w, ev.parent, ev.lora_id)
            engine, keys = keys, _chain(ev.tokens, ev.block_size, start)
            w.chain.update(zip(engine, keys, strict=True))
        self._learn_tpb(w, min(ev.block_size, len(ev.tokens) // 4))
        self._store(w, group, eid, rank, keys, ev.cache_level, None)

    def _learn_tpb(self, w: _Worker, block_tokens: int) -> None:
        """A chain's first block holds ``block_tokens`` tokens (its longest: only a chain's
        last block may be partial)."""
        if not w.tpb_configured and block_tokens > (w.tpb or 0):
            w.tpb = block_tokens
            self._groups_cache = None

    def _chain_start(self, w: _Worker, parent: object, lora_id: int | None) -> int:
        """The key a stored chain's first block is hashed after: its reuse scope's root, or the
        index's key of its parent."""
        if parent is None:
            return token_chain_root(lora_id, None)
        try:
            ph = normalize_hash(parent)
        except ValueError as exc:
            raise _Malformed(str(exc)) from None
        found = self._chain_get(w, ph)
        if found is None:
            raise _Skipped("stored chain under a parent the index never saw")
        return found

    def _chain_keys(
        self, w: _Worker, parent: object, blocks: Sequence[StoredBlock], engine: list[int]
    ) -> list[int]:
        key = self._chain_start(w, parent, blocks[0].lora_id)
        try:
            tokens = [b.tokens for b in blocks]
            sizes = list(map(len, tokens))
        except (TypeError, AttributeError) as exc:
            raise _Malformed(f"bad tokens in a stored block: {exc}") from None
        size, n = sizes[0], len(sizes)
        if _LITTLE and size and 0 not in sizes and set(map(type, tokens)) == {TokenIds}:
            # a kvpool manager's blocks (an in-process feed): their u32 bytes, as they are
            out = _chain_blocks(map(TokenIds.tobytes, tokens), key)  # type: ignore[arg-type]
        elif 0 < sizes[-1] <= size and sizes.count(size) == n - (sizes[-1] != size):
            # Full blocks, the last one maybe partial (the usual): each block packed in one C
            # call, and nothing is changed before every block has packed.
            try:
                if sizes[-1] == size:
                    out = _chain_blocks(starmap(_packer(size), tokens), key)
                else:
                    out = _chain_blocks(starmap(_packer(size), tokens[:-1]), key)
                    out.append(_XXH3(_packer(sizes[-1])(*tokens[-1]), out[-1]))
            except struct.error as exc:
                raise _Malformed(f"bad token ids in a stored block: {exc}") from None
        else:
            try:
                # One conversion for the whole chain; blocks are slices of it.
                flat: list[int] = []
                for t in tokens:
                    flat += t
                raw = token_bytes(flat)
            except (TypeError, ValueError) as exc:
                raise _Malformed(f"bad token ids in a stored block: {exc}") from None
            out = []
            off = 0
            for size, h in zip(sizes, engine, strict=True):
                if not size:
                    # A block re-announced by hash alone (vLLM's offloading connector, and
                    # kvpool's encoding of a tier move): it must be one we already keyed.
                    known = self._chain_get(w, h)
                    if known is None:
                        raise _Skipped("stored block without tokens the index cannot map")
                    key = known
                else:
                    key = _XXH3(raw[4 * off:4 * (off + size)], key)
                    off += size
                out.append(key)
        w.chain.update(zip(engine, out, strict=True))
        return out

    @staticmethod
    def _chain_get(w: _Worker, h: int) -> int | None:
        key = w.chain.get(h)
        return key if key is not None else _recent_get(w, h)

    def _store(
        self,
        w: _Worker,
        group: int,
        eid: int,
        rank: int | None,
        keys: list[int],
        level: int | None,
        levels: list[int] | None,
    ) -> None:
        """+1 reference per key: on ``level``, or block by block on ``levels`` when None."""
        if not (w.compact and w.group == group):
            self._adopt(w, group)
        masks = self.masks
        mget = masks.get
        stride = self._stride
        bit0 = 1 << w.slot
        present = w.present
        if w.compact and level is not None and not w.ledger:
            # The common case, kept tight: one layer group, one tier, nothing pending.
            extra = w.extras[level]
            bit = bit0 << (level * stride)
            again = 0  # keys already held: one more reference
            for h in keys:
                if h not in masks:
                    masks[h] = bit
                    continue
                m = masks[h]
                if m & bit:
                    extra[h] = extra.get(h, 0) + 1
                    again += 1
                else:
                    masks[h] = m | bit
            present[level] += len(keys) - again
        else:
            ledger = w.ledger
            per_block = levels if levels is not None else [level or 0] * len(keys)
            if w.compact:
                for h, t in zip(keys, per_block, strict=True):
                    if ledger and (group, t, h) in ledger:
                        self._step(w, (group, t, h), eid, rank, 1)
                    else:
                        c = self._count(w, group, t, h)
                        self._set_count(w, (group, t, h), c, c + 1)
            else:
                tiers = w.groups[group]
                for h, t in zip(keys, per_block, strict=True):
                    if ledger and (group, t, h) in ledger:
                        self._step(w, (group, t, h), eid, rank, 1)
                        continue
                    d = tiers[t]
                    c = d.get(h, 0)
                    d[h] = c + 1
                    if c == 0 and not _held_elsewhere(w, group, t, h):
                        masks[h] = mget(h, 0) | (bit0 << (t * stride))
                        present[t] += 1
        w.counters.blocks_stored += len(keys)
        self.counters.blocks_stored += len(keys)

    def _release(
        self, w: _Worker, group: int, eid: int, rank: int | None, h: int, t: int
    ) -> bool:
        """Take one reference of (group, t, h). False when the tier held none (an anomaly)."""
        key = (group, t, h)
        if w.ledger and key in w.ledger:
            return self._step(w, key, eid, rank, -1)
        c = self._count(w, group, t, h)
        if c > 0:
            self._set_count(w, key, c, c - 1)
            return True
        w.counters.anomalies += 1
        self.counters.anomalies += 1
        stream = w.streams.get(rank)
        late = w.arrived_late
        if late or (stream is not None and not stream.complete_below(eid)):
            # Either the store this refers to may still be on its way, or a later event that
            # arrived first took the reference this one refers to: keep the step, in order.
            entry = _Entry(0)
            entry.steps.append((eid, rank, _LATE_RELEASE if late else -1))
            w.ledger[key] = entry
            if len(w.ledger) > MAX_LEDGER:
                for old in list(w.ledger)[: len(w.ledger) // 2]:
                    self._settle_entry(w, old, force=True)
        return False

    def _count(self, w: _Worker, group: int, t: int, h: int) -> int:
        """The worker's references of ``h`` on tier ``t`` in layer group ``group``."""
        if w.compact:
            if group != w.group or not (self.masks.get(h, 0) >> (t * self._stride + w.slot)) & 1:
                return 0
            return 1 + w.extras[t].get(h, 0)
        tiers = w.groups.get(group)
        return tiers[t].get(h, 0) if tiers is not None else 0

    def _adopt(self, w: _Worker, group: int) -> None:
        """Make ``group`` one whose counts can be set: a compact worker takes it as its layer
        group, or expands when it has another one."""
        if w.compact:
            if w.group is None:
                w.group = group
            elif group != w.group:
                self._expand(w)
        if not w.compact and group not in w.groups:
            w.groups[group] = [{} for _ in range(TIERS)]

    def _expand(self, w: _Worker) -> None:
        """A second layer group: the compact worker's counts move to per-group dicts."""
        assert w.compact and w.group is not None
        tiers: list[dict[int, int]] = [{} for _ in range(TIERS)]
        if any(w.present):
            stride = self._stride
            for h, m in self.masks.items():
                for t in range(TIERS):
                    if (m >> (t * stride + w.slot)) & 1:
                        tiers[t][h] = 1 + w.extras[t].get(h, 0)
        w.groups = {w.group: tiers}
        w.compact, w.group, w.extras = False, None, [{} for _ in range(TIERS)]

    def _set_count(self, w: _Worker, key: tuple[int, int, int], old: int, new: int) -> None:
        """Set a count (old and new >= 0, old the current one) and keep the presence masks in
        step."""
        group, t, h = key
        self._adopt(w, group)
        if w.compact:
            if new > 1:
                w.extras[t][h] = new - 1
            elif old > 1:
                del w.extras[t][h]
            if (old > 0) == (new > 0):
                return
        else:
            tiers = w.groups[group]
            if new > 0:
                tiers[t][h] = new
            else:
                tiers[t].pop(h, None)
            if (old > 0) == (new > 0) or (len(w.groups) > 1 and _held_elsewhere(w, group, t, h)):
                return
        bit = (1 << w.slot) << (t * self._stride)
        if new > 0:
            self.masks[h] = self.masks.get(h, 0) | bit
            w.present[t] += 1
        else:
            m = self.masks[h] & ~bit
            if m:
                self.masks[h] = m
            else:
                del self.masks[h]
            w.present[t] -= 1

    # ---------------------------------------------------------------------------------------
    # the out-of-order ledger

    def _step(
        self, w: _Worker, key: tuple[int, int, int], eid: int, rank: int | None, delta: int
    ) -> bool:
        """Add a step to a ledger entry; True when the count went down (for a release)."""
        group, t, h = key
        before = self._count(w, group, t, h)
        if delta < 0 and w.arrived_late:
            delta = _LATE_RELEASE
        w.ledger[key].steps.append((eid, rank, delta))
        after = self._settle_entry(w, key)
        return after < before

    def _evaluate(self, w: _Worker, entry: _Entry) -> int:
        """The count after the entry's steps in event-id order (negative while waiting)."""
        running = entry.base
        for eid, rank, delta in sorted(entry.steps, key=_first):
            if delta > 0:
                running += 1
            elif running > 0 or delta == _LATE_RELEASE:
                running -= 1
            else:
                stream = w.streams.get(rank)
                if stream is None or stream.complete_below(eid):
                    continue  # in order, nothing missing below: history before our view
                running -= 1
        return running

    def _settle_entry(self, w: _Worker, key: tuple[int, int, int], force: bool = False) -> int:
        entry = w.ledger[key]
        old = self._count(w, *key)
        count = self._evaluate(w, entry)
        self._set_count(w, key, old, max(count, 0))
        # Settled when no step can still arrive before the ones we hold. A negative count waits
        # for a store that may be anywhere below the newest id seen; once nothing is missing
        # at all, it was history.
        upto = max(e for e, _, _ in entry.steps) if count >= 0 else None
        if force or all(
            (st := w.streams.get(r)) is None
            or (st.complete_below(upto) if upto is not None else not st.holes)
            for r in {r for _, r, _ in entry.steps}
        ):
            del w.ledger[key]  # from now on a plain count
        return max(count, 0)

    def _settle(self, w: _Worker) -> None:
        """Holes closed: re-evaluate every ledger entry."""
        for key in list(w.ledger):
            self._settle_entry(w, key)

    def _resolve(self, w: _Worker, raw_hash: object) -> int | None:
        """Event hash -> index key (None when a token-matched worker never stored it)."""
        try:
            h = raw_hash & _M64 if type(raw_hash) is int else normalize_hash(raw_hash)
        except ValueError as exc:
            raise _Malformed(str(exc)) from None
        if w.match_by_tokens:
            return self._chain_get(w, h)
        return h

    def _apply_removed(
        self, w: _Worker, group: int, eid: int, rank: int | None, data: Removed
    ) -> None:
        levels = data.cache_levels
        hashes = data.block_hashes
        level: int | None = None
        if levels is not None:
            if len(levels) != len(hashes):
                raise _Malformed("cache_levels and block_hashes differ in length")
            level = 0
            if any(levels):
                if not all(type(t) is int and 0 <= t < TIERS for t in levels):
                    raise _Malformed(f"cache_levels {levels!r} out of range")
                level = levels[0]
                if levels.count(level) != len(levels):
                    level = None  # mixed tiers: block by block
        try:
            keys = normalize_hashes(hashes)
        except ValueError as exc:
            raise _Malformed(str(exc)) from None
        if w.match_by_tokens:
            self._remove_mapped(w, group, eid, rank, keys, level, levels)
        else:
            self._remove(w, group, eid, rank, keys, level, levels)

    def _remove_mapped(
        self,
        w: _Worker,
        group: int,
        eid: int,
        rank: int | None,
        engine: list[int],
        level: int | None,
        levels: Sequence[int] | None,
    ) -> None:
        """:meth:`_remove` for a token-matched worker: ``engine`` are the engine's (normalized)
        hashes. A hash the index never mapped is an anomaly, skipped; the mapping of a block
        held nowhere any more is kept a while (:meth:`_forget_chains`)."""
        keys: list[int | None] = list(map(w.chain.get, engine))
        mapped_all = all(keys)  # in C; False for a key of 0 too: then check for None
        if not mapped_all:
            keys = [
                k if k is not None else _recent_get(w, h) for h, k in zip(engine, keys, strict=True)
            ]
            mapped_all = None not in keys
        if (mapped_all and len(set(keys)) == len(keys) and not w.ledger
                and len(keys) <= MAX_LEDGER):
            # The usual case, in bulk. Distinct keys: whether a block is still held after its
            # own release does not depend on the other releases; and the ledger cannot
            # overflow (settling other entries) within this event.
            mapped = cast(list[int], keys)
            none_left = _none_left(w, group, level, levels)
            self._remove(w, group, eid, rank, mapped, level, levels)
            if none_left:  # no block to look up: every mapping goes
                _forget(w, engine)
            else:
                self._forget_chains(w, engine, mapped)
            return
        removed = 0
        for i, key in enumerate(keys):
            if key is None:
                w.counters.anomalies += 1
                self.counters.anomalies += 1
                continue
            if level is not None:
                removed += self._release(w, group, eid, rank, key, level)
            elif levels is not None:
                removed += self._release(w, group, eid, rank, key, levels[i] or 0)
            else:
                removed += self._release_everywhere(w, group, eid, rank, key)
            self._forget_chains(w, engine[i:i + 1], [key])
        w.counters.blocks_removed += removed
        self.counters.blocks_removed += removed

    def _remove(
        self,
        w: _Worker,
        group: int,
        eid: int,
        rank: int | None,
        keys: list[int],
        level: int | None,
        levels: Sequence[int] | None,
    ) -> None:
        """-1 reference per key: on ``level``; block by block on ``levels`` when ``level`` is
        None; on every tier that holds it when both are None."""
        removed = 0
        anomalies = 0
        present = w.present
        if (w.compact and group == w.group and not w.ledger
                and (level is not None or (levels is None and not present[1] and not present[2]))):
            # The common case, kept tight: one layer group, one tier, nothing pending. (A
            # removal from every tier while only the GPU holds anything is a GPU removal.)
            everywhere = level is None
            t = level or 0
            extra = w.extras[t]
            masks = self.masks
            bit = (1 << w.slot) << (t * self._stride)
            clear = ~bit
            kept = missing = 0  # references left / keys not held
            for key in keys:
                try:
                    m = masks[key]
                except KeyError:  # held by nobody: rare, an anomaly
                    m = 0
                if m & bit:
                    if extra and key in extra:
                        c = extra.pop(key)
                        if c > 1:
                            extra[key] = c - 1
                        kept += 1
                    elif m := m & clear:
                        masks[key] = m
                    else:
                        del masks[key]
                else:
                    missing += 1
                    if not everywhere:
                        self._release(w, group, eid, rank, key, t)
            removed = len(keys) - missing
            present[t] -= removed - kept
            if everywhere:
                anomalies = missing  # held nowhere: nothing can be pending either
        elif level is not None:
            for key in keys:
                removed += self._release(w, group, eid, rank, key, level)
        elif levels is not None:
            for key, t in zip(keys, levels, strict=True):
                removed += self._release(w, group, eid, rank, key, t or 0)
        else:
            for key in keys:
                removed += self._release_everywhere(w, group, eid, rank, key)
        if anomalies:
            w.counters.anomalies += anomalies
            self.counters.anomalies += anomalies
        w.counters.blocks_removed += removed
        self.counters.blocks_removed += removed

    def _release_everywhere(
        self, w: _Worker, group: int, eid: int, rank: int | None, key: int
    ) -> int:
        """A removal without tiers: one reference from every tier that holds ``key``."""
        held = [t for t in range(TIERS) if self._count(w, group, t, key)]
        if not held:
            w.counters.anomalies += 1
            self.counters.anomalies += 1
        return sum([self._release(w, group, eid, rank, key, t) for t in held])

    def _forget_chains(self, w: _Worker, engine: Sequence[int], keys: Sequence[int]) -> None:
        """Engine hashes whose keys the worker no longer holds on any tier move to the recently
        removed mappings. Kept a while: a block removed from one tier is often announced on
        another right after (by hash only), and a late child may still name it as parent."""
        if w.compact:
            masks = self.masks
            held = _tier_bits(w.slot, self._stride)
            gone = [h for h, k in zip(engine, keys, strict=True) if not masks.get(k, 0) & held]
        else:
            groups = w.groups.values()
            gone = [h for h, k in zip(engine, keys, strict=True)
                    if not any(k in d for tiers in groups for d in tiers)]
        _forget(w, gone)

    def _apply_updated(
        self, w: _Worker, group: int, eid: int, rank: int | None, data: Updated
    ) -> None:
        diff = data.cache_level
        if diff is None:
            return  # priority-only: nothing the router scores on
        if type(diff) is not EventDiff:
            raise _Malformed("cache_level must be an event diff")
        old, new = diff.old_value, diff.new_value
        if not (type(old) is int and type(new) is int and 0 <= old < TIERS and 0 <= new < TIERS):
            raise _Malformed(f"cache level diff {old!r} -> {new!r} out of range")
        key = self._resolve(w, data.block_hash)
        if key is None:
            raise _Skipped("tier move of a block the index cannot map")
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

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        return w

    def _reset(self, w: _Worker) -> None:
        self._drop_blocks(w)
        w.streams.clear()
        w.created_seen.clear()
        w.capacity.clear()
        w.counters.resets += 1
        self.counters.resets += 1
        for listener in self._listeners:
            listener(w.worker_id, w.slot, False)

    def _drop_blocks(self, w: _Worker) -> None:
        masks = self.masks
        stride = self._stride
        if w.compact:
            if any(w.present):
                # The worker keeps no list of its hashes: find them by its bits (in C loops).
                bits = _tier_bits(w.slot, stride)
                clear = ~bits
                for h in list(compress(masks, map(and_, masks.values(), repeat(bits)))):
                    m = masks[h] & clear
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
        else:
            for t in range(TIERS):
                clear = ~((1 << w.slot) << (t * stride))
                for tiers in w.groups.values():
                    for h in tiers[t]:
                        m = masks.get(h, 0) & clear
                        if m:
                            masks[h] = m
                        else:
                            masks.pop(h, None)
        w.compact, w.group, w.extras = True, None, [{} for _ in range(TIERS)]
        w.groups.clear()
        w.ledger.clear()
        w.chain.clear()
        w.chain_recent.clear()
        w.chain_older.clear()
        w.present = [0] * TIERS

    def _grow(self) -> None:
        old, new = self._stride, self._stride * 2
        full = (1 << old) - 1
        masks = self.masks
        for h, m in masks.items():
            out = 0
            for t in range(TIERS):
                out |= ((m >> (t * old)) & full) << (t * new)
            masks[h] = out
        self._stride = new


def _none_left(w: _Worker, group: int, level: int | None, levels: object) -> bool:
    """True when, before a removal of distinct keys on ``level`` (every tier when both it and
    ``levels`` are None), it is known that no removed block stays held anywhere: the worker is
    compact in ``group``, holds one reference per block, and nothing on another tier."""
    if not (w.compact and w.group == group) or any(w.extras):
        return False
    if level is None:
        return levels is None
    present = w.present
    return sum(present) == present[level]


def _recent_get(w: _Worker, h: int) -> int | None:
    """The chain key of a recently removed engine hash (None when not remembered)."""
    key = w.chain_recent.get(h)
    return key if key is not None else w.chain_older.get(h)


def _forget(w: _Worker, engine: Sequence[int]) -> None:
    """Held mappings of ``engine`` hashes (blocks the worker no longer holds) become recently
    removed ones, in bulk."""
    popped: list[int | None] = list(map(w.chain.pop, engine, repeat(None)))
    recent = w.chain_recent
    if None in popped:  # not held (a mapping already among the recent ones)
        recent.update([(h, k) for h, k in zip(engine, popped, strict=True) if k is not None])
    else:
        recent.update(zip(engine, cast(list[int], popped), strict=True))
    if len(recent) >= MAX_LEDGER:
        w.chain_older = recent
        w.chain_recent = {}


def _first(step: tuple[int, int | None, int]) -> int:
    return step[0]


def _tier_bits(slot: int, stride: int) -> int:
    """A slot's presence bits on every tier."""
    return sum((1 << slot) << (t * stride) for t in range(TIERS))


def _held_elsewhere(w: _Worker, group: int, tier: int, h: int) -> bool:
    return any(g != group and h in tiers[tier] for g, tiers in w.groups.items())


def _group_key(w: _Worker) -> GroupKey | None:
    if w.tpb is None:
        return None
    if w.match_by_tokens:
        return ("tokens", w.tpb)
    if w.algo is None:
        return None
    return (_SCHEMES[w.algo], w.tpb)


def _check_tpb(tpb: int | None) -> None:
    if tpb is None:
        return
    if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1:
        raise InvalidArgumentError(f"tokens_per_block must be an int >= 1, got {tpb!r}")
