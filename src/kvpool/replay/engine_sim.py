"""One simulated engine of a replay: a real :class:`~kvpool.core.manager.KVCacheManager` behind a
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
from array import array
from collections import deque
from typing import Final

from kvpool.config import CacheConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.core.plan import RequestPlan
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.events.manager import EventManager
from kvpool.replay.simmodel import (
    RequestRecord,
    SchedulerConfig,
    TimeModel,
    committed_tokens,
    fits_ever,
    gpu_capacity,
    output_tokens,
    peak_blocks,
    reference_group,
)
from kvpool.replay.simrun import DECODE, DONE, PREFILL, WAITING, SimRun, SimStep
from kvpool.replay.workloads import Request

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
        self._remote = cache.remote.store is not None or cache.remote.url is not None
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
        self._waiting: deque[SimRun] = deque()
        self._running: dict[int, SimRun] = {}  # admission order -> run (newest last)
        self._prefilling: list[SimRun] = []
        self._decoding = 0
        self._ctx_base = 0  # sum over decoding runs of n + gen_base - step_base
        self._heap: list[tuple[int, int, int, SimRun]] = []  # (due, order, epoch, run)
        self._dsteps = 0
        self._orders = 0
        # The queue head did not fit; retried once something may make it fit: blocks freed
        # (finish, preemption, window release) or committed (a longer match needs fewer).
        self._blocked = False
        self._step: SimStep | None = None
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
        self._waiting.append(SimRun(req, rec, out))
        return True

    def start_step(self, now: float) -> float | None:
        """Schedule a step starting at ``now``; returns its end, or None if idle."""
        if self._step is not None:
            raise InvalidArgumentError(f"worker {self.worker_id}: a step is already in flight")
        sched = self.scheduler
        budget = sched.max_num_tokens - self._decoding
        chunks: list[tuple[SimRun, int]] = []
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
        self._step = SimStep(now, chunks, batch, context, k, duration)
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
        completed: list[SimRun] = []
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
        due: list[SimRun] = []
        while heap and heap[0][0] <= self._dsteps:
            _, _, epoch, run = heapq.heappop(heap)
            if epoch == run.epoch:
                run.generated = run.gen_base + self._dsteps - run.step_base
                due.append(run)
        grow: list[SimRun] = []
        for run in completed:
            if run.generated >= run.m:
                self._finish(run, now, finished)
                continue
            self._prefilling.remove(run)
            run.state = DECODE
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
            if run.state == DECODE:  # not preempted by an older run's growth
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

    def _admit(self, now: float, budget: int, chunks: list[tuple[SimRun, int]]) -> None:
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
        runs: list[SimRun] = []
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
            self._started(run, res.reused_tokens, where, now)
            chunks.append((run, c))

    def _started(self, run: SimRun, reused: int, where: tuple[int, list[int]] | None,
                 now: float) -> None:
        """An admitted run starts prefilling; its first admission is recorded (reuse, tiers:
        ``where`` is (reuse, tokens per tier) when it was planned, None on the shortcut)."""
        tpb = self.tpb
        rec = run.rec
        run.state = PREFILL
        run.target = len(run.sequence_request().tokens)
        run.seq_req = None
        run.computed = reused
        run.logged = (reused - reused % tpb) // tpb
        run.mgr_len = run.target
        self._orders += 1
        run.order = self._orders
        self._running[run.order] = run
        self._prefilling.append(run)
        if rec.admitted_s is not None:
            return
        if self.accesses is not None:  # even empty: it carries the prompt's tokens
            self.accesses.append((rec.index, LOOKUP, 0, run.logged))
        # a partial match is shorter than a block: it is the reuse beyond whole blocks
        partial = reused % tpb
        rec.admitted_s = now
        rec.reused_tokens = reused
        # what the shared tier gave and admission still found (evictions between)
        rec.remote_tokens = min(rec.remote_tokens, reused)
        rec.reused_partial_tokens = partial
        rec.reused_full_tokens = reused - partial
        if where is None:  # the shortcut: one GPU tier
            rec.tier_tokens[0] += reused
        else:
            assert where[0] == reused, "plan_batch and admission disagree"
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

    def _grow(self, run: SimRun) -> None:
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

    def _leave(self, run: SimRun) -> None:
        """Take ``run`` out of the running set (and the decode accounting)."""
        del self._running[run.order]
        if run.state == DECODE:
            self._decoding -= 1
            self._ctx_base -= run.n + run.gen_base - run.step_base
            run.generated = run.gen_base + self._dsteps - run.step_base
        elif run.state == PREFILL:
            self._prefilling.remove(run)
        run.epoch += 1
        self._blocked = False

    def _remove_storing(self, run: SimRun) -> None:
        """``remove_sequence(store_for_reuse=True)``, logging what it commits: the appended
        tokens but the last once decoding began (the manager's rule)."""
        length = run.mgr_len
        computed = length - 1 if length > run.target else length
        self.manager.remove_sequence(run.req.request_id, store_for_reuse=True)
        self._log_insert(run, computed // self.tpb)

    def _log_insert(self, run: SimRun, blocks: int) -> None:
        if self.accesses is not None and blocks > run.logged:
            self.accesses.append((run.rec.index, INSERT, run.logged, blocks))
            run.logged = blocks

    def _flush_appended(self, run: SimRun, upto: int) -> None:
        if run.mgr_len < upto:
            n = run.n
            self.manager.add_tokens(run.req.request_id, run.out[run.mgr_len - n : upto - n])
            run.mgr_len = upto

    def _finish(self, run: SimRun, now: float, finished: list[RequestRecord]) -> None:
        self._leave(run)
        # every sampled token but the final one is appended (no sync lies before it)
        self._flush_appended(run, run.n + run.m - 1)
        self._remove_storing(run)
        run.state = DONE
        run.rec.finish_s = now
        finished.append(run.rec)

    def _preempt(self, run: SimRun) -> None:
        decoding = run.state == DECODE
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
        run.state = WAITING
        run.seq_req = None
        run.rec.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(run)
