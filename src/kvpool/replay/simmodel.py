"""What a simulated engine is configured with and reports (:mod:`kvpool.replay.engine_sim`):
its :class:`TimeModel` and :class:`SchedulerConfig`, the :class:`RequestRecord` of every
request, the tokens it generates, and the block arithmetic of its pool (peak need, capacity).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.replay.workloads import DEFAULT_VOCAB_SIZE, Request
from kvpool.validation import check_bool, check_int, check_number

__all__ = [
    "RequestRecord",
    "SchedulerConfig",
    "TimeModel",
    "committed_tokens",
    "fits_ever",
    "gpu_capacity",
    "output_tokens",
    "peak_blocks",
    "reference_group",
]


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
            object.__setattr__(self, name, check_number(name, getattr(self, name)))

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
        check_int("max_batch_size", self.max_batch_size, 1)
        check_int("max_num_tokens", self.max_num_tokens, 1)
        if self.max_num_tokens < self.max_batch_size:
            raise InvalidArgumentError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running sequence decodes one token a step"
            )
        check_bool("chunked_prefill", self.chunked_prefill)


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
