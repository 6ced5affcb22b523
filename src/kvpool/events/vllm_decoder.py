"""The decoder behind :mod:`kvpool.events.vllm_msgpack`: one batch's wire events, read by the
typed structs or generically, into kvpool events (:class:`BatchDecoder`) or keyed records
(:class:`KeyedBatchDecoder`).

Every check names the event and field at fault; error locations are built only when an error
is raised (this is a hot path).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import repeat
from typing import Any, cast

import msgspec

from kvpool.errors import EventFormatError
from kvpool.events.keyed import (
    REMOVED,
    STORED,
    KeyedEvent,
    cut_blocks,
    digest_keys,
    keyed,
    token_bytes,
)
from kvpool.events.model import (
    DEFAULT_PRIORITY,
    AllCleared,
    BlockHash,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
)
from kvpool.events.vllm_wire import (
    M64,
    REMOVED_FIELDS,
    STORED_FIELDS,
    TIER_OF_MEDIUM,
    V2_SHA256,
    InRemoved,
    InStored,
    InStoredNoTokens,
)

__all__ = ["BatchDecoder", "KeyedBatchDecoder", "short_repr"]


def _where(index: int, field: str = "") -> str:
    return f"event {index}.{field}" if field else f"event {index}"


class BatchDecoder:
    """Turns one batch's wire events into kvpool events (shared by both decoding paths).

    Error locations are built only when an error is raised: this is a hot path.
    """

    __slots__ = ("algo", "hex_bytes", "next_id", "out", "rank", "typed")

    def __init__(self, algo: str, first_event_id: int, rank: int | None, typed: bool) -> None:
        self.typed = typed
        self.algo = algo
        self.hex_bytes = algo == V2_SHA256
        self.next_id = first_event_id
        self.rank = rank
        self.out: list[Any] = []

    def events(self) -> list[KVCacheEvent]:
        """What was emitted (kvpool events)."""
        return cast(list[KVCacheEvent], self.out)

    def emit(self, data: Stored | Removed | AllCleared, group: int, window: int) -> None:
        self.out.append(KVCacheEvent(self.next_id, data, window, group, self.algo, self.rank))
        self.next_id += 1

    def hash(self, value: Any, index: int, field: str) -> BlockHash:
        if type(value) is int:
            return value & M64 if value < 0 else value
        if type(value) is bytes:
            return value.hex() if self.hex_bytes else int.from_bytes(value[-8:], "big")
        raise EventFormatError(
            f"{_where(index, field)}: a block hash must be an int or bytes, got {value!r}"
        )

    def hashes(self, value: Any, index: int) -> list[BlockHash]:
        if type(value) is not list:
            raise EventFormatError(
                f"{_where(index, 'block_hashes')}: expected an array, got {short_repr(value)}"
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
            names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS
            fields = dict(zip(names, raw[1:], strict=False))
        else:
            raise EventFormatError(
                f"{_where(index)}: expected a map or an array, got {short_repr(raw)}"
            )
        if kind == "BlockStored":
            tokens = fields.get("token_ids")
            if tokens is None:
                tokens = ()
            elif not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise EventFormatError(
                    f"{_where(index, 'token_ids')}: expected an array of ints, "
                    f"got {short_repr(tokens)}"
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



class KeyedBatchDecoder(BatchDecoder):
    """Turns one batch's wire events into keyed records
    (:func:`~kvpool.events.vllm_msgpack.decode_vllm_keys`): stored and removed events straight
    from the wire, with no object per block; what only the event path reads (positional
    events, hashes that make no key, token ids a record cannot carry as they are) is built as
    an event and converted (:func:`~kvpool.events.keyed.keyed`).

    ``tokens``: the consumer keys blocks by their tokens (stored records carry them).
    """

    __slots__ = ("tokens",)

    def __init__(self, algo: str, first_event_id: int, rank: int | None, typed: bool,
                 tokens: bool) -> None:
        super().__init__(algo, first_event_id, rank, typed)
        self.tokens = tokens

    def records(self) -> list[KeyedEvent]:
        """What was emitted (keyed records)."""
        return cast(list[KeyedEvent], self.out)

    def typed_events(
        self, events: list[Any], read: tuple[bytes, list[int]] | None = None
    ) -> list[KeyedEvent]:
        """The records of a batch's typed wire events. ``read``: every stored event's token
        ids already read (u32 little-endian, back to back, and each non-empty array's length),
        for the stored events without tokens that the kernel read them for."""
        data, lengths = read if read is not None else (b"", [])
        k = off = 0
        for index, ev in enumerate(events):
            kind = type(ev)
            if kind is InStoredNoTokens:
                if read is None:
                    self.stored_keys(ev, index)
                    continue
                n_tokens = 0
                if ev.token_ids:
                    n_tokens = lengths[k]
                    k += 1
                self.stored_token_bytes(ev, index, data[4 * off:4 * (off + n_tokens)])
                off += n_tokens
            elif kind is InStored:
                self.stored_tokens(ev, index)
            elif kind is InRemoved:
                self.removed_keys(ev.block_hashes, ev.medium, ev.group_idx, index)
            else:
                self.emit(AllCleared(), 0, 0)
        return self.records()

    def emit(self, data: Stored | Removed | AllCleared, group: int, window: int) -> None:
        event = KVCacheEvent(self.next_id, data, window, group, self.algo, self.rank)
        self.out.append(keyed(event, self.tokens))
        self.next_id += 1

    def keys(self, value: list[Any]) -> list[int] | None:
        """The normalized keys of msgspec-checked hashes (ints and bytes); None when a digest
        makes no key (the event then goes the event path, for the consumer to reject)."""
        try:
            if min(value) >= 0:
                return value  # all ints below 2**64
            return [h & M64 for h in value]
        except TypeError:  # bytes among them
            pass
        keys = digest_keys(value, head=self.hex_bytes)
        if keys is not None:
            return keys
        out: list[int] = []
        for h in value:
            if type(h) is int:
                out.append(h & M64)
            elif not self.hex_bytes:
                out.append(int.from_bytes(h[-8:], "big"))
            elif 0 < len(h) <= 32:  # its hex digest normalizes to its first 8 bytes
                out.append(int.from_bytes(h[:8], "big"))
            else:
                return None
        return out

    def stored_keys(self, ev: InStoredNoTokens, index: int) -> None:
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
        self.out.append(KeyedEvent(self.next_id, STORED, keys, level, ev.group_idx or 0,
                                   self.algo, self.rank, first))
        self.next_id += 1

    def stored_tokens(self, ev: InStored, index: int) -> None:
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

    def stored_token_bytes(self, ev: InStoredNoTokens, index: int, tokens: bytes) -> None:
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
        self, ev: InStored | InStoredNoTokens, index: int, n_tokens: int
    ) -> tuple[int, int, list[int], int | None, int] | tuple[()] | None:
        """What a stored event's record with tokens needs: (first, end) token
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

    def _record(self, ev: InStored | InStoredNoTokens,
                cut: tuple[int, int, list[int], int | None, int], tokens: bytes) -> None:
        size = ev.block_size or 0
        self.out.append(KeyedEvent(
            self.next_id, STORED, cut[2], cut[4], ev.group_idx or 0, self.algo, self.rank,
            min(size, len(tokens) // 4), size, cut_blocks(tokens, size), cut[3], ev.lora_id,
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
        self.out.append(KeyedEvent(self.next_id, REMOVED, keys, tier, group or 0, self.algo,
                                   self.rank))
        self.next_id += 1


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


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
