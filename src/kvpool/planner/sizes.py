"""Byte sizes as people write them: ``40GiB``, ``512 MB``, ``1.5 TiB`` <-> ints."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Final

from kvpool.errors import InvalidArgumentError

__all__ = ["format_size", "parse_size"]

_UNITS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
)
_SIZE_RE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a plain int (bytes) or a number with a unit — B, KB/MB/GB/TB (powers
    of 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive. Fractions round down."""
    match = _SIZE_RE.fullmatch(text)
    scale = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or scale is None:
        raise InvalidArgumentError(
            f"bad size {text!r}: expected e.g. 40GiB, 40GB, 512MiB or a plain number of bytes"
        )
    return math.floor(Fraction(match.group(1)) * scale)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number ≥ 1 (``1.50 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
