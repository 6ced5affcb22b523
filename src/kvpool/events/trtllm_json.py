"""TensorRT-LLM's KV cache event JSON, shape for shape (COMPATIBILITY §2).

An event list serializes as::

    [{"event_id": 12, "data": {...}, "window_size": 4096,
      "attention_dp_rank": 0,            # only when set
      "hash_algo": "v1_block_key", "layer_group_id": 0}]

with ``data`` one of ``created``, ``stored`` (blocks of ``stored_block`` with ``unique_token``
tokens), ``removed`` or ``updated`` (``event_diff`` values). Hashes are ints (which may exceed
2**63) or, for ``v2_sha256``, 64-character hex strings. Two kvpool additions have no field in
TensorRT-LLM's JSON and are not written: a removed event's per-hash ``cache_levels`` and a stored
block's ``lora_id`` (both parse back as None). kvpool's all-cleared event, which TensorRT-LLM
does not emit, is written as ``{"type": "all_cleared"}``.

:func:`parse_trtllm_keys` parses the same lists for a consumer keyed by block hashes (the
router's index): token lists skipped, every event as a :class:`~kvpool.events.keyed.KeyedEvent`
record.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Annotated, Any, cast

import msgspec

from kvpool.errors import EventFormatError
from kvpool.events.decoding import format_errors
from kvpool.events.keyed import (
    REMOVED,
    STORED,
    KeyedEvent,
    hex_keys,
    keyed,
    keyed_events,
    normalize_hashes,
)
from kvpool.events.model import (
    DEFAULT_PRIORITY,
    AllCleared,
    BlockHash,
    Created,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "parse_trtllm_dicts",
    "parse_trtllm_json",
    "parse_trtllm_keys",
    "to_trtllm_dicts",
    "to_trtllm_json",
]

_M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------ encode


def to_trtllm_dicts(events: Iterable[KVCacheEvent]) -> list[dict[str, Any]]:
    """The JSON-ready objects of ``events`` (key order as TensorRT-LLM writes them)."""
    out: list[dict[str, Any]] = []
    for event in events:
        obj: dict[str, Any] = {
            "event_id": event.event_id,
            "data": _data_to_dict(event.data),
            "window_size": event.window_size,
        }
        if event.attention_dp_rank is not None:
            obj["attention_dp_rank"] = event.attention_dp_rank
        obj["hash_algo"] = event.hash_algo
        obj["layer_group_id"] = event.layer_group_id
        out.append(obj)
    return out


def to_trtllm_json(events: Iterable[KVCacheEvent]) -> str:
    """The JSON text of ``events``: a list, as ``POST /kv_cache_events`` returns it."""
    return msgspec.json.encode(to_trtllm_dicts(events)).decode()


def _diff(diff: EventDiff | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {"type": "event_diff", "new_value": diff.new_value, "old_value": diff.old_value}


def _data_to_dict(data: EventData) -> dict[str, Any]:
    if type(data) is Stored:
        return {
            "type": "stored",
            "parent_hash": data.parent_hash,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": b.block_hash,
                    "tokens": [
                        {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in b.tokens
                    ],
                    "cache_level": b.cache_level,
                    "priority": b.priority,
                    "mm_keys": list(b.mm_keys),
                }
                for b in data.blocks
            ],
        }
    if type(data) is Removed:
        return {"type": "removed", "block_hashes": list(data.block_hashes)}
    if type(data) is Updated:
        return {
            "type": "updated",
            "block_hash": data.block_hash,
            "cache_level": _diff(data.cache_level),
            "priority": _diff(data.priority),
        }
    if type(data) is Created:
        levels = list(data.num_blocks_per_cache_level)
        return {"type": "created", "num_blocks_per_cache_level": levels}
    assert type(data) is AllCleared
    return {"type": "all_cleared"}


# ------------------------------------------------------------------------------------ decode


@format_errors("KV event JSON")
def parse_trtllm_json(text: str | bytes, *, tokens: bool = True) -> list[KVCacheEvent]:
    """Parse an event list; raises :class:`EventFormatError` naming the first bad value.

    Well-formed input is decoded by typed msgspec structs in C; anything the typed shape
    rejects goes through the checking parser, which names the fault. With ``tokens=False``
    stored blocks carry no tokens and their token lists are neither read nor checked (a
    consumer keyed by block hashes parses several times faster).
    """
    typed = _decode_typed(text, tokens)
    if typed is not None:
        try:
            return [_from_typed(e, tokens) for e in typed]
        except _Fallback:
            pass
    return _parse_checked(text)


@format_errors("KV event JSON")
def parse_trtllm_keys(text: str | bytes) -> list[KeyedEvent]:
    """Parse an event list for a consumer keyed by block hashes (the router's index).

    The events mean what ``parse_trtllm_json(text, tokens=False)`` means to such a consumer
    (the same events, the same errors), each as one :class:`~kvpool.events.keyed.KeyedEvent`
    record: stored events whose blocks share one tier and removed events are read into records
    holding their blocks' normalized keys, with no object per block; the rest (blocks on mixed
    tiers, created, updated and all-cleared events, hashes that make no key) go through kvpool
    events and :func:`~kvpool.events.keyed.keyed`.
    """
    typed = _decode_typed(text, False)
    if typed is not None:
        try:
            return [_keyed(e) for e in cast(list[_JEventNoTokens], typed)]
        except _Fallback:
            pass
    return keyed_events(_parse_checked(text))


def _parse_checked(text: str | bytes) -> list[KVCacheEvent]:
    try:
        obj = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"KV event JSON does not parse: {exc}") from None
    return parse_trtllm_dicts(obj)


def _decode_typed(text: str | bytes, tokens: bool) -> list[_JEvent] | list[_JEventNoTokens] | None:
    """The typed decoding of ``text``, or None when the typed shape rejects it."""
    if not tokens:
        emptied = _without_token_lists(text)
        if emptied is not None:
            try:
                return _TYPED_NO_TOKENS.decode(emptied)
            except (msgspec.DecodeError, TypeError):
                pass  # a token list holding ']' (not TensorRT-LLM's) or garbage: as it is
    try:
        return (_TYPED if tokens else _TYPED_NO_TOKENS).decode(text)
    except (msgspec.DecodeError, TypeError):
        return None


_TOKENS_KEYS = (b'"tokens":[', b'"tokens": [')  # compact (TensorRT-LLM's server), spaced
# After a token list, TensorRT-LLM writes at least 83 bytes before the next block's list
# (cache level, priority, multimodal keys, the next block's type and hash): the search for it
# starts past _GAP bytes and looks within _NEAR bytes first. (A list these bounds miss is
# decoded whole, never cut wrong.)
_GAP = 64
_NEAR = 4096


def _without_token_lists(text: str | bytes) -> bytes | None:
    """``text`` with the content of every ``"tokens":[...]`` list cut out, or None when there is
    none.

    Token lists are most of TensorRT-LLM's JSON (about 55 bytes per token), and a consumer that
    does not read them would otherwise pay msgspec to scan them; finding each list's end is one
    ``memchr`` for ``]``. This is exact for valid JSON: the key's closing quote cannot be inside
    a string (it follows a letter, so it is not escaped), and if the first ``]`` after the key
    is not the one closing its list (it sits in a string, or closes a nested list), the text
    cut out holds an odd number of string quotes or an unclosed ``[``, so the result is not
    valid JSON and the caller decodes the text as it is. A result that is valid JSON differs
    from ``text`` only inside token lists, which such a consumer does not check.
    """
    if isinstance(text, str):
        try:
            text = text.encode()
        except UnicodeEncodeError:
            return None
    find = text.find
    for key in _TOKENS_KEYS:
        start = find(key)
        if start >= 0:
            break
    else:
        return None
    skip = len(key)
    parts: list[bytes] = []
    append = parts.append
    pos = 0
    while start >= 0:
        start += skip
        end = find(b"]", start)
        if end < 0:
            break
        append(text[pos:start])
        pos = end
        # Bounded first: on a long rest CPython prepares a costlier search algorithm.
        start = find(key, end + _GAP, end + _NEAR)
        if start < 0:
            start = find(key, end + _GAP)
    append(text[pos:])
    return b"".join(parts)


class _Fallback(Exception):
    """The typed shape decoded, but a value needs the checking parser (e.g. a hash > u64)."""


_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec itself rejects ints beyond u64
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_JHash = _U64 | str


class _JToken(msgspec.Struct, gc=False):
    token_id: _NonNegative


class _JMmKey(msgspec.Struct, gc=False):
    hash: str


class _JDiff(msgspec.Struct, gc=False):
    old_value: int
    new_value: int


class _JBlock(msgspec.Struct, gc=False):
    block_hash: _JHash
    tokens: list[_JToken | _NonNegative] = []
    cache_level: int = 0
    priority: int = DEFAULT_PRIORITY
    lora_id: int | None = None
    mm_keys: list[_JMmKey | str] = []


class _JBlockNoTokens(msgspec.Struct, gc=False):
    # No tokens field: skipped as an unknown key, any value accepted (and no object built).
    # mm_keys as a tuple: the usual empty one is a singleton, not a new list per block.
    block_hash: _JHash
    cache_level: int = 0
    priority: int = DEFAULT_PRIORITY
    lora_id: int | None = None
    mm_keys: tuple[_JMmKey | str, ...] = ()


class _JCreated(msgspec.Struct, tag="created", tag_field="type", gc=False):
    num_blocks_per_cache_level: list[int]


class _JStored(msgspec.Struct, tag="stored", tag_field="type", gc=False):
    blocks: list[_JBlock]
    parent_hash: _JHash | None = None


class _JStoredNoTokens(msgspec.Struct, tag="stored", tag_field="type", gc=False):
    blocks: list[_JBlockNoTokens]
    parent_hash: _JHash | None = None


class _JRemoved(msgspec.Struct, tag="removed", tag_field="type", gc=False):
    block_hashes: list[_JHash]


class _JUpdated(msgspec.Struct, tag="updated", tag_field="type", gc=False):
    block_hash: _JHash
    cache_level: _JDiff | None = None
    priority: _JDiff | None = None


class _JCleared(msgspec.Struct, tag="all_cleared", tag_field="type", gc=False):
    pass


class _JEvent(msgspec.Struct, gc=False):
    event_id: int
    data: _JCreated | _JStored | _JRemoved | _JUpdated | _JCleared
    window_size: int = 0
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


class _JEventNoTokens(msgspec.Struct, gc=False):
    event_id: int
    data: _JCreated | _JStoredNoTokens | _JRemoved | _JUpdated | _JCleared
    window_size: int = 0
    layer_group_id: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


_TYPED = msgspec.json.Decoder(list[_JEvent])
_TYPED_NO_TOKENS = msgspec.json.Decoder(list[_JEventNoTokens])


def _h(value: int | str) -> int | str:
    if type(value) is int and value > _M64:
        raise _Fallback
    return value


def _diff_of(d: _JDiff | None) -> EventDiff | None:
    return None if d is None else EventDiff(old_value=d.old_value, new_value=d.new_value)


def _from_typed(e: _JEvent | _JEventNoTokens, tokens: bool) -> KVCacheEvent:
    d = e.data
    data: EventData
    if isinstance(d, _JStored | _JStoredNoTokens):
        blocks = []
        for b in d.blocks:
            toks: tuple[int, ...] = ()
            if tokens:
                assert isinstance(b, _JBlock)
                toks = tuple(t if type(t) is int else t.token_id  # type: ignore[union-attr]
                             for t in b.tokens)
            mm = tuple(k if type(k) is str else k.hash for k in b.mm_keys)  # type: ignore[union-attr]
            blocks.append(
                StoredBlock(_h(b.block_hash), toks, b.cache_level, b.priority, b.lora_id, mm)
            )
        parent = None if d.parent_hash is None else _h(d.parent_hash)
        data = Stored(parent_hash=parent, blocks=tuple(blocks))
    elif isinstance(d, _JRemoved):
        data = Removed(tuple([_h(x) for x in d.block_hashes]))
    elif isinstance(d, _JUpdated):
        data = Updated(_h(d.block_hash), _diff_of(d.cache_level), _diff_of(d.priority))
    elif isinstance(d, _JCreated):
        data = Created(tuple(d.num_blocks_per_cache_level))
    else:
        data = AllCleared()
    return KVCacheEvent(
        event_id=e.event_id, data=data, window_size=e.window_size,
        layer_group_id=e.layer_group_id, hash_algo=e.hash_algo,
        attention_dp_rank=e.attention_dp_rank,
    )


_LEVEL = attrgetter("cache_level")
_HASH = attrgetter("block_hash")


def _keyed(e: _JEventNoTokens) -> KeyedEvent:
    """A typed event as a keyed record: read straight into one when it is a stored event on one
    tier or a removed event, else converted from :func:`_from_typed`'s event."""
    d = e.data
    if type(d) is _JStoredNoTokens:
        blocks = d.blocks
        if d.parent_hash is not None:
            _h(d.parent_hash)
        if blocks:
            level = blocks[0].cache_level
            if 0 <= level < 3 and list(map(_LEVEL, blocks)).count(level) == len(blocks):
                keys = _keys(list(map(_HASH, blocks)))
                if keys is not None:
                    return KeyedEvent(e.event_id, STORED, keys, level, e.layer_group_id,
                                      e.hash_algo, e.attention_dp_rank)
    elif type(d) is _JRemoved:
        keys = _keys(d.block_hashes)
        if keys is not None:
            return KeyedEvent(e.event_id, REMOVED, keys, None, e.layer_group_id, e.hash_algo,
                              e.attention_dp_rank)
    return keyed(_from_typed(e, False))


def _keys(hashes: list[Any]) -> list[int] | None:
    """Normalized keys of typed hashes (ints >= 0 and strings); None when one makes no key
    (then the ordinary event carries it to the consumer, which rejects it). Raises _Fallback
    as :func:`_h` does."""
    if not hashes:
        return []
    if type(hashes[0]) is str:
        keys = hex_keys(hashes)
        if keys is not None:
            return keys
    try:
        top = max(hashes)
    except TypeError:  # ints and strings
        for h in hashes:
            _h(h)
    else:
        if type(top) is int:  # all ints, and >= 0 (checked by msgspec): keys as they are
            if top > _M64:
                raise _Fallback
            return hashes
    try:
        return normalize_hashes(hashes)
    except ValueError:
        return None


@format_errors("KV event JSON")
def parse_trtllm_dicts(obj: Any) -> list[KVCacheEvent]:
    """Parse already-decoded JSON (a list of event objects). Unknown keys are ignored."""
    if not isinstance(obj, list):
        raise EventFormatError(f"KV event JSON must be a list, got {type(obj).__name__}")
    return [_event(item, i) for i, item in enumerate(obj)]


def _event(obj: Any, index: int) -> KVCacheEvent:
    where = f"event {index}"
    if not isinstance(obj, dict):
        raise EventFormatError(f"{where}: expected an object, got {obj!r}")
    rank = obj.get("attention_dp_rank")
    algo = obj.get("hash_algo", "v1_block_key")
    if not isinstance(algo, str):
        raise EventFormatError(f"{where}: hash_algo must be a string, got {algo!r}")
    return KVCacheEvent(
        event_id=_int(obj.get("event_id"), f"{where}.event_id"),
        data=_data(obj.get("data"), where),
        window_size=_int(obj.get("window_size", 0), f"{where}.window_size"),
        layer_group_id=_int(obj.get("layer_group_id", 0), f"{where}.layer_group_id"),
        hash_algo=algo,
        attention_dp_rank=None if rank is None else _int(rank, f"{where}.attention_dp_rank"),
    )


def _int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise EventFormatError(f"{where}: expected an integer, got {value!r}")
    return value


def _hash(value: Any, where: str) -> BlockHash:
    if type(value) is int:
        if not 0 <= value <= _M64:
            raise EventFormatError(f"{where}: hash {value} is not an unsigned 64-bit integer")
        return value
    if type(value) is str:
        return value
    raise EventFormatError(f"{where}: a hash must be an integer or a hex string, got {value!r}")


def _event_diff(value: Any, where: str) -> EventDiff | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EventFormatError(f"{where}: expected an event_diff object or null, got {value!r}")
    return EventDiff(
        old_value=_int(value.get("old_value"), f"{where}.old_value"),
        new_value=_int(value.get("new_value"), f"{where}.new_value"),
    )


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise EventFormatError(f"{where}: expected a list, got {value!r}")
    return value


def _token(value: Any, where: str) -> int:
    if isinstance(value, dict):
        value = value.get("token_id")
    if type(value) is not int or value < 0:
        raise EventFormatError(f"{where}: expected a non-negative integer token id, got {value!r}")
    return value


def _mm_key(value: Any, where: str) -> str:
    # TensorRT-LLM writes {"type": "mm_key", "hash": ..., "start_offset": ...}; kvpool a string.
    if isinstance(value, dict):
        value = value.get("hash")
    if not isinstance(value, str):
        raise EventFormatError(f"{where}: expected a multimodal key string, got {value!r}")
    return value


def _block(obj: Any, where: str) -> StoredBlock:
    if not isinstance(obj, dict):
        raise EventFormatError(f"{where}: expected a stored_block object, got {obj!r}")
    tokens = _list(obj.get("tokens", []), f"{where}.tokens")
    lora = obj.get("lora_id")
    return StoredBlock(
        block_hash=_hash(obj.get("block_hash"), f"{where}.block_hash"),
        tokens=tuple(_token(t, f"{where}.tokens[{i}]") for i, t in enumerate(tokens)),
        cache_level=_int(obj.get("cache_level", 0), f"{where}.cache_level"),
        priority=_int(obj.get("priority", DEFAULT_PRIORITY), f"{where}.priority"),
        lora_id=None if lora is None else _int(lora, f"{where}.lora_id"),
        mm_keys=tuple(
            _mm_key(k, f"{where}.mm_keys[{i}]")
            for i, k in enumerate(_list(obj.get("mm_keys", []), f"{where}.mm_keys"))
        ),
    )


def _data(obj: Any, where: str) -> EventData:
    where = f"{where}.data"
    if not isinstance(obj, dict):
        raise EventFormatError(f"{where}: expected an object, got {obj!r}")
    kind = obj.get("type")
    if kind == "stored":
        parent = obj.get("parent_hash")
        blocks = _list(obj.get("blocks"), f"{where}.blocks")
        return Stored(
            parent_hash=None if parent is None else _hash(parent, f"{where}.parent_hash"),
            blocks=tuple(_block(b, f"{where}.blocks[{i}]") for i, b in enumerate(blocks)),
        )
    if kind == "removed":
        hashes = _list(obj.get("block_hashes"), f"{where}.block_hashes")
        return Removed(tuple(_hash(h, f"{where}.block_hashes[{i}]") for i, h in enumerate(hashes)))
    if kind == "updated":
        return Updated(
            block_hash=_hash(obj.get("block_hash"), f"{where}.block_hash"),
            cache_level=_event_diff(obj.get("cache_level"), f"{where}.cache_level"),
            priority=_event_diff(obj.get("priority"), f"{where}.priority"),
        )
    if kind == "created":
        levels = _list(obj.get("num_blocks_per_cache_level"), f"{where}.num_blocks_per_cache_level")
        return Created(
            tuple(_int(n, f"{where}.num_blocks_per_cache_level[{i}]") for i, n in enumerate(levels))
        )
    if kind == "all_cleared":
        return AllCleared()
    raise EventFormatError(f"{where}.type: unknown event type {kind!r}")
