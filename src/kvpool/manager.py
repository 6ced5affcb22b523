"""KVCacheManager: the engine-facing API. It orchestrates the tree, pools, policy and storage.

State per layer group g and tier t:

- ``_free[t][g]``: slots holding nothing (a stack);
- ``_queue[t][g]``: cached, unreferenced slots in eviction order (the policy);
- ``_node_at[t][g][slot]``: the tree node whose block the slot holds (cached blocks);
- ``_ref[g][slot]``: references on GPU slots (one per block-table entry of a sequence).

A GPU slot is in exactly one of: free, queued (cached, ref 0), referenced (ref > 0, cached or
not). A colder-tier slot is free, queued, or claimed for onboarding during one call. Every
public call takes the manager lock, checks everything it needs before changing anything, and
so either completes or raises with the manager unchanged (and no event emitted).
"""

from __future__ import annotations

import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool import admission
from kvpool.admission import BatchPlan, PartialMode, RequestPlan
from kvpool.config import CacheConfig, SequenceRequest
from kvpool.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    RewindError,
    SequenceStateError,
    StorageError,
    UnknownSequenceError,
)
from kvpool.events.model import EventDiff, KVCacheEvent, StoredBlock
from kvpool.eviction import EvictionPolicy, make_policies
from kvpool.hashing import (
    BlockHasher,
    BlockKey,
    HashAlgo,
    cache_salt_id,
    hash_algo,
    tokens_to_u32,
)
from kvpool.radix import NO_SLOT, Node, prune
from kvpool.sequence import Sequence as Seq
from kvpool.stats import CacheStats, RequestStats
from kvpool.storage import BlockCopy, MetadataStorage, Storage


class EventSink(Protocol):
    """The hooks the manager reports cache changes through (kvpool.events.EventManager)."""

    def on_created(self, layer_group: int, window_size: int,
                   num_blocks_per_cache_level: Sequence[int]) -> None: ...

    def on_stored(self, layer_group: int, window_size: int, parent_hash: int | str | None,
                  blocks: Sequence[StoredBlock]) -> None: ...

    def on_removed(self, layer_group: int, window_size: int,
                   block_hashes: Sequence[int | str]) -> None: ...

    def on_updated(self, layer_group: int, window_size: int, block_hash: int | str, *,
                   cache_level: EventDiff | None = None,
                   priority: EventDiff | None = None) -> None: ...

    def on_all_cleared(self) -> None: ...


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


def _stage(c: BlockCopy) -> tuple[int, int]:
    # Copies leave colder tiers first (host->disk before GPU->host), then come up, then
    # same-tier partial copies: each stage only overwrites slots whose data already moved.
    if c.dst_tier > c.src_tier:
        return (0, -c.src_tier)
    if c.dst_tier < c.src_tier:
        return (1, 0)
    return (2, 0)


def _projection(algo: HashAlgo) -> Callable[[list[BlockKey]], list[int | str]]:
    """``event_hash`` of a list of keys, specialised to one algorithm (the manager projects
    every event's keys; one comprehension per event)."""
    if algo is HashAlgo.V1_BLOCK_KEY:
        return list  # type: ignore[return-value]
    if algo is HashAlgo.V2_SHA256:
        return lambda keys: [k.hex() for k in keys]  # type: ignore[union-attr]
    if algo is HashAlgo.V2_SHA256_64:
        return lambda keys: [int.from_bytes(k[:8], "big") for k in keys]  # type: ignore[index]
    return lambda keys: [int.from_bytes(k[-8:], "big") for k in keys]  # type: ignore[index]


_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def _token_tuple(tkey: bytes) -> tuple[int, ...]:
    """A node's tokens (native uint32 bytes) as a tuple of ints."""
    st = _TOKEN_STRUCTS.get(len(tkey))
    if st is None:
        st = _TOKEN_STRUCTS[len(tkey)] = struct.Struct(f"={len(tkey) // 4}I")
    return st.unpack(tkey)


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
        self._ev_algo = self._event_algo()
        self._ev_hashes = _projection(self._ev_algo)
        self._clock = config.clock or time.monotonic
        self._lock = threading.RLock()
        groups = config.num_groups
        self.self_groups: tuple[int, ...] = tuple(
            g for g in range(groups) if g not in config.cross_attention_groups
        )
        self.sink_blocks: tuple[int, ...] = tuple(-(-s // self.tpb) for s in config.sinks)
        # no sliding window: a sequence's self-attention tables all have the same length,
        # and decode growth within its last block changes nothing but its tokens
        self._full_attention_only = all(
            config.window_sizes[g] is None for g in self.self_groups
        )
        self._tiers = config.num_tiers
        self._free: list[list[list[int]]] = [
            [list(range(n - 1, -1, -1)) for n in config.slots[t]] for t in range(self._tiers)
        ]
        self._queue: list[list[EvictionPolicy]] = make_policies(config, self._clock)
        self._node_at: list[list[list[Node | None]]] = [
            [[None] * n for n in config.slots[t]] for t in range(self._tiers)
        ]
        self._ref: list[list[int]] = [[0] * n for n in config.slots[0]]
        # colder-tier slots holding blocks of suspended sequences (never evicted)
        self._held: list[list[set[int]]] = [
            [set() for _ in range(groups)] for _ in range(self._tiers)
        ]
        self.roots: dict[BlockKey, Node] = {}
        self._root_keys: dict[tuple[int | None, str | None], BlockKey] = {}
        self.sequences: dict[int | str, Seq] = {}
        if storage is None and config.layer_geometry is not None:
            from kvpool.storage import TorchStorage

            storage = TorchStorage(self.tpb, config.layer_geometry, config.slots,
                                   device=config.device, disk_path=config.disk_path)
        self.storage: Storage = storage or MetadataStorage(self.tpb)
        if events is None and config.event_buffer_max_size > 0:
            from kvpool.events.manager import EventManager

            events = EventManager(config.event_buffer_max_size,
                                  hash_algo=self._event_algo())
        self.events = events
        self._events = events
        self._copies: list[BlockCopy | None] = []
        self._removed_pending: dict[int, list[int | str]] = {}
        # (tier, group, slot) -> index in _copies of the copy that fills it during this call
        self._pending_dst: dict[tuple[int, int, int], int] = {}
        self._pending_free: list[tuple[int, int, int]] = []  # (tier, group, slot) at call end
        self._new_count = [0] * groups
        self._stats = CacheStats()
        self._iter_base = CacheStats()
        if events is not None:
            for g in range(groups):
                events.on_created(g, config.window_size(g),
                                  [config.slots[t][g] for t in range(self._tiers)])

    # ------------------------------------------------------------------ queries used by planning

    def root_key(self, lora_id: int | None, cache_salt: str | None) -> BlockKey:
        """The root key of a reuse scope (cached: v2 roots are a sha256 each)."""
        scope = (lora_id, cache_salt)
        key = self._root_keys.get(scope)
        if key is None:
            salt = cache_salt_id(cache_salt) if cache_salt is not None else None
            key = BlockHasher.root_key(self.config.hash_algo, lora_id=lora_id, salt_id=salt)
            self._root_keys[scope] = key
        return key

    def gpu_refs(self, g: int) -> list[int]:
        """Reference counts of group g's GPU slots (read only)."""
        return self._ref[g]

    def gpu_available(self, g: int) -> int:
        """Free plus evictable GPU slots of group g."""
        return len(self._free[0][g]) + len(self._queue[0][g])

    def gpu_evictable(self, node: Node, g: int) -> bool:
        """Does ``node`` hold a queued (cached, unreferenced) GPU slot in group g?"""
        s = node.slot[g]
        return s != NO_SLOT and node.tier[g] == 0 and self._ref[g][s] == 0

    def is_unreferenced_gpu_block(self, node: Node) -> bool:
        """Does ``node`` hold an unreferenced GPU slot in every self-attention group?"""
        return all(self.gpu_evictable(node, g) for g in self.self_groups)

    # ------------------------------------------------------------------ admission

    def plan_batch(self, requests: Sequence[SequenceRequest]) -> BatchPlan:
        """What ``add_sequence_batch(requests)`` would reuse and allocate; changes nothing."""
        with self._lock:
            return admission.plan(self, list(requests))

    def add_sequence(self, request: SequenceRequest) -> AdmitResult:
        """Admit one request (a batch of one)."""
        return self.add_sequence_batch([request])[0]

    def add_sequence_batch(self, requests: Sequence[SequenceRequest]) -> list[AdmitResult]:
        """Admit a scheduler step's new requests in two phases (see :mod:`kvpool.admission`).

        Raises :class:`OutOfBlocksError` with the deficit per (tier, layer group) when the
        batch does not fit; the manager is then exactly as before.
        """
        with self._lock:
            plan = admission.plan(self, list(requests))
            if not plan.fits:
                detail = ", ".join(
                    f"group {g}: need {plan.new_blocks[g]}, have {plan.available[g]}"
                    for (_, g) in sorted(plan.deficit)
                )
                raise OutOfBlocksError(
                    f"batch of {len(plan.requests)} requests does not fit the GPU pool ({detail})",
                    plan.deficit,
                )
            self._new_count = [0] * self.config.num_groups
            takeovers = self._claim(plan)
            results = [self._allocate(p, takeovers) for p in plan.requests]
            self._finish_call(release=[p.partial for p in plan.requests
                                       if p.partial is not None and id(p.partial) not in takeovers])
            return results

    def _claim(self, plan: BatchPlan) -> set[int]:
        """Phase 1: reference every full match; take partial sources out of the queues."""
        takeovers: set[int] = set()
        for p in plan.requests:
            beams = p.request.beam_width
            for g, slots in p.claim_slots.items():
                tiers = p.claim_tiers[g]
                ref = self._ref[g]
                if not any(tiers):  # all on the GPU (slots are distinct within a request)
                    self._queue[0][g].remove_many([s for s in slots if not ref[s]])
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
        # partial sources after every full match: a full match of the same block holds it
        for p in plan.requests:
            src = p.partial
            if src is None:
                continue
            for g in self.self_groups:
                t, s = src.tier[g], src.slot[g]
                p.partial_loc[g] = (t, s)
                if s in self._queue[t][g]:
                    self._queue[t][g].remove(s)
            if p.partial_mode is PartialMode.TAKEOVER:
                takeovers.add(id(src))
        return takeovers

    def _allocate(self, p: RequestPlan, takeovers: set[int]) -> AdmitResult:
        """Phase 2 for one request: onboard claims, copy/take over partials, allocate misses."""
        cfg = self.config
        r = p.request
        beams = r.beam_width
        tpb = self.tpb
        d = len(p.matched)
        matched = p.matched
        st = RequestStats()
        before = list(self._new_count)
        tables: list[list[list[int]]] = []
        tier_hits = self._stats.tier_hits
        for g in range(cfg.num_groups):
            ref = self._ref[g]
            if g in cfg.cross_attention_groups:
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
                for i, claim_tier in zip(claimed, claim_tiers, strict=True):
                    node = matched[i]
                    if claim_tier:  # GPU claims took their reference in phase 1
                        st.onboarded += self._onboard(node, g, beams)
                    shared[i] = node.slot[g]
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
            if p.partial is not None:
                src = p.partial
                on_last = per_beam_last and d == last
                copies = beams if on_last else 1
                targets: list[int] = []
                if p.partial_mode is PartialMode.TAKEOVER:
                    targets.append(self._take_over(src, g, beams))
                    copies -= 1
                src_tier, src_slot = p.partial_loc[g]
                for s in self._alloc_n(g, copies):
                    self._add_copy(BlockCopy(src_tier, src_slot, 0, s, g))
                    ref[s] += 1 if on_last else beams
                    targets.append(s)
                if on_last:
                    for b in range(beams):
                        per_beam[b].append(targets[b])
                else:
                    shared.append(targets[0])
                st.partial_reused += 1
            first_fresh = d + (1 if p.partial is not None else 0)
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
        seq = Seq(
            r.seq_id, array("I", r.tokens), beams, [n.key for n in matched],
            self._root(p.root_key), tables,
            lora_id=r.lora_id, cache_salt=r.cache_salt, retention=r.retention,
            encoder_tokens=(
                array("I", r.encoder_tokens) if r.encoder_tokens is not None else None
            ),
        )
        seq.commit_nodes = list(matched)
        seq.committed_blocks = d
        self.sequences[r.seq_id] = seq
        stats = self._stats
        stats.add_request(st)
        stats.reused_tokens += p.reused_tokens
        stats.prompt_tokens += len(r.tokens)
        stats.admitted_requests += 1
        stats.onboard_blocks += st.onboarded
        return AdmitResult(
            seq_id=r.seq_id, reused_tokens=p.reused_tokens,
            block_ids=[[list(b) for b in t] for t in tables], new_blocks=new, stats=st,
        )

    def _alloc_n(self, g: int, n: int) -> list[int]:
        """``n`` GPU slots of group g (free ones first, then evicted victims)."""
        if n <= 0:
            return []
        free = self._free[0][g]
        self._new_count[g] += n
        if len(free) >= n:
            out = free[-n:]
            del free[-n:]
            out.reverse()
            return out
        out = free[::-1]
        free.clear()
        if self._tiers > 1 or self._pending_dst:
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
        # a leaf just leaves the tree. (A victim with queued descendants drops them too; their
        # slots go to the free list, so the call may evict a few more blocks than it needs.)
        node_at = self._node_at[0][g]
        single = self.config.num_groups == 1
        removed: list[Node] = []
        dropped = 0
        for s, prio in self._queue[0][g].pop_many(n - len(out)):
            node = node_at[s]
            assert node is not None
            if node.children:
                self._emit_removed(g, removed)  # keep the removed hashes in eviction order
                removed = []
                self._evict(0, g, s, prio)
            else:
                node_at[s] = None
                node.slot[g] = NO_SLOT
                dropped += 1
                removed.append(node)
                if single or max(node.slot) == NO_SLOT:
                    parent = node.parent
                    assert parent is not None
                    parent.remove_child(node)
                    node.alive = False
                    if not parent.children and parent.parent is not None \
                            and max(parent.slot) == NO_SLOT:
                        prune(parent)
            out.append(s)
        self._stats.evicted_blocks += dropped
        self._stats.dropped_blocks += dropped
        self._emit_removed(g, removed)
        return out

    def _root(self, key: BlockKey) -> Node:
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = Node(key, None, b"", self.config.num_groups)
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
        node = self._node_at[t][g][slot]
        assert node is not None and node.slot[g] == slot and node.tier[g] == t
        self._node_at[t][g][slot] = None
        self._stats.evicted_blocks += 1
        if (offload and t + 1 < self._tiers and priority >= self.config.offload_min_priority
                and self._queue[t][g].should_offload(slot)):
            s2 = self._lower_slot(t + 1, g)
            if s2 is not None:
                node.tier[g] = t + 1
                node.slot[g] = s2
                self._node_at[t + 1][g][s2] = node
                self._queue[t + 1][g].push(s2, node.priority, key=node.key)
                self._add_copy(BlockCopy(t, slot, t + 1, s2, g))
                self._stats.offload_blocks += 1
                self._stats.offload_bytes += self.storage.block_bytes(g)
                self._emit_updated(g, node, t, t + 1)
                return
        if self._pending_dst:
            self._cancel_copy_into(t, g, slot)
        node.slot[g] = NO_SLOT
        node.tier[g] = 0
        self._stats.dropped_blocks += 1
        if not node.children:  # the common case: victims are leaves (tails go first)
            if self._events is not None:
                self._emit_removed(g, [node])
            if max(node.slot) == NO_SLOT:
                prune(node)
            return
        removed = [node]
        if self.config.window_sizes[g] is None:
            # A full-attention block without its prefix cannot be matched: drop the subtree's
            # queued blocks. Held or claimed ones stay (a sequence that computed a duplicate of
            # an ancestor holds its own copy) and are queued, unreachable, once released.
            for desc in node.descendants():
                ds = desc.slot[g]
                if ds == NO_SLOT:
                    continue
                dt = desc.tier[g]
                q = self._queue[dt][g]
                if ds not in q:
                    continue
                q.remove(ds)
                self._cancel_copy_into(dt, g, ds)
                self._node_at[dt][g][ds] = None
                self._free[dt][g].append(ds)
                desc.slot[g] = NO_SLOT
                desc.tier[g] = 0
                self._stats.dropped_blocks += 1
                removed.append(desc)
        self._emit_removed(g, removed)
        self._prune_subtree(node)

    def _add_copy(self, c: BlockCopy) -> None:
        """Record a copy; if its source was itself filled by a copy of this call, forward it.

        After forwarding every copy of a call reads data that was in place when the call
        began and writes a slot nothing else writes, so the stage order of ``_finish_call``
        is a correct execution order.
        """
        idx = self._pending_dst.pop((c.src_tier, c.layer_group, c.src_slot), None)
        if idx is not None:
            first = self._copies[idx]
            assert first is not None
            c = BlockCopy(first.src_tier, first.src_slot, c.dst_tier, c.dst_slot, c.layer_group)
            self._copies[idx] = None
        self._pending_dst[(c.dst_tier, c.layer_group, c.dst_slot)] = len(self._copies)
        self._copies.append(c)

    def _cancel_copy_into(self, t: int, g: int, slot: int) -> None:
        """The block at (t, g, slot) is dropped: a copy still bringing it there is moot."""
        idx = self._pending_dst.pop((t, g, slot), None)
        if idx is not None:
            self._copies[idx] = None

    def _prune_subtree(self, node: Node) -> None:
        """Remove slotless leaves below and at ``node``, then slotless ancestors."""
        stack = [node]
        order: list[Node] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            if n.alive and n.parent is not None and not n.children and not n.has_any_slot():
                n.parent.remove_child(n)
                n.alive = False
        prune(node.parent if not node.alive else node)

    def _onboard(self, node: Node, g: int, refs: int) -> int:
        """Bring a claimed block up to the GPU with ``refs`` references; returns 1 if it moved
        now, 0 if an earlier request of the batch already brought it up."""
        t, s = node.tier[g], node.slot[g]
        if t == 0:
            self._ref[g][s] += refs
            return 0
        new = self._alloc(g)
        self._add_copy(BlockCopy(t, s, 0, new, g))
        self._node_at[t][g][s] = None
        if s not in self._held[t][g]:
            self._pending_free.append((t, g, s))
        # else: a suspended sequence holds that copy; it stays held, no longer cached
        node.tier[g] = 0
        node.slot[g] = new
        self._node_at[0][g][new] = node
        self._ref[g][new] = refs
        self._stats.onboard_bytes += self.storage.block_bytes(g)
        self._emit_updated(g, node, t, 0)
        return 1

    def _take_over(self, node: Node, g: int, refs: int) -> int:
        """The request adopts an unreferenced leaf's slot in place; the node leaves the tree."""
        s = node.slot[g]
        assert node.tier[g] == 0 and self._ref[g][s] == 0
        self._node_at[0][g][s] = None
        node.slot[g] = NO_SLOT
        self._ref[g][s] = refs
        self._emit_removed(g, [node])
        if not node.has_any_slot():
            prune(node)
        return s

    def _finish_call(self, release: Iterable[Node] = ()) -> None:
        """End of a mutating call: release claimed partial sources, free onboarded colder
        slots, and move the data of every copy the call made, batched per tier pair."""
        for src in release:
            for g in self.self_groups:
                t, s = src.tier[g], src.slot[g]
                if s == NO_SLOT or s in self._queue[t][g] or s in self._held[t][g]:
                    continue
                if t == 0 and self._ref[g][s] > 0:
                    continue  # a full match holds it: the release is cancelled
                if self._node_at[t][g][s] is src:
                    self._queue[t][g].push(s, src.priority, key=src.key)
        for t, g, s in self._pending_free:
            self._free[t][g].append(s)
        self._pending_free.clear()
        self._flush_removed()
        self._pending_dst.clear()
        if self._copies:
            copies = sorted((c for c in self._copies if c is not None), key=_stage)
            self._copies = []
            if copies:
                self.storage.copy_blocks(copies)

    # ------------------------------------------------------------------ events

    def _event_algo(self) -> HashAlgo:
        algo = self.config.event_hash_algo
        return hash_algo(algo if algo is not None else self.config.hash_algo)

    def flush_iteration_events(self) -> None:
        """Publish this step's events (no-op without events)."""
        if self._events is not None and hasattr(self._events, "flush_iteration_events"):
            self._events.flush_iteration_events()

    def get_latest_events(self, timeout_s: float | None = 0) -> list[KVCacheEvent]:
        """Published events not read yet (see ``EventManager.get_latest_events``)."""
        if self._events is None or not hasattr(self._events, "get_latest_events"):
            return []
        out: list[KVCacheEvent] = self._events.get_latest_events(timeout_s)
        return out

    def cached_blocks(self) -> set[tuple[int | str, int, int]]:
        """(event hash, layer group, tier) of every cached block: what events describe."""
        with self._lock:
            out: set[tuple[int | str, int, int]] = set()
            for root in self.roots.values():
                for n in root.descendants():
                    for g, s in enumerate(n.slot):
                        if s != NO_SLOT:
                            out.add((self._ev_hashes([n.key])[0], g, n.tier[g]))
            return out

    def _emit_removed(self, g: int, nodes: list[Node]) -> None:
        # Removals of one call are handed over together (one hook call per layer group),
        # flushed before any other event so the stream's order is exactly the call's.
        if self._events is not None and nodes:
            pending = self._removed_pending.get(g)
            if pending is None:
                pending = self._removed_pending[g] = []
            pending.extend(self._ev_hashes([n.key for n in nodes]))

    def _flush_removed(self) -> None:
        if self._removed_pending and self._events is not None:
            for g, hashes in self._removed_pending.items():
                self._events.on_removed(g, self.config.window_size(g), hashes)
            self._removed_pending = {}

    def _emit_updated(self, g: int, node: Node, old: int, new: int) -> None:
        if self._events is not None:
            self._flush_removed()
            self._events.on_updated(g, self.config.window_size(g), self._ev_hashes([node.key])[0],
                                    cache_level=EventDiff(old, new))

    def _emit_stored(self, g: int, parent: Node, chain: list[Node], lora_id: int | None) -> None:
        if self._events is None or not chain:
            return
        self._flush_removed()
        parent_hash = None if parent.parent is None else self._ev_hashes([parent.key])[0]
        hashes = self._ev_hashes([n.key for n in chain])
        blocks = [
            StoredBlock(h, _token_tuple(n.tkey), n.tier[g], n.priority, lora_id)
            for h, n in zip(hashes, chain, strict=True)
        ]
        self._events.on_stored(g, self.config.window_size(g), parent_hash, blocks)

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
        """Blocks [sink_blocks, limit) of a window group are stale at ``length`` tokens."""
        w = self.config.window_sizes[g]
        if w is None:
            return 0
        return max(0, (length - w - 1) // self.tpb)

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
            if g in self.config.cross_attention_groups:
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
                for i in range(self.sink_blocks[g], min(limit, len(tb))):
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
        step computes. All or nothing: raises :class:`OutOfBlocksError`
        with the manager unchanged when the pool cannot provide the blocks.
        """
        with self._lock:
            seq = self._active(seq_id)
            toks = tokens_to_u32(token_ids)
            if not toks:
                return
            new_len = seq.num_tokens + len(toks)
            if (self._full_attention_only
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
            self._new_count = [0] * self.config.num_groups
            for g in range(self.config.num_groups):
                if g in self.config.cross_attention_groups:
                    continue
                # The step computes the new tokens' KV; its first token still attends back a
                # window from the old end, so staleness is judged at old length + 1.
                self._release_stale(seq, g, seq.num_tokens + 1)
            blocks_after = -(-new_len // self.tpb)
            for g in range(self.config.num_groups):
                if g in self.config.cross_attention_groups:
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
            for i in range(self.sink_blocks[g], min(limit, len(tb))):
                s = tb[i]
                if s != NO_SLOT:
                    self._unref(g, s)
                    tb[i] = NO_SLOT

    def _unref(self, g: int, s: int) -> None:
        ref = self._ref[g]
        ref[s] -= 1
        assert ref[s] >= 0
        if ref[s] == 0:
            node = self._node_at[0][g][s]
            if node is None:
                self._free[0][g].append(s)
            else:
                expires = (
                    self._clock() + node.duration if node.duration is not None else None
                )
                self._queue[0][g].push(s, node.priority, expires, node.key)

    def _unref_many(self, g: int, slots: list[int]) -> None:
        """Drop one reference on each slot of a block table (NO_SLOT entries skipped).

        Cached blocks whose last reference goes join the eviction queue tail first, so that
        within one release a sequence's tail is evicted before its head: evicting a head block
        would take every block after it along (a full-attention block without its prefix
        cannot be matched). Uncached blocks become free.
        """
        ref = self._ref[g]
        node_at = self._node_at[0][g]
        free = self._free[0][g]
        queue = self._queue[0][g]
        batch: list[int] = []
        keys: list[BlockKey] | None = [] if queue.uses_keys else None
        batch_prio = -1
        for s in reversed(slots):
            if s == NO_SLOT:
                continue
            r = ref[s] - 1
            ref[s] = r
            if r:
                continue
            node = node_at[s]
            if node is None:
                free.append(s)
            elif node.duration is None:
                if node.priority != batch_prio and batch:
                    queue.push_many(batch, batch_prio, keys)
                    batch = []
                    keys = [] if keys is not None else None
                batch_prio = node.priority
                batch.append(s)
                if keys is not None:
                    keys.append(node.key)
            else:
                if batch:
                    queue.push_many(batch, batch_prio, keys)
                    batch = []
                    keys = [] if keys is not None else None
                queue.push(s, node.priority, self._clock() + node.duration, node.key)
        if batch:
            queue.push_many(batch, batch_prio, keys)

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
                w = self.config.window_sizes[g]
                if w is None:
                    continue
                limit = self._stale_limit(g, new_len)
                tb = seq.tables[g][0]
                keep = -(-new_len // self.tpb)
                for i in range(max(limit, self.sink_blocks[g]), min(keep, len(tb))):
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
        h = BlockHasher(self.config.hash_algo, self.tpb, lora_id=seq.lora_id,
                        cache_salt=seq.cache_salt, root=seq.root.key)
        h.resume(seq.keys[:blocks])
        return h

    def _commit(self, seq: Seq, upto: int) -> None:
        """Insert the sequence's full blocks [committed, upto) into the tree (beam 0).

        Blocks already in the tree (another sequence committed them) are found by their
        tokens; after the first block that is not, every later one is new too (its parent
        is), so those are created in one pass, their keys computed in one chained batch.
        """
        start = seq.committed_blocks
        if not self.config.enable_block_reuse or upto <= start:
            return
        tpb = self.tpb
        nodes = seq.commit_nodes
        if nodes and not nodes[-1].alive:
            nodes = seq.commit_nodes = self._path(seq, len(nodes))
        parent = nodes[-1] if nodes else seq.root
        groups = self.config.num_groups
        node_at = self._node_at[0]
        chains: dict[int, tuple[Node, list[Node]]] = {}
        events = self._events is not None
        tokens = seq.tokens
        raw = tokens.tobytes()
        step = 4 * tpb
        keys = seq.keys
        group_tables = [(g, seq.tables[g][0]) for g in self.self_groups]
        i = start
        while i < upto:  # blocks another sequence committed already
            node = parent.children.get(raw[i * step:(i + 1) * step])
            if node is None:
                break
            keys.append(node.key)
            slots = node.slot
            for g, tb in group_tables:
                s = tb[i] if i < len(tb) else NO_SLOT
                if s != NO_SLOT and slots[g] == NO_SLOT and node_at[g][s] is None:
                    slots[g] = s
                    node.tier[g] = 0
                    node_at[g][s] = node
                    if events:
                        chain = chains.get(g)
                        if chain is None:
                            chains[g] = (parent, [node])
                        else:
                            chain[1].append(node)
                elif events and g in chains:
                    chain_parent, chain_nodes = chains.pop(g)
                    self._emit_stored(g, chain_parent, chain_nodes, seq.lora_id)
            nodes.append(node)
            parent = node
            i += 1
        if i < upto:  # new blocks: a chain under ``parent``
            first = i
            new_keys = self._hasher_after(seq, first).extend(tokens[first * tpb:upto * tpb])
            fresh = [
                Node(key, None, raw[j * step:(j + 1) * step], groups)
                for j, key in enumerate(new_keys, first)
            ]
            head = parent
            for node in fresh:
                node.parent = parent
                if parent is head:
                    parent.add_child(node)
                else:  # a new node: no first-token index yet, no children
                    parent.children = {node.tkey: node}
                parent = node
            if seq.retention is not None:
                for j, node in enumerate(fresh, first):
                    self._set_priority(seq, node, j * tpb)
            keys.extend(new_keys)
            nodes.extend(fresh)
            for g, tb in group_tables:
                na = node_at[g]
                chain = chains.pop(g, None)
                run: list[Node] = chain[1] if chain is not None else []
                run_parent = chain[0] if chain is not None else head
                prev = head
                for j, node in enumerate(fresh, first):
                    s = tb[j] if j < len(tb) else NO_SLOT
                    if s != NO_SLOT and na[s] is None:
                        node.slot[g] = s
                        na[s] = node
                        if events:
                            if not run:
                                run_parent = prev
                            run.append(node)
                    elif run:
                        self._emit_stored(g, run_parent, run, seq.lora_id)
                        run = []
                    prev = node
                if run:
                    chains[g] = (run_parent, run)
        for g, (chain_parent, chain_nodes) in chains.items():
            self._emit_stored(g, chain_parent, chain_nodes, seq.lora_id)
        seq.committed_blocks = upto
        last = nodes[-1]
        if not last.has_any_slot() and not last.children:
            prune(last)

    def _path(self, seq: Seq, blocks: int) -> list[Node]:
        """Nodes of the sequence's first ``blocks`` committed blocks, recreating path nodes a
        prune removed (keys are still valid; only slots were lost)."""
        out: list[Node] = []
        parent = self._root(self.root_key(seq.lora_id, seq.cache_salt))
        seq.root = parent
        tpb = self.tpb
        for i in range(blocks):
            tokens = seq.tokens[i * tpb:(i + 1) * tpb]
            node = parent.children.get(tokens.tobytes())
            if node is None:
                node = Node(seq.keys[i], parent, tokens.tobytes(), self.config.num_groups)
                self._set_priority(seq, node, i * tpb)
                parent.add_child(node)
            out.append(node)
            parent = node
        return out

    def _set_priority(self, seq: Seq, node: Node, first_token: int) -> None:
        ret = seq.retention
        if ret is None:
            return
        if first_token >= seq.prompt_len:
            node.priority, node.duration = ret.decode_priority, ret.decode_duration_s
        else:
            node.priority, node.duration = ret.block_priority(first_token)

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
        nodes = seq.commit_nodes
        parent = nodes[full - 1] if full else seq.root
        if not parent.alive:
            return
        tokens = seq.tokens[full * self.tpb:computed]
        if tokens.tobytes() in parent.children:
            return
        key = self._hasher_after(seq, full).key_of_prefix_block(tokens)
        node = Node(key, parent, tokens.tobytes(), self.config.num_groups)
        self._set_priority(seq, node, full * self.tpb)
        stored: list[int] = []
        for g in self.self_groups:
            tb = seq.tables[g][0]
            s = tb[full] if full < len(tb) else NO_SLOT
            if s != NO_SLOT and self._node_at[0][g][s] is None:
                node.slot[g] = s
                self._node_at[0][g][s] = node
                stored.append(g)
        if not stored:
            return
        parent.add_child(node)
        for g in stored:
            self._emit_stored(g, parent, [node], seq.lora_id)

    # ------------------------------------------------------------------ preemption

    def suspend(self, seq_id: int | str) -> dict[int, int]:
        """Preempt a sequence without losing its KV.

        Blocks only this sequence holds move to the host tier (when there is one and it can
        make room) and stay held there: they are never evicted or dropped. Blocks shared with
        other sequences stay on the GPU. Returns the GPU slots freed per layer group.
        """
        with self._lock:
            seq = self._seq(seq_id)
            if seq.suspended:
                raise SequenceStateError(f"sequence {seq_id!r} is already suspended")
            freed = dict.fromkeys(range(self.config.num_groups), 0)
            if self._tiers > 1:
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
                        self._add_copy(BlockCopy(0, s, 1, h, g))
                        node = self._node_at[0][g][s]
                        if node is not None:
                            self._node_at[0][g][s] = None
                            node.tier[g], node.slot[g] = 1, h
                            self._node_at[1][g][h] = node
                            self._emit_updated(g, node, 0, 1)
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

        Raises :class:`OutOfBlocksError` (nothing changed) when the GPU cannot take them.
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
            self._new_count = [0] * self.config.num_groups
            for (g, _), (t, h, pos) in seq.moved.items():
                new = self._alloc(g)
                self._add_copy(BlockCopy(t, h, 0, new, g))
                node = self._node_at[t][g][h]
                if node is not None:
                    self._node_at[t][g][h] = None
                    node.tier[g], node.slot[g] = 0, new
                    self._node_at[0][g][new] = node
                    self._emit_updated(g, node, t, 0)
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
            node = self._node_at[t][g][h]
            if node is None:
                self._free[t][g].append(h)
            else:
                self._queue[t][g].push(h, node.priority, key=node.key)
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
        """Release the storage (removes a disk tier's file)."""
        self.storage.close()

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
            if not 0 <= layer_group < self.config.num_groups:
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            if not 0 <= beam < seq.beam_width:
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
            _, matched, _, k = admission.walk(self, req)
            return len(matched) * self.tpb + k

    def num_free_blocks(self, layer_group: int = 0) -> int:
        """Free plus evictable GPU slots of a layer group."""
        with self._lock:
            if not 0 <= layer_group < self.config.num_groups:
                raise InvalidArgumentError(f"unknown layer group {layer_group!r}")
            return self.gpu_available(layer_group)

    def slot_usage(self, tier: int = 0, layer_group: int = 0) -> dict[str, int]:
        """used / free / evictable slots of one pool."""
        with self._lock:
            if not 0 <= tier < self._tiers or not 0 <= layer_group < self.config.num_groups:
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

    def _debug_state(self) -> dict[str, Any]:
        """A comparable snapshot of everything a call may change (tests use it)."""
        with self._lock:
            def tree() -> list[tuple[Any, ...]]:
                out: list[tuple[Any, ...]] = []
                for rk, root in self.roots.items():
                    for n in root.descendants():
                        out.append((rk, n.key, tuple(n.slot), tuple(n.tier), n.priority))
                return sorted(out, key=repr)
            return {
                "free": [[sorted(f) for f in t] for t in self._free],
                "queue": [[q.peek_order() for q in t] for t in self._queue],
                "ref": [list(r) for r in self._ref],
                "tree": tree(),
                "seqs": {
                    k: (list(s.tokens), [[list(b) for b in t] for t in s.tables],
                        s.committed_blocks, s.suspended)
                    for k, s in self.sequences.items()
                },
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
                        node = self._node_at[t][g][s]
                        if s in free:
                            assert node is None and (t > 0 or self._ref[g][s] == 0)
                        if s in queued:
                            assert node is not None and (t > 0 or self._ref[g][s] == 0)
                        if t == 0 and self._ref[g][s] == 0:
                            assert s in free or s in queued, f"slot {s} of group {g} leaked"
                        if t > 0:
                            held = s in self._held[t][g]
                            assert (s in free) + (s in queued) + held == 1, \
                                f"tier {t} slot {s} leaked or double-booked"
                        if node is not None:
                            assert node.alive and node.slot[g] == s and node.tier[g] == t
            seen: set[tuple[BlockKey, BlockKey]] = set()
            for rk, root in self.roots.items():
                for n in root.descendants():
                    assert n.alive
                    assert n.children or n.has_any_slot() or True
                    if n.children:
                        assert len(n.tkey) == 4 * self.tpb, "a non-leaf node is a partial block"
                    pk = n.parent.key if n.parent is not None else rk
                    assert (pk, n.key) not in seen
                    seen.add((pk, n.key))
                    for g in range(cfg.num_groups):
                        if n.slot[g] != NO_SLOT:
                            assert self._node_at[n.tier[g]][g][n.slot[g]] is n
