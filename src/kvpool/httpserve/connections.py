"""aiohttp's low-level server with a connection cap and JSON answers for what aiohttp refuses
itself, and the listening socket that runs it.

- At :meth:`HttpLimits.connection_cap` open connections, a new one makes room by closing the
  oldest connection with no request in progress (idle, or still sending its request head: a
  slow client's); when every connection has a request in progress, the new one is answered
  with the service's JSON 503 (``Retry-After: 1``) and closed before anything is read. The
  process never runs out of file descriptors, so ``accept()`` never fails, and ``/health``
  gets through however many slow clients hold connections. Both are logged rate limited.
- aiohttp answers malformed HTTP (a bad request line, headers too long or too many, a bad
  chunk) itself, before any handler runs: those answers get the service's JSON body too, are
  counted, and are one log line (rate limited), not a traceback.
- ``keepalive_timeout_s`` is aiohttp's keep-alive timeout, armed when a connection opens and
  after each response: a connection still waiting for a whole request head when it fires is
  closed, whether idle or trickling its headers.
- Should ``accept()`` still fail for want of descriptors (other files of the process), the
  event loop's report is one rate-limited line, not a traceback a second.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, Final, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvpool.errors import KVPoolError
from kvpool.httpserve.dispatch import Dispatcher
from kvpool.httpserve.ratelog import RateLimitedLog

__all__ = ["GuardedServer", "listen"]

logger = logging.getLogger(__name__)

_ACCEPT_FAILED: Final = "socket.accept() out of system resource"
_OVERSHOOT: Final = 8
"""Connections closed to make room are counted open until their transport is gone; at most
``cap // _OVERSHOOT`` more than the cap may be open meanwhile."""
_LINGER_S: Final = 1.0
"""How long an unread body is read and dropped after its response (aiohttp's default: 10 s)."""


class GuardedServer(web.Server):
    """A :class:`aiohttp.web.Server` around a :class:`Dispatcher` (see the module's docstring).
    ``kwargs`` go to aiohttp's request handler (e.g. ``handler_cancellation``)."""

    def __init__(self, dispatcher: Dispatcher, **kwargs: Any) -> None:
        limits = dispatcher.limits
        kwargs.setdefault("access_log", None)
        super().__init__(dispatcher, keepalive_timeout=limits.keepalive_timeout_s,
                         lingering_time=_LINGER_S, **kwargs)
        self.dispatcher = dispatcher
        self.cap = limits.connection_cap()
        self.open = 0
        self._hard_cap = self.cap + max(1, self.cap // _OVERSHOOT)
        self.log = RateLimitedLog(logger)
        self._full = dispatcher.shape.raw_response(
            503, f"the server holds its maximum of {self.cap} connections; retry shortly",
            "Retry-After: 1")

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Whether a new connection may be served: under the cap, or room was made by
        closing the oldest connection with no request in progress; else it is refused."""
        if self.open < self.cap:
            return True
        if self.open < self._hard_cap:
            for handler in self._connections:
                if not handler._request_in_progress and not handler._force_close:
                    self.log.log(logging.WARNING, "closed the idle or slow connection of %s "
                                 "to make room: %d connections open (the cap)",
                                 handler.peername, self.open)
                    handler.force_close()
                    return True
        self._refuse(transport)
        return False

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer a connection past the cap with the 503 and close it."""
        cast(asyncio.Transport, transport).write(self._full)
        transport.close()
        self.dispatcher.counts.add(503)
        self.log.log(logging.WARNING, "refused a connection from %s: %d connections open "
                     "(the cap)", transport.get_extra_info("peername"), self.open)

    def framework_error(self, request: web.BaseRequest, status: int,
                        exc: BaseException | None, message: str | None) -> web.StreamResponse:
        """What aiohttp answers itself (malformed HTTP, a failure outside the dispatcher), in
        the service's JSON shape."""
        if request.writer.output_size > 0 or isinstance(exc, ConnectionError):
            raise ConnectionError("the response had started, or the client went away")
        if status >= 500:
            logger.error("%s from %s", status, request.remote, exc_info=exc)
        else:
            self.log.log(logging.INFO, "answered %d to %s: %s", status, request.remote,
                         message or exc)
        text = message or HTTPStatus(status).phrase
        response = self.dispatcher.error(status, text)
        response.force_close()
        return response


class _GuardedHandler(RequestHandler):
    __slots__ = ("_counted", "_guard")

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if not guard.admit(transport):
            self._force_close = True
            return
        guard.open += 1
        self._counted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        return self._guard.framework_error(request, status, exc, message)


async def listen(server: GuardedServer, host: str, port: int, *,
                 shutdown_timeout: float = 60.0) -> tuple[web.ServerRunner, int]:
    """Listen on ``host:port`` (port 0: any free one); returns the runner (``cleanup()`` stops
    it, waiting up to ``shutdown_timeout`` for handlers) and the port bound. Raises
    :class:`KVPoolError` when the address cannot be bound."""
    runner = web.ServerRunner(server, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise KVPoolError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    _quiet_accept_failures(asyncio.get_running_loop(), server.log)
    return runner, int(runner.addresses[0][1])


def _quiet_accept_failures(loop: asyncio.AbstractEventLoop, log: RateLimitedLog) -> None:
    """Report the loop's ``accept()`` failures as rate-limited lines; anything else goes to
    the handler there was."""
    previous = loop.get_exception_handler()
    if getattr(previous, "kvpool_accept_filter", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            log.log(logging.WARNING, "accept() failed: %s (retried in 1 s)",
                    context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.kvpool_accept_filter = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
