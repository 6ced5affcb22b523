"""Recurrent-state layer groups (hybrid models): the kind, and its part of admission and eviction.

A state group (``CacheConfig.state_groups``) holds a fixed-size recurrent state per sequence
(Mamba conv + SSM state, gated delta net, short convolution) instead of per-token KV:

- a live sequence owns one **running slot** per beam: ``tables[g] == [[slot]]`` per beam,
  one GPU reference each, never in the tree;
- a **checkpoint** is a copy of a sequence's state after a whole number of blocks, cached in
  the prefix tree under that prefix's last block, as the block's slot in group g (``NO_SLOT``
  where that boundary has none). Like any cached slot it is queued in the group's eviction
  policy, offloaded to host and disk, onboarded, and described by events.

Admission (:mod:`kvpool.core.plan`) cuts a request's reusable prefix to the longest one whose
attention blocks are reusable **and** that has a checkpoint at its end in every state group
(:func:`checkpoint_cut`; no partial-block reuse: a state exists only at block boundaries).
Phase 1 claims that checkpoint like a matched block (:func:`plan_needs` fills the request's
claims, :func:`kvpool.core.execute.claim` takes them), so another request's eviction in the
same step cannot take it; phase 2 copies it into the request's fresh running slots
straight from whatever tier it is on, and the claims are released when the whole batch is
allocated (:mod:`kvpool.core.checkpoints`).

A checkpoint whose prefix lost a full-attention block could never be matched again: evicting
a full-attention block drops the queued checkpoints at and below it
(the allocator's ``_drop_orphans``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.config import SequenceRequest
from kvpool.core.radix import NO_SLOT, Run, Segment, SlotId


class StateGroup:
    """A recurrent-state layer group: a running slot per beam, checkpoints in the tree."""

    __slots__ = ("tpb",)
    cross = False
    windowed = True  # an evicted checkpoint takes nothing below it along
    state = True
    first_kept = 0

    def __init__(self, tpb: int) -> None:
        self.tpb = tpb

    def required(self, i: int, length: int) -> bool:
        return False

    def stale_limit(self, length: int) -> int:
        return 0

    def claimed(self, d: int, length: int) -> Sequence[int]:
        """The checkpoint at the end of the ``d`` matched blocks."""
        return [d - 1] if d else []

    def reusable(self, slots: Sequence[int], length: int) -> bool:
        """A state can resume only at a block boundary that has a checkpoint."""
        if length % self.tpb:
            return False
        n = length // self.tpb
        return n == 0 or slots[n - 1] != NO_SLOT


class _Claims(Protocol):
    def claim(self, g: int, slots: list[SlotId]) -> None: ...


class _Layout(Protocol):
    @property
    def one_tier(self) -> bool: ...


class _View(Protocol):
    """What :func:`plan_needs` reads of :class:`kvpool.core.views.PlanView`."""

    @property
    def layout(self) -> _Layout: ...

    def refs(self, g: int) -> Sequence[int]: ...


class _Plan(Protocol):
    """What :func:`plan_needs` reads and fills of :class:`kvpool.core.plan.RequestPlan`."""

    request: SequenceRequest
    num_matched: int
    matched: list[Segment]
    claimed: dict[int, Sequence[int]]
    claim_slots: dict[int, list[SlotId]]
    claim_tiers: dict[int, Sequence[int]]
    queued: dict[int, list[SlotId]]


# ------------------------------------------------------------------ admission (plan)


def checkpoint_cut(state_groups: Sequence[int], matched: list[Segment], d: int) -> int:
    """The longest prefix of the first ``d`` matched blocks that ends on a block with a
    checkpoint in every state group (0 if none)."""
    if not d:
        return 0
    pos = 0
    best = 0
    for run, a, b in matched:
        if pos >= d:
            break
        stop = min(b, a + d - pos)
        for j in range(a, stop):
            if all(run.slot[g][j] != NO_SLOT for g in state_groups):
                best = pos + j - a + 1
        pos += stop - a
    return best


def last_block(matched: list[Segment]) -> tuple[Run, int]:
    """The last block of a matched path (which is not empty)."""
    run, _, b = matched[-1]
    return run, b - 1


def plan_needs(view: _View, p: _Plan, g: int, claims: _Claims) -> int:
    """GPU slots request ``p`` takes in state group g (one running slot per beam); records its
    claim of the matched checkpoint in ``p`` (and the queued GPU slot in ``claims``)."""
    beams = p.request.beam_width
    d = p.num_matched
    if not d:
        p.claimed[g] = ()
        p.claim_slots[g] = []
        p.claim_tiers[g] = ()
        p.queued[g] = []
        return beams
    run, j = last_block(p.matched)
    t, s = run.tier[g][j], run.slot[g][j]
    p.claimed[g] = [d - 1]
    p.claim_slots[g] = [s]
    p.claim_tiers[g] = () if view.layout.one_tier else [t]
    queued = [s] if t == 0 and not view.refs(g)[s] else []
    p.queued[g] = queued
    claims.claim(g, queued)
    return beams
