"""The router as an HTTP service (aiohttp): ``kvpool router --config router.yaml``.

Endpoints
---------
``POST /route``
    ``{"token_ids": [...], "cache_salt"?: str, "request_id"?: str, "prefill_tokens"?: int}``
    → the :class:`~kvpool.router.scoring.RouteDecision` as JSON (chosen worker, matched blocks
    per tier, every candidate's score). 400 for a bad body or bad token ids, 503 when no worker
    is healthy. Instead of ``token_ids``: ``prompt`` (text) or ``messages`` (chat), tokenized
    with the served model's tokenizer (:mod:`kvpool.router.text_requests`; 503 while there is
    none).
``POST /query``
    Each worker's cached prefix of a request per tier, in Mooncake RFC #1403's shape
    (:mod:`kvpool.router.query`); changes nothing.
``POST /finished``
    ``{"request_id": str}`` → ``{"request_id": ..., "finished": bool}`` (false: not active).
``GET /workers``
    Per worker: health state (``unknown``, ``healthy``, ``degraded``, ``unhealthy``; see
    :mod:`kvpool.router.ingest`) and why, whether it is routed to, algorithm, tokens per block,
    blocks per tier, events applied / malformed / anomalies, lag (seconds since its last event
    and batch), transport counters (sequence gaps, replays, snapshots, restarts, decode errors
    and the last one), active requests and pending prefill tokens.
``GET /metrics``
    Prometheus text (:mod:`kvpool.router.metrics`): routes, hit blocks per tier, events applied
    / malformed, anomalies, gaps, replays, missed batches, snapshots, restarts, poll and decode
    errors, a decision-latency histogram and per-worker gauges.
``GET /bus`` (with ``bus: nats``)
    The replica's place in the event stream (:mod:`kvpool.router.nats_bus`): replica id,
    stream sequence held, caught up or not, gaps seen and repaired, messages missed,
    snapshots, in-flight messages, and the index's digest (equal on replicas that hold the
    same blocks).
``GET /health``
    200 while at least one worker may be routed to, else 503.
``POST /v1/completions``, ``POST /v1/chat/completions`` (with ``proxy: true``)
    Requests carrying token ids or text are routed and forwarded to the chosen worker's
    ``http_base_url`` (:mod:`kvpool.router.openai_proxy`); the answer, streamed or not, is
    passed through, and the request is finished when it ends. The ``x-kvpool-worker`` response
    header names the worker. Errors are OpenAI's error JSON.

The service listens where its config says (loopback by default; port 0 picks a free port).
The request boundary is :mod:`kvpool.httpserve`, shared with ``kvpool serve``: request bodies
over ``listen.max_body_bytes`` get 413, bodies not in within ``listen.body_timeout_s`` 408;
every error status (400, 401, 404, 405, 408, 413, 500, 502, 503, and aiohttp's own 400 for
malformed HTTP) comes with a JSON body ``{"error": "..."}``. With ``listen.auth_token_env``
set, every endpoint but ``/health`` requires ``Authorization: Bearer <token>``, the token being
the value of that environment variable (401 otherwise). A 405 names the allowed methods
(``Allow``); ``HEAD`` works wherever ``GET`` does; a request with ``Expect: 100-continue`` gets
its 100 before sending the body, or a 413 at once when its ``Content-Length`` is over the limit.
Past ``listen.max_connections`` open connections a new one gets a JSON 503; a connection idle
(or still sending its request head) for ``listen.keepalive_timeout_s`` is closed. Bodies over
:data:`~kvpool.httpserve.OFFLOAD_BYTES` are decoded in a thread (a ``/route`` body's token ids
in 64 KiB pieces, so the GIL is free for the loop between them), and such a request is routed
in a thread too, while the loop's other uses of the router wait (``/health`` does not): a
10 MiB request (about 1.2 M token ids) never holds up the event loop.

``kvpool router`` runs the service on uvloop when installed (:mod:`kvpool.commands.router`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from array import array
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import ClientSession, ClientTimeout, web

from kvpool.errors import InvalidArgumentError, NoWorkerAvailableError
from kvpool.hashing.keys import tokens_to_u32
from kvpool.httpserve import (
    OFFLOAD_BYTES,
    ROUTER_ERRORS,
    Dispatcher,
    Endpoints,
    GuardedServer,
    ResponseCounts,
    bearer_token,
    decode_json,
    listen,
    read_body,
)
from kvpool.httpserve.jsondoc import decode_token_array, off_loop
from kvpool.router.agreement import DEFAULT_AGREE_MARGIN
from kvpool.router.config import ServiceConfig, WorkerConfig
from kvpool.router.index import KvIndex
from kvpool.router.ingest import HEALTHY, Ingest
from kvpool.router.metrics import CONTENT_TYPE, RouterMetrics
from kvpool.router.nats_bus import NatsBus, bus_worker
from kvpool.router.openai_proxy import CHAT_PATH, COMPLETIONS_PATH, OpenAIProxy
from kvpool.router.query import QueryBody, query
from kvpool.router.scoring import Router
from kvpool.router.text_requests import TextRequests
from kvpool.router.tokenizer_source import TokenizerUnavailableError

__all__ = [
    "RouterService", "parse_finished_body", "parse_route_body", "serve", "token_array",
]

logger = logging.getLogger(__name__)

_JSON = "application/json"
_R = TypeVar("_R")


class _RouteBody(msgspec.Struct):
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    prefill_tokens: int | None = None


class _FinishedBody(msgspec.Struct):
    request_id: str


_ROUTE_DECODER = msgspec.json.Decoder(_RouteBody)
_FINISHED_DECODER = msgspec.json.Decoder(_FinishedBody)
_QUERY_DECODER = msgspec.json.Decoder(QueryBody)
_SIZE_OPTION = "listen.max_body_bytes"


def parse_route_body(raw: bytes) -> _RouteBody:
    """A ``/route`` body; raises :class:`~kvpool.errors.HttpRequestError` (the service's 400)
    for anything else: bad JSON, invalid UTF-8, nesting, wrong types (the schema bounds the
    depth)."""
    body: _RouteBody = decode_json(raw, "/route", _ROUTE_DECODER, depth=None)
    return body


def parse_finished_body(raw: bytes) -> _FinishedBody:
    """A ``/finished`` body; raises as :func:`parse_route_body`."""
    body: _FinishedBody = decode_json(raw, "/finished", _FINISHED_DECODER, depth=None)
    return body


def parse_query_body(raw: bytes) -> QueryBody:
    """A ``/query`` body; raises as :func:`parse_route_body` (messages depth-limited)."""
    body: QueryBody = decode_json(raw, "/query", _QUERY_DECODER)
    return body

_BigRoute = tuple[_RouteBody, "array[int] | list[int] | None"]


def parse_big_route_body(raw: bytes) -> _BigRoute:
    """A large ``/route`` body as :func:`parse_route_body` and :func:`token_array` give it,
    its token ids decoded in pieces (:func:`~kvpool.httpserve.jsondoc.decode_token_array`:
    the GIL free for the event loop between them)."""
    split = decode_token_array(raw, _ROUTE_DECODER, "token_ids")
    if split is not None:
        return split
    body = parse_route_body(raw)
    if body.token_ids is not None and body.prompt is None and body.messages is None:
        return body, token_array(body.token_ids)
    return body, None  # text: the tokenizer's


def token_array(token_ids: list[int] | array[int]) -> array[int] | list[int]:
    """A decoded body's token ids as u32 (the decoder let only ints through, no bools): one C
    pass, after which the router's validation is a copy and a scan of the top bytes, not a
    conversion and a scan for bools. Ids out of u32 range stay a list, for the router to name
    the bad one. A u32 array (ids the router tokenized) is returned as it is."""
    if isinstance(token_ids, array):
        return token_ids
    out = array("I")
    try:
        out.fromlist(token_ids)
    except OverflowError:
        return token_ids
    return out


class RouterService:
    """An index, a router and their ingest, behind an aiohttp application.

    Build it from a :class:`ServiceConfig`; :meth:`start` starts ingestion and listening and
    returns the bound port; :meth:`stop` undoes both.
    """

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.index = KvIndex()
        for w in config.workers:
            self.index.add_worker(
                w.id,
                hash_algo=w.hash_algo,
                tokens_per_block=w.tokens_per_block,
                match_by_tokens=w.match_by_tokens,
            )
        o = config.router
        self.router = Router(
            self.index,
            mode=o.mode,
            tier_weights=o.tier_weights,
            load_weight=o.load_weight,
            temperature=o.temperature,
            prediction_ttl_s=o.prediction_ttl_s,
            max_batch_size=o.max_batch_size,
            request_timeout_s=o.request_timeout_s,
            shared_tier_weight=o.shared_tier_weight,
            shared_tier_blocks=o.shared_tier_blocks,
            agree_margin=(o.agree_margin if o.agree_margin is not None
                          else DEFAULT_AGREE_MARGIN if config.bus == "nats" else 0.0),
            seed=o.seed,
        )
        for w in config.workers:
            if w.approx_blocks is not None:  # publishes no events: its cache is predicted
                self.router.predict_cache(w.id, w.approx_blocks)
            if w.shared_tier is not None:
                self.router.share_tier(w.id, w.shared_tier)
        self.ingest = Ingest(self.index, config.ingest, shared=self.router.shared)
        for w in config.workers:
            self.ingest.add(w if config.bus == "direct" else bus_worker(w))
        self._proxy_ids = itertools.count()  # request ids of /route calls without one (bus)
        self.bus: NatsBus | None = None
        if config.bus == "nats":
            self.bus = NatsBus(config.nats, self.index, self.ingest, self.router)
        self._workers: dict[str, WorkerConfig] = {w.id: w for w in config.workers}
        self._runner: web.ServerRunner | None = None
        self._proxy_session: ClientSession | None = None
        self.limits = config.listen.limits()
        self.text = TextRequests(config, lambda: self._proxy_session)
        self.proxy = OpenAIProxy(self.router, self._workers, self.limits, self.text,
                                 lambda: self._proxy_session, _SIZE_OPTION, self._gated,
                                 self.bus)
        self.responses = ResponseCounts("kvpool_router")
        self.metrics = RouterMetrics(self.router, self.index, self.ingest)
        self.metrics.registry.register(self.responses)
        self.metrics.registry.register(self.text)
        self._token = bearer_token(config.listen.auth_token_env, option="listen.auth_token_env")
        self.port: int | None = None
        # held while a large request is routed in a thread: the loop's other uses of the
        # router wait for it, and the index's resets reach the router after it
        self._routing = asyncio.Lock()

    # ------------------------------------------------------------------------------ lifecycle

    def server(self) -> GuardedServer:
        """The HTTP server (built on the running loop): :mod:`kvpool.httpserve`'s, with the
        endpoints in one dict."""
        endpoints: Endpoints = {
            "/route": {"POST": self._route},
            "/query": {"POST": self._query},
            "/finished": {"POST": self._finished},
            "/workers": {"GET": self._workers_view},
            "/metrics": {"GET": self._metrics},
            "/health": {"GET": self._health},
        }
        if self.bus is not None:
            endpoints["/bus"] = {"GET": self._bus_view}
        if self.config.proxy:
            endpoints[COMPLETIONS_PATH] = {"POST": self.proxy.handle}
            endpoints[CHAT_PATH] = {"POST": self.proxy.handle}
        dispatcher = Dispatcher(endpoints, shape=ROUTER_ERRORS, limits=self.limits,
                                token=self._token, size_option=_SIZE_OPTION,
                                counts=self.responses)
        limit = self.limits.max_body_bytes
        loop = asyncio.get_running_loop()

        def make_request(
            message: Any, payload: Any, protocol: Any, writer: Any, task: Any
        ) -> web.BaseRequest:
            return web.BaseRequest(message, payload, protocol, writer, task, loop,
                                   client_max_size=limit)

        return GuardedServer(dispatcher, request_factory=make_request)

    async def start(self) -> int:
        """Start ingesting and listening; returns the port bound."""
        await self.ingest.start()
        if self.bus is not None:
            try:
                await self.bus.start()
            except BaseException:
                await self._close_clients()
                raise
        # Proxied requests and tokenizer fetches. No total timeout: a streamed completion may
        # run for minutes.
        self._proxy_session = ClientSession(
            timeout=ClientTimeout(total=None, sock_connect=self.config.ingest.http_timeout_s)
        )
        try:
            self._runner, self.port = await listen(self.server(), self.config.host,
                                                   self.config.port)
        except BaseException:
            await self._close_clients()
            raise
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._close_clients()

    async def _close_clients(self) -> None:
        if self.bus is not None:
            await self.bus.stop()
        await self.ingest.stop()
        self.text.close()
        if self._proxy_session is not None:
            await self._proxy_session.close()
            self._proxy_session = None

    # ------------------------------------------------------------------------------ handlers

    async def _route(self, request: web.BaseRequest) -> web.Response:
        raw = await read_body(request, self.limits, _SIZE_OPTION)
        big = len(raw) > OFFLOAD_BYTES
        if big:
            body, tokens = await asyncio.to_thread(parse_big_route_body, raw)
        else:
            body = parse_route_body(raw)
            tokens = None
            if body.token_ids is not None and body.prompt is None and body.messages is None:
                tokens = token_array(body.token_ids)
        if tokens is None:  # text or messages: tokenized as the workers do
            try:
                ids = (await self.text.route_body(body.token_ids, body.prompt,
                                                  body.messages)).ids
            except TokenizerUnavailableError as exc:
                return _error(503, str(exc))
            except InvalidArgumentError as exc:
                return _error(400, str(exc))
            tokens = token_array(ids)
        rid = body.request_id
        if rid is None and self.bus is not None:  # ids unique across replicas
            rid = f"{self.bus.replica_id}-{next(self._proxy_ids)}"
        return await self._routed(tokens, body.cache_salt, rid, body.prefill_tokens,
                                  in_thread=big)

    async def _routed(self, tokens: array[int] | list[int], salt: str | None, rid: str | None,
                      prefill: int | None, *, in_thread: bool = False) -> web.Response:
        """The decision as JSON (503, 400 as the router raises). A large request is routed in
        a thread, the small ones on the loop, never two at once (:attr:`_routing`)."""
        try:
            if in_thread or self._routing.locked():
                async with self._routing:
                    decision = await self._in_thread(
                        functools.partial(self.router.route, tokens, cache_salt=salt,
                                          request_id=rid, prefill_tokens=prefill),
                        in_thread)
            else:
                decision = self.router.route(tokens, cache_salt=salt, request_id=rid,
                                             prefill_tokens=prefill)
        except NoWorkerAvailableError as exc:
            return _error(503, str(exc))
        except InvalidArgumentError as exc:
            return _error(400, str(exc))
        if self.bus is not None:
            self.bus.inflight.routed(decision.request_id)
        return web.Response(body=msgspec.json.encode(decision), content_type=_JSON)

    async def _in_thread(self, call: Callable[[], _R], in_thread: bool) -> _R:
        """``call()`` in a thread (the index defers its resets meanwhile), or at once."""
        if not in_thread:
            return call()
        self.index.defer_resets()
        done = asyncio.ensure_future(asyncio.to_thread(call))
        try:
            return await asyncio.shield(done)
        finally:
            while not done.done():  # cancelled: the thread still uses the router, so the
                with contextlib.suppress(asyncio.CancelledError):  # lock is held till it ends
                    await asyncio.wait([done])
            self.index.flush_resets()

    async def _gated(self, call: Callable[[], _R]) -> _R:
        """``call()`` on the loop, after any large route in its thread."""
        if not self._routing.locked():
            return call()
        async with self._routing:
            return call()

    async def _query(self, request: web.BaseRequest) -> web.Response:
        raw = await read_body(request, self.limits, _SIZE_OPTION)
        body = await off_loop(raw, parse_query_body)
        try:
            body.check()
            tokens = await self.text.route_body(body.token_ids, body.prompt, body.messages)
            answer = query(self.router, tokens_to_u32(token_array(tokens.ids)),
                           body.cache_salt)
        except TokenizerUnavailableError as exc:
            return _error(503, str(exc))
        except InvalidArgumentError as exc:
            return _error(400, str(exc))
        return web.Response(body=msgspec.json.encode(answer), content_type=_JSON)

    async def _finished(self, request: web.BaseRequest) -> web.Response:
        raw = await read_body(request, self.limits, _SIZE_OPTION)
        body = await off_loop(raw, parse_finished_body)
        done = await self._gated(functools.partial(self.router.request_finished,
                                                   body.request_id))
        if self.bus is not None:
            self.bus.inflight.finished(body.request_id)
        return web.json_response({"request_id": body.request_id, "finished": done})

    async def _workers_view(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"workers": await self._gated(self._workers_list)})

    def _workers_list(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for info in self.index.workers():
            cfg = self._workers.get(info.worker_id)
            status = self.ingest.status(info.worker_id)
            out.append({
                "id": info.worker_id,
                "kind": cfg.kind.value if cfg is not None else None,
                "healthy": status.state == HEALTHY,
                "state": status.state,
                "reason": status.reason,
                "routable": info.healthy,
                "hash_algo": info.hash_algo,
                "tokens_per_block": info.tokens_per_block,
                "match_by_tokens": info.match_by_tokens,
                "blocks_per_tier": list(info.blocks_per_tier),
                "capacity_per_tier": (
                    list(info.capacity_per_tier) if info.capacity_per_tier is not None else None
                ),
                "layer_groups": list(info.layer_groups),
                "events_applied": info.events_applied,
                "events_malformed": info.events_malformed,
                "anomalies": info.anomalies,
                "resets": info.resets,
                "last_event_id": info.last_event_id,
                "seconds_since_last_event": (
                    None if info.last_event_age_s is None else round(info.last_event_age_s, 3)
                ),
                "active_requests": self.router.active_requests(info.worker_id),
                "pending_prefill_tokens": self.router.pending_prefill_tokens(info.worker_id),
                "ingest": status.as_dict(),
            })
        return out

    async def _health(self, request: web.BaseRequest) -> web.Response:
        infos = self.index.workers()
        healthy = sum(1 for i in infos if i.healthy)
        return web.json_response(
            {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
             "workers": len(infos)},
            status=200 if healthy else 503,
        )

    async def _metrics(self, request: web.BaseRequest) -> web.Response:
        text = await self._gated(self.metrics.text)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})

    async def _bus_view(self, request: web.BaseRequest) -> web.Response:
        assert self.bus is not None
        return web.json_response({**self.bus.as_dict(), "digest": self.bus.digest()})


def _error(status: int, message: str) -> web.Response:
    return ROUTER_ERRORS.response(status, message)


async def serve(config: ServiceConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Run the service until cancelled; ``on_ready(port)`` once it listens."""
    service = RouterService(config)
    port = await service.start()
    try:
        if on_ready is not None:
            on_ready(port)
        await asyncio.Event().wait()
    finally:
        await service.stop()
