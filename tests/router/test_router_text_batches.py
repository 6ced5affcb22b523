"""Text requests encoded in batches (:mod:`kvpool.router.text_requests`): the texts that arrive
in one event loop turn are encoded together, each request still gets its own ids (the
tokenizer's), its own error, and a cancelled one takes nothing from the others; texts with
much left to encode still go to the pool."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_router_service import config, run

from kvpool.errors import InvalidArgumentError

pytest.importorskip("transformers")

from engine_serve_fixtures import tiny_tokenizer
from kvpool.router import text_requests
from kvpool.router.text_requests import TextRequests

# the tiny tokenizer's ChatML template, refusing one role as real templates refuse theirs
_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok = tiny_tokenizer()
    tok.chat_template = _TEMPLATE
    tok.save_pretrained(path)
    return path


def _chat_ids(tok: Any, chat: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])


def _requests(tok_dir: Path) -> TextRequests:
    cfg = config([{"id": "w", "kind": "kvpool", "http_base_url": "http://127.0.0.1:9"}],
                 proxy=True, tokenizer=str(tok_dir))
    return TextRequests(cfg, lambda: None)


def test_texts_of_one_loop_turn_are_encoded_together(tok_dir: Path) -> None:
    tok = tiny_tokenizer()
    tok.chat_template = _TEMPLATE
    chats = [[{"role": "system", "content": "Be brief. " * 20},
              {"role": "user", "content": f"question {i}: what is block {i * 7}?"}]
             for i in range(12)]
    prompts = [f"Once upon a time, {i} routers" for i in range(5)]

    async def main() -> None:
        texts = _requests(tok_dir)
        try:
            await texts.text("warm up")  # loads the tokenizer
            batches = texts.batches
            got = await asyncio.gather(
                *(texts.chat(c) for c in chats), *(texts.text(p) for p in prompts),
                texts.chat([{"role": "tool", "content": "x"}]),
                return_exceptions=True)
            assert texts.batches == batches + 1  # one turn's texts, one batch
            for chat, ids in zip(chats, got[:12], strict=True):
                assert not isinstance(ids, BaseException) and ids.tolist() == _chat_ids(tok, chat)
            for prompt, ids in zip(prompts, got[12:17], strict=True):
                assert not isinstance(ids, BaseException)
                assert ids.tolist() == list(tok.encode(prompt))
            refused = got[17]  # the template's refusal is that request's, and only its
            assert isinstance(refused, InvalidArgumentError) and "no tools" in str(refused)
            assert texts.encoded == 1 + 18
        finally:
            texts.close()

    run(main())


def test_a_cancelled_request_leaves_the_batch_to_the_others(tok_dir: Path) -> None:
    async def main() -> None:
        texts = _requests(tok_dir)
        try:
            await texts.text("warm up")
            first = asyncio.ensure_future(texts.text("the first text"))
            second = asyncio.ensure_future(texts.text("the second text"))
            await asyncio.sleep(0)  # both wait for the batch now
            first.cancel()
            ids = await second
            assert ids.tolist() == list(tiny_tokenizer().encode("the second text"))
            assert first.cancelled()
        finally:
            texts.close()

    run(main())


def test_much_left_to_encode_goes_to_the_pool(tok_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A text whose plan leaves more than INLINE_CHARS to encode is finished in the thread
    pool, not in the batch on the loop."""
    monkeypatch.setattr(text_requests, "INLINE_CHARS", 8)
    threads: list[str] = []

    async def main() -> None:
        texts = _requests(tok_dir)
        try:
            encoder = await texts.sources.encoder()
            real = encoder.finish

            def finish(plan: Any) -> Any:
                import threading

                threads.append(threading.current_thread().name)
                return real(plan)

            encoder.finish = finish  # type: ignore[method-assign]
            short, long = await asyncio.gather(texts.text("hi"), texts.text("a new text " * 9))
            assert long.tolist() == list(tiny_tokenizer().encode("a new text " * 9))
            assert short.tolist() == list(tiny_tokenizer().encode("hi"))
        finally:
            texts.close()

    run(main())
    assert threads[0] == "MainThread" and threads[1].startswith("kvpool-tokenize")
