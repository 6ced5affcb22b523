"""Wire formats: TensorRT-LLM JSON and vLLM msgpack, checked with independent generic decoders
(json.loads, msgspec.msgpack.decode to plain objects) against COMPATIBILITY §2-3."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import EventFormatError, InvalidArgumentError
from kvpool.events import (
    REMOTE_CACHE_LEVEL,
    REMOTE_MEDIUM,
    AllCleared,
    Created,
    EventDiff,
    EventIndex,
    EventManager,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
    decode_vllm_batch,
    encode_vllm_batch,
    parse_trtllm_json,
    to_trtllm_dicts,
    to_trtllm_json,
)

M64 = (1 << 64) - 1
H1 = 924206229973855  # COMPATIBILITY §1.1: v1 hash([1, 2, 3, 4])
H2 = 6875034662206558884  # ... and of [5, 6] chained on it (> 2**62)
HEX = "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073"  # §1.2 block_key

# ================================================================ TensorRT-LLM JSON (§2)


def test_json_golden_matches_the_compatibility_shapes() -> None:
    events = [
        KVCacheEvent(12, Created((1024, 4096)), 4096, 0, "v1_block_key", attention_dp_rank=0),
        KVCacheEvent(13, Stored(None, (StoredBlock(H1, (1,), 0, 35),)), 4096, 0, "v1_block_key"),
        KVCacheEvent(14, Removed((H1,), (0,)), 4096, 0, "v1_block_key"),
        KVCacheEvent(15, Updated(H1, cache_level=EventDiff(0, 1)), 4096, 2, "v1_block_key"),
    ]
    decoded = json.loads(to_trtllm_json(events))
    assert decoded == [
        {
            "event_id": 12,
            "data": {"type": "created", "num_blocks_per_cache_level": [1024, 4096]},
            "window_size": 4096,
            "attention_dp_rank": 0,
            "hash_algo": "v1_block_key",
            "layer_group_id": 0,
        },
        {
            "event_id": 13,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": 924206229973855,
                        "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}],
                        "cache_level": 0,
                        "priority": 35,
                        "mm_keys": [],
                    }
                ],
            },
            "window_size": 4096,
            "hash_algo": "v1_block_key",
            "layer_group_id": 0,
        },
        {
            "event_id": 14,
            "data": {"type": "removed", "block_hashes": [924206229973855]},
            "window_size": 4096,
            "hash_algo": "v1_block_key",
            "layer_group_id": 0,
        },
        {
            "event_id": 15,
            "data": {
                "type": "updated",
                "block_hash": 924206229973855,
                "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                "priority": None,
            },
            "window_size": 4096,
            "hash_algo": "v1_block_key",
            "layer_group_id": 2,
        },
    ]
    # Key order as TensorRT-LLM writes it.
    assert list(decoded[0]) == [
        "event_id",
        "data",
        "window_size",
        "attention_dp_rank",
        "hash_algo",
        "layer_group_id",
    ]
    assert list(decoded[1]) == ["event_id", "data", "window_size", "hash_algo", "layer_group_id"]
    assert list(decoded[1]["data"]["blocks"][0]) == [
        "type",
        "block_hash",
        "tokens",
        "cache_level",
        "priority",
        "mm_keys",
    ]
    assert list(decoded[3]["data"]) == ["type", "block_hash", "cache_level", "priority"]


def test_json_hashes_keep_full_precision_and_hex() -> None:
    events = [
        KVCacheEvent(0, Removed((M64, 1 << 63)), 0, 0, "v2_sha256_64"),
        KVCacheEvent(1, Stored(HEX, (StoredBlock(HEX, (5, 6)),)), 0, 0, "v2_sha256"),
    ]
    text = to_trtllm_json(events)
    assert "18446744073709551615" in text and "9223372036854775808" in text
    decoded = json.loads(text)
    assert decoded[0]["data"]["block_hashes"] == [M64, 1 << 63]
    assert decoded[1]["data"]["parent_hash"] == HEX
    assert decoded[1]["data"]["blocks"][0]["block_hash"] == HEX
    assert to_trtllm_dicts(events)[0]["data"]["block_hashes"] == [M64, 1 << 63]


def test_json_writes_all_cleared_as_a_kvpool_extension() -> None:
    assert json.loads(to_trtllm_json([KVCacheEvent(0, AllCleared(), 0)]))[0]["data"] == {
        "type": "all_cleared"
    }


def test_json_parse_accepts_engine_output_with_optional_fields_missing() -> None:
    text = json.dumps(
        [
            {
                "event_id": 3,
                "data": {
                    "type": "stored",
                    "parent_hash": H1,
                    "blocks": [
                        {
                            "type": "stored_block",
                            "block_hash": H2,
                            "tokens": [
                                {"type": "unique_token", "token_id": 5, "token_extra_id": 0},
                                {"type": "unique_token", "token_id": 6, "token_extra_id": 0},
                            ],
                            "lora_id": 3,
                            "cache_level": 1,
                            "priority": 80,
                            "mm_keys": [{"type": "mm_key", "hash": "ab12", "start_offset": 0}],
                            "future_field": True,
                        }
                    ],
                },
                "window_size": 128,
            }
        ]
    )
    assert parse_trtllm_json(text) == [
        KVCacheEvent(
            event_id=3,
            data=Stored(H1, (StoredBlock(H2, (5, 6), 1, 80, lora_id=3, mm_keys=("ab12",)),)),
            window_size=128,
            layer_group_id=0,
            hash_algo="v1_block_key",
            attention_dp_rank=None,
        )
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "does not parse"),
        ('{"event_id": 1}', "must be a list"),
        ("[1]", "event 0"),
        ('[{"event_id": 1, "window_size": 0, "data": {"type": "frobbed"}}]', "frobbed"),
        ('[{"event_id": "x", "window_size": 0, "data": {"type": "all_cleared"}}]', "event_id"),
        (
            '[{"event_id": 1, "window_size": 0, "data": {"type": "removed", '
            '"block_hashes": [1.5]}}]',
            r"block_hashes\[0\]",
        ),
        (
            '[{"event_id": 1, "window_size": 0, "data": {"type": "removed", '
            '"block_hashes": [18446744073709551616]}}]',
            "64-bit",
        ),
        (
            '[{"event_id": 1, "window_size": 0, "data": {"type": "stored", "parent_hash": null, '
            '"blocks": [{"block_hash": 1, "tokens": [{"token_id": "img"}]}]}}]',
            "token",
        ),
    ],
)
def test_json_parse_rejects_garbage(text: str, match: str) -> None:
    with pytest.raises(EventFormatError, match=match):
        parse_trtllm_json(text)


# ------------------------------------------------------------------------- strategies

U64 = st.integers(0, M64)
HEXES = st.binary(min_size=32, max_size=32).map(bytes.hex)


@st.composite
def event_streams(draw: st.DrawFn, *, vllm: bool = False) -> tuple[str, list[KVCacheEvent]]:
    """Events of one engine: one algorithm, one tokens-per-block, consistent per-event tiers."""
    algo = draw(st.sampled_from(["v1_block_key", "v2_sha256"]))
    hashes: st.SearchStrategy[int | str] = U64 if algo == "v1_block_key" else HEXES
    tpb = draw(st.integers(1, 6))
    rank = draw(st.none() | st.integers(0, 3))
    events: list[KVCacheEvent] = []
    for i in range(draw(st.integers(0, 6))):
        group = draw(st.integers(0, 2))
        window = draw(st.integers(0, 4096))
        kind = draw(st.sampled_from(["stored", "removed", "cleared", "created", "updated"]))
        if vllm and kind in ("created", "updated"):
            kind = "stored"
        data: Any
        if kind == "stored":
            n = draw(st.integers(1, 4))
            tier = draw(st.integers(0, 2))
            lora = draw(st.none() | st.integers(0, 1000))
            sizes = [tpb] * (n - 1) + [draw(st.integers(1, tpb))]
            blocks = tuple(
                StoredBlock(
                    draw(hashes),
                    tuple(draw(st.lists(st.integers(0, 2**31 - 1), min_size=s, max_size=s))),
                    tier,
                    35 if vllm else draw(st.integers(0, 100)),
                    lora,
                )
                for s in sizes
            )
            data = Stored(draw(st.none() | hashes), blocks)
        elif kind == "removed":
            n = draw(st.integers(1, 4))
            levels = None if draw(st.booleans()) else (draw(st.integers(0, 2)),) * n
            data = Removed(tuple(draw(hashes) for _ in range(n)), levels)
        elif kind == "created":
            data = Created(tuple(draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))))
        elif kind == "updated":
            diff = st.none() | st.builds(EventDiff, st.integers(0, 2), st.integers(0, 2))
            data = Updated(draw(hashes), draw(diff), draw(diff))
        else:
            data = AllCleared()
        events.append(KVCacheEvent(i, data, window, group, algo, rank))
    return algo, events


def _without_kvpool_only_fields(event: KVCacheEvent) -> KVCacheEvent:
    data = event.data
    if isinstance(data, Removed):
        data = Removed(data.block_hashes)
    elif isinstance(data, Stored):
        blocks = tuple(msgspec.structs.replace(b, lora_id=None) for b in data.blocks)
        data = Stored(data.parent_hash, blocks)
    return msgspec.structs.replace(event, data=data)


@given(event_streams())
def test_json_round_trips(stream: tuple[str, list[KVCacheEvent]]) -> None:
    _, events = stream
    parsed = parse_trtllm_json(to_trtllm_json(events))
    assert parsed == [_without_kvpool_only_fields(e) for e in events]


# ====================================================================== vLLM msgpack (§3)


def _plain(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)  # generic: plain lists, dicts, ints, bytes


def test_vllm_golden_batch_matches_the_compatibility_shapes() -> None:
    events = [
        KVCacheEvent(
            0,
            Stored(None, (StoredBlock(H1, (1, 2, 3, 4)), StoredBlock(M64, (5, 6, 7, 8)))),
            4096,
        ),
        KVCacheEvent(1, Removed((H1, M64), (1, 1)), 4096),
        KVCacheEvent(2, AllCleared(), 4096),
    ]
    payload = encode_vllm_batch(events, ts=1700000000.5, data_parallel_rank=3)
    expected_events: list[dict[str, Any]] = [
        {
            "type": "BlockStored",
            "block_hashes": [H1, M64],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [H1, M64], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ]
    expected = [1700000000.5, expected_events, 3]
    decoded = _plain(payload)
    assert decoded == expected
    assert [list(e) for e in decoded[1]] == [list(e) for e in expected_events]  # key order
    assert payload[0] == 0x93  # a 3-element array
    assert payload[1:10] == b"\xcb" + struct.pack(">d", 1700000000.5)  # ts as float64
    # Byte for byte what an independent msgpack encoder writes for the same objects.
    assert payload == msgspec.msgpack.encode(expected)


def test_vllm_optional_fields_only_when_not_default() -> None:
    stored = Stored(7, (StoredBlock(8, (1, 2), lora_id=5),))
    payload = encode_vllm_batch(
        [
            KVCacheEvent(0, stored, 128, layer_group_id=1),
            KVCacheEvent(1, stored, 4096, layer_group_id=2),
            KVCacheEvent(2, Removed((8,), (2,)), 128, layer_group_id=1),
        ],
        ts=0.0,
        sliding_window_groups={1},
    )
    sliding, full, removed = _plain(payload)[1]
    assert sliding == {
        "type": "BlockStored",
        "block_hashes": [8],
        "parent_block_hash": 7,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": 5,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
    }
    assert "kv_cache_spec_kind" not in full and full["group_idx"] == 2
    assert "extra_keys" not in full
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [8],
        "medium": "STORAGE",
        "group_idx": 1,
    }
    assert _plain(encode_vllm_batch([], ts=1.0)) == [1.0, [], None]


def test_vllm_hex_hashes_go_out_as_raw_bytes() -> None:
    payload = encode_vllm_batch(
        [KVCacheEvent(0, Stored(HEX, (StoredBlock(HEX, (1,)),)), 0, hash_algo="v2_sha256")], ts=0
    )
    (event,) = _plain(payload)[1]
    assert event["block_hashes"] == [bytes.fromhex(HEX)]
    assert event["parent_block_hash"] == bytes.fromhex(HEX)


def test_vllm_tier_move_is_removed_on_old_medium_then_stored_on_new() -> None:
    payload = encode_vllm_batch(
        [
            KVCacheEvent(0, Updated(H1, cache_level=EventDiff(0, 2)), 64, layer_group_id=1),
            KVCacheEvent(1, Updated(H1, priority=EventDiff(35, 90)), 64),
            KVCacheEvent(2, Created((10,)), 64),
        ],
        ts=0,
    )
    assert _plain(payload)[1] == [
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 1},
        {
            "type": "BlockStored",
            "block_hashes": [H1],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": "STORAGE",
            "lora_name": None,
            "group_idx": 1,
        },
    ]


def test_vllm_remote_tier_is_its_own_medium_both_ways() -> None:
    blocks = (StoredBlock(1, (1, 2), REMOTE_CACHE_LEVEL), StoredBlock(2, (3, 4), 0))
    payload = encode_vllm_batch(
        [KVCacheEvent(0, Stored(None, blocks), 64), KVCacheEvent(1, Removed((1,), (3,)), 64)],
        ts=0,
    )
    events = _plain(payload)[1]
    assert [(e["type"], e["block_hashes"], e["medium"]) for e in events] == [
        ("BlockStored", [1], REMOTE_MEDIUM), ("BlockStored", [2], "GPU"),
        ("BlockRemoved", [1], REMOTE_MEDIUM),
    ]
    decoded = decode_vllm_batch(payload).events
    assert [b.cache_level for b in decoded[0].data.blocks] == [REMOTE_CACHE_LEVEL]
    assert decoded[2].data.cache_levels == (REMOTE_CACHE_LEVEL,)


def test_vllm_mixed_tiers_split_by_medium_keeping_the_chain() -> None:
    blocks = (StoredBlock(1, (1,), 0), StoredBlock(2, (2,), 0), StoredBlock(3, (3,), 1))
    payload = encode_vllm_batch(
        [
            KVCacheEvent(0, Stored(None, blocks), 0),
            KVCacheEvent(1, Removed((1, 2, 3), (0, 1, 0)), 0),
            KVCacheEvent(2, Removed((4,)), 0),
        ],
        ts=0,
    )
    events = _plain(payload)[1]
    assert [(e["type"], e["block_hashes"], e["medium"]) for e in events] == [
        ("BlockStored", [1, 2], "GPU"),
        ("BlockStored", [3], "CPU"),
        ("BlockRemoved", [1, 3], "GPU"),
        ("BlockRemoved", [2], "CPU"),
        ("BlockRemoved", [4], None),  # no tiers: every tier
    ]
    assert events[1]["parent_block_hash"] == 2


@pytest.mark.parametrize(
    "event",
    [
        KVCacheEvent(0, Removed((1,), (4,)), 0),  # tiers 0-3: GPU, CPU, STORAGE, REMOTE
        KVCacheEvent(0, Removed((1 << 64,)), 0),
        KVCacheEvent(0, Removed(("not hex",)), 0),
        KVCacheEvent(0, Removed((1, 2), (0,)), 0),
    ],
)
def test_vllm_encode_rejects_what_the_format_cannot_carry(event: KVCacheEvent) -> None:
    with pytest.raises(InvalidArgumentError):
        encode_vllm_batch([event])


# --------------------------------------------------------------------------------- decode


def _batch(*events: Any, ts: Any = 1.25, rank: Any = None) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), rank])


def test_vllm_decode_map_form_ignores_unknown_keys_and_tolerates_missing_ones() -> None:
    payload = _batch(
        {
            "type": "BlockStored",
            "block_hashes": [10, 11, 12],
            "parent_block_hash": 9,
            "token_ids": [1, 2, 3, 4, 5],
            "block_size": 2,
            "lora_id": 4,
            "medium": "CPU_PINNED",
            "lora_name": "adapter",
            "extra_keys": [None, None, None],
            "group_idx": 2,
            "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 256,
            "locality": "node-3",  # a newer field
        },
        {"type": "BlockStored", "block_hashes": [13], "token_ids": [7]},  # an older engine
        {"type": "BlockRemoved", "block_hashes": [10], "medium": "DISK"},
        {"type": "BlockRemoved", "block_hashes": [11]},
        {"type": "AllBlocksCleared"},
        rank=1,
    )
    batch = decode_vllm_batch(payload, hash_algo="vllm_sha256_cbor", first_event_id=100)
    assert batch.ts == 1.25 and batch.data_parallel_rank == 1
    algo = "vllm_sha256_cbor"
    assert batch.events == [
        KVCacheEvent(
            100,
            Stored(
                9,
                (
                    StoredBlock(10, (1, 2), 1, lora_id=4),
                    StoredBlock(11, (3, 4), 1, lora_id=4),
                    StoredBlock(12, (5,), 1, lora_id=4),
                ),
            ),
            256,
            2,
            algo,
            1,
        ),
        KVCacheEvent(101, Stored(None, (StoredBlock(13, ()),)), 0, 0, algo, 1),
        KVCacheEvent(102, Removed((10,), (2,)), 0, 0, algo, 1),
        KVCacheEvent(103, Removed((11,)), 0, 0, algo, 1),
        KVCacheEvent(104, AllCleared(), 0, 0, algo, 1),
    ]


def test_vllm_decode_cuts_tokens_aligned_to_the_last_block() -> None:
    # A sliding-window group: token_ids cover 3 blocks, hashes name the last 2.
    payload = _batch(
        {
            "type": "BlockStored",
            "block_hashes": [5, 6],
            "token_ids": list(range(6)),
            "block_size": 2,
        }
    )
    (event,) = decode_vllm_batch(payload).events
    assert isinstance(event.data, Stored)
    assert [b.tokens for b in event.data.blocks] == [(2, 3), (4, 5)]


def test_vllm_decode_byte_hashes_by_algorithm() -> None:
    # COMPATIBILITY §1.4: vLLM block 0 (tokens 0..15) and its event id, the last 8 bytes.
    digest = bytes.fromhex("dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749")
    payload = _batch({"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"})
    (as_int,) = decode_vllm_batch(payload).events
    assert as_int.data == Removed((0x1EFEA06206AC0749,), (0,))
    (as_hex,) = decode_vllm_batch(payload, hash_algo="v2_sha256").events
    assert as_hex.data == Removed((digest.hex(),), (0,)) and as_hex.hash_algo == "v2_sha256"


LEGACY_STORED = [
    "BlockStored",
    [21, 22],
    20,
    [1, 2, 3, 4],
    2,
    7,
    "CPU",
    "lora-a",
    [None, None],
    3,
    "sliding_window",
    512,
]


@pytest.mark.parametrize("length", range(6, 13))
def test_vllm_decode_positional_block_stored_of_6_to_12_elements(length: int) -> None:
    (event,) = decode_vllm_batch(_batch(LEGACY_STORED[:length]), first_event_id=5).events
    tier = 1 if length >= 7 else 0
    assert event.data == Stored(
        20, (StoredBlock(21, (1, 2), tier, lora_id=7), StoredBlock(22, (3, 4), tier, lora_id=7))
    )
    assert event.event_id == 5
    assert event.layer_group_id == (3 if length >= 10 else 0)
    assert event.window_size == (512 if length == 12 else 0)


@pytest.mark.parametrize(
    ("raw", "levels", "group"),
    [
        (["BlockRemoved", [1, 2]], None, 0),
        (["BlockRemoved", [1, 2], "STORAGE"], (2, 2), 0),
        (["BlockRemoved", [1, 2], "GPU", 4], (0, 0), 4),
    ],
)
def test_vllm_decode_positional_block_removed(
    raw: list[Any], levels: tuple[int, ...] | None, group: int
) -> None:
    (event,) = decode_vllm_batch(_batch(raw)).events
    assert event.data == Removed((1, 2), levels)
    assert event.layer_group_id == group


def test_vllm_decode_oldest_batches_and_map_batches() -> None:
    old = msgspec.msgpack.encode([3, [["AllBlocksCleared"]]])  # [ts, events], int ts
    batch = decode_vllm_batch(old)
    assert (batch.ts, batch.data_parallel_rank, batch.events) == (
        3.0,
        None,
        [KVCacheEvent(0, AllCleared(), 0, 0, "vllm_sha256_cbor")],
    )
    mapped = msgspec.msgpack.encode(
        {"ts": 2.5, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2}
    )
    batch = decode_vllm_batch(mapped)
    assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (2.5, 2, 1)
    assert batch.events[0].attention_dp_rank == 2


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1", "not msgpack"),
        (b"", "not msgpack"),
        (msgspec.msgpack.encode({"hello": 1}), "batch must be"),
        (msgspec.msgpack.encode([1.0]), "batch must be"),
        (msgspec.msgpack.encode(["now", []]), "ts"),
        (msgspec.msgpack.encode([1.0, 5]), "events"),
        (_batch(17), "event 0"),
        (_batch({"type": "BlockMoved"}), "BlockMoved"),
        (_batch({"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}), "TAPE"),
        (_batch({"type": "BlockRemoved", "block_hashes": "abc"}), "block_hashes"),
        (_batch({"type": "BlockRemoved", "block_hashes": [1.5]}), "hash"),
        (_batch({"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]}), "token_ids"),
        (_batch({"type": "BlockStored", "block_hashes": [1], "block_size": -2}), "block_size"),
        (_batch(["BlockStored", [1], None, [1]]), "6 to 12"),
        (_batch(["BlockRemoved", [1], "GPU", 0, "x"]), "2 to 4"),
        (_batch({"type": "BlockStored", "block_hashes": [1], "group_idx": "g"}), "group_idx"),
    ],
)
def test_vllm_decode_rejects_garbage(payload: bytes, match: str) -> None:
    with pytest.raises(EventFormatError, match=match):
        decode_vllm_batch(payload)


def _expected_after_vllm(
    events: list[KVCacheEvent], sliding: set[int], rank: int | None
) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for event in events:
        data, window = event.data, 0
        if isinstance(data, Stored):
            blocks = tuple(msgspec.structs.replace(b, priority=35, mm_keys=()) for b in data.blocks)
            data = Stored(data.parent_hash, blocks)
            window = event.window_size if event.layer_group_id in sliding else 0
        group = 0 if isinstance(data, AllCleared) else event.layer_group_id
        out.append(KVCacheEvent(len(out), data, window, group, event.hash_algo, rank))
    return out


@given(event_streams(vllm=True), st.sets(st.integers(0, 2)), st.floats(0, 2e9))
def test_vllm_round_trips(
    stream: tuple[str, list[KVCacheEvent]], sliding: set[int], ts: float
) -> None:
    algo, events = stream
    rank = events[0].attention_dp_rank if events else None
    payload = encode_vllm_batch(
        events, ts=ts, data_parallel_rank=rank, sliding_window_groups=sliding,
        partial_blocks=True,
    )
    batch = decode_vllm_batch(payload, hash_algo=algo)
    assert batch.ts == ts and batch.data_parallel_rank == rank
    assert batch.events == _expected_after_vllm(events, sliding, rank)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "move", "clear"]),
            st.integers(0, 1),
            st.lists(st.integers(1, 12), min_size=1, max_size=4),
            st.integers(0, 2),
        ),
        max_size=25,
    )
)
def test_vllm_path_preserves_what_a_consumer_holds(
    hooks: list[tuple[str, int, list[int], int]],
) -> None:
    """Tier moves become removed + stored on the wire; the holdings rebuilt are the same."""
    em = EventManager(10_000, hash_algo="v1_block_key")
    for kind, group, hashes, tier in hooks:
        if kind == "store":
            em.on_stored(group, 0, None, [StoredBlock(h, (h,), tier) for h in hashes])
        elif kind == "remove":
            em.on_removed(group, 0, hashes)
        elif kind == "move":
            em.on_updated(group, 0, hashes[0], cache_level=EventDiff(0, tier))
        else:
            em.on_all_cleared()
    em.flush_iteration_events()
    events = em.get_latest_events(0)
    direct, via_vllm = EventIndex(strict=True), EventIndex(strict=True)
    direct.apply_all(events)
    via_vllm.apply_all(
        decode_vllm_batch(encode_vllm_batch(events, partial_blocks=True),
                          hash_algo="v1_block_key").events
    )
    assert via_vllm.cached == direct.cached == em.announced_blocks()
