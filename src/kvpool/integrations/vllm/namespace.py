"""The namespace of a ``KvpoolTier``'s chunks: what must be equal for two vLLM instances (or a
vLLM restarted on the same disk) to read each other's chunks.

Written down from vLLM's normalized offloading config (``OffloadingSpec.config``): the model
name and KV dtype, the KV cache layout, per KV cache group its tokens per block, layer count
and sliding window, bytes per block and blocks per chunk, and the parallel layout unless vLLM
says the bytes are parallelism-agnostic; then the chunk size of the primary pool and the
operator's ``namespace`` text. Canonical JSON, hashed by
:class:`~kvpool.tiers.remote.namespace.RemoteNamespace`: a difference anywhere gives other remote
keys, and a disk manifest of another namespace is never read as this one's.
"""

from __future__ import annotations

import json
from typing import Any, Final

from kvpool.errors import ConfigError
from kvpool.hashing.keys import HashAlgo
from kvpool.integrations.vllm.config import KvpoolTierConfig
from kvpool.tiers.remote.namespace import RemoteNamespace

__all__ = ["tier_namespace"]

_FORMAT: Final = 1


def _spec_layout(spec: Any) -> dict[str, object]:
    """The KV layout facts of vLLM's ``OffloadingSpec`` (its ``config``)."""
    config = spec.config
    parallel = config.parallel
    return {
        "dtype": str(config.model.dtype),
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": bool(config.canonical_layout),
        "replicated_layout": bool(config.replicated_layout),
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "groups": [[g.tokens_per_block, len(g.layer_names), g.sliding_window_size_in_chunks]
                   for g in config.groups],
        "parallel": None if parallel.is_parallelism_agnostic else [
            parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size,
            parallel.dcp_size],
    }


def tier_namespace(spec: Any, settings: KvpoolTierConfig, chunk_bytes: int) -> RemoteNamespace:
    """The namespace of a tier with ``settings`` on a primary pool of ``chunk_bytes`` chunks,
    under vLLM's ``spec`` (None: standalone, ``settings.model`` then names the model)."""
    model = settings.model
    if model is None:
        if spec is None:
            raise ConfigError("KvpoolTier without vLLM's offloading spec needs 'model' "
                              "(the model name its chunks belong to)")
        model = str(spec.config.model.name)
    doc: dict[str, object] = {
        "format": _FORMAT,
        "kind": "vllm-offload-chunks",
        "hash_algo": HashAlgo.VLLM_SHA256_CBOR.value,
        "model": model,
        "namespace": settings.namespace,
        "chunk_bytes": chunk_bytes,
        "layout": _spec_layout(spec) if spec is not None else None,
    }
    return RemoteNamespace.from_description(json.dumps(doc, sort_keys=True,
                                                       separators=(",", ":")))
