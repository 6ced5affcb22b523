"""Two-phase batch admission: plan every request, claim every match, then allocate, so that no
request of a batch evicts what another reuses.

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
d = num_matched, k = partial_tokens: a RequestPlan's fields
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
from kvpool.core.layout import TOKEN_BYTES
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
    """What one request of a batch reuses and needs: the contract between planning (here)
    and execution (:mod:`kvpool.core.execute`), every field public and typed.

    For callers of ``plan_batch``: ``seq_id``, ``reused_tokens``, ``new_blocks`` (layer group
    -> GPU slots the request takes: fresh + copies + onboards) and the queries below. The
    execution also reads the tree blocks (``matched``, ``partial``) and the claims; it fills
    ``partial_loc`` in its phase 1. A plan is spent once executed.
    """

    request: SequenceRequest
    seq_id: int | str
    root_key: BlockKey
    matched: list[Segment]
    """The fully matched blocks, as tree segments in block order."""
    num_matched: int
    """Blocks in ``matched``."""
    partial: Block | None
    """The partially matched source block (a tree block), or None."""
    partial_tokens: int
    """Tokens reused from ``partial``."""
    reused_tokens: int
    num_blocks: int
    """The prompt's context blocks."""
    last_shared: bool
    """Is the last context block shared by all beams?"""
    new_blocks: dict[int, int]
    claimed: dict[int, Sequence[int]]
    """Layer group -> indices (into the matched blocks) of the blocks it claims."""
    claim_slots: dict[int, list[SlotId]]
    """Layer group -> the slots of its claimed blocks."""
    claim_tiers: dict[int, Sequence[int]]
    """Layer group -> the tiers of its claimed blocks (() when all are on the GPU)."""
    partial_mode: PartialMode | None
    partial_loc: dict[int, tuple[int, int]]
    """Layer group -> (tier, slot) of the partial source when the execution claimed it."""
    queued: dict[int, list[SlotId]]
    """Layer group -> claimed GPU slots that were queued (unreferenced) when planned, for the
    batch's first request, whose claims the execution starts with (later ones recount)."""

    __slots__ = (
        "_blocks", "claim_slots", "claim_tiers", "claimed",
        "last_shared", "matched", "new_blocks", "num_blocks", "num_matched", "partial",
        "partial_loc", "partial_mode", "partial_tokens", "queued", "request", "reused_tokens",
        "root_key", "seq_id",
    )

    def __init__(self, request: SequenceRequest, root_key: BlockKey, matched: list[Segment],
                 num_matched: int, partial: Block | None, partial_tokens: int,
                 claim_slots: dict[int, list[SlotId]], tpb: int) -> None:
        n = len(request.tokens)
        self.request = request
        self.seq_id = request.seq_id
        self.root_key = root_key
        self.matched = matched
        self.num_matched = num_matched
        self.partial = partial
        self.partial_tokens = partial_tokens
        self.reused_tokens = num_matched * tpb + partial_tokens
        self.num_blocks = -(-n // tpb)  # context blocks
        self.last_shared = request.beam_width == 1 or n % tpb == 0  # shared by all beams
        self.new_blocks = {}  # plan fills every group, in group order
        self.claimed = {}
        self.claim_slots = claim_slots
        self.claim_tiers = {}
        self.partial_mode = None
        self.partial_loc = {}
        self.queued = {}
        self._blocks: list[Block] | None = None

    def blocks(self) -> list[Block]:
        """The matched blocks one by one (built on first use: only slow paths need them)."""
        if self._blocks is None:
            self._blocks = flat_blocks(self.matched)
        return self._blocks

    def tier_tokens(self, g: int, tiers: int = 3) -> list[int]:
        """Reused tokens per tier their blocks are on now, in layer group g."""
        num_matched = self.num_matched
        tpb = ((self.reused_tokens - self.partial_tokens) // num_matched  # tokens per block
               if num_matched else 0)
        out = [0] * tiers
        for run, a, b in self.matched:
            for t in run.tier[g][a:b]:
                out[t] += tpb
        if self.partial is not None:
            prun, i = self.partial
            out[prun.tier[g][i]] += self.partial_tokens
        return out

    def partial_source(self, g: int) -> tuple[int, int] | None:
        """(tier, slot) of the partially matched block in layer group g, or None."""
        if self.partial is None:
            return None
        run, i = self.partial
        return run.tier[g][i], run.slot[g][i]

    def matched_keys(self) -> list[BlockKey]:
        keys: list[BlockKey] = []
        for run, a, b in self.matched:
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
        for g, n in self.new_blocks.items():  # noqa: SIM110 (CPython costs, docs/architecture.md §3.10)
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


def cut(segments: list[Segment], keep: int) -> list[Segment]:
    """The first ``keep`` blocks of a path."""
    out: list[Segment] = []
    for run, a, b in segments:
        if keep <= 0:
            break
        if b - a > keep:
            b = a + keep
        out.append((run, a, b))
        keep -= b - a
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
    step = view.layout.step
    if segments:
        run, _, b = segments[-1]
        if b < len(run.keys):  # inside a run: its next block is the only candidate
            candidates: list[Block] = [(run, b)]
        else:
            candidates = [(c, 0) for c in run.children_starting_with(first_token(target))]
    else:
        candidates = [(c, 0) for c in root.children_starting_with(first_token(target))]
    best: Block | None = None
    best_shared = 0
    groups = view.layout.self_groups
    for run, i in candidates:
        if any(run.slot[g][i] == NO_SLOT for g in groups):
            continue
        shared = common_prefix(run.tkey[i * step:(i + 1) * step], target)
        if shared > best_shared:
            best, best_shared = (run, i), shared
    return best, best_shared


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
    groups = view.layout.self_groups
    root = view.roots.get((request.lora_id, request.cache_salt)) if cfg.enable_block_reuse \
        else None
    if root is None:
        return root_key, [], None, 0, {g: [] for g in groups}
    tpb = view.layout.tpb
    tokens = request.tokens
    body = len(tokens) - 1
    raw = tokens.tobytes() if isinstance(tokens, array) else array("I", tokens).tobytes()
    step = view.layout.step
    matched = match_full(root, raw, body // tpb, step)
    if len(matched) == 1:
        run, a, b = matched[0]
        num_matched = b - a
        slots = {}  # loops, not comprehensions (CPython costs, docs/architecture.md §3.10)
        for g in groups:
            slots[g] = run.slot[g][a:b]
    else:
        num_matched = sum(b - a for _, a, b in matched)
        slots = {}
        for g in groups:
            slots[g] = flat(matched, g)
    kinds = view.layout.kinds
    if cfg.enable_partial_reuse and num_matched * tpb < body and not cfg.state_groups:
        target = raw[num_matched * step:min((num_matched + 1) * tpb, body) * TOKEN_BYTES]
        candidate, partial_tokens = _partial_candidate(view, matched, root, target)
        if candidate is not None:
            length = num_matched * tpb + partial_tokens
            run, i = candidate
            if all(kinds[g].reusable([*slots[g], run.slot[g][i]], length) for g in groups):
                return root_key, matched, candidate, partial_tokens, slots
    full = num_matched
    for g in groups:  # full attention needs every block: nothing past its first hole
        if not kinds[g].windowed and NO_SLOT in slots[g]:
            num_matched = min(num_matched, slots[g].index(NO_SLOT))
    if not view.layout.full_attention_only:
        while num_matched > 0:
            if all(kinds[g].reusable(slots[g] if num_matched == full
                                     else slots[g][:num_matched], num_matched * tpb)
                   for g in groups):
                break
            num_matched -= 1
    if cfg.state_groups:  # hybrid: the prefix must end on a checkpoint (state_groups)
        num_matched = checkpoint_cut(cfg.state_groups, matched, num_matched)
    if num_matched == full:
        return root_key, matched, None, 0, slots
    return root_key, cut(matched, num_matched), None, 0, {
        g: sl[:num_matched] for g, sl in slots.items()}


def _check_requests(view: PlanView, requests: list[SequenceRequest]) -> None:
    """Refuse a batch with a bad request (nothing is planned)."""
    cfg = view.config
    seen: set[int | str] | None = set() if len(requests) > 1 else None  # a batch of one: none
    for request in requests:
        if not isinstance(request, SequenceRequest):
            raise InvalidArgumentError(f"expected SequenceRequest, got {request!r}")
        if request.seq_id in view.sequences or (seen is not None and request.seq_id in seen):
            where = "already in use" if request.seq_id in view.sequences else "twice in this batch"
            raise DuplicateSequenceError(f"sequence id {request.seq_id!r} is {where}")
        if seen is not None:
            seen.add(request.seq_id)
        if request.beam_width > cfg.max_beam_width:
            raise InvalidArgumentError(
                f"request {request.seq_id!r}: beam_width {request.beam_width} > max_beam_width "
                f"{cfg.max_beam_width}"
            )
        if cfg.cross_attention_groups and request.encoder_tokens is None:
            raise InvalidArgumentError(
                f"request {request.seq_id!r} has no encoder_tokens but layer groups "
                f"{list(cfg.cross_attention_groups)} are cross attention"
            )


def _plan_request(view: PlanView, request: SequenceRequest) -> RequestPlan:
    """One request's reuse (its walk) and the blocks each group claims of it."""
    root_key, matched, partial, partial_tokens, matched_slots = walk(view, request)
    num_matched = matched[0][2] - matched[0][1] if len(matched) == 1 else sum(
        b - a for _, a, b in matched)
    plan = RequestPlan(request, root_key, matched, num_matched, partial, partial_tokens,
                       matched_slots, view.layout.tpb)
    kinds = view.layout.kinds
    claimed = plan.claimed
    for g in view.layout.self_groups:
        claimed[g] = kinds[g].claimed(num_matched, plan.reused_tokens)
    return plan


class _BatchClaims:
    """What the requests of a batch planned so far claim of the GPU pools: queued slots they
    take out of the queues (a set per group, or only a count for a batch of one request
    without a partial source, whose claims are distinct) and colder blocks already
    onboarded (made on first use)."""

    __slots__ = ("count", "evictable", "onboarded")

    def __init__(self, groups: int, single: bool) -> None:
        self.count = [0] * groups
        # one set per group (a list display for the common one group: CPython costs,
        # docs/architecture.md §3.10)
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


def _group_needs(view: PlanView, plan: RequestPlan, g: int, claims: _BatchClaims) -> int:
    """GPU slots request ``plan`` takes in self-attention group g (fresh + copies + onboards);
    records its claims in ``claims`` and its claimed slots and tiers in ``plan``."""
    num_matched = plan.num_matched
    partial = plan.partial
    fresh = plan.num_blocks - num_matched
    copies = 0
    if partial is not None:
        fresh -= 1
        beams = plan.request.beam_width
        on_last = not plan.last_shared and num_matched == plan.num_blocks - 1
        copies_needed = beams if on_last else 1
        copies = copies_needed - (1 if plan.partial_mode is PartialMode.TAKEOVER else 0)
        partial_run, partial_index = partial
        if view.evictable(partial_run, partial_index, g):
            # (a batch with a partial keeps sets)
            claims.claim(g, [partial_run.slot[g][partial_index]])
    if fresh > 0 and not plan.last_shared:
        fresh += plan.request.beam_width - 1
    ref = view.refs(g)
    idxs = plan.claimed[g]
    slots = plan.claim_slots[g]  # every matched block's, from the walk
    if view.layout.one_tier:  # every claim on the GPU: no tier list
        if len(idxs) != num_matched:
            slots = plan.claim_slots[g] = [slots[i] for i in idxs]
        plan.claim_tiers[g] = _GPU_ONLY
        queued = plan.queued[g] = [s for s in slots if not ref[s]]
        if claims.evictable is None:  # claims.claim inline (docs/architecture.md §3.10)
            claims.count[g] += len(queued)
        else:
            claims.evictable[g].update(queued)
        return fresh + copies
    tiers = flat_tiers(plan.matched, g)
    if len(idxs) != num_matched:
        tiers = [tiers[i] for i in idxs]
        slots = plan.claim_slots[g] = [slots[i] for i in idxs]
    plan.claim_tiers[g] = tiers
    if not any(tiers):
        queued = plan.queued[g] = [s for s in slots if not ref[s]]
        claims.claim(g, queued)
        return fresh + copies
    onboard = 0
    blocks = plan.blocks()
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
    for request in requests:
        request_plan = _plan_request(view, request)
        out.append(request_plan)
        if request_plan.partial is not None:
            partials.append(request_plan)
    tracker = PartialClaimTracker() if partials else None
    if tracker is not None:
        # partial sources are decided once every full match of the batch is known
        for request_plan in out:
            blocks = request_plan.blocks()
            for idxs in request_plan.claimed.values():
                for i in idxs:
                    tracker.note_full_match(*blocks[i])
    groups = view.layout.groups
    kinds = view.layout.kinds
    claims = _BatchClaims(len(groups), len(out) == 1 and not partials)
    for request_plan in out:
        if request_plan.partial is not None:
            assert tracker is not None
            shared = (request_plan.last_shared
                      or request_plan.num_matched < request_plan.num_blocks - 1)
            request_plan.partial_mode = tracker.decide(
                view, request_plan.partial, request_plan.seq_id, shared)
        new_blocks = request_plan.new_blocks
        for g in groups:
            kind = kinds[g]
            if kind.cross:
                new_blocks[g] = cast(CrossAttention, kind).blocks(
                    len(request_plan.request.encoder_tokens or ()))
            elif kind.state:
                new_blocks[g] = plan_needs(view, request_plan, g, claims)
            else:
                new_blocks[g] = _group_needs(view, request_plan, g, claims)
    if len(out) == 1:
        totals = out[0].new_blocks.copy()
    else:
        totals = {g: sum(request_plan.new_blocks[g] for request_plan in out) for g in groups}
    available = {}
    for g in groups:
        available[g] = view.available(g) - claims.claimed(g)
    return BatchPlan(out, totals, available, partials)
