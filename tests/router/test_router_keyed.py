"""The keyed ingestion paths (kvpool.events.keyed records read straight from the wire, the
token-list cut of TensorRT-LLM's JSON) against the checking parsers whose events are converted
at the index's door: on random batches, the same errors and the same index."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import EventFormatError
from kvpool.events.keyed import (
    MALFORMED,
    REMOVED,
    STORED,
    KeyedEvent,
    digest_keys,
    hex_keys,
    keyed,
    normalize_hash,
    normalize_hashes,
    token_bytes,
)
from kvpool.events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvpool.events.trtllm_json import parse_trtllm_dicts, parse_trtllm_json, parse_trtllm_keys
from kvpool.events.vllm_msgpack import decode_vllm_batch, decode_vllm_keys
from kvpool.hashing import jit
from kvpool.router.config import WorkerConfig, WorkerKind
from kvpool.router.index import TIERS, KvIndex
from kvpool.router.ingest import Ingest

M64 = (1 << 64) - 1


def index_state(
    events: list[Any], *, algo: str | None = None, tpb: int | None = None,
    by_tokens: bool = False,
) -> tuple[Any, ...]:
    """Everything the index makes of ``events`` (applied one by one and as a batch)."""
    states = []
    for batch in (True, False):
        index = KvIndex()
        index.add_worker("w", hash_algo=algo, tokens_per_block=tpb, match_by_tokens=by_tokens)
        applied = (
            index.apply_many("w", events) if batch else sum(index.apply("w", e) for e in events)
        )
        info = index.worker_info("w")
        states.append((
            applied,
            dict(index.masks),
            index.snapshot("w"),
            dataclasses.astuple(index.counters),
            info.hash_algo,
            info.tokens_per_block,
            info.blocks_per_tier,
            info.layer_groups,
            info.last_event_id,
        ))
    assert states[0] == states[1]
    return states[0]


def outcome(parse: Any, *args: Any, **kwargs: Any) -> list[Any] | None:
    """The parse result, or None when it raises EventFormatError."""
    try:
        return list(parse(*args, **kwargs))
    except EventFormatError:
        return None


# ====================================================================== normalization helpers

HEX64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
ODD_STR = st.sampled_from(["", "zz", "0x12", " ab", "+1f", "1_0", "٣" * 4, "f" * 65, "F" * 64,
                           "ab cd" + "0" * 59, "0" * 63 + "g"])


@given(st.lists(st.one_of(HEX64, HEX64.map(lambda h: h[:16]), ODD_STR,
                          st.integers(-(2**70), 2**70)), max_size=6))
def test_bulk_normalization_equals_normalize_hash(raw: list[Any]) -> None:
    try:
        expected: list[int] | None = [normalize_hash(h) for h in raw]
    except ValueError:
        expected = None
    try:
        got: list[int] | None = normalize_hashes(raw)
    except ValueError:
        got = None
    assert got == expected
    keys = hex_keys(raw)
    assert keys is None or keys == expected


@given(st.sampled_from([0, 4, 8, 16, 24, 32, 40]), st.integers(1, 5), st.booleans(),
       st.data())
def test_digest_keys_take_the_first_or_last_8_bytes(
    size: int, n: int, head: bool, data: st.DataObject
) -> None:
    raw = [data.draw(st.binary(min_size=size, max_size=size)) for _ in range(n)]
    keys = digest_keys(raw, head=head)
    if size == 0 or size % 8 or (head and size > 32):
        assert keys is None
    else:
        assert keys == [int.from_bytes(b[:8] if head else b[-8:], "big") for b in raw]
    assert digest_keys([*raw, b"x" * 9], head=head) is None  # lengths differ: hash by hash


# ============================================================================ vLLM msgpack

INT_HASH = st.one_of(st.integers(0, M64), st.integers(-(2**63), -1))
BYTES_HASH = st.sampled_from([0, 4, 8, 16, 32, 40]).flatmap(
    lambda n: st.binary(min_size=n, max_size=n)
)
MEDIUM = st.sampled_from([None, "GPU", "CPU", "STORAGE", "CPU_PINNED", "DISK"])


@st.composite
def vllm_events(draw: st.DrawFn, hashes: st.SearchStrategy[Any]) -> Any:
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
    positional = draw(st.integers(0, 4)) == 0
    if kind == "cleared":
        return ["AllBlocksCleared"] if positional else {"type": "AllBlocksCleared"}
    block_hashes = draw(st.lists(hashes, max_size=5))
    medium = draw(st.one_of(MEDIUM, st.just("NVME"))) if draw(st.integers(0, 20)) == 0 else \
        draw(MEDIUM)
    group = draw(st.sampled_from([None, 0, 1, 2]))
    if kind == "removed":
        fields = [block_hashes, medium, group]
        if positional:
            return ["BlockRemoved", *fields[: draw(st.integers(1, 3))]]
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": block_hashes,
                               "medium": medium}
        if group is not None:
            out["group_idx"] = group
        return out
    size = draw(st.sampled_from([None, 0, 1, 2, 3, 4]))
    n_tokens = draw(st.integers(0, (len(block_hashes) + 1) * (size or 2)))
    tokens = None if draw(st.integers(0, 6)) == 0 else draw(
        st.lists(st.integers(0, 2**31), min_size=n_tokens, max_size=n_tokens))
    fields = [
        block_hashes,
        draw(st.one_of(st.none(), hashes)),  # parent
        tokens,
        size,
        draw(st.sampled_from([None, 3])),  # lora id
        medium,
        draw(st.sampled_from([None, "adapter"])),
        None,  # extra keys
        group,
        draw(st.sampled_from([None, "sliding_window"])),
        draw(st.sampled_from([None, 64])),
    ]
    if positional:
        return ["BlockStored", *fields[: draw(st.integers(5, 11))]]
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
             "kv_cache_spec_sliding_window"]
    stored: dict[str, Any] = {"type": "BlockStored"}
    stored.update({k: v for k, v in zip(names, fields, strict=True)
                   if v is not None or k in names[:7]})
    if draw(st.booleans()):
        stored["a_newer_field"] = [1, {"x": b"\x00"}]
    return stored


@st.composite
def vllm_payloads(draw: st.DrawFn) -> bytes:
    hashes = draw(st.sampled_from([INT_HASH, BYTES_HASH, st.one_of(INT_HASH, BYTES_HASH)]))
    events = draw(st.lists(vllm_events(hashes), max_size=6))
    rank = draw(st.sampled_from([None, 0, 2]))
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return msgspec.msgpack.encode({"ts": 1.5, "events": events, "data_parallel_rank": rank})
    if shape == 1:
        return msgspec.msgpack.encode([1.5, events])
    return msgspec.msgpack.encode([1.5, events, rank])


@given(vllm_payloads(), st.sampled_from(["vllm_sha256_cbor", "v2_sha256", "v1_block_key"]),
       st.integers(0, 1000))
def test_vllm_keyed_decoding_means_what_the_checked_decoding_means(
    payload: bytes, algo: str, first: int
) -> None:
    expected = outcome(lambda: decode_vllm_batch(payload, hash_algo=algo, first_event_id=first)
                       .events)
    got = outcome(decode_vllm_keys, payload, hash_algo=algo, first_event_id=first)
    assert (got is None) == (expected is None)
    if got is None or expected is None:
        return
    assert [e.event_id for e in got] == [e.event_id for e in expected]
    # The index learns algorithm and block size from either stream alike.
    assert index_state(got) == index_state(expected)
    assert index_state(got, algo=algo, tpb=4) == index_state(expected, algo=algo, tpb=4)


@given(vllm_payloads(), st.sampled_from(["vllm_sha256_cbor", "v2_sha256", "v1_block_key"]),
       st.integers(0, 1000), st.data())
def test_vllm_keyed_decoding_with_tokens_means_what_the_checked_decoding_means(
    payload: bytes, algo: str, first: int, data: st.DataObject
) -> None:
    expected = outcome(lambda: decode_vllm_batch(payload, hash_algo=algo, first_event_id=first)
                       .events)
    got = outcome(decode_vllm_keys, payload, hash_algo=algo, first_event_id=first, tokens=True)
    assert (got is None) == (expected is None)
    if got is None or expected is None:
        return
    assert [e.event_id for e in got] == [e.event_id for e in expected]
    # Records with tokens are what a worker matched by its tokens reads (ingest: tokens=True).
    assert index_state(got, by_tokens=True) == index_state(expected, by_tokens=True)
    assert (index_state(got, algo=algo, tpb=4, by_tokens=True)
            == index_state(expected, algo=algo, tpb=4, by_tokens=True))
    # Chains under the stored blocks' hashes (parents the payloads rarely name by chance).
    held = [k for e in got if e.op == STORED and e.tokens for k in e.keys]
    if held:
        size = data.draw(st.integers(1, 3))
        child = msgspec.msgpack.encode([0.0, [
            {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash":
             data.draw(st.sampled_from(held)), "token_ids": list(range(size + 1)),
             "block_size": size, "lora_id": None, "medium": None, "lora_name": None},
        ], None])
        start = first + len(got)
        assert (index_state([*got, *decode_vllm_keys(child, hash_algo=algo,
                                                     first_event_id=start, tokens=True)],
                            by_tokens=True)
                == index_state([*expected, *decode_vllm_batch(child, hash_algo=algo,
                                                              first_event_id=start).events],
                               by_tokens=True))


def test_vllm_keyed_decoding_with_tokens_cuts_blocks_as_the_checked_decoding() -> None:
    """token_ids may cover more blocks than block_hashes names: aligned to the last block."""
    stored: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
        "token_ids": list(range(10)), "block_size": 4, "lora_id": 3, "medium": "CPU",
        "lora_name": None}
    payload = msgspec.msgpack.encode([0.0, [stored], 1])
    (record,) = decode_vllm_keys(payload, first_event_id=9, tokens=True)
    assert record == KeyedEvent(9, STORED, [5, 6], 1, 0, "vllm_sha256_cbor", 1, block_tokens=4,
                                block_size=4, lora_id=3,
                                tokens=(token_bytes(range(4, 8)), token_bytes(range(8, 10))))
    (event,) = decode_vllm_batch(payload, first_event_id=9).events
    assert isinstance(event.data, Stored)
    assert [b.tokens for b in event.data.blocks] == [(4, 5, 6, 7), (8, 9)]
    # Token ids a record cannot carry as they are go through the event, converted: an id too
    # large, or a parent that makes no key (a v2_sha256 digest longer than 32 bytes), makes a
    # malformed record; a block without tokens is announced by its hash alone.
    for changes, malformed in (({"token_ids": [1, 2, 3, 2**32]}, True),  # an id too large
                               ({"token_ids": list(range(3))}, False),  # a block without any
                               ({"parent_block_hash": b"\x01" * 40}, True)):
        payload = msgspec.msgpack.encode([0.0, [{**stored, **changes}], None])
        (converted,) = decode_vllm_keys(payload, hash_algo="v2_sha256", tokens=True)
        assert converted == keyed(decode_vllm_batch(payload, hash_algo="v2_sha256").events[0],
                                  True)
        assert (converted.op == MALFORMED) is malformed
    # A chain of one partial block: its tokens, not block_size, are what the index learns.
    payload = msgspec.msgpack.encode([0.0, [{**stored, "block_hashes": [5],
                                             "token_ids": [1, 2, 3]}], None])
    for by_tokens in (True, False):
        assert (index_state(decode_vllm_keys(payload, tokens=True), by_tokens=by_tokens)
                == index_state(list(decode_vllm_batch(payload).events), by_tokens=by_tokens))


def test_vllm_keyed_decoding_does_not_read_token_ids() -> None:
    """As with tokens=False, token ids are neither built nor checked; only their count is
    read (for the block size the index learns)."""
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": ["a", "b", "c"], "block_size": 2, "lora_id": None, "medium": "CPU",
         "lora_name": None},
    ], None])
    with pytest.raises(EventFormatError, match="token_ids"):
        decode_vllm_batch(payload)
    assert decode_vllm_keys(payload) == [KeyedEvent(0, STORED, [1, 2], 1, 0, "vllm_sha256_cbor",
                                                    None, 2)]


# Token ids as any msgpack encoder may write them: every int form (a non-canonical one too),
# values outside [0, 2**32) that a token id cannot be, and elements that are not ints.
_INT_FORMS: dict[str, tuple[bytes, int, int, bool]] = {  # tag, width, lowest, highest, signed
    "u8": (b"\xcc", 1, 0, 2**8 - 1, False), "u16": (b"\xcd", 2, 0, 2**16 - 1, False),
    "u32": (b"\xce", 4, 0, 2**32 - 1, False), "u64": (b"\xcf", 8, 0, 2**64 - 1, False),
    "i8": (b"\xd0", 1, -(2**7), 2**7 - 1, True), "i16": (b"\xd1", 2, -(2**15), 2**15 - 1, True),
    "i32": (b"\xd2", 4, -(2**31), 2**31 - 1, True), "i64": (b"\xd3", 8, -(2**63), 2**63 - 1, True),
}  # type: ignore[dict-item]


@st.composite
def msgpack_int(draw: st.DrawFn) -> tuple[bytes, Any]:
    """One msgpack element and what it decodes to."""
    form = draw(st.sampled_from([*_INT_FORMS, "fixint", "fixint", "negfixint", "other"]))
    if form == "fixint":
        v = draw(st.integers(0, 127))
        return bytes([v]), v
    if form == "negfixint":
        v = draw(st.integers(-32, -1))
        return bytes([v & 0xFF]), v
    if form == "other":
        v = draw(st.sampled_from([None, 1.5, "a", [1], True]))
        return msgspec.msgpack.encode(v), v
    tag, width, low, high, signed = _INT_FORMS[form]  # type: ignore[misc]
    edges = [low, high, 0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -1]
    v = draw(st.one_of(st.integers(low, high),
                       st.sampled_from([e for e in edges if low <= e <= high])))
    return tag + v.to_bytes(width, "big", signed=signed), v


@st.composite
def msgpack_token_array(draw: st.DrawFn, size: int | None = None) -> tuple[bytes, list[Any]]:
    """A msgpack array of ints (sometimes other elements), with any valid header."""
    items = draw(st.lists(msgpack_int(), min_size=size or 0, max_size=size if size else 40))
    n = len(items)
    head = draw(st.sampled_from(
        (["fix"] if n < 16 else []) + (["a16"] if n < 2**16 else []) + ["a32"]))
    header = (bytes([0x90 | n]) if head == "fix" else
              b"\xdc" + n.to_bytes(2, "big") if head == "a16" else b"\xdd" + n.to_bytes(4, "big"))
    return header + b"".join(b for b, _ in items), [v for _, v in items]


def _token_ids(values: list[Any]) -> list[int] | None:
    ok = all(type(v) is int and 0 <= v < 2**32 for v in values)
    return values if ok else None


@given(st.lists(msgpack_token_array(), max_size=6))
def test_msgpack_token_kernel_reads_every_int_form_and_rejects_the_rest(
    arrays: list[tuple[bytes, list[Any]]],
) -> None:
    """The kernel's ids are what msgspec decodes, whatever int forms the encoder chose; any
    element that is not a token id (another type, a negative value, one of 2**32 or more)
    makes it decline the whole call. Cut input is declined too, never read past."""
    if jit.backend() == "python":
        pytest.skip("the jit extra is not installed")
    raws = [raw for raw, _ in arrays]
    for raw, values in arrays:
        assert msgspec.msgpack.decode(raw) == values  # the test's encoding is msgpack
    expected = [_token_ids(values) for _, values in arrays]
    got = jit.msgpack_token_arrays(raws)
    if any(e is None for e in expected):
        assert got is None
    else:
        assert got is not None
        data, lengths = got
        assert lengths == [len(v) for _, v in arrays]
        assert list(array("I", data)) == [t for _, v in arrays for t in v]
    if raws and raws[-1][1:]:
        for cut in (1, len(raws[-1]) // 2):
            assert jit.msgpack_token_arrays([*raws[:-1], raws[-1][:-cut]]) is None


@st.composite
def vllm_payloads_any_int_forms(draw: st.DrawFn) -> bytes:
    events: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["stored", "stored", "removed"]))
        hashes = draw(st.lists(st.integers(0, M64), min_size=0, max_size=4))
        if kind == "removed":
            events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": None})
            continue
        size = draw(st.sampled_from([0, 1, 2, 3]))
        n_tokens = draw(st.integers(0, (len(hashes) + 1) * max(size, 1)))
        raw, _ = draw(msgpack_token_array(n_tokens))
        stored: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": draw(st.one_of(st.none(), st.integers(0, M64))),
            "block_size": size, "lora_id": None, "medium": draw(MEDIUM), "lora_name": None}
        if draw(st.integers(0, 5)):  # absent now and then
            stored["token_ids"] = msgspec.Raw(raw)
        events.append(stored)
    return msgspec.msgpack.encode([2.5, events, draw(st.sampled_from([None, 1]))])


@given(vllm_payloads_any_int_forms(), st.integers(0, 100))
def test_vllm_keyed_decoding_with_tokens_is_the_same_with_or_without_the_kernel(
    payload: bytes, first: int
) -> None:
    """decode_vllm_keys(tokens=True) reads token ids with the msgpack kernel when numba is
    there: records, events and errors are exactly those of the Python path, and they mean
    what the checked decoding means."""
    with_kernel = outcome(decode_vllm_keys, payload, first_event_id=first, tokens=True)
    was = jit.enabled()
    jit.set_enabled(False)
    try:
        without = outcome(decode_vllm_keys, payload, first_event_id=first, tokens=True)
    finally:
        jit.set_enabled(was)
    assert with_kernel == without
    expected = outcome(lambda: decode_vllm_batch(payload, first_event_id=first).events)
    assert (with_kernel is None) == (expected is None)
    if with_kernel is not None and expected is not None:
        assert (index_state(with_kernel, by_tokens=True)
                == index_state(expected, by_tokens=True))


def test_vllm_keyed_decoding_with_tokens_uses_the_kernel() -> None:
    """The kernel path is the one that runs (when numba is installed): it decodes token ids
    msgspec's typed decoder would not hold as ints of a tuple if it had to build them."""
    if jit.backend() == "python":
        pytest.skip("the jit extra is not installed")
    raw = b"\x94" + b"\xd3" + (5).to_bytes(8, "big") + b"\xcf" + (2**32 - 1).to_bytes(8, "big") \
        + b"\x07\xd0\x01"
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": msgspec.Raw(raw), "block_size": 2, "lora_id": None, "medium": None,
         "lora_name": None}], None])
    calls: list[int] = []
    original = jit.msgpack_token_arrays

    def counting(arrays: list[bytes]) -> tuple[bytes, list[int]] | None:
        calls.append(len(arrays))
        return original(arrays)

    jit.msgpack_token_arrays = counting  # type: ignore[assignment]
    try:
        (record,) = decode_vllm_keys(payload, tokens=True)
    finally:
        jit.msgpack_token_arrays = original  # type: ignore[assignment]
    assert calls == [1]
    assert record == KeyedEvent(0, STORED, [11, 12], 0, 0, "vllm_sha256_cbor", None, 2, 2,
                                (token_bytes([5, 2**32 - 1]), token_bytes([7, 1])))


def test_vllm_digest_a_v2_key_cannot_be_made_of_makes_a_malformed_record() -> None:
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 40], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": None},
    ], None])
    bad, good = decode_vllm_keys(payload, hash_algo="v2_sha256")
    assert bad == KeyedEvent(0, MALFORMED, [], 0, 0, "v2_sha256", None)
    assert good == KeyedEvent(1, REMOVED, [0x0101010101010101], None, 0, "v2_sha256", None)
    index = KvIndex()
    index.add_worker("w")
    assert index.apply_many("w", [bad, good]) == 1 and index.counters.events_malformed == 1


# ========================================================================= TensorRT-LLM JSON

TRT_HASH_V1 = st.one_of(st.integers(0, M64), st.integers(0, M64), st.integers(M64 + 1, 2**70),
                        st.integers(-5, -1))
TRT_HASH_V2 = st.one_of(HEX64, HEX64, HEX64.map(lambda h: h[:16]), ODD_STR)
# Unknown keys whose values hold the characters a token-list cut must not be fooled by.
TRICKY = st.one_of(
    st.sampled_from(["]", "[", '"]', "\\", '\\"]', "],", "}]", '"tokens":[', "[[]]"]),
    st.lists(st.sampled_from([[], [1, [2]], "]", {"k": "]"}]), max_size=3),
)


@st.composite
def trt_tokens(draw: st.DrawFn) -> list[Any]:
    out: list[Any] = []
    for t in draw(st.lists(st.integers(0, 2**31), max_size=5)):
        if draw(st.integers(0, 3)) == 0:
            out.append(t)  # a bare int: accepted too
            continue
        token: dict[str, Any] = {"type": "unique_token", "token_id": t, "token_extra_id": 0}
        if draw(st.integers(0, 4)) == 0:
            token[draw(st.sampled_from(["note", "x]", 'q"'])) ] = draw(TRICKY)
        out.append(token)
    return out


@st.composite
def trt_events(draw: st.DrawFn, hashes: st.SearchStrategy[Any], algo: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "removed", "updated",
                                 "created", "all_cleared"]))
    data: dict[str, Any] = {"type": kind}
    if kind == "stored":
        data["parent_hash"] = draw(st.one_of(st.none(), hashes))
        level = draw(st.integers(0, 2))
        blocks = []
        for _ in range(draw(st.integers(0, 4))):
            block: dict[str, Any] = {
                "type": "stored_block",
                "block_hash": draw(hashes),
                "tokens": draw(trt_tokens()),
                "cache_level": level if draw(st.integers(0, 5)) else draw(st.integers(0, 3)),
                "priority": 35,
                "mm_keys": draw(st.sampled_from([[], ["img"], [{"type": "mm_key", "hash": "h"}]])),
            }
            if draw(st.integers(0, 5)) == 0:
                block["lora_id"] = 7
            if draw(st.integers(0, 5)) == 0:
                block["unknown"] = draw(TRICKY)
            blocks.append(block)
        data["blocks"] = blocks
    elif kind == "removed":
        data["block_hashes"] = draw(st.lists(hashes, max_size=4))
    elif kind == "updated":
        data["block_hash"] = draw(hashes)
        data["cache_level"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
            {"type": st.just("event_diff"), "new_value": st.integers(0, 2),
             "old_value": st.integers(0, 2)})))
        data["priority"] = None
    elif kind == "created":
        data["num_blocks_per_cache_level"] = draw(st.lists(st.integers(0, 100), max_size=3))
    event: dict[str, Any] = {"event_id": draw(st.integers(0, 50)), "data": data,
                             "window_size": 4096}
    if draw(st.booleans()):
        event["attention_dp_rank"] = draw(st.integers(0, 2))
    event["hash_algo"] = algo
    event["layer_group_id"] = draw(st.sampled_from([0, 0, 0, 1, -1]))
    return event


@st.composite
def trt_texts(draw: st.DrawFn) -> str:
    algo = draw(st.sampled_from(["v1_block_key", "v2_sha256"]))
    hashes = TRT_HASH_V1 if algo == "v1_block_key" else TRT_HASH_V2
    events = draw(st.lists(trt_events(hashes, algo), max_size=5))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    return json.dumps(events, separators=separators)


def _strip_tokens(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    out = []
    for e in events:
        if isinstance(e.data, Stored):
            blocks = tuple(msgspec.structs.replace(b, tokens=()) for b in e.data.blocks)
            e = msgspec.structs.replace(e, data=Stored(e.data.parent_hash, blocks))
        out.append(e)
    return out


@given(trt_texts(), st.booleans())
def test_trtllm_fast_paths_mean_what_the_checking_parser_means(text: str, as_bytes: bool) -> None:
    payload: str | bytes = text.encode() if as_bytes else text
    expected = outcome(lambda: parse_trtllm_dicts(json.loads(text)))
    without_tokens = outcome(parse_trtllm_json, payload, tokens=False)
    keyed = outcome(parse_trtllm_keys, payload)
    assert (without_tokens is None) == (keyed is None) == (expected is None)
    if expected is None or without_tokens is None or keyed is None:
        return
    assert without_tokens == _strip_tokens(expected)
    assert parse_trtllm_json(payload) == expected
    # Keyed records carry no tokens: the index keys them alike once tokens per block is known.
    assert index_state(keyed, tpb=4) == index_state(expected, tpb=4)


def test_trtllm_token_lists_are_cut_only_where_that_is_exact() -> None:
    # A ']' inside a token list's string, and a nested list: the cut would change the
    # meaning, so the text is decoded as it is.
    for tokens in ('[{"token_id": 1, "note": "]"}]', '[{"token_id": 1, "x": [2]}, 3]'):
        text = ('[{"event_id": 0, "data": {"type": "stored", "parent_hash": null, "blocks": '
                '[{"block_hash": 5, "tokens": ' + tokens + ', "cache_level": 1}]}}]')
        text = text.replace(": ", ":").replace(", ", ",")
        assert parse_trtllm_keys(text) == [KeyedEvent(0, STORED, [5], 1)]
        (event,) = parse_trtllm_json(text, tokens=False)
        assert isinstance(event.data, Stored) and event.data.blocks == (StoredBlock(5, (), 1),)


def test_trtllm_token_lists_are_not_checked_without_tokens() -> None:
    text = ('[{"event_id":0,"data":{"type":"stored","parent_hash":null,"blocks":'
            '[{"block_hash":5,"tokens":[{"token_id":-1},"x"],"cache_level":0}]}}]')
    with pytest.raises(EventFormatError, match="token"):
        parse_trtllm_json(text)
    assert parse_trtllm_keys(text) == [KeyedEvent(0, STORED, [5], 0)]


# ==================================================================== the index, both inputs


def _as_keyed(event: KVCacheEvent) -> KeyedEvent | KVCacheEvent:
    """The record a decoder's fast path would make of ``event`` (when one can carry it)."""
    data, common = event.data, (event.layer_group_id, event.hash_algo, event.attention_dp_rank)
    if isinstance(data, Stored) and data.blocks:
        levels = {b.cache_level for b in data.blocks}
        if len(levels) == 1:
            keys = [normalize_hash(b.block_hash) for b in data.blocks]
            return KeyedEvent(event.event_id, STORED, keys, levels.pop(), *common,
                              len(data.blocks[0].tokens))
    if isinstance(data, Removed):
        levels = set(data.cache_levels or ())
        if data.cache_levels is None or len(levels) == 1:
            keys = [normalize_hash(h) for h in data.block_hashes]
            level = None if data.cache_levels is None else levels.pop()
            return KeyedEvent(event.event_id, REMOVED, keys, level, *common)
    return event


@given(st.lists(st.tuples(
    st.sampled_from(["store", "store", "remove", "remove_all", "mixed"]),
    st.integers(0, 1),  # layer group
    st.lists(st.integers(0, 9), min_size=1, max_size=4),
    st.integers(0, TIERS - 1),
    st.integers(-3, 3),  # event id shift: out of order, duplicates, gaps
), max_size=30), st.booleans())
def test_keyed_records_and_events_build_the_same_index(
    steps: list[tuple[str, int, list[int], int, int]], tokens_matched: bool
) -> None:
    events = []
    for i, (kind, group, hashes, tier, shift) in enumerate(steps):
        eid = max(0, 4 * i + shift)
        data: Any
        if kind == "store":
            toks = tuple(range(tier + 1))
            data = Stored(None, tuple(StoredBlock(h, () if tokens_matched else toks, tier)
                                      for h in hashes))
        elif kind == "mixed":
            data = Stored(None, tuple(StoredBlock(h, (), (tier + j) % TIERS)
                                      for j, h in enumerate(hashes)))
        elif kind == "remove":
            data = Removed(tuple(hashes), (tier,) * len(hashes))
        else:
            data = Removed(tuple(hashes))
        events.append(KVCacheEvent(eid, data, 0, group))
    keyed = [_as_keyed(e) for e in events]
    states = []
    for stream in (events, keyed):
        index = KvIndex()
        index.add_worker("w", match_by_tokens=tokens_matched)
        index.apply_many("w", stream)
        states.append((dict(index.masks), index.snapshot("w"), dataclasses.astuple(index.counters),
                       index.worker_info("w").blocks_per_tier, index.tokens_per_block_of("w")))
    assert states[0] == states[1]


# =============================================================================== the ingest


def test_ingest_learns_the_block_size_of_a_vllm_worker_without_decoding_tokens() -> None:
    index = KvIndex()
    index.add_worker("v")
    ingest = Ingest(index)
    ingest.add(WorkerConfig("v", WorkerKind.VLLM))
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": list(range(7)), "block_size": 4, "lora_id": None, "medium": None,
         "lora_name": None},
    ], None])
    assert ingest.feed_vllm("v", payload) == 1
    assert index.tokens_per_block_of("v") == 4
    assert index.group_of("v") == ("vllm", 4)


def test_ingest_reads_tokens_where_the_index_needs_them() -> None:
    index = KvIndex()
    index.add_worker("t", tokens_per_block=2, match_by_tokens=True)
    index.add_worker("u")  # tokens per block still to learn
    ingest = Ingest(index)
    for wid in ("t", "u"):
        ingest.add(WorkerConfig(wid, WorkerKind.TRTLLM, http_base_url="http://127.0.0.1:1"))
    text = ('[{"event_id":0,"data":{"type":"stored","parent_hash":null,"blocks":'
            '[{"block_hash":5,"tokens":[1,2]},{"block_hash":6,"tokens":[3]}]}}]')
    assert ingest.feed_trtllm("t", text) == 1 and ingest.feed_trtllm("u", text) == 1
    assert index.tiers_of("u", 5) == (0,) and index.tokens_per_block_of("u") == 2
    assert index.worker_info("t").blocks_per_tier == (2, 0, 0)
    assert index.counters.anomalies == 0


def test_ingest_loads_the_token_reader_when_a_worker_is_matched_by_tokens() -> None:
    """The compiled token reader loads (numba is imported) when a worker matched by tokens is
    added, not while its first batch waits; workers keyed by hashes never need it."""
    if jit.backend() == "python":
        pytest.skip("the jit extra is not installed")
    code = ("import sys; from kvpool.router.index import KvIndex; "
            "from kvpool.router.ingest import Ingest; "
            "from kvpool.router.config import WorkerConfig, WorkerKind; "
            "index = KvIndex(); ingest = Ingest(index); "
            "index.add_worker('h', tokens_per_block=4); "
            "ingest.add(WorkerConfig('h', WorkerKind.KVPOOL)); "
            "print('numba' in sys.modules); "
            "index.add_worker('t', tokens_per_block=4, match_by_tokens=True); "
            "ingest.add(WorkerConfig('t', WorkerKind.KVPOOL, match_by_tokens=True)); "
            "print('numba' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_JIT"}  # the default: on
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env=env).stdout.split()
    assert out == ["False", "True"]


@given(st.lists(st.tuples(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=5),
                          st.integers(0, M64)), min_size=1, max_size=6),
       st.booleans())
def test_token_matched_index_reads_token_ids_as_their_tuples(
    blocks: list[tuple[list[int], int]], chained: bool
) -> None:
    """Stored chains whose blocks carry TokenIds (a kvpool manager's, fed in process) build the
    index that the same chains with tuples build: whole, partial and token-less blocks."""
    from kvpool.events import TokenIds

    def events(make: Any) -> list[KVCacheEvent]:
        chain = tuple(StoredBlock(h, make(t)) for t, h in blocks)
        out = [KVCacheEvent(0, Stored(None, chain), 0, hash_algo="vllm_sha256_cbor")]
        if chained:  # a child chain under the last block
            out.append(KVCacheEvent(1, Stored(blocks[-1][1], (StoredBlock(M64 - 1, make([9])),)),
                                    0, hash_algo="vllm_sha256_cbor"))
        return out

    as_ids = events(lambda t: TokenIds("I", array("I", t).tobytes()))
    assert index_state(as_ids, by_tokens=True) == index_state(events(tuple), by_tokens=True)
