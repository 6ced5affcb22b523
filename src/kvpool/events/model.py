"""KV cache event types (ARCHITECTURE §4, COMPATIBILITY §2).

The in-memory model mirrors TensorRT-LLM's event JSON: every event carries an id, the window
size and layer group it concerns, the hash algorithm of its hashes and, with attention data
parallelism, the rank it came from. ``data`` is one of the five payload types. Block hashes are
ints (u64) or, for ``v2_sha256``, 64-character hex strings.

The structs are declared ``gc=False``: they hold only ints, strings, tuples (or
:class:`TokenIds`) and each other, so they can never be part of a reference cycle, and leaving
millions of them out of the cyclic garbage collector's passes measurably speeds up decoding and
indexing event streams.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpool.eviction.priority import DEFAULT_PRIORITY as DEFAULT_PRIORITY  # defined once, there

BlockHash = int | str

REMOTE_CACHE_LEVEL = 3
"""The cache level of a block held in the shared remote tier (:mod:`kvpool.tiers.remote`), below
GPU (0), host (1) and disk (2) whatever tiers a manager has locally: TensorRT-LLM's
``cache_level`` 3."""
REMOTE_MEDIUM = "REMOTE"
"""vLLM's ``medium`` of :data:`REMOTE_CACHE_LEVEL` (``"GPU"``, ``"CPU"``, ``"STORAGE"``, then
this)."""


class EventDiff(msgspec.Struct, frozen=True, gc=False):
    """A changed value: cache level or priority."""

    old_value: int
    new_value: int


class TokenIds(array):  # type: ignore[type-arg]
    """A block's token ids as kvpool's manager announces them: an ``array("I")`` (build one
    as ``TokenIds("I", data)``) that equals, and hashes as, the tuple of the same ids.

    The manager keeps tokens as u32 bytes; a stored block's ids come out of them in one C
    call instead of one Python int per token, and the vLLM encoder writes them from their
    bytes (with the ``jit`` extra). Read them as any sequence of ints."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is tuple:
            return self.tolist() == list(other)
        return array.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:  # type: ignore[override]  # arrays are mutable; these are not
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"TokenIds({tuple(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds, ("I", self.tobytes()))


class StoredBlock(msgspec.Struct, frozen=True, gc=False):
    """One block of a stored chain. ``tokens``: a tuple of ints, or :class:`TokenIds` in the
    events of kvpool's manager (equal to the tuple of the same ids)."""

    block_hash: BlockHash
    tokens: Sequence[int]
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
