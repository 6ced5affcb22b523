"""KVCacheManager: the engine-facing API. It orchestrates the tree, pools, policy and storage.

State per layer group g and tier t:

- ``_free[t][g]``: slots holding nothing (a stack);
- ``_queue[t][g]``: cached, unreferenced slots in eviction order (the policy);
- ``_run_at[t][g][slot]`` / ``_idx_at[t][g][slot]``: the tree run and the index in it of the
  block the slot holds (cached blocks);
- ``_ref[g][slot]``: references on GPU slots (one per block-table entry of a sequence).

A GPU slot is in exactly one of: free, queued (cached, ref 0), referenced (ref > 0, cached or
not). A colder-tier slot is free, queued, or claimed for onboarding during one call. Every
public call takes the manager lock, checks everything it needs before changing anything, and
so either completes or raises with the manager unchanged (and no event emitted). A call that
may copy blocks asks the storage first (``Storage.check``: closed, a disk file removed or
truncated), since its copies run after its bookkeeping; a copy that still fails (a disk's I/O
error during the call) leaves the call done and the manager refusing every later copy.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvpool import admission, jit
from kvpool.admission import BatchPlan, PartialMode, RequestPlan
from kvpool.config import DEFAULT_PRIORITY, CacheConfig, SequenceRequest
from kvpool.copies import CopyPlan
from kvpool.emit import Emitter, EventSink, event_algo
from kvpool.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    RewindError,
    SequenceStateError,
    StorageError,
    UnknownSequenceError,
)
from kvpool.events.model import KVCacheEvent
from kvpool.eviction import EvictionPolicy, make_policies
from kvpool.groups import group_kinds
from kvpool.hashing import (
    BlockHasher,
    BlockKey,
    tokens_to_u32,
)
from kvpool.radix import NO_SLOT, Run, Segment, detach, match_full, prune
from kvpool.sequence import Sequence as Seq
from kvpool.slots import SlotPool
from kvpool.stats import CacheStats, RequestStats
from kvpool.storage import BlockCopy, MetadataStorage, Storage
from kvpool.views import PlanView, Scope

if TYPE_CHECKING:
    from kvpool.remote.hooks import ManagerRemote, RemoteStats


@dataclass(slots=True)
class AdmitResult:
    """One admitted request: its reuse, block tables and stats.

    ``block_ids[g][b]`` is beam b's block table in layer group g (-1 = not held: a block a
    sliding window does not need). ``new_blocks[g]`` counts GPU slots the admission took.
    """

    seq_id: int | str
    reused_tokens: int
    block_ids: list[list[list[int]]]
    new_blocks: dict[int, int]
    stats: RequestStats


def _is_index(value: object, size: int) -> bool:
    """Is ``value`` an int (not a bool) in [0, size)?"""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _check_hooks(name: str, obj: object, methods: tuple[str, ...]) -> None:
    """``obj`` is None or has every method of its protocol."""
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if obj is not None and missing:
        raise InvalidArgumentError(f"{name} {obj!r:.60} lacks {', '.join(missing)}")


def _request_list(requests: Iterable[SequenceRequest]) -> list[SequenceRequest]:
    """A batch as a list; a batch that is not a sequence of requests is refused."""
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
        self.config = config
        self.tpb = config.tokens_per_block
        self._clock = config.clock or time.monotonic
        self._lock = threading.RLock()
        groups = config.num_groups
        self.self_groups: tuple[int, ...] = tuple(
            g for g in range(groups) if g not in config.cross_attention_groups
        )
        self._kinds = group_kinds(config)  # one per layer group: what it needs, what it drops
        # no sliding window: a sequence's self-attention tables all have the same length,
        # and decode growth within its last block changes nothing but its tokens
        self.full_attention_only = all(
            config.window_sizes[g] is None for g in self.self_groups
        )
        self._tiers = config.num_tiers
        # one SlotPool per (tier, layer group) owns its free list, references, queue and
        # back-pointers; the lists below are those pools' own containers, per tier and group
        queues: list[list[EvictionPolicy]] = make_policies(config, self._clock)
        self._pools: list[list[SlotPool[Run, EvictionPolicy]]] = [
            [SlotPool(n, q) for n, q in zip(config.slots[t], queues[t], strict=True)]
            for t in range(self._tiers)
        ]
        self.step = 4 * self.tpb  # bytes per full block of tokens in the tree
        self._free = [[p.free for p in tier] for tier in self._pools]
        self._queue = [[p.queue for p in tier] for tier in self._pools]
        self._run_at = [[p.run_at for p in tier] for tier in self._pools]
        self._idx_at = [[p.idx_at for p in tier] for tier in self._pools]
        self._ref = [p.ref for p in self._pools[0]]
        self._held = [[p.held for p in tier] for tier in self._pools]
        # one tree per reuse scope (LoRA id, cache salt): scopes never share a root, whatever
        # the hash algorithm (v1 and vLLM mix the scope into the first block's key, so their
        # root keys are equal across scopes)
        self.roots: dict[Scope, Run] = {}
        self._hashers: dict[Scope, BlockHasher] = {}  # one unfed hasher per reuse scope
        self.sequences: dict[int | str, Seq] = {}
        self._view = PlanView(config, self.roots, self.sequences, self._ref, self._free[0],
                              self._queue[0])
        _check_hooks("storage", storage, ("block_bytes", "close", "copy_blocks", "stats"))
        _check_hooks("events", events, ("on_all_cleared", "on_created", "on_removed",
                                        "on_stored", "on_updated", "flush_iteration_events",
                                        "get_latest_events"))
        if storage is None and config.layer_geometry is not None:
            from kvpool.storage import TorchStorage

            storage = TorchStorage(self.tpb, config.layer_geometry, config.slots,
                                   device=config.device, disk_path=config.disk_path)
        self.storage: Storage = storage or MetadataStorage(self.tpb)
        if events is None and config.event_buffer_max_size > 0:
            from kvpool.events.manager import EventManager

            events = EventManager(config.event_buffer_max_size,
                                  hash_algo=event_algo(config))
        self.events = events
        self._events = events
        self._emit = Emitter(config, events)
        if events is not None:
            # Stored blocks carry TokenIds, which the vLLM encoder writes with a kernel: load it
            # now (once per process) rather than while the first batch waits to be published.
            jit.backend()
        self._copies = CopyPlan()  # the copies of the call in progress
        self._pending_free: list[tuple[int, int, int]] = []  # (tier, group, slot) at call end
        self._new_count = [0] * groups
        self._retention_seen = False  # has any block had a retention priority set?
        self._copy_failure: str | None = None  # what made a copy fail after the checks
        self._stats = CacheStats()
        self._iter_base = CacheStats()
        if events is not None:
            for g in range(groups):
                events.on_created(g, config.window_size(g),
                                  [config.slots[t][g] for t in range(self._tiers)])
        self._remote: ManagerRemote | None = None  # the shared remote tier (kvpool.remote)
        if config.remote_url is not None or config.remote_store is not None:
            from kvpool.remote.hooks import ManagerRemote

            self._remote = ManagerRemote(self)

    def gpu_available(self, g: int) -> int:
        """Free plus evictable GPU slots of group g (no checks: see ``num_free_blocks``)."""
        return self._pools[0][g].available()

    # ------------------------------------------------------------------ admission

    def plan_batch(self, requests: Sequence[SequenceRequest]) -> BatchPlan:
        """What ``add_sequence_batch(requests)`` would reuse and allocate; changes nothing."""
        with self._lock:
            return admission.plan(self._view, _request_list(requests))

    def add_sequence(self, request: SequenceRequest) -> AdmitResult:
        """Admit one request: ``add_sequence_batch([request])[0]``."""
        return self.add_sequence_batch([request])[0]

    def add_sequence_batch(self, requests: Sequence[SequenceRequest]) -> list[AdmitResult]:
        """Admit a scheduler step's new requests in two phases (see :mod:`kvpool.admission`).

        Raises :class:`OutOfBlocksError` with the deficit per (tier, layer group) when the
        batch does not fit, and :class:`StorageError` when it would copy blocks and the
        storage cannot (closed, a disk file removed or truncated); the manager is then
        exactly as before.
        """
        with self._lock:
            plan = admission.plan(self._view, _request_list(requests))
            if not plan.fits:
                detail = ", ".join(
                    f"group {g}: need {plan.new_blocks[g]}, have {plan.available[g]}"
                    for (_, g) in sorted(plan.deficit)
                )
                raise OutOfBlocksError(
                    f"batch of {len(plan.requests)} requests does not fit the GPU pool ({detail})",
                    plan.deficit,
                )
            if self._tiers > 1 or any(p._partial is not None for p in plan.requests):
                self._check_storage()  # the batch may copy: fail before changing anything
            self._new_count = [0] * self.config.num_groups
            takeovers = self._claim(plan)
            results = [self._allocate(p, takeovers) for p in plan.requests]
            self._finish_call(release=[
                p._partial for p in plan.requests
                if p._partial is not None and (id(p._partial[0]), p._partial[1]) not in takeovers
            ])
            return results

    def _claim(self, plan: BatchPlan) -> set[tuple[int, int]]:
        """Phase 1: reference every full match; take partial sources out of the queues."""
        takeovers: set[tuple[int, int]] = set()
        first = True
        for p in plan.requests:
            beams = p.request.beam_width
            for g, slots in p.claim_slots.items():
                tiers = p.claim_tiers[g]
                ref = self._ref[g]
                if not any(tiers):  # all on the GPU (slots are distinct within a request)
                    # the first request claims from the state it was planned against
                    queued = p.queued[g] if first else [s for s in slots if not ref[s]]
                    self._queue[0][g].remove_many(queued)
                    for s in slots:
                        ref[s] += beams
                    continue
                for t, s in zip(tiers, slots, strict=True):
                    if t == 0:
                        if ref[s] == 0:
                            self._queue[0][g].remove(s)
                        ref[s] += beams
                    elif s in self._queue[t][g]:
                        self._queue[t][g].remove(s)  # claimed for onboarding
            first = False
        # partial sources after every full match: a full match of the same block holds it
        for p in plan.requests:
            if p._partial is None:
                continue
            run, i = p._partial
            for g in self.self_groups:
                t, s = run.tier[g][i], run.slot[g][i]
                p.partial_loc[g] = (t, s)
                if s in self._queue[t][g]:
                    self._queue[t][g].remove(s)
            if p.partial_mode is PartialMode.TAKEOVER:
                takeovers.add((id(run), i))
        return takeovers

    def _allocate(self, p: RequestPlan, takeovers: set[tuple[int, int]]) -> AdmitResult:
        """Phase 2 for one request: onboard claims, copy/take over partials, allocate misses."""
        cfg = self.config
        r = p.request
        beams = r.beam_width
        tpb = self.tpb
        d = p.num_matched
        st = RequestStats()
        before = list(self._new_count)
        tables: list[list[list[int]]] = []
        tier_hits = self._stats.tier_hits
        for g in range(cfg.num_groups):
            ref = self._ref[g]
            if self._kinds[g].cross:
                enc = r.encoder_tokens or []
                row = self._alloc_n(g, -(-len(enc) // tpb))
                for s in row:
                    ref[s] += beams
                tables.append([list(row) for _ in range(beams)])
                st.alloc_total += len(row)
                continue
            shared: list[int] = [NO_SLOT] * d
            claimed = p.claimed[g]
            claim_tiers = p.claim_tiers[g]
            if any(claim_tiers):
                blocks = p.blocks()
                for i, claim_tier in zip(claimed, claim_tiers, strict=True):
                    run, j = blocks[i]
                    if claim_tier:  # GPU claims took their reference in phase 1
                        st.onboarded += self._onboard(run, j, g, beams)
                    shared[i] = run.slot[g][j]
                for t in range(1, self._tiers):
                    tier_hits[t] += claim_tiers.count(t)
            elif len(claimed) == d:
                shared = list(p.claim_slots[g])
            else:
                for i, s in zip(claimed, p.claim_slots[g], strict=True):
                    shared[i] = s
            tier_hits[0] += claim_tiers.count(0)
            st.full_reused += len(claimed)
            last = p.num_blocks - 1
            per_beam_last = not p.last_shared
            per_beam: list[list[int]] = [[] for _ in range(beams)]
            if p._partial is not None:
                on_last = per_beam_last and d == last
                copies = beams if on_last else 1
                targets: list[int] = []
                if p.partial_mode is PartialMode.TAKEOVER:
                    targets.append(self._take_over(*p._partial, g, beams))
                    copies -= 1
                src_tier, src_slot = p.partial_loc[g]
                for s in self._alloc_n(g, copies):
                    self._copies.add(BlockCopy(src_tier, src_slot, 0, s, g))
                    ref[s] += 1 if on_last else beams
                    targets.append(s)
                if on_last:
                    for b in range(beams):
                        per_beam[b].append(targets[b])
                else:
                    shared.append(targets[0])
                st.partial_reused += 1
            first_fresh = d + (1 if p._partial is not None else 0)
            n_shared_fresh = p.num_blocks - first_fresh - (1 if per_beam_last else 0)
            if n_shared_fresh > 0:
                fresh = self._alloc_n(g, n_shared_fresh)
                for s in fresh:
                    ref[s] += beams
                shared.extend(fresh)
                st.missed += n_shared_fresh
            if per_beam_last and first_fresh <= last:
                for b, s in enumerate(self._alloc_n(g, beams)):
                    ref[s] += 1
                    per_beam[b].append(s)
                st.missed += 1
            tables.append([shared + per_beam[b] for b in range(beams)])
            st.alloc_total += len(shared) - shared.count(NO_SLOT) + sum(map(len, per_beam))
        st.reused = st.full_reused + st.partial_reused
        new = {g: self._new_count[g] - before[g] for g in range(cfg.num_groups)}
        st.alloc_new = sum(new[g] for g in self.self_groups)
        return self._admitted(r, p.root_key, p._matched, p.reused_tokens, tables, new, st)

    def _admitted(self, r: SequenceRequest, root_key: BlockKey, matched: list[Segment],
                  reused_tokens: int, tables: list[list[list[int]]], new: dict[int, int],
                  st: RequestStats) -> AdmitResult:
        """Register an admitted request's sequence and count it in the stats."""
        keys: list[BlockKey] = []
        for run, a, b in matched:
            keys += run.keys[a:b]
        seq = Seq(
            r.seq_id, array("I", r.tokens), r.beam_width, keys,
            self._root((r.lora_id, r.cache_salt)), root_key, tables,
            lora_id=r.lora_id, cache_salt=r.cache_salt, retention=r.retention,
            encoder_tokens=(
                array("I", r.encoder_tokens) if r.encoder_tokens is not None else None
            ),
        )
        if matched:
            seq.at_run, _, seq.at_len = matched[-1]
        seq.committed_blocks = len(keys)
        self.sequences[r.seq_id] = seq
        stats = self._stats
        stats.add_request(st)
        stats.reused_tokens += reused_tokens
        stats.prompt_tokens += len(r.tokens)
        stats.admitted_requests += 1
        stats.onboard_blocks += st.onboarded
        return AdmitResult(
            seq_id=r.seq_id, reused_tokens=reused_tokens,
            block_ids=[[list(b) for b in t] for t in tables], new_blocks=new, stats=st,
        )

    def _alloc_n(self, g: int, n: int) -> list[int]:
        """``n`` GPU slots of group g (free ones first, then evicted victims)."""
        if n <= 0:
            return []
        pool = self._pools[0][g]
        self._new_count[g] += n
        out = pool.take(n)
        if len(out) == n:
            return out
        free = pool.free
        if self._tiers > 1 or self._copies:
            pop = self._queue[0][g].pop
            while len(out) < n:
                if free:  # an eviction's cascade freed its descendants' slots
                    out.append(free.pop())
                    continue
                s, prio = pop()
                self._evict(0, g, s, prio)
                out.append(s)
            return out
        # GPU only, no copy in flight: the victims are taken in one pop, and a victim that is
        # a leaf's tail just leaves its run. (A victim with queued descendants drops them too;
        # their slots go to the free list, so the call may evict a few more blocks than it
        # needs.) Victims come tail first, so a run losing its tail is truncated once, at the
        # end: until then ``cut`` holds its length (the blocks past it have no slot left), and
        # a run losing every block leaves its parent at once.
        run_at = self._run_at[0][g]
        idx_at = self._idx_at[0][g]
        single = self.config.num_groups == 1
        events = self._events is not None
        victims = self._queue[0][g].pop_many(n - len(out))
        slots = [s for s, _ in victims]
        if single:
            tails = self._leaf_tails(g, slots)
            if tails is not None:
                self._drop_tails(g, tails)
                out += slots
                self._stats.evicted_blocks += len(slots)
                self._stats.dropped_blocks += len(slots)
                return out
        removed: list[BlockKey] = []
        cut: dict[Run, int] = {}
        prev: Run | None = None  # the run the last victim left, and its length now
        prev_n = 0
        slow = 0
        for s, prio in victims:
            run = run_at[s]
            assert run is not None
            i = idx_at[s]
            if (run is not prev or i != prev_n - 1) and (
                    i != cut.get(run, len(run.keys)) - 1 or run.children):
                self._emit.removed(g, removed)  # keep the removed hashes in eviction order
                removed = []
                self._cut_runs(cut)
                cut = {}
                prev = None
                slow += 1
                self._evict(0, g, s, prio)  # counts its own evictions and drops
                continue
            run_at[s] = None
            run.slot[g][i] = NO_SLOT
            if events:
                removed.append(run.keys[i])
            if single or not run.has_slot(i):
                if i:
                    cut[run] = prev_n = i
                    prev = run
                else:  # the whole run left
                    cut.pop(run, None)
                    prev = None
                    detach(run)
            else:
                prev = None
        self._cut_runs(cut)
        out += slots
        self._stats.evicted_blocks += len(victims) - slow
        self._stats.dropped_blocks += len(victims) - slow
        self._emit.removed(g, removed)
        return out

    def _leaf_tails(self, g: int, slots: list[int]) -> list[tuple[Run, int]] | None:
        """If GPU victims ``slots`` (one layer group in all) are, stretch after stretch, the
        tails of leaf runs, tail first (how a released block table leaves the queue): each
        run with the length it keeps. Else None (nothing changed)."""
        run_at = self._run_at[0][g]
        idx_at = self._idx_at[0][g]
        tails: list[tuple[Run, int]] = []
        pos, n = 0, len(slots)
        while pos < n:
            s = slots[pos]
            run = run_at[s]
            if run is None or run.children:
                return None
            i = idx_at[s]
            if i != len(run.keys) - 1:
                return None
            keep = max(0, i + 1 - (n - pos))
            stretch = run.slot[g][keep:]
            stretch.reverse()
            if stretch != slots[pos:pos + i + 1 - keep]:
                return None
            tails.append((run, keep))
            pos += i + 1 - keep
        return tails

    def _drop_tails(self, g: int, tails: list[tuple[Run, int]]) -> None:
        """Evict whole leaf-run tails found by :meth:`_leaf_tails`: what evicting their blocks
        one by one does, a run at a time."""
        run_at = self._run_at[0][g]
        removed: list[BlockKey] = []
        for run, keep in tails:
            sl = run.slot[g]
            for s in sl[keep:]:
                run_at[s] = None
            if self._events is not None:
                gone = run.keys[keep:]
                gone.reverse()
                removed += gone
            if keep:
                run.truncate(keep)
                if not run.has_slot(keep - 1):
                    prune(run)
                continue
            sl[:] = [NO_SLOT] * len(sl)
            detach(run)
        self._emit.removed(g, removed)

    def _cut_runs(self, cut: dict[Run, int]) -> None:
        """Truncate runs to the lengths ``cut`` gives (their tails lost every slot)."""
        for run, n in cut.items():
            if run.alive and n < len(run.keys):
                run.truncate(n)
                if not run.children and not run.has_slot(n - 1):
                    prune(run)

    def _root(self, scope: Scope) -> Run:
        root = self.roots.get(scope)
        if root is None:
            root = self.roots[scope] = Run.root(self.config.num_groups)
        return root

    # ------------------------------------------------------------------ slots and eviction

    def _alloc(self, g: int) -> int:
        """Take a GPU slot of group g (free first, else evict the policy's victim)."""
        self._new_count[g] += 1
        free = self._free[0][g]
        if free:
            return free.pop()
        s, prio = self._queue[0][g].pop()
        self._evict(0, g, s, prio)
        return s

    def _lower_slot(self, t: int, g: int) -> int | None:
        """A slot on colder tier t for an offloaded block, or None if none can be had."""
        free = self._free[t][g]
        if free:
            return free.pop()
        if not len(self._queue[t][g]):
            return None
        s, prio = self._queue[t][g].pop()
        self._evict(t, g, s, prio)
        return s

    def _evict(self, t: int, g: int, slot: int, priority: int, *, offload: bool = True) -> None:
        """The block at (t, g, slot) leaves that slot: offloaded one tier down, or dropped."""
        run = self._run_at[t][g][slot]
        i = self._idx_at[t][g][slot]
        assert run is not None and run.slot[g][i] == slot and run.tier[g][i] == t
        self._pools[t][g].clear(slot)
        self._stats.evicted_blocks += 1
        if (offload and t + 1 < self._tiers and priority >= self.config.offload_min_priority
                and self._queue[t][g].should_offload(slot)):
            s2 = self._lower_slot(t + 1, g)
            if s2 is not None:
                run.tier[g][i] = t + 1
                run.slot[g][i] = s2
                self._pools[t + 1][g].place(s2, run, i)
                self._queue[t + 1][g].push(s2, run.priority(i), key=run.keys[i])
                self._copies.add(BlockCopy(t, slot, t + 1, s2, g))
                self._stats.offload_blocks += 1
                self._stats.offload_bytes += self.storage.block_bytes(g)
                self._emit.updated(g, run.keys[i], t, t + 1)
                return
        if offload and self._remote is not None:  # remote tier: the block leaves local tiers
            self._remote.dropped(t, g, slot, run, i)
        if self._copies:
            self._copies.cancel_into(t, g, slot)
        run.slot[g][i] = NO_SLOT
        run.tier[g][i] = 0
        self._stats.dropped_blocks += 1
        if i == len(run.keys) - 1 and not run.children:  # the common case: tails go first
            if self._events is not None:
                self._emit.removed(g, [run.keys[i]])
            if not run.has_slot(i):
                prune(run)
            return
        removed = [run.keys[i]]
        if not self._kinds[g].windowed:
            # A full-attention block without its prefix cannot be matched: drop the subtree's
            # queued blocks. Held or claimed ones stay (a sequence that computed a duplicate of
            # an ancestor holds its own copy) and are queued, unreachable, once released.
            for r, j in self._blocks_below(run, i):
                ds = r.slot[g][j]
                if ds == NO_SLOT:
                    continue
                dt = r.tier[g][j]
                q = self._queue[dt][g]
                if ds not in q:
                    continue
                q.remove(ds)
                if offload and self._remote is not None:  # remote tier, as above
                    self._remote.dropped(dt, g, ds, r, j)
                self._copies.cancel_into(dt, g, ds)
                self._pools[dt][g].clear(ds)
                self._free[dt][g].append(ds)
                r.slot[g][j] = NO_SLOT
                r.tier[g][j] = 0
                self._stats.dropped_blocks += 1
                removed.append(r.keys[j])
        self._emit.removed(g, removed)
        self._prune_subtree(run)

    @staticmethod
    def _blocks_below(run: Run, i: int) -> list[tuple[Run, int]]:
        """Every block below block i of ``run``: the rest of the run, then the runs under it
        (depth first, parents before children)."""
        out = [(run, j) for j in range(i + 1, len(run.keys))]
        for r in run.descendants():
            out += [(r, j) for j in range(len(r.keys))]
        return out

    def _prune_subtree(self, run: Run) -> None:
        """Drop slotless blocks without children below and in ``run``, then upwards."""
        order = [run, *run.descendants()]
        for r in reversed(order):  # children before parents
            if r.alive and not r.children:
                prune(r)
        prune(run if run.alive else run.parent)

    def _onboard(self, run: Run, i: int, g: int, refs: int) -> int:
        """Bring a claimed block up to the GPU with ``refs`` references; returns 1 if it moved
        now, 0 if an earlier request of the batch already brought it up."""
        t, s = run.tier[g][i], run.slot[g][i]
        if t == 0:
            self._ref[g][s] += refs
            return 0
        new = self._alloc(g)
        self._copies.add(BlockCopy(t, s, 0, new, g))
        self._pools[t][g].clear(s)
        if s not in self._held[t][g]:
            self._pending_free.append((t, g, s))
        # else: a suspended sequence holds that copy; it stays held, no longer cached
        run.tier[g][i] = 0
        run.slot[g][i] = new
        self._pools[0][g].place(new, run, i)
        self._ref[g][new] = refs
        self._stats.onboard_bytes += self.storage.block_bytes(g)
        self._emit.updated(g, run.keys[i], t, 0)
        return 1

    def _take_over(self, run: Run, i: int, g: int, refs: int) -> int:
        """The request adopts an unreferenced leaf's slot in place; the block leaves the tree."""
        s = run.slot[g][i]
        assert run.tier[g][i] == 0 and self._ref[g][s] == 0
        self._pools[0][g].clear(s)
        run.slot[g][i] = NO_SLOT
        self._ref[g][s] = refs
        self._emit.removed(g, [run.keys[i]])
        if not run.has_slot(i):
            prune(run)
        return s

    def _finish_call(self, release: Iterable[tuple[Run, int]] = ()) -> None:
        """End of a mutating call: release claimed partial sources, free onboarded colder
        slots, and move the data of every copy the call made, batched per tier pair."""
        for run, i in release:
            for g in self.self_groups:
                t, s = run.tier[g][i], run.slot[g][i]
                if s == NO_SLOT or s in self._queue[t][g] or s in self._held[t][g]:
                    continue
                if t == 0 and self._ref[g][s] > 0:
                    continue  # a full match holds it: the release is cancelled
                if self._run_at[t][g][s] is run and self._idx_at[t][g][s] == i:
                    self._queue[t][g].push(s, run.priority(i), key=run.keys[i])
        for t, g, s in self._pending_free:
            self._free[t][g].append(s)
        self._pending_free.clear()
        self._emit.flush_removed()
        if self._remote is not None:  # remote tier: snapshot what leaves, before copies
            self._remote.before_copies()
        copies = self._copies.take()
        if copies:
            self._copy(copies)

    def _check_storage(self) -> None:
        """Before changing anything in a call that may copy: raise StorageError if the copies
        could not run (the storage closed, a disk file removed or truncated)."""
        if self._copy_failure is not None:
            raise StorageError(
                f"an earlier copy failed ({self._copy_failure}); the blocks it was moving lost "
                "their bytes, so this manager copies nothing more: build a new one"
            )
        check = getattr(self.storage, "check", None)  # a storage written before check() existed
        if check is not None:
            check()

    def _copy(self, copies: list[BlockCopy]) -> None:
        """Run a call's copies. The call checked the storage before changing anything, so a
        failure here is one no check could see coming (a disk's I/O error, a file truncated
        during the call): the call's bookkeeping is done but some blocks lack their bytes, so
        every later call that may copy raises StorageError (no block whose bytes were lost is
        ever served) and the engine builds a new manager."""
        try:
            self.storage.copy_blocks(copies)
        except Exception as exc:
            self._copy_failure = repr(exc)
            if isinstance(exc, StorageError):
                raise
            raise StorageError(f"copying blocks failed: {exc!r}") from exc

    # ------------------------------------------------------------------ events

    def flush_iteration_events(self) -> None:
        """Publish this step's events (no-op without events)."""
        if self._events is not None:
            self._events.flush_iteration_events()

    def get_latest_events(self, timeout_s: float | None = 0) -> list[KVCacheEvent]:
        """Published events not read yet (see ``EventManager.get_latest_events``)."""
        if self._events is None:
            return []
        return self._events.get_latest_events(timeout_s)

    def cached_blocks(self) -> set[tuple[int | str, int, int]]:
        """(event hash, layer group, tier) of every cached block: what events describe."""
        with self._lock:
            out: set[tuple[int | str, int, int]] = set()
            for root in self.roots.values():
                for r in root.descendants():
                    hashes = self._emit.hashes(r.keys)
                    for g, slots in enumerate(r.slot):
                        tiers = r.tier[g]
                        for j, s in enumerate(slots):
                            if s != NO_SLOT:
                                out.add((hashes[j], g, tiers[j]))
            return out

    # ------------------------------------------------------------------ growth and release

    def _seq(self, seq_id: int | str) -> Seq:
        try:
            return self.sequences[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def _active(self, seq_id: int | str) -> Seq:
        seq = self._seq(seq_id)
        if seq.suspended:
            raise SequenceStateError(f"sequence {seq_id!r} is suspended; resume it first")
        return seq

    def _stale_limit(self, g: int, length: int) -> int:
        """Blocks [first_kept, limit) of group g are stale at ``length`` tokens (kvpool.groups)."""
        return self._kinds[g].stale_limit(length)

    def needed_blocks_one_step(self, seq_id: int | str, num_new_tokens: int = 1) -> dict[int, int]:
        """GPU slots per layer group that growing by ``num_new_tokens`` tokens would take."""
        with self._lock:
            seq = self._seq(seq_id)
            if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) \
                    or num_new_tokens < 0:
                raise InvalidArgumentError(f"num_new_tokens must be >= 0, got {num_new_tokens!r}")
            return self._growth(seq, seq.num_tokens + num_new_tokens)[0]

    def _growth(self, seq: Seq, new_len: int) -> tuple[dict[int, int], dict[int, int]]:
        """(new slots needed, slots freed to the pool by window release) per group."""
        need: dict[int, int] = {}
        freed: dict[int, int] = {}
        blocks_after = -(-new_len // self.tpb)
        for g in range(self.config.num_groups):
            if self._kinds[g].cross:
                need[g] = freed[g] = 0
                continue
            table = seq.tables[g][0]
            add = max(0, blocks_after - len(table))
            # blocks that become per-beam: with beams, new blocks are per beam
            need[g] = add * seq.beam_width
            released = 0
            limit = self._stale_limit(g, seq.num_tokens + 1)
            counts: dict[int, int] = {}
            for b in range(seq.beam_width):
                tb = seq.tables[g][b]
                for i in range(self._kinds[g].first_kept, min(limit, len(tb))):
                    s = tb[i]
                    if s != NO_SLOT:
                        counts[s] = counts.get(s, 0) + 1
            for s, c in counts.items():
                if self._ref[g][s] == c:
                    released += 1
            freed[g] = released
        return need, freed

    def add_tokens(self, seq_id: int | str, token_ids: Sequence[int]) -> None:
        """Grow a sequence by ``token_ids`` (decode; several for speculative decoding).

        Allocates a block at each block boundary (per beam), and releases blocks that left a
        sliding window (sink blocks stay) as seen from the first new token, whose KV the next
        step computes. All or nothing: raises :class:`OutOfBlocksError` with the manager
        unchanged when the pool cannot provide the blocks (and :class:`StorageError` when an
        eviction would offload and the storage cannot copy).
        """
        with self._lock:
            seq = self._active(seq_id)
            toks = tokens_to_u32(token_ids)
            if not toks:
                return
            new_len = seq.num_tokens + len(toks)
            if (self.full_attention_only
                    and new_len <= len(seq.tables[self.self_groups[0]][0]) * self.tpb):
                # the common decode step: the tokens fit the blocks held, no window moves
                seq.tokens.extend(toks)
                return
            need, freed = self._growth(seq, new_len)
            deficit = {
                (0, g): need[g] - freed[g] - self.gpu_available(g)
                for g in need
                if need[g] > freed[g] + self.gpu_available(g)
            }
            if deficit:
                raise OutOfBlocksError(
                    f"sequence {seq_id!r} cannot grow to {new_len} tokens: missing "
                    + ", ".join(f"{v} slots in group {g}" for (_, g), v in sorted(deficit.items())),
                    deficit,
                )
            if self._tiers > 1:
                self._check_storage()  # evictions may offload: fail before changing anything
            self._new_count = [0] * self.config.num_groups
            for g in range(self.config.num_groups):
                if self._kinds[g].cross:
                    continue
                # The step computes the new tokens' KV; its first token still attends back a
                # window from the old end, so staleness is judged at old length + 1.
                self._release_stale(seq, g, seq.num_tokens + 1)
            blocks_after = -(-new_len // self.tpb)
            for g in range(self.config.num_groups):
                if self._kinds[g].cross:
                    continue
                for b in range(seq.beam_width):
                    tb = seq.tables[g][b]
                    while len(tb) < blocks_after:
                        s = self._alloc(g)
                        self._ref[g][s] += 1
                        tb.append(s)
            seq.tokens.extend(toks)
            self._finish_call()

    def _release_stale(self, seq: Seq, g: int, length: int) -> None:
        limit = self._stale_limit(g, length)
        for b in range(seq.beam_width):
            tb = seq.tables[g][b]
            for i in range(self._kinds[g].first_kept, min(limit, len(tb))):
                s = tb[i]
                if s != NO_SLOT:
                    self._unref(g, s)
                    tb[i] = NO_SLOT

    def _unref(self, g: int, s: int) -> None:
        ref = self._ref[g]
        ref[s] -= 1
        assert ref[s] >= 0
        if ref[s] == 0:
            run = self._run_at[0][g][s]
            if run is None:
                self._free[0][g].append(s)
            else:
                i = self._idx_at[0][g][s]
                dur = run.duration(i)
                expires = self._clock() + dur if dur is not None else None
                self._queue[0][g].push(s, run.priority(i), expires, run.keys[i])

    def _unref_many(self, g: int, slots: list[int]) -> None:
        """Drop one reference on each slot of a block table (NO_SLOT entries skipped).

        Cached blocks whose last reference goes join the eviction queue tail first, so that
        within one release a sequence's tail is evicted before its head: evicting a head block
        would take every block after it along (a full-attention block without its prefix
        cannot be matched). Uncached blocks become free.
        """
        run_at = self._run_at[0][g]
        idx_at = self._idx_at[0][g]
        queue = self._queue[0][g]
        if NO_SLOT in slots:
            slots = [s for s in slots if s != NO_SLOT]
        gone = self._pools[0][g].drop(slots)
        if not gone:
            return
        runs = [run_at[s] for s in gone]
        free = self._free[0][g]
        if None in runs:  # blocks never committed (a partial last block, say) become free
            free += [s for s, r in zip(gone, runs, strict=True) if r is None]
            gone = [s for s, r in zip(gone, runs, strict=True) if r is not None]
            runs = [r for r in runs if r is not None]
        cached = cast("list[Run]", runs)
        if not gone:
            return
        if not self._retention_seen or all(r.prio is None for r in cached):
            # the common case: default priority, no duration
            if queue.uses_keys:
                keys = [r.keys[idx_at[s]] for r, s in zip(cached, gone, strict=True)]
                queue.push_many(gone, DEFAULT_PRIORITY, keys)
            else:
                queue.push_many(gone, DEFAULT_PRIORITY)
            return
        batch: list[int] = []
        batch_keys: list[BlockKey] = []
        batch_prio = -1
        for s, run in zip(gone, cached, strict=True):
            i = idx_at[s]
            prio = run.priority(i)
            dur = run.duration(i)
            if batch and (dur is not None or prio != batch_prio):
                queue.push_many(batch, batch_prio, batch_keys)
                batch, batch_keys = [], []
            if dur is not None:
                queue.push(s, prio, self._clock() + dur, run.keys[i])
                continue
            batch_prio = prio
            batch.append(s)
            batch_keys.append(run.keys[i])
        if batch:
            queue.push_many(batch, batch_prio, batch_keys)

    def rewind_tokens(self, seq_id: int | str, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens (rejected speculative tokens).

        Releases blocks that become empty. Never goes below the committed length (the prompt
        and any stored block); raises :class:`RewindError` otherwise, or when a sliding
        window would need a block it already released.
        """
        with self._lock:
            seq = self._active(seq_id)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
                raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
            new_len = seq.num_tokens - num_tokens
            floor = max(seq.committed_floor, seq.committed_blocks * self.tpb)
            if new_len < floor:
                raise RewindError(
                    f"cannot rewind sequence {seq_id!r} by {num_tokens} tokens to {new_len}: "
                    f"its first {floor} tokens are committed"
                )
            for g in self.self_groups:
                if not self._kinds[g].windowed:
                    continue
                limit = self._stale_limit(g, new_len)
                tb = seq.tables[g][0]
                keep = -(-new_len // self.tpb)
                for i in range(max(limit, self._kinds[g].first_kept), min(keep, len(tb))):
                    if tb[i] == NO_SLOT:
                        raise RewindError(
                            f"cannot rewind sequence {seq_id!r} to {new_len} tokens: layer "
                            f"group {g} already released block {i} of its window"
                        )
            keep = -(-new_len // self.tpb)
            for g in self.self_groups:
                for b in range(seq.beam_width):
                    tb = seq.tables[g][b]
                    while len(tb) > keep:
                        s = tb.pop()
                        if s != NO_SLOT:
                            self._unref(g, s)
            del seq.tokens[new_len:]

    # ------------------------------------------------------------------ committing for reuse

    def store_context_blocks(self, seq_id: int | str, num_computed_tokens: int) -> None:
        """Commit the full blocks within the first ``num_computed_tokens`` tokens for reuse."""
        with self._lock:
            seq = self._active(seq_id)
            if (isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int)
                    or not 0 <= num_computed_tokens <= seq.num_tokens):
                raise InvalidArgumentError(
                    f"num_computed_tokens must be in [0, {seq.num_tokens}], "
                    f"got {num_computed_tokens!r}"
                )
            self._commit(seq, num_computed_tokens // self.tpb)
            self._finish_call()

    def _hasher_after(self, seq: Seq, blocks: int) -> BlockHasher:
        """A hasher positioned after the sequence's first ``blocks`` full blocks."""
        scope = (seq.lora_id, seq.cache_salt)
        proto = self._hashers.get(scope)
        if proto is None:
            proto = self._hashers[scope] = BlockHasher(
                self.config.hash_algo, self.tpb, lora_id=seq.lora_id, cache_salt=seq.cache_salt,
                root=seq.root_key)
        return proto.resumed(seq.keys[:blocks] if blocks < len(seq.keys) else seq.keys)

    def _position(self, seq: Seq, blocks: int, *, rebuild: bool = True) -> tuple[Run, int] | None:
        """Where the sequence's first ``blocks`` committed blocks end in the tree: (run, n),
        after block n - 1 of run (n = 0 only at the root).

        ``seq.at_run``/``at_len`` remember where the committed blocks end; a split or an
        eviction may have moved or dropped them since, which the block's key tells. Then the
        path is walked again by tokens, and with ``rebuild`` blocks a prune removed are
        recreated as path blocks (their keys are still valid; only slots were lost);
        without it, None.
        """
        run, n = seq.at_run, seq.at_len
        c = seq.committed_blocks
        if not (run.alive and len(run.keys) >= n
                and (run is seq.root if n == 0 else run.keys[n - 1] == seq.keys[c - 1])):
            found = self._walk_path(seq, c, rebuild)
            if found is None:
                return None
            run, n = seq.at_run, seq.at_len = found
        back = c - blocks
        while back > n:  # walk up to an earlier block of the path
            back -= n
            parent = run.parent
            assert parent is not None
            run, n = parent, len(parent.keys)
        return run, n - back

    def _walk_path(self, seq: Seq, blocks: int, rebuild: bool) -> tuple[Run, int] | None:
        """Where the sequence's first ``blocks`` blocks end in the tree, found by their tokens
        (``radix.match_full``, the walk admission uses too); with ``rebuild`` the blocks past
        the match are recreated as a path run without slots, else None."""
        root = seq.root = self._root((seq.lora_id, seq.cache_salt))
        path = match_full(root, seq.tokens.tobytes(), blocks, self.step)
        run, n = (path[-1][0], path[-1][2]) if path else (root, 0)
        d = sum(b - a for _, a, b in path)
        if d == blocks:
            return run, n
        if not rebuild:
            return None
        slots = [[NO_SLOT] * (blocks - d) for _ in range(self.config.num_groups)]
        return self._new_run(seq, run, n, d, blocks, slots), blocks - d

    def _new_run(self, seq: Seq, run: Run, n: int, first: int, upto: int,
                 slots: list[list[int]], keys: list[BlockKey] | None = None) -> Run:
        """Blocks [first, upto) of ``seq`` (keys known, or given) as a new run after block
        n - 1 of ``run`` (split there if needed), holding ``slots`` per group (GPU)."""
        step = self.step
        if n < len(run.keys):
            self._reindex(run.split(n, step))
        tk = seq.tokens[first * self.tpb:upto * self.tpb].tobytes()
        new = Run(run, tk, tk[:step], seq.keys[first:upto] if keys is None else keys, slots,
                  [[0] * (upto - first) for _ in slots])
        run.add_child(new)
        if seq.retention is not None:
            for j in range(upto - first):
                self._set_priority(seq, new, j, (first + j) * self.tpb)
        return new

    def _reindex(self, run: Run) -> None:
        """Point the slots of ``run``'s blocks at it (after a split renumbered them)."""
        for g, slots in enumerate(run.slot):
            tiers = run.tier[g]
            if not any(tiers):
                self._pools[0][g].place_all(slots, run)
                continue
            for j, s in enumerate(slots):
                if s != NO_SLOT:
                    self._pools[tiers[j]][g].place(s, run, j)

    def _commit(self, seq: Seq, upto: int) -> None:
        """Insert the sequence's full blocks [committed, upto) into the tree (beam 0).

        Blocks already in the tree (another sequence committed them) are found by their
        tokens; after the first block that is not, every later one is new too (its parent
        is): they are added at once, their keys computed in one chained batch, as one new
        run (or appended to the run this sequence's previous commit made, when nothing
        branched from it since).
        """
        start = seq.committed_blocks
        if not self.config.enable_block_reuse or upto <= start:
            return
        pos = self._position(seq, start)
        assert pos is not None
        run, n = pos
        step = self.step
        run_at = self._run_at[0]
        idx_at = self._idx_at[0]
        events = self._events is not None
        chains: dict[int, list[Segment]] = {}  # per group: the stored chain still open
        raw = seq.tokens.tobytes()
        keys = seq.keys
        group_tables = [(g, seq.tables[g][0]) for g in self.self_groups]
        i = start
        while i < upto:  # blocks another sequence committed already
            blk = raw[i * step:(i + 1) * step]
            if n < len(run.keys):
                if run.tkey[n * step:(n + 1) * step] != blk:
                    break
            else:
                child = run.children.get(blk)
                if child is None:
                    break
                run, n = child, 0
            keys.append(run.keys[n])
            for g, tb in group_tables:
                s = tb[i] if i < len(tb) else NO_SLOT
                if s != NO_SLOT and run.slot[g][n] == NO_SLOT and run_at[g][s] is None:
                    run.slot[g][n] = s
                    run.tier[g][n] = 0
                    run_at[g][s] = run
                    idx_at[g][s] = n
                    if events:
                        chain = chains.setdefault(g, [])
                        if chain and chain[-1][0] is run and chain[-1][2] == n:
                            chain[-1] = (run, chain[-1][1], n + 1)
                        else:
                            chain.append((run, n, n + 1))
                elif events and g in chains:
                    self._emit.stored(g, chains.pop(g), seq.lora_id)
            n += 1
            i += 1
        if i < upto:  # new blocks: a chain after block n - 1 of ``run``
            first = i
            k = upto - first
            new_keys = self._hasher_after(seq, first).extend(seq.tokens[first * self.tpb:
                                                                         upto * self.tpb])
            keys.extend(new_keys)
            slots: list[list[int]] = []
            for g in range(self.config.num_groups):
                if self._kinds[g].cross:
                    slots.append([NO_SLOT] * k)
                    continue
                tb = seq.tables[g][0]
                sl = tb[first:upto]
                if len(sl) < k:
                    sl += [NO_SLOT] * (k - len(sl))
                na = run_at[g]
                slots.append([s if s != NO_SLOT and na[s] is None else NO_SLOT for s in sl])
            if (run is seq.own_run and run.alive and n == len(run.keys) and not run.children
                    and len(run.ckey) == step):
                base = n
                run.extend(raw[first * step:upto * step], new_keys, slots,
                           [[0] * k for _ in slots], step)
                if seq.retention is not None:
                    for j in range(k):
                        self._set_priority(seq, run, base + j, (first + j) * self.tpb)
            else:
                base = 0
                run = self._new_run(seq, run, n, first, upto, slots, new_keys)
            seq.own_run = run
            for g in self.self_groups:
                na, ia = run_at[g], idx_at[g]
                sl = slots[g]
                if not events and NO_SLOT not in sl:  # the common case, in two C-speed loops
                    for s in sl:
                        na[s] = run
                    for j, s in enumerate(sl, base):
                        ia[s] = j
                    continue
                # a chain still open ends at the block just before the new ones
                piece = chains.pop(g, [])
                start = -1  # first block of the stretch being stored
                for j, s in enumerate(sl, base):
                    if s != NO_SLOT:
                        na[s] = run
                        ia[s] = j
                        if start < 0:
                            start = j
                        continue
                    if start >= 0:
                        piece.append((run, start, j))
                        start = -1
                    if piece and events:
                        self._emit.stored(g, piece, seq.lora_id)
                    piece = []
                if start >= 0:
                    piece.append((run, start, base + k))
                if piece and events:
                    chains[g] = piece
            n = base + k
        for g, chain in chains.items():
            self._emit.stored(g, chain, seq.lora_id)
        if self._remote is not None:  # remote tier: write-through of committed blocks
            self._remote.stored(seq, seq.committed_blocks, upto)
        seq.committed_blocks = upto
        seq.at_run, seq.at_len = run, n
        if n == len(run.keys) and not run.children and not run.has_slot(n - 1):
            prune(run)

    def _set_priority(self, seq: Seq, run: Run, i: int, first_token: int) -> None:
        ret = seq.retention
        if ret is None:
            return
        self._retention_seen = True
        if first_token >= seq.prompt_len:
            run.set_retention(i, ret.decode_priority, ret.decode_duration_s)
        else:
            run.set_retention(i, *ret.block_priority(first_token))

    def remove_sequence(self, seq_id: int | str, *, store_for_reuse: bool = True) -> None:
        """Release a finished sequence; with ``store_for_reuse`` commit what it computed first
        (full blocks including generated tokens, and the trailing partial block when partial
        reuse is on). Its blocks stay cached until evicted. A suspended sequence (an aborted
        preempted request) commits nothing new; its held colder-tier blocks are released."""
        with self._lock:
            seq = self._seq(seq_id)
            if seq.suspended:
                self._release_moved(seq)
            elif store_for_reuse and self.config.enable_block_reuse:
                computed = seq.num_tokens - (1 if seq.num_tokens > seq.prompt_len else 0)
                self._commit(seq, computed // self.tpb)
                if self.config.enable_partial_reuse and computed % self.tpb:
                    self._commit_partial(seq, computed)
            for g in range(self.config.num_groups):
                for tb in seq.tables[g]:
                    self._unref_many(g, tb)
            del self.sequences[seq_id]
            self._finish_call()

    def _commit_partial(self, seq: Seq, computed: int) -> None:
        """Store the trailing partial block as a leaf keyed by its (short) token chain."""
        full = computed // self.tpb
        if seq.committed_blocks < full:
            return
        pos = self._position(seq, full, rebuild=False)
        if pos is None:
            return
        run, n = pos
        tokens = seq.tokens[full * self.tpb:computed]
        tk = tokens.tobytes()
        if n == len(run.keys) and tk in run.children:
            return
        stored = []
        slots: list[list[int]] = []
        for g in range(self.config.num_groups):
            s = NO_SLOT
            if g in self.self_groups:
                tb = seq.tables[g][0]
                s = tb[full] if full < len(tb) else NO_SLOT
                if s != NO_SLOT and self._run_at[0][g][s] is not None:
                    s = NO_SLOT
            if s != NO_SLOT:
                stored.append(g)
            slots.append([s])
        if not stored:
            return
        if n < len(run.keys):
            self._reindex(run.split(n, self.step))
        key = self._hasher_after(seq, full).key_of_prefix_block(tokens)
        leaf = Run(run, tk, tk, [key], slots, [[0] for _ in slots])
        run.add_child(leaf)
        self._set_priority(seq, leaf, 0, full * self.tpb)
        for g in stored:
            s = slots[g][0]
            self._pools[0][g].place(s, leaf, 0)
            self._emit.stored(g, [(leaf, 0, 1)], seq.lora_id)

    # ------------------------------------------------------------------ preemption

    def suspend(self, seq_id: int | str) -> dict[int, int]:
        """Preempt a sequence without losing its KV.

        Blocks only this sequence holds move to the host tier (when there is one and it can
        make room) and stay held there: they are never evicted or dropped. Blocks shared with
        other sequences stay on the GPU. Returns the GPU slots freed per layer group. Raises
        :class:`StorageError` (nothing changed) when there is a host tier and the storage
        cannot copy.
        """
        with self._lock:
            seq = self._seq(seq_id)
            if seq.suspended:
                raise SequenceStateError(f"sequence {seq_id!r} is already suspended")
            freed = dict.fromkeys(range(self.config.num_groups), 0)
            if self._tiers > 1:
                self._check_storage()
                for g in range(self.config.num_groups):
                    positions: dict[int, list[tuple[int, int]]] = {}
                    for b, tb in enumerate(seq.tables[g]):
                        for i, s in enumerate(tb):
                            if s != NO_SLOT:
                                positions.setdefault(s, []).append((b, i))
                    for s, pos in positions.items():
                        if self._ref[g][s] != len(pos):
                            continue  # shared with another sequence: stays on the GPU
                        h = self._lower_slot(1, g)
                        if h is None:
                            continue  # no room below: stays on the GPU, still held
                        self._copies.add(BlockCopy(0, s, 1, h, g))
                        run = self._run_at[0][g][s]
                        if run is not None:
                            i = self._idx_at[0][g][s]
                            self._pools[0][g].clear(s)
                            run.tier[g][i], run.slot[g][i] = 1, h
                            self._pools[1][g].place(h, run, i)
                            self._emit.updated(g, run.keys[i], 0, 1)
                        self._held[1][g].add(h)
                        self._ref[g][s] = 0
                        self._free[0][g].append(s)
                        for b, i in pos:
                            seq.tables[g][b][i] = NO_SLOT
                        seq.moved[(g, s)] = (1, h, pos)
                        freed[g] += 1
                        self._stats.offload_blocks += 1
                        self._stats.offload_bytes += self.storage.block_bytes(g)
            seq.suspended = True
            self._finish_call()
            return freed

    def resume(self, seq_id: int | str) -> None:
        """Bring a suspended sequence back: its moved blocks are copied up to the GPU.

        Raises :class:`OutOfBlocksError` (nothing changed) when the GPU cannot take them, and
        :class:`StorageError` (nothing changed) when the storage cannot copy them.
        """
        with self._lock:
            seq = self._seq(seq_id)
            if not seq.suspended:
                raise SequenceStateError(f"sequence {seq_id!r} is not suspended")
            need = dict.fromkeys(range(self.config.num_groups), 0)
            for g, _ in seq.moved:
                need[g] += 1
            deficit = {(0, g): n - self.gpu_available(g) for g, n in need.items()
                       if n > self.gpu_available(g)}
            if deficit:
                raise OutOfBlocksError(
                    f"cannot resume sequence {seq_id!r}: missing "
                    + ", ".join(f"{v} slots in group {g}" for (_, g), v in sorted(deficit.items())),
                    deficit,
                )
            if seq.moved:
                self._check_storage()
            self._new_count = [0] * self.config.num_groups
            for (g, _), (t, h, pos) in seq.moved.items():
                new = self._alloc(g)
                self._copies.add(BlockCopy(t, h, 0, new, g))
                run = self._run_at[t][g][h]
                if run is not None:
                    i = self._idx_at[t][g][h]
                    self._pools[t][g].clear(h)
                    run.tier[g][i], run.slot[g][i] = 0, new
                    self._pools[0][g].place(new, run, i)
                    self._emit.updated(g, run.keys[i], t, 0)
                self._held[t][g].discard(h)
                self._pending_free.append((t, g, h))
                self._ref[g][new] = len(pos)
                for b, i in pos:
                    seq.tables[g][b][i] = new
                self._stats.onboard_blocks += 1
                self._stats.onboard_bytes += self.storage.block_bytes(g)
            seq.moved.clear()
            seq.suspended = False
            self._finish_call()

    def _release_moved(self, seq: Seq) -> None:
        for (g, _), (t, h, _pos) in seq.moved.items():
            self._held[t][g].discard(h)
            run = self._run_at[t][g][h]
            if run is None:
                self._free[t][g].append(h)
            else:
                i = self._idx_at[t][g][h]
                self._queue[t][g].push(h, run.priority(i), key=run.keys[i])
        seq.moved.clear()
        seq.suspended = False

    def tensors(self, layer_group: int, tier: int = 0) -> Any:
        """The KV pool of one layer group and tier, for attention kernels:
        ``[slots, layers, 2, tokens_per_block, kv_heads, head_dim]`` (torch storage only)."""
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
            self.storage.close()

    # ------------------------------------------------------------------ remote tier

    def prefetch(self, requests: Iterable[SequenceRequest]) -> list[int]:
        """Pull each request's longest remote-resident continuation of its local match into
        local slots (host tier, else GPU), before admission; tokens made local per request
        (all 0 without a remote tier). See :mod:`kvpool.remote.prefetch`."""
        if self._remote is None:
            return [0 for _ in _request_list(requests)]
        from kvpool.remote.prefetch import prefetch

        return prefetch(self, self._remote, requests)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until every block handed to the remote tier so far is written (or failed, or
        dropped by a full queue); False if ``timeout_s`` passed first. True without one."""
        return True if self._remote is None else self._remote.flush(timeout_s)

    def remote_stats(self) -> RemoteStats | None:
        """The remote tier's counters (None without one)."""
        with self._lock:
            return None if self._remote is None else self._remote.snapshot()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear_cache(self) -> int:
        """Drop every cached block no sequence holds, on every tier; returns how many."""
        with self._lock:
            dropped = self._stats.dropped_blocks
            for t in range(self._tiers):
                for g in range(self.config.num_groups):
                    q = self._queue[t][g]
                    while len(q):
                        s, prio = q.pop()
                        self._evict(t, g, s, prio, offload=False)
                        self._free[t][g].append(s)
            self._finish_call()
            return self._stats.dropped_blocks - dropped

    # ------------------------------------------------------------------ queries

    def block_ids(self, seq_id: int | str, layer_group: int = 0, beam: int = 0) -> list[int]:
        """Beam ``beam``'s block table in ``layer_group`` (-1 = block not held)."""
        with self._lock:
            seq = self._seq(seq_id)
            if not _is_index(layer_group, self.config.num_groups):
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            if not _is_index(beam, seq.beam_width):
                raise InvalidArgumentError(
                    f"beam {beam!r} out of range for beam width {seq.beam_width}"
                )
            return list(seq.tables[layer_group][beam])

    def count_reusable_tokens(
        self, tokens: Sequence[int], *, lora_id: int | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens a request with this prompt would reuse now (what ``plan_batch`` says)."""
        with self._lock:
            enc = [0] if self.config.cross_attention_groups else None
            req = SequenceRequest("__count__", tokens, lora_id=lora_id, cache_salt=cache_salt,
                                  encoder_tokens=enc)
            _, matched, _, k, _ = admission.walk(self._view, req)
            return sum(b - a for _, a, b in matched) * self.tpb + k

    def num_free_blocks(self, layer_group: int = 0) -> int:
        """Free plus evictable GPU slots of a layer group."""
        with self._lock:
            if not _is_index(layer_group, self.config.num_groups):
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            return self.gpu_available(layer_group)

    def slot_usage(self, tier: int = 0, layer_group: int = 0) -> dict[str, int]:
        """used / free / evictable slots of one pool."""
        with self._lock:
            if not (_is_index(tier, self._tiers)
                    and _is_index(layer_group, self.config.num_groups)):
                raise InvalidArgumentError(f"unknown pool (tier {tier}, group {layer_group})")
            total = self.config.slots[tier][layer_group]
            free = len(self._free[tier][layer_group])
            evictable = len(self._queue[tier][layer_group])
            return {"total": total, "free": free, "evictable": evictable,
                    "used": total - free - evictable}

    def stats(self) -> CacheStats:
        """Totals since the manager was created."""
        with self._lock:
            return self._stats.copy()

    def iteration_stats(self) -> CacheStats:
        """Totals since the previous call (and resets the iteration)."""
        with self._lock:
            now = self._stats.copy()
            out = now.minus(self._iter_base)
            self._iter_base = now
            return out

    def _blocks(self) -> list[tuple[Scope, Run, int]]:
        """(scope, run, index) of every block in the tree."""
        out: list[tuple[Scope, Run, int]] = []
        for rk, root in self.roots.items():
            for r in root.descendants():
                out += [(rk, r, j) for j in range(len(r.keys))]
        return out

    def tree_blocks(self) -> list[tuple[array[int], list[int], list[int]]]:
        """(tokens up to and including the block, slot per group, tier per group) of every
        block in the tree; for tests and introspection (O(tree))."""
        with self._lock:
            out: list[tuple[array[int], list[int], list[int]]] = []
            step = self.step
            for _, r, j in self._blocks():
                chain = [r.tkey[:(j + 1) * step]]
                p = r.parent
                while p is not None:
                    chain.append(p.tkey[:len(p.keys) * step])
                    p = p.parent
                toks = array("I")
                toks.frombytes(b"".join(reversed(chain)))
                out.append((toks, [sl[j] for sl in r.slot], [tl[j] for tl in r.tier]))
            return out

    def debug_state(self) -> dict[str, Any]:
        """A comparable snapshot of everything a call may change: free lists, queues,
        references, the tree, held colder-tier slots, the sequences and the stats. Two
        snapshots are equal iff nothing observable changed between them; for tests and
        debugging (O(everything))."""
        return self._debug_state()

    def _debug_state(self) -> dict[str, Any]:
        """See :meth:`debug_state` (the existing tests call this name)."""
        with self._lock:
            tree = sorted(
                ((rk, r.keys[j], tuple(sl[j] for sl in r.slot), tuple(tl[j] for tl in r.tier),
                  r.priority(j)) for rk, r, j in self._blocks()),
                key=repr,
            )
            return {
                "free": [[sorted(f) for f in t] for t in self._free],
                "queue": [[q.peek_order() for q in t] for t in self._queue],
                "ref": [list(r) for r in self._ref],
                "tree": tree,
                "held": [[sorted(h) for h in t] for t in self._held],
                "seqs": {
                    k: (list(s.tokens), [[list(b) for b in t] for t in s.tables],
                        s.committed_blocks, s.suspended, sorted(s.moved.items()))
                    for k, s in self.sequences.items()
                },
                "stats": self._stats.copy(),
            }

    def check_invariants(self) -> None:
        """Assert ARCHITECTURE §7 (1-3) over the whole state; for tests. O(everything)."""
        with self._lock:
            cfg = self.config
            refs = [[0] * n for n in cfg.slots[0]]
            for seq in self.sequences.values():
                for g in range(cfg.num_groups):
                    for tb in seq.tables[g]:
                        for s in tb:
                            if s != NO_SLOT:
                                refs[g][s] += 1
            assert refs == self._ref, "reference counts differ from the block tables"
            for t in range(self._tiers):
                for g in range(cfg.num_groups):
                    free = set(self._free[t][g])
                    assert len(free) == len(self._free[t][g]), "a slot is free twice"
                    queued = set(self._queue[t][g].peek_order())
                    assert not free & queued, "a slot is both free and queued"
                    for s in range(cfg.slots[t][g]):
                        run = self._run_at[t][g][s]
                        if s in free:
                            assert run is None and (t > 0 or self._ref[g][s] == 0)
                        if s in queued:
                            assert run is not None and (t > 0 or self._ref[g][s] == 0)
                        if t == 0 and self._ref[g][s] == 0:
                            assert s in free or s in queued, f"slot {s} of group {g} leaked"
                        if t > 0:
                            held = s in self._held[t][g]
                            assert (s in free) + (s in queued) + held == 1, \
                                f"tier {t} slot {s} leaked or double-booked"
                        if run is not None:
                            i = self._idx_at[t][g][s]
                            assert run.alive and run.slot[g][i] == s and run.tier[g][i] == t
            step = self.step
            seen: set[tuple[Scope, BlockKey | None, BlockKey]] = set()
            for scope, root in self.roots.items():
                rk = self._view.root_key(*scope)
                assert not root.keys and root.parent is None
                for r in root.descendants():
                    n = len(r.keys)
                    assert r.alive and n > 0, "an empty run in the tree"
                    parent = r.parent
                    assert parent is not None and parent.children.get(r.ckey) is r
                    assert all(len(sl) == n for sl in r.slot) and all(len(tl) == n for tl in r.tier)
                    assert r.prio is None or len(r.prio) == n == len(r.dur or ())
                    if len(r.ckey) != step:  # a partial block: a leaf run of its own
                        assert n == 1 and len(r.tkey) == len(r.ckey) < step \
                            and not r.children, "a non-leaf block is a partial block"
                    else:
                        assert len(r.tkey) >= n * step, "a run lost its blocks' tokens"
                    assert r.ckey == r.tkey[:step]
                    pk = parent.keys[-1] if parent.keys else rk
                    for j, key in enumerate(r.keys):
                        assert (scope, pk, key) not in seen, "two blocks with the same key"
                        seen.add((scope, pk, key))
                        pk = key
                        for g in range(cfg.num_groups):
                            s = r.slot[g][j]
                            if s != NO_SLOT:
                                t = r.tier[g][j]
                                assert self._run_at[t][g][s] is r and self._idx_at[t][g][s] == j
                    if not r.children:
                        assert r.has_slot(n - 1), "a slotless leaf block was not pruned"
