"""The numba kernels behind :mod:`kvpool.hashing.jit` (imported only by it: it needs numba).

Module-level functions and constants, so that numba can cache the machine code on disk.
The v1 chain is uint64 arithmetic that wraps as the engine's C++ does; ``mix32``'s 32-bit
products are masked back to 32 bits. The msgpack reader parses arrays of ints byte by byte;
the writer writes u32 ids as one array, each in its shortest form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

_U64 = np.uint64
_M32 = _U64(0xFFFFFFFF)
_C32 = _U64(0x045D9F3B)
_C64A = _U64(0xBF58476D1CE4E5B9)
_C64B = _U64(0x94D049BB133111EB)
_K = _U64(0x9E3779B9)
_S2, _S6, _S16, _S27, _S30, _S31 = (_U64(s) for s in (2, 6, 16, 27, 30, 31))

_F = TypeVar("_F", bound=Callable[..., Any])
# the dispatcher numba returns is called like the function it compiles
_jit = cast("Callable[[_F], _F]", numba.njit(cache=True, nogil=True))


@_jit
def _mix64(v: Any, seed: Any) -> Any:
    """kvpool.hashing.v1._mix64: a 64-bit id (salt, LoRA) mixed into the seed."""
    v = (v ^ (v >> _S30)) * _C64A
    v = (v ^ (v >> _S27)) * _C64B
    v = v ^ (v >> _S31)
    return seed ^ (v + _K + (seed << _S6) + (seed >> _S2))


@_jit
def v1_chain(tok: Any, params: Any, tpb: int, flags: int) -> Any:
    """kvpool.hashing.v1._v1_chain over u32 token ids ``tok`` (an ``array("I")``): one uint64 key
    per block (the last block may be partial), each chained on the one before, the first on
    ``params[0]``. ``params`` (an ``array("Q")``) = (parent, salt id, LoRA id); ``flags`` bit 0:
    a salt is set, bit 1: a LoRA id is set."""
    n = len(tok)
    parent = _U64(params[0])
    salt = _U64(params[1])
    lora = _U64(params[2])
    has_salt = (flags & 1) != 0
    has_lora = (flags & 2) != 0
    out = np.empty((n + tpb - 1) // tpb, dtype=np.uint64)
    for b in range(out.shape[0]):
        start = b * tpb
        stop = min(n, start + tpb)
        seed = _U64(stop - start) ^ (parent * _C64A)
        if has_salt and parent == 0:
            seed = _mix64(salt, seed)
        for i in range(start, stop):
            v = _U64(tok[i])
            v = ((v >> _S16) ^ v) * _C32 & _M32
            v = ((v >> _S16) ^ v) * _C32 & _M32
            v = (((v >> _S16) ^ v) + _K) & _M32
            seed ^= v + (seed << _S6) + (seed >> _S2)
        if has_lora:
            seed = _mix64(lora, seed)
        out[b] = seed
        parent = seed
    return out


_BAD = -1


@_jit
def msgpack_u32(buf: Any, n: int, out: Any, counts: Any) -> int:
    """Read the ``n`` bytes of ``buf`` (a uint8 array followed by at least 8 more bytes) as
    msgpack arrays of ints back to back: every int into ``out`` (uint32, at least ``n``
    long), each array's length into ``counts``. Returns the number of arrays, or -1 when the
    bytes are anything else: another type, an int outside ``[0, 2**32)``, a cut array.

    Every msgpack int form is read (an encoder may use any): positive fixint, uint 8/16/32/64
    and int 8/16/32/64 of a non-negative value. The 8-, 16- and 32-bit forms are read
    without branching on their width (random token ids switch widths unpredictably): the 4
    bytes after the tag, shifted down to the form's width; hence the padding after ``n``.
    """
    p = np.int64(0)  # (numpy ints throughout: numba types them alike)
    o = 0
    k = 0
    bad = np.int64(0)
    while p < n:
        h = np.int64(buf[p])
        if 0x90 <= h <= 0x9F:  # fixarray
            m = h & 0x0F
            p += 1
        elif h == 0xDC:  # array 16
            m = (np.int64(buf[p + 1]) << 8) | np.int64(buf[p + 2])
            p += 3
        elif h == 0xDD:  # array 32
            m = ((np.int64(buf[p + 1]) << 24) | (np.int64(buf[p + 2]) << 16)
                 | (np.int64(buf[p + 3]) << 8) | np.int64(buf[p + 4]))
            p += 5
        else:
            return _BAD
        if k >= counts.shape[0] or o + m > out.shape[0]:
            return _BAD
        counts[k] = m
        k += 1
        for _ in range(m):
            if p >= n:  # (so no read goes past the padding)
                return _BAD
            t = np.int64(buf[p])
            if t < 0x80:  # positive fixint
                out[o] = t
                o += 1
                p += 1
                continue
            if t == 0xCF or t == 0xD3:  # 64-bit forms: their high 4 bytes must be 0, and
                if buf[p + 1] or buf[p + 2] or buf[p + 3] or buf[p + 4]:
                    return _BAD
                p += 4
                t = np.int64(0xCE)  # the low 4 bytes are then the value (non-negative either way)
            elif t < 0xCC or t > 0xD2:
                return _BAD
            w = np.int64(1) << (t & 3)  # 1, 2 or 4 bytes
            v = ((np.int64(buf[p + 1]) << 24) | (np.int64(buf[p + 2]) << 16)
                 | (np.int64(buf[p + 3]) << 8) | np.int64(buf[p + 4])) >> (32 - 8 * w)
            bad |= (t >> 4 == 0xD) & (v >> (8 * w - 1))  # a signed form's negative value
            out[o] = v
            o += 1
            p += 1 + w
    if p != n or bad:
        return _BAD
    return k


@_jit
def msgpack_from_u32(ids: Any, out: Any) -> int:
    """Write ``ids`` (uint32) as one msgpack array into ``out`` (uint8, at least 5 + 5 x
    len(ids) long), each int in its shortest form (as msgspec writes it); returns the bytes
    written."""
    n = ids.shape[0]
    if n < 16:
        out[0] = 0x90 | n
        p = 1
    elif n < 0x10000:
        out[0] = 0xDC
        out[1] = n >> 8
        out[2] = n & 0xFF
        p = 3
    else:
        out[0] = 0xDD
        out[1] = n >> 24
        out[2] = (n >> 16) & 0xFF
        out[3] = (n >> 8) & 0xFF
        out[4] = n & 0xFF
        p = 5
    for i in range(n):
        v = np.int64(ids[i])
        if v < 0x80:
            out[p] = v
            p += 1
        elif v < 0x100:
            out[p] = 0xCC
            out[p + 1] = v
            p += 2
        elif v < 0x10000:
            out[p] = 0xCD
            out[p + 1] = v >> 8
            out[p + 2] = v & 0xFF
            p += 3
        else:
            out[p] = 0xCE
            out[p + 1] = v >> 24
            out[p + 2] = (v >> 16) & 0xFF
            out[p + 3] = (v >> 8) & 0xFF
            out[p + 4] = v & 0xFF
            p += 5
    return p
