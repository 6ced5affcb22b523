"""The decoders' error boundary: whatever bytes arrive, only :class:`EventFormatError` leaves.

The wire decoders (:mod:`kvpool.events.vllm_msgpack`, :mod:`kvpool.events.trtllm_json`) check
what they read and name the bad field; below them, msgspec and Python's conversions raise their
own errors on input no check anticipated: invalid UTF-8 in a string or map key
(``UnicodeDecodeError``), nesting past the interpreter's recursion limit (``RecursionError``,
which is what bounds nesting), a surrogate in a ``str`` payload (``UnicodeEncodeError``), an
unhashable map key, a value of the wrong type where a check assumed one. A consumer must not
stop on any of them, so every public decoder is wrapped by :func:`format_errors`, which turns
them into :class:`EventFormatError` naming what failed. Nothing is caught that a correct program
raises on valid input (``MemoryError``, ``KeyboardInterrupt``), and a decoder holds no state, so
the error leaves nothing half-done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

import msgspec

from kvpool.errors import EventFormatError

__all__ = ["INPUT_FAULTS", "format_errors"]

INPUT_FAULTS: Final = (
    msgspec.MsgspecError, UnicodeError, RecursionError, ValueError, TypeError, OverflowError,
    KeyError, IndexError,
)
"""What decoding bad input can raise below the decoders' own checks."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def format_errors(what: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Make a decoder raise only :class:`EventFormatError`; ``what`` names the payload in
    messages (``"vLLM event batch"``)."""

    def wrap(decode: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(decode)
        def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return decode(*args, **kwargs)
            except EventFormatError:
                raise
            except INPUT_FAULTS as exc:
                raise EventFormatError(
                    f"{what} cannot be decoded ({type(exc).__name__}): {_short(str(exc))}"
                ) from None

        return guarded

    return wrap


def _short(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."
