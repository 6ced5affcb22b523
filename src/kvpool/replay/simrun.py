"""A request's state on a simulated worker (:class:`SimRun`) and a step in flight
(:class:`SimStep`): the bookkeeping :class:`~kvpool.replay.engine_sim.SimWorker` keeps."""

from __future__ import annotations

from array import array
from typing import Final

from kvpool.config import SequenceRequest
from kvpool.replay.simmodel import RequestRecord
from kvpool.replay.workloads import Request

__all__ = ["DECODE", "DONE", "PREFILL", "WAITING", "SimRun", "SimStep"]

WAITING: Final = 0
PREFILL: Final = 1
DECODE: Final = 2
DONE: Final = 3


class SimRun:
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
        self.state = WAITING
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


class SimStep:
    __slots__ = ("batch", "chunks", "context", "duration", "k", "start")

    def __init__(
        self, start: float, chunks: list[tuple[SimRun, int]], batch: int, context: int, k: int,
        duration: float,
    ) -> None:
        self.start = start
        self.chunks = chunks
        self.batch = batch  # decoding sequences
        self.context = context  # their context tokens at the first step
        self.k = k  # steps this (macro) step runs
        self.duration = duration
