"""Seed 004: a small sliding window must not size its pool to one slot and deadlock scheduling.

A model with one full-attention layer and one layer with a 4-token window (a quarter of a
16-token block) serves many short requests that decode concurrently. The pools of a planner
that only sees a long-history request give the window group a single slot; the pools of
:func:`plan_pools` (with its concurrent-decode floor) give it ``max_batch_size`` slots. The
same workload, driven through the real :class:`KVCacheManager` by a minimal continuous-batching
loop, gets stuck with the former (free memory in the full-attention pool, no request can move)
and runs to completion with the latter.

The completion guarantee is for a scheduler that admits by peak need (guaranteed no evict): a
greedy scheduler without preemption can exhaust any finite pool when all its requests cross a
block boundary in the same step, so it is only used here to show the undersized pool's deadlock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvpool.config import CacheConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.planner.capacity import (
    KVCacheDesc,
    LayerSpec,
    ModelSpec,
    batch_need,
    blocks_needed,
    plan_pools,
    split_budget,
)

TPB = 16
WINDOW = 4  # smaller than one block
MAX_SEQ_LEN = 1032
MAX_BATCH = 16
MODEL = ModelSpec(
    "swa-toy",
    (LayerSpec(None, kv_heads=1, head_dim=8), LayerSpec(WINDOW, kv_heads=1, head_dim=8)),
    MAX_SEQ_LEN,
)
GROUPS = MODEL.layer_groups()
BYTES_PER_BLOCK = [g.bytes_per_block(TPB) for g in GROUPS]  # 512 B each
GPU_BYTES = 90 * 512
# The step a planner without the concurrent-decode constraint sizes for: one long decode.
LONG_DECODE = KVCacheDesc(MAX_SEQ_LEN, MAX_SEQ_LEN - 1)

PROMPT = 8  # one window block at admission
GEN = 40  # crosses two block boundaries; the window then spans two blocks for a few steps
REQUESTS = 24


@dataclass
class Outcome:
    finished: int = 0
    steps: int = 0
    stuck: bool = False
    running_when_stuck: int = 0
    free_when_stuck: dict[int, int] = field(default_factory=dict)
    grow_failures: int = 0


def peak_need(prompt: int, gen: int) -> list[int]:
    """Most slots per group one request holds over its life (the planner's need model)."""
    steps = [KVCacheDesc(prompt, 0)] + [
        KVCacheDesc(c, c - 1) for c in range(prompt + 1, prompt + gen + 1)
    ]
    return [max(blocks_needed(d, TPB, g.window, g.sink_tokens) for d in steps) for g in GROUPS]


def run_workload(cfg: CacheConfig, *, reserve: bool, max_steps: int = 2000) -> Outcome:
    """A minimal continuous-batching loop over the real manager.

    Each step admits waiting requests (FIFO, at most ``MAX_BATCH`` running) with
    ``add_sequence_batch``, grows every running request by one token with ``add_tokens`` and
    removes the ones that generated ``GEN`` tokens. Admission is either *guaranteed no evict*
    (``reserve``: the running requests' peak needs plus the candidate's must fit every pool)
    or *greedy* (whatever the manager accepts now). A step in which nothing is admitted, grown
    or finished while requests remain is *stuck*.
    """
    rng = random.Random(4)
    manager = KVCacheManager(cfg)
    pools = [cfg.slots[0][g] for g in range(len(GROUPS))]
    peak = peak_need(PROMPT, GEN)  # the same for every request of this workload
    waiting = [
        SequenceRequest(i, [rng.randrange(1, 30_000) for _ in range(PROMPT)])
        for i in range(REQUESTS)
    ]
    running: dict[int, int] = {}  # seq id -> tokens generated
    out = Outcome()
    while waiting or running:
        if out.steps >= max_steps:
            pytest.fail(f"no verdict after {max_steps} steps")
        out.steps += 1
        batch: list[SequenceRequest] = []
        while waiting and len(running) + len(batch) < MAX_BATCH:
            total = len(running) + len(batch) + 1
            if reserve and any(total * p > n for p, n in zip(peak, pools, strict=True)):
                break
            batch.append(waiting.pop(0))
        while batch:  # greedy admission backs off until the manager accepts the batch
            try:
                manager.add_sequence_batch(batch)
                break
            except OutOfBlocksError:
                waiting.insert(0, batch.pop())
        running.update((int(r.seq_id), 0) for r in batch)
        progressed = bool(batch)
        for seq_id in list(running):
            try:
                manager.add_tokens(seq_id, [rng.randrange(1, 30_000)])
            except OutOfBlocksError:
                out.grow_failures += 1
                continue
            progressed = True
            running[seq_id] += 1
            if running[seq_id] == GEN:
                manager.remove_sequence(seq_id)
                del running[seq_id]
                out.finished += 1
        if not progressed:
            out.stuck = True
            out.running_when_stuck = len(running)
            out.free_when_stuck = {g: manager.num_free_blocks(g) for g in range(len(GROUPS))}
            return out
    manager.check_invariants()
    return out


def long_history_only_pools() -> tuple[int, ...]:
    """GPU slots sized from the long decode alone: floors and split both from LONG_DECODE."""
    need = batch_need([LONG_DECODE], GROUPS, TPB)
    return split_budget(GPU_BYTES, BYTES_PER_BLOCK, need, need)


def undersized_config() -> CacheConfig:
    slots = long_history_only_pools()
    assert slots[1] < MAX_BATCH  # the window pool is undersized (one slot)
    return CacheConfig(
        tokens_per_block=TPB,
        gpu_blocks=dict(enumerate(slots)),
        window_sizes=[g.window for g in GROUPS],
        max_seq_len=MAX_SEQ_LEN,
    )


def test_undersized_window_pool_cannot_schedule_anything() -> None:
    # Every request holds two window blocks while its window straddles a block boundary, so a
    # scheduler that admits by peak need never admits one; the full-attention pool sits idle.
    out = run_workload(undersized_config(), reserve=True)
    assert out.stuck and out.finished == 0 and out.running_when_stuck == 0
    assert out.free_when_stuck[0] > 0


def test_undersized_window_pool_deadlocks_a_running_request() -> None:
    # Greedy admission lets one request in; at its first block boundary it needs a second
    # window slot that can never free up, while the full-attention pool has free slots.
    out = run_workload(undersized_config(), reserve=False)
    assert out.stuck and out.finished == 0
    assert out.running_when_stuck >= 1 and out.grow_failures >= out.running_when_stuck
    assert out.free_when_stuck[1] == 0 and out.free_when_stuck[0] > 0


def test_planned_pools_run_the_workload_to_completion() -> None:
    plan = plan_pools(
        MODEL,
        TPB,
        GPU_BYTES,
        max_batch_size=MAX_BATCH,
        max_num_tokens=64,
        max_seq_len=MAX_SEQ_LEN,
        typical_step=[LONG_DECODE],
    )
    assert plan.gpu_blocks[1] >= MAX_BATCH
    assert plan.groups[1].floor_reason == "concurrent_decode"
    out = run_workload(CacheConfig(**plan.cache_config_kwargs()), reserve=True)
    assert not out.stuck and out.finished == REQUESTS
    # Admission reserved the planner's peak need; the manager never needed more than that.
    assert out.grow_failures == 0
