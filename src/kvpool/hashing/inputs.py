"""The inputs of the block hash functions, validated: token ids and the other arguments.

Token ids must be ints in [0, 2**31) (``bool`` counts as an int, as everywhere in Python);
anything else raises :class:`InvalidTokenError` naming the first bad token. Token ids are
validated and converted in bulk, once per call, into a native u32 array (``array("I")``), which
is what the hash loops read. The ``check_*`` functions validate the other arguments and raise
:class:`InvalidArgumentError`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np

from kvpool.errors import InvalidArgumentError, InvalidTokenError
from kvpool.validation import check_int, check_u64, is_int

__all__ = [
    "DIGEST_SIZE",
    "M64",
    "MAX_TOKEN_ID",
    "check_digest",
    "check_salt",
    "check_tpb",
    "check_u64_or_none",
    "tokens_to_u32",
    "validate_tokens",
]

M64: Final = (1 << 64) - 1
MAX_TOKEN_ID: Final = (1 << 31) - 1
DIGEST_SIZE: Final = 32
_TOP_BYTE: Final = 3 if sys.byteorder == "little" else 0  # of a native u32
_NUMPY_SCAN_MIN: Final = 4096  # tokens
_LOW_BYTE: Final = 0 if sys.byteorder == "little" else 3  # of a native u32
_BOOL_SCAN_MIN: Final = 64  # tokens: from here the 0 and 1 ids are found by their low byte


def _bad_token_error(tokens: object) -> InvalidTokenError:
    """The error naming the first bad token of ``tokens`` (called only once a check failed)."""
    if isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(
        tokens, Iterable
    ):
        return InvalidTokenError(
            f"tokens must be a sequence of int token ids, got {type(tokens).__name__} "
            f"{tokens!r:.80}"
        )
    for i, t in enumerate(tokens):
        if not (is_int(t) or isinstance(t, np.integer)):
            return InvalidTokenError(
                f"token at position {i} is {t!r} ({type(t).__name__}); token ids must be ints"
            )
        if not 0 <= int(t) <= MAX_TOKEN_ID:
            return InvalidTokenError(
                f"token at position {i} is {int(t)}; token ids must be in [0, 2**31)"
            )
    return InvalidTokenError(f"invalid token ids {tokens!r:.80}")


def _u32_array(seq: list[int]) -> tuple[array[int], bytes | None]:
    """``seq`` as a u32 array, and its bytes when they were needed here (a long list)."""
    out = array("I")
    try:
        # Rejects non-ints (floats, str, None) and ids outside [0, 2**32) in C. fromlist
        # converts each item directly; array("I", seq) goes through the sequence protocol per
        # item and measured 30 % more instructions.
        out.fromlist(seq)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token_error(seq) from None
    # fromlist takes a bool for 0 or 1: a short list is looked at item by item; in a long one
    # only the items that became 0 or 1 can be bools, and memchr finds the ids whose low byte
    # is 0 or 1 (~1 in 128). A numpy reduction did this before, ~13 us of an engine's request
    # in place (its code is cold on every call) against ~3 here.
    if len(seq) < _BOOL_SCAN_MIN:
        for t in seq:
            if t.__class__ is bool:
                raise _bad_token_error(seq)
        return out, None
    raw = out.tobytes()
    low = raw[_LOW_BYTE::4]
    find = low.find
    for b in (0, 1):
        i = find(b)
        while i >= 0:
            if seq[i].__class__ is bool:  # (most candidates are ids like 256 or 513)
                raise _bad_token_error(seq)
            i = find(b, i + 1)
    return out, raw


def tokens_to_u32(tokens: Iterable[int] | np.ndarray | array[int]) -> array[int]:
    """Validate token ids and return them as a new native u32 array (``array("I")``).

    Accepts a sequence (or iterable) of ints, an ``array`` of any integer typecode, or a 1-D
    numpy array of an integer dtype. Raises :class:`InvalidTokenError` naming the first bad
    token. The result never aliases the argument.
    """
    raw = None
    if type(tokens) is list:  # the common case first
        out, raw = _u32_array(tokens)
    elif isinstance(tokens, array) and tokens.typecode == "I":
        out = tokens[:]  # a memcpy, not a per-item conversion
    elif isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidTokenError(
                f"token array must be 1-D of an integer dtype, got {tokens.dtype} "
                f"with shape {tokens.shape}: {tokens!r:.80}"
            )
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
            raise _bad_token_error(tokens.tolist())
        out = array("I")
        out.frombytes(tokens.astype(np.uint32, copy=False).tobytes())
        return out
    elif isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(
        tokens, Iterable
    ):
        raise _bad_token_error(tokens)
    else:
        out, raw = _u32_array(list(tokens))  # a one-shot iterator must survive the error path
    # An id >= 2**31 has the top bit of its u32 set: scan the most significant bytes in C, or
    # for long inputs take numpy's max (its fixed cost is that of scanning ~3,000 ids).
    if len(out) > _NUMPY_SCAN_MIN:
        if np.frombuffer(out, dtype=np.uint32).max() > MAX_TOKEN_ID:
            raise _bad_token_error(out)
    elif not (raw if raw is not None else out.tobytes())[_TOP_BYTE::4].isascii():
        raise _bad_token_error(out)
    return out


def validate_tokens(tokens: Sequence[int] | np.ndarray | array[int]) -> list[int]:
    """Validate token ids and return them as a new list of ints."""
    return tokens_to_u32(tokens).tolist()


def check_tpb(tokens_per_block: object) -> int:
    return check_int("tokens_per_block", tokens_per_block, 1)


def check_u64_or_none(name: str, value: object) -> None:
    """None, or an unsigned 64-bit int."""
    if value is None:
        return
    check_u64(name, value)


def check_digest(name: str, value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        size = f" of {len(value)} bytes" if isinstance(value, bytes | str) else ""
        raise InvalidArgumentError(
            f"{name} must be a 32-byte digest (bytes), got {type(value).__name__}{size} "
            f"{value!r:.200}"
        )
    return value


def check_salt(cache_salt: object) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidArgumentError(f"cache_salt must be a str, got {cache_salt!r}")
