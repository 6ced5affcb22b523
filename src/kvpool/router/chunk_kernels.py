"""The numba kernels behind :mod:`kvpool.router.chunk_table` (imported only by it: it needs
numba).

A table of chunks (byte strings) to their token ids lives in two flat arrays:

* ``slots``, an open-addressed hash table (linear probing; a power of two long, never more than
  half full): each entry 0 (empty) or the top 24 bits of its key's hash over the offset + 1 of
  its record in the arena (40 bits);
* ``arena``, the records one after the other, u32 words: a header (the key's length in bytes |
  its number of ids << 16), the key's bytes (padded to a whole word), then the ids.
  ``arena8`` is the same memory as bytes.

:func:`lookup` cuts a text into chunks (at each space that follows a byte other than ASCII
white space; the space starts the next chunk), hashes each chunk as it scans it (eight bytes to a
multiplication), finds it (a fingerprint, then its bytes compared) and copies its ids out. The
chunks it does not find it reports, for the caller to encode and :func:`insert`, so a text's
chunks cost one compiled call, no Python object each.

Module-level functions, so that numba can cache the machine code on disk. Hash arithmetic is
uint64 throughout (numba widens uint64 mixed with int64 to a float).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

_U64 = np.uint64
_C1 = _U64(0x9E3779B97F4A7C15)
_C2 = _U64(0xFF51AFD7ED558CCD)
_C3 = _U64(0xC4CEB9FE1A85EC53)
_S8, _S29, _S33, _S40, _S48 = (_U64(s) for s in (8, 29, 33, 40, 48))
_LOW40 = _U64((1 << 40) - 1)
_ONE = _U64(1)

_F = TypeVar("_F", bound=Callable[..., Any])
# the GIL stays held: a lookup or insert is atomic for the router's other threads
_jit = cast("Callable[[_F], _F]", numba.njit(cache=True))


@_jit
def _is_space(c: Any) -> Any:
    """ASCII white space as GPT-2's expression (``re.ASCII``) sees it."""
    return c == 32 or (9 <= c <= 13)


@_jit
def _chunk(text: Any, s: Any, n: Any, seed: Any) -> Any:
    """The end of the chunk that starts at ``s`` and its hash: it runs up to the next space
    that follows a byte other than white space (or to ``n``)."""
    h = seed
    word = _U64(0)
    shift = _U64(0)
    j = s
    prev = 0
    while j < n:
        c = text[j]
        if c == 32 and j > s and not _is_space(prev):
            break
        word |= _U64(c) << shift
        shift += _S8
        if shift == 64:
            h = (h ^ word) * _C1
            h ^= h >> _S29
            word = _U64(0)
            shift = _U64(0)
        prev = c
        j += 1
    h = (h ^ word ^ (_U64(j - s) << _S48)) * _C2  # murmur3's finalizer
    h ^= h >> _S33
    h *= _C3
    h ^= h >> _S33
    return j, h


@_jit
def _same(text: Any, s: Any, e: Any, head: Any, arena8: Any, off: Any) -> Any:
    """Whether the record at ``off`` (its header ``head``) has the key ``text[s:e]``."""
    n = e - s
    if np.int64(head & 0xFFFF) != n:
        return False
    b = (off + 1) * 4
    for j in range(n):  # noqa: SIM110 (a loop numba compiles; all() of a generator it does not)
        if arena8[b + j] != text[s + j]:
            return False
    return True


@_jit
def _find(text: Any, s: Any, e: Any, h: Any, slots: Any, arena: Any, arena8: Any) -> Any:
    """(record offset or -1, slot): where the key ``text[s:e]`` is, or the empty slot it
    would take."""
    mask = _U64(slots.shape[0] - 1)
    fp = h >> _S40
    i = h & mask
    while True:
        v = slots[i]
        if v == 0:
            return -1, np.int64(i)
        if (v >> _S40) == fp:
            off = np.int64(v & _LOW40) - 1
            if _same(text, s, e, arena[off], arena8, off):
                return off, np.int64(i)
        i = (i + _ONE) & mask


@_jit
def lookup(text: Any, slots: Any, arena: Any, arena8: Any, seed: Any, out: Any,
           misses: Any) -> Any:
    """The ids of ``text``'s chunks into ``out`` (at least ``len(text)`` long: a byte-level
    token covers a byte at least); the count of ids written when every chunk was found, else
    minus the count of chunks missing, their (start, end) in ``misses`` (``2 * len(text)``
    long).

    In passes, so that the table's memory is read many places at a time rather than one miss
    after another (the table is cold when a router has done other work since its last text):
    every chunk's end and hash; each chunk's first slot, in a loop of loads alone; the
    records those slots name, again loads alone; then the keys compared and the ids copied
    (a chunk whose first slot is not its own is found by probing on).
    """
    n = text.shape[0]
    ends = np.empty(n, dtype=np.int64)
    hashes = np.empty(n, dtype=_U64)
    count = 0
    s = 0
    while s < n:
        s, hashes[count] = _chunk(text, s, n, seed)
        ends[count] = s
        count += 1
    mask = _U64(slots.shape[0] - 1)
    found = np.empty(count, dtype=_U64)
    for k in range(count):
        found[k] = slots[hashes[k] & mask]
    offs = np.empty(count, dtype=np.int64)
    heads = np.empty(count, dtype=np.uint32)
    for k in range(count):
        at = np.int64(found[k] & _LOW40) - 1
        offs[k] = at
        heads[k] = arena[max(at, 0)]
    written: Any = 0
    missing = 0
    s = 0
    for k in range(count):
        e = ends[k]
        h = hashes[k]
        off: Any = offs[k]
        v = found[k]
        if v == 0 or (v >> _S40) != (h >> _S40) or not _same(text, s, e, heads[k], arena8,
                                                              off):
            off = -1 if v == 0 else _find(text, s, e, h, slots, arena, arena8)[0]
        if off < 0:
            misses[2 * missing] = s
            misses[2 * missing + 1] = e
            missing += 1
        elif missing == 0:
            head = np.int64(arena[off])
            start = off + 1 + ((head & 0xFFFF) + 3) // 4
            for j in range(head >> 16):
                out[written + j] = arena[start + j]
            written += head >> 16
        s = e
    return -missing if missing else written


@_jit
def insert(key: Any, ids: Any, slots: Any, arena: Any, arena8: Any, seed: Any,
           used: Any) -> Any:
    """Add ``key`` (one whole chunk, under 65,536 bytes) -> ``ids`` (fewer than 65,536) as a
    record at word ``used`` of the arena: the arena's new length in use; ``used`` when the key
    is there already; -1 when the arena has no room; -2 when ``key`` is not one chunk."""
    n = key.shape[0]
    e, h = _chunk(key, 0, n, seed)
    if e != n or n == 0:
        return -2
    off, slot = _find(key, 0, n, h, slots, arena, arena8)
    if off >= 0:
        return used
    count = ids.shape[0]
    words = 1 + (n + 3) // 4 + count
    if used + words > arena.shape[0]:
        return -1
    arena[used] = n | (count << 16)
    b = (used + 1) * 4
    for j in range(n):
        arena8[b + j] = key[j]
    start = used + 1 + (n + 3) // 4
    for k in range(count):
        arena[start + k] = ids[k]
    slots[slot] = ((h >> _S40) << _S40) | _U64(used + 1)
    return used + words


@_jit
def rehash(slots: Any, arena: Any, arena8: Any, seed: Any, used: Any) -> Any:
    """Put every record of ``arena[:used]`` into the empty ``slots`` (a larger table): the
    count of records."""
    mask = _U64(slots.shape[0] - 1)
    off: Any = 0
    count = 0
    while off < used:
        head = np.int64(arena[off])
        n = head & 0xFFFF
        b = (off + 1) * 4
        _e, h = _chunk(arena8[b:b + n], 0, n, seed)
        i = h & mask
        while slots[i] != 0:
            i = (i + _ONE) & mask
        slots[i] = ((h >> _S40) << _S40) | _U64(off + 1)
        off += 1 + (n + 3) // 4 + (head >> 16)
        count += 1
    return count
