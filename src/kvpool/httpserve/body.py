"""Request bodies, read under the size limit and the body timeout.

Both failures are an :class:`~kvpool.errors.HttpRequestError` (413, 408) that the dispatcher
answers in the service's JSON shape, closing the connection (the rest of the body is never
read). A body that arrived whole with its head (nearly every route or completion request) is
taken from the payload's buffer in one call.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvpool.errors import HttpRequestError
from kvpool.httpserve.limits import HttpLimits

__all__ = ["read_body", "too_large"]


def too_large(limits: HttpLimits, option: str) -> HttpRequestError:
    return HttpRequestError(
        413, f"request body is over {option} ({limits.max_body_bytes} bytes)")


async def read_body(request: web.BaseRequest, limits: HttpLimits, option: str) -> bytes:
    """The request's body; ``option`` names the size setting in the 413's message.

    Raises:
        HttpRequestError: 413 when the body (or its announced ``Content-Length``) is over
            ``limits.max_body_bytes``; 408 when it is not all in within
            ``limits.body_timeout_s``.
    """
    content = request.content
    limit = limits.max_body_bytes
    if content.is_eof():
        raw = content.read_nowait()
        if len(raw) > limit:
            raise too_large(limits, option)
        return raw
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(limits, option)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await content.readany():
                body += chunk
                if len(body) > limit:
                    raise too_large(limits, option)
    except TimeoutError:
        raise HttpRequestError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                 f"({len(body)} bytes received)") from None
    return bytes(body)
