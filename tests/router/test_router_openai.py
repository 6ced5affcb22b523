"""Plain OpenAI requests in proxy mode, in process over real HTTP on 127.0.0.1: what the router
forwards to each kind of worker (a fake upstream records it), streaming passed through, the
tokenizer from the config or fetched from a kvpool worker (and fetched again after a failure),
tokenizers that differ refused, errors in OpenAI's shape; and the segment-cached encoder
against the tokenizer it wraps (hypothesis), for tokenizers whose pre-tokenizers differ."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from test_router_service import LOCAL, config, run

from kvpool.errors import ConfigError
from kvpool.router.config import parse_config
from kvpool.router.service import RouterService
from kvpool.router.tokenizer_source import RETRY_S

pytest.importorskip("transformers")

from engine_serve_fixtures import CHAT_TEMPLATE, SPECIAL_TOKENS, tiny_tokenizer
from kvpool.engine.server import tokenizer_document
from kvpool.router.tokenize import TextEncoder

CHAT = [{"role": "system", "content": "Answer briefly. " * 8},
        {"role": "user", "content": "What is a KV cache?"}]
SSE = [b'data: {"choices": [{"delta": {"content": "A"}}]}\n\n', b"data: [DONE]\n\n"]


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])


class Upstream:
    """A worker's HTTP side: records what it is sent, answers JSON or an SSE stream, serves
    ``/health`` and, once ``tokenizer`` is set, ``/v1/tokenizer``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []
        self.tokenizer: bytes | None = None
        self.tokenizer_asks = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append((request.path, raw))
        if json.loads(raw).get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in SSE:
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        return web.json_response({"object": "chat.completion", "choices": []})

    async def _tokenizer(self, request: web.Request) -> web.Response:
        self.tokenizer_asks += 1
        if self.tokenizer is None:
            return web.json_response({"error": "not ready"}, status=503)
        return web.Response(body=self.tokenizer, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/tokenizer", self._tokenizer)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, LOCAL, 0)
        await site.start()
        self.url = f"http://{LOCAL}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def send(base: str, path: str, body: object) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["kvpool", "vllm"])
def test_text_is_forwarded_as_the_worker_takes_it(kind: str, tok_dir: Path) -> None:
    tok = tiny_tokenizer()
    ids = chat_ids(tok, CHAT)

    async def main() -> None:
        up = Upstream()
        await up.start()
        worker = {"id": "w", "kind": kind, "http_base_url": up.url}
        if kind == "vllm":
            worker["approx_blocks"] = [64]
        svc = RouterService(config([worker], proxy=True, tokenizer=str(tok_dir)))
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            chat = {"messages": CHAT, "max_tokens": 2}
            status, headers, _ = await send(base, "/v1/chat/completions", chat)
            assert status == 200 and headers["x-kvpool-worker"] == "w"
            path, raw = up.seen[-1]
            assert path == "/v1/chat/completions"
            if kind == "kvpool":  # the ids the router computed, so the worker does not tokenize
                assert json.loads(raw) == {**chat, "prompt_token_ids": ids}
            else:  # vLLM's chat endpoint takes no ids: as sent
                assert json.loads(raw) == chat

            text = {"prompt": "Once upon a time", "max_tokens": 2}
            assert (await send(base, "/v1/completions", text))[0] == 200
            sent = json.loads(up.seen[-1][1])
            prompt_ids = list(tok.encode("Once upon a time"))
            if kind == "kvpool":
                assert sent == {**text, "prompt_token_ids": prompt_ids}
            else:
                assert sent == {**text, "prompt": prompt_ids}

            # ids already: forwarded byte for byte
            body = b'{"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2}'
            async with aiohttp.ClientSession() as s, s.post(
                    base + "/v1/completions", data=body,
                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
            assert up.seen[-1] == ("/v1/completions", body)

            # a stream passes through as the worker sent it
            status, headers, raw_stream = await send(base, "/v1/chat/completions",
                                                     {**chat, "stream": True})
            assert status == 200
            assert headers["Content-Type"].startswith("text/event-stream")
            assert raw_stream == b"".join(SSE)
            assert svc.router.active_requests("w") == 0  # each finished when its answer ended

            # /metrics: the three text requests counted, with the CPU their tokenizing took
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
                metrics = await resp.text()
            assert "kvpool_router_text_requests_total 3.0" in metrics
            cpu = re.search(r"^kvpool_router_tokenize_cpu_seconds_total (\S+)$", metrics, re.M)
            assert cpu is not None and 0 < float(cpu.group(1)) < 10
        finally:
            await svc.stop()
            await up.stop()

    run(main())


def test_the_tokenizer_is_fetched_from_a_kvpool_worker_again_after_a_failure() -> None:
    async def main() -> None:
        up = Upstream()
        await up.start()
        svc = RouterService(config([{"id": "w", "kind": "kvpool", "http_base_url": up.url}],
                                   proxy=True))
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            status, _, raw = await send(base, "/v1/chat/completions", {"messages": CHAT})
            assert status == 503
            error = json.loads(raw)["error"]
            assert error["type"] == "service_unavailable" and "/v1/tokenizer" in error["message"]
            assert up.tokenizer_asks == 1 and not up.seen

            up.tokenizer = tokenizer_document(tiny_tokenizer(), "tiny")
            await asyncio.sleep(RETRY_S + 0.1)  # a failure is retried, not kept
            status, _, raw = await send(base, "/v1/chat/completions", {"messages": CHAT})
            assert status == 200, raw
            assert json.loads(up.seen[-1][1])["prompt_token_ids"] == chat_ids(
                tiny_tokenizer(), CHAT)
            assert (await send(base, "/v1/chat/completions", {"messages": CHAT}))[0] == 200
            assert up.tokenizer_asks == 2 and svc.text.sources.loads == 1  # then kept
        finally:
            await svc.stop()
            await up.stop()

    run(main())


def test_workers_whose_tokenizers_differ_get_no_text(tmp_path: Path, tok_dir: Path) -> None:
    other = tiny_tokenizer()
    other.chat_template = CHAT_TEMPLATE.replace("<|im_start|>", "<|im_start|> ")
    other.save_pretrained(tmp_path / "other")

    async def main() -> None:
        svc = RouterService(config([
            {"id": "a", "kind": "kvpool", "tokens_per_block": 16, "tokenizer": str(tok_dir)},
            {"id": "b", "kind": "kvpool", "tokens_per_block": 16,
             "tokenizer": str(tmp_path / "other")},
        ], proxy=True))
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            status, _, raw = await send(base, "/v1/chat/completions", {"messages": CHAT})
            assert status == 503 and "differ" in json.loads(raw)["error"]["message"]
            status, _, raw = await send(base, "/route", {"messages": CHAT})
            assert status == 503 and "differ" in json.loads(raw)["error"]
            # ids need no tokenizer
            status, _, raw = await send(base, "/route", {"token_ids": [1, 2, 3]})
            assert status == 200
        finally:
            await svc.stop()

    run(main())


def test_errors_are_openai_error_json(tok_dir: Path) -> None:
    async def main() -> None:
        svc = RouterService(config([{"id": "w", "kind": "kvpool", "tokens_per_block": 16}],
                                   proxy=True, tokenizer=str(tok_dir)))
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            for path, body, status in (
                ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
                ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400),
                ("/v1/completions", {"prompt": ""}, 400),
                ("/v1/completions", {"prompt": [1, "x"]}, 400),
                ("/v1/completions", [1, 2], 400),
                ("/v1/completions", {"prompt_token_ids": [1, 2]}, 502),  # no http_base_url
            ):
                got, _, raw = await send(base, path, body)
                error = json.loads(raw)["error"]
                assert got == status, (body, error)
                assert set(error) == {"message", "type", "code"} and error["code"] == status
            async with aiohttp.ClientSession() as s, s.post(
                    base + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
        finally:
            await svc.stop()

    run(main())


def test_tokenizer_config_keys() -> None:
    cfg = parse_config({"tokenizer": "/models/x", "workers": [
        {"id": "a", "kind": "kvpool"}, {"id": "b", "kind": "kvpool", "tokenizer": "/m/y"}]})
    assert cfg.tokenizer == "/models/x" and cfg.workers[1].tokenizer == "/m/y"
    for bad in ({"tokenizer": ""}, {"tokenizer": 3}):
        with pytest.raises(ConfigError, match=r"^tokenizer: "):
            parse_config({**bad, "workers": [{"id": "a", "kind": "kvpool"}]})


# --------------------------------------------------------------------------- the encoder


def _bpe_tokenizer() -> Any:
    """A byte-level BPE with merges, trained here on a small text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the router routes requests to the worker that caches their prefix"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def _metaspace_tokenizer() -> Any:
    """A sentencepiece-like tokenizer whose pre-tokenizer marks the first piece alone
    (Metaspace, prepend_scheme 'first'), with a BOS added by its post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(["the router routes requests to workers"] * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", *SPECIAL_TOKENS]))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


_ENCODERS: dict[str, tuple[Any, TextEncoder]] = {}


def _encoder(name: str) -> tuple[Any, TextEncoder]:
    if name not in _ENCODERS:
        tok = {"bytes": tiny_tokenizer, "bpe": _bpe_tokenizer,
               "metaspace": _metaspace_tokenizer}[name]()
        _ENCODERS[name] = (tok, TextEncoder(tok))
    return _ENCODERS[name]


_TEXT = st.lists(st.one_of(st.sampled_from(["the", " router", "routes", "  ", "\n", "é", "🚀",
                                            " to", "x", *SPECIAL_TOKENS]),
                           st.text(max_size=6)), max_size=12).map("".join)


@pytest.mark.parametrize("name", ["bytes", "bpe", "metaspace"])
def test_each_probed_tokenizer_is_cut_at_its_added_tokens(name: str) -> None:
    assert _encoder(name)[1].segmented


@given(name=st.sampled_from(["bytes", "bpe", "metaspace"]), prompt=_TEXT,
       messages=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT),
                         min_size=1, max_size=4))
def test_the_encoder_encodes_as_its_tokenizer(name: str, prompt: str,
                                              messages: list[tuple[str, str]]) -> None:
    tok, encoder = _encoder(name)
    chat = [{"role": r, "content": c} for r, c in messages]
    for _ in range(2):  # cold, then from the segment cache
        assert encoder.encode_prompt(prompt) == list(tok.encode(prompt))
        assert encoder.encode_chat(chat) == chat_ids(tok, chat)
