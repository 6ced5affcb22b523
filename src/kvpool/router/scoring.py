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
    cost   = max(prompt_tokens - credit, 0)               the prefill this request needs there
             + load_weight * queued_prefill_tokens        the prefill queued ahead of it

Both terms are prompt tokens to compute, so the weights are exchange rates:

* ``tier_weights`` (default 1, 0.95, 0.5): what a matched token saves when found on GPU, host
  or disk. A host (disk) block is copied to the GPU before use; for an 8B model a token's KV
  (128 KiB) crosses PCIe 5 in about 3 µs and an NVMe drive in about 25 µs, against about
  40 µs to compute it again.
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

Ties (equal cost) go to the worker whose unfinished requests hold the fewest prompt tokens
(the KV its decode steps read), then to fewer unfinished requests, then to the worker after
the last such tie's pick, so cold prompts spread over an idle cluster. Workers with
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

The router is not thread-safe; one thread (the service's event loop) owns it and its index.
"""

from __future__ import annotations

import math
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import repeat
from typing import Final, cast

import msgspec
import numpy as np

from kvpool.errors import InvalidArgumentError, NoWorkerAvailableError
from kvpool.hashing import (
    BlockHasher,
    HashAlgo,
    cache_salt_id,
    request_block_hashes,
    tokens_to_u32,
)
from kvpool.router.approx import DEFAULT_APPROX_TTL_S, ApproxCaches
from kvpool.router.index import (
    TIERS,
    GroupKey,
    KvIndex,
    token_chain_keys,
    token_chain_root,
)

__all__ = [
    "LATENCY_BUCKETS_S",
    "CandidateScore",
    "RouteDecision",
    "RouteMode",
    "Router",
    "RouterStats",
    "request_keys",
]

LATENCY_BUCKETS_S: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)
"""Upper bounds of the decision-latency histogram (seconds); a last bucket catches the rest."""

DEFAULT_TIER_WEIGHTS: Final = (1.0, 0.95, 0.5)
"""``cost``/``approx``: what a matched token saves on GPU, host, disk (see the module docstring)."""

DEFAULT_LOAD_WEIGHT: Final = 0.02
"""``cost``/``approx``: weight of a worker's queued prefill tokens (see the module docstring)."""

DEFAULT_PREDICTION_TTL_S: Final = 2.0
"""How long a request's predicted blocks outlive its prefill (events in flight)."""

DEFAULT_APPROX_CAPACITY: Final = (65536,)
"""Blocks per tier assumed for a predicted worker given no capacity of its own."""

_LITTLE: Final = sys.byteorder == "little"
_U64: Final = (1 << 64) - 1
_WALK_NP_MIN_BLOCKS: Final = 128
"""Prompts of this many blocks or more are walked with numpy: below it the Python walk, which
stops at the first block no worker holds, measured faster (64 blocks: 2x on GPU copies, 1.3x
with host and disk copies); from 256 blocks with tiered copies numpy wins."""

_SCHEME_ALGO: Final = {
    "v1": HashAlgo.V1_BLOCK_KEY,
    "v2": HashAlgo.V2_SHA256,
    "vllm": HashAlgo.VLLM_SHA256_CBOR,
}


class RouteMode(StrEnum):
    COST = "cost"
    TRTLLM = "trtllm"
    APPROX = "approx"


class CandidateScore(msgspec.Struct, frozen=True):
    """How one worker scored for one request."""

    worker_id: str
    score: float
    matched_blocks: tuple[int, ...]
    """Consecutive matched blocks per tier (GPU, host, disk); each at its hottest tier."""
    matched_tokens: int
    total_blocks: int
    active_requests: int
    pending_prefill_tokens: int
    saturated: bool


class RouteDecision(msgspec.Struct, frozen=True):
    """The router's answer: where to send the request, and why (every candidate's score)."""

    worker_id: str
    request_id: str
    mode: str
    score: float
    matched_blocks: tuple[int, ...]
    matched_tokens: int
    total_blocks: int
    prefill_tokens: int
    candidates: tuple[CandidateScore, ...]


@dataclass(slots=True)
class RouterStats:
    """Counters for ``/metrics``. ``latency_buckets[i]`` counts decisions that took at most
    ``LATENCY_BUCKETS_S[i]`` (not cumulative); the last entry counts the slower ones."""

    routes_total: int = 0
    hit_blocks: list[int] = field(default_factory=lambda: [0] * TIERS)
    prompt_tokens: int = 0
    matched_tokens: int = 0
    finished_total: int = 0
    expired_total: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0


@dataclass(slots=True)
class _Active:
    worker_id: str
    prefill_tokens: int
    tokens: int
    started: float
    prefilled: bool = False
    predicted: tuple[int, list[int]] | None = None  # (slot, keys) predicted until prefilled


@dataclass(slots=True)
class _Load:
    active: int = 0
    prefill_tokens: int = 0
    queued_tokens: int = 0  # prefill of the requests not reported prefilled
    tokens: int = 0


def request_keys(
    scheme: str, tokens_per_block: int, tokens: array[int], cache_salt: str | None
) -> list[int]:
    """The normalized block keys of a request (``tokens`` already validated u32) for one
    hashing group: what :func:`kvpool.router.index.normalize_hash` makes of the hashes the
    group's workers publish for the same blocks."""
    if scheme == "v2":  # the whole chain in one call, no hasher object
        return cast(list[int], request_block_hashes(
            tokens, tokens_per_block, HashAlgo.V2_SHA256_64, cache_salt=cache_salt
        ))
    body = tokens[: max(len(tokens) - 1, 0)]
    if scheme == "tokens":
        salt = cache_salt_id(cache_salt) if cache_salt is not None else None
        return token_chain_keys(body, tokens_per_block, token_chain_root(None, salt))
    algo = _SCHEME_ALGO[scheme]
    hasher = BlockHasher(algo, tokens_per_block, cache_salt=cache_salt)
    keys = hasher.extend(body)
    if scheme == "v1":
        tail = hasher.partial_key()
        out: list[int] = [k for k in keys if isinstance(k, int)]
        if isinstance(tail, int):
            out.append(tail)
        return out
    return [int.from_bytes(k[-8:], "big") for k in keys if isinstance(k, bytes)]


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
        _check_nonneg("load_weight", load_weight)
        _check_nonneg("temperature", temperature)
        if prediction_ttl_s is None:
            prediction_ttl_s = 0.0 if self.mode is RouteMode.TRTLLM else DEFAULT_PREDICTION_TTL_S
        _check_nonneg("prediction_ttl_s", prediction_ttl_s)
        _check_nonneg("request_timeout_s", request_timeout_s)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or (
            max_batch_size < 1
        ):
            raise InvalidArgumentError(
                f"max_batch_size must be an int >= 1, got {max_batch_size!r}"
            )
        self.index = index
        self.tier_weights = weights
        self.load_weight = float(load_weight)
        self.temperature = float(temperature)
        self.prediction_ttl_s = float(prediction_ttl_s)
        self.max_batch_size = max_batch_size
        self.request_timeout_s = float(request_timeout_s)
        self.approx = ApproxCaches(index.stride, approx_ttl_s)
        self.approx_capacity_blocks = tuple(approx_capacity_blocks)
        ApproxCaches(index.stride).add(0, self.approx_capacity_blocks)  # validates
        self.stats = RouterStats()
        self._clock = clock
        self._rng = random.Random(seed)
        self._rr = 0
        self._auto_id = 0
        self._active: dict[str, _Active] = {}
        # (started, request id, entry) in routing order, for request_timeout_s: popping the
        # oldest of _active itself would scan the dict's deleted slots at its front each time
        self._timeouts: deque[tuple[float, str, _Active]] = deque()
        self._load: dict[str, _Load] = {}
        # Predicted blocks: hash -> mask of slots (tier-0 bit positions), with references per
        # slot and hash (int keys: no tuple per block) and an expiry queue (a constant TTL
        # keeps it sorted).
        self._pred: dict[int, int] = {}
        self._pred_refs: dict[int, dict[int, int]] = {}  # slot -> {hash: references}
        self._pred_queue: deque[tuple[float, int, list[int]]] = deque()
        index.add_reset_listener(self._on_reset)

    def predict_cache(self, worker_id: str, capacity_blocks: Sequence[int] | None = None) -> None:
        """Route ``worker_id`` on the router's own prediction of its cache (it publishes no
        events; see :mod:`kvpool.router.approx`): ``capacity_blocks`` per tier (GPU, host,
        disk), by default ``approx_capacity_blocks``. Events the index still receives for it
        are ignored. In ``approx`` mode every worker is predicted without this call."""
        slot = self.index.slot_of(worker_id)
        self.approx.add(slot, self.approx_capacity_blocks if capacity_blocks is None
                        else capacity_blocks)

    def predicted_cache_blocks(self) -> int:
        """(block, worker) pairs the approximate caches hold now."""
        self.approx.expire(self._clock())
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
        if not toks:
            raise InvalidArgumentError("token_ids must not be empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id is not None and request_id in self._active:
            raise InvalidArgumentError(f"request_id {request_id!r} is already active")
        if prefill_tokens is not None and (
            isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int)
            or prefill_tokens < 0
        ):
            raise InvalidArgumentError(
                f"prefill_tokens must be an int >= 0, got {prefill_tokens!r}"
            )
        now = self._clock()
        self._expire(now)
        index = self.index
        healthy = index.healthy_mask()
        if not healthy:
            raise NoWorkerAvailableError(
                f"no healthy worker among {len(index.worker_ids)} registered"
            )
        approx = self.approx
        if approx.stride != index.stride:
            approx.restride(index.stride)
        if self.mode is RouteMode.APPROX:
            for _, slot in index.healthy_workers():
                if not approx.predicts(slot):
                    approx.add(slot, self.approx_capacity_blocks)

        # Hash once per group and walk all its healthy workers at once.
        per_slot: dict[int, tuple[list[int], int, int]] = {}  # slot -> (tiers, tpb, n_blocks)
        group_keys: dict[GroupKey, list[int]] = {}
        for gkey, gmask in index.groups().items():
            alive = gmask & healthy
            if not alive:
                continue
            scheme, tpb = gkey
            keys = request_keys(scheme, tpb, toks, cache_salt)
            group_keys[gkey] = keys
            walked = self._walk(keys, alive)
            n_keys = len(keys)
            while alive:
                low = alive & -alive
                slot = low.bit_length() - 1
                alive ^= low
                per_slot[slot] = (walked.get(slot) or [0] * TIERS, tpb, n_keys)

        prompt = len(toks)
        body = prompt - 1
        trt = self.mode is RouteMode.TRTLLM
        cands: list[CandidateScore] = []
        for wid, slot in index.healthy_workers():
            hits, tpb, n_blocks = per_slot.get(slot, ([0] * TIERS, 0, 0))
            load = self._load.get(wid) or _Load()
            total_hits = sum(hits)
            saturated = load.active >= self.max_batch_size
            if trt:
                matched = total_hits * tpb
                score = matched / max(n_blocks * tpb, 1) - load.active / self.max_batch_size
            else:
                matched = min(total_hits * tpb, body)
                credit = 0.0
                if total_hits:
                    scale = matched / total_hits
                    weighted = sum(w * h for w, h in zip(self.tier_weights, hits, strict=True))
                    credit = scale * weighted
                cost = max(prompt - credit, 0.0) + self.load_weight * load.queued_tokens
                score = -cost
            cands.append(CandidateScore(
                worker_id=wid,
                score=score,
                matched_blocks=tuple(hits),
                matched_tokens=matched,
                total_blocks=n_blocks,
                active_requests=load.active,
                pending_prefill_tokens=load.prefill_tokens,
                saturated=saturated,
            ))

        chosen = self._choose(cands)
        winner = cands[chosen]

        # Commit: register the request, predict its blocks, count.
        if request_id is None:
            self._auto_id += 1
            request_id = f"auto-{self._auto_id}"
            while request_id in self._active:
                self._auto_id += 1
                request_id = f"auto-{self._auto_id}"
        prefill = prefill_tokens if prefill_tokens is not None else max(
            prompt - winner.matched_tokens, 0
        )
        entry = _Active(winner.worker_id, prefill, prompt, now)
        self._active[request_id] = entry
        if self.request_timeout_s > 0:
            self._timeouts.append((now, request_id, entry))
        load = self._load.setdefault(winner.worker_id, _Load())
        load.active += 1
        load.prefill_tokens += prefill
        load.queued_tokens += prefill
        load.tokens += prompt
        gkey_w = index.group_of(winner.worker_id)
        if gkey_w is not None and gkey_w in group_keys:
            slot_w = index.slot_of(winner.worker_id)
            if approx.predicts(slot_w):
                approx.touch(slot_w, group_keys[gkey_w], now)
            elif self.prediction_ttl_s > 0:
                entry.predicted = (slot_w, group_keys[gkey_w])
                self._predict(slot_w, group_keys[gkey_w])

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
        )
        st = self.stats
        st.routes_total += 1
        for t in range(TIERS):
            st.hit_blocks[t] += winner.matched_blocks[t]
        st.prompt_tokens += prompt
        st.matched_tokens += winner.matched_tokens
        elapsed = time.perf_counter() - started
        st.latency_sum_s += elapsed
        b = 0
        while b < len(LATENCY_BUCKETS_S) and elapsed > LATENCY_BUCKETS_S[b]:
            b += 1
        st.latency_buckets[b] += 1
        return decision

    def request_finished(self, request_id: str) -> bool:
        """The request left its worker: its load goes away. False if it was not active."""
        entry = self._active.pop(request_id, None)
        if entry is None:
            return False
        self._unload(entry, self._clock())
        self.stats.finished_total += 1
        return True

    def prefill_finished(self, request_id: str) -> bool:
        """The request's prompt is computed (its first token is out): its prefill leaves
        the worker's queued prefill, and the blocks predicted for it start their
        ``prediction_ttl_s`` (the worker's stored events are on their way). False if it was
        not active or was already reported."""
        entry = self._active.get(request_id)
        if entry is None or entry.prefilled:
            return False
        self._prefilled(entry, self._clock())
        return True

    def active_requests(self, worker_id: str) -> int:
        """Requests routed to ``worker_id`` and not finished."""
        self.index.slot_of(worker_id)  # UnknownWorkerError for strangers
        load = self._load.get(worker_id)
        return load.active if load is not None else 0

    def pending_prefill_tokens(self, worker_id: str) -> int:
        self.index.slot_of(worker_id)
        load = self._load.get(worker_id)
        return load.prefill_tokens if load is not None else 0

    def predicted_blocks(self) -> int:
        """Distinct (hash, worker) predictions alive now."""
        self._expire(self._clock())
        return sum(map(len, self._pred_refs.values()))

    # ---------------------------------------------------------------------------------------

    def _walk(self, keys: list[int], alive: int) -> dict[int, list[int]]:
        """Consecutive matched blocks per slot of ``alive`` and per hottest tier (slots that
        match nothing may be left out)."""
        if self.index.stride == 64 and len(keys) >= _WALK_NP_MIN_BLOCKS and _LITTLE:
            return self._walk_np(keys, alive)
        return self._walk_py(keys, alive)

    def _walk_np(self, keys: list[int], alive: int) -> dict[int, list[int]]:
        """:meth:`_walk_py` vectorized for up to 64 slots: one u64 lane per tier and block."""
        ms = list(map(self.index.masks.get, keys, repeat(0)))
        pred = self._pred
        if pred:
            ms = [m | p for m, p in zip(ms, map(pred.get, keys, repeat(0)), strict=True)]
        approx = self.approx
        if approx.slot_bits:
            keep = ~approx.slot_bits
            ms = [(m & keep) | a
                  for m, a in zip(ms, map(approx.masks.get, keys, repeat(0)), strict=True)]
        n = len(ms)
        tiered = max(ms) > _U64
        if tiered:
            # 3 x 64 bits per block -> 3 lanes (GPU, host, disk), in one pass through bytes
            raw = b"".join([m.to_bytes(24, "little") for m in ms])
            lanes = np.frombuffer(raw, dtype="<u8").reshape(n, TIERS)
            a0, a1, a2 = lanes[:, 0], lanes[:, 1], lanes[:, 2]
            held = a0 | a1 | a2
        else:  # GPU copies only
            held = a0 = np.array(ms, dtype=np.uint64)
        # live[i]: the slots that hold every block up to i
        live = np.bitwise_and.accumulate(held & np.uint64(alive))
        stop = np.flatnonzero(live == 0)
        if stop.size:
            n = int(stop[0])
            if n == 0:
                return {}
            live = live[:n]
        # Bits only ever turn off: a slot's depth is where it turns off.
        depth: dict[int, int] = {}
        dropped = live[:-1] & ~live[1:]
        for i in np.flatnonzero(dropped).tolist():
            _set_depth(depth, int(dropped[i]), i + 1)
        _set_depth(depth, int(live[-1]), n)
        if not tiered:
            return {slot: [d, 0, 0] for slot, d in depth.items()}
        a0, a1, a2 = a0[:n], a1[:n], a2[:n]
        h1 = _lane_counts(a1 & ~a0 & live)
        h2 = _lane_counts(a2 & ~(a0 | a1) & live)
        out: dict[int, list[int]] = {}
        for slot, d in depth.items():
            c1, c2 = int(h1[slot]), int(h2[slot])
            out[slot] = [d - c1 - c2, c1, c2]
        return out

    def _walk_py(self, keys: list[int], alive: int) -> dict[int, list[int]]:
        masks_get = self.index.masks.get
        pred = self._pred
        pred_get = pred.get
        approx = self.approx
        approx_bits = approx.slot_bits
        keep = ~approx_bits
        approx_get = approx.masks.get
        stride = self.index.stride
        full = (1 << stride) - 1
        s2 = 2 * stride
        depth: dict[int, int] = {}
        rows1: list[int] = []
        rows2: list[int] = []
        n = 0
        for h in keys:
            m = masks_get(h, 0)
            if pred:
                m |= pred_get(h, 0)  # predictions sit in the GPU tier's bits
            if approx_bits:  # predicted workers: our model, not their (absent) events
                m = (m & keep) | approx_get(h, 0)
            if m <= full:  # GPU copies only: the common case
                hit = m & alive
                if hit != alive:
                    _set_depth(depth, alive & ~hit, n)
                    alive = hit
                    if not hit:
                        break
                n += 1
                continue
            t0 = m & full
            t1 = (m >> stride) & full
            t2 = m >> s2
            hit = (t0 | t1 | t2) & alive
            if hit != alive:
                _set_depth(depth, alive & ~hit, n)
                alive = hit
                if not hit:
                    break
            c1 = t1 & hit & ~t0
            if c1:
                rows1.append(c1)
            c2 = t2 & hit & ~(t0 | t1)
            if c2:
                rows2.append(c2)
            n += 1
        _set_depth(depth, alive, n)
        on1 = _bit_counts(rows1, stride)
        on2 = _bit_counts(rows2, stride)
        out: dict[int, list[int]] = {}
        for slot, d in depth.items():
            h1 = on1.get(slot, 0)
            h2 = on2.get(slot, 0)
            out[slot] = [d - h1 - h2, h1, h2]
        return out

    def _choose(self, cands: list[CandidateScore]) -> int:
        if self.mode is RouteMode.TRTLLM:
            best = max(c.score for c in cands)
            tied = [i for i, c in enumerate(cands) if c.score == best]
            pick = tied[self._rr % len(tied)]
            self._rr += 1
            return pick
        eligible = [i for i, c in enumerate(cands) if not c.saturated] or list(range(len(cands)))
        if self.temperature > 0 and len(eligible) > 1:
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
        # ties: less KV held by unfinished requests, fewer of them, then the worker after the
        # last such tie's pick (rotation)
        best = max(cands[i].score for i in eligible)
        tied = [i for i in eligible if cands[i].score == best]
        if len(tied) == 1:
            return tied[0]
        n = len(cands)
        rot = self._rr

        def rank(i: int) -> tuple[int, int, int]:
            return (self._held(cands[i].worker_id), cands[i].active_requests, (i - rot) % n)

        ranks = {i: rank(i) for i in tied}
        pick = min(tied, key=ranks.__getitem__)
        if any(j != pick and ranks[j][:2] == ranks[pick][:2] for j in tied):
            self._rr = pick + 1
        return pick

    def _held(self, worker_id: str) -> int:
        load = self._load.get(worker_id)
        return load.tokens if load is not None else 0

    def _predict(self, slot: int, keys: list[int]) -> None:
        bit = 1 << slot
        pred = self._pred
        refs = self._pred_refs.get(slot)
        if refs is None:
            refs = self._pred_refs[slot] = {}
        for h in keys:
            c = refs.get(h, 0)
            refs[h] = c + 1
            if c == 0:
                pred[h] = pred.get(h, 0) | bit

    def _prefilled(self, entry: _Active, now: float) -> None:
        """Prefill done: the queued prefill goes, the prediction's TTL starts."""
        entry.prefilled = True
        load = self._load.get(entry.worker_id)
        if load is not None:
            load.queued_tokens -= entry.prefill_tokens
        if entry.predicted is not None:
            slot, keys = entry.predicted
            entry.predicted = None
            self._pred_queue.append((now + self.prediction_ttl_s, slot, keys))

    def _unpredict(self, slot: int, keys: list[int]) -> None:
        clear = ~(1 << slot)
        pred = self._pred
        refs = self._pred_refs[slot]
        for h in keys:
            c = refs[h]
            if c > 1:
                refs[h] = c - 1
                continue
            del refs[h]
            m = pred[h] & clear
            if m:
                pred[h] = m
            else:
                del pred[h]
        if not refs:
            del self._pred_refs[slot]

    def _expire(self, now: float) -> None:
        q = self._pred_queue
        while q and q[0][0] <= now:
            _, slot, keys = q.popleft()
            self._unpredict(slot, keys)
        if self.request_timeout_s > 0:
            deadline = now - self.request_timeout_s
            timeouts = self._timeouts
            active = self._active
            while timeouts and timeouts[0][0] <= deadline:
                _, rid, entry = timeouts.popleft()
                if active.get(rid) is entry:  # not finished (nor routed again) since
                    del active[rid]
                    self._unload(entry, now)
                    self.stats.expired_total += 1
            if len(timeouts) > 2 * len(active) + 1024:  # mostly finished ones: keep the rest
                self._timeouts = deque([(e.started, rid, e) for rid, e in active.items()])
        if self.approx.slot_bits:
            self.approx.expire(now)

    def _unload(self, entry: _Active, now: float) -> None:
        if not entry.prefilled:
            self._prefilled(entry, now)
        load = self._load.get(entry.worker_id)
        if load is None:
            return
        load.active -= 1
        load.prefill_tokens -= entry.prefill_tokens
        load.tokens -= entry.tokens
        if load.active <= 0:
            del self._load[entry.worker_id]

    def _on_reset(self, worker_id: str, slot: int, removed: bool) -> None:
        # The worker's cache is gone: so are the blocks we predicted there. A removed worker's
        # slot may be reused, and its requests will never be reported finished.
        kept: deque[tuple[float, int, list[int]]] = deque()
        for item in self._pred_queue:
            if item[1] == slot:
                self._unpredict(slot, item[2])
            else:
                kept.append(item)
        self._pred_queue = kept
        for entry in self._active.values():
            if entry.predicted is not None and entry.predicted[0] == slot:
                self._unpredict(slot, entry.predicted[1])
                entry.predicted = None
        if removed:
            self.approx.remove(slot)
        else:
            self.approx.clear(slot)
        if removed:
            for rid in [r for r, a in self._active.items() if a.worker_id == worker_id]:
                del self._active[rid]
            self._load.pop(worker_id, None)


def _set_depth(depth: dict[int, int], mask: int, n: int) -> None:
    while mask:
        low = mask & -mask
        depth[low.bit_length() - 1] = n
        mask ^= low


def _lane_counts(lanes: np.ndarray) -> np.ndarray:
    """Per bit (slot) of a u64 array, how many elements have it set."""
    bits = np.unpackbits(lanes.view(np.uint8).reshape(len(lanes), 8), axis=1, bitorder="little")
    counts: np.ndarray = bits.sum(axis=0)
    return counts


def _bit_counts(rows: list[int], stride: int) -> dict[int, int]:
    """Per slot, how many of ``rows`` have its bit set."""
    if not rows:
        return {}
    if len(rows) <= 8:
        out: dict[int, int] = {}
        for m in rows:
            while m:
                low = m & -m
                s = low.bit_length() - 1
                out[s] = out.get(s, 0) + 1
                m ^= low
        return out
    nbytes = stride // 8
    if stride == 64 and _LITTLE:
        raw = np.array(rows, dtype=np.uint64).view(np.uint8).reshape(len(rows), nbytes)
    else:
        buf = b"".join(m.to_bytes(nbytes, "little") for m in rows)
        raw = np.frombuffer(buf, dtype=np.uint8).reshape(len(rows), nbytes)
    bits = np.unpackbits(raw, axis=1, bitorder="little")
    counts = bits.sum(axis=0)
    return {int(s): int(counts[s]) for s in np.flatnonzero(counts)}


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or (
        math.isinf(value)
    ):
        raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
