"""The JSON error body of each service, for every status either sends.

``kvpool serve`` answers as OpenAI's API does: ``{"error": {"message", "type", "code"}}``;
``kvpool router`` as ``docs/router.md`` documents: ``{"error": "<message>"}``. Bodies are
written with :func:`json.dumps` (ASCII only), so any message, even one quoting a client's
invalid text, is valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from aiohttp import web

__all__ = ["OPENAI_ERRORS", "ROUTER_ERRORS", "ErrorShape"]

JSON_TYPE: Final = "application/json"

_OPENAI_TYPES: Final = {
    401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
    500: "internal_error", 502: "internal_error", 503: "service_unavailable",
}


def _openai(status: int, message: str) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def _router(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one service writes an error: ``body(status, message)`` is the JSON object."""

    name: str
    body: Callable[[int, str], dict[str, Any]]

    def encode(self, status: int, message: str) -> bytes:
        # a lone surrogate (a client's invalid text quoted) becomes its escape, as text
        clean = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return json.dumps(self.body(status, clean)).encode()

    def response(self, status: int, message: str) -> web.Response:
        return web.Response(status=status, body=self.encode(status, message),
                            content_type=JSON_TYPE)

    def raw_response(self, status: int, message: str, *headers: str) -> bytes:
        """A whole HTTP/1.1 response that closes the connection, for answering before any
        request was parsed (the connection cap's 503)."""
        body = self.encode(status, message)
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Type: {JSON_TYPE}",
                f"Content-Length: {len(body)}", "Connection: close", *headers]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


OPENAI_ERRORS: Final = ErrorShape("openai", _openai)
ROUTER_ERRORS: Final = ErrorShape("router", _router)
