"""The router as an HTTP service (aiohttp): ``kvpool router --config router.yaml``.

Endpoints
---------
``POST /route``
    ``{"token_ids": [...], "cache_salt"?: str, "request_id"?: str, "prefill_tokens"?: int}``
    → the :class:`~kvpool.router.scoring.RouteDecision` as JSON (chosen worker, matched blocks
    per tier, every candidate's score). 400 for a bad body or bad token ids, 503 when no worker
    is healthy.
``POST /finished``
    ``{"request_id": str}`` → ``{"request_id": ..., "finished": bool}`` (false: not active).
``GET /workers``
    Per worker: health (and why not), algorithm, tokens per block, blocks per tier, events
    applied / malformed / anomalies, lag (seconds since its last event and batch), transport
    counters (sequence gaps, replays, restarts), active requests and pending prefill tokens.
``GET /metrics``
    Prometheus text: routes, hit blocks per tier, events applied / malformed, anomalies, gaps,
    replays, missed batches, restarts, poll errors, a decision-latency histogram and per-worker
    gauges.
``GET /health``
    200 while at least one worker is healthy, else 503.
``POST /v1/completions``, ``POST /v1/chat/completions`` (with ``proxy: true``)
    Requests carrying ``prompt_token_ids`` (or, for completions, a ``prompt`` of token ids) are
    routed and forwarded unchanged to the chosen worker's ``http_base_url``; the answer,
    streamed or not, is passed through, and the request is finished when it ends. The
    ``x-kvpool-worker`` response header names the worker.

The service listens where its config says (loopback by default; port 0 picks a free port).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import ClientError, ClientSession, ClientTimeout, web

from kvpool.errors import InvalidArgumentError, KVPoolError, NoWorkerAvailableError
from kvpool.router.config import ServiceConfig, WorkerConfig
from kvpool.router.index import TIERS, KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.scoring import LATENCY_BUCKETS_S, Router

__all__ = ["RouterService", "serve"]

logger = logging.getLogger(__name__)

_JSON = "application/json"


class _RouteBody(msgspec.Struct):
    token_ids: list[int]
    cache_salt: str | None = None
    request_id: str | None = None
    prefill_tokens: int | None = None


class _FinishedBody(msgspec.Struct):
    request_id: str


_ROUTE_DECODER = msgspec.json.Decoder(_RouteBody)
_FINISHED_DECODER = msgspec.json.Decoder(_FinishedBody)


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
            seed=o.seed,
        )
        self.ingest = Ingest(self.index, config.ingest)
        for w in config.workers:
            self.ingest.add(w)
        self._workers: dict[str, WorkerConfig] = {w.id: w for w in config.workers}
        self._runner: web.AppRunner | None = None
        self._proxy_session: ClientSession | None = None
        self._proxy_ids = itertools.count()
        self.port: int | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/route", self._route)
        app.router.add_post("/finished", self._finished)
        app.router.add_get("/workers", self._workers_view)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        if self.config.proxy:
            app.router.add_post("/v1/completions", self._proxy)
            app.router.add_post("/v1/chat/completions", self._proxy)
        return app

    async def start(self) -> int:
        """Start ingesting and listening; returns the port bound."""
        await self.ingest.start()
        if self.config.proxy:
            # No total timeout: a streamed completion may run for minutes.
            self._proxy_session = ClientSession(
                timeout=ClientTimeout(total=None, sock_connect=self.config.ingest.http_timeout_s)
            )
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            await self._close_clients()
            raise KVPoolError(
                f"cannot listen on {self.config.host}:{self.config.port}: {exc.strerror}"
            ) from None
        self._runner = runner
        address = runner.addresses[0]
        self.port = int(address[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._close_clients()

    async def _close_clients(self) -> None:
        await self.ingest.stop()
        if self._proxy_session is not None:
            await self._proxy_session.close()
            self._proxy_session = None

    # ------------------------------------------------------------------------------ handlers

    async def _route(self, request: web.Request) -> web.Response:
        try:
            body = _ROUTE_DECODER.decode(await request.read())
        except msgspec.MsgspecError as exc:
            return _error(400, f"bad /route body: {exc}")
        try:
            decision = self.router.route(
                body.token_ids,
                cache_salt=body.cache_salt,
                request_id=body.request_id,
                prefill_tokens=body.prefill_tokens,
            )
        except NoWorkerAvailableError as exc:
            return _error(503, str(exc))
        except InvalidArgumentError as exc:
            return _error(400, str(exc))
        return web.Response(body=msgspec.json.encode(decision), content_type=_JSON)

    async def _finished(self, request: web.Request) -> web.Response:
        try:
            body = _FINISHED_DECODER.decode(await request.read())
        except msgspec.MsgspecError as exc:
            return _error(400, f"bad /finished body: {exc}")
        done = self.router.request_finished(body.request_id)
        return web.json_response({"request_id": body.request_id, "finished": done})

    async def _workers_view(self, request: web.Request) -> web.Response:
        out: list[dict[str, Any]] = []
        for info in self.index.workers():
            cfg = self._workers.get(info.worker_id)
            out.append({
                "id": info.worker_id,
                "kind": cfg.kind.value if cfg is not None else None,
                "healthy": info.healthy,
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
                "ingest": self.ingest.status(info.worker_id).as_dict(),
            })
        return web.json_response({"workers": out})

    async def _health(self, request: web.Request) -> web.Response:
        infos = self.index.workers()
        healthy = sum(1 for i in infos if i.healthy)
        return web.json_response(
            {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
             "workers": len(infos)},
            status=200 if healthy else 503,
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics_text().encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    def metrics_text(self) -> str:
        """The Prometheus exposition of the router's counters and gauges."""
        st = self.router.stats
        ic = self.index.counters
        gc = self.ingest.counters
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_num(value)}")

        metric("kvpool_router_routes_total", "counter", "Routing decisions made.",
               [("", st.routes_total)])
        metric("kvpool_router_hit_blocks_total", "counter",
               "Prefix blocks matched on the chosen worker, by tier (0 GPU, 1 host, 2 disk).",
               [(f'{{tier="{t}"}}', st.hit_blocks[t]) for t in range(TIERS)])
        metric("kvpool_router_prompt_tokens_total", "counter", "Prompt tokens routed.",
               [("", st.prompt_tokens)])
        metric("kvpool_router_matched_tokens_total", "counter",
               "Prompt tokens found cached on the chosen worker.", [("", st.matched_tokens)])
        metric("kvpool_router_requests_finished_total", "counter",
               "Requests reported finished.", [("", st.finished_total)])
        metric("kvpool_router_requests_expired_total", "counter",
               "Requests dropped after request_timeout_s without a finish.",
               [("", st.expired_total)])
        metric("kvpool_router_events_applied_total", "counter", "KV events applied to the index.",
               [("", ic.events_applied)])
        metric("kvpool_router_events_malformed_total", "counter",
               "KV events or payloads that could not be applied (skipped).",
               [("", ic.events_malformed)])
        metric("kvpool_router_event_anomalies_total", "counter",
               "Events about blocks the index did not hold (late, reordered or lost).",
               [("", ic.anomalies)])
        metric("kvpool_router_blocks_stored_total", "counter", "Blocks stored, all workers.",
               [("", ic.blocks_stored)])
        metric("kvpool_router_blocks_removed_total", "counter", "Blocks removed, all workers.",
               [("", ic.blocks_removed)])
        metric("kvpool_router_event_batches_total", "counter", "Event batches received.",
               [("", gc.batches)])
        metric("kvpool_router_sequence_gaps_total", "counter",
               "Sequence gaps seen on ZMQ streams.", [("", gc.gaps)])
        metric("kvpool_router_replayed_batches_total", "counter",
               "Batches recovered through replay sockets.", [("", gc.replayed)])
        metric("kvpool_router_missed_batches_total", "counter",
               "Batches lost (not replayable).", [("", gc.missed)])
        metric("kvpool_router_publisher_restarts_total", "counter",
               "Publisher or engine restarts detected (the worker was reset).",
               [("", gc.restarts)])
        metric("kvpool_router_poll_errors_total", "counter",
               "Failed TensorRT-LLM event polls.", [("", gc.poll_errors)])
        metric("kvpool_router_probe_failures_total", "counter",
               "Failed liveness probes.", [("", gc.probe_failures)])
        # histogram: cumulative buckets
        name = "kvpool_router_decision_latency_seconds"
        lines.append(f"# HELP {name} Time to make one routing decision.")
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS_S, st.latency_buckets, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {sum(st.latency_buckets)}')
        lines.append(f"{name}_sum {_num(st.latency_sum_s)}")
        lines.append(f"{name}_count {sum(st.latency_buckets)}")
        infos = self.index.workers()
        metric("kvpool_router_worker_healthy", "gauge", "1 while the worker may be routed to.",
               [(f'{{worker="{_label(i.worker_id)}"}}', int(i.healthy)) for i in infos])
        metric("kvpool_router_worker_blocks", "gauge", "Blocks the index holds per worker, tier.",
               [(f'{{worker="{_label(i.worker_id)}",tier="{t}"}}', i.blocks_per_tier[t])
                for i in infos for t in range(TIERS)])
        metric("kvpool_router_worker_active_requests", "gauge", "Routed, unfinished requests.",
               [(f'{{worker="{_label(i.worker_id)}"}}',
                 self.router.active_requests(i.worker_id)) for i in infos])
        return "\n".join(lines) + "\n"

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"body is not JSON: {exc}")
        tokens = obj.get("prompt_token_ids") if isinstance(obj, dict) else None
        if tokens is None and isinstance(obj, dict) and request.path == "/v1/completions":
            prompt = obj.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                tokens = prompt
        if not isinstance(tokens, list):
            return _error(400, "proxy mode routes requests that carry prompt_token_ids")
        salt = obj.get("cache_salt")
        rid = f"proxy-{next(self._proxy_ids)}"
        try:
            decision = self.router.route(
                tokens, cache_salt=salt if isinstance(salt, str) else None, request_id=rid
            )
        except NoWorkerAvailableError as exc:
            return _error(503, str(exc))
        except InvalidArgumentError as exc:
            return _error(400, str(exc))
        try:
            cfg = self._workers.get(decision.worker_id)
            if cfg is None or cfg.http_base_url is None or self._proxy_session is None:
                return _error(502, f"worker {decision.worker_id!r} has no http_base_url")
            url = cfg.http_base_url + request.path
            try:
                async with self._proxy_session.post(
                    url, data=raw, headers={"Content-Type": _JSON}
                ) as upstream:
                    resp = web.StreamResponse(
                        status=upstream.status,
                        headers={
                            "Content-Type": upstream.headers.get("Content-Type", _JSON),
                            "x-kvpool-worker": decision.worker_id,
                        },
                    )
                    await resp.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
            except (ClientError, TimeoutError) as exc:
                return _error(502, f"worker {decision.worker_id!r} failed: {exc}")
        finally:
            self.router.request_finished(rid)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


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
