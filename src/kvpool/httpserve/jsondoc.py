"""JSON request bodies: decoded by msgspec (strict UTF-8, no lone surrogates, no ``NaN``),
nested at most :data:`MAX_JSON_DEPTH` deep, large ones decoded off the event loop.

Every failure is an :class:`~kvpool.errors.HttpRequestError` 400 naming what was wrong. A
decoder with a schema (a :class:`msgspec.Struct` of scalars and lists of them) bounds the
depth itself; an untyped one is followed by :func:`check_depth`, so nothing after the decode
(an error message's ``repr``, a comparison) can meet a ``RecursionError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Final, TypeVar

import msgspec

from kvpool.errors import HttpRequestError
from kvpool.events.decoding import INPUT_FAULTS

__all__ = ["MAX_JSON_DEPTH", "OFFLOAD_BYTES", "check_depth", "decode_json", "off_loop"]

MAX_JSON_DEPTH: Final = 32
"""Arrays and objects nested deeper than this are refused (an OpenAI request nests 4 deep)."""
OFFLOAD_BYTES: Final = 256 << 10
"""Bodies larger than this are decoded in an executor thread, not on the event loop."""
_SCAN_ALL: Final = 64
"""Containers longer than this are first checked for nested containers in one C pass."""
_NESTED: Final = frozenset((list, dict))
_ANY: Final = msgspec.json.Decoder()
_T = TypeVar("_T")


def check_depth(obj: object, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`HttpRequestError` (400) if ``obj`` nests lists and dicts deeper than
    ``limit`` (the top level is depth 1). Iterative: one level at a time."""
    level: list[Any] = [obj] if type(obj) in _NESTED else []
    for _ in range(limit):
        deeper: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            if len(items) > _SCAN_ALL and _NESTED.isdisjoint(set(map(type, items))):
                continue
            deeper.extend(x for x in items if type(x) is list or type(x) is dict)
        if not deeper:
            return
        level = deeper
    raise HttpRequestError(400, f"arrays and objects nest more than {limit} levels deep")


def decode_json(raw: bytes, what: str, decoder: msgspec.json.Decoder[Any] = _ANY,
                *, depth: int | None = MAX_JSON_DEPTH) -> Any:
    """``raw`` decoded by ``decoder`` (any JSON by default), its depth checked unless
    ``depth`` is None; ``what`` names the body in the error's message."""
    try:
        obj = decoder.decode(raw)
    except INPUT_FAULTS as exc:
        raise HttpRequestError(
            400, f"bad {what} body ({type(exc).__name__}): {_reason(exc)}") from None
    if depth is not None:
        try:
            check_depth(obj, depth)
        except HttpRequestError as exc:
            raise HttpRequestError(400, f"bad {what} body: {exc}") from None
    return obj


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, RecursionError):
        return f"nested too deeply (at most {MAX_JSON_DEPTH} levels)"
    if text == "Input data was truncated":  # msgspec's word for a lone \ud800-\udfff escape too
        return "truncated JSON, or a \\u escape of a lone surrogate"
    return text


async def off_loop(raw: bytes, parse: Callable[[bytes], _T],
                   executor: Executor | None = None) -> _T:
    """``parse(raw)``, in ``executor`` (the loop's default when None) when ``raw`` is larger
    than :data:`OFFLOAD_BYTES`, else at once."""
    if len(raw) <= OFFLOAD_BYTES:
        return parse(raw)
    return await asyncio.get_running_loop().run_in_executor(executor, parse, raw)
