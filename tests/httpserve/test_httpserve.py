"""kvpool.httpserve's parts on their own: the JSON depth check against a recursive count
(hypothesis), the rate-limited log, bearer-token comparison, the limits' validation; and
``kvpool router`` held to 1,024 file descriptors by 1,000 slow clients (a subprocess)."""

from __future__ import annotations

import asyncio
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from http_raw import LOCAL, exchange, request_bytes
from kvpool.errors import HttpRequestError, InvalidArgumentError
from kvpool.httpserve import HttpLimits, check_depth, decode_json
from kvpool.httpserve.auth import authorized
from kvpool.httpserve.ratelog import RateLimitedLog

NESTED = st.recursive(st.integers() | st.text(max_size=3) | st.none(),
                      lambda inner: st.lists(inner, max_size=70)
                      | st.dictionaries(st.text(max_size=3), inner, max_size=4),
                      max_leaves=200)


def depth(obj: Any) -> int:
    if isinstance(obj, list):
        return 1 + max(map(depth, obj), default=0)
    if isinstance(obj, dict):
        return 1 + max(map(depth, obj.values()), default=0)
    return 0


@given(obj=NESTED, limit=st.integers(1, 8))
def test_check_depth_refuses_exactly_what_nests_deeper_than_the_limit(obj: Any,
                                                                      limit: int) -> None:
    if depth(obj) > limit:
        with pytest.raises(HttpRequestError, match=f"nest more than {limit} levels") as info:
            check_depth(obj, limit)
        assert info.value.status == 400
    else:
        check_depth(obj, limit)


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'"\\ud800abc"', b"\xff",
                                 b"[" * 33 + b"]" * 33, b"NaN", b"{"])
def test_decode_json_refuses_with_a_400(raw: bytes) -> None:
    with pytest.raises(HttpRequestError) as info:
        decode_json(raw, "test")
    assert info.value.status == 400 and str(info.value).startswith("bad test body")


def test_the_rate_limited_log_writes_a_burst_then_counts(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    log = RateLimitedLog(logging.getLogger("kvpool.test.ratelog"), burst=3, window_s=0.2)
    with caplog.at_level(logging.INFO, "kvpool.test.ratelog"):
        for i in range(10):
            log.log(logging.INFO, "line %d", i)
        time.sleep(0.25)
        log.log(logging.INFO, "after")
    assert [r.getMessage() for r in caplog.records] == [
        "line 0", "line 1", "line 2", "after (7 similar lines held back)"]


def test_bearer_tokens_compare_as_bytes() -> None:
    assert authorized("Bearer tok", b"tok") and authorized("bearer   tok ", b"tok")
    assert not authorized("Basic tok", b"tok") and not authorized("tok", b"tok")
    assert not authorized("Bearer \udcfftok", b"tok") and not authorized("Bearer \ud800", b"t")
    assert authorized("Bearer \udcff", b"\xff")  # the bytes sent, as aiohttp keeps them


@pytest.mark.parametrize("bad", [{"max_body_bytes": 0}, {"max_connections": 0},
                                 {"keepalive_timeout_s": 0.0}, {"body_timeout_s": float("inf")}])
def test_limits_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        HttpLimits(**bad)
    assert HttpLimits(max_connections=1 << 30).connection_cap() < 1 << 30


def test_the_router_at_1024_descriptors_answers_health_past_1000_slow_clients(
    tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("listen: {host: 127.0.0.1, port: 0}\n"
                      "workers:\n  - {id: a, kind: kvpool, tokens_per_block: 16}\n")
    src = str(Path(__file__).resolve().parents[2] / "src")

    def limit_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "router", "--config", str(config), "--log-level",
         "INFO"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit_descriptors,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("kvpool router listening on"), line
        port = int(line.rsplit(":", 1)[1])

        async def slow_clients_then_health() -> list[int]:
            writers = []
            for _ in range(1000):
                _, writer = await asyncio.open_connection(LOCAL, port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                writers.append(writer)
            await asyncio.sleep(0.2)
            statuses = []
            for _ in range(10):
                (reply,) = await asyncio.to_thread(
                    exchange, port, request_bytes("GET", "/health"), timeout=5)
                statuses.append(reply.status)
            for writer in writers:
                writer.close()
            return statuses

        assert asyncio.run(asyncio.wait_for(slow_clients_then_health(), 60)) == [200] * 10
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = err.decode().splitlines()
    assert "Traceback" not in err.decode()
    assert 1 <= len([x for x in lines if "to make room" in x]) <= 12, lines[-5:]
    assert len(lines) < 40, lines[-10:]


_ID_TEXT = st.integers(-5, 2**33).map(str) | st.sampled_from(
    ["", " ", "1.5", '"7"', "[1]", "1e3", "-0", "true", "4611686018427387903",
     "99999999999999999999999"])
_SEPARATORS = st.sampled_from([",", ", ", " ,", ",,", "", "\n,"])


@st.composite
def _token_bodies(draw: st.DrawFn) -> bytes:
    ids = draw(st.lists(st.tuples(_ID_TEXT, _SEPARATORS), max_size=40))
    array_text = "".join(i + sep for i, sep in ids[:-1]) + (ids[-1][0] if ids else "")
    salt = draw(st.sampled_from(['', ', "cache_salt": "s"', ', "cache_salt": "[1, 2]"',
                                 ', "cache_salt": 3', ', "x": [1]']))
    first = draw(st.booleans())
    head = '{"cache_salt": "[9]", ' if draw(st.booleans()) and not salt else "{"
    field = f'"token_ids": [{array_text}]'
    text = head + (field + salt if first or not salt else salt.lstrip(", ") + ", " + field) + "}"
    return text.encode()


@given(_token_bodies(), st.integers(1, 12))
def test_token_arrays_decoded_in_pieces_equal_one_decode(raw: bytes, piece: int) -> None:
    """decode_token_array gives what one decode (and token_array) gives, or None; never a
    different body, whatever the pieces' size."""
    import msgspec

    from kvpool.httpserve import jsondoc
    from kvpool.router.service import _ROUTE_DECODER, token_array

    old = jsondoc._PIECE_BYTES
    jsondoc._PIECE_BYTES = piece  # type: ignore[misc]
    try:
        split = jsondoc.decode_token_array(raw, _ROUTE_DECODER, "token_ids")
    finally:
        jsondoc._PIECE_BYTES = old  # type: ignore[misc]
    try:
        whole = _ROUTE_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        assert split is None
        return
    if split is None:
        return
    body, ids = split
    assert list(ids) == whole.token_ids and type(ids) is type(token_array(whole.token_ids))
    assert (body.cache_salt, body.request_id, body.prefill_tokens) == (
        whole.cache_salt, whole.request_id, whole.prefill_tokens)


def test_a_plain_token_array_is_decoded_in_pieces() -> None:
    from kvpool.httpserve.jsondoc import decode_token_array
    from kvpool.router.service import _ROUTE_DECODER

    ids = b", ".join(b"%d" % i for i in range(100_000))
    raw = b'{"token_ids": [' + ids + b'], "request_id": "r"}'
    split = decode_token_array(raw, _ROUTE_DECODER, "token_ids")
    assert split is not None and list(split[1]) == list(range(100_000))
    assert split[0].request_id == "r"
