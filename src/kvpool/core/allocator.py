"""Slots in and out of the pools: allocation, eviction, onboarding and release of references.

Every function here works on one manager's :class:`~kvpool.core.state.CacheState` and keeps the
pool invariants (ARCHITECTURE §7): a GPU slot is free, queued (cached, no reference) or
referenced; a colder-tier slot is free, queued, held by a suspended sequence or claimed for
onboarding during one call; a cached slot's back-pointer names the tree block that holds it.

Eviction follows the back-pointer from the policy's victim to its block: the block is
offloaded one tier down (when the policy says so and the tier can make room) or dropped. A
dropped full-attention block takes the queued blocks below it along (a block without its
prefix cannot be matched), and the tree prunes the slotless leaves left behind. The bulk path
(:func:`alloc_n`) evicts the common victims - tails of leaf runs, tail first, as a released
block table enters the queue - a run at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvpool.core.radix import NO_SLOT, Run, SlotId, detach, prune
from kvpool.core.state import CacheState
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.storage import BlockCopy

# ------------------------------------------------------------------ taking slots


def alloc(state: CacheState, g: int) -> SlotId:
    """A GPU slot of group g (free first, else the policy's victim, evicted)."""
    state.new_count[g] += 1
    pool = state.gpu[g]
    if pool.free:
        return pool.take_free()
    s, prio = pool.pop_victim()
    evict(state, 0, g, s, prio)
    return s


def alloc_n(state: CacheState, g: int, n: int) -> list[SlotId]:
    """``n`` GPU slots of group g (free ones first, then evicted victims)."""
    if n <= 0:
        return []
    pool = state.gpu[g]
    state.new_count[g] += n
    out = pool.take(n)
    if len(out) == n:
        return out
    # (a remote tier: evict() sees each block)
    if state.layout.tiers > 1 or state.copies or state.remote is not None:
        free = pool.free
        pop = pool.pop_victim
        while len(out) < n:
            if free:  # an eviction's cascade freed its descendants' slots
                out.append(pool.take_free())
                continue
            s, prio = pop()
            evict(state, 0, g, s, prio)
            out.append(s)
        return out
    victims = pool.pop_victims(n - len(out))
    _drop_victims(state, g, victims)
    out += victims
    return out


def _drop_victims(state: CacheState, g: int, slots: list[SlotId]) -> None:
    """Drop the blocks of GPU victims ``slots`` (one tier, no copy in flight: a victim's
    priority cannot send it down a tier).

    A victim that is a leaf's tail just leaves its run. (A victim with queued descendants
    drops them too; their slots go to the free list, so the call may evict a few more blocks
    than it needs.) Victims come tail first, so a run losing its tail is truncated once, at
    the end: until then ``cut`` holds its length (the blocks past it have no slot left), and
    a run losing every block leaves its parent at once.
    """
    pool = state.gpu[g]
    run_at, idx_at = pool.run_at, pool.idx_at
    single = state.layout.num_groups == 1
    stats = state.stats
    if single:
        tails = leaf_tails(pool.run_at, pool.idx_at, g, slots)
        if tails is not None:
            drop_tails(state, g, tails)
            stats.evicted(len(slots), len(slots))
            return
    events = state.emit.sink is not None
    removed: list[BlockKey] = []
    cut: dict[Run, int] = {}
    prev: Run | None = None  # the run the last victim left, and its length now
    prev_n = 0
    slow = 0
    left: list[SlotId] = []  # victims whose back-pointers go, cleared in one pass at the end
    for s in slots:
        run = run_at[s]
        assert run is not None
        i = idx_at[s]
        if (run is not prev or i != prev_n - 1) and (
                i != cut.get(run, len(run.keys)) - 1 or run.children):
            state.emit.removed(g, removed)  # keep the removed hashes in eviction order
            removed = []
            cut_runs(cut)
            cut = {}
            prev = None
            slow += 1
            evict(state, 0, g, s, DEFAULT_PRIORITY)  # counts its own evictions and drops
            continue
        left.append(s)
        run.slot[g][i] = NO_SLOT
        if events:
            removed.append(run.keys[i])
        if state.config.state_groups and not state.layout.kinds[g].windowed:
            _drop_orphans(state, [(run, i)])  # a tail: nothing below it
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
    cut_runs(cut)
    pool.clear_all(left)
    stats.evicted(len(slots) - slow, len(slots) - slow)
    state.emit.removed(g, removed)


def leaf_tails(run_at: list[Run | None], idx_at: list[int], g: int,
               slots: list[SlotId]) -> list[tuple[Run, int]] | None:
    """If victims ``slots`` (one layer group in all) are, stretch after stretch, the tails of
    leaf runs, tail first (how a released block table leaves the queue): each run with the
    length it keeps. Else None (nothing changed)."""
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


def drop_tails(state: CacheState, g: int, tails: list[tuple[Run, int]]) -> None:
    """Evict whole leaf-run tails found by :func:`leaf_tails`: what evicting their blocks one
    by one does, a run at a time."""
    pool = state.gpu[g]
    events = state.emit.sink is not None
    removed: list[BlockKey] = []
    for run, keep in tails:
        sl = run.slot[g]
        pool.clear_all(sl[keep:])
        if events:
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
    state.emit.removed(g, removed)


def cut_runs(cut: dict[Run, int]) -> None:
    """Truncate runs to the lengths ``cut`` gives (their tails lost every slot)."""
    for run, n in cut.items():
        if run.alive and n < len(run.keys):
            run.truncate(n)
            if not run.children and not run.has_slot(n - 1):
                prune(run)


def lower_slot(state: CacheState, t: int, g: int) -> SlotId | None:
    """A slot on colder tier t for an offloaded block, or None if none can be had."""
    pool = state.pools[t][g]
    if pool.free:
        return pool.take_free()
    if not len(pool.queue):
        return None
    s, prio = pool.pop_victim()
    evict(state, t, g, s, prio)
    return s


# ------------------------------------------------------------------ eviction


def evict(state: CacheState, t: int, g: int, slot: SlotId, priority: int, *,
          offload: bool = True) -> None:
    """The block at (t, g, slot) leaves that slot: offloaded one tier down, or dropped."""
    pool = state.pools[t][g]
    run = pool.run_at[slot]
    i = pool.idx_at[slot]
    assert run is not None and run.slot[g][i] == slot and run.tier[g][i] == t
    pool.clear(slot)
    if (offload and t + 1 < state.layout.tiers
            and priority >= state.config.eviction.offload_min_priority
            and pool.queue.should_offload(slot)):
        s2 = lower_slot(state, t + 1, g)
        if s2 is not None:
            run.tier[g][i] = t + 1
            run.slot[g][i] = s2
            lower = state.pools[t + 1][g]
            lower.place(s2, run, i)
            lower.enqueue(s2, run.priority(i), key=run.keys[i])
            state.copies.add(BlockCopy(t, slot, t + 1, s2, g))
            state.stats.evicted(1, 0)
            state.stats.offloaded(1, state.storage.block_bytes(g))
            state.emit.updated(g, run.keys[i], t, t + 1)
            return
    if offload and state.remote is not None:  # remote tier: the block leaves the local tiers
        state.remote.dropped(t, g, slot, run, i)
    if state.copies:
        state.copies.cancel_into(t, g, slot)
    run.slot[g][i] = NO_SLOT
    run.tier[g][i] = 0
    state.stats.evicted(1, 1)
    if state.config.state_groups and not state.layout.kinds[g].windowed:
        # checkpoints at and below a lost attention block
        _drop_orphans(state, [(run, i), *_blocks_below(run, i)])
    if i == len(run.keys) - 1 and not run.children:  # the common case: tails go first
        state.emit.removed(g, [run.keys[i]])
        if not run.has_slot(i):
            prune(run)
        return
    removed = [run.keys[i]]
    if not state.layout.kinds[g].windowed:
        removed += _drop_below(state, g, run, i, offload)
    state.emit.removed(g, removed)
    _prune_subtree(run)


def _drop_below(state: CacheState, g: int, run: Run, i: int, offload: bool) -> list[BlockKey]:
    """A full-attention block without its prefix cannot be matched: drop the queued blocks
    below block i of ``run``; returns their keys. Held or claimed ones stay (a sequence that
    computed a duplicate of an ancestor holds its own copy) and are queued, unreachable, once
    released."""
    return _drop_queued(state, g, _blocks_below(run, i), offload)


def _drop_orphans(state: CacheState, blocks: list[tuple[Run, int]]) -> None:
    """A full-attention block left the cache (the first of ``blocks``, the others below it):
    the queued recurrent-state checkpoints there can never be matched again, so they go too
    (``kvpool.core.state_groups``)."""
    for h in state.config.state_groups:
        state.emit.removed(h, _drop_queued(state, h, blocks, False))


def _drop_queued(state: CacheState, g: int, blocks: list[tuple[Run, int]],
                 offload: bool) -> list[BlockKey]:
    """Drop group g's queued slots of ``blocks``; returns their keys."""
    removed: list[BlockKey] = []
    for r, j in blocks:
        ds = r.slot[g][j]
        if ds == NO_SLOT:
            continue
        dt = r.tier[g][j]
        pool = state.pools[dt][g]
        if ds not in pool.queue:
            continue
        pool.dequeue(ds)
        if offload and state.remote is not None:  # remote tier, as in evict()
            state.remote.dropped(dt, g, ds, r, j)
        state.copies.cancel_into(dt, g, ds)
        pool.clear(ds)
        pool.give_one(ds)
        r.slot[g][j] = NO_SLOT
        r.tier[g][j] = 0
        state.stats.evicted(0, 1)
        removed.append(r.keys[j])
    return removed


def _blocks_below(run: Run, i: int) -> list[tuple[Run, int]]:
    """Every block below block i of ``run``: the rest of the run, then the runs under it
    (depth first, parents before children)."""
    out = [(run, j) for j in range(i + 1, len(run.keys))]
    for r in run.descendants():
        out += [(r, j) for j in range(len(r.keys))]
    return out


def _prune_subtree(run: Run) -> None:
    """Drop slotless blocks without children below and in ``run``, then upwards."""
    order = [run, *run.descendants()]
    for r in reversed(order):  # children before parents
        if r.alive and not r.children:
            prune(r)
    prune(run if run.alive else run.parent)


def clear_queues(state: CacheState) -> None:
    """Drop every queued block on every tier (nothing offloaded)."""
    for t, tier in enumerate(state.pools):
        for g, pool in enumerate(tier):
            while len(pool.queue):
                s, prio = pool.pop_victim()
                evict(state, t, g, s, prio, offload=False)
                pool.give_one(s)


def drop_unwritten(state: CacheState, failed: Sequence[BlockCopy]) -> list[BlockCopy]:
    """The copies ``failed`` did not complete, so their destination slots hold unknown bytes:
    a cached block there (queued: no sequence uses it) leaves the cache, as if dropped, and a
    later request misses it. Returns the failed copies no drop can repair: those that brought
    a block a sequence uses (referenced on the GPU, or held for a suspended sequence)."""
    unrepaired: list[BlockCopy] = []
    for c in failed:
        t, g, s = c.dst_tier, c.layer_group, SlotId(c.dst_slot)
        pool = state.pools[t][g]
        if s in pool.queue:
            pool.dequeue(s)
            evict(state, t, g, s, DEFAULT_PRIORITY, offload=False)
            pool.give_one(s)
        elif pool.run_at[s] is not None or s in pool.held or (t == 0 and state.gpu[g].ref[s]):
            unrepaired.append(c)
    return unrepaired


# ------------------------------------------------------------------ claimed blocks


def onboard(state: CacheState, run: Run, i: int, g: int, refs: int) -> int:
    """Bring a claimed block up to the GPU with ``refs`` references; returns 1 if it moved
    now, 0 if an earlier request of the batch already brought it up."""
    t, s = run.tier[g][i], run.slot[g][i]
    if t == 0:
        state.gpu[g].hold_one(s, refs)
        return 0
    new = alloc(state, g)
    state.copies.add(BlockCopy(t, s, 0, new, g))
    colder = state.pools[t][g]
    colder.clear(s)
    if s not in colder.held:
        state.free_at_call_end(t, g, s)
    # else: a suspended sequence holds that copy; it stays held, no longer cached
    run.tier[g][i] = 0
    run.slot[g][i] = new
    gpu = state.gpu[g]
    gpu.place(new, run, i)
    gpu.set_refs(new, refs)
    state.stats.onboarded(0, state.storage.block_bytes(g))
    state.emit.updated(g, run.keys[i], t, 0)
    return 1


def take_over(state: CacheState, run: Run, i: int, g: int, refs: int) -> SlotId:
    """The request adopts an unreferenced leaf's slot in place; the block leaves the tree."""
    s = run.slot[g][i]
    pool = state.gpu[g]
    assert run.tier[g][i] == 0 and pool.ref[s] == 0
    pool.clear(s)
    run.slot[g][i] = NO_SLOT
    pool.set_refs(s, refs)
    state.emit.removed(g, [run.keys[i]])
    if not run.has_slot(i):
        prune(run)
    return s


def release_partials(state: CacheState, release: list[tuple[Run, int]]) -> None:
    """Queue again the partial sources a batch claimed and did not take over (unless a full
    match of the batch holds one, or it moved)."""
    for run, i in release:
        for g in state.layout.self_groups:
            t, s = run.tier[g][i], run.slot[g][i]
            pool = state.pools[t][g]
            if s == NO_SLOT or s in pool.queue or s in pool.held:
                continue
            if t == 0 and pool.ref[s] > 0:
                continue  # a full match holds it: the release is cancelled
            if pool.run_at[s] is run and pool.idx_at[s] == i:
                pool.enqueue(s, run.priority(i), key=run.keys[i])


# ------------------------------------------------------------------ releasing references


def unref(state: CacheState, g: int, s: SlotId) -> None:
    """Drop one reference on GPU slot s of group g; at zero it is queued (cached) or freed."""
    pool = state.gpu[g]
    if pool.drop_ref(s) == 0:
        run = pool.run_at[s]
        if run is None:
            pool.give_one(s)
        else:
            i = pool.idx_at[s]
            dur = run.duration(i)
            expires = state.clock() + dur if dur is not None else None
            pool.enqueue(s, run.priority(i), expires, run.keys[i])


def unref_many(state: CacheState, g: int, slots: list[SlotId]) -> None:
    """Drop one reference on each slot of a block table (NO_SLOT entries skipped).

    Cached blocks whose last reference goes join the eviction queue tail first, so that within
    one release a sequence's tail is evicted before its head: evicting a head block would take
    every block after it along (a full-attention block without its prefix cannot be matched).
    Uncached blocks become free.
    """
    pool = state.gpu[g]
    gone = pool.release(slots)  # blocks never committed (a partial last block) are freed
    if not gone:
        return
    run_at = cast("list[Run]", pool.run_at)  # (every slot in ``gone`` holds a block)
    queue = pool.queue
    push_many = pool.enqueue_many
    idx_at = pool.idx_at
    if not state.retention_seen:  # the common case: default priority, no duration
        if queue.uses_keys:
            keys = [run_at[s].keys[idx_at[s]] for s in gone]
            push_many(gone, DEFAULT_PRIORITY, keys)
        else:
            push_many(gone, DEFAULT_PRIORITY)
        return
    cached = [run_at[s] for s in gone]
    if all(r.prio is None for r in cached):
        if queue.uses_keys:
            keys = [r.keys[idx_at[s]] for r, s in zip(cached, gone, strict=True)]
            push_many(gone, DEFAULT_PRIORITY, keys)
        else:
            push_many(gone, DEFAULT_PRIORITY)
        return
    batch: list[SlotId] = []
    batch_keys: list[BlockKey] = []
    batch_prio = -1
    for s, run in zip(gone, cached, strict=True):
        i = idx_at[s]
        prio = run.priority(i)
        dur = run.duration(i)
        if batch and (dur is not None or prio != batch_prio):
            push_many(batch, batch_prio, batch_keys)
            batch, batch_keys = [], []
        if dur is not None:
            pool.enqueue(s, prio, state.clock() + dur, run.keys[i])
            continue
        batch_prio = prio
        batch.append(s)
        batch_keys.append(run.keys[i])
    if batch:
        push_many(batch, batch_prio, batch_keys)
