"""Plain OpenAI requests through ``kvpool router`` (proxy) in front of two ``kvpool serve``
workers (tiny random model, a real byte-level tokenizer with a chat template): real processes
and sockets on 127.0.0.1 (``test_engine_cluster``'s cluster), no tokenizer in the router's
config (it fetches the workers').

A chat request carrying only ``messages`` is answered, streamed and not; a second one sharing a
long system prompt goes to the worker that served the first, and that worker's
``cached_tokens`` equals the router's matched tokens: the shared prefix's whole blocks. The
router's prediction of where routed prefixes go is off (``prediction_ttl_s: 0``), so the match
can only come from the worker's KV events; ``/query`` reports the same prefix on that worker's
device tier."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine_cluster import (  # noqa: F401 - cluster: the two workers and the router
    TPB,
    _matched_tokens,
    cluster,
)

from engine_serve_fixtures import http_request, tiny_tokenizer

SYSTEM = "You answer in French. " * 40  # 880 bytes: 880 tokens of the byte-level tokenizer


@pytest.fixture(scope="module")
def router(cluster: tuple[str, list[str]]) -> str:  # noqa: F811 - the imported fixture
    return cluster[0]


def _worker_blocks(router: str, worker: str) -> int:
    view = http_request(router, "GET", "/workers")[2]["workers"]
    return int(next(w for w in view if w["id"] == worker)["blocks_per_tier"][0])


def _ids(messages: list[dict[str, str]]) -> list[int]:
    """What kvpool serve makes of ``messages``: the chat template's ids."""
    encoded = tiny_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_a_chat_request_with_only_messages_is_answered(router: str) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Bonjour ?"}],
                            "max_tokens": 5, "temperature": 0}
    status, headers, answer = http_request(router, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    assert headers["x-kvpool-worker"] in ("w0", "w1")
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    expected = _ids(body["messages"])
    assert answer["usage"]["prompt_tokens"] == len(expected)

    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = http_request(router, "POST", "/v1/chat/completions", stream)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["prompt_tokens"] == len(expected)
    # the same prompt, tokenized by the router: the same answer as not streamed
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    assert text == answer["choices"][0]["message"]["content"]


def test_completions_with_a_text_prompt_are_answered(router: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    status, _, answer = http_request(router, "POST", "/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == len(tiny_tokenizer().encode("Once upon a time"))


def test_errors_are_openai_error_json(router: str) -> None:
    for body in ({"messages": []}, {"messages": [{"role": "user", "content": 5}]}, {},
                 {"messages": "hi"}):
        status, _, answer = http_request(router, "POST", "/v1/chat/completions", body)
        assert status == 400, answer
        assert set(answer["error"]) >= {"message", "type", "code"}
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] == 400
    status, _, answer = http_request(router, "POST", "/v1/completions", {"prompt": 7})
    assert status == 400 and "'prompt'" in answer["error"]["message"]


def test_a_shared_system_prompt_goes_to_the_worker_that_cached_it(router: str) -> None:
    first, second = _chat("Quelle heure est-il ?"), _chat("Où est la gare ?")
    status, headers, answer = http_request(
        router, "POST", "/v1/chat/completions",
        {"messages": first, "max_tokens": 3, "temperature": 0})
    assert status == 200, answer
    served_by = headers["x-kvpool-worker"]
    ids = [_ids(m) for m in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    whole = shared // TPB * TPB
    assert whole >= 800
    deadline = time.monotonic() + 30
    while _worker_blocks(router, served_by) < whole // TPB and time.monotonic() < deadline:
        time.sleep(0.1)

    status, _, found = http_request(router, "POST", "/query", {"messages": second})
    assert status == 200, found
    assert found["instances"][served_by]["gpu"] == whole
    assert found["prompt_tokens"] == len(ids[1])

    before = _matched_tokens(router)
    status, headers, answer = http_request(
        router, "POST", "/v1/chat/completions",
        {"messages": second, "max_tokens": 3, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}})
    assert status == 200
    assert headers["x-kvpool-worker"] == served_by
    usage = json.loads(answer.decode().split("\n\n")[-3][len("data: "):])["usage"]
    matched = _matched_tokens(router) - before
    assert matched == whole
    assert usage["prompt_tokens_details"]["cached_tokens"] == matched
    assert usage["prompt_tokens"] == len(ids[1])
