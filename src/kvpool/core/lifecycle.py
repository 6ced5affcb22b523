"""A sequence's life after admission: growth, rewind, suspend/resume and removal.

Each function is the body of one :class:`~kvpool.core.manager.KVCacheManager` call (the manager
takes its lock and delegates). Each checks everything it needs before changing anything, so it
either completes or raises with the state unchanged; a call that may copy blocks asks the
storage first (:meth:`CacheState.check_storage`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.allocator import alloc, lower_slot, unref, unref_many
from kvpool.core.commit import commit, commit_partial
from kvpool.core.radix import NO_SLOT, SlotId
from kvpool.core.sequence import Sequence as Seq
from kvpool.core.state import CacheState, SeqId
from kvpool.errors import (
    OutOfBlocksError,
    RewindError,
    SequenceStateError,
)
from kvpool.hashing.keys import tokens_to_u32
from kvpool.tiers.storage import BlockCopy
from kvpool.validation import check_int

# ------------------------------------------------------------------ growth


def growth(state: CacheState, seq: Seq, new_len: int) -> tuple[dict[int, int], dict[int, int]]:
    """(new slots needed, slots freed to the pool by window release) per group."""
    need: dict[int, int] = {}
    freed: dict[int, int] = {}
    blocks_after = -(-new_len // state.layout.tpb)
    for g in range(state.layout.num_groups):
        kind = state.layout.kinds[g]
        if kind.cross or kind.state:
            need[g] = freed[g] = 0
            continue
        add = max(0, blocks_after - len(seq.tables[g][0]))
        need[g] = add * seq.beam_width  # with beams, new blocks are per beam
        limit = kind.stale_limit(seq.num_tokens + 1)
        counts: dict[int, int] = {}
        for tb in seq.tables[g]:
            for i in range(kind.first_kept, min(limit, len(tb))):
                s = tb[i]
                if s != NO_SLOT:
                    counts[s] = counts.get(s, 0) + 1
        ref = state.gpu[g].ref
        freed[g] = sum(1 for s, c in counts.items() if ref[s] == c)
    return need, freed


def _deficit(state: CacheState, need: dict[int, int],
             freed: dict[int, int] | None = None) -> dict[tuple[int, int], int]:
    """(0, group) -> GPU slots missing for ``need`` (after ``freed`` return to the pool)."""
    out: dict[tuple[int, int], int] = {}
    for g, n in need.items():
        have = state.gpu[g].available() + (freed[g] if freed else 0)
        if n > have:
            out[(0, g)] = n - have
    return out


def _missing(deficit: dict[tuple[int, int], int]) -> str:
    return ", ".join(f"{v} slots in group {g}" for (_, g), v in sorted(deficit.items()))


def add_tokens(state: CacheState, seq_id: SeqId, token_ids: Sequence[int]) -> None:
    """See :meth:`KVCacheManager.add_tokens`."""
    seq = state.active(seq_id)
    toks = tokens_to_u32(token_ids)
    if not toks:
        return
    new_len = seq.num_tokens + len(toks)
    layout = state.layout
    if layout.full_attention_only and \
            new_len <= len(seq.tables[layout.self_groups[0]][0]) * layout.tpb:
        # the common decode step: the tokens fit the blocks held, no window moves
        seq.tokens.extend(toks)
        return
    need, freed = growth(state, seq, new_len)
    deficit = _deficit(state, need, freed)
    if deficit:
        raise OutOfBlocksError(
            f"sequence {seq_id!r} cannot grow to {new_len} tokens: missing {_missing(deficit)}",
            deficit,
        )
    if state.layout.tiers > 1:
        state.check_storage()  # evictions may offload: fail before changing anything
    state.begin_call()
    for g in state.layout.self_groups:
        # The step computes the new tokens' KV; its first token still attends back a window
        # from the old end, so staleness is judged at old length + 1.
        _release_stale(state, seq, g, seq.num_tokens + 1)
    blocks_after = -(-new_len // state.layout.tpb)
    for g in state.layout.self_groups:
        pool = state.gpu[g]
        for tb in seq.tables[g]:
            while len(tb) < blocks_after:
                s = alloc(state, g)
                pool.hold_one(s, 1)
                tb.append(s)
    seq.tokens.extend(toks)
    state.finish_call()


def _release_stale(state: CacheState, seq: Seq, g: int, length: int) -> None:
    kind = state.layout.kinds[g]
    limit = kind.stale_limit(length)
    for tb in seq.tables[g]:
        for i in range(kind.first_kept, min(limit, len(tb))):
            s = tb[i]
            if s != NO_SLOT:
                unref(state, g, s)
                tb[i] = NO_SLOT


def rewind_tokens(state: CacheState, seq_id: SeqId, num_tokens: int) -> None:
    """See :meth:`KVCacheManager.rewind_tokens`."""
    seq = state.active(seq_id)
    check_int("num_tokens", num_tokens, 0)
    new_len = seq.num_tokens - num_tokens
    floor = max(seq.committed_floor, seq.committed_blocks * state.layout.tpb)
    if new_len < floor:
        raise RewindError(
            f"cannot rewind sequence {seq_id!r} by {num_tokens} tokens to {new_len}: "
            f"its first {floor} tokens are committed"
        )
    keep = -(-new_len // state.layout.tpb)
    for g in state.layout.self_groups:
        kind = state.layout.kinds[g]
        if not kind.windowed:
            continue
        tb = seq.tables[g][0]
        for i in range(max(kind.stale_limit(new_len), kind.first_kept), min(keep, len(tb))):
            if tb[i] == NO_SLOT:
                raise RewindError(
                    f"cannot rewind sequence {seq_id!r} to {new_len} tokens: layer "
                    f"group {g} already released block {i} of its window"
                )
    for g in state.layout.self_groups:
        for tb in seq.tables[g]:
            while len(tb) > keep:
                s = tb.pop()
                if s != NO_SLOT:
                    unref(state, g, s)
    del seq.tokens[new_len:]


# ------------------------------------------------------------------ removal


def remove_sequence(state: CacheState, seq_id: SeqId, store_for_reuse: bool) -> None:
    """See :meth:`KVCacheManager.remove_sequence`."""
    seq = state.seq(seq_id)
    if seq.suspended:
        _release_moved(state, seq)
    elif store_for_reuse and state.config.enable_block_reuse:
        computed = seq.num_tokens - (1 if seq.num_tokens > seq.prompt_len else 0)
        commit(state, seq, computed // state.layout.tpb)
        # (a hybrid model never reuses a partial block: its state exists at block boundaries)
        if (state.config.enable_partial_reuse and computed % state.layout.tpb
                and not state.config.state_groups):
            commit_partial(state, seq, computed)
    for g, tables in enumerate(seq.tables):
        for tb in tables:
            unref_many(state, g, tb)
    state.drop_sequence(seq_id)
    state.finish_call()


def _release_moved(state: CacheState, seq: Seq) -> None:
    """A suspended sequence goes: its held colder-tier slots are queued (cached) or freed."""
    for (g, _), (t, h, _pos) in seq.moved.items():
        pool = state.pools[t][g]
        pool.unkeep(h)
        run = pool.run_at[h]
        if run is None:
            pool.give_one(h)
        else:
            i = pool.idx_at[h]
            pool.enqueue(h, run.priority(i), key=run.keys[i])
    seq.moved.clear()
    seq.suspended = False


# ------------------------------------------------------------------ preemption


def suspend(state: CacheState, seq_id: SeqId) -> dict[int, int]:
    """See :meth:`KVCacheManager.suspend`."""
    seq = state.seq(seq_id)
    if seq.suspended:
        raise SequenceStateError(f"sequence {seq_id!r} is already suspended")
    freed = dict.fromkeys(range(state.layout.num_groups), 0)
    if state.layout.tiers > 1:
        state.check_storage()
        for g in range(state.layout.num_groups):
            freed[g] = _offload_own(state, seq, g)
    seq.suspended = True
    state.finish_call()
    return freed


def _offload_own(state: CacheState, seq: Seq, g: int) -> int:
    """Move group g's blocks only this sequence holds to the host tier, held there; returns
    how many GPU slots that freed."""
    positions: dict[SlotId, list[tuple[int, int]]] = {}
    for b, tb in enumerate(seq.tables[g]):
        for i, s in enumerate(tb):
            if s != NO_SLOT:
                positions.setdefault(s, []).append((b, i))
    gpu, host = state.gpu[g], state.pools[1][g]
    freed = 0
    for s, pos in positions.items():
        if gpu.ref[s] != len(pos):
            continue  # shared with another sequence: stays on the GPU
        h = lower_slot(state, 1, g)
        if h is None:
            continue  # no room below: stays on the GPU, still held
        state.copies.add(BlockCopy(0, s, 1, h, g))
        _move_tree_entry(state, g, 0, s, 1, h)
        host.keep(h)
        gpu.set_refs(s, 0)
        gpu.give_one(s)
        for b, i in pos:
            seq.tables[g][b][i] = NO_SLOT
        seq.moved[(g, s)] = (1, h, pos)
        freed += 1
        state.stats.offloaded(1, state.storage.block_bytes(g))
    return freed


def resume(state: CacheState, seq_id: SeqId) -> None:
    """See :meth:`KVCacheManager.resume`."""
    seq = state.seq(seq_id)
    if not seq.suspended:
        raise SequenceStateError(f"sequence {seq_id!r} is not suspended")
    need = dict.fromkeys(range(state.layout.num_groups), 0)
    for g, _ in seq.moved:
        need[g] += 1
    deficit = _deficit(state, need)
    if deficit:
        raise OutOfBlocksError(
            f"cannot resume sequence {seq_id!r}: missing {_missing(deficit)}", deficit)
    if seq.moved:
        state.check_storage()
    state.begin_call()
    for (g, _), (t, h, pos) in seq.moved.items():
        new = alloc(state, g)
        state.copies.add(BlockCopy(t, h, 0, new, g))
        colder, gpu = state.pools[t][g], state.gpu[g]
        _move_tree_entry(state, g, t, h, 0, new)
        colder.unkeep(h)
        state.free_at_call_end(t, g, h)
        gpu.set_refs(new, len(pos))
        for b, i in pos:
            seq.tables[g][b][i] = new
        state.stats.onboarded(1, state.storage.block_bytes(g))
    seq.moved.clear()
    seq.suspended = False
    state.finish_call()


def _move_tree_entry(state: CacheState, g: int, t: int, s: SlotId, dt: int, ds: SlotId) -> None:
    """The tree block held in slot ``s`` of tier ``t`` (if one is) now lives in slot ``ds`` of
    tier ``dt``: the run, both pools' back-pointers and an updated event follow."""
    src = state.pools[t][g]
    run = src.run_at[s]
    if run is None:
        return
    i = src.idx_at[s]
    src.clear(s)
    run.tier[g][i], run.slot[g][i] = dt, ds
    state.pools[dt][g].place(ds, run, i)
    state.emit.updated(g, run.keys[i], t, dt)
