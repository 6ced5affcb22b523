"""vLLM's KV event batches in msgpack (COMPATIBILITY §3), encoder and tolerant decoder.

A batch is the msgpack array ``[ts, events, data_parallel_rank]``. kvpool encodes each event
as a map tagged by ``"type"``, as current vLLM does:

* ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name`` always (possibly nil), then ``extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window`` only when not nil;
* ``BlockRemoved``: ``block_hashes, medium`` (+ ``group_idx`` when not nil);
* ``AllBlocksCleared``.

Mapping from kvpool events:

* tier <-> medium: 0 ``"GPU"``, 1 ``"CPU"``, 2 ``"STORAGE"``, 3 ``"REMOTE"`` (the shared
  remote tier, :data:`~kvpool.events.model.REMOTE_MEDIUM`; older names ``"CPU_PINNED"`` and
  ``"DISK"`` decode to 1 and 2);
* layer group <-> ``group_idx``: group 0 is written as nil (vLLM's default, so single-group
  output is byte-identical to vLLM's) and nil decodes to group 0;
* hashes: ints as they are, hex strings (``v2_sha256``) as their raw bytes. Decoding turns bytes
  back into hex for ``v2_sha256`` and into the last 8 bytes as an unsigned big-endian int
  otherwise (vLLM's raw ``sha256_cbor`` digests, COMPATIBILITY §1.4);
* a stored event's blocks go out as one ``BlockStored`` per run of blocks sharing tier and
  LoRA id (usually one), ``token_ids`` the blocks' tokens concatenated;
* a removed event's hashes go out as one ``BlockRemoved`` per tier, in order of first
  appearance (nil medium when the event carries no tiers: "every tier");
* an updated event that moves a block between tiers has no vLLM equivalent: it goes out as
  ``BlockRemoved`` on the old medium followed by a placeholder ``BlockStored`` on the new one
  (the hash only: no parent, no tokens, block size 0, as vLLM's own offloading connector does);
  a priority-only update and a created event are not written;
* the window size goes out only for the layer groups the caller names as sliding-window
  (``kv_cache_spec_kind="sliding_window"``, ``kv_cache_spec_sliding_window=W``); decoding takes
  the window from that field, else 0.

The decoder also accepts older engines' positional events (``["BlockStored", block_hashes,
parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kind,
window]``, 6 to 12 elements; ``["BlockRemoved", block_hashes, medium, group_idx]``, 2 to 4),
a batch written as a map, ignores unknown keys and tolerates missing optional fields.
:func:`decode_vllm_keys` decodes the same batches for a consumer keyed by block hashes (the
router's index): every event as a :class:`~kvpool.events.keyed.KeyedEvent` record.

The format is split by concept: :mod:`kvpool.events.vllm_wire` (the structs and media),
:mod:`kvpool.events.vllm_encode` (the encoder), :mod:`kvpool.events.vllm_decoder` (the
per-event decoding); this module holds the public decoding entry points and re-exports the
encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvpool.errors import EventFormatError
from kvpool.events.decoding import format_errors
from kvpool.events.keyed import KeyedEvent, keyed_events
from kvpool.events.model import AllCleared, KVCacheEvent
from kvpool.events.vllm_decoder import BatchDecoder, KeyedBatchDecoder, short_repr
from kvpool.events.vllm_encode import encode_vllm_batch
from kvpool.events.vllm_wire import (
    MEDIUM_OF_TIER,
    TIER_OF_MEDIUM,
    TYPED_DECODER,
    TYPED_DECODER_NO_TOKENS,
    InRemoved,
    InStored,
    InStoredNoTokens,
)
from kvpool.hashing import jit
from kvpool.hashing.keys import HashAlgo

__all__ = [
    "MEDIUM_OF_TIER",
    "TIER_OF_MEDIUM",
    "VllmEventBatch",
    "decode_vllm_batch",
    "decode_vllm_keys",
    "encode_vllm_batch",
]


@dataclass(frozen=True, slots=True)
class VllmEventBatch:
    """A decoded batch: its timestamp, its events as kvpool events, the engine's DP rank."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None


@format_errors("vLLM event batch")
def decode_vllm_batch(
    payload: bytes,
    *,
    hash_algo: str = HashAlgo.VLLM_SHA256_CBOR.value,
    first_event_id: int = 0,
    tokens: bool = True,
) -> VllmEventBatch:
    """Decode one batch (map-form or positional events) into kvpool events.

    Events are numbered from ``first_event_id`` (vLLM events carry no ids) and stamped with
    ``hash_algo`` and the batch's rank as ``attention_dp_rank``. A stored event's tokens are cut
    into blocks of ``block_size`` (aligned to the last block when ``token_ids`` covers more
    blocks than ``block_hashes`` names); a stored or removed event without hashes yields
    nothing. An unknown event type is an error, not skipped: dropping it silently would break
    the consumer's picture of the cache without a trace. With ``tokens=False`` stored blocks
    carry no tokens (a consumer keyed by block hashes decodes about twice as fast).

    Raises:
        EventFormatError: the payload is not msgpack or not a batch; the message names the
            bad field.
    """
    try:
        batch = (TYPED_DECODER if tokens else TYPED_DECODER_NO_TOKENS).decode(payload)
    except (msgspec.DecodeError, TypeError):
        # Not the current shape (positional events, a map batch, unknown keys' types...) or
        # garbage: the generic path accepts the former and names the fault in the latter.
        return _decode_generic(payload, hash_algo, first_event_id)
    decoder = BatchDecoder(hash_algo, first_event_id, batch.data_parallel_rank, typed=True)
    for index, ev in enumerate(batch.events):
        if type(ev) is InStored or type(ev) is InStoredNoTokens:
            decoder.stored(
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids if tokens else (),  # type: ignore[arg-type]
                ev.block_size,
                ev.lora_id,
                ev.medium,
                ev.group_idx,
                ev.kv_cache_spec_sliding_window,
                index,
            )
        elif type(ev) is InRemoved:
            decoder.removed(ev.block_hashes, ev.medium, ev.group_idx, index)
        else:
            decoder.emit(AllCleared(), 0, 0)
    return VllmEventBatch(batch.ts, decoder.events(), batch.data_parallel_rank)


@format_errors("vLLM event batch")
def decode_vllm_keys(
    payload: bytes,
    *,
    hash_algo: str = HashAlgo.VLLM_SHA256_CBOR.value,
    first_event_id: int = 0,
    tokens: bool = False,
) -> list[KeyedEvent]:
    """Decode one batch for a consumer keyed by block hashes (the router's index).

    The events mean to such a consumer what :func:`decode_vllm_batch`'s mean, numbered and
    stamped the same way, each as one :class:`~kvpool.events.keyed.KeyedEvent` record: stored
    and removed events are read into records holding their blocks' normalized keys, with no
    object per block; the rest (all-cleared events, hashes that make no key, batches only the
    generic decoder reads: positional events, map batches) go through kvpool events and
    :func:`~kvpool.events.keyed.keyed`. Token ids are neither built nor checked (as with
    ``tokens=False``); a stored record carries the token count of its first block (from
    ``block_size`` and the length of ``token_ids``), so the block size is learned as from the
    full events. With ``tokens=True`` (a consumer that keys blocks by their tokens) stored
    records carry the blocks' token ids, cut as :func:`decode_vllm_batch` cuts them, parent and
    LoRA id; a stored event whose token ids are not all in ``[0, 2**32)``, or whose parent
    makes no key, is a malformed record. Hashes that make no key make their event a malformed
    record, for the consumer to count.

    Raises:
        EventFormatError: as :func:`decode_vllm_batch`.
    """
    if tokens:
        fast = _decode_keys_reading_tokens(payload, hash_algo, first_event_id)
        if fast is not None:
            return fast
    try:
        batch = (TYPED_DECODER if tokens else TYPED_DECODER_NO_TOKENS).decode(payload)
    except (msgspec.DecodeError, TypeError):
        return _decode_generic_keys(payload, hash_algo, first_event_id, tokens)
    decoder = KeyedBatchDecoder(hash_algo, first_event_id, batch.data_parallel_rank, True, tokens)
    return decoder.typed_events(batch.events)


def _decode_keys_reading_tokens(
    payload: bytes, hash_algo: str, first_event_id: int
) -> list[KeyedEvent] | None:
    """``decode_vllm_keys(tokens=True)`` with the token ids read from their msgpack bytes by a
    compiled kernel (:func:`~kvpool.hashing.jit.msgpack_token_arrays`) instead of one Python int
    each;
    None when the kernel is not available or the batch needs the other paths (a shape the
    typed decoder does not take, or token ids that are not all ints in ``[0, 2**32)``: those
    paths then decode, or reject, it exactly as without the kernel)."""
    if jit.backend() == "python":
        return None  # before decoding: the caller's path would decode the batch again
    try:
        batch = TYPED_DECODER_NO_TOKENS.decode(payload)
    except (msgspec.DecodeError, TypeError):
        # not the typed shape even with token ids left raw, so not with them read either
        return _decode_generic_keys(payload, hash_algo, first_event_id, True)
    events = batch.events
    arrays = [ev.token_ids for ev in events if type(ev) is InStoredNoTokens and ev.token_ids]
    read = jit.msgpack_token_arrays(arrays)  # type: ignore[arg-type]  # Raw is a buffer
    if read is None:
        return None
    decoder = KeyedBatchDecoder(hash_algo, first_event_id, batch.data_parallel_rank, True, True)
    return decoder.typed_events(events, read)


def _decode_generic_keys(
    payload: bytes, hash_algo: str, first_event_id: int, tokens: bool
) -> list[KeyedEvent]:
    return keyed_events(_decode_generic(payload, hash_algo, first_event_id).events, tokens)


def _decode_generic(payload: bytes, hash_algo: str, first_event_id: int) -> VllmEventBatch:
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise EventFormatError(f"vLLM event batch is not msgpack: {exc}") from None
    if isinstance(obj, list) and len(obj) in (2, 3):
        ts, raw_events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw_events, rank = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    else:
        raise EventFormatError(
            f"vLLM event batch must be [ts, events, data_parallel_rank], got {short_repr(obj)}"
        )
    if type(ts) not in (float, int):
        raise EventFormatError(f"batch ts must be a number, got {ts!r}")
    if not isinstance(raw_events, list):
        raise EventFormatError(f"batch events must be an array, got {short_repr(raw_events)}")
    if rank is not None and type(rank) is not int:
        raise EventFormatError(f"batch data_parallel_rank must be an int or nil, got {rank!r}")
    decoder = BatchDecoder(hash_algo, first_event_id, rank, typed=False)
    for index, raw in enumerate(raw_events):
        decoder.generic(raw, index)
    return VllmEventBatch(float(ts), decoder.events(), rank)
