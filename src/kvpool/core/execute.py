"""Executing an admission plan (:mod:`kvpool.core.plan`): claim, then allocate.

Phase 1 (:func:`claim`) references every full match of every request of the batch, so that
nothing phase 2 evicts can be one of them, and takes the partial sources out of the eviction
queues. Phase 2 (:func:`allocate`, per request) onboards matched blocks from colder tiers,
copies (or takes over) the partial block, allocates the fresh blocks and registers the
sequence. The plan was computed from the state phase 1 starts from, so the execution realises
it exactly (ARCHITECTURE §7.5).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from kvpool.core.allocator import alloc_n, onboard, release_partials, take_over
from kvpool.core.checkpoints import release_claims, running_slots
from kvpool.core.plan import BatchPlan, PartialMode, RequestPlan
from kvpool.core.radix import NO_SLOT, Run, Segment, SlotId
from kvpool.core.sequence import Sequence as Seq
from kvpool.core.state import CacheState, SeqId
from kvpool.core.stats import RequestStats
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.storage import BlockCopy, Tier

_DISK = int(Tier.DISK)


@dataclass(slots=True)
class AdmitResult:
    """One admitted request: its reuse, block tables and stats.

    ``block_ids[g][b]`` is beam b's block table in layer group g (-1 = not held: a block a
    sliding window does not need). ``new_blocks[g]`` counts GPU slots the admission took.
    """

    seq_id: SeqId
    reused_tokens: int
    block_ids: list[list[list[SlotId]]]
    new_blocks: dict[int, int]
    stats: RequestStats


def admit(state: CacheState, batch: BatchPlan) -> list[AdmitResult]:
    """Execute a batch that fits (phase 1, then phase 2 per request). The partial sources no
    request took over are queued again. The caller ends the call (``finish_call``)."""
    state.begin_call()
    takeovers = claim(state, batch)
    results = []
    for plan in batch.requests:
        results.append(allocate(state, plan))
    if state.config.state_groups:  # checkpoints copied into running slots: claims released
        release_claims(state, batch)
    if batch.partials:
        release_partials(state, [plan.partial for plan in batch.partials if plan.partial is not None
                              and (id(plan.partial[0]), plan.partial[1]) not in takeovers])
    return results


def disk_reads(state: CacheState, batch: BatchPlan) -> dict[int, list[SlotId]]:
    """The disk slots executing ``batch`` reads, per layer group (claims on the disk tier and
    partial sources there): what the manager reads ahead before changing anything."""
    reads: dict[int, list[SlotId]] = {}
    for plan in batch.requests:
        for g, tiers in plan.claim_tiers.items():
            if _DISK in tiers:
                reads.setdefault(g, []).extend(
                    s for t, s in zip(tiers, plan.claim_slots[g], strict=True) if t == _DISK)
    for plan in batch.partials:
        assert plan.partial is not None
        run, i = plan.partial
        for g in state.layout.self_groups:
            if run.tier[g][i] == _DISK:
                reads.setdefault(g, []).append(run.slot[g][i])
    return {g: list(dict.fromkeys(slots)) for g, slots in reads.items()}


def claim(state: CacheState, batch: BatchPlan) -> set[tuple[int, int]]:
    """Phase 1: reference every full match; take partial sources out of the queues. Returns
    the partial sources taken over, as (id(run), index)."""
    first = True
    gpu = state.gpu
    one_tier = state.layout.one_tier
    for plan in batch.requests:
        beams = plan.request.beam_width
        for g, slots in plan.claim_slots.items():
            tiers = plan.claim_tiers[g]
            pool = gpu[g]
            if one_tier or not any(tiers):  # all on the GPU (slots are distinct within a request)
                # the first request claims from the state it was planned against
                ref = pool.ref
                queued = plan.queued[g] if first else [s for s in slots if not ref[s]]
                pool.dequeue_many(queued)
                pool.hold(slots, beams)
                continue
            for t, s in zip(tiers, slots, strict=True):
                if t == 0:
                    pool.claim(s, beams)
                else:
                    state.pools[t][g].dequeue_if_queued(s)  # claimed for onboarding
        first = False
    # partial sources after every full match: a full match of the same block holds it
    takeovers: set[tuple[int, int]] = set()
    for plan in batch.partials:
        assert plan.partial is not None
        run, i = plan.partial
        for g in state.layout.self_groups:
            t, s = run.tier[g][i], run.slot[g][i]
            plan.partial_loc[g] = (t, s)
            state.pools[t][g].dequeue_if_queued(s)
        if plan.partial_mode is PartialMode.TAKEOVER:
            takeovers.add((id(run), i))
    return takeovers


def allocate(state: CacheState, plan: RequestPlan) -> AdmitResult:
    """Phase 2 for one request: onboard claims, copy/take over partials, allocate misses."""
    request = plan.request
    beams = request.beam_width
    stats = RequestStats()
    before = list(state.new_count)
    tables: list[list[list[SlotId]]] = []
    for g in range(state.layout.num_groups):
        if state.layout.kinds[g].cross:
            enc = request.encoder_tokens or []
            row = alloc_n(state, g, -(-len(enc) // state.layout.tpb))
            state.gpu[g].hold(row, beams)
            tables.append([list(row) for _ in range(beams)])
            stats.alloc_total += len(row)
        elif state.layout.kinds[g].state:
            tables.append(running_slots(state, plan, g, stats))
        else:
            tables.append(_self_tables(state, plan, g, stats))
    stats.reused = stats.full_reused + stats.partial_reused
    new: dict[int, int] = {}
    now = state.new_count
    for g in range(state.layout.num_groups):
        new[g] = now[g] - before[g]
    alloc_new = 0
    for g in state.layout.self_groups:
        alloc_new += new[g]
    stats.alloc_new = alloc_new
    return _admitted(state, plan, tables, new, stats)


def _shared_matches(state: CacheState, plan: RequestPlan, g: int,
                    stats: RequestStats) -> list[SlotId]:
    """The matched part of group g's table: claimed slots (onboarded if colder), NO_SLOT for
    the matched blocks the group does not claim."""
    num_matched = plan.num_matched
    claimed = plan.claimed[g]
    claim_tiers = plan.claim_tiers[g]
    totals = state.stats
    colder = state.layout.tiers > 1 and any(claim_tiers)  # one tier: every claim is on the GPU
    if colder:
        shared = [NO_SLOT] * num_matched
        blocks = plan.blocks()
        beams = plan.request.beam_width
        for i, claim_tier in zip(claimed, claim_tiers, strict=True):
            run, j = blocks[i]
            if claim_tier:  # GPU claims took their reference in phase 1
                stats.onboarded += onboard(state, run, j, g, beams)
            shared[i] = run.slot[g][j]
        for t in range(1, state.layout.tiers):
            totals.tier_hit(t, claim_tiers.count(t))
    elif len(claimed) == num_matched:
        shared = plan.claim_slots[g]  # the plan is spent once executed: its list becomes the row
    else:
        shared = [NO_SLOT] * num_matched
        for i, s in zip(claimed, plan.claim_slots[g], strict=True):
            shared[i] = s
    totals.tier_hit(0, claim_tiers.count(0) if colder else len(claimed))
    stats.full_reused += len(claimed)
    return shared


def _self_tables(state: CacheState, plan: RequestPlan, g: int,
                 stats: RequestStats) -> list[list[SlotId]]:
    """Group g's block table per beam: matches, the partial block, then fresh blocks (the
    last one per beam when the beams' last blocks differ)."""
    beams = plan.request.beam_width
    pool = state.gpu[g]
    num_matched = plan.num_matched
    shared = _shared_matches(state, plan, g, stats)
    last = plan.num_blocks - 1
    per_beam_last = not plan.last_shared
    per_beam: list[list[SlotId]] = [[]] if beams == 1 else [[] for _ in range(beams)]
    if plan.partial is not None:
        on_last = per_beam_last and num_matched == last
        copies = beams if on_last else 1
        targets: list[SlotId] = []
        if plan.partial_mode is PartialMode.TAKEOVER:
            targets.append(take_over(state, *plan.partial, g, beams))
            copies -= 1
        src_tier, src_slot = plan.partial_loc[g]
        for s in alloc_n(state, g, copies):
            state.copies.add(BlockCopy(src_tier, src_slot, 0, s, g))
            pool.hold_one(s, 1 if on_last else beams)
            targets.append(s)
        if on_last:
            for b in range(beams):
                per_beam[b].append(targets[b])
        else:
            shared.append(targets[0])
        stats.partial_reused += 1
    first_fresh = num_matched + (1 if plan.partial is not None else 0)
    n_shared_fresh = plan.num_blocks - first_fresh - (1 if per_beam_last else 0)
    if n_shared_fresh > 0:
        fresh = alloc_n(state, g, n_shared_fresh)
        pool.hold(fresh, beams)
        shared += fresh
        stats.missed += n_shared_fresh
    if per_beam_last and first_fresh <= last:
        for b, s in enumerate(alloc_n(state, g, beams)):
            pool.hold_one(s, 1)
            per_beam[b].append(s)
        stats.missed += 1
    if beams == 1:
        row = per_beam[0]
        stats.alloc_total += len(shared) - shared.count(NO_SLOT) + len(row)
        if row:
            shared += row
        return [shared]
    stats.alloc_total += len(shared) - shared.count(NO_SLOT) + sum(map(len, per_beam))
    return [shared + per_beam[b] for b in range(beams)]


def _admitted(state: CacheState, plan: RequestPlan, tables: list[list[list[SlotId]]],
              new: dict[int, int], request_stats: RequestStats) -> AdmitResult:
    """Register an admitted request's sequence and count it in the stats."""
    request = plan.request
    matched: list[Segment] = plan.matched
    keys: list[BlockKey] = []
    for run, a, b in matched:
        keys += run.keys[a:b]
    root: Run = state.root((request.lora_id, request.cache_salt))
    seq = Seq(
        request.seq_id, array("I", request.tokens), request.beam_width, keys, root,
        plan.root_key, tables,
        lora_id=request.lora_id, cache_salt=request.cache_salt, retention=request.retention,
        encoder_tokens=(
            array("I", request.encoder_tokens) if request.encoder_tokens is not None else None
        ),
    )
    if matched:
        seq.at_run, _, seq.at_len = matched[-1]
    seq.committed_blocks = len(keys)
    state.add_sequence(seq)
    state.stats.admitted(request_stats, plan.reused_tokens, len(request.tokens))
    return AdmitResult(
        seq_id=request.seq_id, reused_tokens=plan.reused_tokens,
        block_ids=_copy_tables(tables), new_blocks=new, stats=request_stats,
    )


def _copy_tables(tables: list[list[list[SlotId]]]) -> list[list[list[SlotId]]]:
    """The caller's copy of the block tables (the sequence keeps its own)."""
    out = []
    for t in tables:
        if len(t) == 1:
            out.append([t[0][:]])
        else:
            out.append([b[:] for b in t])
    return out
