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
router's index): stored and removed events as :mod:`kvpool.events.keyed` records.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Annotated, Any, Final, cast

import msgspec

from kvpool import jit
from kvpool.errors import EventFormatError, InvalidArgumentError
from kvpool.events.decoding import format_errors
from kvpool.events.keyed import (
    KeyedEvent,
    RemovedKeys,
    StoredKeys,
    StoredTokens,
    digest_keys,
    token_bytes,
)
from kvpool.events.model import (
    DEFAULT_PRIORITY,
    REMOTE_CACHE_LEVEL,
    REMOTE_MEDIUM,
    AllCleared,
    BlockHash,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    TokenIds,
    Updated,
)
from kvpool.hashing import HashAlgo

__all__ = [
    "MEDIUM_OF_TIER",
    "TIER_OF_MEDIUM",
    "VllmEventBatch",
    "decode_vllm_batch",
    "decode_vllm_keys",
    "encode_vllm_batch",
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
_M64: Final = (1 << 64) - 1
_V2_SHA256: Final = HashAlgo.V2_SHA256.value

WireHash = int | bytes


# ------------------------------------------------------------------------------ wire structs
# Struct field order is the wire order; omit_defaults drops exactly the fields that vLLM only
# writes when set (those with a default here), never the always-present ones. gc=False: these
# hold no cycles, and the cyclic collector has millions of them to skip.


class _BlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: Sequence[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int] | msgspec.Raw  # Raw: the array already encoded (_wire_tokens)
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: Sequence[WireHash]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


_WireEvent = _BlockStored | _BlockRemoved | _AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireEvent]
    data_parallel_rank: int | None


_ENCODER: Final = msgspec.msgpack.Encoder()


# ------------------------------------------------------------------------------------ encode


def encode_vllm_batch(
    events: Iterable[KVCacheEvent],
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    *,
    block_size: int | None = None,
    sliding_window_groups: Collection[int] = (),
    partial_blocks: bool = False,
) -> bytes:
    """One vLLM event batch (the ZMQ payload) holding ``events``.

    Args:
        events: kvpool events, in order.
        ts: the batch timestamp (seconds); now when None.
        data_parallel_rank: written as the batch's third element.
        block_size: tokens per block; when None each stored event writes its longest block's
            token count (its full-block size unless every block is partial).
        sliding_window_groups: layer groups whose stored events carry their window size.
        partial_blocks: also write blocks of fewer than ``block_size`` tokens (a chain's
            partial last block). vLLM never publishes them (its token ids are always a whole
            number of blocks), so by default they are left out of stored events, as vLLM
            consumers expect; kvpool's own router matches them for TensorRT-LLM's hash
            algorithms, so a kvpool worker routed by it with those algorithms sets this.
            One call cannot know the later removals and tier moves of a block it left out:
            :class:`kvpool.events.vllm_stream.VllmStreamEncoder` leaves those out too.

    Raises:
        InvalidArgumentError: a tier with no vLLM medium, or a hash that is neither an
            unsigned 64-bit int nor a hex string.
    """
    # One wire struct per wire event and one msgspec call for the batch. Hash sequences go out
    # as they are when they are u64 ints (msgspec writes a tuple as an array); a stored event's
    # tokens are gathered into one list per run, the only per-token work in Python.
    wire: list[_WireEvent] = []
    append = wire.append
    for event in events:
        data = event.data
        kind = type(data)
        if kind is Stored:
            if not partial_blocks:
                data = whole_blocks(data, block_size)  # type: ignore[arg-type]
            _encode_stored(data, event, block_size, sliding_window_groups, wire)  # type: ignore[arg-type]
        elif kind is Removed:
            _encode_removed(data, event.layer_group_id or None, wire)  # type: ignore[arg-type]
        elif kind is Updated:
            diff = data.cache_level  # type: ignore[union-attr]
            if diff is not None and diff.old_value != diff.new_value:
                group = event.layer_group_id or None
                h = _wire_hash(data.block_hash)  # type: ignore[union-attr]
                append(_BlockRemoved([h], _medium(diff.old_value), group))
                append(
                    _BlockStored([h], None, [], 0, None, _medium(diff.new_value), None, None, group)
                )
        elif kind is AllCleared:
            append(_ALL_CLEARED)
    batch = _Batch(time.time() if ts is None else float(ts), wire, data_parallel_rank)
    try:
        return _ENCODER.encode(batch)
    except (OverflowError, TypeError) as exc:  # an int hash above u64 (or an id past msgpack)
        raise InvalidArgumentError(
            f"KV event batch cannot be encoded (block hashes must be unsigned 64-bit ints or "
            f"hex strings): {exc}"
        ) from None


_ALL_CLEARED: Final = _AllBlocksCleared()


def whole_blocks(data: Stored, block_size: int | None) -> Stored:
    """``data`` without its blocks of fewer than ``block_size`` tokens (the longest block's
    count when None): the chain up to its first partial block. Only a chain's last block can
    be partial (a block with a child is full), so this is usually one length check."""
    blocks = data.blocks
    if not blocks:
        return data
    size = block_size if block_size is not None else max(len(b.tokens) for b in blocks)
    if len(blocks[-1].tokens) >= size:
        return data
    cut = next(i for i, b in enumerate(blocks) if len(b.tokens) < size)
    return Stored(data.parent_hash, blocks[:cut])


def _medium(tier: int) -> str:
    if 0 <= tier < len(MEDIUM_OF_TIER):
        return MEDIUM_OF_TIER[tier]
    raise InvalidArgumentError(f"tier {tier} has no vLLM medium (expected 0 to 3)")


def _wire_hash(h: BlockHash) -> WireHash:
    if type(h) is int:
        if not 0 <= h <= _M64:
            raise InvalidArgumentError(f"block hash {h} is not an unsigned 64-bit integer")
        return h
    try:
        return bytes.fromhex(h)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            f"block hash {h!r} is neither an unsigned 64-bit int nor a hex string"
        ) from None


def _wire_hashes(hashes: Sequence[BlockHash]) -> Sequence[WireHash]:
    # Checked in C: a sequence of non-negative ints passes through as it is (msgspec refuses
    # one above u64 when it encodes the batch).
    try:
        if min(hashes) >= 0:  # type: ignore[operator]
            return hashes  # type: ignore[return-value]
    except TypeError:  # strings (v2_sha256) or a mix
        pass
    return [_wire_hash(h) for h in hashes]


def _encode_stored(
    data: Stored,
    event: KVCacheEvent,
    block_size: int | None,
    sliding: Collection[int],
    wire: list[_WireEvent],
) -> None:
    blocks = data.blocks
    if not blocks:
        return
    # One BlockStored per run of blocks of equal (tier, LoRA): usually the whole chain, built
    # in one pass; the runs stay chained through their parents.
    first = blocks[0]
    level, lora = first.cache_level, first.lora_id
    hashes: list[BlockHash] = []
    add = hashes.append
    tokens: list[Sequence[int]] = []  # the blocks' token sequences
    add_tokens = tokens.append
    longest = 0
    runs: list[tuple[list[BlockHash], list[Sequence[int]], int, int | None]] = []
    for block in blocks:
        if block.cache_level != level or (block.lora_id is not lora and block.lora_id != lora):
            runs.append((hashes, tokens, level, lora))
            level, lora = block.cache_level, block.lora_id
            hashes, tokens = [], []
            add, add_tokens = hashes.append, tokens.append
        add(block.block_hash)
        block_tokens = block.tokens
        add_tokens(block_tokens)
        if block_size is None and len(block_tokens) > longest:
            longest = len(block_tokens)
    runs.append((hashes, tokens, level, lora))
    size = longest if block_size is None else block_size
    group = event.layer_group_id or None
    kind: str | None = None
    window: int | None = None
    if sliding and event.layer_group_id in sliding:
        kind, window = "sliding_window", event.window_size
    parent = None if data.parent_hash is None else _wire_hash(data.parent_hash)
    for hashes, tokens, level, lora in runs:
        wire_hashes = _wire_hashes(hashes)
        wire.append(
            _BlockStored(
                wire_hashes, parent, _wire_tokens(tokens), size, lora, _medium(level), None,
                None, group, kind, window,
            )
        )
        parent = wire_hashes[-1]


_KERNEL_MIN_BYTES: Final = 512
"""Token bytes (128 ids) from which the msgpack kernel beats ints: a call costs about 1.5 µs."""


def _wire_tokens(blocks: list[Sequence[int]]) -> list[int] | msgspec.Raw:
    """The token_ids of a run of blocks: from their bytes in one kernel call when they are all
    :class:`TokenIds` (the manager's) and the ``jit`` extra is there, else as a list of ints
    (the same bytes on the wire either way)."""
    if blocks and set(map(type, blocks)) == {TokenIds}:
        raw = b"".join(blocks)  # type: ignore[arg-type]  # arrays are buffers
        if len(raw) >= _KERNEL_MIN_BYTES:
            packed = jit.msgpack_token_array(raw)
            if packed is not None:
                return msgspec.Raw(packed)
        ids: list[int] = array("I", raw).tolist()  # short: a kernel call costs more
        return ids
    out: list[int] = []
    for t in blocks:
        out += t
    return out


def _encode_removed(data: Removed, group: int | None, wire: list[_WireEvent]) -> None:
    hashes, levels = data.block_hashes, data.cache_levels
    if not hashes:
        return
    if levels is None:
        wire.append(_BlockRemoved(_wire_hashes(hashes), None, group))
        return
    if len(levels) != len(hashes):
        raise InvalidArgumentError(
            f"removed event has {len(hashes)} hashes but {len(levels)} cache levels"
        )
    first = levels[0]
    if levels.count(first) == len(levels):
        wire.append(_BlockRemoved(_wire_hashes(hashes), _medium(first), group))
        return
    # One BlockRemoved per tier, in order of first appearance.
    by_level: dict[int, list[WireHash]] = {}
    for h, level in zip(hashes, levels, strict=True):
        by_level.setdefault(level, []).append(_wire_hash(h))
    for level, level_hashes in by_level.items():
        wire.append(_BlockRemoved(level_hashes, _medium(level), group))


# ------------------------------------------------------------------------------------ decode


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
        batch = (_TYPED_DECODER if tokens else _TYPED_DECODER_NO_TOKENS).decode(payload)
    except (msgspec.DecodeError, TypeError):
        # Not the current shape (positional events, a map batch, unknown keys' types...) or
        # garbage: the generic path accepts the former and names the fault in the latter.
        return _decode_generic(payload, hash_algo, first_event_id)
    decoder = _Decoder(hash_algo, first_event_id, batch.data_parallel_rank, typed=True)
    for index, ev in enumerate(batch.events):
        if type(ev) is _InStored or type(ev) is _InStoredNoTokens:
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
        elif type(ev) is _InRemoved:
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
    stamped the same way, but stored and removed events come as
    :class:`~kvpool.events.keyed.StoredKeys` / :class:`~kvpool.events.keyed.RemovedKeys`
    records holding their blocks' normalized keys: no object per block. Token ids are neither
    built nor checked (as with ``tokens=False``); a stored record carries the token count of
    its first block (from ``block_size`` and the length of ``token_ids``), so the block size
    is learned as from the full events. With ``tokens=True`` (a consumer that keys blocks by
    their tokens) stored events come as :class:`~kvpool.events.keyed.StoredTokens` records
    instead: the blocks' token ids, cut as :func:`decode_vllm_batch` cuts them, in one byte
    string; a stored event whose tokens such a record cannot carry (a block without tokens,
    an id outside ``[0, 2**32)``) stays an ordinary one. Hashes that do not make a key (a
    ``v2_sha256`` digest longer than 32 bytes) leave their event an ordinary one, for the
    consumer to reject; batches only the generic decoder reads (positional events, map
    batches) come back as ordinary events.

    Raises:
        EventFormatError: as :func:`decode_vllm_batch`.
    """
    if tokens:
        fast = _decode_keys_reading_tokens(payload, hash_algo, first_event_id)
        if fast is not None:
            return fast
    try:
        batch = (_TYPED_DECODER if tokens else _TYPED_DECODER_NO_TOKENS).decode(payload)
    except (msgspec.DecodeError, TypeError):
        events: list[KeyedEvent] = list(_decode_generic(payload, hash_algo, first_event_id).events)
        return events
    decoder = _Decoder(hash_algo, first_event_id, batch.data_parallel_rank, typed=True)
    for index, ev in enumerate(batch.events):
        if type(ev) is _InStoredNoTokens:
            decoder.stored_keys(ev, index)
        elif type(ev) is _InStored:
            decoder.stored_tokens(ev, index)
        elif type(ev) is _InRemoved:
            decoder.removed_keys(ev.block_hashes, ev.medium, ev.group_idx, index)
        else:
            decoder.emit(AllCleared(), 0, 0)
    return decoder.out


def _decode_keys_reading_tokens(
    payload: bytes, hash_algo: str, first_event_id: int
) -> list[KeyedEvent] | None:
    """``decode_vllm_keys(tokens=True)`` with the token ids read from their msgpack bytes by a
    compiled kernel (:func:`kvpool.jit.msgpack_token_arrays`) instead of one Python int each;
    None when the kernel is not available or the batch needs the other paths (a shape the
    typed decoder does not take, or token ids that are not all ints in ``[0, 2**32)``: those
    paths then decode, or reject, it exactly as without the kernel)."""
    if jit.backend() == "python":
        return None  # before decoding: the caller's path would decode the batch again
    try:
        batch = _TYPED_DECODER_NO_TOKENS.decode(payload)
    except (msgspec.DecodeError, TypeError):
        # not the typed shape even with token ids left raw, so not with them read either
        return list(_decode_generic(payload, hash_algo, first_event_id).events)
    events = batch.events
    arrays = [ev.token_ids for ev in events if type(ev) is _InStoredNoTokens and ev.token_ids]
    read = jit.msgpack_token_arrays(arrays)  # type: ignore[arg-type]  # Raw is a buffer
    if read is None:
        return None
    data, lengths = read
    decoder = _Decoder(hash_algo, first_event_id, batch.data_parallel_rank, typed=True)
    k = off = 0
    for index, ev in enumerate(events):
        if type(ev) is _InStoredNoTokens:
            n_tokens = 0
            if ev.token_ids:
                n_tokens = lengths[k]
                k += 1
            decoder.stored_token_bytes(ev, index, data[4 * off:4 * (off + n_tokens)])
            off += n_tokens
        elif type(ev) is _InRemoved:
            decoder.removed_keys(ev.block_hashes, ev.medium, ev.group_idx, index)
        else:
            decoder.emit(AllCleared(), 0, 0)
    return decoder.out


# Decoding structs for the current shape: msgspec validates types in C and ignores unknown keys;
# anything else falls back to the generic path.

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _InStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
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


class _InRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: _NonNegative | None = None


class _InCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _InBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InStored | _InRemoved | _InCleared]
    data_parallel_rank: int | None = None


_TYPED_DECODER: Final = msgspec.msgpack.Decoder(_InBatch)


class _InStoredNoTokens(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    # As _InStored, but token_ids stay raw msgpack: a consumer keyed by block hashes never
    # reads them, and building their ints is half of a batch's decoding time.
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    block_size: _NonNegative | None = 0
    lora_id: int | None = None
    medium: str | None = None
    group_idx: _NonNegative | None = None
    kv_cache_spec_sliding_window: _NonNegative | None = None


class _InBatchNoTokens(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InStoredNoTokens | _InRemoved | _InCleared]
    data_parallel_rank: int | None = None


_TYPED_DECODER_NO_TOKENS: Final = msgspec.msgpack.Decoder(_InBatchNoTokens)

_STORED_FIELDS: Final = (
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
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")


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
            f"vLLM event batch must be [ts, events, data_parallel_rank], got {_short(obj)}"
        )
    if type(ts) not in (float, int):
        raise EventFormatError(f"batch ts must be a number, got {ts!r}")
    if not isinstance(raw_events, list):
        raise EventFormatError(f"batch events must be an array, got {_short(raw_events)}")
    if rank is not None and type(rank) is not int:
        raise EventFormatError(f"batch data_parallel_rank must be an int or nil, got {rank!r}")
    decoder = _Decoder(hash_algo, first_event_id, rank, typed=False)
    for index, raw in enumerate(raw_events):
        decoder.generic(raw, index)
    return VllmEventBatch(float(ts), decoder.events(), rank)


def _where(index: int, field: str = "") -> str:
    return f"event {index}.{field}" if field else f"event {index}"


class _Decoder:
    """Turns one batch's wire events into kvpool events (shared by both decoding paths).

    Error locations are built only when an error is raised: this is a hot path.
    """

    __slots__ = ("algo", "hex_bytes", "next_id", "out", "rank", "typed")

    def __init__(self, algo: str, first_event_id: int, rank: int | None, typed: bool) -> None:
        self.typed = typed
        self.algo = algo
        self.hex_bytes = algo == _V2_SHA256
        self.next_id = first_event_id
        self.rank = rank
        self.out: list[KeyedEvent] = []

    def events(self) -> list[KVCacheEvent]:
        """What was emitted, when only the event path ran (it emits nothing else)."""
        return cast(list[KVCacheEvent], self.out)

    def emit(self, data: Stored | Removed | AllCleared, group: int, window: int) -> None:
        self.out.append(KVCacheEvent(self.next_id, data, window, group, self.algo, self.rank))
        self.next_id += 1

    def hash(self, value: Any, index: int, field: str) -> BlockHash:
        if type(value) is int:
            return value & _M64 if value < 0 else value
        if type(value) is bytes:
            return value.hex() if self.hex_bytes else int.from_bytes(value[-8:], "big")
        raise EventFormatError(
            f"{_where(index, field)}: a block hash must be an int or bytes, got {value!r}"
        )

    def hashes(self, value: Any, index: int) -> list[BlockHash]:
        if type(value) is not list:
            raise EventFormatError(
                f"{_where(index, 'block_hashes')}: expected an array, got {_short(value)}"
            )
        if not value:
            return value
        if self.typed:
            # The common case, checked in C: msgspec already made every hash an int or bytes,
            # and unsigned ints pass through as they are.
            try:
                if min(value) >= 0:
                    return value
            except TypeError:  # bytes
                digests: list[BlockHash] | None
                if self.hex_bytes:
                    try:
                        digests = [h.hex() for h in value]
                    except AttributeError:  # ints among them
                        digests = None
                else:
                    digests = digest_keys(value, head=False)  # type: ignore[assignment]
                if digests is not None:
                    return digests
        return [self.hash(h, index, f"block_hashes[{i}]") for i, h in enumerate(value)]

    def keys(self, value: list[Any]) -> list[int] | None:
        """The normalized keys of msgspec-checked hashes (ints and bytes); None when a digest
        makes no key (the event then goes the event path, for the consumer to reject)."""
        try:
            if min(value) >= 0:
                return value  # all ints below 2**64
            return [h & _M64 for h in value]
        except TypeError:  # bytes among them
            pass
        keys = digest_keys(value, head=self.hex_bytes)
        if keys is not None:
            return keys
        out: list[int] = []
        for h in value:
            if type(h) is int:
                out.append(h & _M64)
            elif not self.hex_bytes:
                out.append(int.from_bytes(h[-8:], "big"))
            elif 0 < len(h) <= 32:  # its hex digest normalizes to its first 8 bytes
                out.append(int.from_bytes(h[:8], "big"))
            else:
                return None
        return out

    def stored_keys(self, ev: _InStoredNoTokens, index: int) -> None:
        """Emit one stored event as a keyed record (see :func:`decode_vllm_keys`)."""
        raw = ev.block_hashes
        if ev.parent_block_hash is not None:
            self.hash(ev.parent_block_hash, index, "parent_block_hash")
        level = self.tier(ev.medium, index) or 0
        if not raw:
            return
        keys = self.keys(raw)
        if keys is None:
            self.stored(raw, ev.parent_block_hash, (), ev.block_size, ev.lora_id, ev.medium,
                        ev.group_idx, ev.kv_cache_spec_sliding_window, index)
            return
        # The first block's token count, as stored() would cut token_ids into blocks.
        size, first = ev.block_size, 0
        n_tokens = _array_length(ev.token_ids) if size else 0
        if size and n_tokens:
            n = len(keys)
            if n == 1 and n_tokens <= size:
                first = n_tokens
            else:
                base = max(0, -(-n_tokens // size) - n) * size
                first = max(0, min(size, n_tokens - base))
        self.out.append(
            StoredKeys(self.next_id, keys, level, ev.group_idx or 0, self.algo, self.rank, first)
        )
        self.next_id += 1

    def stored_tokens(self, ev: _InStored, index: int) -> None:
        """Emit one stored event as a record with its tokens (see :func:`decode_vllm_keys`)."""
        tokens = ev.token_ids
        cut = self._record_cut(ev, index, len(tokens))
        if cut is None:
            return
        if cut:
            base, end = cut[0], cut[1]
            try:
                data = token_bytes(tokens[base:end] if base or end < len(tokens) else tokens)
            except ValueError:  # an id outside u32: the event path names it
                pass
            else:
                self._record(ev, cut, data)
                return
        self.stored(ev.block_hashes, ev.parent_block_hash, tokens, ev.block_size, ev.lora_id,
                    ev.medium, ev.group_idx, ev.kv_cache_spec_sliding_window, index)

    def stored_token_bytes(self, ev: _InStoredNoTokens, index: int, tokens: bytes) -> None:
        """:meth:`stored_tokens` of an event whose token ids were read already: ``tokens``,
        u32 little-endian (checked in ``[0, 2**32)``)."""
        cut = self._record_cut(ev, index, len(tokens) // 4)
        if cut is None:
            return
        if cut:
            base, end = 4 * cut[0], 4 * cut[1]
            self._record(ev, cut, tokens[base:end] if base or end < len(tokens) else tokens)
            return
        self.stored(ev.block_hashes, ev.parent_block_hash, tuple(array("I", tokens)),
                    ev.block_size, ev.lora_id, ev.medium, ev.group_idx,
                    ev.kv_cache_spec_sliding_window, index)

    def _record_cut(
        self, ev: _InStored | _InStoredNoTokens, index: int, n_tokens: int
    ) -> tuple[int, int, list[int], int | None, int] | tuple[()] | None:
        """What a stored event's :class:`StoredTokens` record needs: (first, end) token
        positions of its blocks, its keys, its parent's key and its tier; () when it cannot be
        a record (the event path takes it); None when it names no block (nothing to emit)."""
        raw, parent = ev.block_hashes, ev.parent_block_hash
        if parent is not None:
            self.hash(parent, index, "parent_block_hash")
        level = self.tier(ev.medium, index) or 0
        if not raw:
            return None
        keys = self.keys(raw)
        parent_keys = [] if parent is None else self.keys([parent])
        size, n = ev.block_size or 0, len(raw)
        # Cut as stored() cuts, aligned to the last block; a record needs tokens in every block.
        base = max(0, -(-n_tokens // size) - n) * size if size else 0
        if (keys is None or parent_keys is None or not size
                or base + (n - 1) * size >= n_tokens):
            return ()
        return base, base + n * size, keys, parent_keys[0] if parent_keys else None, level

    def _record(self, ev: _InStored | _InStoredNoTokens,
                cut: tuple[int, int, list[int], int | None, int], tokens: bytes) -> None:
        self.out.append(StoredTokens(
            self.next_id, cut[2], tokens, ev.block_size or 0, cut[3], ev.lora_id, cut[4],
            ev.group_idx or 0, self.algo, self.rank,
        ))
        self.next_id += 1

    def removed_keys(
        self, raw: list[int | bytes], medium: Any, group: int | None, index: int
    ) -> None:
        """Emit one removed event as a keyed record (see :func:`decode_vllm_keys`)."""
        tier = self.tier(medium, index)
        if not raw:
            return
        keys = self.keys(raw)
        if keys is None:
            self.removed(raw, medium, group, index)
            return
        self.out.append(RemovedKeys(self.next_id, keys, tier, group or 0, self.algo, self.rank))
        self.next_id += 1

    @staticmethod
    def tier(medium: Any, index: int) -> int | None:
        if medium is None:
            return None
        tier = TIER_OF_MEDIUM.get(medium) if type(medium) is str else None
        if tier is None:
            raise EventFormatError(f"{_where(index, 'medium')}: unknown medium {medium!r}")
        return tier

    @staticmethod
    def check_int(value: Any, field: str, index: int) -> int:
        """A non-negative int, or 0 for nil."""
        if value is None:
            return 0
        if type(value) is not int or value < 0:
            raise EventFormatError(
                f"{_where(index, field)}: expected an int >= 0 or nil, got {value!r}"
            )
        return value

    def generic(self, raw: Any, index: int) -> None:
        if isinstance(raw, dict):
            kind = raw.get("type")
            fields = raw
        elif isinstance(raw, list) and raw:
            kind = raw[0]
            if kind == "BlockStored" and not 6 <= len(raw) <= 12:
                raise EventFormatError(
                    f"{_where(index)}: positional BlockStored has {len(raw)} elements, "
                    "expected 6 to 12"
                )
            if kind == "BlockRemoved" and not 2 <= len(raw) <= 4:
                raise EventFormatError(
                    f"{_where(index)}: positional BlockRemoved has {len(raw)} elements, "
                    "expected 2 to 4"
                )
            names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
            fields = dict(zip(names, raw[1:], strict=False))
        else:
            raise EventFormatError(
                f"{_where(index)}: expected a map or an array, got {_short(raw)}"
            )
        if kind == "BlockStored":
            tokens = fields.get("token_ids")
            if tokens is None:
                tokens = ()
            elif not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise EventFormatError(
                    f"{_where(index, 'token_ids')}: expected an array of ints, got {_short(tokens)}"
                )
            lora = fields.get("lora_id")
            if lora is not None and type(lora) is not int:
                raise EventFormatError(
                    f"{_where(index, 'lora_id')}: expected an int or nil, got {lora!r}"
                )
            self.stored(
                fields.get("block_hashes"),
                fields.get("parent_block_hash"),
                tuple(tokens),
                self.check_int(fields.get("block_size"), "block_size", index),
                lora,
                fields.get("medium"),
                self.check_int(fields.get("group_idx"), "group_idx", index),
                self.check_int(
                    fields.get("kv_cache_spec_sliding_window"),
                    "kv_cache_spec_sliding_window",
                    index,
                ),
                index,
            )
        elif kind == "BlockRemoved":
            group = self.check_int(fields.get("group_idx"), "group_idx", index)
            self.removed(fields.get("block_hashes"), fields.get("medium"), group, index)
        elif kind == "AllBlocksCleared":
            self.emit(AllCleared(), 0, 0)
        else:
            raise EventFormatError(f"{_where(index)}: unknown event type {kind!r}")

    def stored(
        self,
        raw_hashes: Any,
        raw_parent: Any,
        tokens: tuple[int, ...],
        size: int | None,
        lora: int | None,
        medium: Any,
        group: int | None,
        window: int | None,
        index: int,
    ) -> None:
        """Emit one stored event; ints arrive checked (by msgspec or by :meth:`generic`)."""
        hashes = self.hashes(raw_hashes, index)
        n = len(hashes)
        parent = None if raw_parent is None else self.hash(raw_parent, index, "parent_block_hash")
        level = self.tier(medium, index) or 0
        if n == 0:
            return
        chunks: Iterable[tuple[int, ...]]
        if size and tokens:
            n_tokens = len(tokens)
            if n == 1 and n_tokens <= size:
                chunks = (tokens,)
            else:
                # Align to the last block: token_ids may span more blocks than hashes name.
                base = max(0, -(-n_tokens // size) - n) * size
                chunks = map(tokens.__getitem__, _block_slices(base, size, n))
        else:
            chunks = repeat((), n)
        # Built in C (map over the columns): no bytecode runs per block.
        blocks = tuple(
            list(map(StoredBlock, hashes, chunks, repeat(level), repeat(DEFAULT_PRIORITY),
                     repeat(lora)))
        )
        self.emit(Stored(parent, blocks), group or 0, window or 0)

    def removed(self, raw_hashes: Any, medium: Any, group: int | None, index: int) -> None:
        hashes = self.hashes(raw_hashes, index)
        tier = self.tier(medium, index)
        if not hashes:
            return
        levels = None if tier is None else (tier,) * len(hashes)
        self.emit(Removed(tuple(hashes), levels), group or 0, 0)


_SLICES: dict[tuple[int, int, int], tuple[slice, ...]] = {}


def _block_slices(base: int, size: int, n: int) -> tuple[slice, ...]:
    """The slices that cut ``n`` blocks of ``size`` tokens from ``base`` (cached: a stream
    repeats a few chain lengths)."""
    key = (base, size, n)
    slices = _SLICES.get(key)
    if slices is None:
        if len(_SLICES) >= 4096:
            _SLICES.clear()
        slices = _SLICES[key] = tuple(
            [slice(base + i * size, base + (i + 1) * size) for i in range(n)]
        )
    return slices


def _array_length(raw: msgspec.Raw) -> int:
    """Elements of the msgpack array in ``raw`` (0 for nil, absent or not an array)."""
    view = memoryview(raw)
    if not view:
        return 0
    head = view[0]
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F
    if head == 0xDC:  # array 16
        return int.from_bytes(view[1:3], "big")
    if head == 0xDD:  # array 32
        return int.from_bytes(view[1:5], "big")
    return 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
