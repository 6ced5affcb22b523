"""An OpenAI-compatible HTTP server over one :class:`~kvpool.engine.Engine` (aiohttp):
``kvpool serve --model smollm2``.

Endpoints
---------
``POST /v1/completions``
    ``prompt`` is a string or a list of token ids (one prompt per request). Sampling fields:
    ``max_tokens`` (default 16), ``temperature`` (default 1.0), ``top_p``, ``top_k``, ``seed``,
    ``stop`` (a string or a list), ``stop_token_ids``, ``ignore_eos``; ``stream`` (SSE
    ``data: {...}`` chunks, then ``data: [DONE]``) with ``stream_options.include_usage``.
``POST /v1/chat/completions``
    ``messages`` through the tokenizer's chat template; ``max_tokens`` or
    ``max_completion_tokens`` (default: up to the model's length). Same sampling fields.
    Both endpoints take ``prompt_token_ids`` instead of the prompt or messages (what
    ``kvpool router``'s proxy mode routes on) and answer with ``usage`` including
    ``prompt_tokens_details.cached_tokens`` (prompt tokens reused from the KV cache).
``GET /v1/models``, ``GET /health``
``GET /v1/tokenizer``
    The tokenizer's files as ``save_pretrained`` writes them (``tokenizer.json``, its config,
    the chat template), ``{"object": "tokenizer", "model", "files": {name: base64}}``: what
    ``kvpool router`` tokenizes text requests with. 404 for a model without a tokenizer.
``GET /metrics``
    Prometheus text: requests by outcome, prompt / cached prompt / generated tokens, the prefix
    hit rate, a time-to-first-token histogram, generated tokens per second (last 10 s), free
    and evictable blocks per tier and layer group, and the prompt tokens a shared remote tier
    made reusable (``kvpool serve --remote-url``).

Bad input is a JSON 400 naming the field (malformed JSON, invalid UTF-8 or a lone surrogate,
nesting deeper than 32, wrong types, an empty prompt, a prompt too long for the model, bad
sampling values, a request larger than the KV cache can ever hold); such a request never
reaches the engine or is refused by its admission, and the engine goes on. A client that
disconnects aborts its request (one log line, no traceback).

The request boundary is :mod:`kvpool.httpserve`, shared with ``kvpool router``: every error,
aiohttp's own (404, 405, 413, 400 for malformed HTTP) included, is a JSON body in OpenAI's
shape ``{"error": {"message", "type", "code"}}``; the body limit, connection cap and timeouts
are :class:`~kvpool.httpserve.HttpLimits`; with a bearer token every endpoint but ``/health``
requires ``Authorization: Bearer <token>`` (401). Bodies are decoded and tokenized in a
thread of their own, not on the event loop. ``/metrics`` counts every response by status.

Shutdown: :meth:`EngineServer.stop` stops accepting connections at once, closes idle ones,
lets the requests in flight finish for up to ``shutdown_grace_s`` seconds and then cancels what
is left (each cancelled request is aborted in the engine, its blocks freed);
:meth:`EngineServer.abort_in_flight` cancels them at once (``kvpool serve`` on a second
SIGINT or SIGTERM). Then the engine thread ends after its current step.

Threads: the engine is single-threaded and runs in its own thread (:class:`EngineLoop`); the
event loop hands it requests and aborts through a queue and receives each step's outputs
through ``loop.call_soon_threadsafe``. With KV events on, a third thread publishes the
manager's events as vLLM msgpack batches over ZeroMQ (:class:`EventPublisherThread`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import queue
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.engine.engine import Engine, RequestOutput
from kvpool.engine.protocol import Answer, ParsedRequest, UnknownModelError, parse_request
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import (
    CapacityError,
    HttpRequestError,
    InvalidArgumentError,
    KVPoolError,
    OutOfBlocksError,
)
from kvpool.events.nats_publisher import NatsEventPublisher
from kvpool.events.publishing import BatchPublisher, EventSink
from kvpool.httpserve import (
    OPENAI_ERRORS,
    Dispatcher,
    GuardedServer,
    HttpLimits,
    ResponseCounts,
    decode_json,
    listen,
    read_body,
)

__all__ = ["DEFAULT_SHUTDOWN_GRACE_S", "EngineLoop", "EngineServer", "EventPublisherThread",
           "tokenizer_document"]

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException
_Sink = Callable[[_Item], None]
_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATE_WINDOW_S = 10.0
_CANCEL_WAIT_S = 1.0  # for a cancelled request's handler to end
DEFAULT_SHUTDOWN_GRACE_S = 20.0
"""How long :meth:`EngineServer.stop` lets the requests in flight finish before it cancels
them (below the 30 s a supervisor such as Kubernetes waits before SIGKILL)."""
SIZE_OPTION = "--max-body-bytes"


class EngineLoop(threading.Thread):
    """Runs ``engine.step()`` in one thread while requests are unfinished.

    ``submit`` and ``abort`` may be called from any thread. Every submitted request's sink gets
    its outputs in order, the last one ``finished``; a request the engine refuses gets the
    exception instead (and nothing else). If a step raises, every unfinished request gets
    that exception and is aborted.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__(name="kvpool-engine", daemon=True)
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, str, Any, Any, _Sink | None]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, _Sink] = {}
        self._stopping = threading.Event()
        self.steps = 0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               sink: _Sink) -> None:
        self._commands.put(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None, None))

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", "", None, None, None))

    def run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._drain(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()  # flushes the step's KV events
            except Exception as exc:  # an engine bug: fail its requests, keep serving
                logger.exception("engine step failed")
                for rid, failed in list(self._sinks.items()):
                    with contextlib.suppress(KVPoolError):
                        engine.abort(rid)
                    failed(exc)
                self._sinks.clear()
                continue
            self.steps += 1
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)

    def _drain(self, *, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            kind, rid, prompt, params, sink = cmd
            if kind == "add" and sink is not None:
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as exc:  # refused: the request's error, the engine goes on
                    if not isinstance(exc, KVPoolError | ValueError):
                        logger.exception("add_request(%s) failed", rid)
                    sink(exc)
                    continue
                self._sinks[rid] = sink
            elif kind == "abort" and rid in self._sinks:
                del self._sinks[rid]
                with contextlib.suppress(KVPoolError):
                    self.engine.abort(rid)


class EventPublisherThread(threading.Thread):
    """Runs a :class:`~kvpool.events.publishing.BatchPublisher`'s loop over the engine
    manager's KV events (vLLM msgpack batches on ZeroMQ with snapshots of every block, or onto NATS
    JetStream)."""

    def __init__(self, engine: Engine, batches: BatchPublisher) -> None:
        super().__init__(name="kvpool-kv-events", daemon=True)
        self.engine = engine
        self.batches = batches
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        self.batches.run(self.engine.manager.get_latest_events, self._stopping)


class _Metrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_serve_requests", "Requests by outcome.", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("kvpool_serve_prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.cached_tokens = Counter("kvpool_serve_cached_prompt_tokens",
                                     "Prompt tokens reused from the KV cache.", registry=r)
        self.generated = Counter("kvpool_serve_generation_tokens", "Tokens generated.",
                                 registry=r)
        self.ttft = Histogram("kvpool_serve_time_to_first_token_seconds",
                              "From request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        Gauge("kvpool_serve_prefix_hit_rate",
              "Cached prompt tokens / prompt tokens, all requests so far.",
              registry=r).set_function(self._hit_rate)
        Gauge("kvpool_serve_generation_tokens_per_second",
              f"Tokens generated per second over the last {_RATE_WINDOW_S:g} s.",
              registry=r).set_function(self._rate)
        self.free = Gauge("kvpool_serve_free_blocks", "Free KV blocks per tier and layer group.",
                          ["tier", "layer_group"], registry=r)
        self.evictable = Gauge("kvpool_serve_evictable_blocks",
                               "Cached, unreferenced KV blocks per tier and layer group.",
                               ["tier", "layer_group"], registry=r)
        self.remote_tokens = Counter(
            "kvpool_serve_remote_prefetched_tokens",
            "Prompt tokens the shared remote tier made reusable before admission.", registry=r)
        self._remote_seen = 0
        self._engine = engine
        self._recent: deque[tuple[float, int]] = deque()
        self._prompt_total = 0
        self._cached_total = 0
        self._lock = threading.Lock()

    def count_prompt(self, prompt: int, cached: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        with self._lock:
            self._prompt_total += prompt
            self._cached_total += cached

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def count_generated(self, n: int) -> None:
        if n:
            self.generated.inc(n)
            with self._lock:
                self._recent.append((time.monotonic(), n))

    def _rate(self) -> float:
        horizon = time.monotonic() - _RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / _RATE_WINDOW_S

    def exposition(self) -> bytes:
        manager = self._engine.manager
        config = manager.config
        for tier in range(len(config.slots)):
            for group in range(config.num_groups):
                usage = manager.slot_usage(tier, group)
                self.free.labels(str(tier), str(group)).set(usage["free"])
                self.evictable.labels(str(tier), str(group)).set(usage["evictable"])
        with self._lock:  # the engine thread's count so far (an int: read whole)
            total = self._engine.scheduler.remote_tokens
            self.remote_tokens.inc(max(0, total - self._remote_seen))
            self._remote_seen = max(total, self._remote_seen)
        return generate_latest(self.registry)


class EngineServer:
    """The HTTP front of one engine: :meth:`start` starts the engine thread, the KV event
    publisher (when ``kv_events_endpoint`` is set) and listening, and returns the bound port;
    :meth:`stop` undoes all three, giving the requests in flight up to ``shutdown_grace_s``
    seconds to finish.

    ``model_name`` is what ``/v1/models`` lists and answers carry; a request's ``model`` must be
    it or one of ``model_aliases`` (else a 404 ``model_not_found``); ``limits`` the request
    boundary's (default :class:`~kvpool.httpserve.HttpLimits`); ``auth_token`` the bearer
    token clients must send (None: no auth).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
        limits: HttpLimits | None = None,
        auth_token: bytes | None = None,
        model_aliases: tuple[str, ...] = (),
        nats_url: str | None = None,
        nats_worker: str = "kvpool-serve",
    ) -> None:
        if not shutdown_grace_s >= 0:
            raise InvalidArgumentError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s}")
        self.engine = engine
        self.shutdown_grace_s = shutdown_grace_s
        self._in_flight: set[asyncio.Task[Any]] = set()
        self.model_name = model_name
        self.model_names = tuple(dict.fromkeys((model_name, *model_aliases)))
        self.host = host
        self.port = port
        self.limits = limits or HttpLimits()
        self.auth_token = auth_token
        self.loop_thread = EngineLoop(engine)
        self.metrics = _Metrics(engine)
        self.responses = ResponseCounts("kvpool_serve")
        self.metrics.registry.register(self.responses)
        # one thread decodes and tokenizes bodies: off the event loop, one body at a time
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="kvpool-serve-parse")
        self.publisher: EventSink | None = None
        self._events_thread: EventPublisherThread | None = None
        if kv_events_endpoint is not None or nats_url is not None:
            config = engine.manager.config
            batches = BatchPublisher(
                kv_events_endpoint, kv_events_replay_endpoint,
                block_size=config.tokens_per_block, snapshots=nats_url is None,
                sliding_window_groups=[g for g, w in enumerate(config.window_sizes)
                                       if w is not None],
                # kvpool.events.nats_publisher: the stream keeps the history, no snapshots
                sink=None if nats_url is None else NatsEventPublisher(nats_url, nats_worker))
            self.publisher = batches.publisher
            self._events_thread = EventPublisherThread(engine, batches)
        self._runner: web.ServerRunner | None = None
        self._tokenizer_doc: bytes | None = None
        config = engine.manager.config
        full = [config.slots[0][g] for g, w in enumerate(config.window_sizes) if w is None]
        self._cache_tokens = min(full) * config.tokens_per_block if full else None

    def server(self) -> GuardedServer:
        """The HTTP server (built on the running loop): :mod:`kvpool.httpserve`'s."""
        dispatcher = Dispatcher({
            "/v1/completions": {"POST": self._tracked(self._completions)},
            "/v1/chat/completions": {"POST": self._tracked(self._chat)},
            "/v1/models": {"GET": self._tracked(self._models)},
            "/v1/tokenizer": {"GET": self._tracked(self._tokenizer)},
            "/health": {"GET": self._tracked(self._health)},
            "/metrics": {"GET": self._tracked(self._metrics)},
        }, shape=OPENAI_ERRORS, limits=self.limits, token=self.auth_token,
            size_option=SIZE_OPTION, counts=self.responses)
        return GuardedServer(dispatcher, handler_cancellation=True)

    async def start(self) -> int:
        self.loop_thread.start()
        if self._events_thread is not None:
            self._events_thread.start()
        try:
            self._runner, self.port = await listen(self.server(), self.host, self.port,
                                                   shutdown_timeout=_CANCEL_WAIT_S)
        except KVPoolError:
            self._stop_threads()
            raise
        return self.port

    @property
    def in_flight(self) -> int:
        """Requests being handled now."""
        return len(self._in_flight)

    def abort_in_flight(self) -> int:
        """Cancel every request being handled (each is aborted in the engine); returns how
        many. During :meth:`stop`, this ends the grace period at once."""
        tasks = list(self._in_flight)
        for task in tasks:
            task.cancel()
        return len(tasks)

    def _tracked(self, handler: _Handler) -> _Handler:
        """``handler``, counted in :attr:`in_flight` while it runs (what :meth:`stop` drains
        and :meth:`abort_in_flight` cancels)."""

        async def tracked(request: web.BaseRequest) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            self._in_flight.add(task)
            try:
                return await handler(request)
            finally:
                self._in_flight.discard(task)

        return tracked

    async def stop(self) -> None:
        """Stop accepting, give the requests in flight ``shutdown_grace_s`` seconds, cancel
        the rest, stop the engine thread and the KV event publisher."""
        runner = self._runner
        if runner is not None:
            for site in list(runner.sites):  # no new connection
                await site.stop()
            if runner.server is not None:  # idle keep-alive connections close now, busy
                runner.server.pre_shutdown()  # ones after their request: no new request
            await self._drain()
            await runner.cleanup()
            self._runner = None
        self._stop_threads()

    async def _drain(self) -> None:
        """Wait up to ``shutdown_grace_s`` for the requests in flight (less if
        :meth:`abort_in_flight` cancels them), then cancel what is left."""
        deadline = time.monotonic() + self.shutdown_grace_s
        while self._in_flight and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(set(self._in_flight), timeout=left)
        if self._in_flight:
            logger.warning("shutdown: aborting %d request(s) still in flight after %g s",
                           len(self._in_flight), self.shutdown_grace_s)
            tasks = set(self._in_flight)
            self.abort_in_flight()
            await asyncio.wait(tasks, timeout=_CANCEL_WAIT_S)

    def _stop_threads(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)
        self.loop_thread.stop()
        if self.loop_thread.is_alive():
            self.loop_thread.join(timeout=10)
        if self._events_thread is not None:
            self._events_thread.stop()
            if self._events_thread.is_alive():
                self._events_thread.join(timeout=5)
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------------------ handlers

    async def _models(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvpool", "max_model_len": self.engine.max_model_len,
        }]})

    async def _tokenizer(self, request: web.BaseRequest) -> web.Response:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return OPENAI_ERRORS.response(404, f"the model {self.model_name!r} has no tokenizer")
        if self._tokenizer_doc is None:  # written once, in the parser thread that uses it
            self._tokenizer_doc = await asyncio.get_running_loop().run_in_executor(
                self._parser, tokenizer_document, tokenizer, self.model_name)
        return web.Response(body=self._tokenizer_doc, content_type="application/json")

    async def _health(self, request: web.BaseRequest) -> web.Response:
        ok = self.loop_thread.is_alive()
        return web.json_response({"status": "ok" if ok else "engine stopped"},
                                 status=200 if ok else 503)

    async def _metrics(self, request: web.BaseRequest) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, self.metrics.exposition)
        return web.Response(body=body,
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """A body decoded (depth-limited) and validated, its prompt tokenized (in the parser
        thread)."""
        return parse_request(decode_json(raw, "request"), chat=chat,
                             tokenizer=self.engine.tokenizer,
                             max_model_len=self.engine.max_model_len,
                             cache_tokens=self._cache_tokens, models=self.model_names)

    async def _serve(self, request: web.BaseRequest, *, chat: bool) -> web.StreamResponse:
        """A completion, its outcome counted: ``rejected`` (any 4xx), ``disconnected``,
        ``failed`` (an unexpected error: the dispatcher's 500) or ``ok``."""
        arrived = time.monotonic()
        outcome = self.metrics.requests
        try:
            try:
                raw = await read_body(request, self.limits, SIZE_OPTION)
                parsed = await asyncio.get_running_loop().run_in_executor(
                    self._parser, self._parse, raw, chat)
            except UnknownModelError as exc:
                self.metrics.requests.labels("rejected").inc()
                return web.json_response({"error": {
                    "message": str(exc), "type": "invalid_request_error", "param": "model",
                    "code": "model_not_found"}}, status=404)
            except InvalidArgumentError as exc:
                if isinstance(exc, HttpRequestError):  # the dispatcher answers: 400, 408, 413
                    outcome.labels("rejected").inc()
                    raise
                return self._reject(str(exc))
            return await self._generate(request, parsed, chat=chat, arrived=arrived)
        except HttpRequestError:
            raise
        except (ConnectionError, asyncio.CancelledError):
            outcome.labels("disconnected").inc()
            raise
        except Exception:
            outcome.labels("failed").inc()
            raise

    async def _generate(self, request: web.BaseRequest, parsed: ParsedRequest, *, chat: bool,
                        arrived: float) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        items: asyncio.Queue[_Item] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(item: _Item) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        self.loop_thread.submit(rid, parsed.prompt, parsed.params, sink)
        finished = False
        try:
            first = await items.get()
            if isinstance(first, BaseException):
                finished = True
                return self._refused(first)
            self.metrics.ttft.observe(time.monotonic() - arrived)
            self.metrics.count_prompt(len(parsed.prompt), first.cached_tokens)
            # ``created``: when this response begins (every chunk of a stream carries it)
            answer = Answer(rid, self.model_name, chat, int(time.time()), parsed)
            if parsed.stream:
                response = await self._stream(request, answer, first, items)
            else:
                out = first
                self.metrics.count_generated(len(out.new_token_ids))
                while not out.finished:
                    item = await items.get()
                    if isinstance(item, BaseException):
                        raise item
                    out = item
                    self.metrics.count_generated(len(out.new_token_ids))
                response = web.json_response(answer.full(out))
            finished = True
            self.metrics.requests.labels("ok").inc()
            return response
        finally:
            if not finished:
                self.loop_thread.abort(rid)

    async def _stream(self, request: web.BaseRequest, answer: Answer, first: RequestOutput,
                      items: asyncio.Queue[_Item]) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        })
        await response.prepare(request)
        out: _Item = first
        while True:
            if isinstance(out, BaseException):
                await _send(response, {"error": {"message": f"engine failed: {out}",
                                                  "type": "internal_error"}})
                break
            self.metrics.count_generated(len(out.new_token_ids))
            chunk = answer.chunk(out)
            if chunk is not None:
                await _send(response, chunk)
            if out.finished:
                if answer.request.include_usage:
                    await _send(response, answer.usage_chunk(out))
                break
            out = await items.get()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _reject(self, message: str) -> web.Response:
        self.metrics.requests.labels("rejected").inc()
        return OPENAI_ERRORS.response(400, message)

    def _refused(self, exc: BaseException) -> web.Response:
        if isinstance(exc, CapacityError | OutOfBlocksError | InvalidArgumentError | ValueError):
            return self._reject(str(exc))
        self.metrics.requests.labels("failed").inc()
        return OPENAI_ERRORS.response(500, f"engine failed: {exc}")


def tokenizer_document(tokenizer: Any, model: str) -> bytes:
    """``GET /v1/tokenizer``'s body: the files ``tokenizer.save_pretrained`` writes."""
    with tempfile.TemporaryDirectory(prefix="kvpool-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: base64.b64encode(p.read_bytes()).decode()
                 for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    return json.dumps({"object": "tokenizer", "model": model, "files": files}).encode()


async def _send(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
