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


def admit(st: CacheState, plan: BatchPlan, partials: list[RequestPlan]) -> list[AdmitResult]:
    """Execute a plan that fits (phase 1, then phase 2 per request); ``partials`` are its
    requests with a partial source. The sources no request took over are queued again. The
    caller ends the call (``finish_call``)."""
    st.begin_call()
    takeovers = claim(st, plan, partials)
    results = []
    for p in plan.requests:
        results.append(allocate(st, p))
    if st.config.state_groups:  # checkpoints copied into running slots: claims released
        release_claims(st, plan)
    if partials:
        release_partials(st, [p._partial for p in partials if p._partial is not None
                              and (id(p._partial[0]), p._partial[1]) not in takeovers])
    return results


def disk_reads(st: CacheState, plan: BatchPlan,
               partials: list[RequestPlan]) -> dict[int, list[SlotId]]:
    """The disk slots executing ``plan`` reads, per layer group (claims on the disk tier and
    partial sources there): what the manager reads ahead before changing anything."""
    reads: dict[int, list[SlotId]] = {}
    for p in plan.requests:
        for g, tiers in p.claim_tiers.items():
            if _DISK in tiers:
                reads.setdefault(g, []).extend(
                    s for t, s in zip(tiers, p.claim_slots[g], strict=True) if t == _DISK)
    for p in partials:
        assert p._partial is not None
        run, i = p._partial
        for g in st.self_groups:
            if run.tier[g][i] == _DISK:
                reads.setdefault(g, []).append(run.slot[g][i])
    return {g: list(dict.fromkeys(slots)) for g, slots in reads.items()}


def claim(st: CacheState, plan: BatchPlan, partials: list[RequestPlan]) -> set[tuple[int, int]]:
    """Phase 1: reference every full match; take partial sources out of the queues. Returns
    the partial sources taken over, as (id(run), index)."""
    first = True
    gpu = st.gpu
    one_tier = st.tiers == 1
    for p in plan.requests:
        beams = p.request.beam_width
        for g, slots in p.claim_slots.items():
            tiers = p.claim_tiers[g]
            pool = gpu[g]
            ref = pool.ref
            if one_tier or not any(tiers):  # all on the GPU (slots are distinct within a request)
                # the first request claims from the state it was planned against
                queued = p.queued[g] if first else [s for s in slots if not ref[s]]
                pool.queue.remove_many(queued)
                pool.hold(slots, beams)
                continue
            for t, s in zip(tiers, slots, strict=True):
                if t == 0:
                    if ref[s] == 0:
                        pool.queue.remove(s)
                    ref[s] += beams
                elif s in st.pools[t][g].queue:
                    st.pools[t][g].queue.remove(s)  # claimed for onboarding
        first = False
    # partial sources after every full match: a full match of the same block holds it
    takeovers: set[tuple[int, int]] = set()
    for p in partials:
        assert p._partial is not None
        run, i = p._partial
        for g in st.self_groups:
            t, s = run.tier[g][i], run.slot[g][i]
            p.partial_loc[g] = (t, s)
            if s in st.pools[t][g].queue:
                st.pools[t][g].queue.remove(s)
        if p.partial_mode is PartialMode.TAKEOVER:
            takeovers.add((id(run), i))
    return takeovers


def allocate(st: CacheState, p: RequestPlan) -> AdmitResult:
    """Phase 2 for one request: onboard claims, copy/take over partials, allocate misses."""
    r = p.request
    beams = r.beam_width
    stats = RequestStats()
    before = list(st.new_count)
    tables: list[list[list[SlotId]]] = []
    for g in range(st.num_groups):
        if st.kinds[g].cross:
            enc = r.encoder_tokens or []
            row = alloc_n(st, g, -(-len(enc) // st.tpb))
            st.gpu[g].hold(row, beams)
            tables.append([list(row) for _ in range(beams)])
            stats.alloc_total += len(row)
        elif st.kinds[g].state:
            tables.append(running_slots(st, p, g, stats))
        else:
            tables.append(_self_tables(st, p, g, stats))
    stats.reused = stats.full_reused + stats.partial_reused
    new: dict[int, int] = {}
    now = st.new_count
    for g in range(st.num_groups):
        new[g] = now[g] - before[g]
    alloc_new = 0
    for g in st.self_groups:
        alloc_new += new[g]
    stats.alloc_new = alloc_new
    return _admitted(st, p, tables, new, stats)


def _shared_matches(st: CacheState, p: RequestPlan, g: int, stats: RequestStats) -> list[SlotId]:
    """The matched part of group g's table: claimed slots (onboarded if colder), NO_SLOT for
    the matched blocks the group does not claim."""
    d = p.num_matched
    claimed = p.claimed[g]
    claim_tiers = p.claim_tiers[g]
    tier_hits = st.stats.tier_hits
    colder = st.tiers > 1 and any(claim_tiers)  # one tier: every claim is on the GPU
    if colder:
        shared = [NO_SLOT] * d
        blocks = p.blocks()
        beams = p.request.beam_width
        for i, claim_tier in zip(claimed, claim_tiers, strict=True):
            run, j = blocks[i]
            if claim_tier:  # GPU claims took their reference in phase 1
                stats.onboarded += onboard(st, run, j, g, beams)
            shared[i] = run.slot[g][j]
        for t in range(1, st.tiers):
            tier_hits[t] += claim_tiers.count(t)
    elif len(claimed) == d:
        shared = p.claim_slots[g]  # the plan is spent once executed: its list becomes the row
    else:
        shared = [NO_SLOT] * d
        for i, s in zip(claimed, p.claim_slots[g], strict=True):
            shared[i] = s
    tier_hits[0] += claim_tiers.count(0) if colder else len(claimed)
    stats.full_reused += len(claimed)
    return shared


def _self_tables(st: CacheState, p: RequestPlan, g: int,
                 stats: RequestStats) -> list[list[SlotId]]:
    """Group g's block table per beam: matches, the partial block, then fresh blocks (the
    last one per beam when the beams' last blocks differ)."""
    beams = p.request.beam_width
    pool = st.gpu[g]
    ref = pool.ref
    d = p.num_matched
    shared = _shared_matches(st, p, g, stats)
    last = p.num_blocks - 1
    per_beam_last = not p.last_shared
    per_beam: list[list[SlotId]] = [[]] if beams == 1 else [[] for _ in range(beams)]
    if p._partial is not None:
        on_last = per_beam_last and d == last
        copies = beams if on_last else 1
        targets: list[SlotId] = []
        if p.partial_mode is PartialMode.TAKEOVER:
            targets.append(take_over(st, *p._partial, g, beams))
            copies -= 1
        src_tier, src_slot = p.partial_loc[g]
        for s in alloc_n(st, g, copies):
            st.copies.add(BlockCopy(src_tier, src_slot, 0, s, g))
            ref[s] += 1 if on_last else beams
            targets.append(s)
        if on_last:
            for b in range(beams):
                per_beam[b].append(targets[b])
        else:
            shared.append(targets[0])
        stats.partial_reused += 1
    first_fresh = d + (1 if p._partial is not None else 0)
    n_shared_fresh = p.num_blocks - first_fresh - (1 if per_beam_last else 0)
    if n_shared_fresh > 0:
        fresh = alloc_n(st, g, n_shared_fresh)
        pool.hold(fresh, beams)
        shared += fresh
        stats.missed += n_shared_fresh
    if per_beam_last and first_fresh <= last:
        for b, s in enumerate(alloc_n(st, g, beams)):
            ref[s] += 1
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


def _admitted(st: CacheState, p: RequestPlan, tables: list[list[list[SlotId]]],
              new: dict[int, int], rs: RequestStats) -> AdmitResult:
    """Register an admitted request's sequence and count it in the stats."""
    r = p.request
    matched: list[Segment] = p._matched
    keys: list[BlockKey] = []
    for run, a, b in matched:
        keys += run.keys[a:b]
    root: Run = st.root((r.lora_id, r.cache_salt))
    seq = Seq(
        r.seq_id, array("I", r.tokens), r.beam_width, keys, root, p.root_key, tables,
        lora_id=r.lora_id, cache_salt=r.cache_salt, retention=r.retention,
        encoder_tokens=(
            array("I", r.encoder_tokens) if r.encoder_tokens is not None else None
        ),
    )
    if matched:
        seq.at_run, _, seq.at_len = matched[-1]
    seq.committed_blocks = len(keys)
    st.sequences[r.seq_id] = seq
    stats = st.stats
    stats.add_request(rs)
    stats.reused_tokens += p.reused_tokens
    stats.prompt_tokens += len(r.tokens)
    stats.admitted_requests += 1
    stats.onboard_blocks += rs.onboarded
    return AdmitResult(
        seq_id=r.seq_id, reused_tokens=p.reused_tokens,
        block_ids=_copy_tables(tables), new_blocks=new, stats=rs,
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
