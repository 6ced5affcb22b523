"""kvpool.validation: a bool is never an int or a number, bounds hold, messages name the value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.validation import check_bool, check_int, check_number, check_u64, is_int, is_number


@given(st.integers() | st.floats() | st.booleans() | st.text() | st.none())
def test_predicates_refuse_bools_and_accept_only_their_kind(value: object) -> None:
    assert is_int(value) == (type(value) is int)
    assert is_number(value) == (type(value) in (int, float))


@given(st.integers(-50, 50), st.integers(-10, 10), st.integers(-10, 10))
def test_check_int_holds_its_bounds(value: int, lo: int, width: int) -> None:
    hi = lo + width
    if lo <= value <= hi:
        assert check_int("n", value, lo, hi) == value
    else:
        with pytest.raises(InvalidArgumentError, match=rf"n must be an int in \[{lo}, {hi}\], got"):
            check_int("n", value, lo, hi)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check_int("count", True, 1), "count must be an int >= 1, got True"),
    (lambda: check_int("count", 0, 1), "count must be an int >= 1, got 0"),
    (lambda: check_int("count", 2.0, None), "count must be an int, got 2.0"),
    (lambda: check_number("t", 0, 0, above=True), "t must be a finite number > 0, got 0"),
    (lambda: check_number("t", math.nan), "t must be a finite number >= 0.0, got nan"),
    (lambda: check_number("t", math.inf, None), "t must be a finite number, got inf"),
    (lambda: check_number("m", 2000, 0, 1024), r"m must be a finite number in \[0, 1024\]"),
    (lambda: check_number("p", 0, 0, 1, above=True), r"p must be a finite number in \(0, 1\]"),
    (lambda: check_number("t", False), "t must be a finite number >= 0.0, got False"),
    (lambda: check_bool("flag", 1), "flag must be a bool, got 1"),
    (lambda: check_u64("key", 1 << 64), "key must be an unsigned 64-bit int"),
    (lambda: check_u64("key", True), "key must be an unsigned 64-bit int, got True"),
])
def test_messages_name_the_argument_and_the_value(call: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call()  # type: ignore[operator]


def test_a_boundary_raises_its_own_error_type() -> None:
    with pytest.raises(ConfigError, match="io_threads must be an int >= 1"):
        check_int("io_threads", 0, 1, error=ConfigError)
    assert check_number("x", 3) == 3.0 and isinstance(check_number("x", 3), float)
    assert check_u64("key", (1 << 64) - 1) == (1 << 64) - 1
    assert check_bool("flag", False) is False
