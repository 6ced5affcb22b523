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

from collections.abc import Callable, Sequence
from typing import cast

from kvpool.core.radix import NO_SLOT, Run, SlotId, detach, prune
from kvpool.core.state import CacheState
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.storage import BlockCopy

# ------------------------------------------------------------------ taking slots


def alloc(st: CacheState, g: int) -> SlotId:
    """A GPU slot of group g (free first, else the policy's victim, evicted)."""
    st.new_count[g] += 1
    pool = st.gpu[g]
    if pool.free:
        return pool.free.pop()
    s, prio = cast("tuple[SlotId, int]", pool.queue.pop())
    evict(st, 0, g, s, prio)
    return s


def alloc_n(st: CacheState, g: int, n: int) -> list[SlotId]:
    """``n`` GPU slots of group g (free ones first, then evicted victims)."""
    if n <= 0:
        return []
    pool = st.gpu[g]
    st.new_count[g] += n
    out = pool.take(n)
    if len(out) == n:
        return out
    if st.tiers > 1 or st.copies or st.remote is not None:  # remote: evict() sees each block
        free = pool.free
        pop = cast("Callable[[], tuple[SlotId, int]]", pool.queue.pop)
        while len(out) < n:
            if free:  # an eviction's cascade freed its descendants' slots
                out.append(free.pop())
                continue
            s, prio = pop()
            evict(st, 0, g, s, prio)
            out.append(s)
        return out
    victims = cast("list[SlotId]", pool.queue.pop_slots(n - len(out)))
    _drop_victims(st, g, victims)
    out += victims
    return out


def _drop_victims(st: CacheState, g: int, slots: list[SlotId]) -> None:
    """Drop the blocks of GPU victims ``slots`` (one tier, no copy in flight: a victim's
    priority cannot send it down a tier).

    A victim that is a leaf's tail just leaves its run. (A victim with queued descendants
    drops them too; their slots go to the free list, so the call may evict a few more blocks
    than it needs.) Victims come tail first, so a run losing its tail is truncated once, at
    the end: until then ``cut`` holds its length (the blocks past it have no slot left), and
    a run losing every block leaves its parent at once.
    """
    pool = st.gpu[g]
    run_at, idx_at = pool.run_at, pool.idx_at
    single = st.num_groups == 1
    stats = st.stats
    if single:
        tails = leaf_tails(pool.run_at, pool.idx_at, g, slots)
        if tails is not None:
            drop_tails(st, g, tails)
            stats.evicted_blocks += len(slots)
            stats.dropped_blocks += len(slots)
            return
    events = st.emit.sink is not None
    removed: list[BlockKey] = []
    cut: dict[Run, int] = {}
    prev: Run | None = None  # the run the last victim left, and its length now
    prev_n = 0
    slow = 0
    for s in slots:
        run = run_at[s]
        assert run is not None
        i = idx_at[s]
        if (run is not prev or i != prev_n - 1) and (
                i != cut.get(run, len(run.keys)) - 1 or run.children):
            st.emit.removed(g, removed)  # keep the removed hashes in eviction order
            removed = []
            cut_runs(cut)
            cut = {}
            prev = None
            slow += 1
            evict(st, 0, g, s, DEFAULT_PRIORITY)  # counts its own evictions and drops
            continue
        run_at[s] = None
        run.slot[g][i] = NO_SLOT
        if events:
            removed.append(run.keys[i])
        if st.config.state_groups and not st.kinds[g].windowed:
            _drop_orphans(st, [(run, i)])  # a tail: nothing below it
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
    stats.evicted_blocks += len(slots) - slow
    stats.dropped_blocks += len(slots) - slow
    st.emit.removed(g, removed)


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


def drop_tails(st: CacheState, g: int, tails: list[tuple[Run, int]]) -> None:
    """Evict whole leaf-run tails found by :func:`leaf_tails`: what evicting their blocks one
    by one does, a run at a time."""
    run_at = st.gpu[g].run_at
    events = st.emit.sink is not None
    removed: list[BlockKey] = []
    for run, keep in tails:
        sl = run.slot[g]
        for s in sl[keep:]:
            run_at[s] = None
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
    st.emit.removed(g, removed)


def cut_runs(cut: dict[Run, int]) -> None:
    """Truncate runs to the lengths ``cut`` gives (their tails lost every slot)."""
    for run, n in cut.items():
        if run.alive and n < len(run.keys):
            run.truncate(n)
            if not run.children and not run.has_slot(n - 1):
                prune(run)


def lower_slot(st: CacheState, t: int, g: int) -> SlotId | None:
    """A slot on colder tier t for an offloaded block, or None if none can be had."""
    pool = st.pools[t][g]
    if pool.free:
        return pool.free.pop()
    if not len(pool.queue):
        return None
    s, prio = cast("tuple[SlotId, int]", pool.queue.pop())
    evict(st, t, g, s, prio)
    return s


# ------------------------------------------------------------------ eviction


def evict(st: CacheState, t: int, g: int, slot: SlotId, priority: int, *,
          offload: bool = True) -> None:
    """The block at (t, g, slot) leaves that slot: offloaded one tier down, or dropped."""
    pool = st.pools[t][g]
    run = pool.run_at[slot]
    i = pool.idx_at[slot]
    assert run is not None and run.slot[g][i] == slot and run.tier[g][i] == t
    pool.clear(slot)
    st.stats.evicted_blocks += 1
    if (offload and t + 1 < st.tiers and priority >= st.config.offload_min_priority
            and pool.queue.should_offload(slot)):
        s2 = lower_slot(st, t + 1, g)
        if s2 is not None:
            run.tier[g][i] = t + 1
            run.slot[g][i] = s2
            lower = st.pools[t + 1][g]
            lower.place(s2, run, i)
            lower.queue.push(s2, run.priority(i), key=run.keys[i])
            st.copies.add(BlockCopy(t, slot, t + 1, s2, g))
            st.stats.offload_blocks += 1
            st.stats.offload_bytes += st.storage.block_bytes(g)
            st.emit.updated(g, run.keys[i], t, t + 1)
            return
    if offload and st.remote is not None:  # remote tier: the block leaves the local tiers
        st.remote.dropped(t, g, slot, run, i)
    if st.copies:
        st.copies.cancel_into(t, g, slot)
    run.slot[g][i] = NO_SLOT
    run.tier[g][i] = 0
    st.stats.dropped_blocks += 1
    if st.config.state_groups and not st.kinds[g].windowed:
        # checkpoints at and below a lost attention block
        _drop_orphans(st, [(run, i), *_blocks_below(run, i)])
    if i == len(run.keys) - 1 and not run.children:  # the common case: tails go first
        st.emit.removed(g, [run.keys[i]])
        if not run.has_slot(i):
            prune(run)
        return
    removed = [run.keys[i]]
    if not st.kinds[g].windowed:
        removed += _drop_below(st, g, run, i, offload)
    st.emit.removed(g, removed)
    _prune_subtree(run)


def _drop_below(st: CacheState, g: int, run: Run, i: int, offload: bool) -> list[BlockKey]:
    """A full-attention block without its prefix cannot be matched: drop the queued blocks
    below block i of ``run``; returns their keys. Held or claimed ones stay (a sequence that
    computed a duplicate of an ancestor holds its own copy) and are queued, unreachable, once
    released."""
    return _drop_queued(st, g, _blocks_below(run, i), offload)


def _drop_orphans(st: CacheState, blocks: list[tuple[Run, int]]) -> None:
    """A full-attention block left the cache (the first of ``blocks``, the others below it):
    the queued recurrent-state checkpoints there can never be matched again, so they go too
    (``kvpool.core.state_groups``)."""
    for h in st.config.state_groups:
        st.emit.removed(h, _drop_queued(st, h, blocks, False))


def _drop_queued(st: CacheState, g: int, blocks: list[tuple[Run, int]],
                 offload: bool) -> list[BlockKey]:
    """Drop group g's queued slots of ``blocks``; returns their keys."""
    removed: list[BlockKey] = []
    for r, j in blocks:
        ds = r.slot[g][j]
        if ds == NO_SLOT:
            continue
        dt = r.tier[g][j]
        pool = st.pools[dt][g]
        if ds not in pool.queue:
            continue
        pool.queue.remove(ds)
        if offload and st.remote is not None:  # remote tier, as in evict()
            st.remote.dropped(dt, g, ds, r, j)
        st.copies.cancel_into(dt, g, ds)
        pool.clear(ds)
        pool.free.append(ds)
        r.slot[g][j] = NO_SLOT
        r.tier[g][j] = 0
        st.stats.dropped_blocks += 1
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


def clear_queues(st: CacheState) -> None:
    """Drop every queued block on every tier (nothing offloaded)."""
    for t, tier in enumerate(st.pools):
        for g, pool in enumerate(tier):
            q = pool.queue
            while len(q):
                s, prio = cast("tuple[SlotId, int]", q.pop())
                evict(st, t, g, s, prio, offload=False)
                pool.free.append(s)


def drop_unwritten(st: CacheState, failed: Sequence[BlockCopy]) -> list[BlockCopy]:
    """The copies ``failed`` did not complete, so their destination slots hold unknown bytes:
    a cached block there (queued: no sequence uses it) leaves the cache, as if dropped, and a
    later request misses it. Returns the failed copies no drop can repair: those that brought
    a block a sequence uses (referenced on the GPU, or held for a suspended sequence)."""
    unrepaired: list[BlockCopy] = []
    for c in failed:
        t, g, s = c.dst_tier, c.layer_group, SlotId(c.dst_slot)
        pool = st.pools[t][g]
        if s in pool.queue:
            pool.queue.remove(s)
            evict(st, t, g, s, DEFAULT_PRIORITY, offload=False)
            pool.free.append(s)
        elif pool.run_at[s] is not None or s in pool.held or (t == 0 and st.gpu[g].ref[s]):
            unrepaired.append(c)
    return unrepaired


# ------------------------------------------------------------------ claimed blocks


def onboard(st: CacheState, run: Run, i: int, g: int, refs: int) -> int:
    """Bring a claimed block up to the GPU with ``refs`` references; returns 1 if it moved
    now, 0 if an earlier request of the batch already brought it up."""
    t, s = run.tier[g][i], run.slot[g][i]
    if t == 0:
        st.gpu[g].ref[s] += refs
        return 0
    new = alloc(st, g)
    st.copies.add(BlockCopy(t, s, 0, new, g))
    colder = st.pools[t][g]
    colder.clear(s)
    if s not in colder.held:
        st.pending_free.append((t, g, s))
    # else: a suspended sequence holds that copy; it stays held, no longer cached
    run.tier[g][i] = 0
    run.slot[g][i] = new
    gpu = st.gpu[g]
    gpu.place(new, run, i)
    gpu.ref[new] = refs
    st.stats.onboard_bytes += st.storage.block_bytes(g)
    st.emit.updated(g, run.keys[i], t, 0)
    return 1


def take_over(st: CacheState, run: Run, i: int, g: int, refs: int) -> SlotId:
    """The request adopts an unreferenced leaf's slot in place; the block leaves the tree."""
    s = run.slot[g][i]
    pool = st.gpu[g]
    assert run.tier[g][i] == 0 and pool.ref[s] == 0
    pool.clear(s)
    run.slot[g][i] = NO_SLOT
    pool.ref[s] = refs
    st.emit.removed(g, [run.keys[i]])
    if not run.has_slot(i):
        prune(run)
    return s


def release_partials(st: CacheState, release: list[tuple[Run, int]]) -> None:
    """Queue again the partial sources a batch claimed and did not take over (unless a full
    match of the batch holds one, or it moved)."""
    for run, i in release:
        for g in st.self_groups:
            t, s = run.tier[g][i], run.slot[g][i]
            pool = st.pools[t][g]
            if s == NO_SLOT or s in pool.queue or s in pool.held:
                continue
            if t == 0 and pool.ref[s] > 0:
                continue  # a full match holds it: the release is cancelled
            if pool.run_at[s] is run and pool.idx_at[s] == i:
                pool.queue.push(s, run.priority(i), key=run.keys[i])


# ------------------------------------------------------------------ releasing references


def unref(st: CacheState, g: int, s: SlotId) -> None:
    """Drop one reference on GPU slot s of group g; at zero it is queued (cached) or freed."""
    pool = st.gpu[g]
    ref = pool.ref
    ref[s] -= 1
    assert ref[s] >= 0
    if ref[s] == 0:
        run = pool.run_at[s]
        if run is None:
            pool.free.append(s)
        else:
            i = pool.idx_at[s]
            dur = run.duration(i)
            expires = st.clock() + dur if dur is not None else None
            pool.queue.push(s, run.priority(i), expires, run.keys[i])


def unref_many(st: CacheState, g: int, slots: list[SlotId]) -> None:
    """Drop one reference on each slot of a block table (NO_SLOT entries skipped).

    Cached blocks whose last reference goes join the eviction queue tail first, so that within
    one release a sequence's tail is evicted before its head: evicting a head block would take
    every block after it along (a full-attention block without its prefix cannot be matched).
    Uncached blocks become free.
    """
    pool = st.gpu[g]
    gone = pool.release(slots)  # blocks never committed (a partial last block) are freed
    if not gone:
        return
    run_at = cast("list[Run]", pool.run_at)  # (every slot in ``gone`` holds a block)
    queue = pool.queue
    idx_at = pool.idx_at
    if not st.retention_seen:  # the common case: default priority, no duration
        if queue.uses_keys:
            keys = [run_at[s].keys[idx_at[s]] for s in gone]
            queue.push_many(gone, DEFAULT_PRIORITY, keys)
        else:
            queue.push_many(gone, DEFAULT_PRIORITY)
        return
    cached = [run_at[s] for s in gone]
    if all(r.prio is None for r in cached):
        if queue.uses_keys:
            keys = [r.keys[idx_at[s]] for r, s in zip(cached, gone, strict=True)]
            queue.push_many(gone, DEFAULT_PRIORITY, keys)
        else:
            queue.push_many(gone, DEFAULT_PRIORITY)
        return
    batch: list[SlotId] = []
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
            queue.push(s, prio, st.clock() + dur, run.keys[i])
            continue
        batch_prio = prio
        batch.append(s)
        batch_keys.append(run.keys[i])
    if batch:
        queue.push_many(batch, batch_prio, batch_keys)
