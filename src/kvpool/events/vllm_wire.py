"""vLLM's KV event wire format as msgspec structs (COMPATIBILITY §3), both directions.

The tier <-> medium names, the structs :mod:`kvpool.events.vllm_encode` writes (the current map
form, field order = wire order) and those :mod:`kvpool.events.vllm_msgpack` reads the current
shape with (types checked in C, unknown keys ignored), and the field order of older engines'
positional events. :mod:`kvpool.events.vllm_msgpack` describes the mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec

from kvpool.events.model import REMOTE_CACHE_LEVEL, REMOTE_MEDIUM
from kvpool.hashing.keys import HashAlgo

__all__ = [
    "M64",
    "MEDIUM_OF_TIER",
    "REMOVED_FIELDS",
    "STORED_FIELDS",
    "TIER_OF_MEDIUM",
    "TYPED_DECODER",
    "TYPED_DECODER_NO_TOKENS",
    "V2_SHA256",
    "InCleared",
    "InRemoved",
    "InStored",
    "InStoredNoTokens",
    "OutBatch",
    "OutCleared",
    "OutEvent",
    "OutRemoved",
    "OutStored",
    "WireHash",
]

MEDIUM_OF_TIER: Final[tuple[str, ...]] = ("GPU", "CPU", "STORAGE", REMOTE_MEDIUM)
TIER_OF_MEDIUM: Final[dict[str, int]] = {
    "GPU": 0,
    "CPU": 1,
    "STORAGE": 2,
    REMOTE_MEDIUM: REMOTE_CACHE_LEVEL,
    "CPU_PINNED": 1,
    "DISK": 2,
}
M64: Final = (1 << 64) - 1
V2_SHA256: Final = HashAlgo.V2_SHA256.value

WireHash = int | bytes


# ------------------------------------------------------------------------------ wire structs
# Struct field order is the wire order; omit_defaults drops exactly the fields that vLLM only
# writes when set (those with a default here), never the always-present ones. gc=False: these
# hold no cycles, and the cyclic collector has millions of them to skip.


class OutStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: Sequence[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int] | msgspec.Raw  # Raw: already encoded (vllm_encode._wire_tokens)
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OutRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: Sequence[WireHash]
    medium: str | None
    group_idx: int | None = None


class OutCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


OutEvent = OutStored | OutRemoved | OutCleared


class OutBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[OutEvent]
    data_parallel_rank: int | None


# Decoding structs for the current shape: msgspec validates types in C and ignores unknown keys;
# anything else falls back to the generic path.

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class InStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    # Fields kvpool does not use (lora_name, extra_keys, kv_cache_spec_kind) are left out so
    # msgspec skips them without building objects.
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: _NonNegative | None = 0
    lora_id: int | None = None
    medium: str | None = None
    group_idx: _NonNegative | None = None
    kv_cache_spec_sliding_window: _NonNegative | None = None


class InRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: _NonNegative | None = None


class InCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class InBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[InStored | InRemoved | InCleared]
    data_parallel_rank: int | None = None


TYPED_DECODER: Final = msgspec.msgpack.Decoder(InBatch)


class InStoredNoTokens(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    # As InStored, but token_ids stay raw msgpack: a consumer keyed by block hashes never
    # reads them, and building their ints is half of a batch's decoding time.
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    block_size: _NonNegative | None = 0
    lora_id: int | None = None
    medium: str | None = None
    group_idx: _NonNegative | None = None
    kv_cache_spec_sliding_window: _NonNegative | None = None


class InBatchNoTokens(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[InStoredNoTokens | InRemoved | InCleared]
    data_parallel_rank: int | None = None


TYPED_DECODER_NO_TOKENS: Final = msgspec.msgpack.Decoder(InBatchNoTokens)

STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")

