"""Proxy mode: ``POST /v1/completions`` and ``/v1/chat/completions`` routed and forwarded.

A request carries its prompt as token ids or as text (:mod:`kvpool.router.text_requests`):
text is tokenized with the served model's tokenizer and chat template, the router routes by
the ids, and the request goes to the chosen worker's ``http_base_url`` with the ids where the
worker takes them, so it does not tokenize again (and differently):

* a ``kvpool`` worker (``kvpool serve``) gets the body with ``prompt_token_ids`` added (it
  reads them instead of ``prompt`` or ``messages``);
* a ``vllm`` or ``trtllm`` worker gets a completion's ``prompt`` replaced by its ids (OpenAI's
  ``prompt`` takes a list of ids); a chat request unchanged (their chat endpoints take no ids;
  they apply the same template);
* a body that carried ids is forwarded byte for byte.

The answer, streamed or not, is passed through with an ``x-kvpool-worker`` header; the request
counts as load on the worker until the answer ends. Every error of these endpoints is OpenAI's
error JSON ``{"error": {"message", "type", "code"}}``, the shape ``kvpool serve`` answers in.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import msgspec
from aiohttp import ClientError, ClientSession, web

from kvpool.errors import HttpRequestError, InvalidArgumentError, NoWorkerAvailableError
from kvpool.httpserve import OPENAI_ERRORS, HttpLimits, decode_json, read_body
from kvpool.httpserve.jsondoc import off_loop
from kvpool.router.config import WorkerConfig, WorkerKind
from kvpool.router.nats_bus import NatsBus
from kvpool.router.scoring import Router
from kvpool.router.text_requests import TextRequests
from kvpool.router.tokenizer_source import TokenizerUnavailableError

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "OpenAIProxy", "forwarded_body"]

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"
_JSON: Final = "application/json"
Gate = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs a call of the router's after any large route in its thread (RouterService._gated)."""
_CLOSING: Final = (408, 413)


def _parse(raw: bytes) -> Any:
    return decode_json(raw, "request")


def forwarded_body(body: Mapping[str, Any], ids: list[int] | array[int], kind: WorkerKind,
                   *, chat: bool) -> dict[str, Any] | None:
    """What a request whose ids the router computed is forwarded as to a ``kind`` worker;
    None: the body unchanged."""
    if isinstance(ids, array):
        ids = ids.tolist()
    if kind is WorkerKind.KVPOOL:
        return {**body, "prompt_token_ids": ids}
    if not chat:
        return {**body, "prompt": ids}
    return None


class OpenAIProxy:
    """The two OpenAI endpoints of a router in proxy mode."""

    def __init__(self, router: Router, workers: Mapping[str, WorkerConfig], limits: HttpLimits,
                 text: TextRequests, session: Callable[[], ClientSession | None],
                 size_option: str, gate: Gate, bus: NatsBus | None = None) -> None:
        self.router = router
        self._bus = bus  # replicas: request ids unique across them, in-flight state shared
        self._gate = gate  # the router's calls wait for a large route in its thread
        self.workers = workers
        self.limits = limits
        self.text = text
        self._session = session
        self._size_option = size_option
        self._ids = itertools.count()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        chat = request.path == CHAT_PATH
        try:
            raw = await read_body(request, self.limits, self._size_option)
            body = await off_loop(raw, _parse)
            if not isinstance(body, dict):
                raise InvalidArgumentError("the request body must be a JSON object")
            tokens = await self.text.openai(body, chat=chat)
        except HttpRequestError as exc:
            response = OPENAI_ERRORS.response(exc.status, str(exc))
            if exc.status in _CLOSING:
                response.force_close()
            return response
        except TokenizerUnavailableError as exc:
            return OPENAI_ERRORS.response(503, str(exc))
        except InvalidArgumentError as exc:
            return OPENAI_ERRORS.response(400, str(exc))
        salt = body.get("cache_salt")
        rid = f"proxy-{next(self._ids)}"
        if self._bus is not None:
            rid = f"{self._bus.replica_id}-{rid}"
        try:
            decision = await self._gate(functools.partial(
                self.router.route, tokens.ids,
                cache_salt=salt if isinstance(salt, str) else None, request_id=rid))
        except NoWorkerAvailableError as exc:
            return OPENAI_ERRORS.response(503, str(exc))
        except InvalidArgumentError as exc:
            return OPENAI_ERRORS.response(400, str(exc))
        if self._bus is not None:
            self._bus.inflight.routed(rid)
        try:
            cfg = self.workers.get(decision.worker_id)
            if tokens.from_text and cfg is not None:
                new = forwarded_body(body, tokens.ids, cfg.kind, chat=chat)
                if new is not None:
                    raw = await off_loop(raw, lambda _raw: msgspec.json.encode(new))
            return await self._forward(request, decision.worker_id, cfg, raw)
        finally:
            await self._gate(functools.partial(self.router.request_finished, rid))
            if self._bus is not None:
                self._bus.inflight.finished(rid)

    async def _forward(self, request: web.BaseRequest, worker_id: str,
                       cfg: WorkerConfig | None, raw: bytes) -> web.StreamResponse:
        session = self._session()
        if cfg is None or cfg.http_base_url is None or session is None:
            return OPENAI_ERRORS.response(502, f"worker {worker_id!r} has no http_base_url")
        try:
            async with session.post(cfg.http_base_url + request.path, data=raw,
                                    headers={"Content-Type": _JSON}) as upstream:
                resp = web.StreamResponse(
                    status=upstream.status,
                    headers={
                        "Content-Type": upstream.headers.get("Content-Type", _JSON),
                        "x-kvpool-worker": worker_id,
                    },
                )
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (ClientError, TimeoutError) as exc:
            return OPENAI_ERRORS.response(502, f"worker {worker_id!r} failed: {exc}")
