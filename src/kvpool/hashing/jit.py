"""Optional compiled kernels, with numba (the ``jit`` extra), for loops CPython cannot make fast.

TensorRT-LLM's v1 block key chains one 64-bit seed through every token of a sequence::

    seed ^= mix32(token) + (seed << 6) + (seed >> 2)        (mod 2**64, token by token)

Each step depends on the one before, so only the per-token ``mix32`` vectorises (numpy, in
:mod:`kvpool.hashing.v1`); the combine stays a loop of five big-int operations that each allocate
an int, about 250 ns a token on CPython 3.11, which caps ``v1_block_key`` near 4 M tokens/s.
Compiled, the whole chain (mixing, combine, salt and LoRA scopes, block chaining) runs at a
few hundred million tokens per second.

A router keying vLLM workers by their tokens reads every stored block's token ids from
msgpack; building a Python int per token (and packing them back into bytes) was most of its
decoding time. :func:`msgpack_token_arrays` reads the arrays' bytes straight into u32 ids, and
:func:`msgpack_token_array` writes u32 ids as a msgpack array (the vLLM encoder, for tokens the
manager announced as :class:`~kvpool.events.model.TokenIds`).

Contract: a kernel returns exactly what the pure-Python path returns (hypothesis tests
compare them on random inputs); callers validate their input first (or let the kernel reject
it) and fall back to Python when a kernel function returns None. That happens when numba is
not installed, when ``KVPOOL_JIT=0`` is set in the environment, after
:func:`set_enabled(False) <set_enabled>`, or when compiling failed (logged once). numba is
imported, and the kernels compiled, on the first call that can use them (about half a
second; numba caches the machine code on disk, so later processes load it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from array import array
from collections.abc import Callable
from typing import Final

import numpy as np

__all__ = [
    "V1_MIN_TOKENS", "backend", "enabled", "msgpack_token_array", "msgpack_token_arrays",
    "set_enabled", "v1_chain",
]

log = logging.getLogger(__name__)

V1_MIN_TOKENS: Final = 16
"""Shorter inputs stay in Python: a kernel call's fixed cost (a few µs) is not worth it."""

_lock = threading.Lock()
_enabled = os.environ.get("KVPOOL_JIT", "1").strip().lower() not in ("0", "off", "false", "no")
_loaded = False
_v1_kernel: Callable[..., np.ndarray] | None = None
_msgpack_kernel: Callable[..., int] | None = None
_msgpack_writer: Callable[..., int] | None = None
_PAD: Final = bytes(8)  # the msgpack kernel reads up to 8 bytes past its input
_backend = "python"


def set_enabled(enabled: bool) -> None:
    """Use the compiled kernels when available (True, the default) or never (False)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    """Whether the kernels are switched on (``KVPOOL_JIT``, :func:`set_enabled`); they may still
    be unavailable (see :func:`backend`)."""
    return _enabled


def backend() -> str:
    """What runs the v1 chain now: ``"numba <version>"`` or ``"python"`` (loads numba)."""
    return _backend if _enabled and _load() else "python"


def v1_chain(
    tokens: array[int], tpb: int, parent: int, salt: int | None, lora: int | None
) -> list[int] | None:
    """v1 keys of the blocks of ``tokens`` (validated u32; the last block may be partial),
    chained on ``parent``, as :func:`kvpool.hashing.keys.v1_block_keys` computes them; None when
    no kernel is available (or the input is too short to gain)."""
    if not _enabled or len(tokens) < V1_MIN_TOKENS or not _load():
        return None
    assert _v1_kernel is not None
    params = array("Q", (parent, salt or 0, lora or 0))
    keys = _v1_kernel(tokens, params, tpb, (salt is not None) | (lora is not None) << 1)
    out: list[int] = keys.tolist()
    return out


def msgpack_token_arrays(arrays: list[bytes]) -> tuple[bytes, list[int]] | None:
    """Token ids of msgpack-encoded arrays of ints (each item of ``arrays`` one whole array):
    all of them as u32 little-endian bytes, back to back, and each array's length. None when
    no kernel is available, or when an array holds anything but ints in ``[0, 2**32)``
    (the caller's Python path then decodes, and reports, what is there)."""
    if not _enabled or sys.byteorder != "little" or not _load():
        return None
    assert _msgpack_kernel is not None
    buf = b"".join([*arrays, _PAD])
    n = len(buf) - len(_PAD)
    out = np.empty(n, dtype=np.uint32)
    counts = np.empty(len(arrays), dtype=np.int64)
    k = _msgpack_kernel(np.frombuffer(buf, dtype=np.uint8), n, out, counts)
    if k != len(arrays):
        return None
    lengths: list[int] = counts.tolist()
    return out[:sum(lengths)].tobytes(), lengths


def msgpack_token_array(ids: bytes) -> bytes | None:
    """``ids`` (native u32, as ``array("I").tobytes()``) as one msgpack array of ints, byte
    for byte what msgspec writes for the list of them; None when no kernel is available."""
    if not _enabled or not _load():
        return None
    assert _msgpack_writer is not None
    values = np.frombuffer(ids, dtype=np.uint32)
    out = np.empty(5 + 5 * len(values), dtype=np.uint8)
    return out[:_msgpack_writer(values, out)].tobytes()


def _load() -> bool:
    """Import numba and compile the kernels once; False when that is not possible."""
    global _loaded
    if _loaded:
        return _v1_kernel is not None
    with _lock:
        if not _loaded:
            try:
                _compile()
            except ImportError:
                pass  # the jit extra is not installed: Python it is
            except Exception:  # a numba or LLVM failure must not break hashing
                log.warning("kvpool.hashing.jit: compiling the numba kernels failed; using Python",
                            exc_info=True)
            _loaded = True
    return _v1_kernel is not None


def _compile() -> None:
    global _v1_kernel, _msgpack_kernel, _msgpack_writer, _backend
    import numba

    # imports numba; defines the kernels at module level
    from kvpool.hashing import kernels as _kernels

    # compile now (or load numba's cached machine code), not inside the first caller's timing
    _kernels.v1_chain(array("I", [1]), array("Q", (0, 1, 1)), 1, 3)
    _kernels.msgpack_u32(np.frombuffer(b"\x91\x01" + _PAD, dtype=np.uint8), 2,
                         np.empty(2, dtype=np.uint32), np.empty(1, dtype=np.int64))
    _kernels.msgpack_from_u32(np.ones(1, dtype=np.uint32), np.empty(10, dtype=np.uint8))
    _v1_kernel = _kernels.v1_chain
    _msgpack_kernel = _kernels.msgpack_u32
    _msgpack_writer = _kernels.msgpack_from_u32
    _backend = f"numba {numba.__version__}"
