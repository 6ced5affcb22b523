"""Engines sharing a remote tier through ``kvpool serve``'s flags (``--remote-url``, a real
redis-server on loopback): what an engine computed, a ``kvpool serve`` process fetches before
admission and reuses (``cached_tokens``, ``kvpool_serve_remote_prefetched_tokens_total``),
and its greedy answer is transformers' own. The flags' checks before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("redis")

from engine_serve_fixtures import KvpoolProcess, http_request, save_tiny_model, stop_all  # noqa: E402
from kvpool.cli import build_parser  # noqa: E402
from kvpool.commands import serve  # noqa: E402
from kvpool.errors import InvalidArgumentError  # noqa: E402
from redis_server import RedisServer  # noqa: E402

TPB = 16
SHARED = 48  # three blocks


def _cache(*argv: str) -> dict[str, object]:
    return serve.cache_options(build_parser().parse_args(["serve", *argv]))


def test_the_remote_flags_name_the_server_the_write_mode_and_the_model() -> None:
    assert "remote" not in _cache()
    url = "redis://127.0.0.1:6379/0"
    got = _cache("--model", "/models/tiny-7b/", "--remote-url", url)
    assert got["remote"] == {"url": url, "write": "evict"} and got["model_id"] == "tiny-7b"
    got = _cache("--remote-url", url, "--remote-write", "store", "--served-model-name", "m")
    assert got["remote"] == {"url": url, "write": "store"} and got["model_id"] == "m"
    with pytest.raises(InvalidArgumentError, match="--remote-write needs --remote-url"):
        _cache("--remote-write", "store")
    with pytest.raises(InvalidArgumentError, match="--remote-url must be a redis:// URL"):
        _cache("--remote-url", "127.0.0.1:6379")


def _complete(base: str, prompt: list[int]) -> dict[str, object]:
    status, _, answer = http_request(base, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def _prefetched(base: str) -> float:
    text = http_request(base, "GET", "/metrics")[2].decode()
    line = next(x for x in text.splitlines()
                if x.startswith("kvpool_serve_remote_prefetched_tokens_total "))
    return float(line.split()[1])


def test_a_second_server_reuses_the_first_engines_prefix_from_the_store(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Engine A (in process, on the cache ``kvpool serve``'s flags give) serves a prompt;
    server B, a ``kvpool serve`` process with the same flags, reuses its prefix."""
    from kvpool.engine import Engine, SamplingParams
    from kvpool.engine.models import load_model

    model_dir = save_tiny_model(tmp_path / "model", seed=3)
    flags = ["--model", str(model_dir), "--tokens-per-block", str(TPB), "--gpu-blocks", "64",
             "--remote-url", redis_server.url, "--remote-write", "store"]
    b = KvpoolProcess("serve", "--port", "0", *flags)  # loads meanwhile
    try:
        model, tokenizer = load_model(str(model_dir))
        a = Engine(model, tokenizer, cache=_cache(*flags))
        base = list(range(100, 100 + SHARED + 5))
        a.generate([base], SamplingParams(max_tokens=2, ignore_eos=True))
        assert a.manager.flush_remote(10)
        a.manager.close()
        url = b.wait_line("kvpool serve listening on ").split()[-1]
        query = [*base[:SHARED], 7, 8, 9, 10]
        answer = _complete(url, query)
        usage = answer["usage"]
        assert isinstance(usage, dict)
        assert usage["prompt_tokens_details"]["cached_tokens"] == SHARED
        assert _prefetched(url) == SHARED
    finally:
        stop_all([b])
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([query]), max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(out[0, len(query):], skip_special_tokens=True)
    choices = answer["choices"]
    assert isinstance(choices, list) and choices[0]["text"] == expected
