"""Building blocks of the KvpoolTier tests: a primary pool, keys and payloads, jobs."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from vllm_peer import vllm_module

base = vllm_module("vllm.v1.kv_offload.base")
tiering = vllm_module("vllm.v1.kv_offload.tiering.base")
factory = vllm_module("vllm.v1.kv_offload.tiering.factory")

CHUNK = 4096
_job_ids = itertools.count(1)


def key(i: int, group: int = 0) -> bytes:
    """The offload key of block hash i (32 bytes, as vLLM's sha256 hashes) in a KV group."""
    return base.make_offload_key(i.to_bytes(32, "big"), group)  # type: ignore[no-any-return]


def payload(i: int) -> np.ndarray:
    """Chunk bytes that differ for every i and every position."""
    rng = np.random.default_rng(i)
    return rng.integers(-128, 128, CHUNK, dtype=np.int8)


def primary(num_chunks: int) -> np.ndarray:
    """A primary pool as vLLM's (num_chunks rows of CHUNK int8 bytes)."""
    return np.zeros((num_chunks, CHUNK), dtype=np.int8)


def make_tier(pool: np.ndarray, **config: Any) -> Any:
    """A KvpoolTier built as vLLM's SecondaryTierFactory builds an out-of-tree tier."""
    entry = {"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm", "model": "m",
             **config}
    return factory.SecondaryTierFactory.create_secondary_tier(entry, memoryview(pool), None)


def job(keys: list[bytes], chunk_ids: list[int], *, load: bool, req: str = "r") -> Any:
    return tiering.TransferJob(job_id=next(_job_ids), keys=keys,
                               chunk_ids=np.array(chunk_ids, dtype=np.int32),
                               is_promotion=load, req_context=base.ReqContext(req))


def finish(tier: Any) -> dict[int, Any]:
    """Wait for every job and return their results by job id."""
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def store(tier: Any, pool: np.ndarray, ids: list[int], chunks: list[int] | None = None) -> Any:
    """Put payload(i) in the pool's chunks and store them; the job's result."""
    chunks = chunks if chunks is not None else list(range(len(ids)))
    for i, c in zip(ids, chunks, strict=True):
        pool[c] = payload(i)
    j = job([key(i) for i in ids], chunks, load=False)
    tier.submit_store(j)
    return finish(tier)[j.job_id]


def load(tier: Any, pool: np.ndarray, ids: list[int], chunks: list[int] | None = None) -> Any:
    """Load the keys into the pool's chunks (zeroed first); the job's result."""
    chunks = chunks if chunks is not None else list(range(len(ids)))
    pool[chunks] = 0
    j = job([key(i) for i in ids], chunks, load=True)
    tier.submit_load(j)
    return finish(tier)[j.job_id]


def loaded_ids(result: Any, ids: list[int]) -> list[int]:
    """The ids a load result says were loaded."""
    if result.success:
        return list(ids)
    done = set(result.successful_keys or ())
    return [i for i in ids if key(i) in done]
