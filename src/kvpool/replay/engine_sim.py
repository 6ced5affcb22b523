"""One simulated engine of a replay: a real :class:`~kvpool.manager.KVCacheManager` behind a
continuous-batching scheduler and a roofline time model (ARCHITECTURE §6).

Nothing here sleeps or computes KV: the manager runs with metadata-only storage, the scheduler
decides what each step computes, and :class:`TimeModel` says how long the step would take on
the GPU. The cluster (:mod:`kvpool.replay.cluster`) drives the steps in simulated time.

A request's life on a worker (n prompt tokens, m output tokens, tpb tokens per block)::

    arrive ─► waiting ─► admitted (add_sequence_batch: reuse + blocks for the whole prompt)
              ▲   │          │ prefill chunks [reused, n) within the step's token budget;
              │   │          │ store_context_blocks after each chunk
              │   │          ▼ last chunk: token 1 is sampled (time to first token)
              │   │       decode: one token per step; each sampled token is appended
              │   │          │ (add_tokens) and its KV is computed by the next step
              │   │          ▼ token m sampled: remove_sequence (commits for reuse)
              └───┴── preempted (recompute): add_tokens could not get a block

Scheduler step (vLLM v1 order): every decoding sequence takes one token of the
``max_num_tokens`` budget, running prefills continue in admission order, then waiting requests
are admitted first come first served while the batch (``plan_batch`` of the candidates, so
exactly what ``add_sequence_batch`` will do), the token budget and ``max_batch_size`` allow.
The head of the queue blocks the rest (no overtaking), so requests of one worker are admitted
in arrival order.

Appending is lazy: between two *sync lengths* (a length whose token needs a new block, or
moves a sliding window past a block) growing a sequence changes nothing in the manager but its
token list, so the tokens are handed over in one ``add_tokens`` call when the next sync length
is reached (a second call appends the sync token itself, so window releases happen at exactly
the length they would one token at a time). Steps in which only decodes run and nothing can be
admitted are identical but for their context lengths; the worker runs them as one *macro step*
up to the next sync, finish or arrival, so the Python cost is per block, not per token.

Preemption (recompute): when the appended token needs a block the pool cannot give, the most
recently admitted sequence is removed (``remove_sequence(store_for_reuse=True)`` after a
decode, ``store_for_reuse=False`` mid-prefill, whose computed blocks were already stored) and
requeued at the head of the queue with the tokens it generated; if it is the sequence itself,
it goes. The oldest sequence is never a victim while another runs, and a request whose peak
need exceeds the pool is rejected at arrival, so the scheduler cannot deadlock.

The final sampled token is never appended (no block is taken for a token whose KV is never
computed); the manager then commits every appended token but the last
(``remove_sequence``'s rule), i.e. ``prompt + output[:m-2]`` for m >= 2 and the prompt for
m = 1.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import xxhash

from kvpool.admission import RequestPlan
from kvpool.config import CacheConfig, SequenceRequest
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.events.manager import EventManager
from kvpool.manager import KVCacheManager
from kvpool.replay.workloads import DEFAULT_VOCAB_SIZE, Request

__all__ = [
    "INSERT",
    "LOOKUP",
    "RequestRecord",
    "SchedulerConfig",
    "SimWorker",
    "TimeModel",
    "committed_tokens",
    "fits_ever",
    "gpu_capacity",
    "output_tokens",
    "peak_blocks",
    "reference_group",
]

LOOKUP: Final = 0
"""Access kind: the whole blocks a request reused at its first admission."""
INSERT: Final = 1
"""Access kind: blocks a sequence committed to the tree."""

_WAITING: Final = 0
_PREFILL: Final = 1
_DECODE: Final = 2
_DONE: Final = 3


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    return float(value)


def _check_count(name: str, value: object, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TimeModel:
    """How long one scheduler step takes on the GPU, in simulated seconds (a roofline sketch)::

        step = max(weight_read_s, tokens * token_compute_s)    linear layers: memory or compute
             + prefill_pairs * attention_pair_s                prefill attention
             + decode_context * kv_read_s                      decode attention reads the KV

    ``tokens`` are the tokens the step computes (prefill chunks + one per decode);
    ``prefill_pairs`` the (query, key) pairs of the prefill chunks: a chunk [a, b) of a
    sequence pairs each position p with its p + 1 predecessors, so reused tokens save their
    own linear and attention work while the computed tokens still attend to them;
    ``decode_context`` the tokens the decoding sequences attend to.

    The defaults are assumptions, not measurements: one H100 SXM (989 dense bf16 TFLOP/s,
    3.35 TB/s HBM) serving an 8B dense model (Llama-3-8B: 32 layers, d_model 4096, bf16 KV of
    128 KiB per token) at about 40 % of peak FLOP/s. They give ~25k prefill tokens/s on short
    prompts and ~10 ms decode steps for 32 sequences of 4k tokens; scale them for other
    hardware or models.
    """

    weight_read_s: float = 5.0e-3
    """Floor of every step: reading 16 GB of bf16 weights at 3.35 TB/s (4.8 ms) + launches."""
    token_compute_s: float = 4.0e-5
    """Linear layers per token: 2 x 8e9 FLOP at 400 TFLOP/s effective."""
    attention_pair_s: float = 1.3e-9
    """Prefill attention per (query, key) pair: 4 x 32 layers x 4096 FLOP at 400 TFLOP/s."""
    kv_read_s: float = 4.0e-8
    """Decode attention per context token: 128 KiB of K and V read at 3.35 TB/s (39 ns)."""

    def __post_init__(self) -> None:
        for name in ("weight_read_s", "token_compute_s", "attention_pair_s", "kv_read_s"):
            object.__setattr__(self, name, _check_number(name, getattr(self, name)))

    def step_s(self, tokens: int, prefill_pairs: int, decode_context: int) -> float:
        """Duration of one step (see the class docstring)."""
        return (
            max(self.weight_read_s, tokens * self.token_compute_s)
            + prefill_pairs * self.attention_pair_s
            + decode_context * self.kv_read_s
        )

    def decode_steps_s(self, steps: int, batch: int, context: int) -> float:
        """Duration of ``steps`` consecutive decode-only steps of ``batch`` sequences whose
        context is ``context`` tokens in all at the first step (it grows by ``batch`` a step)."""
        linear = max(self.weight_read_s, batch * self.token_compute_s)
        reads = steps * context + batch * steps * (steps - 1) // 2
        return steps * linear + reads * self.kv_read_s


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The continuous-batching scheduler of one worker.

    ``max_batch_size`` sequences run at once at most; a step computes at most
    ``max_num_tokens`` tokens (one per decoding sequence, the rest prefill). With
    ``chunked_prefill`` a prompt is computed in chunks that fill the budget; without it a
    prompt is computed in one step, and a prompt larger than the budget is admitted only as the
    step's sole prefill (that step then exceeds the budget, as an engine configured with
    ``max_num_tokens`` below its longest prompt would have to).
    """

    max_batch_size: int = 64
    max_num_tokens: int = 8192
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_count("max_batch_size", self.max_batch_size)
        _check_count("max_num_tokens", self.max_num_tokens)
        if self.max_num_tokens < self.max_batch_size:
            raise InvalidArgumentError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running sequence decodes one token a step"
            )
        if not isinstance(self.chunked_prefill, bool):
            raise InvalidArgumentError(
                f"chunked_prefill must be a bool, got {self.chunked_prefill!r}"
            )


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times are simulated seconds from the workload origin).

    Reuse fields describe the request's *first* admission (a preempted request reuses its own
    blocks when readmitted; that is recompute saving, not cache hits): ``reused_tokens`` =
    ``reused_full_tokens`` (whole blocks) + ``reused_partial_tokens`` (a partially matched
    block); ``tier_tokens[t]`` splits them by the tier the blocks were found on.
    ``remote_tokens``: tokens the shared remote tier gave it (``prefetch`` before its first
    admission; a cluster with ``remote_bytes``).
    ``computed_tokens`` counts every prefill token computed, recomputation included.
    Rejected requests (peak need larger than the pool) have no times.
    """

    index: int
    request_id: str
    worker: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    reused_tokens: int = 0
    reused_full_tokens: int = 0
    reused_partial_tokens: int = 0
    tier_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])
    remote_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0
    rejected: bool = False

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (queueing included), None if the request never got one."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def output_tokens(
    request: Request, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> array[int]:
    """The tokens a simulated engine generates for ``request``.

    ``request.output_token_ids`` when the workload provides them (the synthetic workload does,
    so the next turn of a conversation can reuse the answer), else ``output_length``
    pseudo-random ids in [0, vocab_size) that depend only on (``seed``, request id).
    """
    if request.output_token_ids is not None:
        return request.output_token_ids
    rid = xxhash.xxh3_64_intdigest(request.request_id.encode("utf-8"))
    rng = np.random.Generator(np.random.PCG64([seed, rid]))
    out = array("I")
    out.frombytes(
        rng.integers(0, vocab_size, size=request.output_length, dtype=np.uint32).tobytes()
    )
    return out


def committed_tokens(prompt_len: int, output_len: int) -> int:
    """How many leading tokens of ``prompt + output`` a finished request leaves committed for
    reuse (see the module docstring): the prompt when one token is generated, else every token
    but the last two (the unappended final token and the last appended one)."""
    return prompt_len if output_len <= 1 else prompt_len + output_len - 2


def reference_group(config: CacheConfig) -> int:
    """The layer group whose blocks reuse is counted in: the first full-attention
    self-attention group, else the first self-attention group."""
    selfg = [g for g in range(config.num_groups) if g not in config.cross_attention_groups]
    for g in selfg:
        if config.window_sizes[g] is None:
            return g
    return selfg[0]


def peak_blocks(cache: CacheConfig, req: Request) -> int:
    """The GPU blocks ``req`` needs at its peak in a self-attention group:
    ceil((n + m - 1) / tpb) (the longest prompt it may be readmitted with), plus one with
    partial reuse (a partially matched block is copied into a fresh slot while its source
    stays claimed)."""
    need = -(-(len(req.tokens) + req.output_length - 1) // cache.tokens_per_block)
    return need + (1 if cache.enable_partial_reuse else 0)


def gpu_capacity(cache: CacheConfig) -> int:
    """The smallest GPU pool of a self-attention group: the most one request can hold."""
    return min(
        cache.slots[0][g] for g in range(cache.num_groups)
        if g not in cache.cross_attention_groups
    )


def fits_ever(cache: CacheConfig, req: Request) -> bool:
    """Can ``req`` ever run on a worker of this cache alone (:func:`peak_blocks` within
    :func:`gpu_capacity`)? A request that cannot is rejected at arrival, so the scheduler
    cannot deadlock on it."""
    return peak_blocks(cache, req) <= gpu_capacity(cache)


class _Run:
    """One request on a worker: waiting, prefilling, decoding or done.

    Decoding sequences are advanced implicitly: with ``D`` the worker's decode-step counter,
    ``generated = gen_base + D - step_base`` and the length is ``n + generated``.
    """

    __slots__ = (
        "computed", "due", "epoch", "gen_base", "generated", "logged", "m", "mgr_len", "n",
        "order", "out", "prefetched", "rec", "req", "seq_req", "state", "step_base", "target",
    )

    def __init__(self, req: Request, rec: RequestRecord, out: array[int]) -> None:
        self.req = req
        self.rec = rec
        self.out = out
        self.n = len(req.tokens)
        self.m = req.output_length
        self.state = _WAITING
        self.generated = 0  # tokens sampled so far (over every admission)
        self.target = 0  # tokens this admission prefills (n + generated at admission)
        self.computed = 0  # tokens of this admission whose KV is computed
        self.mgr_len = 0  # tokens the manager holds
        self.gen_base = 0
        self.step_base = 0
        self.due = 0  # decode-step count at which this run needs attention
        self.epoch = 0  # bumped when the run leaves a state (stale heap entries)
        self.order = 0  # admission order
        self.logged = 0  # blocks of this admission known to be in the tree (access log)
        self.seq_req: SequenceRequest | None = None
        self.prefetched = False  # asked the shared remote tier (before its first admission)

    def sequence_request(self) -> SequenceRequest:
        if self.seq_req is None:
            tokens = self.req.tokens
            if self.generated:
                tokens = tokens + self.out[: self.generated]
            self.seq_req = SequenceRequest(
                self.req.request_id, tokens, cache_salt=self.req.cache_salt
            )
        return self.seq_req


class _Step:
    __slots__ = ("batch", "chunks", "context", "duration", "k", "start")

    def __init__(
        self, start: float, chunks: list[tuple[_Run, int]], batch: int, context: int, k: int,
        duration: float,
    ) -> None:
        self.start = start
        self.chunks = chunks
        self.batch = batch  # decoding sequences
        self.context = context  # their context tokens at the first step
        self.k = k  # steps this (macro) step runs
        self.duration = duration


class SimWorker:
    """One engine: a manager, its scheduler and its clock.

    The cluster calls :meth:`submit` when a request arrives, :meth:`start_step` when the
    worker may start a step (it returns the step's end time, or None when there is nothing to
    do), :meth:`interrupt` when a request arrives during a step, and :meth:`finish_step` at
    the step's end (it returns the records of the requests that finished). Events the manager
    emitted are flushed at every step end (``events``' ``flush_iteration_events``).

    ``coalesce=False`` turns lazy appends and macro steps off: every sampled token is appended
    by its own ``add_tokens`` call and every step is simulated on its own. The results are the
    same (up to float rounding of times); it exists to check exactly that.

    ``accesses``, when given, receives the cache accesses in the order they happen, as
    ``(request index, kind, first block, end block)`` over the blocks of the request's
    ``prompt + output`` chain: kind :data:`LOOKUP` when a request is first admitted (the whole
    blocks it reused), kind :data:`INSERT` when blocks are committed (``store_context_blocks``,
    ``remove_sequence``); a block a request computes is accessed when it is committed, the
    moment it can first be in a cache. Several workers may share one list.
    """

    def __init__(
        self,
        worker_id: str,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        time_model: TimeModel,
        *,
        events: EventManager | None = None,
        coalesce: bool = True,
        accesses: list[tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.coalesce = coalesce
        self.accesses = accesses
        self.cache = cache
        self.scheduler = scheduler
        self.time_model = time_model
        self.events = events
        self.manager = KVCacheManager(cache, events=events)
        self._remote = cache.remote_store is not None or cache.remote_url is not None
        self.tpb = cache.tokens_per_block
        self._ref_group = reference_group(cache)
        self._windows = tuple(
            w for g, w in enumerate(cache.window_sizes)
            if w is not None and g not in cache.cross_attention_groups
        )
        self._self_groups = [
            g for g in range(cache.num_groups) if g not in cache.cross_attention_groups
        ]
        # one self-attention group, no cross attention, GPU tier only: see _admit's shortcut
        self._simple = cache.num_groups == 1 and cache.num_tiers == 1
        self._waiting: deque[_Run] = deque()
        self._running: dict[int, _Run] = {}  # admission order -> run (newest last)
        self._prefilling: list[_Run] = []
        self._decoding = 0
        self._ctx_base = 0  # sum over decoding runs of n + gen_base - step_base
        self._heap: list[tuple[int, int, int, _Run]] = []  # (due, order, epoch, run)
        self._dsteps = 0
        self._orders = 0
        # The queue head did not fit; retried once something may make it fit: blocks freed
        # (finish, preemption, window release) or committed (a longer match needs fewer).
        self._blocked = False
        self._step: _Step | None = None
        self.steps = 0
        self.preemptions = 0
        self.busy_s = 0.0
        self.first_tokens: list[RequestRecord] = []
        """Records whose first token a step sampled; the cluster drains it (the router's
        :meth:`~kvpool.router.Router.prefill_finished`)."""

    # ------------------------------------------------------------------------ state queries

    @property
    def busy(self) -> bool:
        """Is a step in flight?"""
        return self._step is not None

    @property
    def active(self) -> int:
        """Requests on this worker that are not finished (waiting or running)."""
        return len(self._waiting) + len(self._running)

    # ------------------------------------------------------------------------------ driving

    def submit(self, req: Request, rec: RequestRecord, out: array[int]) -> bool:
        """Queue an arrived request; False (and ``rec.rejected``) if it can never fit."""
        if not fits_ever(self.cache, req):
            rec.rejected = True
            return False
        self._waiting.append(_Run(req, rec, out))
        return True

    def start_step(self, now: float) -> float | None:
        """Schedule a step starting at ``now``; returns its end, or None if idle."""
        if self._step is not None:
            raise InvalidArgumentError(f"worker {self.worker_id}: a step is already in flight")
        sched = self.scheduler
        budget = sched.max_num_tokens - self._decoding
        chunks: list[tuple[_Run, int]] = []
        for run in self._prefilling:
            if budget <= 0:
                break
            c = run.target - run.computed
            if sched.chunked_prefill and c > budget:
                c = budget
            chunks.append((run, c))
            budget -= c
        if (
            self._waiting
            and not self._blocked
            and budget > 0
            and len(self._running) < sched.max_batch_size
        ):
            if self._remote:
                self._prefetch()
            self._admit(now, budget, chunks)
        if self._remote:  # writes settle before any other worker's next call: deterministic
            self.manager.flush_remote()
        batch = self._decoding
        if not chunks and not batch:
            return None
        context = self._ctx_base + batch * self._dsteps
        tm = self.time_model
        if chunks:
            tokens = batch
            pairs = 0
            for run, c in chunks:
                tokens += c
                a = run.computed
                pairs += c * (2 * a + c + 1) // 2
            k = 1
            duration = tm.step_s(tokens, pairs, context)
        else:
            heap = self._heap
            while heap[0][2] != heap[0][3].epoch:
                heapq.heappop(heap)
            k = heap[0][0] - self._dsteps
            duration = tm.decode_steps_s(k, batch, context)
        self._step = _Step(now, chunks, batch, context, k, duration)
        return now + duration

    def interrupt(self, now: float) -> float | None:
        """A request arrived at ``now`` during a macro step: end it at the first step boundary
        at or after ``now``. Returns the new end time, or None if the step is unchanged."""
        step = self._step
        if step is None or step.k == 1:
            return None
        tm = self.time_model
        elapsed = now - step.start
        lo, hi = 1, step.k  # smallest k with duration(k) >= elapsed
        while lo < hi:
            mid = (lo + hi) // 2
            if tm.decode_steps_s(mid, step.batch, step.context) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        if lo >= step.k:
            return None
        step.k = lo
        step.duration = tm.decode_steps_s(lo, step.batch, step.context)
        return step.start + step.duration

    def finish_step(self, now: float) -> list[RequestRecord]:
        """Apply the step that ends at ``now``; returns the records of finished requests.

        Finished requests leave first (freeing blocks), then the sequences that sampled a
        token at a sync length append it, oldest first, so that preemption picks the newest.
        """
        step = self._step
        if step is None:
            raise InvalidArgumentError(f"worker {self.worker_id}: no step in flight")
        self._step = None
        self.steps += step.k
        self.busy_s += step.duration
        self._dsteps += step.k
        mgr = self.manager
        finished: list[RequestRecord] = []
        completed: list[_Run] = []
        if step.chunks:
            # committed blocks lengthen what the queue head matches: it may fit now
            self._blocked = False
        for run, c in step.chunks:
            run.computed += c
            run.rec.computed_tokens += c
            mgr.store_context_blocks(run.req.request_id, run.computed)
            self._log_insert(run, run.computed // self.tpb)
            if run.computed == run.target:
                run.generated += 1  # prefill samples the next token
                if run.rec.first_token_s is None:
                    run.rec.first_token_s = now
                    self.first_tokens.append(run.rec)
                completed.append(run)
        heap = self._heap
        due: list[_Run] = []
        while heap and heap[0][0] <= self._dsteps:
            _, _, epoch, run = heapq.heappop(heap)
            if epoch == run.epoch:
                run.generated = run.gen_base + self._dsteps - run.step_base
                due.append(run)
        grow: list[_Run] = []
        for run in completed:
            if run.generated >= run.m:
                self._finish(run, now, finished)
                continue
            self._prefilling.remove(run)
            run.state = _DECODE
            run.gen_base = run.generated
            run.step_base = self._dsteps
            self._decoding += 1
            self._ctx_base += run.n + run.gen_base - run.step_base
            grow.append(run)
        for run in due:
            if run.generated >= run.m:
                self._finish(run, now, finished)
            else:
                grow.append(run)
        grow.sort(key=lambda r: r.order)
        for run in grow:
            if run.state == _DECODE:  # not preempted by an older run's growth
                self._grow(run)
        if self._remote:
            mgr.flush_remote()
        if self.events is not None:
            self.events.flush_iteration_events()
        return finished

    # ----------------------------------------------------------------------------- internal

    def _prefetch(self) -> None:
        """Before admission, the shared tier gives the waiting requests that may be admitted
        now (first admissions only) their remote continuations."""
        room = self.scheduler.max_batch_size - len(self._running)
        runs = [r for r in itertools.islice(self._waiting, max(0, room))
                if not r.prefetched and r.rec.admitted_s is None]
        if not runs:
            return
        got = self.manager.prefetch([r.sequence_request() for r in runs])
        for run, n in zip(runs, got, strict=True):
            run.prefetched = True
            run.rec.remote_tokens += n

    def _admit(self, now: float, budget: int, chunks: list[tuple[_Run, int]]) -> None:
        """Admit waiting requests while the batch, the token budget and the batch size allow
        (the queue head blocks the rest). Appends their first chunks to ``chunks``.

        Each candidate is checked with ``plan_batch`` of the batch so far plus itself, which
        is exactly what ``add_sequence_batch`` then does. Shortcut: with one self-attention
        group and a GPU tier only, a candidate whose blocks, plus one, fit in what the pool
        has free or evictable beyond the batch's own worst case surely fits (a request never
        takes more than ceil(n / tpb) new slots plus claims on its matched blocks); then a
        tree walk (``count_reusable_tokens``) gives its reuse, and every hit is on the GPU.
        """
        sched = self.scheduler
        mgr = self.manager
        waiting = self._waiting
        runs: list[_Run] = []
        reqs: list[SequenceRequest] = []
        sizes: list[int] = []
        found: list[tuple[int, list[int]] | None] = []  # (reuse, tokens per tier) if planned
        tpb = self.tpb
        slots = sched.max_batch_size - len(self._running)
        room = mgr.gpu_available(self._self_groups[0]) if self._simple else -1
        worst = 0
        while waiting and budget > 0 and slots > 0:
            run = waiting[0]
            sreq = run.sequence_request()
            n = len(sreq.tokens)
            bound = -(-n // tpb) + 1
            tiers: tuple[int, list[int]] | None = None
            if worst + bound <= room:
                reused = mgr.count_reusable_tokens(sreq.tokens, cache_salt=sreq.cache_salt)
            else:
                trial = mgr.plan_batch([*reqs, sreq])
                if not trial.fits:
                    # alone on an idle worker every request fits (fits_ever): no deadlock
                    assert self._running or reqs, f"{sreq.seq_id} cannot be admitted on idle"
                    self._blocked = True
                    break
                plan = trial.requests[-1]
                reused = plan.reused_tokens
                # where the reuse is now: admission onboards it to the GPU
                tiers = (reused, self._tier_tokens(plan))
            todo = n - reused
            if todo > budget:
                if not sched.chunked_prefill and (chunks or runs):
                    break
                c = budget if sched.chunked_prefill else todo
            else:
                c = todo
            waiting.popleft()
            runs.append(run)
            reqs.append(sreq)
            sizes.append(c)
            found.append(tiers)
            worst += bound
            budget -= c
            slots -= 1
        if not runs:
            return
        results = mgr.add_sequence_batch(reqs)
        for run, res, where, c in zip(runs, results, found, sizes, strict=True):
            rec = run.rec
            run.state = _PREFILL
            run.target = len(run.sequence_request().tokens)
            run.seq_req = None
            run.computed = res.reused_tokens
            run.logged = (res.reused_tokens - res.reused_tokens % tpb) // tpb
            run.mgr_len = run.target
            self._orders += 1
            run.order = self._orders
            self._running[run.order] = run
            self._prefilling.append(run)
            chunks.append((run, c))
            if rec.admitted_s is None:
                if self.accesses is not None:  # even empty: it carries the prompt's tokens
                    self.accesses.append((rec.index, LOOKUP, 0, run.logged))
                # a partial match is shorter than a block: it is the reuse beyond whole blocks
                partial = res.reused_tokens % tpb
                rec.admitted_s = now
                rec.reused_tokens = res.reused_tokens
                # what the shared tier gave and admission still found (evictions between)
                rec.remote_tokens = min(rec.remote_tokens, res.reused_tokens)
                rec.reused_partial_tokens = partial
                rec.reused_full_tokens = res.reused_tokens - partial
                if where is None:  # the shortcut: one GPU tier
                    rec.tier_tokens[0] += res.reused_tokens
                else:
                    assert where[0] == res.reused_tokens, "plan_batch and admission disagree"
                    rec.tier_tokens = where[1]

    def _tier_tokens(self, plan: RequestPlan) -> list[int]:
        """Reused tokens per tier the matched blocks are on (reference layer group)."""
        return plan.tier_tokens(self._ref_group)

    def _is_sync(self, length: int) -> bool:
        """Does growing a sequence to ``length`` tokens change more than its token list?"""
        if not self.coalesce:
            return True
        tpb = self.tpb
        if (length - 1) % tpb == 0:
            return True
        for w in self._windows:
            x = length - w - 1
            if x >= tpb and x % tpb == 0:
                return True
        return False

    def _next_sync(self, length: int) -> int:
        """The smallest sync length above ``length``."""
        if not self.coalesce:
            return length + 1
        tpb = self.tpb
        best = -(-length // tpb) * tpb + 1
        for w in self._windows:
            k = max(1, -(-(length - w) // tpb))
            best = min(best, w + 1 + k * tpb)
        return best

    def _grow(self, run: _Run) -> None:
        """The decoding ``run`` just sampled a token: append it (lazily) and schedule the
        step at which it next needs the manager; preempt on a missing block.

        The first token after a prefill is always appended at once when a layer group has a
        window: admission holds every prompt block, and that append releases the ones that
        already left the window.
        """
        length = run.n + run.generated
        first = bool(self._windows) and run.mgr_len == run.target
        if first or self._is_sync(length):
            mgr = self.manager
            sid = run.req.request_id
            n = run.n
            if run.mgr_len < length - 1:
                mgr.add_tokens(sid, run.out[run.mgr_len - n : length - 1 - n])
                run.mgr_len = length - 1
            token = run.out[length - 1 - n : length - n]
            while True:
                try:
                    mgr.add_tokens(sid, token)
                    break
                except OutOfBlocksError:
                    victim = self._running[next(reversed(self._running))]
                    self._preempt(victim)
                    if victim is run:
                        return
            run.mgr_len = length
            if self._windows:
                self._blocked = False  # a window release may have freed blocks
        steps = min(self._next_sync(length) - length, run.m - run.generated)
        run.due = self._dsteps + steps
        heapq.heappush(self._heap, (run.due, run.order, run.epoch, run))

    def _leave(self, run: _Run) -> None:
        """Take ``run`` out of the running set (and the decode accounting)."""
        del self._running[run.order]
        if run.state == _DECODE:
            self._decoding -= 1
            self._ctx_base -= run.n + run.gen_base - run.step_base
            run.generated = run.gen_base + self._dsteps - run.step_base
        elif run.state == _PREFILL:
            self._prefilling.remove(run)
        run.epoch += 1
        self._blocked = False

    def _remove_storing(self, run: _Run) -> None:
        """``remove_sequence(store_for_reuse=True)``, logging what it commits: the appended
        tokens but the last once decoding began (the manager's rule)."""
        length = run.mgr_len
        computed = length - 1 if length > run.target else length
        self.manager.remove_sequence(run.req.request_id, store_for_reuse=True)
        self._log_insert(run, computed // self.tpb)

    def _log_insert(self, run: _Run, blocks: int) -> None:
        if self.accesses is not None and blocks > run.logged:
            self.accesses.append((run.rec.index, INSERT, run.logged, blocks))
            run.logged = blocks

    def _flush_appended(self, run: _Run, upto: int) -> None:
        if run.mgr_len < upto:
            n = run.n
            self.manager.add_tokens(run.req.request_id, run.out[run.mgr_len - n : upto - n])
            run.mgr_len = upto

    def _finish(self, run: _Run, now: float, finished: list[RequestRecord]) -> None:
        self._leave(run)
        # every sampled token but the final one is appended (no sync lies before it)
        self._flush_appended(run, run.n + run.m - 1)
        self._remove_storing(run)
        run.state = _DONE
        run.rec.finish_s = now
        finished.append(run.rec)

    def _preempt(self, run: _Run) -> None:
        decoding = run.state == _DECODE
        self._leave(run)
        if decoding:
            # The token sampled this step is not appended: the victim is the newest sequence,
            # so one token at a time it would not have had its turn yet (and a token at a sync
            # length would need the block that is missing).
            self._flush_appended(run, run.n + run.generated - 1)
            self._remove_storing(run)
        else:
            # mid-prefill: the computed chunks were stored; the rest holds no valid KV
            self.manager.remove_sequence(run.req.request_id, store_for_reuse=False)
        run.state = _WAITING
        run.seq_req = None
        run.rec.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(run)
