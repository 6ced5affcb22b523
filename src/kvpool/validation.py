"""Argument checks every layer shares: an int that is not a bool, a finite number, a bool.

Python's ``bool`` is an ``int`` (``True == 1``); kvpool refuses it wherever a count, an index,
a size or a number is expected, so ``True`` never becomes "one block" by accident. The
``check_*`` functions return the checked value and raise ``error`` (an
:class:`InvalidArgumentError` unless the caller's boundary has its own error type) with a
message that names the argument, says what it must be and shows what it got.
"""

from __future__ import annotations

import math
from typing import TypeGuard

from kvpool.errors import InvalidArgumentError

U64_MAX = (1 << 64) - 1


def is_int(value: object) -> TypeGuard[int]:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float, not a bool (NaN and the infinities included)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bound(minimum: float | None, maximum: float | None, above: bool) -> str:
    low = "(" if above else "["
    if maximum is None:
        return "" if minimum is None else f" {'>' if above else '>='} {minimum}"
    return f" <= {maximum}" if minimum is None else f" in {low}{minimum}, {maximum}]"


def check_int(name: str, value: object, minimum: int | None = 0, maximum: int | None = None,
              *, error: type[Exception] = InvalidArgumentError) -> int:
    """``value`` if it is an int in [minimum, maximum] (None: unbounded on that side)."""
    if (not is_int(value) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise error(f"{name} must be an int{_bound(minimum, maximum, False)}, got {value!r}")
    return value


def check_u64(name: str, value: object, *,
              error: type[Exception] = InvalidArgumentError) -> int:
    """``value`` if it is an int in [0, 2**64) (a 64-bit key, id or salt)."""
    if not is_int(value) or not 0 <= value <= U64_MAX:
        raise error(f"{name} must be an unsigned 64-bit int, got {value!r}")
    return value


def check_number(name: str, value: object, minimum: float | None = 0.0,
                 maximum: float | None = None, *, above: bool = False,
                 error: type[Exception] = InvalidArgumentError) -> float:
    """``value`` as a float if it is a finite number in [minimum, maximum] (``above=True``:
    greater than ``minimum``)."""
    if (not is_number(value) or not math.isfinite(value)
            or (minimum is not None and (value <= minimum if above else value < minimum))
            or (maximum is not None and value > maximum)):
        bound = _bound(minimum, maximum, above)
        raise error(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def check_bool(name: str, value: object, *,
               error: type[Exception] = InvalidArgumentError) -> bool:
    """``value`` if it is a bool (not merely truthy: 1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be a bool, got {value!r}")
    return value
