"""kvpool events -> one vLLM KV event batch in msgpack (COMPATIBILITY §3).

:func:`encode_vllm_batch` writes the map form current vLLM writes; the mapping from kvpool
events (tiers to media, layer groups to ``group_idx``, runs of blocks, tier moves as a removal
and a placeholder) is described in :mod:`kvpool.events.vllm_msgpack`.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Collection, Iterable, Sequence
from typing import Final

import msgspec

from kvpool.errors import InvalidArgumentError
from kvpool.events.model import (
    AllCleared,
    BlockHash,
    KVCacheEvent,
    Removed,
    Stored,
    TokenIds,
    Updated,
)
from kvpool.events.vllm_wire import (
    M64,
    MEDIUM_OF_TIER,
    OutBatch,
    OutCleared,
    OutEvent,
    OutRemoved,
    OutStored,
    WireHash,
)
from kvpool.hashing import jit

__all__ = ["encode_vllm_batch", "whole_blocks"]

_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_vllm_batch(
    events: Iterable[KVCacheEvent],
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    *,
    block_size: int | None = None,
    sliding_window_groups: Collection[int] = (),
    partial_blocks: bool = False,
    state_groups: Collection[int] = (),
) -> bytes:
    """One vLLM event batch (the ZMQ payload) holding ``events``.

    Args:
        events: kvpool events, in order.
        ts: the batch timestamp (seconds); now when None.
        data_parallel_rank: written as the batch's third element.
        block_size: tokens per block; when None each stored event writes its longest block's
            token count (its full-block size unless every block is partial).
        sliding_window_groups: layer groups whose stored events carry their window size.
        state_groups: recurrent-state layer groups (hybrid models, docs/hybrid.md): their
            stored events (checkpoints) carry ``kv_cache_spec_kind="mamba"``, vLLM's kind
            for a state group.
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
    wire: list[OutEvent] = []
    append = wire.append
    for event in events:
        data = event.data
        kind = type(data)
        if kind is Stored:
            if not partial_blocks:
                data = whole_blocks(data, block_size)  # type: ignore[arg-type]
            _encode_stored(data, event, block_size, sliding_window_groups, wire,  # type: ignore[arg-type]
                           state_groups)
        elif kind is Removed:
            _encode_removed(data, event.layer_group_id or None, wire)  # type: ignore[arg-type]
        elif kind is Updated:
            diff = data.cache_level  # type: ignore[union-attr]
            if diff is not None and diff.old_value != diff.new_value:
                group = event.layer_group_id or None
                h = _wire_hash(data.block_hash)  # type: ignore[union-attr]
                append(OutRemoved([h], _medium(diff.old_value), group))
                append(
                    OutStored([h], None, [], 0, None, _medium(diff.new_value), None, None, group)
                )
        elif kind is AllCleared:
            append(_ALL_CLEARED)
    batch = OutBatch(time.time() if ts is None else float(ts), wire, data_parallel_rank)
    try:
        return _ENCODER.encode(batch)
    except (OverflowError, TypeError) as exc:  # an int hash above u64 (or an id past msgpack)
        raise InvalidArgumentError(
            f"KV event batch cannot be encoded (block hashes must be unsigned 64-bit ints or "
            f"hex strings): {exc}"
        ) from None


_ALL_CLEARED: Final = OutCleared()


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
        if not 0 <= h <= M64:
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
    wire: list[OutEvent],
    state: Collection[int] = (),
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
    elif state and event.layer_group_id in state:
        kind = "mamba"
    parent = None if data.parent_hash is None else _wire_hash(data.parent_hash)
    for hashes, tokens, level, lora in runs:
        wire_hashes = _wire_hashes(hashes)
        wire.append(
            OutStored(
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


def _encode_removed(data: Removed, group: int | None, wire: list[OutEvent]) -> None:
    hashes, levels = data.block_hashes, data.cache_levels
    if not hashes:
        return
    if levels is None:
        wire.append(OutRemoved(_wire_hashes(hashes), None, group))
        return
    if len(levels) != len(hashes):
        raise InvalidArgumentError(
            f"removed event has {len(hashes)} hashes but {len(levels)} cache levels"
        )
    first = levels[0]
    if levels.count(first) == len(levels):
        wire.append(OutRemoved(_wire_hashes(hashes), _medium(first), group))
        return
    # One BlockRemoved per tier, in order of first appearance.
    by_level: dict[int, list[WireHash]] = {}
    for h, level in zip(hashes, levels, strict=True):
        by_level.setdefault(level, []).append(_wire_hash(h))
    for level, level_hashes in by_level.items():
        wire.append(OutRemoved(level_hashes, _medium(level), group))

