"""The wire decoders under hostile input: only EventFormatError (the service: 400) escapes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import EventFormatError, InvalidArgumentError
from kvpool.events.model import KVCacheEvent, Removed
from kvpool.events.trtllm_json import parse_trtllm_json, parse_trtllm_keys, to_trtllm_json
from kvpool.events.vllm_msgpack import decode_vllm_batch, decode_vllm_keys, encode_vllm_batch
from kvpool.router.service import parse_route_body

ROOT = Path(__file__).resolve().parents[2]

VLLM: list[Callable[[bytes], object]] = [
    decode_vllm_batch,
    lambda p: decode_vllm_batch(p, tokens=False, hash_algo="v2_sha256"),
    decode_vllm_keys,
    lambda p: decode_vllm_keys(p, tokens=True),
]
TRTLLM: list[Callable[[bytes | str], object]] = [
    parse_trtllm_json,
    lambda p: parse_trtllm_json(p, tokens=False),
    parse_trtllm_keys,
]


@pytest.mark.parametrize("payload", [
    b"\xa1\x8c",  # a map whose key is invalid UTF-8 (killed a router's reader thread)
    b"\x91" * 100_000,  # nesting far past the recursion limit
    b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff",  # 2**32 - 1 events announced, none there
    b"\x93\xcb" + bytes(8) + b"\x91\x82\xa4type\xabBlockStored\xacblock_hashes\x91\xa2\xe9\xe9",
])
@pytest.mark.parametrize("decode", VLLM)
def test_vllm_decoders_refuse_what_broke_them(
    decode: Callable[[bytes], object], payload: bytes
) -> None:
    with pytest.raises(EventFormatError, match="vLLM event batch"):
        decode(payload)


@pytest.mark.parametrize("payload", [
    b'["\xe9"]',  # invalid UTF-8 (stopped a TensorRT-LLM poller)
    "[" * 100_000 + "]" * 100_000,  # nesting far past the recursion limit
    '[{"event_id": 1, "data": {"type": "removed", "block_hashes": ["\ud800"]}}]',  # surrogate
    '[{"event_id": "x", "data": {"type": "all_cleared"}}]',  # a wrong type
])
@pytest.mark.parametrize("decode", TRTLLM)
def test_trtllm_decoders_refuse_what_broke_them(
    decode: Callable[[bytes | str], object], payload: bytes | str
) -> None:
    with pytest.raises(EventFormatError):
        decode(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_vllm_decoders_raise_only_format_errors_on_any_bytes(data: bytes) -> None:
    for decode in VLLM:
        with contextlib.suppress(EventFormatError):
            decode(data)


def _valid_batch(hashes: list[int]) -> bytes:
    return encode_vllm_batch([KVCacheEvent(0, Removed(tuple(hashes), (0,) * len(hashes)), 0)],
                             ts=0.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4), st.data())
def test_mutated_valid_batches_decode_or_raise_format_errors(
    hashes: list[int], data: st.DataObject
) -> None:
    valid = _valid_batch(hashes)
    assert decode_vllm_batch(valid).events[0].data == Removed(tuple(hashes), (0,) * len(hashes))
    pos = data.draw(st.integers(0, len(valid)))
    cut = data.draw(st.integers(0, 8))
    insert = data.draw(st.binary(max_size=8))
    mutated = valid[:pos] + insert + valid[pos + cut:]
    for decode in VLLM:
        with contextlib.suppress(EventFormatError):
            decode(mutated)
    text = to_trtllm_json([KVCacheEvent(0, Removed(tuple(hashes)), 0)]).encode()
    pos = min(pos, len(text))
    mutated_text = text[:pos] + insert + text[pos + cut:]
    for parse in TRTLLM:
        with contextlib.suppress(EventFormatError):
            parse(mutated_text)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.binary(max_size=4))
def test_any_json_value_is_parsed_or_refused_with_format_errors(
    value: object, noise: bytes
) -> None:
    text = json.dumps(value).encode()
    for payload in (text, noise + text, json.dumps([value]).encode()):
        for parse in TRTLLM:
            with contextlib.suppress(EventFormatError):
                parse(payload)
        with contextlib.suppress(InvalidArgumentError):
            parse_route_body(payload)


def test_route_body_with_invalid_utf8_is_a_bad_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="UnicodeDecodeError"):
        parse_route_body(b'{"token_ids": [1, 2], "cache_salt": "\xe9"}')
    assert parse_route_body(msgspec.json.encode({"token_ids": [1, 2]})).token_ids == [1, 2]


def test_fuzz_script_finds_no_escaping_error(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fuzz_decoders.py"), "--count", "600",
         "--seed", "7", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10
    for row in rows:
        assert row["escaped"] == 0, row
        assert row["accepted"] + row["rejected"] == row["inputs"] == 600
        assert row["accepted"] > 0 and row["rejected"] > 0, row  # both kinds were tried
