"""kvpool.engine.server over real HTTP on 127.0.0.1: OpenAI completions and chat, streamed and
not, cached tokens in usage, metrics, clear 400s for bad input, refusal of requests larger
than the cache, and abort on client disconnect. Tiny random Llama, byte-level tokenizer."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("prometheus_client")

from engine_serve_fixtures import save_tiny_model  # noqa: E402
from kvpool.engine import Engine  # noqa: E402
from kvpool.engine.models import load_model  # noqa: E402
from kvpool.engine.server import EngineServer  # noqa: E402

TPB = 16
GPU_BLOCKS = 24  # 384 tokens: far below the model's 4,096


class Served:
    """An EngineServer running its own event loop in a thread."""

    def __init__(self, engine: Engine, server: EngineServer | None = None) -> None:
        self.engine = engine
        self.server = server or EngineServer(engine, model_name="tiny", port=0)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: object) -> tuple[int, Any]:
        status, raw = self.request("POST", path, body)
        return status, json.loads(raw)

    def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        status, raw = self.request("POST", path, {**body, "stream": True})
        assert status == 200, raw
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]"
        return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    model, tokenizer = load_model(str(model_dir))
    engine = Engine(model, tokenizer, cache={"tokens_per_block": TPB, "gpu_blocks": GPU_BLOCKS},
                    max_batch_size=4, max_num_tokens=256)
    s = Served(engine, EngineServer(engine, model_name="tiny", port=0,
                                    model_aliases=("tiny-alias",)))
    yield s
    s.close()


def _reference_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def test_completion_matches_transformers_greedy_and_streams_the_same_text(
    served: Served, model_dir: Path
) -> None:
    tok = served.engine.tokenizer
    prompt = "kvpool serves a model"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, answer = served.post("/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["token_ids"] == _reference_greedy(model_dir, tok.encode(prompt), 12)
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    assert answer["usage"]["completion_tokens"] == 12
    chunks = served.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_second_request_reports_its_cached_prefix(served: Served) -> None:
    prompt = list(range(5, 5 + 5 * TPB))  # five full blocks
    first = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})[1]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = served.post("/v1/completions", {"prompt": [*prompt[:-3], 1, 2, 3],
                                             "max_tokens": 2})[1]
    # blocks 0-3 are whole matches; block 4 differs in its last 3 tokens
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 4 * TPB <= cached <= 5 * TPB - 3


def test_chat_uses_the_template_and_streams_a_role_first(served: Served) -> None:
    tok = served.engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, answer = served.post("/v1/chat/completions", body)
    assert status == 200, answer
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    assert answer["usage"]["prompt_tokens"] == len(expected)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    chunks = served.stream("/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": ""}, "'prompt' is empty"),
        ("/v1/completions", {"prompt": []}, "'prompt' is empty"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4096}, "maximum context length"),
        ("/v1/completions", {"prompt": list(range(1, 200)) * 21}, "maximum context length"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "'stream'"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "'n' must be 1"),
        ("/v1/completions", {"prompt": 7}, "'prompt' must be"),
        ("/v1/completions", {"prompt": [1, -2]}, "token ids"),
        ("/v1/completions", {"prompt": [1, 300]}, "is not an id"),
        ("/v1/completions", [1, 2], "JSON object"),
        ("/v1/completions", b'{"prompt": "x"', "bad request body"),
        ("/v1/chat/completions", {"messages": "hi"}, "'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content"),
        # larger than the cache (24 blocks of 16) can ever hold, though the model allows it
        ("/v1/completions", {"prompt": [i % 250 for i in range(300)], "max_tokens": 200}, "blocks"),
    ],
)
def test_bad_input_is_a_clear_400_and_the_server_goes_on(
    served: Served, path: str, body: object, message: str
) -> None:
    status, answer = served.post(path, body)
    assert status == 400
    assert message in answer["error"]["message"]
    status, ok = served.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_client_disconnect_aborts_the_request(served: Served) -> None:
    body = json.dumps({"prompt": "abort me", "max_tokens": 360, "ignore_eos": True,
                       "stream": True}).encode()
    before = served.engine.manager.slot_usage(0, 0)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the stream early"
            received += chunk
    deadline = time.monotonic() + 10
    while served.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not served.engine.has_unfinished_requests()
    after = served.engine.manager.slot_usage(0, 0)
    assert after["used"] == before["used"]  # its blocks went back to the pool
    assert 'kvpool_serve_requests_total{outcome="disconnected"}' in _metrics(served)


def test_models_health_and_metrics(served: Served) -> None:
    status, models = served.request("GET", "/v1/models")
    assert status == 200
    assert json.loads(models)["data"][0]["max_model_len"] == served.engine.max_model_len
    assert served.request("GET", "/health")[0] == 200
    served.post("/v1/completions", {"prompt": "metrics", "max_tokens": 3, "ignore_eos": True})
    text = _metrics(served)
    samples = _samples(text)
    usage = served.engine.manager.slot_usage(0, 0)
    assert samples['kvpool_serve_free_blocks{layer_group="0",tier="0"}'] == usage["free"]
    assert samples['kvpool_serve_evictable_blocks{layer_group="0",tier="0"}'] == (
        usage["evictable"])
    started = samples['kvpool_serve_requests_total{outcome="ok"}'] + samples.get(
        'kvpool_serve_requests_total{outcome="disconnected"}', 0)
    assert samples["kvpool_serve_time_to_first_token_seconds_count"] == started
    assert samples["kvpool_serve_generation_tokens_total"] >= 3
    hit = samples["kvpool_serve_prefix_hit_rate"]
    assert hit == pytest.approx(samples["kvpool_serve_cached_prompt_tokens_total"]
                                / samples["kvpool_serve_prompt_tokens_total"])


def _metrics(served: Served) -> str:
    status, raw = served.request("GET", "/metrics")
    assert status == 200
    return raw.decode()


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_serve_command_binds_its_replay_socket_where_only_its_user_reaches_it() -> None:
    import argparse

    from kvpool.commands.serve import register, replay_endpoint

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def endpoint(*argv: str) -> str | None:
        return replay_endpoint(parser.parse_args(["serve", "--model", "m", *argv]))

    events = ("--kv-events-endpoint", "tcp://127.0.0.1:0")
    assert endpoint(*events) == "ipc://*" and endpoint() is None
    assert endpoint(*events, "--kv-events-replay-endpoint", "none") is None
    assert endpoint(*events, "--kv-events-replay-endpoint", "ipc:///x/r") == "ipc:///x/r"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-blocks", "4", "--gpu-mem", "1GiB"], "--gpu-blocks or --gpu-mem"),
        (["--host-blocks", "4", "--host-mem", "1GiB"], "--host-blocks or --host-mem"),
        (["--disk-mem", "1GiB"], "--disk-mem needs --disk-path"),
        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"], "needs --kv-events-endpoint"),
        (["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint",
          "tcp://127.0.0.1:0"], "tcp:// is refused"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    ],
)
def test_serve_command_refuses_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.cli import main

    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_kv_events_reach_a_subscriber_in_vllm_format(model_dir: Path) -> None:
    from kvpool.events import AllCleared, Stored, ZmqEventSubscriber, decode_vllm_batch

    model, tokenizer = load_model(str(model_dir))
    engine = Engine(model, tokenizer, cache={
        "tokens_per_block": TPB, "gpu_blocks": GPU_BLOCKS,
        "events": {"buffer_max_size": 1000, "hash_algo": "v2_sha256_64"}})
    server = EngineServer(engine, model_name="tiny", port=0,
                          kv_events_endpoint="tcp://127.0.0.1:0",
                          kv_events_replay_endpoint="tcp://127.0.0.1:0")
    s = Served(engine, server)
    assert server.publisher is not None
    sub = ZmqEventSubscriber(server.publisher.endpoint, server.publisher.replay_endpoint)
    try:
        prompt = [i % 250 for i in range(3 * TPB + 5)]
        assert s.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})[0] == 200
        stored: list[Stored] = []
        deadline = time.monotonic() + 20
        while sum(len(e.blocks) for e in stored) < 3 and time.monotonic() < deadline:
            for batch in sub.recv(timeout_s=0.2) or sub.catch_up():
                decoded = decode_vllm_batch(batch.payload, hash_algo="v2_sha256_64")
                stored += [e.data for e in decoded.events if isinstance(e.data, Stored)]
        blocks = [b for e in stored for b in e.blocks]
        assert [list(b.tokens) for b in blocks[:3]] == [prompt[i:i + TPB]
                                                       for i in range(0, 3 * TPB, TPB)]
        # the prompt's partial last block is committed when the request ends, which may be
        # after the answer reached the client: wait for it before a consumer joins
        while time.monotonic() < deadline:
            cached = {h for h, _, tier in engine.manager.cached_blocks() if tier == 0}
            if len(cached) > len(blocks):
                break
            time.sleep(0.01)
        assert {b.block_hash for b in blocks} <= cached
        # a consumer joining now (a router started after the worker) asks for a snapshot: an
        # all-cleared event, then every block published so far, the partial one included
        late = ZmqEventSubscriber(server.publisher.endpoint, server.publisher.replay_endpoint)
        try:
            snap = late.snapshot()
        finally:
            late.close()
        assert snap is not None
        decoded = decode_vllm_batch(snap.payload, hash_algo="v2_sha256_64")
        assert isinstance(decoded.events[0].data, AllCleared)
        in_snapshot = [b for e in decoded.events if isinstance(e.data, Stored)
                       for b in e.data.blocks]
        assert {b.block_hash for b in blocks} <= {b.block_hash for b in in_snapshot}
        assert {b.block_hash for b in in_snapshot} <= cached
        assert len(in_snapshot) == len(blocks) + 1  # + the prompt's partial last block
    finally:
        sub.close()
        s.close()


def test_chat_without_max_tokens_generates_up_to_what_the_cache_holds(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
    status, answer = served.post("/v1/chat/completions", body)
    assert status == 200, answer  # not refused: the model's 4,096 tokens would not fit
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage["total_tokens"] == GPU_BLOCKS * TPB


def test_serve_memory_budgets_size_the_pools_through_the_planner(
    model_dir: Path, tmp_path: Path
) -> None:
    from kvpool.cli import build_parser
    from kvpool.commands.serve import cache_options

    args = build_parser().parse_args([
        "serve", "--model", str(model_dir), "--tokens-per-block", "16", "--gpu-mem", "4MiB",
        "--host-mem", "2MiB", "--disk-mem", "8MiB", "--disk-path", str(tmp_path)])
    model, tokenizer = load_model(str(model_dir))
    engine = Engine(model, tokenizer, cache=cache_options(args))
    config = model.config
    block = (config.num_hidden_layers * 2 * 16 * config.num_key_value_heads
             * (config.hidden_size // config.num_attention_heads) * 4)  # fp32 K and V
    gpu, host, disk = (engine.manager.config.slots[t][0] for t in range(3))
    for slots, budget in ((gpu, 4 << 20), (host, 2 << 20), (disk, 8 << 20)):
        assert budget // 2 < slots * block <= budget


def test_created_is_the_time_of_each_response(served: Served) -> None:
    time.sleep(1.1)  # past the server's start: a start time would be a second old
    before = time.time()
    _, answer = served.post("/v1/completions", {"prompt": "now", "max_tokens": 1})
    chunks = served.stream("/v1/chat/completions", {"messages": [{"role": "user",
                                                                  "content": "now"}],
                                                    "max_tokens": 2})
    _, raw = served.request("GET", "/v1/models")
    after = time.time()
    stamps = [answer["created"], json.loads(raw)["data"][0]["created"],
              *(c["created"] for c in chunks)]
    assert all(before - 1 < t <= after for t in stamps), (before, after, stamps)


@pytest.mark.parametrize("role", ["wizard", "tool", "User"])
def test_an_unknown_chat_role_is_a_400_naming_it(served: Served, role: str) -> None:
    status, answer = served.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "s"}, {"role": role, "content": "hi"}],
        "max_tokens": 1})
    assert status == 400
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert f"messages[1].role {role!r}" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_model_is_the_served_name_an_alias_or_left_out(served: Served, path: str) -> None:
    base: dict[str, Any] = {"max_tokens": 1}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "system", "content": "s"},
                            {"role": "assistant", "content": "a"},
                            {"role": "user", "content": "u"}]
    else:
        base["prompt"] = "hello"
    for model in ("tiny", "tiny-alias", None):
        body = base if model is None else {**base, "model": model}
        status, answer = served.post(path, body)
        assert status == 200, answer
        assert answer["model"] == "tiny"
    status, answer = served.post(path, {**base, "model": "gpt-4"})
    assert status == 404
    assert answer["error"]["code"] == "model_not_found"
    assert answer["error"]["type"] == "invalid_request_error"
    assert "'gpt-4'" in answer["error"]["message"] and "'tiny'" in answer["error"]["message"]
