"""kvpool: the KV cache block manager for LLM inference engines.

The public API is what this module exports (plus the subpackages ``kvpool.events``,
``kvpool.router`` and ``kvpool.replay``); everything else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvpool.config import (
    CacheConfig,
    DiskConfig,
    EventsConfig,
    EvictionConfig,
    RemoteConfig,
    RetentionConfig,
    SequenceRequest,
    TokenRangeRetention,
)
from kvpool.core.manager import AdmitResult, KVCacheManager
from kvpool.core.plan import BatchPlan, PartialClaimTracker, PartialMode, RequestPlan
from kvpool.core.stats import CacheStats, RequestStats
from kvpool.errors import (
    CapacityError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokenError,
    KVPoolError,
    ManifestError,
    OutOfBlocksError,
    RewindError,
    SequenceStateError,
    StorageError,
    UnknownHashAlgorithmError,
    UnknownSequenceError,
)
from kvpool.events.manager import EventManager
from kvpool.hashing.keys import (
    BlockHasher,
    HashAlgo,
    cache_salt_id,
    request_block_hashes,
    v1_block_key,
    v2_block_key,
    v2_root_key,
    vllm_event_int,
    vllm_none_hash,
    vllm_sha256_cbor_block_hash,
)
from kvpool.planner.capacity import KVCacheDesc, LayerSpec, ModelSpec, PoolPlan, plan_pools
from kvpool.tiers.storage import BlockCopy, GroupGeometry, MetadataStorage
from kvpool.tiers.torch_storage import TorchStorage

__all__ = [
    "AdmitResult",
    "BatchPlan",
    "BlockCopy",
    "BlockHasher",
    "CacheConfig",
    "CacheStats",
    "CapacityError",
    "DiskConfig",
    "DuplicateSequenceError",
    "EventManager",
    "EventsConfig",
    "EvictionConfig",
    "GroupGeometry",
    "HashAlgo",
    "InvalidArgumentError",
    "InvalidTokenError",
    "KVCacheDesc",
    "KVCacheManager",
    "KVPoolError",
    "LayerSpec",
    "ManifestError",
    "MetadataStorage",
    "ModelSpec",
    "OutOfBlocksError",
    "PartialClaimTracker",
    "PartialMode",
    "PoolPlan",
    "RemoteConfig",
    "RequestPlan",
    "RequestStats",
    "RetentionConfig",
    "RewindError",
    "SequenceRequest",
    "SequenceStateError",
    "StorageError",
    "TokenRangeRetention",
    "TorchStorage",
    "UnknownHashAlgorithmError",
    "UnknownSequenceError",
    "__version__",
    "cache_salt_id",
    "plan_pools",
    "request_block_hashes",
    "v1_block_key",
    "v2_block_key",
    "v2_root_key",
    "vllm_event_int",
    "vllm_none_hash",
    "vllm_sha256_cbor_block_hash",
]
