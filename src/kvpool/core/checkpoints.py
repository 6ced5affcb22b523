"""Recurrent-state checkpoints of hybrid models: admission's copies, the policy, saving.

The concept (state groups, checkpoints in the prefix tree, the reuse rule) is described in
:mod:`kvpool.core.state_groups`; this module does the work that takes slots:

- admission phase 2 (:func:`running_slots`): each admitted sequence gets a fresh running slot
  per beam in every state group, a copy of the checkpoint its prefix matched (read from the
  checkpoint's tier, host and disk included: no GPU slot is taken to onboard it), and the
  batch's claims are released once every request is allocated (:func:`release_claims`); a
  cold sequence's running slots are zeroed after the call's copies (the manager,
  :func:`cold_slots`);
- the **policy** (:class:`CheckpointBook`, ``CacheConfig.checkpoint_policy``): at which token
  counts a sequence's state should be saved (:meth:`CheckpointBook.positions`), so the engine
  splits its prefill there, and :meth:`CheckpointBook.save` copies the running slot into a
  new checkpoint slot cached under that prefix's last block.

Policies (docs/hybrid.md): ``every_block``; ``interval`` (every ``checkpoint_interval_tokens``);
``last`` (the last boundary a sequence reached: each new one replaces the sequence's previous
one, so a finished or suspended sequence leaves its last boundary); ``branch`` (where an
admitted request's attention match ends without a checkpoint: a branch point of the tree,
which a later request sharing that prefix then resumes from); ``marconi`` (the default:
``branch`` + the prompt's last boundary + ``last``: Marconi's admission rule, arXiv
2411.19379, keeping only the states most likely to be reused per byte - shared prefixes, the
prompt a later turn extends, the end of a conversation - instead of one per block).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from kvpool.core.allocator import alloc, alloc_n, evict, unref
from kvpool.core.commit import commit, position
from kvpool.core.plan import BatchPlan, RequestPlan
from kvpool.core.radix import NO_SLOT, Run, SlotId, match_full
from kvpool.core.sequence import Sequence as Seq
from kvpool.core.state import CacheState, SeqId
from kvpool.core.stats import RequestStats
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.tiers.storage import BlockCopy

# ------------------------------------------------------------------ admission (execute)


def running_slots(st: CacheState, p: RequestPlan, g: int,
                  stats: RequestStats) -> list[list[SlotId]]:
    """Phase 2 in state group g: a fresh running slot per beam, each a copy of the claimed
    checkpoint (from its tier) when the request reuses a prefix; a cold one is zeroed by the
    manager after the call's copies (:func:`cold_slots`)."""
    beams = p.request.beam_width
    out = alloc_n(st, g, beams)
    pool = st.gpu[g]
    for s in out:
        pool.hold_one(s, 1)
    if p.num_matched:
        t = p.claim_tiers[g][0] if p.claim_tiers[g] else 0
        src = p.claim_slots[g][0]
        for s in out:
            st.copies.add(BlockCopy(t, src, 0, s, g))
        st.stats.tier_hit(t, 1)
    stats.alloc_total += beams
    return [[s] for s in out]


def release_claims(st: CacheState, plan: BatchPlan) -> None:
    """After phase 2: the checkpoints the batch claimed go back to their queues (unless a
    request still claims... none does: every request of the batch has copied its own)."""
    for p in plan.requests:
        if not p.num_matched:
            continue
        beams = p.request.beam_width
        for g in st.config.state_groups:
            s = p.claim_slots[g][0]
            t = p.claim_tiers[g][0] if p.claim_tiers[g] else 0
            if t == 0:
                for _ in range(beams):
                    unref(st, g, s)
                continue
            pool = st.pools[t][g]
            run = pool.run_at[s]
            if run is not None and s not in pool.queue and s not in pool.held:
                i = pool.idx_at[s]
                pool.enqueue(s, run.priority(i), key=run.keys[i])


# ------------------------------------------------------------------ the policy and saving


@dataclass(slots=True)
class _Provisional:
    """The checkpoint a sequence saved last under ``last``/``marconi``: replaced by its next."""

    run: Run
    i: int
    slots: dict[int, SlotId]


def full_groups(st: CacheState) -> list[int]:
    """The full-attention layer groups (a checkpoint needs every block of its prefix there)."""
    return [g for g in st.layout.self_groups if not st.layout.kinds[g].windowed]


def attention_match(st: CacheState, p: RequestPlan) -> int:
    """Blocks of ``p``'s prompt whose full-attention blocks are cached (any tier), ignoring
    checkpoints: where the request's path leaves the tree (or its cached part)."""
    r = p.request
    root = st.roots.get((r.lora_id, r.cache_salt))
    if root is None or not st.config.enable_block_reuse:
        return 0
    body = len(r.tokens) - 1
    raw = r.tokens.tobytes() if isinstance(r.tokens, array) else array("I", r.tokens).tobytes()
    d = 0
    groups = full_groups(st)
    for run, a, b in match_full(root, raw, body // st.layout.tpb, st.layout.step):
        for j in range(a, b):
            if any(run.slot[g][j] == NO_SLOT for g in groups):
                return d
            d += 1
    return d


def _reachable(st: CacheState, run: Run, i: int) -> bool:
    """Do block i of ``run`` and every block before it hold a full-attention slot?"""
    groups = full_groups(st)
    r: Run | None = run
    n = i + 1
    while r is not None and r.parent is not None:
        for g in groups:
            if NO_SLOT in r.slot[g][:n]:
                return False
        r = r.parent
        n = len(r.keys) if r is not None else 0
    return True


class CheckpointBook:
    """Which boundaries each live sequence should checkpoint, and saving them."""

    __slots__ = ("branch", "interval", "policy", "provisional", "st")

    def __init__(self, st: CacheState) -> None:
        self.st = st
        self.policy = st.config.checkpoint_policy
        self.interval = (st.config.checkpoint_interval_tokens if self.policy == "interval"
                         else st.layout.tpb)
        self.branch: dict[SeqId, int] = {}  # token count of the branch point, per sequence
        self.provisional: dict[SeqId, _Provisional] = {}

    def admitting(self, plan: BatchPlan) -> None:
        """Before a batch is admitted: note each request's branch point (its attention match
        ends past its checkpoint match)."""
        if self.policy not in ("branch", "marconi"):
            return
        for p in plan.requests:
            d = attention_match(self.st, p)
            if d > p.num_matched:
                self.branch[p.seq_id] = d * self.st.layout.tpb

    def forget(self, seq_id: SeqId) -> None:
        """The sequence left (its checkpoints stay cached)."""
        self.branch.pop(seq_id, None)
        self.provisional.pop(seq_id, None)

    def positions(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Token counts in (start, end] at which the policy wants a checkpoint."""
        tpb = self.st.layout.tpb
        out: set[int] = set()
        if self.policy in ("every_block", "interval"):
            n = self.interval
            out.update(range((start // n + 1) * n, end + 1, n))
        if self.policy in ("last", "marconi") and end // tpb * tpb > start:
            out.add(end // tpb * tpb)
        for b in self._kept(seq_id):
            if start < b <= end:
                out.add(b)
        return sorted(out)

    def _kept(self, seq_id: SeqId) -> tuple[int, ...]:
        """The boundaries of a sequence saved for good under ``branch`` / ``marconi``: its
        branch point, and (``marconi``) its prompt's last boundary."""
        out: tuple[int, ...] = ()
        b = self.branch.get(seq_id)
        if b is not None:
            out = (b,)
        if self.policy == "marconi":
            seq = self.st.sequences.get(seq_id)
            if seq is not None and seq.prompt_len >= self.st.layout.tpb:
                out += (seq.prompt_len // self.st.layout.tpb * self.st.layout.tpb,)
        return out

    def save(self, seq: Seq, num_tokens: int) -> bool:
        """Copy the sequence's running state (after ``num_tokens`` tokens, a block boundary)
        into a checkpoint under that prefix; False when it cannot be cached (reuse off, a
        state pool with no slot to spare, a prefix not reachable in the tree). The caller
        checked the arguments and the storage, and ends the call."""
        st = self.st
        nb = num_tokens // st.layout.tpb
        state = st.config.state_groups
        if not st.config.enable_block_reuse or any(not st.gpu[g].available() for g in state):
            return False
        commit(st, seq, nb)
        pos = position(st, seq, nb, rebuild=False)
        if pos is None:
            return False
        run, n = pos
        while n == 0 and run.parent is not None:  # the start of a run: its parent's end
            run = run.parent
            n = len(run.keys)
        if n == 0:
            return False
        i = n - 1
        if not _reachable(st, run, i):
            return False
        saved: dict[int, SlotId] = {}
        for g in state:
            if run.slot[g][i] != NO_SLOT:
                continue  # that boundary has a checkpoint already
            s = alloc(st, g)
            if not run.alive or run.slot[g][i] != NO_SLOT:  # pragma: no cover - defensive
                st.gpu[g].give_one(s)
                continue
            st.copies.add(BlockCopy(0, seq.tables[g][0][0], 0, s, g))
            run.slot[g][i], run.tier[g][i] = s, 0
            pool = st.gpu[g]
            pool.place(s, run, i)
            pool.enqueue(s, run.priority(i), key=run.keys[i])
            st.emit.stored(g, [(run, i, i + 1)], seq.lora_id)
            saved[g] = s
        if self.policy in ("last", "marconi") and num_tokens not in self._kept(seq.seq_id):
            old = self.provisional.pop(seq.seq_id, None)
            if old is not None and (old.run is not run or old.i != i):
                self._drop(old)
            if saved:
                self.provisional[seq.seq_id] = _Provisional(run, i, saved)
        return True

    def _drop(self, old: _Provisional) -> None:
        """Drop a sequence's previous provisional checkpoint, if it is still where it was."""
        st = self.st
        run, i = old.run, old.i
        for g, s in old.slots.items():
            if not run.alive or i >= len(run.keys) or run.slot[g][i] != s:
                continue
            t = run.tier[g][i]
            pool = st.pools[t][g]
            if s in pool.queue:
                pool.dequeue(s)
                evict(st, t, g, s, DEFAULT_PRIORITY, offload=False)
                pool.give_one(s)


def check_checkpoints(st: CacheState) -> None:
    """Every checkpoint sits at the end of a path whose full-attention blocks all hold a slot
    (on some tier); running slots are not in the tree. For tests (O(tree))."""
    state = st.config.state_groups
    if not state:
        return
    full = [g for g in st.layout.self_groups if not st.layout.kinds[g].windowed]
    for root in st.roots.values():
        stack: list[tuple[Run, bool]] = [(c, True) for c in root.children.values()]
        while stack:
            run, ok = stack.pop()
            for j in range(len(run.keys)):
                ok = ok and all(run.slot[g][j] != NO_SLOT for g in full)
                for g in state:
                    assert ok or run.slot[g][j] == NO_SLOT, \
                        f"a checkpoint of group {g} below a missing attention block"
            stack += [(c, ok) for c in run.children.values()]
    for seq in st.sequences.values():
        for g in state:
            for tb in seq.tables[g]:
                assert len(tb) == 1, "a state group's table is one running slot"
                s = tb[0]
                if s != NO_SLOT:
                    assert st.gpu[g].run_at[s] is None, "a running slot is in the tree"
