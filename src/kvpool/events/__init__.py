"""KV cache events: the model, the batching manager, the reference consumer, wire formats and
the ZeroMQ transport (ARCHITECTURE §4, COMPATIBILITY §2-3)."""

from __future__ import annotations

from kvpool.events.index import EventIndex
from kvpool.events.manager import AttentionDpGather, EventManager
from kvpool.events.model import (
    DEFAULT_PRIORITY,
    REMOTE_CACHE_LEVEL,
    REMOTE_MEDIUM,
    AllCleared,
    BlockHash,
    Created,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    TokenIds,
    Updated,
)
from kvpool.events.snapshot import PublishedState
from kvpool.events.trtllm_json import (
    parse_trtllm_dicts,
    parse_trtllm_json,
    to_trtllm_dicts,
    to_trtllm_json,
)
from kvpool.events.vllm_msgpack import VllmEventBatch, decode_vllm_batch, encode_vllm_batch
from kvpool.events.vllm_stream import VllmStreamEncoder
from kvpool.events.zmq import SubscribedBatch, ZmqEventPublisher, ZmqEventSubscriber

__all__ = [
    "DEFAULT_PRIORITY",
    "REMOTE_CACHE_LEVEL",
    "REMOTE_MEDIUM",
    "AllCleared",
    "AttentionDpGather",
    "BlockHash",
    "Created",
    "EventData",
    "EventDiff",
    "EventIndex",
    "EventManager",
    "KVCacheEvent",
    "PublishedState",
    "Removed",
    "Stored",
    "StoredBlock",
    "SubscribedBatch",
    "TokenIds",
    "Updated",
    "VllmEventBatch",
    "VllmStreamEncoder",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "decode_vllm_batch",
    "encode_vllm_batch",
    "parse_trtllm_dicts",
    "parse_trtllm_json",
    "to_trtllm_dicts",
    "to_trtllm_json",
]
