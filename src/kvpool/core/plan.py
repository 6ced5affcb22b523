"""Two-phase batch admission (seeds 001 and 002): plan every request, claim, then allocate.

``plan`` is pure: it walks the tree for every request of a batch, decides what each one
reuses (full matches, one partial match), how the batch shares partial sources
(:class:`PartialClaimTracker`) and how many GPU slots each request and the batch need per
layer group. ``KVCacheManager.add_sequence_batch`` executes exactly that plan: phase 1 claims
every matched block of every request (nothing can evict them afterwards), phase 2 onboards,
copies and allocates. Since the plan is computed from the same state the execution starts
from, ``plan_batch`` equals what ``add_sequence_batch`` realises (ARCHITECTURE §7.5).

Token layout of one request of n prompt tokens (tpb = tokens per block):

```
| full matches (d blocks) | partial (k tokens) |  fresh blocks ...            |last|
0                        d*tpb            d*tpb+k = L (reused)        n-1   n
keys cover tokens[:n-1]: the last prompt token is computed in the step that samples
```
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import cast

from kvpool.config import SequenceRequest
from kvpool.core.groups import CrossAttention
from kvpool.core.radix import NO_SLOT, Run, Segment, SlotId, common_prefix, first_token, match_full
from kvpool.core.state_groups import checkpoint_cut, plan_needs
from kvpool.core.views import PlanView
from kvpool.errors import DuplicateSequenceError, InvalidArgumentError
from kvpool.hashing.keys import BlockKey

Block = tuple[Run, int]
"""Block i of a run."""

_GPU_ONLY: tuple[int, ...] = ()
"""A request's claim tiers in a one-tier manager: every claim is on the GPU (no list)."""


class PartialMode(Enum):
    """How a request reuses its partially matched block."""

    COPY = "copy"  # copy the matched tokens into a fresh slot
    TAKEOVER = "takeover"  # take an unreferenced GPU leaf over in place


class RequestPlan:
    """What one request of a batch reuses and needs.

    Public: ``seq_id``, ``reused_tokens``, ``new_blocks`` (layer group -> GPU slots the
    request takes: fresh + copies + onboards) and the queries below. The rest is what the
    execution (:mod:`kvpool.core.execute`) needs; the tree objects (``_matched``, ``_partial``) stay
    private.
    """

    __slots__ = (
        "_blocks", "_matched", "_partial", "claim_slots", "claim_tiers", "claimed",
        "last_shared", "new_blocks", "num_blocks", "num_matched", "partial_loc",
        "partial_mode", "partial_tokens", "queued", "request", "reused_tokens", "root_key",
        "seq_id",
    )

    def __init__(self, request: SequenceRequest, root_key: BlockKey, matched: list[Segment],
                 num_matched: int, partial: Block | None, partial_tokens: int,
                 claim_slots: dict[int, list[SlotId]], tpb: int, groups: range) -> None:
        n = len(request.tokens)
        self.request = request
        self.seq_id: int | str = request.seq_id
        self.root_key = root_key
        self._matched = matched  # full matches, block order (tree objects: internal)
        self.num_matched = num_matched  # blocks in ``_matched``
        self._partial = partial  # the partial source (a tree block: internal)
        self.partial_tokens = partial_tokens
        self.reused_tokens = num_matched * tpb + partial_tokens
        self.num_blocks = -(-n // tpb)  # context blocks
        self.last_shared = request.beam_width == 1 or n % tpb == 0  # shared by all beams
        self.new_blocks: dict[int, int] = {}  # plan fills every group, in group order
        # layer group -> indices of matched blocks it claims, their slots and tiers
        self.claimed: dict[int, Sequence[int]] = {}
        self.claim_slots = claim_slots
        self.claim_tiers: dict[int, Sequence[int]] = {}  # () when every claim is on the GPU
        self.partial_mode: PartialMode | None = None
        self.partial_loc: dict[int, tuple[int, int]] = {}  # (tier, slot) per group
        # group -> claimed GPU slots that were queued (unreferenced) when planned, for the
        # batch's first request whose claims the execution starts with (later ones recount)
        self.queued: dict[int, list[SlotId]] = {}
        self._blocks: list[Block] | None = None

    def blocks(self) -> list[Block]:
        """The matched blocks one by one (built on first use: only slow paths need them)."""
        if self._blocks is None:
            self._blocks = flat_blocks(self._matched)
        return self._blocks

    def tier_tokens(self, g: int, tiers: int = 3) -> list[int]:
        """Reused tokens per tier their blocks are on now, in layer group g."""
        d = self.num_matched
        tpb = (self.reused_tokens - self.partial_tokens) // d if d else 0  # tokens per block
        out = [0] * tiers
        for run, a, b in self._matched:
            for t in run.tier[g][a:b]:
                out[t] += tpb
        if self._partial is not None:
            prun, i = self._partial
            out[prun.tier[g][i]] += self.partial_tokens
        return out

    def partial_source(self, g: int) -> tuple[int, int] | None:
        """(tier, slot) of the partially matched block in layer group g, or None."""
        if self._partial is None:
            return None
        run, i = self._partial
        return run.tier[g][i], run.slot[g][i]

    def matched_keys(self) -> list[BlockKey]:
        keys: list[BlockKey] = []
        for run, a, b in self._matched:
            keys += run.keys[a:b]
        return keys


@dataclass(slots=True)
class BatchPlan:
    """The plan of a batch: per request, and totals per layer group (GPU tier)."""

    requests: list[RequestPlan]
    new_blocks: dict[int, int]
    available: dict[int, int]  # free + evictable GPU slots not claimed by this batch
    partials: list[RequestPlan] = field(default_factory=list)  # the requests with a partial

    @property
    def fits(self) -> bool:
        available = self.available
        for g, n in self.new_blocks.items():  # noqa: SIM110 (a loop: no generator per call)
            if n > available[g]:
                return False
        return True

    @property
    def deficit(self) -> dict[tuple[int, int], int]:
        """(tier, layer group) -> missing slots; empty when the batch fits."""
        return {
            (0, g): self.new_blocks[g] - self.available[g]
            for g in self.new_blocks
            if self.new_blocks[g] > self.available[g]
        }

    @property
    def reused_tokens(self) -> dict[int | str, int]:
        return {r.seq_id: r.reused_tokens for r in self.requests}


def flat_blocks(segments: list[Segment]) -> list[Block]:
    return [(run, i) for run, a, b in segments for i in range(a, b)]


def flat(segments: list[Segment], g: int) -> list[SlotId]:
    """Slots of layer group g along ``segments``, block by block."""
    out: list[SlotId] = []
    for run, a, b in segments:
        out += run.slot[g][a:b]
    return out


def flat_tiers(segments: list[Segment], g: int) -> list[int]:
    """Tiers of layer group g along ``segments``, block by block."""
    out: list[int] = []
    for run, a, b in segments:
        out += run.tier[g][a:b]
    return out


def cut(segments: list[Segment], d: int) -> list[Segment]:
    """The first ``d`` blocks of a path."""
    out: list[Segment] = []
    for run, a, b in segments:
        if d <= 0:
            break
        if b - a > d:
            b = a + d
        out.append((run, a, b))
        d -= b - a
    return out


class PartialClaimTracker:
    """Who may take a partially matched source over, and who must copy from it.

    Within one batch: a source that is an unreferenced GPU leaf, fully matched by no request
    of the batch, is taken over in place by the first request that partially matches it (if
    that request's partial block is shared by all its beams); every other request copies from
    it. A source that is not taken over is claimed while the copies are made and released by
    the last copier, unless some request holds it (a full match cancels the release).
    """

    __slots__ = ("_full", "_taker")

    def __init__(self) -> None:
        self._full: set[tuple[int, int]] = set()  # (id(run), i) fully matched in the batch
        self._taker: dict[tuple[int, int], int | str] = {}  # (id(run), i) -> seq_id taking it

    def note_full_match(self, run: Run, i: int) -> None:
        self._full.add((id(run), i))

    def decide(self, view: PlanView, block: Block, seq_id: int | str,
               shared_block: bool) -> PartialMode:
        run, i = block
        key = (id(run), i)
        if (
            key in self._taker
            or key in self._full
            or not shared_block
            or i != len(run.keys) - 1
            or not run.is_leaf
            or not view.unreferenced_on_gpu(run, i)
        ):
            return PartialMode.COPY
        self._taker[key] = seq_id
        return PartialMode.TAKEOVER


def _partial_candidate(view: PlanView, segments: list[Segment], root: Run,
                       target: bytes) -> tuple[Block | None, int]:
    """The block after the matched path sharing the longest token prefix with ``target``
    that holds a slot in every self-attention group; (block, shared tokens) or (None, 0)."""
    step = 4 * view.tpb
    if segments:
        run, _, b = segments[-1]
        if b < len(run.keys):  # inside a run: its next block is the only candidate
            cands: list[Block] = [(run, b)]
        else:
            cands = [(c, 0) for c in run.children_starting_with(first_token(target))]
    else:
        cands = [(c, 0) for c in root.children_starting_with(first_token(target))]
    best: Block | None = None
    best_k = 0
    groups = view.self_groups
    for run, i in cands:
        if any(run.slot[g][i] == NO_SLOT for g in groups):
            continue
        k = common_prefix(run.tkey[i * step:(i + 1) * step], target)
        if k > best_k:
            best, best_k = (run, i), k
    return best, best_k


def walk(view: PlanView, request: SequenceRequest) -> tuple[
    BlockKey, list[Segment], Block | None, int, dict[int, list[SlotId]]
]:
    """Find a request's reuse: the longest prefix valid in every self-attention layer group.

    Blocks cover the prompt minus its last token. The tree is walked by token bytes, a run at
    a time, so a matched block is never hashed again. Returns (root key, matched segments,
    partial block, partial tokens, the matched blocks' slots per self-attention group).
    """
    cfg = view.config
    root_key = view.root_key(request.lora_id, request.cache_salt)
    groups = view.self_groups
    root = view.roots.get((request.lora_id, request.cache_salt)) if cfg.enable_block_reuse \
        else None
    if root is None:
        return root_key, [], None, 0, {g: [] for g in groups}
    tpb = view.tpb
    tokens = request.tokens
    body = len(tokens) - 1
    raw = tokens.tobytes() if isinstance(tokens, array) else array("I", tokens).tobytes()
    step = view.step
    matched = match_full(root, raw, body // tpb, step)
    if len(matched) == 1:
        run, a, b = matched[0]
        d = b - a
        slots = {}  # loops, not comprehensions: each of those is a call in Python 3.11
        for g in groups:
            slots[g] = run.slot[g][a:b]
    else:
        d = sum(b - a for _, a, b in matched)
        slots = {}
        for g in groups:
            slots[g] = flat(matched, g)
    kinds = view.kinds
    if cfg.enable_partial_reuse and d * tpb < body and not cfg.state_groups:
        target = raw[d * step:min((d + 1) * tpb, body) * 4]
        cand, k = _partial_candidate(view, matched, root, target)
        if cand is not None:
            length = d * tpb + k
            run, i = cand
            if all(kinds[g].reusable([*slots[g], run.slot[g][i]], length) for g in groups):
                return root_key, matched, cand, k, slots
    full = d
    for g in groups:  # full attention needs every block: nothing past its first hole
        if not kinds[g].windowed and NO_SLOT in slots[g]:
            d = min(d, slots[g].index(NO_SLOT))
    if not view.full_attention_only:
        while d > 0:
            if all(kinds[g].reusable(slots[g] if d == full else slots[g][:d], d * tpb)
                   for g in groups):
                break
            d -= 1
    if cfg.state_groups:  # hybrid: the prefix must end on a checkpoint (state_groups)
        d = checkpoint_cut(cfg.state_groups, matched, d)
    if d == full:
        return root_key, matched, None, 0, slots
    return root_key, cut(matched, d), None, 0, {g: sl[:d] for g, sl in slots.items()}


def _check_requests(view: PlanView, requests: list[SequenceRequest]) -> None:
    """Refuse a batch with a bad request (nothing is planned)."""
    cfg = view.config
    seen: set[int | str] | None = set() if len(requests) > 1 else None  # a batch of one: none
    for r in requests:
        if not isinstance(r, SequenceRequest):
            raise InvalidArgumentError(f"expected SequenceRequest, got {r!r}")
        if r.seq_id in view.sequences or (seen is not None and r.seq_id in seen):
            where = "already in use" if r.seq_id in view.sequences else "twice in this batch"
            raise DuplicateSequenceError(f"sequence id {r.seq_id!r} is {where}")
        if seen is not None:
            seen.add(r.seq_id)
        if r.beam_width > cfg.max_beam_width:
            raise InvalidArgumentError(
                f"request {r.seq_id!r}: beam_width {r.beam_width} > max_beam_width "
                f"{cfg.max_beam_width}"
            )
        if cfg.cross_attention_groups and r.encoder_tokens is None:
            raise InvalidArgumentError(
                f"request {r.seq_id!r} has no encoder_tokens but layer groups "
                f"{list(cfg.cross_attention_groups)} are cross attention"
            )


def _plan_request(view: PlanView, r: SequenceRequest) -> RequestPlan:
    """One request's reuse (its walk) and the blocks each group claims of it."""
    root_key, matched, pblock, pk, matched_slots = walk(view, r)
    d = matched[0][2] - matched[0][1] if len(matched) == 1 else sum(
        b - a for _, a, b in matched)
    p = RequestPlan(r, root_key, matched, d, pblock, pk, matched_slots, view.tpb, view.groups)
    kinds = view.kinds
    claimed = p.claimed
    for g in view.self_groups:
        claimed[g] = kinds[g].claimed(d, p.reused_tokens)
    return p


class _BatchClaims:
    """What the requests of a batch planned so far claim of the GPU pools: queued slots they
    take out of the queues (a set per group, or only a count for a batch of one request
    without a partial source, whose claims are distinct) and colder blocks already
    onboarded (made on first use)."""

    __slots__ = ("count", "evictable", "onboarded")

    def __init__(self, groups: int, single: bool) -> None:
        self.count = [0] * groups
        # one set per group (a list display: no comprehension call for the common one group)
        self.evictable: list[set[int]] | None = None if single else [set()] if groups == 1 \
            else [set() for _ in range(groups)]
        self.onboarded: set[tuple[int, int, int]] | None = None

    def claim(self, g: int, slots: list[SlotId]) -> None:
        """The batch takes queued GPU slots ``slots`` of group g (distinct within a request)."""
        if self.evictable is None:
            self.count[g] += len(slots)
        else:
            self.evictable[g].update(slots)

    def claimed(self, g: int) -> int:
        """Queued GPU slots of group g the batch claims."""
        return self.count[g] + (len(self.evictable[g]) if self.evictable is not None else 0)

    def onboard(self, block: tuple[int, int, int]) -> bool:
        """Note a colder block the batch onboards; False if an earlier request did."""
        if self.onboarded is None:
            self.onboarded = set()
        elif block in self.onboarded:
            return False
        self.onboarded.add(block)
        return True


def _group_needs(view: PlanView, p: RequestPlan, g: int, claims: _BatchClaims) -> int:
    """GPU slots request ``p`` takes in self-attention group g (fresh + copies + onboards);
    records its claims in ``claims`` and its claimed slots and tiers in ``p``."""
    d = p.num_matched
    partial = p._partial
    fresh = p.num_blocks - d
    copies = 0
    if partial is not None:
        fresh -= 1
        beams = p.request.beam_width
        copies_needed = beams if (not p.last_shared and d == p.num_blocks - 1) else 1
        copies = copies_needed - (1 if p.partial_mode is PartialMode.TAKEOVER else 0)
        prun, pi = partial
        if view.evictable(prun, pi, g):
            claims.claim(g, [prun.slot[g][pi]])  # a batch with a partial keeps sets
    if fresh > 0 and not p.last_shared:
        fresh += p.request.beam_width - 1
    ref = view.refs(g)
    idxs = p.claimed[g]
    slots = p.claim_slots[g]  # every matched block's, from the walk
    if view.one_tier:  # every claim on the GPU: no tier list
        if len(idxs) != d:
            slots = p.claim_slots[g] = [slots[i] for i in idxs]
        p.claim_tiers[g] = _GPU_ONLY
        queued = p.queued[g] = [s for s in slots if not ref[s]]
        if claims.evictable is None:  # (claims.claim inline: the common case)
            claims.count[g] += len(queued)
        else:
            claims.evictable[g].update(queued)
        return fresh + copies
    tiers = flat_tiers(p._matched, g)
    if len(idxs) != d:
        tiers = [tiers[i] for i in idxs]
        slots = p.claim_slots[g] = [slots[i] for i in idxs]
    p.claim_tiers[g] = tiers
    if not any(tiers):
        queued = p.queued[g] = [s for s in slots if not ref[s]]
        claims.claim(g, queued)
        return fresh + copies
    onboard = 0
    blocks = p.blocks()
    for i, t, s in zip(idxs, tiers, slots, strict=True):
        if t:
            run, j = blocks[i]
            onboard += claims.onboard((id(run), j, g))
        elif not ref[s]:
            claims.claim(g, [s])
    return fresh + copies + onboard


def plan(view: PlanView, requests: list[SequenceRequest]) -> BatchPlan:
    """Plan a batch without changing anything (see the module docstring)."""
    _check_requests(view, requests)
    out: list[RequestPlan] = []
    partials: list[RequestPlan] = []
    for r in requests:
        p = _plan_request(view, r)
        out.append(p)
        if p._partial is not None:
            partials.append(p)
    tracker = PartialClaimTracker() if partials else None
    if tracker is not None:
        # partial sources are decided once every full match of the batch is known
        for p in out:
            blocks = p.blocks()
            for idxs in p.claimed.values():
                for i in idxs:
                    tracker.note_full_match(*blocks[i])
    groups = view.groups
    kinds = view.kinds
    claims = _BatchClaims(len(groups), len(out) == 1 and not partials)
    for p in out:
        if p._partial is not None:
            assert tracker is not None
            shared = p.last_shared or p.num_matched < p.num_blocks - 1
            p.partial_mode = tracker.decide(view, p._partial, p.seq_id, shared)
        new_blocks = p.new_blocks
        for g in groups:
            kind = kinds[g]
            if kind.cross:
                new_blocks[g] = cast(CrossAttention, kind).blocks(
                    len(p.request.encoder_tokens or ()))
            elif kind.state:
                new_blocks[g] = plan_needs(view, p, g, claims)
            else:
                new_blocks[g] = _group_needs(view, p, g, claims)
    if len(out) == 1:
        totals = out[0].new_blocks.copy()
    else:
        totals = {g: sum(p.new_blocks[g] for p in out) for g in groups}
    available = {}
    for g in groups:
        available[g] = view.available(g) - claims.claimed(g)
    return BatchPlan(out, totals, available, partials)
