"""JSON request bodies: decoded by msgspec (strict UTF-8, no lone surrogates, no ``NaN``),
nested at most :data:`MAX_JSON_DEPTH` deep, large ones decoded off the event loop.

A thread is not enough for the largest bodies: msgspec, like every C JSON decoder, holds the
GIL for the whole decode, and a 10 MiB array of token ids takes 70-300 ms of it, during which
the loop thread cannot run (``/health`` waits). :func:`decode_token_array` decodes a body's
one array of ints in 64 KiB pieces instead, the GIL free for the loop between them.

Every failure is an :class:`~kvpool.errors.HttpRequestError` 400 naming what was wrong. A
decoder with a schema (a :class:`msgspec.Struct` of scalars and lists of them) bounds the
depth itself; an untyped one is followed by :func:`check_depth`, so nothing after the decode
(an error message's ``repr``, a comparison) can meet a ``RecursionError``.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Final, TypeVar

import msgspec

from kvpool.errors import HttpRequestError
from kvpool.events.decoding import INPUT_FAULTS

__all__ = [
    "MAX_JSON_DEPTH", "OFFLOAD_BYTES", "check_depth", "decode_json", "decode_token_array",
    "off_loop",
]

MAX_JSON_DEPTH: Final = 32
"""Arrays and objects nested deeper than this are refused (an OpenAI request nests 4 deep)."""
OFFLOAD_BYTES: Final = 256 << 10
"""Bodies larger than this are decoded in an executor thread, not on the event loop."""
_SCAN_ALL: Final = 64
"""Containers longer than this are first checked for nested containers in one C pass."""
_NESTED: Final = frozenset((list, dict))
_ANY: Final = msgspec.json.Decoder()
_INTS: Final = msgspec.json.Decoder(list[int])
_PIECE_BYTES: Final = 64 << 10
_MARK: Final = 4611686018427387903  # 2**62 - 1: stands in for the array while the rest decodes
_MARK_TEXT: Final = str(_MARK).encode()
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


def decode_token_array(raw: bytes, decoder: msgspec.json.Decoder[Any], field: str
                       ) -> tuple[Any, array[int] | list[int]] | None:
    """``(body, ids)``: ``raw`` decoded by ``decoder`` with its ``field`` (a ``list[int]``)
    left as ``[]``, and that field's ints as u32 (a list when one is out of u32 range), the
    ints decoded in pieces (see the module docstring). None when ``raw`` is not such a body
    whose first ``[`` opens ``field`` (then decode it whole: that gives the right error).

    Sound: the array's text between its ``[`` and the first ``]`` is decoded in pieces cut at
    commas, each of which must be a non-empty list of ints (no strings, no nesting: so that
    ``]`` closes it); the rest decodes with a mark in the array's place, the mark found in
    ``field`` and nowhere else in ``raw``.
    """
    start = raw.find(b"[")
    end = raw.find(b"]", start)
    if start < 0 or end < 0 or _MARK_TEXT in raw:
        return None
    try:
        body = decoder.decode(b"".join((raw[:start + 1], _MARK_TEXT, raw[end:])))
    except INPUT_FAULTS:
        return None
    if getattr(body, field, None) != [_MARK]:
        return None
    ids = _int_pieces(raw, start + 1, end)
    if ids is None:
        return None
    setattr(body, field, [])
    return body, ids


def _int_pieces(raw: bytes, pos: int, end: int) -> array[int] | list[int] | None:
    out: array[int] | list[int] = array("I")
    first = True
    while True:
        cut = raw.find(b",", pos + _PIECE_BYTES, end)
        last = cut < 0
        if last:
            cut = end
        try:
            values = _INTS.decode(b"".join((b"[", raw[pos:cut], b"]")))
        except INPUT_FAULTS:
            return None
        if not values and not (first and last):  # "[1,]", "[,1]", "[1,,2]"
            return None
        if type(out) is array:
            try:
                out.fromlist(values)
            except OverflowError:  # a negative or too large id: the router names it
                out = [*out.tolist(), *values]
        else:
            out.extend(values)
        if last:
            return out
        pos, first = cut + 1, False
