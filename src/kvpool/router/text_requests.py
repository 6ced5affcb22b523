"""A request body's token ids, from its token ids or from its text.

The router's endpoints take a prompt in three forms (docs/router.md):

* token ids: ``token_ids`` (``/route``, ``/query``), ``prompt_token_ids`` (the OpenAI
  endpoints; what ``kvpool serve`` accepts), or a ``/v1/completions`` ``prompt`` that is a
  list of ids;
* ``prompt``, a string: a completion prompt, encoded as ``tokenizer.encode(prompt)``;
* ``messages``: chat messages through the tokenizer's chat template (with the generation
  prompt).

:class:`TextRequests` finds the form and, for text, encodes it with the tokenizer of
:class:`~kvpool.router.tokenizer_source.TokenizerSources`. The event loop renders the chat
template and looks the text's pieces up in the encoder's segment cache
(:mod:`kvpool.router.tokenize`); when more than :data:`INLINE_CHARS` characters are left to
encode, the encoding runs in a thread pool, so a long new prompt never holds the loop while a
long cached one (a shared system prompt, a conversation's earlier turns) costs no thread hop.
Texts over :data:`POOL_CHARS` characters go to the pool whole.

Texts are encoded in batches: a request's text waits for the end of the event loop's turn,
and then all the texts that came in that turn are rendered, then looked up and encoded, one
after the other. Tokenizing runs through a lot of code and data (the template's skeletons, the
segment cache, the chunk table, the interpreter's own); one request at a time between other
requests' routing, all of it is cold each time. Batched, tokenizing cost the router about a
third less CPU at 512 new tokens (docs/router.md). A request waits one loop turn for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import ClientSession
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.errors import InvalidArgumentError
from kvpool.httpserve.messages import chat_messages
from kvpool.router.config import ServiceConfig
from kvpool.router.tokenize import Plan, TextEncoder
from kvpool.router.tokenizer_source import TokenizerSources

__all__ = ["INLINE_CHARS", "POOL_CHARS", "PromptTokens", "TextRequests"]

INLINE_CHARS: Final = 2048
"""Up to this much work left to encode (:attr:`~kvpool.router.tokenize.Plan.work`, in
characters the tokenizer encodes) is encoded on the event loop (about 1 ms at most); more in
the pool."""
POOL_CHARS: Final = 256 * 1024
"""Texts longer than this are rendered, cut and encoded in the pool altogether."""
_POOL_THREADS: Final = 2


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A request's token ids, and whether the router computed them from text."""

    ids: list[int] | array[int]  # text: a u32 array
    from_text: bool


def _ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InvalidArgumentError(f"'{name}' must be a non-empty list of token ids")
    if not all(type(t) is int for t in value):
        raise InvalidArgumentError(f"'{name}' must hold token ids (ints)")
    return value


class TextRequests(Collector):
    """Token ids of request bodies; owns the tokenizing thread pool. Registered in a
    Prometheus registry, it exposes ``kvpool_router_text_requests_total`` and
    ``kvpool_router_tokenize_cpu_seconds_total`` (the CPU time of rendering chat templates and
    encoding, on the event loop and in the pool: what text requests cost beyond token ids) and
    ``kvpool_router_tokenize_batches_total`` (the loop turns whose texts were encoded
    together)."""

    def __init__(self, config: ServiceConfig, session: Callable[[], ClientSession | None]
                 ) -> None:
        self.pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="kvpool-tokenize")
        self.sources = TokenizerSources(config, session, self.pool)
        self.encoded = 0
        self.batches = 0
        self.cpu_s = 0.0
        self._cpu_lock = threading.Lock()
        self._pending: list[tuple[TextEncoder, Callable[[Any], Plan], Any,
                                  asyncio.Future[Plan | array[int]]]] = []

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvpool_router_text_requests",
                                  "Requests whose text the router tokenized.", value=self.encoded)
        yield CounterMetricFamily(
            "kvpool_router_tokenize_cpu_seconds",
            "CPU time spent rendering chat templates and encoding text requests.",
            value=self.cpu_s)
        yield CounterMetricFamily(
            "kvpool_router_tokenize_batches",
            "Batches the text requests were encoded in (texts that came in one event loop turn).",
            value=self.batches)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def openai(self, body: Mapping[str, Any], *, chat: bool) -> PromptTokens:
        """The ids of a ``/v1/completions`` (``chat`` false) or ``/v1/chat/completions``
        body; InvalidArgumentError (a 400) for a body with no usable prompt."""
        if body.get("prompt_token_ids") is not None:
            return PromptTokens(_ids(body["prompt_token_ids"], "prompt_token_ids"), False)
        if chat:
            return PromptTokens(await self.chat(body.get("messages")), True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return PromptTokens(await self.text(prompt), True)
        if isinstance(prompt, list):
            return PromptTokens(_ids(prompt, "prompt"), False)
        raise InvalidArgumentError(
            "'prompt' must be a string or a list of token ids (one prompt per request)"
        )

    async def route_body(self, token_ids: list[int] | None, prompt: str | None,
                         messages: list[Any] | None) -> PromptTokens:
        """The ids of a ``/route`` or ``/query`` body: exactly one of ``token_ids``,
        ``prompt`` and ``messages``."""
        given = [n for n, v in (("token_ids", token_ids), ("prompt", prompt),
                                ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise InvalidArgumentError(
                "give exactly one of 'token_ids', 'prompt' (text) and 'messages' (chat), got "
                + (", ".join(repr(g) for g in given) or "none")
            )
        if token_ids is not None:
            return PromptTokens(token_ids, False)
        if prompt is not None:
            return PromptTokens(await self.text(prompt), True)
        return PromptTokens(await self.chat(messages), True)

    async def text(self, prompt: str) -> array[int]:
        if not prompt:
            raise InvalidArgumentError("'prompt' is empty")
        encoder = await self.sources.encoder()
        ids = await self._encode(encoder, encoder.prepare_prompt, prompt, len(prompt))
        if not ids:
            raise InvalidArgumentError("'prompt' encodes to no tokens")
        return ids

    async def chat(self, messages: object) -> array[int]:
        clean = chat_messages(messages)
        encoder = await self.sources.encoder()
        size = sum(len(m["content"]) for m in clean)
        ids = await self._encode(encoder, encoder.prepare_chat, clean, size)
        if not ids:
            raise InvalidArgumentError("'messages' encode to no tokens")
        return ids

    async def _encode(self, encoder: TextEncoder, prepare: Callable[[Any], Plan], arg: Any,
                      size: int) -> array[int]:
        loop = asyncio.get_running_loop()
        self.encoded += 1
        if size > POOL_CHARS:
            return await loop.run_in_executor(
                self.pool, self._timed, lambda: encoder.finish(prepare(arg)))
        done: asyncio.Future[Plan | array[int]] = loop.create_future()
        self._pending.append((encoder, prepare, arg, done))
        if len(self._pending) == 1:
            loop.call_soon(self._drain)
        got = await done
        if isinstance(got, Plan):
            plan = got
            return await loop.run_in_executor(self.pool, self._timed,
                                              lambda: encoder.finish(plan))
        return got

    def _drain(self) -> None:
        """Encode every text that waits, back to back: each phase's code and caches stay warm
        from one request to the next (one at a time between other requests' routing, the
        same work costs about half again as much)."""
        batch, self._pending = self._pending, []
        self.batches += 1
        start = time.thread_time()
        try:
            plans: list[tuple[TextEncoder, Plan, asyncio.Future[Plan | array[int]]]] = []
            for encoder, prepare, arg, done in batch:
                if done.done():
                    continue
                try:
                    plans.append((encoder, prepare(arg), done))
                except Exception as exc:  # the request's error, raised where it awaits
                    done.set_exception(exc)
            for encoder, plan, done in plans:
                try:
                    done.set_result(encoder.finish(plan) if plan.work <= INLINE_CHARS else plan)
                except Exception as exc:
                    done.set_exception(exc)
        finally:
            self._count(time.thread_time() - start)

    def _timed(self, call: Callable[[], array[int]]) -> array[int]:
        start = time.thread_time()
        try:
            return call()
        finally:
            self._count(time.thread_time() - start)

    def _count(self, seconds: float) -> None:
        with self._cpu_lock:  # the loop and the pool's threads
            self.cpu_s += seconds

    @property
    def encoder(self) -> TextEncoder | None:
        """The tokenizer in use, once loaded."""
        return self.sources.loaded
