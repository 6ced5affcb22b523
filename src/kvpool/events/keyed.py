"""Keyed events: the one record a hash-keyed consumer (the router's index) applies.

The router's index keys every block by an unsigned 64-bit int (:func:`normalize_hash`) and reads
neither priorities, windows nor multimodal keys. Every source of events converts each event once,
where it enters, into one :class:`KeyedEvent`: the wire decoders' keyed paths
(:func:`~kvpool.events.vllm_msgpack.decode_vllm_keys`,
:func:`~kvpool.events.trtllm_json.parse_trtllm_keys`) build records straight from the wire, with
no object per block, and :func:`keyed` converts a :class:`~kvpool.events.model.KVCacheEvent`
(an in-process source's, or one a decoder built on its checking path). The consumer then has one
shape to apply; what each operation means:

* :data:`STORED`: +1 reference per key, on ``cache_level`` (or per key on ``levels``); a record
  with no key changes nothing (a priority-only update, a chain whose blocks all went to the
  shared tier) but its id still counts;
* :data:`REMOVED`: -1 reference per key on ``cache_level`` (per key on ``levels``), or on every
  tier that holds it when both are None (TensorRT-LLM);
* :data:`MOVED`: the one key moves from ``from_level`` to ``cache_level``;
* :data:`CLEARED`: the worker holds nothing; :data:`CREATED`: a layer group's pools came up
  (``capacity``: slots per cache level);
* :data:`MALFORMED`: an event that cannot be applied (a hash that does not normalize, a tier
  out of range, bad token ids for a consumer that reads them): its id counts as seen, nothing
  else; with layer group -1 (not an event at all) not even that.

A consumer that keys blocks by their tokens (``match_by_tokens``) reads stored records with
``tokens``, ``parent`` and ``lora_id``; :func:`keyed` fills them with ``tokens=True``.

Records are built from validated input and are not checked again: ``keys`` are ints in ``[0,
2**64)``, tiers are 0, 1, 2 or :data:`~kvpool.events.model.REMOTE_CACHE_LEVEL` (3, which the
router's shared tier takes out before its index sees the record), ``tokens`` hold one byte
string per key.
"""

from __future__ import annotations

import binascii
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import starmap
from typing import Any, Final, final

import msgspec

from kvpool.events.model import (
    REMOTE_CACHE_LEVEL,
    AllCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    TokenIds,
    Updated,
)

__all__ = [
    "CLEARED",
    "CREATED",
    "MALFORMED",
    "MOVED",
    "REMOVED",
    "STORED",
    "KeyedEvent",
    "cut_blocks",
    "digest_keys",
    "hex_keys",
    "keyed",
    "keyed_events",
    "normalize_hash",
    "normalize_hashes",
    "one_tier",
    "token_bytes",
]

_M64: Final = (1 << 64) - 1
_SWAP: Final = sys.byteorder == "little"  # keys are read big-endian

STORED: Final = "stored"
REMOVED: Final = "removed"
MOVED: Final = "moved"
CLEARED: Final = "cleared"
CREATED: Final = "created"
MALFORMED: Final = "malformed"


@final
class KeyedEvent(msgspec.Struct, gc=False):
    """One event as a hash-keyed consumer applies it (``op``: see the module docstring).

    ``keys`` are the blocks' normalized hashes, in chain order for a stored chain.
    ``cache_level`` is the tier of every key; None with ``levels`` (one tier per key, mixed),
    or on a removal without either, every tier. ``block_tokens`` is the token count of a stored
    chain's first block (its longest: only a chain's last block may be partial), 0 when
    unknown; ``block_size`` the block size the event names (vLLM's ``block_size``), 0 when it
    names none.

    ``tokens`` (a stored record for a consumer that keys blocks by their tokens) holds each
    block's token ids as unsigned 32-bit little-endian ints (:func:`token_bytes`), one byte
    string per key; an empty one is a block re-announced by its hash alone, and no byte string
    at all (``()``) announces every block so. ``parent`` is the normalized key of the block the
    chain continues, None when it starts the reuse scope of ``lora_id``.
    """

    event_id: int
    op: str
    keys: list[int]
    cache_level: int | None = 0
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None
    block_tokens: int = 0
    block_size: int = 0
    tokens: tuple[bytes, ...] = ()
    parent: int | None = None
    lora_id: int | None = None
    levels: list[int] | None = None
    from_level: int = 0
    capacity: tuple[int, ...] = ()


class _Bad(Exception):
    """An event :func:`keyed` cannot convert: it becomes a :data:`MALFORMED` record."""


def keyed(event: object, tokens: bool = False) -> KeyedEvent:
    """``event`` as the record a hash-keyed consumer applies (a record is returned as it is).

    ``tokens``: the consumer keys blocks by their tokens (a stored chain's token ids, parent and
    LoRA id are carried, and token ids outside ``[0, 2**32)`` make the event malformed); else
    only the first block's token count is read. An event that cannot be applied (see
    :data:`MALFORMED`) becomes a malformed record, never an error.
    """
    if type(event) is KeyedEvent:
        return event
    if not isinstance(event, KVCacheEvent):
        return KeyedEvent(-1, MALFORMED, [], 0, -1)
    head = (event.layer_group_id, event.hash_algo, event.attention_dp_rank)
    eid, data = event.event_id, event.data
    kind = type(data)
    try:
        if kind is Stored:
            return _stored(eid, head, data, tokens)  # type: ignore[arg-type]
        if kind is Removed:
            return _removed(eid, head, data)  # type: ignore[arg-type]
        if kind is Updated:
            return _updated(eid, head, data)  # type: ignore[arg-type]
        if kind is AllCleared:
            return KeyedEvent(eid, CLEARED, [], 0, *head)
        if kind is Created:
            levels = data.num_blocks_per_cache_level  # type: ignore[union-attr]
            if not all(type(n) is int and n >= 0 for n in levels):
                raise _Bad
            return KeyedEvent(eid, CREATED, [], 0, *head, capacity=tuple(levels))
    except (_Bad, ValueError, TypeError, AttributeError):
        pass
    return KeyedEvent(eid, MALFORMED, [], 0, *head)


def keyed_events(events: Iterable[object], tokens: bool = False) -> list[KeyedEvent]:
    """:func:`keyed` of every event, in order."""
    return [keyed(e, tokens) for e in events]


def one_tier(levels: Sequence[Any]) -> tuple[int | None, list[int] | None]:
    """(``cache_level``, ``levels``) of a record whose keys sit on ``levels``: one tier for all
    (usual), or None and the list. All 0 or None count as tier 0; otherwise every level must
    be a tier (up to the remote level). Raises :class:`ValueError` when one is not."""
    if not any(levels):
        return 0, None
    if not all(type(t) is int and 0 <= t <= REMOTE_CACHE_LEVEL for t in levels):
        raise ValueError(f"cache levels {levels!r} out of range")
    first = levels[0]
    if levels.count(first) == len(levels):
        return first, None
    return None, list(levels)


_Head = tuple[Any, Any, Any]  # (layer group, hash algorithm, attention-DP rank), unchecked


def _stored(eid: int, head: _Head, data: Stored, tokens: bool) -> KeyedEvent:
    blocks = data.blocks
    if not blocks:
        return KeyedEvent(eid, STORED, [], 0, *head)
    keys = normalize_hashes([b.block_hash for b in blocks])
    level, levels = one_tier([b.cache_level for b in blocks])
    try:
        first = len(blocks[0].tokens)
    except TypeError:
        first = 0
    if not tokens:
        return KeyedEvent(eid, STORED, keys, level, *head, first, levels=levels)
    parent = None if data.parent_hash is None else normalize_hash(data.parent_hash)
    return KeyedEvent(eid, STORED, keys, level, *head, first, 0,
                      _blocks_bytes([b.tokens for b in blocks]), parent, blocks[0].lora_id,
                      levels)


def _blocks_bytes(ids: list[Sequence[int]]) -> tuple[bytes, ...]:
    """Each block's token ids as :func:`token_bytes`, packed in C (no bytecode per token)."""
    if _SWAP and set(map(type, ids)) == {TokenIds}:  # a kvpool manager's: their bytes as they are
        return tuple(map(TokenIds.tobytes, ids))  # type: ignore[arg-type]
    sizes = list(map(len, ids))
    *full, last = ids
    try:
        if sizes[:-1].count(sizes[0]) == len(full):  # full blocks, the last one maybe partial
            return (*starmap(_packer(sizes[0]), full), _packer(sizes[-1])(*last))
        return tuple([_packer(n)(*t) for n, t in zip(sizes, ids, strict=True)])
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None


def cut_blocks(raw: bytes, block_size: int) -> tuple[bytes, ...]:
    """``raw`` (token ids as :func:`token_bytes`) cut into blocks of ``block_size`` ids, the
    last one maybe fewer, in one C call: no Python-level slice per block."""
    step = 4 * block_size
    n, tail = divmod(len(raw), step)
    return _cutter(step, n, tail)(raw)


@lru_cache(maxsize=1024)
def _cutter(step: int, n: int, tail: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Cuts ``n * step + tail`` bytes into ``n`` pieces of ``step`` bytes and a ``tail``."""
    return struct.Struct(f"{step}s" * n + (f"{tail}s" if tail else "")).unpack


@lru_cache(maxsize=256)
def _packer(size: int) -> Callable[..., bytes]:
    """Packs ``size`` token ids as u32 LE (:class:`struct.error` unless all are in
    ``[0, 2**32)``)."""
    return struct.Struct(f"<{size}I").pack


def _removed(eid: int, head: _Head, data: Removed) -> KeyedEvent:
    hashes, tiers = data.block_hashes, data.cache_levels
    keys = normalize_hashes(hashes)
    level: int | None = None
    levels: list[int] | None = None
    if tiers is not None:
        if len(tiers) != len(hashes):
            raise _Bad
        level, levels = one_tier(tiers)
    return KeyedEvent(eid, REMOVED, keys, level, *head, levels=levels)


def _updated(eid: int, head: _Head, data: Updated) -> KeyedEvent:
    diff = data.cache_level
    if diff is None:
        return KeyedEvent(eid, STORED, [], 0, *head)  # priority only: nothing a consumer keys
    if type(diff) is not EventDiff:
        raise _Bad
    old, new = diff.old_value, diff.new_value
    if not (type(old) is int and type(new) is int and 0 <= old <= REMOTE_CACHE_LEVEL
            and 0 <= new <= REMOTE_CACHE_LEVEL):
        raise _Bad
    return KeyedEvent(eid, MOVED, [normalize_hash(data.block_hash)], new, *head, from_level=old)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian ints, back to back (one conversion in C).

    Raises :class:`ValueError` unless every id is an int in ``[0, 2**32)``.
    """
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None


def normalize_hash(value: object) -> int:
    """Map an event's block hash to its key, an unsigned 64-bit int.

    Ints are taken modulo 2**64 (engines that used Python's signed ``hash()`` map consistently);
    ``v2_sha256`` hex digests keep their first 8 bytes, big-endian, which equals the
    ``v2_sha256_64`` encoding of the same block; raw digests (bytes) keep their last 8 bytes,
    big-endian, as vLLM's event ids do. Anything else raises :class:`ValueError`.
    """
    if type(value) is int:
        return value & _M64
    if isinstance(value, str):
        if not value or len(value) > 64:
            raise ValueError(f"block hash {value!r} is not a hex digest")
        return int(value[:16], 16)  # ValueError for non-hex text
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError("block hash is empty bytes")
        return int.from_bytes(value[-8:], "big")
    raise ValueError(f"block hash {value!r} ({type(value).__name__}) is not an int, str or bytes")


def normalize_hashes(raw: Sequence[Any]) -> list[int]:
    """:func:`normalize_hash` of every hash, in C loops for the usual lists (all ints, or all
    64-character hex digests). Raises :class:`ValueError` like :func:`normalize_hash`."""
    try:
        return [h & _M64 for h in raw]  # str & int and float & int raise TypeError
    except TypeError:
        pass
    keys = hex_keys(raw)
    if keys is None:
        keys = [h & _M64 if type(h) is int else normalize_hash(h) for h in raw]
    return keys


def hex_keys(raw: Sequence[Any]) -> list[int] | None:
    """Keys of hex digests (their first 8 bytes, as :func:`normalize_hash` reads them), or
    None unless every hash is a str that normalizes."""
    try:
        joined = "".join(raw)
        longest = max(map(len, raw))
    except (TypeError, ValueError):  # not all str, or no hash at all
        return None
    n = len(raw)
    if longest == 64 and len(joined) == 64 * n:  # all 64 characters: full sha256 digests
        try:
            return _words(binascii.unhexlify(joined), 4, 0)
        except ValueError:  # not hex somewhere: per hash, as normalize_hash reads them
            pass
    if longest > 64:
        return None
    try:
        return [int(h[:16], 16) for h in raw]
    except ValueError:
        return None


def digest_keys(raw: Sequence[Any], *, head: bool) -> list[int] | None:
    """Keys of raw digests (bytes) that all have one length, a multiple of 8 (at most 32 with
    ``head``): the first 8 bytes, big-endian, with ``head``, else the last 8. None when the list
    is anything else (the caller converts hash by hash)."""
    try:
        joined = b"".join(raw)
    except TypeError:  # not all bytes
        return None
    n = len(raw)
    size = len(joined) // n if n else 0
    if not size or size % 8 or (head and size > 32) or len(joined) != size * n:
        return None
    if max(map(len, raw)) != size:  # equal total and no longer one: all of one length
        return None
    words = size // 8
    return _words(joined, words, 0 if head else words - 1)


def _words(data: bytes, step: int, first: int) -> list[int]:
    arr = array("Q", data)
    if _SWAP:
        arr.byteswap()
    return arr[first::step].tolist()
