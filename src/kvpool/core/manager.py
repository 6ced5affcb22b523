"""KVCacheManager: the engine-facing API. It orchestrates; the work is done by the modules below.

```
KVCacheManager (this module: the API, the lock, argument checks)
 ├─ admission   plan a batch against a read-only PlanView (pure)
 ├─ admit       execute a plan: claim (phase 1), allocate (phase 2)
 ├─ lifecycle   add_tokens, rewind_tokens, suspend, resume, remove_sequence
 ├─ commit      insert a sequence's blocks into the prefix tree (store_context_blocks)
 ├─ allocator   take slots, evict (offload or drop), onboard, release references
 └─ introspect  read-only views for tests: debug_state, check_invariants, tree_blocks
     all on one CacheState (kvpool.core.state): SlotPools per (tier, group), trees, sequences
```

Every public call takes the manager lock, checks everything it needs before changing anything,
and so either completes or raises with the manager unchanged (and no event emitted): a call
that raises has changed nothing the caller can see (``debug_state()``), so the caller never
undoes anything after an error. A call that may copy blocks asks the storage first
(``Storage.check``: closed, a disk file removed or truncated) and reads the disk slots it will
onboard ahead (``read_ahead``), since its copies run after its bookkeeping. A copy that still
fails (a full disk, an I/O error during the call) is repaired without raising: the blocks it
was moving to a colder tier leave the cache (a later miss, never wrong bytes), and a persistent
tier's manifest records that cannot be written are left out (its blocks are then misses after
a restart). Only a failed copy of a block a sequence uses (onto the GPU, or for a suspended
sequence) cannot be repaired nor undone: that call raises ``CopiesLostError`` (a
``StorageError``, the one error that says the call changed the manager) with its work done,
and the manager refuses every later call that may copy with the same error
(``kvpool.core.state``).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.config import CacheConfig, SequenceRequest
from kvpool.core import introspect, lifecycle, persist
from kvpool.core import plan as admission
from kvpool.core.allocator import clear_queues, drop_unwritten
from kvpool.core.checkpoints import CheckpointBook, check_checkpoints
from kvpool.core.commit import commit
from kvpool.core.emit import EventSink, event_algo
from kvpool.core.execute import AdmitResult, admit, disk_reads
from kvpool.core.plan import BatchPlan
from kvpool.core.state import CacheState, SeqId
from kvpool.core.stats import CacheStats
from kvpool.errors import InvalidArgumentError, OutOfBlocksError, StorageError
from kvpool.events.model import KVCacheEvent
from kvpool.hashing import jit
from kvpool.tiers.storage import MetadataStorage, Storage
from kvpool.validation import check_int, is_int

if TYPE_CHECKING:
    from kvpool.core.remote_hooks import ManagerRemote, RemoteStats

__all__ = ["AdmitResult", "KVCacheManager"]


def _is_index(value: object, size: int) -> bool:
    """Is ``value`` an int (not a bool) in [0, size)?"""
    return is_int(value) and 0 <= value < size


def _check_hooks(name: str, obj: object, methods: tuple[str, ...]) -> None:
    """``obj`` is None or has every method of its protocol."""
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if obj is not None and missing:
        raise InvalidArgumentError(f"{name} {obj!r:.60} lacks {', '.join(missing)}")


def _request_list(requests: Iterable[SequenceRequest]) -> list[SequenceRequest]:
    """A batch as a list; a batch that is not a sequence of requests is refused."""
    if isinstance(requests, list):
        return requests
    if isinstance(requests, SequenceRequest | str | bytes) or not isinstance(requests, Iterable):
        raise InvalidArgumentError(
            f"requests must be a sequence of SequenceRequest, got {requests!r:.80}"
        )
    return list(requests)


class KVCacheManager:
    """Block manager for one engine (one model replica). Thread safe: calls serialize."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        storage: Storage | None = None,
        events: EventSink | None = None,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(f"config must be a CacheConfig, got {config!r}")
        _check_hooks("storage", storage, ("block_bytes", "close", "copy_blocks", "stats"))
        _check_hooks("events", events, ("on_all_cleared", "on_created", "on_removed",
                                        "on_stored", "on_updated", "flush_iteration_events",
                                        "get_latest_events"))
        self.config = config
        self.tpb = config.tokens_per_block
        self._lock = threading.RLock()
        owns_storage = storage is None  # persist hook: closed by a failed warm restart
        if storage is None and config.layer_geometry is not None:
            from kvpool.tiers.torch_storage import TorchStorage

            storage = TorchStorage(self.tpb, config.layer_geometry, config.slots,
                                   device=config.device, disk_path=config.disk.path,
                                   persistent=config.disk.persistent)
        if events is None and config.events.buffer_max_size > 0:
            from kvpool.events.manager import EventManager

            events = EventManager(config.events.buffer_max_size, hash_algo=event_algo(config))
        self.events = events
        self._st = state = CacheState(config, storage or MetadataStorage(self.tpb), events)
        state.repair_copies = drop_unwritten
        self.step = state.layout.step
        self.self_groups = state.layout.self_groups
        self.full_attention_only = state.layout.full_attention_only
        self.roots = state.roots
        self.sequences = state.sequences
        self._iter_base = CacheStats()
        # does a batch copy (and so need the storage checked) whatever it matches?
        self._batch_may_copy = state.layout.tiers > 1
        self._has_disk = state.layout.tiers > 2
        if events is not None:
            # Stored blocks carry TokenIds, which the vLLM encoder writes with a kernel: load it
            # now (once per process) rather than while the first batch waits to be published.
            jit.backend()
            for g in range(config.num_groups):
                events.on_created(g, config.window_size(g),
                                  [config.slots[t][g] for t in range(config.num_tiers)])
        # persist hook: a persistent disk tier re-indexes the blocks its manifest records
        self.persistent_disk = state.persist = persist.attach(state, owns_storage=owns_storage,
                                                           lock=self._lock)
        # hybrid models: the checkpoint policy and each live sequence's checkpoints
        self._ckpt = CheckpointBook(state) if config.state_groups else None
        self._remote: ManagerRemote | None = None
        if config.remote.url is not None or config.remote.store is not None:
            from kvpool.core.remote_hooks import ManagerRemote  # the shared remote tier

            self._remote = state.remote = ManagerRemote(state, events)

    @property
    def storage(self) -> Storage:
        """Where the blocks' bytes live (metadata only unless the config gives a geometry)."""
        return self._st.storage

    def gpu_available(self, g: int) -> int:
        """Free plus evictable GPU slots of group g (no checks: see ``num_free_blocks``)."""
        return self._st.gpu[g].available()

    # ------------------------------------------------------------------ admission

    def plan_batch(self, requests: Sequence[SequenceRequest]) -> BatchPlan:
        """What ``add_sequence_batch(requests)`` would reuse and allocate; changes nothing."""
        with self._lock:
            return admission.plan(self._st.view, _request_list(requests))

    def add_sequence(self, request: SequenceRequest) -> AdmitResult:
        """Admit one request: ``add_sequence_batch([request])[0]``."""
        return self.add_sequence_batch([request])[0]

    def add_sequence_batch(self, requests: Sequence[SequenceRequest]) -> list[AdmitResult]:
        """Admit a scheduler step's new requests in two phases (see :mod:`kvpool.core.plan`).

        Raises :class:`OutOfBlocksError` with the deficit per (tier, layer group) when the
        batch does not fit, and :class:`StorageError` when it would copy blocks and the
        storage cannot (closed, a disk file removed or truncated, a disk slot it onboards
        unreadable); the manager is then exactly as before: no request of the batch was
        admitted, and the caller has nothing to remove. (The one exception, after a copy
        that failed beyond repair, is in the module docstring.)
        """
        with self._lock:
            state = self._st
            plan = admission.plan(state.view, _request_list(requests))
            if not plan.fits:
                detail = ", ".join(
                    f"group {g}: need {plan.new_blocks[g]}, have {plan.available[g]}"
                    for (_, g) in sorted(plan.deficit)
                )
                raise OutOfBlocksError(
                    f"batch of {len(plan.requests)} requests does not fit the GPU pool ({detail})",
                    plan.deficit,
                )
            if self._batch_may_copy or plan.partials:
                state.check_storage()  # the batch may copy: fail before changing anything
                if self._has_disk:  # and read what it onboards from disk, for the same reason
                    state.read_ahead(disk_reads(state, plan))
            if self._ckpt is not None:
                self._ckpt.admitting(plan)
            results = admit(state, plan)
            state.finish_call()
            if self._ckpt is not None:
                self._zero_cold(results)
            return results

    def _zero_cold(self, results: list[AdmitResult]) -> None:
        """Cold hybrid sequences start from a zero state: their running slots are zeroed
        (after the call's copies; a storage without ``zero_slots`` leaves it to the engine)."""
        zero = getattr(self.storage, "zero_slots", None)
        if zero is None:
            return
        for g in self.config.state_groups:
            slots = [b[0] for r in results if not r.reused_tokens for b in r.block_ids[g]]
            if slots:
                zero(g, slots)

    def count_reusable_tokens(
        self, tokens: Sequence[int], *, lora_id: int | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens a request with this prompt would reuse now (what ``plan_batch`` says)."""
        with self._lock:
            enc = [0] if self.config.cross_attention_groups else None
            req = SequenceRequest("__count__", tokens, lora_id=lora_id, cache_salt=cache_salt,
                                  encoder_tokens=enc)
            _, matched, _, partial_tokens, _ = admission.walk(self._st.view, req)
            return sum(b - a for _, a, b in matched) * self.tpb + partial_tokens

    # ------------------------------------------------------------------ sequence life

    def needed_blocks_one_step(self, seq_id: SeqId, num_new_tokens: int = 1) -> dict[int, int]:
        """GPU slots per layer group that growing by ``num_new_tokens`` tokens would take."""
        with self._lock:
            seq = self._st.seq(seq_id)
            check_int("num_new_tokens", num_new_tokens, 0)
            return lifecycle.growth(self._st, seq, seq.num_tokens + num_new_tokens)[0]

    def add_tokens(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """Grow a sequence by ``token_ids`` (decode; several for speculative decoding).

        Allocates a block at each block boundary (per beam), and releases blocks that left a
        sliding window (sink blocks stay) as seen from the first new token, whose KV the next
        step computes. All or nothing: raises :class:`OutOfBlocksError` with the manager
        unchanged when the pool cannot provide the blocks (and :class:`StorageError` when an
        eviction would offload and the storage cannot copy).
        """
        with self._lock:
            lifecycle.add_tokens(self._st, seq_id, token_ids)

    def rewind_tokens(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens (rejected speculative tokens).

        Releases blocks that become empty. Never goes below the committed length (the prompt
        and any stored block); raises :class:`RewindError` otherwise, or when a sliding
        window would need a block it already released.
        """
        with self._lock:
            lifecycle.rewind_tokens(self._st, seq_id, num_tokens)

    def store_context_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Commit the full blocks within the first ``num_computed_tokens`` tokens for reuse."""
        with self._lock:
            state = self._st
            seq = state.active(seq_id)
            if not is_int(num_computed_tokens) or not 0 <= num_computed_tokens <= seq.num_tokens:
                raise InvalidArgumentError(
                    f"num_computed_tokens must be in [0, {seq.num_tokens}], "
                    f"got {num_computed_tokens!r}"
                )
            commit(state, seq, num_computed_tokens // self.tpb)
            state.finish_call()

    def remove_sequence(self, seq_id: SeqId, *, store_for_reuse: bool = True) -> None:
        """Release a finished sequence; with ``store_for_reuse`` commit what it computed first
        (full blocks including generated tokens, and the trailing partial block when partial
        reuse is on). Its blocks stay cached until evicted. A suspended sequence (an aborted
        preempted request) commits nothing new; its held colder-tier blocks are released."""
        with self._lock:
            lifecycle.remove_sequence(self._st, seq_id, store_for_reuse)
            if self._ckpt is not None:
                self._ckpt.forget(seq_id)

    def suspend(self, seq_id: SeqId) -> dict[int, int]:
        """Preempt a sequence without losing its KV.

        Blocks only this sequence holds move to the host tier (when there is one and it can
        make room) and stay held there: they are never evicted or dropped. Blocks shared with
        other sequences stay on the GPU. Returns the GPU slots freed per layer group. Raises
        :class:`StorageError` (nothing changed) when there is a host tier and the storage
        cannot copy.
        """
        with self._lock:
            return lifecycle.suspend(self._st, seq_id)

    def resume(self, seq_id: SeqId) -> None:
        """Bring a suspended sequence back: its moved blocks are copied up to the GPU.

        Raises :class:`OutOfBlocksError` (nothing changed) when the GPU cannot take them, and
        :class:`StorageError` (nothing changed) when the storage cannot copy them.
        """
        with self._lock:
            lifecycle.resume(self._st, seq_id)

    # ------------------------------------------------------------------ hybrid models

    def checkpoint_positions(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Token counts in (start, end] after which the checkpoint policy wants the
        sequence's recurrent state saved (``save_checkpoint``): the engine splits a prefill
        chunk there. Empty without state groups (docs/hybrid.md)."""
        with self._lock:
            seq = self._st.seq(seq_id)
            for name, v in (("start", start), ("end", end)):
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= seq.num_tokens:
                    raise InvalidArgumentError(
                        f"{name} must be in [0, {seq.num_tokens}], got {v!r}")
            if self._ckpt is None or end <= start:
                return []
            return self._ckpt.positions(seq_id, start, end)

    def save_checkpoint(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Copy the sequence's running state, which must be its state after its first
        ``num_tokens`` tokens (a block boundary), into a checkpoint cached under that prefix
        (whose blocks are committed first, as ``store_context_blocks`` would). Returns False
        when it is not cached (reuse off, no state slot to spare, or the prefix's attention
        blocks are not all in the cache); True when it is (or already was). Raises
        :class:`InvalidArgumentError` without state groups or for a bad ``num_tokens``,
        :class:`SequenceStateError` for a suspended sequence."""
        with self._lock:
            st = self._st
            seq = st.active(seq_id)
            if self._ckpt is None:
                raise InvalidArgumentError("save_checkpoint needs state groups "
                                           "(CacheConfig.state_groups)")
            if (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                    or not 0 < num_tokens <= seq.num_tokens or num_tokens % self.tpb):
                raise InvalidArgumentError(
                    f"num_tokens must be a multiple of {self.tpb} in (0, {seq.num_tokens}], "
                    f"got {num_tokens!r}")
            st.check_storage()  # a copy, and evictions that may offload
            st.begin_call()
            saved = self._ckpt.save(seq, num_tokens)
            st.finish_call()
            return saved

    # ------------------------------------------------------------------ cache and storage

    def clear_cache(self) -> int:
        """Drop every cached block no sequence holds, on every tier; returns how many."""
        with self._lock:
            state = self._st
            dropped = state.stats.dropped_blocks
            clear_queues(state)
            if self.persistent_disk is not None:  # persist hook: the manifest forgets them
                self.persistent_disk.cleared()
            state.finish_call()
            return state.stats.dropped_blocks - dropped

    def tensors(self, layer_group: int, tier: int = 0) -> Any:
        """The KV pool of one layer group and tier, for attention kernels:
        ``[slots, layers, 2, tokens_per_block, kv_heads, head_dim]`` (torch storage only); for
        a state group a tuple of views ``[slots, layers, *shape]``, one per state shape."""
        tensors = getattr(self.storage, "tensors", None)
        if tensors is None:
            raise StorageError("this manager has metadata-only storage: no tensors "
                               "(give CacheConfig a layer_geometry)")
        return tensors(layer_group, tier)

    def close(self) -> None:
        """Release the storage (removes a disk tier's file). Calls that would copy blocks then
        raise :class:`StorageError`; calls that move no data keep working on the metadata.
        A remote tier's queued writes are written first."""
        if self._remote is not None:
            self._remote.close()
        with self._lock:  # not between a call's storage check and its copies
            if self.persistent_disk is not None:  # persist hook: spill, sync, close the manifest
                self.persistent_disk.close()
            self.storage.close()

    # ------------------------------------------------------------------ remote tier

    def prefetch(self, requests: Iterable[SequenceRequest]) -> list[int]:
        """Pull each request's longest remote-resident continuation of its local match into
        local slots (host tier, else GPU) before admission; tokens made local per request
        (0 each without a remote tier). See :mod:`kvpool.core.remote_prefetch`."""
        from kvpool.core.remote_prefetch import prefetch

        return prefetch(self._st, self._remote, self._lock, requests)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until every block handed to the remote tier so far is written (or failed, or
        dropped by a full queue); False if ``timeout_s`` passed first."""
        return True if self._remote is None else self._remote.flush(timeout_s)

    def remote_stats(self) -> RemoteStats | None:
        """The remote tier's counters (None without one)."""
        with self._lock:
            return None if self._remote is None else self._remote.snapshot()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ events

    def flush_iteration_events(self) -> None:
        """Publish this step's events (no-op without events)."""
        if self.events is not None:
            self.events.flush_iteration_events()

    def get_latest_events(self, timeout_s: float | None = 0) -> list[KVCacheEvent]:
        """Published events not read yet (see ``EventManager.get_latest_events``)."""
        if self.events is None:
            return []
        return self.events.get_latest_events(timeout_s)

    def cached_blocks(self) -> set[tuple[int | str, int, int]]:
        """(event hash, layer group, tier) of every cached block: what events describe."""
        with self._lock:
            return introspect.cached_blocks(self._st)

    # ------------------------------------------------------------------ queries

    def block_ids(self, seq_id: SeqId, layer_group: int = 0, beam: int = 0) -> list[int]:
        """Beam ``beam``'s block table in ``layer_group`` (-1 = block not held)."""
        with self._lock:
            seq = self._st.seq(seq_id)
            if not _is_index(layer_group, self.config.num_groups):
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            if not _is_index(beam, seq.beam_width):
                raise InvalidArgumentError(
                    f"beam {beam!r} out of range for beam width {seq.beam_width}"
                )
            return list(seq.tables[layer_group][beam])

    def num_free_blocks(self, layer_group: int = 0) -> int:
        """Free plus evictable GPU slots of a layer group."""
        with self._lock:
            if not _is_index(layer_group, self.config.num_groups):
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            return self.gpu_available(layer_group)

    def slot_usage(self, tier: int = 0, layer_group: int = 0) -> dict[str, int]:
        """used / free / evictable slots of one pool."""
        with self._lock:
            if not (_is_index(tier, self.config.num_tiers)
                    and _is_index(layer_group, self.config.num_groups)):
                raise InvalidArgumentError(f"unknown pool (tier {tier}, group {layer_group})")
            pool = self._st.pools[tier][layer_group]
            free, evictable = len(pool.free), len(pool.queue)
            return {"total": pool.size, "free": free, "evictable": evictable,
                    "used": pool.size - free - evictable}

    def stats(self) -> CacheStats:
        """Totals since the manager was created."""
        with self._lock:
            return self._st.stats.copy()

    def iteration_stats(self) -> CacheStats:
        """Totals since the previous call (and resets the iteration)."""
        with self._lock:
            now = self._st.stats.copy()
            out = now.minus(self._iter_base)
            self._iter_base = now
            return out

    def tree_blocks(self) -> list[tuple[array[int], list[int], list[int]]]:
        """(tokens up to and including the block, slot per group, tier per group) of every
        block in the tree; for tests and introspection (O(tree))."""
        with self._lock:
            return introspect.tree_blocks(self._st)

    def debug_state(self) -> dict[str, Any]:
        """A comparable snapshot of everything a call may change: free lists, queues,
        references, the tree, held colder-tier slots, the sequences and the stats. Two
        snapshots are equal iff nothing observable changed between them; for tests and
        debugging (O(everything))."""
        with self._lock:
            return introspect.debug_state(self._st)


    def check_invariants(self) -> None:
        """Assert ARCHITECTURE §7 (1-3) over the whole state; for tests. O(everything)."""
        with self._lock:
            introspect.check_invariants(self._st)
            check_checkpoints(self._st)
