"""The request boundary of both services (kvpool.httpserve) over real HTTP on 127.0.0.1:
``kvpool router``'s service and ``kvpool serve``'s (tiny random Llama). Fuzzed requests
(random JSON, bytes, headers, methods, paths; deep nesting, invalid UTF-8, lone surrogates, a
bearer token that is not UTF-8) never get a 5xx and every error body is JSON in the service's
shape; aiohttp's own answers too; slow clients and a maximal body do not delay /health; every
response is counted by status."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from http_raw import LOCAL, LoopThread, Reply, exchange, request_bytes
from kvpool.httpserve import DEFAULT_MAX_BODY_BYTES, HttpLimits, ResponseCounts
from kvpool.router.config import parse_config
from kvpool.router.service import RouterService

TOKEN = "s3cret-token"
AUTH = (b"Authorization", b"Bearer " + TOKEN.encode())
MAX_BODY = 1 << 20
_ENV = "KVPOOL_TEST_HTTP_BOUNDARY_TOKEN"


@dataclass
class Service:
    name: str
    port: int
    counts: ResponseCounts
    paths: tuple[str, ...]
    valid: tuple[str, bytes]  # a POST that succeeds
    check_error: Callable[[int, Any], None]


def _router_error(status: int, obj: Any) -> None:
    assert set(obj) == {"error"} and isinstance(obj["error"], str) and obj["error"]


def _openai_error(status: int, obj: Any) -> None:
    err = obj["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def router(loop_thread: LoopThread) -> Iterator[Service]:
    os.environ[_ENV] = TOKEN
    cfg = parse_config({
        "listen": {"host": LOCAL, "port": 0, "max_body_bytes": MAX_BODY, "auth_token_env": _ENV,
                   "keepalive_timeout_s": 2, "body_timeout_s": 10},
        "workers": [{"id": "a", "kind": "kvpool", "tokens_per_block": 16}],
    })

    async def start() -> RouterService:
        svc = RouterService(cfg)
        await svc.start()
        return svc

    svc = loop_thread.call(start)
    assert svc.port is not None
    yield Service("router", svc.port, svc.responses, ("/route", "/finished", "/workers",
                  "/metrics", "/health"), ("/route", b'{"token_ids": [1, 2, 3]}'),
                  _router_error)
    loop_thread.call(svc.stop)
    del os.environ[_ENV]


@pytest.fixture(scope="module")
def serve(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine_serve_fixtures import save_tiny_model
    from kvpool.engine import Engine
    from kvpool.engine.models import load_model
    from kvpool.engine.server import EngineServer

    model, tokenizer = load_model(str(save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2)))
    engine = Engine(model, tokenizer, cache={"tokens_per_block": 16, "gpu_blocks": 8},
                    max_batch_size=4, max_num_tokens=128)
    server = EngineServer(engine, model_name="tiny", port=0, auth_token=TOKEN.encode(),
                          limits=HttpLimits(MAX_BODY, None, 2.0, 10.0))
    port = loop_thread.call(server.start)
    yield Service("serve", port, server.responses, ("/v1/completions", "/v1/chat/completions",
                  "/v1/models", "/metrics", "/health"),
                  ("/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 1}'), _openai_error)
    loop_thread.call(server.stop)


def checked(service: Service, replies: list[Reply], *, head: bool = False) -> list[Reply]:
    """Every reply under 500; every error a JSON body in the service's shape (a HEAD's error
    has its headers, no body)."""
    for reply in replies:
        assert reply.status < 500, (reply.status, reply.body[:300])
        if reply.status >= 400 and (reply.body or not head):
            assert reply.headers.get("content-type", "").startswith("application/json"), reply
            service.check_error(reply.status, reply.json())
    return replies


# ---------------------------------------------------------------------------------- fuzzing

_SURROGATES = st.sampled_from(["\ud800abc", "\udfff", "a\udc80b", "\ud83d"])
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
            | st.text(max_size=12) | _SURROGATES)
JSON_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
_TOKENS = st.lists(st.integers(-3, 300) | st.integers(2**31, 2**65), max_size=6)
OPENAI_BODIES = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=12) | _TOKENS | _SURROGATES | JSON_VALUES,
    "prompt_token_ids": _TOKENS | JSON_VALUES,
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system"]) | JSON_VALUES,
        "content": st.text(max_size=12) | _SURROGATES | JSON_VALUES}), max_size=2) | JSON_VALUES,
    "max_tokens": st.integers(-1, 3) | JSON_VALUES,
    "temperature": st.floats(-1, 2) | JSON_VALUES, "top_p": JSON_VALUES, "top_k": JSON_VALUES,
    "seed": st.integers(-(2**64), 2**64) | JSON_VALUES,
    "stop": st.text(max_size=4) | JSON_VALUES, "stop_token_ids": _TOKENS | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES, "stream_options": JSON_VALUES, "n": JSON_VALUES,
    "ignore_eos": JSON_VALUES, "logprobs": JSON_VALUES,
})
ROUTER_BODIES = st.fixed_dictionaries({}, optional={
    "token_ids": _TOKENS | JSON_VALUES, "cache_salt": st.text(max_size=6) | JSON_VALUES,
    "request_id": st.text(max_size=6) | JSON_VALUES, "prefill_tokens": JSON_VALUES,
})
FIXED_BODIES = st.sampled_from([
    b"[" * 100_000 + b"]" * 100_000, b"[" * 100_000, b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}",
    b'{"prompt": "\\ud800abc"}', b'{"token_ids": [1], "cache_salt": "\\udc80"}',
    b'{"prompt": "\xff\xfe"}', b'{"messages": [{"role": "user", "content": "\xc3("}]}',
    b"", b"null", b"NaN", b'{"prompt": 1e999}', b"\xef\xbb\xbf{}",
])
_HEADER_NAMES = st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=12)
_HEADER_VALUES = st.binary(max_size=24).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_AUTHS = st.sampled_from([[AUTH], [AUTH], [], [(b"Authorization", b"Bearer \xff\xfe\x80")],
                          [(b"Authorization", b"Bearer wrong")], [(b"Authorization", b"Basic x")],
                          [(b"Authorization", b"Bearer " + TOKEN.encode() + b"\xff")]])


def _encode(obj: object) -> bytes:
    return json.dumps(obj).encode("utf-8", "surrogatepass")


@st.composite
def requests(draw: st.DrawFn, paths: tuple[str, ...], bodies: st.SearchStrategy[Any]) -> bytes:
    method = draw(st.sampled_from(["POST"] * 4 + ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"]))
    path = draw(st.sampled_from([*paths, *paths, "/", "/nowhere", "//route", "/route?x=%ff",
                                 "/%ff%fe", "/v1/models/x", "/health/", "/\u00e9"]))
    body = draw(st.one_of(bodies.map(_encode), JSON_VALUES.map(_encode), FIXED_BODIES,
                          st.binary(max_size=64)))
    headers = draw(_AUTHS) + draw(st.lists(st.tuples(_HEADER_NAMES.map(str.encode),
                                                     _HEADER_VALUES), max_size=3))
    if draw(st.booleans()):
        headers.append((b"Content-Type", draw(st.sampled_from(
            [b"application/json", b"text/plain", b"application/json; charset=latin-1"]))))
    return request_bytes(method, path, body, headers)


def _fuzz(service: Service, data: bytes) -> None:
    head = data.startswith(b"HEAD ")
    checked(service, exchange(service.port, data, head=head), head=head)


@given(data=requests(("/route", "/finished", "/workers", "/metrics", "/health"), ROUTER_BODIES)
       | st.binary(max_size=80).map(lambda b: b + b"\r\n\r\n"))
def test_fuzzed_requests_to_the_router_get_no_5xx_and_json_errors(
    router: Service, data: bytes
) -> None:
    _fuzz(router, data)


@given(data=requests(("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                      "/health"), OPENAI_BODIES)
       | st.binary(max_size=80).map(lambda b: b + b"\r\n\r\n"))
def test_fuzzed_requests_to_serve_get_no_5xx_and_json_errors(serve: Service, data: bytes) -> None:
    _fuzz(serve, data)


# --------------------------------------------------------------- named shapes and counting


def _shapes(service: Service) -> list[tuple[bytes, int]]:
    post, body = service.valid
    long_header = (b"X-Long", b"a" * 9000)
    many = [(b"X-%d" % i, b"v") for i in range(200)]
    return [
        (request_bytes("POST", post, body, [AUTH]), 200),
        (request_bytes("POST", post, b"[" * 100_000 + b"]" * 100_000, [AUTH]), 400),
        (request_bytes("POST", post, b'{"prompt": "\\ud800abc", "token_ids": "\\ud800abc"}',
                       [AUTH]), 400),
        (request_bytes("POST", post, b'{"prompt": "\xff", "token_ids": [1], "cache_salt": "\xff"}',
                       [AUTH]), 400),
        (request_bytes("POST", post, body, [(b"Authorization", b"Bearer \xff\xfe")]), 401),
        (request_bytes("POST", post, body), 401),
        (request_bytes("GET", "/nowhere", b"", [AUTH]), 404),
        (request_bytes("DELETE", post, b"", [AUTH]), 405),
        (request_bytes("POST", post, b" " * (MAX_BODY + 1), [AUTH]), 413),
        (b"GARBAGE / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
        (request_bytes("GET", "/health", b"", [long_header]), 400),
        (request_bytes("GET", "/health", b"", many), 400),
        (b"POST " + post.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
         b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\nzz\r\n", 400),
        (request_bytes("GET", "/health", b""), 200),
    ]


@pytest.mark.parametrize("which", ["router", "serve"])
def test_every_error_is_json_and_every_status_is_counted(
    which: str, request: pytest.FixtureRequest
) -> None:
    service: Service = request.getfixturevalue(which)
    before = dict(service.counts.by_status)
    statuses: Counter[int] = Counter()
    for data, expected in _shapes(service):
        (reply,) = checked(service, exchange(service.port, data))
        assert reply.status == expected, (data[:80], reply.status, reply.body[:200])
        statuses[reply.status] += 1
    if which == "serve":
        (reply,) = exchange(service.port, request_bytes("GET", "/v1/models", b"", [AUTH]))
        assert reply.status == 200 and reply.json()["data"][0]["id"] == "tiny"
        statuses[200] += 1
    after = service.counts.by_status
    assert {s: after.get(s, 0) - before.get(s, 0) for s in statuses} == dict(statuses)
    (metrics,) = exchange(service.port, request_bytes("GET", "/metrics", b"", [AUTH]))
    prefix = "kvpool_router" if which == "router" else "kvpool_serve"
    for status in statuses:
        assert f'{prefix}_http_responses_total{{code="{status}"}}' in metrics.body.decode()


# ------------------------------------------------------------- slow clients, big bodies


async def _probe(port: int) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(LOCAL, port)
    try:
        writer.write(request_bytes("GET", "/health", b""))
        answer = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    return time.perf_counter() - started


async def _slow_clients_and_a_big_body(port: int, post: str, big: bytes, expect: bytes,
                                       slow: int = 400) -> list[float]:
    """``slow`` connections trickling (half their head, half their body: a byte each every
    50 ms) and one maximal body ``big`` POSTed to ``post`` in 16 pieces, while /health is
    probed: during the upload, then every 20 ms until the big body's answer (its status line
    starts with ``expect``) is in. The probes' latencies."""
    writers = []
    for i in range(slow):
        _, writer = await asyncio.open_connection(LOCAL, port)
        if i % 2:
            writer.write(b"POST " + post.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         b"1000\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        else:
            writer.write(b"POST " + post.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        writers.append(writer)
    reader, big_writer = await asyncio.open_connection(LOCAL, port)
    big_writer.write(request_bytes("POST", post, b"", [AUTH]).replace(
        b"Content-Length: 0", b"Content-Length: %d" % len(big)).split(b"\r\n\r\n")[0] + b"\r\n\r\n")
    answer = asyncio.ensure_future(reader.read())
    latencies: list[float] = []
    piece = -(-len(big) // 16)
    for step in range(16):
        for writer in writers:
            writer.write(b"a")
        big_writer.write(big[step * piece:(step + 1) * piece])
        latencies.append(await _probe(port))
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 30
    while not answer.done() and time.monotonic() < deadline:
        latencies.append(await _probe(port))
        await asyncio.sleep(0.02)
    reply = await asyncio.wait_for(answer, 1)
    assert reply.startswith(expect), reply[:300]
    for writer in [*writers, big_writer]:
        writer.close()
    return latencies


def _token_ids_body(limit: int, key: str, rest: bytes) -> bytes:
    """A JSON body of exactly ``limit`` bytes: ``{key: [token ids...], rest}``, the ids of 6
    and 7 digits (what a real tokenizer's large vocabulary gives)."""
    head, tail = b'{"' + key.encode() + b'": [', b"]" + rest + b"}"
    ids, size, n = [], len(head) + len(tail), 0
    while True:
        token = str(100_000 + n * 7919 % 9_900_000).encode()
        if size + len(token) + 2 > limit:
            break
        ids.append(token)
        size += len(token) + (2 if n else 0)
        n += 1
    body = head + b", ".join(ids) + tail
    return body + b" " * (limit - len(body))  # at most a digit's worth of padding


def test_router_health_answers_every_probe_within_100ms_while_routing_a_maximal_body(
    tmp_path: Path
) -> None:
    """``kvpool router`` (its own process, its default 10 MiB body limit): 400 trickling
    clients and a valid /route request of exactly the limit (about 1.2 M token ids, 73 k
    blocks hashed, walked and predicted): every /health probe under 100 ms."""
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({
        "listen": {"host": LOCAL, "port": 0, "auth_token_env": _ENV},
        "workers": [{"id": "a", "kind": "kvpool", "tokens_per_block": 16,
                     "hash_algo": "vllm_sha256_cbor"}]}))
    env = {**os.environ, _ENV: TOKEN, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "router", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1].split("/")[0].strip())
        big = _token_ids_body(DEFAULT_MAX_BODY_BYTES, "token_ids", b', "request_id": "big"')
        assert len(big) == DEFAULT_MAX_BODY_BYTES
        latencies = asyncio.run(asyncio.wait_for(
            _slow_clients_and_a_big_body(port, "/route", big, b"HTTP/1.1 200 "), 90))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "Traceback" not in err, err
    assert len(latencies) > 16 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_serve_health_answers_every_probe_within_100ms_while_a_maximal_body_is_parsed(
    serve: Service
) -> None:
    """``kvpool serve``'s server: 400 trickling clients and a completion request of exactly
    the body limit (token ids, decoded off the loop; longer than the tiny model's context, so
    answered 400 once parsed and checked): every /health probe under 100 ms."""
    big = _token_ids_body(MAX_BODY, "prompt", b', "max_tokens": 1')
    latencies = asyncio.run(asyncio.wait_for(
        _slow_clients_and_a_big_body(serve.port, "/v1/completions", big, b"HTTP/1.1 400 "), 60))
    assert len(latencies) >= 16 and max(latencies) < 0.1, sorted(latencies)[-5:]


# ------------------------------------------------------------ caps, timeouts, dropped clients


def _with_router(listen: dict[str, Any], check: Callable[[int], Any]) -> None:
    cfg = parse_config({"listen": {"host": LOCAL, "port": 0, **listen},
                        "workers": [{"id": "a", "kind": "kvpool", "tokens_per_block": 16}]})

    async def main() -> None:
        svc = RouterService(cfg)
        port = await svc.start()
        try:
            await check(port)
        finally:
            await svc.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_connection_cap_closes_idle_connections_first_then_answers_503() -> None:
    async def check(port: int) -> None:
        idle = [await asyncio.open_connection(LOCAL, port) for _ in range(8)]
        await asyncio.sleep(0.1)
        assert await _probe(port) < 1.0  # at the cap: the oldest idle connection makes room
        assert await asyncio.wait_for(idle[0][0].read(), 2) == b""
        busy = []
        for _ in range(8):  # each closes one more idle one; busy ones are never closed
            reader, writer = await asyncio.open_connection(LOCAL, port)
            writer.write(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            busy.append((reader, writer))
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection(LOCAL, port)
        answer = await asyncio.wait_for(reader.read(), 5)
        (reply,) = checked_router(answer)
        assert reply.status == 503 and "maximum of 8 connections" in reply.json()["error"]
        assert [await asyncio.wait_for(r.read(), 2) for r, _ in idle] == [b""] * 8
        for _, w in idle + busy:
            w.close()

    _with_router({"max_connections": 8}, check)


def checked_router(raw: bytes) -> list[Reply]:
    from http_raw import parse_replies

    replies = parse_replies(raw)
    for reply in replies:
        if reply.status >= 400:
            _router_error(reply.status, reply.json())
    return replies


def test_idle_and_slow_connections_are_closed_and_a_slow_body_is_a_408() -> None:
    async def check(port: int) -> None:
        started = time.monotonic()
        idle_reader, _ = await asyncio.open_connection(LOCAL, port)
        head_reader, head_writer = await asyncio.open_connection(LOCAL, port)
        head_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its head
        body_reader, body_writer = await asyncio.open_connection(LOCAL, port)
        body_writer.write(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        assert await asyncio.wait_for(idle_reader.read(), 3) == b""
        assert await asyncio.wait_for(head_reader.read(), 3) == b""
        (reply,) = checked_router(await asyncio.wait_for(body_reader.read(), 3))
        assert reply.status == 408 and "did not arrive within 0.4 s" in reply.json()["error"]
        assert time.monotonic() - started < 2.5

    _with_router({"keepalive_timeout_s": 0.4, "body_timeout_s": 0.4}, check)


def test_a_client_gone_mid_body_or_mid_stream_is_one_log_line(
    serve: Service, caplog: pytest.LogCaptureFixture
) -> None:
    async def drop_mid_body() -> None:
        _, writer = await asyncio.open_connection(LOCAL, serve.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        await asyncio.sleep(0.1)
        writer.close()

    async def drop_mid_stream() -> None:
        body = (b'{"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": true, '
                b'"stream": true}')
        reader, writer = await asyncio.open_connection(LOCAL, serve.port)
        writer.write(request_bytes("POST", "/v1/completions", body, [AUTH]))
        received = b""
        while b"data: " not in received:
            chunk = await asyncio.wait_for(reader.read(300), 10)
            assert chunk, received
            received += chunk
        writer.close()

    before = -1
    while before != serve.counts.disconnects:  # earlier tests' clients, still being dropped
        before = serve.counts.disconnects
        time.sleep(0.3)
    with caplog.at_level("INFO"):
        for drop in (drop_mid_body, drop_mid_stream):
            asyncio.run(drop())
        deadline = time.monotonic() + 10
        while serve.counts.disconnects < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert serve.counts.disconnects == before + 2
    assert len(gone) == 2 and "its request body" in gone[0].getMessage()
    assert "the response" in gone[1].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


# ---------------------------------------------------------------------- serve's auth, name


def test_serve_requires_its_bearer_token_everywhere_but_health(serve: Service) -> None:
    for path in ("/v1/models", "/metrics"):
        for headers in ([], [(b"Authorization", b"Bearer nope")],
                        [(b"Authorization", b"Bearer \xff" + TOKEN.encode())],
                        [(b"Authorization", TOKEN.encode())]):
            (reply,) = checked(serve, exchange(serve.port, request_bytes("GET", path, b"",
                                                                         headers)))
            assert reply.status == 401 and reply.headers["www-authenticate"] == "Bearer"
            assert reply.json()["error"]["type"] == "authentication_error"
        (reply,) = exchange(serve.port, request_bytes(
            "GET", path, b"", [(b"Authorization", b"bearer  " + TOKEN.encode())]))
        assert reply.status == 200
    post, body = serve.valid
    assert exchange(serve.port, request_bytes("POST", post, body))[0].status == 401
    assert exchange(serve.port, request_bytes("POST", post, body, [AUTH]))[0].status == 200
    assert exchange(serve.port, request_bytes("GET", "/health", b""))[0].status == 200


def test_serve_command_names_the_model_not_its_path(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.cli import build_parser
    from kvpool.commands.serve import http_options
    from kvpool.errors import ConfigError

    checkpoint = tmp_path / "models" / "tiny-llama"
    checkpoint.mkdir(parents=True)
    gguf = tmp_path / "SmolLM2-135M.Q8_0.gguf"
    gguf.write_bytes(b"")
    parser = build_parser()
    for model, name in ((str(checkpoint), "tiny-llama"), (str(checkpoint) + "/", "tiny-llama"),
                        (str(gguf), "SmolLM2-135M.Q8_0"), ("smollm2", "smollm2")):
        options = http_options(parser.parse_args(["serve", "--model", model]))
        assert options["model_name"] == name and "/" not in name
        assert options["auth_token"] is None
    monkeypatch.setenv("KVPOOL_TEST_SERVE_TOKEN", " tok ")
    options = http_options(parser.parse_args([
        "serve", "--model", str(checkpoint), "--served-model-name", "m", "--auth-token-env",
        "KVPOOL_TEST_SERVE_TOKEN", "--max-body-bytes", "2MiB", "--max-connections", "9",
        "--keepalive-timeout-s", "5", "--body-timeout-s", "7"]))
    assert options["model_name"] == "m" and options["auth_token"] == b"tok"
    assert options["limits"] == HttpLimits(2 << 20, 9, 5.0, 7.0)
    with pytest.raises(ConfigError, match="--auth-token-env"):
        http_options(parser.parse_args(["serve", "--auth-token-env", "KVPOOL_TEST_UNSET_VAR"]))


def test_router_large_bodies_are_parsed_in_a_child_and_answered_as_small_ones(
    router: Service
) -> None:
    """Over OFFLOAD_BYTES a /route body is parsed in the child process and routed in a
    thread: the same answers as on the loop, its refusals the same JSON 400s."""
    from kvpool.httpserve import OFFLOAD_BYTES

    good = _token_ids_body(OFFLOAD_BYTES * 2, "token_ids", b', "request_id": "large"')
    bad_type = good.replace(b"[", b'["x", ', 1)
    bad_json = good[:-1]
    too_big_id = good.replace(b"[", b"[4294967296, ", 1)
    replies = checked(router, [
        exchange(router.port, request_bytes("POST", "/route", body, [AUTH]))[0]
        for body in (good, bad_type, bad_json, too_big_id)])
    assert [r.status for r in replies] == [200, 400, 400, 400], replies
    decision = replies[0].json()
    assert decision["worker_id"] == "a" and decision["request_id"] == "large"
    assert "4294967296" in replies[3].json()["error"]
    finished = exchange(router.port, request_bytes("POST", "/finished", b'{"request_id": "large"}',
                                                   [AUTH]))[0]
    assert finished.json() == {"request_id": "large", "finished": True}
