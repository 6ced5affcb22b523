"""KV cache event types (ARCHITECTURE §4, COMPATIBILITY §2).

The in-memory model mirrors TensorRT-LLM's event JSON: every event carries an id, the window
size and layer group it concerns, the hash algorithm of its hashes and, with attention data
parallelism, the rank it came from. ``data`` is one of the five payload types. Block hashes are
ints (u64) or, for ``v2_sha256``, 64-character hex strings.

The structs are declared ``gc=False``: they hold only ints, strings, tuples and each other, so
they can never be part of a reference cycle, and leaving millions of them out of the cyclic
garbage collector's passes measurably speeds up decoding and indexing event streams.
"""

from __future__ import annotations

import msgspec

BlockHash = int | str

DEFAULT_PRIORITY = 35


class EventDiff(msgspec.Struct, frozen=True, gc=False):
    """A changed value: cache level or priority."""

    old_value: int
    new_value: int


class StoredBlock(msgspec.Struct, frozen=True, gc=False):
    """One block of a stored chain."""

    block_hash: BlockHash
    tokens: tuple[int, ...]
    cache_level: int = 0
    priority: int = DEFAULT_PRIORITY
    lora_id: int | None = None
    mm_keys: tuple[str, ...] = ()


class Created(msgspec.Struct, frozen=True, gc=False):
    """A layer group's pools came up: slots per cache level (tier 0 = GPU first)."""

    num_blocks_per_cache_level: tuple[int, ...]


class Stored(msgspec.Struct, frozen=True, gc=False):
    """A chain of blocks entered the cache; ``parent_hash`` is None for a scope's first block."""

    parent_hash: BlockHash | None
    blocks: tuple[StoredBlock, ...]


class Removed(msgspec.Struct, frozen=True, gc=False):
    """Blocks left the cache.

    ``cache_levels`` is None when the blocks left every tier (TensorRT-LLM semantics, and what
    its JSON carries). kvpool's event manager fills it with each block's tier (parallel to
    ``block_hashes``) so that tier-aware formats (vLLM's ``medium``) can say where each block
    was; a removal decoded from vLLM carries the medium it named.
    """

    block_hashes: tuple[BlockHash, ...]
    cache_levels: tuple[int, ...] | None = None


class Updated(msgspec.Struct, frozen=True, gc=False):
    """A cached block changed tier (``cache_level``) and/or retention priority."""

    block_hash: BlockHash
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None


class AllCleared(msgspec.Struct, frozen=True, gc=False):
    """Every block of the cache left it."""


EventData = Created | Stored | Removed | Updated | AllCleared


class KVCacheEvent(msgspec.Struct, frozen=True, gc=False):
    """One event as engines publish it."""

    event_id: int
    data: EventData
    window_size: int
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None
