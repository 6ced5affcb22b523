"""A request body's token ids, from its token ids or from its text.

The router's endpoints take a prompt in three forms (docs/router.md):

* token ids: ``token_ids`` (``/route``, ``/query``), ``prompt_token_ids`` (the OpenAI
  endpoints; what ``kvpool serve`` accepts), or a ``/v1/completions`` ``prompt`` that is a
  list of ids;
* ``prompt``, a string: a completion prompt, encoded as ``tokenizer.encode(prompt)``;
* ``messages``: chat messages through the tokenizer's chat template (with the generation
  prompt).

:class:`TextRequests` finds the form and, for text, encodes it with the tokenizer of
:class:`~kvpool.router.tokenizer_source.TokenizerSources`. Texts longer than
:data:`INLINE_CHARS` characters are encoded in a thread pool, so a long prompt never holds the
event loop; shorter ones (tens of microseconds) on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import ClientSession

from kvpool.errors import InvalidArgumentError
from kvpool.router.config import ServiceConfig
from kvpool.router.tokenize import TextEncoder, chat_messages
from kvpool.router.tokenizer_source import TokenizerSources

__all__ = ["INLINE_CHARS", "PromptTokens", "TextRequests"]

INLINE_CHARS: Final = 2048
"""Texts up to this many characters are encoded on the event loop (a thread hop costs more
than their encoding); longer ones in the pool."""
_POOL_THREADS: Final = 2


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A request's token ids, and whether the router computed them from text."""

    ids: list[int]
    from_text: bool


def _ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InvalidArgumentError(f"'{name}' must be a non-empty list of token ids")
    if not all(type(t) is int for t in value):
        raise InvalidArgumentError(f"'{name}' must hold token ids (ints)")
    return value


class TextRequests:
    """Token ids of request bodies; owns the tokenizing thread pool."""

    def __init__(self, config: ServiceConfig, session: Callable[[], ClientSession | None]
                 ) -> None:
        self.pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="kvpool-tokenize")
        self.sources = TokenizerSources(config, session, self.pool)

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

    async def text(self, prompt: str) -> list[int]:
        if not prompt:
            raise InvalidArgumentError("'prompt' is empty")
        encoder = await self.sources.encoder()
        ids = await self._run(encoder.encode_prompt, prompt, len(prompt))
        if not ids:
            raise InvalidArgumentError("'prompt' encodes to no tokens")
        return ids

    async def chat(self, messages: object) -> list[int]:
        clean = chat_messages(messages)
        encoder = await self.sources.encoder()
        size = sum(len(m["content"]) for m in clean)
        ids = await self._run(encoder.encode_chat, clean, size)
        if not ids:
            raise InvalidArgumentError("'messages' encode to no tokens")
        return ids

    async def _run(self, fn: Callable[[Any], list[int]], arg: Any, size: int) -> list[int]:
        if size <= INLINE_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, arg)

    @property
    def encoder(self) -> TextEncoder | None:
        """The tokenizer in use, once loaded."""
        return self.sources.loaded
