"""Workload replay: workloads (synthetic, Mooncake JSONL) and offline hit-rate bounds.

The simulated engines, the cluster and the report build on these (ARCHITECTURE §6).
"""

from __future__ import annotations

from kvpool.replay.bounds import (
    BlockStream,
    HitRateBound,
    belady_hit_rate,
    request_block_keys,
    unlimited_hit_rate,
)
from kvpool.replay.workloads import (
    BUILTIN_TRACES,
    DEFAULT_TOKENS_PER_HASH_ID,
    DEFAULT_VOCAB_SIZE,
    Request,
    SyntheticParams,
    Workload,
    builtin_trace,
    generate_synthetic,
    hash_id_block,
    load_mooncake,
    synthetic_workload,
)

__all__ = [
    "BUILTIN_TRACES",
    "DEFAULT_TOKENS_PER_HASH_ID",
    "DEFAULT_VOCAB_SIZE",
    "BlockStream",
    "HitRateBound",
    "Request",
    "SyntheticParams",
    "Workload",
    "belady_hit_rate",
    "builtin_trace",
    "generate_synthetic",
    "hash_id_block",
    "load_mooncake",
    "request_block_keys",
    "synthetic_workload",
    "unlimited_hit_rate",
]
