"""Committing a sequence's blocks for reuse: inserting them into the prefix tree.

A sequence's committed blocks are a path from its scope's root. ``seq.at_run`` / ``at_len``
remember where that path ends; a split or an eviction may have moved or dropped those blocks
since, which the last committed block's key tells, and then the path is found again by its
tokens with :func:`kvpool.core.radix.match_full`, the walk admission uses.

A commit first follows the blocks another sequence committed already (found by their tokens;
a GPU slot of this sequence fills a block that lost its slot in a group), then adds every
later block at once: their keys computed in one chained batch, as one new run, or appended to
the run this sequence's previous commit made when nothing branched from it since. Blocks that
gain a slot are reported as stored events, a chain per layer group.
"""

from __future__ import annotations

from kvpool.core.radix import NO_SLOT, Run, Segment, SlotId, match_full, prune
from kvpool.core.sequence import Sequence as Seq
from kvpool.core.state import CacheState
from kvpool.hashing.keys import BlockHasher, BlockKey


def hasher_after(state: CacheState, seq: Seq, blocks: int) -> BlockHasher:
    """A hasher positioned after the sequence's first ``blocks`` full blocks."""
    return state.hasher(seq).resumed(seq.keys[:blocks] if blocks < len(seq.keys) else seq.keys)


def position(state: CacheState, seq: Seq, blocks: int, *,
             rebuild: bool = True) -> tuple[Run, int] | None:
    """Where the sequence's first ``blocks`` committed blocks end in the tree: (run, n), after
    block n - 1 of run (n = 0 only at the root).

    When the remembered end is stale the path is walked again by tokens, and with ``rebuild``
    blocks a prune removed are recreated as path blocks (their keys are still valid; only
    slots were lost); without it, None.
    """
    run, n = seq.at_run, seq.at_len
    c = seq.committed_blocks
    if not (run.alive and len(run.keys) >= n
            and (run is seq.root if n == 0 else run.keys[n - 1] == seq.keys[c - 1])):
        found = _walk_path(state, seq, c, rebuild)
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


def _walk_path(state: CacheState, seq: Seq, blocks: int, rebuild: bool) -> tuple[Run, int] | None:
    """Where the sequence's first ``blocks`` blocks end in the tree, found by their tokens;
    with ``rebuild`` the blocks past the match are recreated as a path run without slots,
    else None."""
    root = seq.root = state.root((seq.lora_id, seq.cache_salt))
    path = match_full(root, seq.tokens.tobytes(), blocks, state.layout.step)
    run, n = (path[-1][0], path[-1][2]) if path else (root, 0)
    on_path = sum(b - a for _, a, b in path)
    if on_path == blocks:
        return run, n
    if not rebuild:
        return None
    slots = [[NO_SLOT] * (blocks - on_path) for _ in range(state.layout.num_groups)]
    return new_run(state, seq, run, n, on_path, blocks, slots), blocks - on_path


def new_run(state: CacheState, seq: Seq, run: Run, n: int, first: int, upto: int,
            slots: list[list[SlotId]], keys: list[BlockKey] | None = None,
            raw: bytes | None = None) -> Run:
    """Blocks [first, upto) of ``seq`` (keys known, or given) as a new run after block n - 1
    of ``run`` (split there if needed), holding ``slots`` per group (GPU). ``raw``: the
    sequence's tokens as bytes, when the caller has them."""
    step = state.layout.step
    if n < len(run.keys):
        reindex(state, run.split(n, step))
    tk = (seq.tokens[first * state.layout.tpb:upto * state.layout.tpb].tobytes() if raw is None
          else raw[first * step:upto * step])
    new = Run(run, tk, tk[:step], seq.keys[first:upto] if keys is None else keys, slots,
              [[0] * (upto - first) for _ in slots])
    run.add_child(new)
    if seq.retention is not None:
        for j in range(upto - first):
            set_priority(state, seq, new, j, (first + j) * state.layout.tpb)
    return new


def reindex(state: CacheState, run: Run) -> None:
    """Point the slots of ``run``'s blocks at it (after a split renumbered them)."""
    for g, slots in enumerate(run.slot):
        tiers = run.tier[g]
        if not any(tiers):
            state.gpu[g].place_all(slots, run)
            continue
        for j, s in enumerate(slots):
            if s != NO_SLOT:
                state.pools[tiers[j]][g].place(s, run, j)


def set_priority(state: CacheState, seq: Seq, run: Run, i: int, first_token: int) -> None:
    """Block i of ``run`` (starting at token ``first_token``) takes the sequence's retention."""
    ret = seq.retention
    if ret is None:
        return
    state.retention_seen = True
    if first_token >= seq.prompt_len:
        run.set_retention(i, ret.decode_priority, ret.decode_duration_s)
    else:
        run.set_retention(i, *ret.block_priority(first_token))


def commit(state: CacheState, seq: Seq, upto: int) -> None:
    """Insert the sequence's full blocks [committed, upto) into the tree (beam 0)."""
    start = seq.committed_blocks
    if not state.config.enable_block_reuse or upto <= start:
        return
    pos = position(state, seq, start)
    assert pos is not None
    chains: dict[int, list[Segment]] = {}  # per group: the stored chain still open
    raw = seq.tokens.tobytes()
    run, n, i = _follow_existing(state, seq, raw, *pos, start, upto, chains)
    if i < upto:
        run, n = _add_new(state, seq, raw, run, n, i, upto, chains)
    for g, chain in chains.items():
        state.emit.stored(g, chain, seq.lora_id)
    if state.remote is not None:  # remote tier: write-through of the committed blocks
        state.remote.stored(seq, start, upto)
    seq.committed_blocks = upto
    seq.at_run, seq.at_len = run, n
    if n == len(run.keys) and not run.children and not run.has_slot(n - 1):
        prune(run)


def _follow_existing(state: CacheState, seq: Seq, raw: bytes, run: Run, n: int, i: int,
                     upto: int, chains: dict[int, list[Segment]]) -> tuple[Run, int, int]:
    """Follow blocks [i, upto) of the sequence while the tree has them (another sequence
    committed them); a block without a slot in a group takes this sequence's. Returns where
    the path ends (run, n) and the first block not in the tree."""
    step = state.layout.step
    events = state.emit.sink is not None
    keys = seq.keys
    group_tables = None
    while i < upto:
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
        if group_tables is None:
            group_tables = [(g, seq.tables[g][0], state.gpu[g]) for g in state.layout.self_groups]
        for g, tb, pool in group_tables:
            s = tb[i] if i < len(tb) else NO_SLOT
            if s != NO_SLOT and run.slot[g][n] == NO_SLOT and pool.run_at[s] is None:
                run.slot[g][n] = s
                run.tier[g][n] = 0
                pool.place(s, run, n)
                if events:
                    chain = chains.setdefault(g, [])
                    if chain and chain[-1][0] is run and chain[-1][2] == n:
                        chain[-1] = (run, chain[-1][1], n + 1)
                    else:
                        chain.append((run, n, n + 1))
            elif events and g in chains:
                state.emit.stored(g, chains.pop(g), seq.lora_id)
        n += 1
        i += 1
    return run, n, i


def _add_new(state: CacheState, seq: Seq, raw: bytes, run: Run, n: int, first: int, upto: int,
             chains: dict[int, list[Segment]]) -> tuple[Run, int]:
    """Blocks [first, upto), none in the tree, as a chain after block n - 1 of ``run``:
    appended to the sequence's own run, or a new run. Returns where the path ends."""
    step = state.layout.step
    count = upto - first
    keys = seq.keys
    new_keys = state.hasher(seq).keys_after(keys[:first] if first < len(keys) else keys,
                                         raw[first * step:upto * step])
    keys.extend(new_keys)
    slots: list[list[SlotId]] = []
    for g in range(state.layout.num_groups):
        if state.layout.kinds[g].cross or state.layout.kinds[g].state:  # no slots of their own
            slots.append([NO_SLOT] * count)
            continue
        sl = seq.tables[g][0][first:upto]
        if len(sl) < count:
            sl += [NO_SLOT] * (count - len(sl))
        na = state.gpu[g].run_at
        slots.append([s if s != NO_SLOT and na[s] is None else NO_SLOT for s in sl])
    if (run is seq.own_run and run.alive and n == len(run.keys) and not run.children
            and len(run.ckey) == step):
        base = n
        run.extend(raw[first * step:upto * step], new_keys, slots,
                   [[0] * count for _ in slots], step)
        if seq.retention is not None:
            for j in range(count):
                set_priority(state, seq, run, base + j, (first + j) * state.layout.tpb)
    else:
        base = 0
        run = new_run(state, seq, run, n, first, upto, slots, new_keys, raw)
    seq.own_run = run
    events = state.emit.sink is not None
    for g in state.layout.self_groups:
        sl = slots[g]
        if not events and NO_SLOT not in sl:  # the common case, in two C-speed loops
            state.gpu[g].place_all(sl, run, base)
            continue
        _place_and_chain(state, seq, g, run, base, sl, chains, events)
    return run, base + count


def _place_and_chain(state: CacheState, seq: Seq, g: int, run: Run, base: int, sl: list[SlotId],
                     chains: dict[int, list[Segment]], events: bool) -> None:
    """Point new blocks' slots at ``run`` (from block ``base``) and extend group g's stored
    chain with them; a block without a slot ends the chain (its event is sent)."""
    state.gpu[g].place_all(sl, run, base)  # one pass (docs/architecture.md §3.10)
    piece = chains.pop(g, [])  # a chain still open ends at the block just before these
    start = -1  # first block of the stretch being stored
    for j, s in enumerate(sl, base):
        if s != NO_SLOT:
            if start < 0:
                start = j
            continue
        if start >= 0:
            piece.append((run, start, j))
            start = -1
        if piece and events:
            state.emit.stored(g, piece, seq.lora_id)
        piece = []
    if start >= 0:
        piece.append((run, start, base + len(sl)))
    if piece and events:
        chains[g] = piece


def commit_partial(state: CacheState, seq: Seq, computed: int) -> None:
    """Store the trailing partial block as a leaf keyed by its (short) token chain."""
    tpb = state.layout.tpb
    full = computed // tpb
    if seq.committed_blocks < full:
        return
    pos = position(state, seq, full, rebuild=False)
    if pos is None:
        return
    run, n = pos
    tokens = seq.tokens[full * tpb:computed]
    tk = tokens.tobytes()
    if n == len(run.keys) and tk in run.children:
        return
    stored = []
    slots: list[list[SlotId]] = []
    for g in range(state.layout.num_groups):
        s = NO_SLOT
        if g in state.layout.self_groups:
            tb = seq.tables[g][0]
            s = tb[full] if full < len(tb) else NO_SLOT
            if s != NO_SLOT and state.gpu[g].run_at[s] is not None:
                s = NO_SLOT
        if s != NO_SLOT:
            stored.append(g)
        slots.append([s])
    if not stored:
        return
    if n < len(run.keys):
        reindex(state, run.split(n, state.layout.step))
    key = hasher_after(state, seq, full).key_of_prefix_block(tokens)
    leaf = Run(run, tk, tk, [key], slots, [[0] for _ in slots])
    run.add_child(leaf)
    set_priority(state, seq, leaf, 0, full * tpb)
    for g in stored:
        state.gpu[g].place(slots[g][0], leaf, 0)
        state.emit.stored(g, [(leaf, 0, 1)], seq.lora_id)
