"""Hybrid-model replay: token hit rates of checkpoint policies at equal memory.

A hybrid model (:class:`~kvpool.planner.hybrid.HybridSpec`) keeps attention KV in blocks and a
fixed-size recurrent state per sequence. :func:`hybrid_hit_rate` replays a workload's requests
one after another through a real :class:`~kvpool.core.manager.KVCacheManager` whose GPU pools
share one byte budget: ``state_fraction`` of it for state slots (one running slot, the rest
checkpoints), the rest for attention blocks. Each request is admitted (its reused tokens
counted), prefilled with a checkpoint at every position the policy asks for
(``checkpoint_positions`` / ``save_checkpoint``), decoded (its output appended, checkpoints at
the boundaries crossed) and removed (its blocks stored for reuse).

Modes (:data:`MODES`):

- ``kvpool`` with any ``checkpoint_policy``: small attention blocks (``tokens_per_block``);
- ``align``: vLLM's "align" prefix caching for hybrid models, simulated: the attention block is
  the size vLLM picks for the spec (:meth:`HybridSpec.vllm_block_size`, the attention page of
  one layer at least the state page of one layer) and states are checkpointed only on that
  grid: at every block boundary (``every_block``) or at the last one reached (``last``,
  closer to vLLM's chunk-end checkpoints); :func:`best_split` reports the better of the two;
- ``attention``: the same workload on an attention-only model (no state at all; every byte
  holds attention blocks), the ceiling a hybrid model's hit rate is compared with.

:func:`best_split` tries a few ``state_fraction`` values and keeps each mode's best, so every
mode is compared at its own best use of the same memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kvpool.config import CacheConfig, EvictionConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.planner.hybrid import HybridSpec
from kvpool.replay.simmodel import output_tokens
from kvpool.replay.workloads import Request

__all__ = ["MODES", "HybridResult", "best_split", "hybrid_hit_rate"]

MODES: Final = ("kvpool", "align", "attention")
SPLITS: Final = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75)
"""The state fractions :func:`best_split` tries."""


@dataclass(frozen=True, slots=True)
class HybridResult:
    """One replay: its mode, policy, block size, memory split and outcome."""

    mode: str
    policy: str
    tokens_per_block: int
    state_fraction: float
    attention_blocks: int
    state_slots: int
    prompt_tokens: int
    hit_tokens: int
    skipped: int  # requests that did not fit at all

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _config(spec: HybridSpec, budget_bytes: int, mode: str, policy: str, tpb: int,
            state_fraction: float) -> tuple[CacheConfig, int, int]:
    """The cache of one replay: its config, attention blocks and state slots."""
    if mode == "align":  # vLLM's grid; every boundary of it, or only the last reached
        tpb = spec.vllm_block_size()
        policy = policy if policy in ("every_block", "last") else "every_block"
    block = spec.attention_bytes_per_token * tpb
    if mode == "attention":
        return CacheConfig(tokens_per_block=tpb, gpu_blocks=max(1, budget_bytes // block),
                           eviction=EvictionConfig(policy="lru")), budget_bytes // block, 0
    state = max(2, int(budget_bytes * state_fraction) // spec.state_bytes)
    blocks = (budget_bytes - state * spec.state_bytes) // block
    if blocks < 1:
        raise InvalidArgumentError(f"a budget of {budget_bytes} B leaves no attention block")
    cfg = CacheConfig(tokens_per_block=tpb, gpu_blocks=[blocks, state],
                      window_sizes=[None, None], state_groups=[1], checkpoint_policy=policy,
                      enable_partial_reuse=False, eviction=EvictionConfig(policy="lru"))
    return cfg, blocks, state


def _save(m: KVCacheManager, seq: str, start: int, end: int) -> None:
    for p in m.checkpoint_positions(seq, start, end):
        m.save_checkpoint(seq, p)


def hybrid_hit_rate(requests: Iterable[Request], spec: HybridSpec, budget_bytes: int, *,
                    mode: str = "kvpool", policy: str = "marconi", tokens_per_block: int = 16,
                    state_fraction: float = 0.1) -> HybridResult:
    """Replay ``requests`` in order on one cache of ``budget_bytes`` (module docstring)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {list(MODES)}, got {mode!r}")
    cfg, blocks, state = _config(spec, budget_bytes, mode, policy, tokens_per_block,
                                 state_fraction)
    m = KVCacheManager(cfg)
    hybrid = mode != "attention"
    prompt = hits = skipped = 0
    for n, req in enumerate(requests):
        seq = f"r{n}"
        prompt += len(req.tokens)
        try:
            r = m.add_sequence(SequenceRequest(seq, req.tokens, cache_salt=req.cache_salt))
        except OutOfBlocksError:
            skipped += 1
            continue
        hits += r.reused_tokens
        length = len(req.tokens)
        if hybrid:
            _save(m, seq, r.reused_tokens, length)
        out = output_tokens(req)
        if len(out) > 1:
            try:
                m.add_tokens(seq, out[:-1])
            except OutOfBlocksError:
                m.remove_sequence(seq)
                continue
            if hybrid:
                _save(m, seq, length, length + len(out) - 2)
        m.remove_sequence(seq)
    m.close()
    return HybridResult(mode, cfg.checkpoint_policy if hybrid else "-", cfg.tokens_per_block,
                        state_fraction if hybrid else 0.0, blocks, state, prompt, hits, skipped)


def best_split(requests: Sequence[Request], spec: HybridSpec, budget_bytes: int, *,
               mode: str = "kvpool", policy: str = "marconi", tokens_per_block: int = 16,
               splits: Sequence[float] = SPLITS) -> HybridResult:
    """:func:`hybrid_hit_rate` at each state fraction of ``splits``; the best one."""
    if mode == "attention":
        splits = splits[:1]
    policies = ("every_block", "last") if mode == "align" else (policy,)
    results = [hybrid_hit_rate(requests, spec, budget_bytes, mode=mode, policy=pol,
                               tokens_per_block=tokens_per_block, state_fraction=f)
               for f in splits for pol in policies]
    return max(results, key=lambda r: r.hit_tokens)
