"""A simulated cluster: N engines (:class:`~kvpool.replay.engine_sim.SimWorker`) behind a
routing policy, replaying a workload in simulated time (ARCHITECTURE §6).

Each policy replays the workload on a fresh cluster. The replay is a discrete-event
simulation: requests arrive at their workload timestamps and are routed at once; each worker
runs scheduler steps back to back while it has work; events at one instant are handled in the
order step ends, arrivals, step starts (so a step that starts at an arrival's instant sees it).

Events take the real path: every worker's manager reports to its own
:class:`~kvpool.events.EventManager`; at each step end the step's events are flushed and
delivered to the router's :class:`~kvpool.router.Ingest` (``inproc``), or encoded as vLLM
msgpack batches, published on a ZeroMQ PUB socket on 127.0.0.1 and received, decoded and
applied by a subscriber (``zmq``); the replay waits for each batch, so both transports give
the same results. Every policy but ``approx`` ingests events, so event volumes compare across
policies.

Policies: ``cost``, ``trtllm`` and ``approx`` are the :class:`~kvpool.router.Router` modes
(the router's clock is the simulated one; it hears of each request's first token,
:meth:`~kvpool.router.Router.prefill_finished`, and of its end). ``approx`` routes on no event:
the workers' events are emitted and counted but never delivered, and the router predicts each
worker's cache with the worker's block budget per tier (of the reference layer group).
``round-robin``, ``least-loaded`` (fewest unfinished requests, then lowest index) and
``random`` (seeded) ignore the cache.

Bounds. Both count whole blocks (:mod:`kvpool.replay.bounds`), so they are compared with the
policies' full-block hit rates; partial-block reuse is reported apart.

* Unlimited cache (:func:`workload_bounds`, one per workload): the stream has, per request in
  arrival order, the whole blocks of its prompt minus its last token (lookups), then the
  further blocks the simulator commits for it (its last prompt block and its answer, see
  :func:`~kvpool.replay.engine_sim.committed_tokens`), which later turns reuse. No routing,
  eviction or timing can reuse more.
* Belady (:attr:`PolicyResult.belady`, one per policy run): Belady's optimum, with optional
  admission (``bypass``), for the cluster's total capacity (every tier of every worker) over
  the run's own cache accesses in simulated-time order: the blocks a request reused when it
  was first admitted, and every block when it is committed (a block a request computes is
  accessed then, when it can first be in any cache; were it also accessed at admission, its
  own commit would count as a hit). The union of the workers' caches is one schedule of such
  a cache, so no eviction policy could have reused more in that run; it also credits blocks
  that another worker held (what perfect routing would have found). A single bound for the
  workload in arrival order would not be one: a busy cluster time-shares its capacity (an
  answer still being generated takes no cache while other requests reuse theirs) and can beat
  Belady on the arrival-order stream (``tests/replay/test_replay_sim.py`` holds such a case).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import xxhash

from kvpool.errors import InvalidArgumentError
from kvpool.events.manager import EventManager
from kvpool.replay.bounds import BlockStream, HitRateBound, belady_hit_rate, unlimited_hit_rate
from kvpool.replay.engine_sim import (
    LOOKUP,
    RequestRecord,
    SimWorker,
    committed_tokens,
    output_tokens,
    reference_group,
)
from kvpool.replay.parallel import run_tasks
from kvpool.replay.sizing import (
    TRANSPORTS,
    ClusterConfig,
    block_cache,
    planned_cache,
    shared_store,
)
from kvpool.replay.transport import InProcess, Zmq
from kvpool.replay.workloads import Request, Workload
from kvpool.router.index import KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.scoring import Router
from kvpool.validation import check_int

__all__ = [
    "KV_POLICIES",
    "POLICIES",
    "TRANSPORTS",
    "ClusterConfig",
    "PolicyResult",
    "ReplayResult",
    "WorkerResult",
    "block_cache",
    "bound_stream",
    "planned_cache",
    "replay",
    "replay_policy",
    "request_chain",
    "run_bound",
    "workload_bounds",
]

POLICIES: Final = ("cost", "trtllm", "approx", "round-robin", "least-loaded", "random")
"""Routing policies, in the order reports list them."""

KV_POLICIES: Final = frozenset({"cost", "trtllm", "approx"})
"""The policies that route with the KV-aware router."""

_END, _ARRIVAL, _START = 0, 1, 2  # event kinds, in their order at one instant


# --------------------------------------------------------------------------------- results


@dataclass(slots=True)
class WorkerResult:
    """One worker at the end of a replay: its manager's totals and its scheduler's."""

    worker_id: str
    requests: int
    steps: int
    busy_s: float
    preemptions: int
    cache_stats: dict[str, object]


@dataclass(slots=True)
class PolicyResult:
    """One policy's replay: every request's record and the cluster's counters.

    ``belady`` bounds the run's whole-block reuse (see the module docstring).
    ``decision_latency_s`` and ``wall_s`` are wall-clock measurements (they vary run to run);
    everything else is a function of the workload, the configuration and the seed.
    """

    policy: str
    records: list[RequestRecord]
    workers: list[WorkerResult]
    events_emitted: int
    events_applied: int
    belady: HitRateBound
    wall_s: float
    decision_latency_s: list[float]

    @property
    def finished(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.rejected]

    @property
    def makespan_s(self) -> float:
        """First arrival to last finish (simulated seconds)."""
        done = [r.finish_s for r in self.records if r.finish_s is not None]
        if not done:
            return 0.0
        return max(done) - min(r.arrival_s for r in self.records)


@dataclass(slots=True)
class ReplayResult:
    """A whole replay: the workload, the cluster, the bounds and one result per policy."""

    workload: dict[str, Any]
    config: ClusterConfig
    bounds: dict[str, HitRateBound]
    policies: list[PolicyResult]
    bounds_wall_s: float = 0.0


# --------------------------------------------------------------------------------- bounds


def _chain_keys(tokens: array[int], blocks: int, tpb: int, salt: str | None) -> list[int]:
    raw = memoryview(tokens).cast("B")
    step = 4 * tpb
    digest = xxhash.xxh3_64_intdigest
    key = 0 if salt is None else digest(b"kvpool-salt\x00" + salt.encode("utf-8"))
    out: list[int] = []
    for off in range(0, blocks * step, step):
        key = digest(raw[off : off + step], key)
        out.append(key)
    return out


def request_chain(req: Request, tokens_per_block: int, *, seed: int = 0) -> list[int]:
    """Keys of the whole blocks of ``prompt + output`` that a request may ever commit or look
    up: the first (n + m - 1) // tpb blocks (xxh3 chains, salted like
    :func:`~kvpool.replay.bounds.request_block_keys`; only their equality matters)."""
    tpb = tokens_per_block
    n, m = len(req.tokens), req.output_length
    blocks = (n + m - 1) // tpb
    tokens = req.tokens
    if blocks * tpb > n:
        tokens = tokens + output_tokens(req, seed)[: blocks * tpb - n]
    return _chain_keys(tokens, blocks, tpb, req.cache_salt)


def _stream(entries: list[tuple[list[int], int]], tokens_per_block: int) -> BlockStream:
    """A stream of (keys, prompt tokens) entries; prompt tokens 0 marks inserts."""
    lengths = [len(k) for k, _ in entries]
    offsets = np.zeros(len(entries) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [key for keys, _ in entries for key in keys]
    prompts = np.array([p for _, p in entries], dtype=np.int64)
    return BlockStream(np.array(flat, dtype=np.uint64), offsets, prompts, tokens_per_block)


def bound_stream(workload: Workload, tokens_per_block: int, *, seed: int = 0) -> BlockStream:
    """The workload's stream in arrival order (see the module docstring).

    Entries alternate per request: its lookups (``prompt_tokens`` = its prompt length), then
    the blocks it commits beyond them (``prompt_tokens`` 0; an access there that hits would
    only raise a bound, and with generated answers none does).
    """
    tpb = tokens_per_block
    entries: list[tuple[list[int], int]] = []
    for req in workload.requests:
        n, m = len(req.tokens), req.output_length
        look = (n - 1) // tpb
        chain = request_chain(req, tpb, seed=seed)[: max(look, committed_tokens(n, m) // tpb)]
        entries.append((chain[:look], n))
        entries.append((chain[look:], 0))
    return _stream(entries, tpb)


def workload_bounds(
    workload: Workload, tokens_per_block: int, *, seed: int = 0
) -> dict[str, HitRateBound]:
    """``{"unlimited": ...}``: the unlimited-cache bound of the workload (whole blocks)."""
    return {"unlimited": unlimited_hit_rate(bound_stream(workload, tokens_per_block, seed=seed))}


def run_bound(
    workload: Workload,
    accesses: Sequence[tuple[int, int, int, int]],
    tokens_per_block: int,
    capacity_blocks: int,
    *,
    seed: int = 0,
) -> HitRateBound:
    """Belady (with bypass) for ``capacity_blocks`` over a run's access log (see
    :class:`~kvpool.replay.engine_sim.SimWorker`)."""
    chains: dict[int, list[int]] = {}
    entries: list[tuple[list[int], int]] = []
    requests = workload.requests
    for index, kind, first, end in accesses:
        chain = chains.get(index)
        if chain is None:
            chain = chains[index] = request_chain(requests[index], tokens_per_block, seed=seed)
        entries.append(
            (chain[first:end], len(requests[index].tokens) if kind == LOOKUP else 0)
        )
    return belady_hit_rate(_stream(entries, tokens_per_block), capacity_blocks, bypass=True)


# ------------------------------------------------------------------------------ the replay


ProgressFn = Callable[[int], None]
"""Called with the number of requests that just completed (finished or rejected)."""


class _Replay:
    """One policy on a fresh cluster."""

    def __init__(self, workload: Workload, config: ClusterConfig, policy: str) -> None:
        if policy not in POLICIES:
            raise InvalidArgumentError(
                f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}"
            )
        self.workload = workload
        self.config = config
        self.policy = policy
        self.now = 0.0
        cache = dataclasses.replace(config.cache, clock=self._clock)
        self.shared = shared_store(config.cache, config.remote_bytes, config.remote_block_bytes)
        if self.shared is not None:
            cache = dataclasses.replace(
                cache, remote=dataclasses.replace(cache.remote, store=self.shared))
        self.worker_ids = [f"w{i}" for i in range(config.workers)]
        self.events = [
            EventManager(1 << 20, hash_algo=cache.hash_algo) for _ in self.worker_ids
        ]
        self.accesses: list[tuple[int, int, int, int]] = []
        self.workers = [
            SimWorker(wid, cache, config.scheduler, config.time_model, events=em,
                      coalesce=config.coalesce_steps, accesses=self.accesses)
            for wid, em in zip(self.worker_ids, self.events, strict=True)
        ]
        self.slot_of = {wid: i for i, wid in enumerate(self.worker_ids)}
        self.index = KvIndex()
        for wid in self.worker_ids:
            self.index.add_worker(
                wid, hash_algo=cache.hash_algo, tokens_per_block=cache.tokens_per_block
            )
        self.ingest = Ingest(self.index)
        self.router: Router | None = None
        if policy in KV_POLICIES:
            options: dict[str, Any] = {
                "max_batch_size": config.scheduler.max_batch_size,
                "request_timeout_s": 0.0,
                "seed": config.seed,
            }
            if policy != "trtllm":
                options.update(config.router_options)
            self.router = Router(self.index, mode=policy, clock=self._clock, **options)
            if policy == "approx":  # the router knows each worker's block budget
                g = reference_group(cache)
                for wid in self.worker_ids:
                    self.router.predict_cache(wid, [tier[g] for tier in cache.slots])
        self.rng = random.Random(config.seed)
        self.rr = 0
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.counter = itertools.count()
        self.versions = [0] * config.workers
        self.start_pending = [False] * config.workers
        self.records: list[RequestRecord] = []
        self.latencies: list[float] = []
        self.emitted = 0
        self.applied = 0

    def _clock(self) -> float:
        return self.now

    def run(self, progress: ProgressFn | None) -> PolicyResult:
        started = time.perf_counter()
        transport: InProcess | Zmq = (
            Zmq(self.ingest, self.worker_ids, self.config.cache.tokens_per_block)
            if self.config.transport == "zmq"
            else InProcess(self.ingest)
        )
        try:
            for w, em in enumerate(self.events):
                em.flush_iteration_events()  # the managers' created events
                self._deliver(transport, w)
            self._loop(transport, progress)
        finally:
            transport.close()
        cfg = self.config
        belady = run_bound(self.workload, self.accesses, cfg.cache.tokens_per_block,
                           cfg.capacity_blocks, seed=cfg.seed)
        if self.shared is not None:  # stop the workers' remote writers
            for worker in self.workers:
                worker.manager.close()
        return PolicyResult(
            policy=self.policy,
            records=self.records,
            workers=[
                WorkerResult(
                    worker_id=w.worker_id,
                    requests=sum(1 for r in self.records if r.worker == w.worker_id),
                    steps=w.steps,
                    busy_s=w.busy_s,
                    preemptions=w.preemptions,
                    cache_stats=w.manager.stats().as_dict(),
                )
                for w in self.workers
            ],
            events_emitted=self.emitted,
            events_applied=self.applied,
            belady=belady,
            wall_s=time.perf_counter() - started,
            decision_latency_s=self.latencies,
        )

    def _loop(self, transport: InProcess | Zmq, progress: ProgressFn | None) -> None:
        requests = self.workload.requests
        heap = self.heap
        pop = heapq.heappop
        i, n = 0, len(requests)
        while i < n or heap:
            if i < n and (not heap or (requests[i].arrival_s, _ARRIVAL) < heap[0][:2]):
                self.now = requests[i].arrival_s
                if self._arrive(i, requests[i]) and progress is not None:
                    progress(1)
                i += 1
                continue
            t, kind, _, w, version = pop(heap)
            self.now = t
            worker = self.workers[w]
            if kind == _START:
                self.start_pending[w] = False
                end = worker.start_step(t)
                if end is not None:
                    self.versions[w] += 1
                    heapq.heappush(heap, (end, _END, next(self.counter), w, self.versions[w]))
            elif version == self.versions[w]:
                finished = worker.finish_step(t)
                self._deliver(transport, w)
                if worker.first_tokens:
                    if self.router is not None:
                        for rec in worker.first_tokens:
                            self.router.prefill_finished(rec.request_id)
                    worker.first_tokens.clear()
                if finished:
                    if self.router is not None:
                        for rec in finished:
                            self.router.request_finished(rec.request_id)
                    if progress is not None:
                        progress(len(finished))
                self._schedule_start(w)
        stuck = [r.request_id for r in self.records if r.finish_s is None and not r.rejected]
        if stuck:  # the scheduler guarantees progress; this is an internal invariant
            raise AssertionError(f"replay ended with unfinished requests: {stuck[:5]}")

    def _schedule_start(self, w: int) -> None:
        if not self.start_pending[w]:
            self.start_pending[w] = True
            heapq.heappush(self.heap, (self.now, _START, next(self.counter), w, 0))

    def _deliver(self, transport: InProcess | Zmq, w: int) -> None:
        events = self.events[w].get_latest_events(0)
        if events:
            self.emitted += len(events)
            if self.policy != "approx":  # approx routes without any event
                self.applied += transport.deliver(self.worker_ids[w], events, self.now)

    def _route(self, req: Request) -> int:
        policy = self.policy
        if self.router is not None:
            decision = self.router.route(
                req.tokens, cache_salt=req.cache_salt, request_id=req.request_id
            )
            return self.slot_of[decision.worker_id]
        if policy == "round-robin":
            w = self.rr
            self.rr = (w + 1) % len(self.workers)
            return w
        if policy == "least-loaded":
            loads = [wk.active for wk in self.workers]
            return loads.index(min(loads))
        return self.rng.randrange(len(self.workers))

    def _arrive(self, i: int, req: Request) -> bool:
        """Route and queue request ``i``; True if it was rejected (it completes at once)."""
        t0 = time.perf_counter()
        w = self._route(req)
        self.latencies.append(time.perf_counter() - t0)
        worker = self.workers[w]
        rec = RequestRecord(
            index=i,
            request_id=req.request_id,
            worker=worker.worker_id,
            arrival_s=req.arrival_s,
            prompt_tokens=len(req.tokens),
            output_tokens=req.output_length,
        )
        self.records.append(rec)
        if not worker.submit(req, rec, output_tokens(req, self.config.seed)):
            if self.router is not None:
                self.router.request_finished(req.request_id)
            return True
        if not worker.busy:
            self._schedule_start(w)
        else:
            end = worker.interrupt(self.now)
            if end is not None:
                self.versions[w] += 1
                heapq.heappush(self.heap, (end, _END, next(self.counter), w, self.versions[w]))
        return False


def replay_policy(
    workload: Workload,
    config: ClusterConfig,
    policy: str,
    *,
    progress: ProgressFn | None = None,
) -> PolicyResult:
    """Replay ``workload`` on a fresh cluster routed by ``policy`` (one of :data:`POLICIES`)."""
    return _Replay(workload, config, policy).run(progress)


def _replay_task(
    workload: Workload, config: ClusterConfig, policy: str, progress: ProgressFn
) -> PolicyResult:
    """One policy in a worker process of :func:`~kvpool.replay.parallel.run_tasks`."""
    return replay_policy(workload, config, policy, progress=progress)


def _replay_parallel(
    workload: Workload,
    config: ClusterConfig,
    policies: Sequence[str],
    jobs: int,
    progress: Callable[[str], ProgressFn | None] | None,
) -> list[PolicyResult]:
    """One policy per task, ``jobs`` worker processes (:mod:`kvpool.replay.parallel`: spawned,
    gone with the replay however it ends)."""
    callbacks = [progress(p) if progress else None for p in policies]

    def forward(index: int, n: int) -> None:
        cb = callbacks[index]
        if cb is not None:
            cb(n)

    results: list[PolicyResult] = run_tasks(
        _replay_task, (workload, config), list(policies), jobs, forward
    )
    return results


def replay(
    workload: Workload,
    config: ClusterConfig,
    policies: Sequence[str] = POLICIES,
    *,
    progress: Callable[[str], ProgressFn | None] | None = None,
    jobs: int = 1,
) -> ReplayResult:
    """Replay ``workload`` once per policy and compute the bounds.

    ``progress(policy)`` may return a callback that receives completed-request counts.
    ``jobs`` > 1 replays that many policies at once in worker processes; the results are the
    same as with one job (each policy is deterministic and independent). Raises
    :class:`InvalidArgumentError` for an unknown or repeated policy, an empty workload or a
    bad ``jobs``, before replaying anything.
    """
    if not policies:
        raise InvalidArgumentError("at least one routing policy is needed")
    for p in policies:
        if p not in POLICIES:
            raise InvalidArgumentError(
                f"unknown routing policy {p!r}; valid: {', '.join(POLICIES)}"
            )
    if len(set(policies)) != len(policies):
        raise InvalidArgumentError(f"routing policies repeat: {', '.join(policies)}")
    if not len(workload):
        raise InvalidArgumentError(f"workload {workload.name!r} has no requests")
    check_int("jobs", jobs, 1)
    t0 = time.perf_counter()
    bounds = workload_bounds(workload, config.cache.tokens_per_block, seed=config.seed)
    bounds_wall = time.perf_counter() - t0
    jobs = min(jobs, len(policies))
    if jobs > 1:
        results = _replay_parallel(workload, config, policies, jobs, progress)
    else:
        results = [
            replay_policy(workload, config, p, progress=progress(p) if progress else None)
            for p in policies
        ]
    info = {
        "name": workload.name,
        "requests": len(workload),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": sum(r.output_length for r in workload.requests),
        "duration_s": workload.duration_s,
        "metadata": workload.metadata,
    }
    return ReplayResult(info, config, bounds, results, bounds_wall)
