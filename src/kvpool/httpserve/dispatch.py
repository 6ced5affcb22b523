"""The endpoint table of one service and everything around each endpoint's handler.

:class:`Dispatcher` is aiohttp's low-level request handler: bearer auth (every endpoint but
the open ones, ``/health``), the table lookup (JSON 404 / 405 with ``Allow``; ``HEAD`` wherever
``GET`` is), ``Expect: 100-continue`` (413 at once when the announced body is too large), then
the endpoint. What the endpoint raises becomes a JSON error in the service's shape: an
:class:`~kvpool.errors.HttpRequestError` its status (408 and 413 close the connection), an
unexpected exception a 500 (logged with its traceback: a bug). A client that goes away
mid-body or mid-response is one log line (rate limited), never a traceback. Every response,
the framework's own included (see :mod:`kvpool.httpserve.connections`), is counted by status
in :class:`ResponseCounts`.

Routing is one dict lookup, not an ``Application``'s router and middleware chain: the router
measured about 20 us more per request through an ``Application``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Final

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.errors import HttpRequestError
from kvpool.httpserve.auth import authorized
from kvpool.httpserve.body import too_large
from kvpool.httpserve.limits import HttpLimits
from kvpool.httpserve.ratelog import RateLimitedLog
from kvpool.httpserve.shapes import ErrorShape

__all__ = ["Dispatcher", "Endpoints", "Handler", "ResponseCounts"]

logger = logging.getLogger(__name__)

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
Endpoints = dict[str, dict[str, Handler]]
"""path -> method -> handler."""

_CLOSING: Final = frozenset((408, 413))
"""Statuses answered before the body was all read: the connection is closed after them."""


class ResponseCounts(Collector):
    """Responses sent by status, and requests whose client went away before their response
    ended; exposed as ``<prefix>_http_responses_total{code}`` and
    ``<prefix>_http_disconnects_total`` when registered in a Prometheus registry."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.by_status: dict[int, int] = {}
        self.disconnects = 0

    def add(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1

    def collect(self) -> Iterator[Metric]:
        responses = CounterMetricFamily(
            f"{self.prefix}_http_responses", "HTTP responses sent, by status code (every "
            "status: the endpoints', the errors', the HTTP parser's own).", labels=["code"])
        for status, n in sorted(self.by_status.items()):
            responses.add_metric([str(status)], n)
        yield responses
        yield CounterMetricFamily(
            f"{self.prefix}_http_disconnects",
            "Requests whose client went away before their response ended.",
            value=self.disconnects)


class Dispatcher:
    """The request handler of one service (see the module's docstring).

    Args:
        endpoints: path -> method -> handler; ``HEAD`` is added wherever ``GET`` is.
        shape: the service's JSON error body.
        limits: body size (for ``Expect: 100-continue``) and the rest of the boundary's limits.
        token: the bearer token every endpoint but ``open_paths`` requires (None: no auth).
        size_option: how the service's body limit is named in a 413's message.
        counts: where responses are counted (a new :class:`ResponseCounts` by default).
    """

    def __init__(self, endpoints: Endpoints, *, shape: ErrorShape, limits: HttpLimits,
                 token: bytes | None, size_option: str, counts: ResponseCounts,
                 open_paths: frozenset[str] = frozenset(("/health",))) -> None:
        self.endpoints: Endpoints = {path: dict(methods) for path, methods in endpoints.items()}
        for methods in self.endpoints.values():  # HEAD as GET (aiohttp sends no body)
            if "GET" in methods:
                methods["HEAD"] = methods["GET"]
        self.shape = shape
        self.limits = limits
        self.token = token
        self.size_option = size_option
        self.counts = counts
        self.open_paths = open_paths
        self.log = RateLimitedLog(logger)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if self.token is not None and path not in self.open_paths and not authorized(
            request.headers.get("Authorization", ""), self.token
        ):
            return self._unauthorized()
        methods = self.endpoints.get(path)
        if methods is None:
            return self.error(404, f"no endpoint {path}")
        handler = methods.get(request.method)
        if handler is None:
            refusal = self.error(405, f"{request.method} is not allowed on {path}")
            refusal.headers["Allow"] = ", ".join(methods)
            return refusal
        if request.headers.get("Expect", "").lower() == "100-continue":
            length = request.content_length
            if length is not None and length > self.limits.max_body_bytes:
                return self._refused(too_large(self.limits, self.size_option))
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response proper has not started
        try:
            response = await handler(request)
        except HttpRequestError as exc:
            return self._refused(exc, request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self.error(exc.status, exc.text or exc.reason)
        except (ConnectionError, asyncio.CancelledError):
            self._gone(request)
            raise
        except Exception:
            logger.exception("%s %s failed", request.method, path)
            return self.error(500, f"internal error in {path} (logged by the server)")
        status = response.status
        self.counts.by_status[status] = self.counts.by_status.get(status, 0) + 1
        return response

    def error(self, status: int, message: str) -> web.Response:
        """A JSON error in the service's shape, counted."""
        self.counts.add(status)
        return self.shape.response(status, message)

    def _unauthorized(self) -> web.Response:
        response = self.error(401, "missing or wrong bearer token (Authorization: Bearer ...)")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def _refused(self, exc: HttpRequestError, request: web.BaseRequest | None = None
                 ) -> web.Response:
        response = self.error(exc.status, str(exc))
        if exc.status in _CLOSING:
            response.force_close()
            if exc.status == 408 and request is not None:
                self.log.log(logging.WARNING, "dropped client %s: %s", request.remote, exc)
        return response

    def _gone(self, request: web.BaseRequest) -> None:
        self.counts.disconnects += 1
        during = "its request body" if not request.content.is_eof() else "the response"
        self.log.log(logging.INFO, "client %s went away during %s of %s %s",
                     request.remote, during, request.method, request.path)
