"""The numba kernels behind :mod:`kvpool.jit` (imported only by it: this module needs numba).

Module-level functions and constants, so that numba can cache the machine code on disk.
Everything is uint64 arithmetic that wraps as the engine's C++ does; ``mix32``'s 32-bit
products are masked back to 32 bits.
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
    """kvpool.hashing._mix64: a 64-bit id (salt, LoRA) mixed into the seed."""
    v = (v ^ (v >> _S30)) * _C64A
    v = (v ^ (v >> _S27)) * _C64B
    v = v ^ (v >> _S31)
    return seed ^ (v + _K + (seed << _S6) + (seed >> _S2))


@_jit
def v1_chain(tok: Any, params: Any, tpb: int, flags: int) -> Any:
    """kvpool.hashing._v1_chain over u32 token ids ``tok`` (an ``array("I")``): one uint64 key
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
