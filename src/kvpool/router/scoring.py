"""Routing decisions: prefix overlap per worker and tier, load, and the choice (ARCHITECTURE §5).

For a request (token ids, optional cache salt) the :class:`Router`

1. hashes the request once per hashing group in use (scheme × tokens per block, see
   :data:`kvpool.router.index.GroupKey`): blocks cover the prompt minus its last token, a
   trailing partial block included for TensorRT-LLM's algorithms and the token chain, full
   blocks only for vLLM's (COMPATIBILITY §1.5);
2. walks the hashes over the index's presence masks, all workers of a group at once, and finds
   per worker the consecutive matched blocks and the tier of each (a block counts at its
   hottest tier present);
3. scores every healthy worker and picks one.

Modes
-----
``trtllm`` (COMPATIBILITY §4, TensorRT-LLM's ``KvCacheAwareRouter``)::

    score = matched_tokens / max(total_blocks * tpb, 1) - active_requests / max_batch_size

where ``matched_tokens`` = consecutive block hits (any tier) × tpb. The highest score wins;
ties go round-robin over the tied workers in registration order, with a counter that advances
on every decision. Predictions are off by default in this mode, so it reproduces the engine's
router.

``cost`` (the default), in tokens, lower is better (``score = -cost``)::

    credit = sum over tiers t of tier_weights[t] * matched tokens at tier t
             + shared_tier_weight * matched tokens only a shared remote tier holds
    cost   = max(prompt_tokens - credit, 0)               the prefill this request needs there
             + load_weight * queued_prefill_tokens        the prefill queued ahead of it

Both terms are prompt tokens to compute, so the weights are exchange rates:

* ``tier_weights`` (default 1, 0.95, 0.5): what a matched token saves when found on GPU, host
  or disk. A host (disk) block is copied to the GPU before use; for an 8B model a token's KV
  (128 KiB) crosses PCIe 5 in about 3 µs and an NVMe drive in about 25 µs, against about
  40 µs to compute it again.
* ``shared_tier_weight`` (default 0.3): what a matched token saves when only a shared remote
  tier the worker is configured with holds it (:meth:`Router.share_tier`,
  :mod:`kvpool.router.shared_tier`): a network fetch, prefetched while the request waits.
* ``queued_prefill_tokens``: the prefill (``prefill_tokens`` of :meth:`Router.route`, else the
  prompt minus its matched tokens) of the requests routed to the worker whose prompt is not
  computed yet. :meth:`Router.prefill_finished` (the first token came back) takes a request
  out; callers that never report it keep it in until :meth:`Router.request_finished`.
  Requests that are decoding do not count: a decode step costs a prefill a token of its
  budget per sequence, not a prompt.
* ``load_weight`` (default 0.02): a queue delays this request token for token, but sending the
  request elsewhere computes its cached prefix again — work that delays everything queued
  there — and takes the later turns of its conversation away from their prefix. On a
  saturated cluster every worker has a queue and moving requests between them only trades one
  wait for another, so the weight is small: it evens out queues that differ by many prompts,
  and among workers with the same prefix it sends the request to the shortest queue.
  ``docs/routing_sensitivity.png`` shows hit rate and TTFT against it.

Ties (equal cost: mostly prompts that share only a prefix every worker holds) go to the worker
with the fewest unfinished requests, then the fewest prompt tokens held by them, then the
worker after the last such tie's pick. The batch is what a worker runs out of first: each
unfinished request takes a batch slot and a token of every step's budget until it finishes,
and holds its KV until then; a worker with more of them evicts cached prefixes of its own
conversations to admit a new one (on 2 workers of the synthetic replay, with GPU pools too
small for the working set, this order reuses 81.3 % of prompt tokens against 80.5 % with held
tokens first, and TensorRT-LLM's 81.2 %; on the first 4,000 requests of the conversation
trace, 24.5 % against 24.8 %, both above TensorRT-LLM's 24.3 %). Workers with
``max_batch_size`` unfinished requests are *saturated*: they are chosen only when every healthy
worker is. With ``temperature > 0`` the choice is sampled from a softmax over the scores
normalized to [0, 1] (``p ∝ exp(norm_score / temperature)``) with a RNG seeded by ``seed``.

Predictions (``cost``): the blocks of a routed request count as GPU-resident on its worker until
its prefill is reported done and ``prediction_ttl_s`` after that (the worker's stored events are
on their way), so the next requests sharing the prefix — a burst on one system prompt, or the
next turn of a conversation sent while this one waits in the queue — land with it.

``approx``: ``cost``'s score over the router's own model of every worker's cache instead of
events: a per-worker prefix tree of the prompts routed there with the worker's block budget
per tier (``approx_capacity_blocks`` unless :meth:`Router.predict_cache` gave one) as LRU
segments, and blocks untouched for ``approx_ttl_s`` forgotten (:mod:`kvpool.router.approx`).
In the other modes, :meth:`Router.predict_cache` puts single workers (those without events) on
that model, so workers with and without events share one router.

Structure: :mod:`~kvpool.router.request_keys` hashes, :mod:`~kvpool.router.walk` walks,
:mod:`~kvpool.router.predictions` and :mod:`~kvpool.router.load` keep what was routed where,
:mod:`~kvpool.router.decision` holds the answer types; this module scores and chooses.

The router is not thread-safe; one thread (the service's event loop) owns it and its index.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from kvpool.errors import InvalidArgumentError, NoWorkerAvailableError
from kvpool.hashing.keys import tokens_to_u32
from kvpool.router.approx import DEFAULT_APPROX_TTL_S, ApproxCaches
from kvpool.router.decision import (
    LATENCY_BUCKETS_S,
    CandidateScore,
    RouteDecision,
    RouteMode,
    RouterStats,
)
from kvpool.router.index import TIERS, GroupKey, KvIndex
from kvpool.router.load import Active, Loads
from kvpool.router.predictions import Predictions
from kvpool.router.request_keys import ChainMemo, request_keys
from kvpool.router.shared_tier import (
    DEFAULT_SHARED_TIER_BLOCKS,
    DEFAULT_SHARED_TIER_WEIGHT,
    SharedTiers,
)
from kvpool.router.walk import walk
from kvpool.validation import check_int, check_number

__all__ = [
    "DEFAULT_APPROX_CAPACITY",
    "DEFAULT_LOAD_WEIGHT",
    "DEFAULT_PREDICTION_TTL_S",
    "DEFAULT_SHARED_TIER_WEIGHT",
    "DEFAULT_TIER_WEIGHTS",
    "LATENCY_BUCKETS_S",
    "CandidateScore",
    "RouteDecision",
    "RouteMode",
    "Router",
    "RouterStats",
    "request_keys",
]

DEFAULT_TIER_WEIGHTS: Final = (1.0, 0.95, 0.5)
"""``cost``/``approx``: what a matched token saves on GPU, host, disk (see the module docstring)."""

DEFAULT_LOAD_WEIGHT: Final = 0.02
"""``cost``/``approx``: weight of a worker's queued prefill tokens (see the module docstring)."""

DEFAULT_PREDICTION_TTL_S: Final = 2.0
"""How long a request's predicted blocks outlive its prefill (events in flight)."""

DEFAULT_APPROX_CAPACITY: Final = (65536,)
"""Blocks per tier assumed for a predicted worker given no capacity of its own."""

_NO_HITS: Final = (0, 0, 0, 0)
_Matches = dict[int, tuple[Sequence[int], int, int]]  # slot -> (hits per tier, tpb, blocks)


class Router:
    """Chooses a worker for each request from a :class:`KvIndex` and the load it routed.

    Contract: :meth:`route` validates everything before it changes anything; a decision
    registers the request as active on the chosen worker until :meth:`request_finished`
    (or ``request_timeout_s`` later, for callers that never report; 0 keeps them forever).
    """

    def __init__(
        self,
        index: KvIndex,
        *,
        mode: RouteMode | str = RouteMode.COST,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        temperature: float = 0.0,
        prediction_ttl_s: float | None = None,
        max_batch_size: int = 64,
        request_timeout_s: float = 600.0,
        approx_capacity_blocks: Sequence[int] = DEFAULT_APPROX_CAPACITY,
        approx_ttl_s: float = DEFAULT_APPROX_TTL_S,
        shared_tier_weight: float = DEFAULT_SHARED_TIER_WEIGHT,
        shared_tier_blocks: int = DEFAULT_SHARED_TIER_BLOCKS,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            self.mode = RouteMode(mode)
        except ValueError:
            raise InvalidArgumentError(
                f"mode must be 'cost', 'trtllm' or 'approx', got {mode!r}"
            ) from None
        weights = tuple(float(w) for w in tier_weights)
        if len(weights) != TIERS or not all(0.0 <= w <= 1.0 for w in weights):
            raise InvalidArgumentError(
                f"tier_weights must be {TIERS} numbers in [0, 1], got {tier_weights!r}"
            )
        if prediction_ttl_s is None:
            prediction_ttl_s = 0.0 if self.mode is RouteMode.TRTLLM else DEFAULT_PREDICTION_TTL_S
        for name, value in (("load_weight", load_weight), ("temperature", temperature),
                            ("prediction_ttl_s", prediction_ttl_s),
                            ("request_timeout_s", request_timeout_s)):
            _check_nonneg(name, value)
        _check_nonneg("shared_tier_weight", shared_tier_weight)
        if shared_tier_weight > 1:
            raise InvalidArgumentError(
                f"shared_tier_weight must be in [0, 1], got {shared_tier_weight!r}"
            )
        check_int("max_batch_size", max_batch_size, 1)
        self.index = index
        self.tier_weights = weights
        self.load_weight = float(load_weight)
        self.temperature = float(temperature)
        self.prediction_ttl_s = float(prediction_ttl_s)
        self.max_batch_size = max_batch_size
        self.request_timeout_s = float(request_timeout_s)
        self.shared_tier_weight = float(shared_tier_weight)
        self.approx = ApproxCaches(index.stride, approx_ttl_s)
        self.approx_capacity_blocks = tuple(approx_capacity_blocks)
        ApproxCaches(index.stride).add(0, self.approx_capacity_blocks)  # validates
        self.shared = SharedTiers(shared_tier_blocks)
        self.stats = RouterStats()
        self.clock = clock
        self._rng = random.Random(seed)
        self._rr = 0
        self._auto_id = 0
        self.loads = Loads()
        self.pred = Predictions(self.prediction_ttl_s)
        self._memo = ChainMemo()  # known v2 chain steps (request_keys)
        index.add_reset_listener(self._on_reset)

    def predict_cache(self, worker_id: str, capacity_blocks: Sequence[int] | None = None) -> None:
        """Route ``worker_id`` on the router's own prediction of its cache (it publishes no
        events; see :mod:`kvpool.router.approx`): ``capacity_blocks`` per tier (GPU, host,
        disk), by default ``approx_capacity_blocks``. Events the index still receives for it
        are ignored. In ``approx`` mode every worker is predicted without this call."""
        slot = self.index.slot_of(worker_id)
        self.approx.add(slot, self.approx_capacity_blocks if capacity_blocks is None
                        else capacity_blocks)

    def share_tier(self, worker_id: str, tier: str) -> None:
        """``worker_id`` reads the shared remote tier named ``tier``: blocks any worker of
        that tier announces on the remote cache level count for it too, at
        ``shared_tier_weight`` (:mod:`kvpool.router.shared_tier`; not in ``trtllm`` mode).
        The events reach :attr:`shared` through :class:`~kvpool.router.ingest.Ingest`."""
        self.shared.join(worker_id, self.index.slot_of(worker_id), tier)

    def predicted_cache_blocks(self) -> int:
        """(block, worker) pairs the approximate caches hold now."""
        self.approx.expire(self.clock())
        return len(self.approx)

    # ---------------------------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        prefill_tokens: int | None = None,
    ) -> RouteDecision:
        """Choose a worker for a request and register it as active there.

        Raises :class:`~kvpool.errors.InvalidTokenError` (bad token ids),
        :class:`~kvpool.errors.InvalidArgumentError` (empty prompt, bad salt, request id
        already active, negative ``prefill_tokens``) or :class:`NoWorkerAvailableError`, all
        before any state changes.
        """
        started = time.perf_counter()
        toks = tokens_to_u32(token_ids)
        self._check_request(toks, cache_salt, request_id, prefill_tokens)
        now = self.clock()
        self._expire(now)
        healthy = self.index.healthy_mask()
        if not healthy:
            raise NoWorkerAvailableError(
                f"no healthy worker among {len(self.index.worker_ids)} registered"
            )
        self._sync_approx()
        matches, group_keys = self._match(toks, cache_salt, healthy)
        cands = self._score(matches, len(toks))
        winner = cands[self._choose(cands)]
        request_id, prefill = self._commit(
            winner, group_keys, len(toks), now, request_id, prefill_tokens
        )
        decision = RouteDecision(
            worker_id=winner.worker_id,
            request_id=request_id,
            mode=self.mode.value,
            score=winner.score,
            matched_blocks=winner.matched_blocks,
            matched_tokens=winner.matched_tokens,
            total_blocks=winner.total_blocks,
            prefill_tokens=prefill,
            candidates=tuple(cands),
            shared_blocks=winner.shared_blocks,
        )
        st = self.stats
        st.routes_total += 1
        for t in range(TIERS):
            st.hit_blocks[t] += winner.matched_blocks[t]
        st.shared_hit_blocks += winner.shared_blocks
        st.prompt_tokens += len(toks)
        st.matched_tokens += winner.matched_tokens
        st.count_latency(time.perf_counter() - started)
        return decision

    def request_finished(self, request_id: str) -> bool:
        """The request left its worker: its load goes away. False if it was not active."""
        entry = self.loads.requests.pop(request_id, None)
        if entry is None:
            return False
        self._unload(entry, self.clock())
        self.stats.finished_total += 1
        return True

    def prefill_finished(self, request_id: str) -> bool:
        """The request's prompt is computed (its first token is out): its prefill leaves
        the worker's queued prefill, and the blocks predicted for it start their
        ``prediction_ttl_s`` (the worker's stored events are on their way). False if it was
        not active or was already reported."""
        entry = self.loads.requests.get(request_id)
        if entry is None or entry.prefilled:
            return False
        self._prefilled(entry, self.clock())
        return True

    def active_requests(self, worker_id: str) -> int:
        """Requests routed to ``worker_id`` and not finished."""
        self.index.slot_of(worker_id)  # UnknownWorkerError for strangers
        return self.loads.of(worker_id).active

    def pending_prefill_tokens(self, worker_id: str) -> int:
        self.index.slot_of(worker_id)
        return self.loads.of(worker_id).prefill_tokens

    def predicted_blocks(self) -> int:
        """Distinct (hash, worker) predictions alive now."""
        self._expire(self.clock())
        return len(self.pred)

    # --------------------------------------------------------------------------- route steps

    def _check_request(
        self, toks: array[int], cache_salt: str | None, request_id: str | None,
        prefill_tokens: int | None,
    ) -> None:
        if not toks:
            raise InvalidArgumentError("token_ids must not be empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id is not None and request_id in self.loads.requests:
            raise InvalidArgumentError(f"request_id {request_id!r} is already active")
        if prefill_tokens is not None:
            check_int("prefill_tokens", prefill_tokens, 0)

    def _sync_approx(self) -> None:
        """The approximate caches follow the index's stride and, in ``approx`` mode, its
        healthy workers."""
        approx = self.approx
        index = self.index
        if approx.stride != index.stride:
            approx.restride(index.stride)
        if self.mode is RouteMode.APPROX:
            for _, slot in index.healthy_workers():
                if not approx.predicts(slot):
                    approx.add(slot, self.approx_capacity_blocks)

    def _match(
        self, toks: array[int], cache_salt: str | None, healthy: int
    ) -> tuple[_Matches, dict[GroupKey, list[int]]]:
        """Hash once per hashing group and walk all its healthy workers at once."""
        index = self.index
        shared = self.shared.masks if self.mode is not RouteMode.TRTLLM else {}
        matches: _Matches = {}
        group_keys: dict[GroupKey, list[int]] = {}
        for gkey, gmask in index.groups().items():
            alive = gmask & healthy
            if not alive:
                continue
            scheme, tpb = gkey
            keys = request_keys(scheme, tpb, toks, cache_salt, self._memo)
            group_keys[gkey] = keys
            walked = walk(keys, alive, index.stride, index.masks, self.pred.masks,
                          self.approx, shared)
            n_keys = len(keys)
            while alive:
                low = alive & -alive
                slot = low.bit_length() - 1
                alive ^= low
                matches[slot] = (walked.get(slot) or _NO_HITS, tpb, n_keys)
        return matches, group_keys

    def _score(self, matches: _Matches, prompt: int) -> list[CandidateScore]:
        """Every healthy worker's score (the module docstring's formulas)."""
        body = prompt - 1
        trt = self.mode is RouteMode.TRTLLM
        weights = self.tier_weights
        cands: list[CandidateScore] = []
        for wid, slot in self.index.healthy_workers():
            hits, tpb, n_blocks = matches.get(slot, (_NO_HITS, 0, 0))
            load = self.loads.of(wid)
            total_hits = sum(hits)
            if trt:
                matched = total_hits * tpb
                score = matched / max(n_blocks * tpb, 1) - load.active / self.max_batch_size
            else:
                matched = min(total_hits * tpb, body)
                credit = 0.0
                if total_hits:
                    weighted = (weights[0] * hits[0] + weights[1] * hits[1]
                                + weights[2] * hits[2] + self.shared_tier_weight * hits[3])
                    credit = matched / total_hits * weighted
                score = -(max(prompt - credit, 0.0) + self.load_weight * load.queued_tokens)
            cands.append(CandidateScore(
                worker_id=wid,
                score=score,
                matched_blocks=(hits[0], hits[1], hits[2]),
                matched_tokens=matched,
                total_blocks=n_blocks,
                active_requests=load.active,
                pending_prefill_tokens=load.prefill_tokens,
                saturated=load.active >= self.max_batch_size,
                shared_blocks=hits[3],
            ))
        return cands

    def _commit(
        self, winner: CandidateScore, group_keys: dict[GroupKey, list[int]], prompt: int,
        now: float, request_id: str | None, prefill_tokens: int | None,
    ) -> tuple[str, int]:
        """Register the request on the winner and predict its blocks there; returns its id
        and prefill tokens."""
        if request_id is None:
            self._auto_id += 1
            request_id = f"auto-{self._auto_id}"
            while request_id in self.loads.requests:
                self._auto_id += 1
                request_id = f"auto-{self._auto_id}"
        prefill = prefill_tokens if prefill_tokens is not None else max(
            prompt - winner.matched_tokens, 0
        )
        entry = Active(winner.worker_id, prefill, prompt, now)
        self.loads.add(request_id, entry, self.request_timeout_s > 0)
        index = self.index
        gkey = index.group_of(winner.worker_id)
        if gkey is not None and gkey in group_keys:
            slot = index.slot_of(winner.worker_id)
            if self.approx.predicts(slot):
                self.approx.touch(slot, group_keys[gkey], now)
            elif self.prediction_ttl_s > 0:
                entry.predicted = (slot, group_keys[gkey])
                self.pred.add(slot, group_keys[gkey])
        return request_id, prefill

    def _choose(self, cands: list[CandidateScore]) -> int:
        if self.mode is RouteMode.TRTLLM:
            best = max(c.score for c in cands)
            tied = [i for i, c in enumerate(cands) if c.score == best]
            pick = tied[self._rr % len(tied)]
            self._rr += 1
            return pick
        eligible = [i for i, c in enumerate(cands) if not c.saturated] or list(range(len(cands)))
        if self.temperature > 0 and len(eligible) > 1:
            return self._sample(cands, eligible)
        best = max(cands[i].score for i in eligible)
        tied = [i for i in eligible if cands[i].score == best]
        if len(tied) == 1:
            return tied[0]
        # ties: fewer unfinished requests, less KV held by them, then the worker after the
        # last such tie's pick (rotation)
        n = len(cands)
        rot = self._rr
        loads = self.loads

        def rank(i: int) -> tuple[int, int, int]:
            c = cands[i]
            return (c.active_requests, loads.of(c.worker_id).tokens, (i - rot) % n)

        ranks = {i: rank(i) for i in tied}
        pick = min(tied, key=ranks.__getitem__)
        if any(j != pick and ranks[j][:2] == ranks[pick][:2] for j in tied):
            self._rr = pick + 1
        return pick

    def _sample(self, cands: list[CandidateScore], eligible: list[int]) -> int:
        """A pick from a softmax over the eligible scores normalized to [0, 1]."""
        scores = [cands[i].score for i in eligible]
        hi, lo = max(scores), min(scores)
        span = hi - lo
        weights = [
            math.exp((s - hi) / (span * self.temperature)) if span > 0 else 1.0
            for s in scores
        ]
        r = self._rng.random() * sum(weights)
        for i, w in zip(eligible, weights, strict=True):
            r -= w
            if r < 0:
                return i
        return eligible[-1]

    # ------------------------------------------------------------------------- bookkeeping

    def _prefilled(self, entry: Active, now: float) -> None:
        """Prefill done: the queued prefill goes, the prediction's TTL starts."""
        self.loads.prefilled(entry)
        if entry.predicted is not None:
            slot, keys = entry.predicted
            entry.predicted = None
            self.pred.start(slot, keys, now)

    def _expire(self, now: float) -> None:
        self.pred.expire(now)
        if self.request_timeout_s > 0:
            for entry in self.loads.timed_out(now - self.request_timeout_s):
                self._unload(entry, now)
                self.stats.expired_total += 1
        if self.approx.slot_bits:
            self.approx.expire(now)

    def _unload(self, entry: Active, now: float) -> None:
        if not entry.prefilled:
            self._prefilled(entry, now)
        self.loads.finish(entry)

    def _on_reset(self, worker_id: str, slot: int, removed: bool) -> None:
        # The worker's cache is gone: so are the blocks we predicted there. A removed worker's
        # slot may be reused, and its requests will never be reported finished; its shared
        # tier's blocks stay (the store outlives the worker), its membership goes.
        self.pred.drop_slot(slot)
        for entry in self.loads.requests.values():
            if entry.predicted is not None and entry.predicted[0] == slot:
                self.pred.remove(slot, entry.predicted[1])
                entry.predicted = None
        if removed:
            self.approx.remove(slot)
            self.loads.drop_worker(worker_id)
            self.shared.leave(worker_id)
        else:
            self.approx.clear(slot)


def _check_nonneg(name: str, value: float) -> None:
    check_number(name, value, 0)


