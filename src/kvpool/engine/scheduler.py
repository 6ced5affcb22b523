"""The scheduler: which requests compute which tokens in a step, and their cache bookkeeping.

A request's manager sequence holds its prompt and every sampled token but the newest one
(added when the next step schedules it). ``num_computed`` tokens of it have KV in the cache;
a step computes ``[num_computed, end)``. Per step, in order:

1. suspended requests resume (oldest first) while the GPU can take their blocks back;
2. every running request's newest sampled token joins its sequence (``add_tokens``); when
   the pool is short, the newest running request is preempted: ``suspend`` (its blocks move
   to the host tier) or, when that frees nothing, recomputation (its sequence is removed,
   committing what it computed, and it waits again with its tokens so far as prompt);
3. decodes (one token each) and prefill chunks share ``max_num_tokens``, oldest first;
4. waiting requests are admitted with one ``add_sequence_batch`` (two-phase admission), as
   many as fit the batch size, the remaining budget and the pool: a batch the pool refuses
   (``OutOfBlocksError``, the manager unchanged) is retried without its newest request.
   With a remote tier (``CacheConfig.remote``), the batch's requests never tried before first
   get their remote continuations (``manager.prefetch``: attention blocks and, for hybrid
   models, the deepest remote checkpoint) into local slots, so that admission reuses them;
   once per request, never for a suspended or recomputed one, and a remote failure is a miss
   (the request computes cold). ``remote_tokens`` counts the tokens it made reusable.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvpool.config import SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import OutOfBlocksError, RemoteTierError

logger = logging.getLogger(__name__)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One request's state. ``tokens`` = prompt + generated (the newest sampled one last)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int]
    status: Status = Status.WAITING
    seq_id: int = -1  # the manager sequence (a new one after each recomputation)
    seq_len: int = 0  # tokens the manager's sequence holds
    admitted_len: int = 0  # tokens it was admitted with
    num_computed: int = 0
    committed_blocks: int = 0  # full blocks committed by store_context_blocks
    cached_tokens: int = -1  # prompt tokens reused at first admission (-1 = not admitted)
    prefetched: bool = False  # its remote continuation was asked for (remote tier only)
    logits: list[torch.Tensor] | None = None
    finish_reason: str | None = None
    text: str | None = None
    stop_checked: int = 0  # characters of text already searched for stop strings

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass(slots=True)
class Schedule:
    """A step's work: decodes compute one token each, prefills ``[start, end)``."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Requests by state and the per-step policy (see the module docstring)."""

    def __init__(self, manager: KVCacheManager, max_batch_size: int, max_num_tokens: int) -> None:
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.suspended: deque[Request] = deque()
        self._next_seq = 0
        self.preemptions = 0
        self.recomputations = 0
        self.remote = manager.remote_stats() is not None  # prefetch before first admissions
        self.remote_tokens = 0  # prompt tokens prefetch made reusable, all requests

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.suspended)

    def schedule(self) -> Schedule:
        self._resume()
        self._grow()
        out = Schedule()
        budget = self.max_num_tokens
        for req in self.running:
            todo = req.seq_len - req.num_computed
            if todo == 1:
                out.decodes.append(req)
                budget -= 1
        for req in self.running:
            todo = req.seq_len - req.num_computed
            if todo > 1 and budget > 0:
                n = min(todo, budget)
                out.prefills.append((req, req.num_computed, req.num_computed + n))
                budget -= n
        for req, n in self._admit(budget):
            out.prefills.append((req, req.num_computed, req.num_computed + n))
        return out

    def _resume(self) -> None:
        while self.suspended and len(self.running) < self.max_batch_size:
            req = self.suspended[0]
            try:
                self.manager.resume(req.seq_id)
            except OutOfBlocksError:
                return
            self.suspended.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

    def _grow(self) -> None:
        """Add every running request's newest token to its sequence, preempting on shortage."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.seq_len < len(req.tokens):
                try:
                    self.manager.add_tokens(req.seq_id, req.tokens[req.seq_len:])
                except OutOfBlocksError:
                    self.preempt(self.running[-1])
                    continue  # retry the same request (or it was the one preempted)
                req.seq_len = len(req.tokens)
            i += 1

    def preempt(self, req: Request) -> None:
        """Take a running request off the GPU: suspend it, or recompute it later."""
        self.running.remove(req)
        self.preemptions += 1
        m = self.manager
        if m.config.num_tiers > 1:
            freed = m.suspend(req.seq_id)
            if any(freed.values()):
                req.status = Status.SUSPENDED
                self.suspended.append(req)
                return
            m.resume(req.seq_id)
        self.recomputations += 1
        self.release(req)
        req.status = Status.WAITING
        req.num_computed = req.seq_len = req.committed_blocks = 0
        self.waiting.appendleft(req)

    def release(self, req: Request) -> None:
        """Remove a request's sequence; commit its KV only where every committed token was
        computed (the manager takes the newest token of a grown sequence as not computed)."""
        if req.seq_id < 0 or req.status is Status.WAITING:
            return
        done = req.num_computed == req.seq_len or (
            req.seq_len > req.admitted_len and req.num_computed == req.seq_len - 1)
        self.manager.remove_sequence(req.seq_id, store_for_reuse=done)
        req.seq_id = -1

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests in one batch; returns (request, tokens this step) pairs."""
        room = self.max_batch_size - len(self.running)
        if self.suspended or room <= 0 or budget <= 0 or not self.waiting:
            return []
        batch: list[Request] = []
        for req in self.waiting:
            if len(batch) >= min(room, budget):
                break
            batch.append(req)
        if self.remote:
            self._prefetch(batch)
        while batch:
            seq_ids = range(self._next_seq, self._next_seq + len(batch))
            try:
                results = self.manager.add_sequence_batch(
                    [SequenceRequest(s, r.tokens) for s, r in zip(seq_ids, batch, strict=True)])
            except OutOfBlocksError:
                batch.pop()
                continue
            self._next_seq += len(batch)
            break
        else:
            return []
        out: list[tuple[Request, int]] = []
        for req, res in zip(batch, results, strict=True):
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.seq_id = int(res.seq_id)
            req.seq_len = req.admitted_len = len(req.tokens)
            req.num_computed = res.reused_tokens
            req.committed_blocks = res.reused_tokens // self.manager.tpb
            if req.cached_tokens < 0:
                req.cached_tokens = res.reused_tokens
            self.running.append(req)
            n = min(req.seq_len - req.num_computed, budget)
            if n > 0:
                out.append((req, n))
                budget -= n
        return out

    def _prefetch(self, batch: list[Request]) -> None:
        """The remote continuations of the batch's requests not asked for yet (first
        admissions only: a recomputed request was admitted before, a suspended one resumes
        with the blocks it holds). A remote failure is a miss: the requests compute cold."""
        fresh = [r for r in batch if not r.prefetched]
        if not fresh:
            return
        for r in fresh:
            r.prefetched = True
        try:
            got = self.manager.prefetch([SequenceRequest(r.request_id, r.tokens) for r in fresh])
        except RemoteTierError as e:  # counted by the manager; per request it is caught there
            logger.warning("remote prefetch failed, computing cold: %s", e)
            return
        self.remote_tokens += sum(got)

    def computed(self, req: Request, end: int) -> None:
        """``[num_computed, end)`` of ``req`` now has KV: commit its prompt's new full blocks."""
        req.num_computed = end
        if end <= req.admitted_len and end // self.manager.tpb > req.committed_blocks:
            self.manager.store_context_blocks(req.seq_id, end)
            req.committed_blocks = end // self.manager.tpb

    def finish(self, req: Request, reason: str) -> None:
        """Release a running, suspended or waiting request for good."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.SUSPENDED:
            self.suspended.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
