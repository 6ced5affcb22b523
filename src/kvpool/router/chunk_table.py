"""Chunks of ASCII text to their token ids, looked up in one compiled call per text.

:class:`~kvpool.router.byte_words.ByteLevelWords` cuts a text into chunks (at each space that
follows anything but white space; no word of a byte-level BPE tokenizer runs across such a
space) and encodes each chunk once. In Python each chunk then costs a string, its hash, a
dict lookup and its part of a join, ~800 CPython instructions and a few cache lines. A
:class:`ChunkTable` keeps the same chunk -> ids map in flat arrays that a numba kernel
(:mod:`kvpool.router.chunk_kernels`) scans: one call cuts, hashes, finds and copies out every
chunk of a text; the chunks it does not find are encoded by the caller's function, added, and
the text looked up again.

It exists only with the ``jit`` extra (:func:`ChunkTable.create` answers None without numba,
with ``KVPOOL_JIT=0`` or after :func:`kvpool.hashing.jit.set_enabled(False)
<kvpool.hashing.jit.set_enabled>`, or when compiling failed); the caller keeps its Python path
for that, for non-ASCII text and for chunks over :data:`MAX_CHUNK_BYTES`.

Bounded like the Python caches: at ``max_chunks`` chunks, or when the arena would pass
:data:`ARENA_MAX_WORDS`, the table starts again empty. Thread-safe: the kernels hold the GIL,
a lookup reads one consistent set of arrays (a growth or a new start makes new arrays, never
moves records under a reader), and additions are serialized by a lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvpool.hashing import jit

__all__ = ["ARENA_MAX_WORDS", "MAX_CHUNK_BYTES", "ChunkTable"]

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES: Final = 1024
"""Longer chunks (a run of text without spaces: a URL, base64) are not kept: the caller encodes
the text in Python."""
ARENA_MAX_WORDS: Final = 16 << 20
"""The arena's limit in u32 words (64 MiB): past it the table starts again."""
_ARENA_START: Final = 1 << 16
_SLOTS_START: Final = 1 << 12
"""The hash table starts small and doubles (at half full): the slots a text's chunks touch
stay within the caches (a table sized for a million chunks from the start costs a cache and a
TLB miss a chunk)."""
_kernels: Any = None
_load_lock = threading.Lock()
_loaded = False


@dataclass(frozen=True, slots=True)
class _Arrays:
    slots: np.ndarray[Any, np.dtype[np.uint64]]
    arena: np.ndarray[Any, np.dtype[np.uint32]]
    arena8: np.ndarray[Any, np.dtype[np.uint8]]


def _load() -> Any:
    """The kernels module, compiled (or loaded from numba's cache), or None."""
    global _kernels, _loaded
    if _loaded:
        return _kernels
    with _load_lock:
        if not _loaded:
            try:
                import kvpool.router.chunk_kernels as kernels

                table = ChunkTable._empty(16, 64)
                out = np.empty(2, dtype=np.uint32)
                kernels.insert(np.frombuffer(b"a", np.uint8), np.ones(1, np.uint32),
                               table.slots, table.arena, table.arena8, np.uint64(1), 0)
                kernels.lookup(np.frombuffer(b"a", np.uint8), table.slots, table.arena,
                               table.arena8, np.uint64(1), out, np.empty(2, dtype=np.int64))
                kernels.rehash(np.zeros(32, dtype=np.uint64), table.arena, table.arena8,
                               np.uint64(1), 2)
                _kernels = kernels
            except ImportError:
                pass  # the jit extra is not installed
            except Exception:  # a numba or LLVM failure must not break tokenizing
                log.warning("kvpool.router.chunk_table: compiling the numba kernels failed; "
                            "chunks stay in Python", exc_info=True)
            _loaded = True
    return _kernels


class ChunkTable:
    """Chunks -> token ids in arrays, for one tokenizer; see the module docstring."""

    def __init__(self, kernels: Any, encode_chunk: Callable[[str], list[int]], *,
                 max_chunks: int) -> None:
        self._k = kernels
        self._encode_chunk = encode_chunk
        self._max = max(int(max_chunks), 1)
        self._seed = np.uint64(secrets.randbits(64))  # no chosen text collides on purpose
        self._capacity = 1 << max(4, (2 * self._max - 1).bit_length())
        self._arrays = self._empty(min(_SLOTS_START, self._capacity), _ARENA_START)
        self._used = 0
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def create(cls, encode_chunk: Callable[[str], list[int]], *, max_chunks: int
               ) -> ChunkTable | None:
        """A table whose chunks ``encode_chunk`` encodes (a chunk's text to its ids), or None
        when the kernels are not available."""
        if not jit.enabled():
            return None
        kernels = _load()
        return None if kernels is None else cls(kernels, encode_chunk, max_chunks=max_chunks)

    @staticmethod
    def _empty(capacity: int, words: int) -> _Arrays:
        arena = np.zeros(words, dtype=np.uint32)
        return _Arrays(np.zeros(capacity, dtype=np.uint64), arena, arena.view(np.uint8))

    def __len__(self) -> int:
        """Chunks held."""
        return self._count

    def encode_u32(self, text: str) -> bytes | None:
        """The ids of ASCII ``text`` (native u32 bytes), or None when it holds a chunk over
        :data:`MAX_CHUNK_BYTES` or the table started again twice on the way."""
        data = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        out = np.empty(len(data), dtype=np.uint32)
        misses = np.empty(2 * len(data), dtype=np.int64)
        for _ in range(3):
            arrays = self._arrays
            got = self._k.lookup(data, arrays.slots, arrays.arena, arrays.arena8, self._seed,
                                 out, misses)
            if got >= 0:
                return out[:got].tobytes()
            spans = misses[:-2 * got].tolist()
            if not self._learn(text, data, spans):
                return None
        return None

    def _learn(self, text: str, data: np.ndarray[Any, Any], spans: list[int]) -> bool:
        """Encode and add the chunks at ``spans`` (start, end, start, end, ...); False when one
        is too long to keep."""
        done: set[str] = set()
        for i in range(0, len(spans), 2):
            start, end = spans[i], spans[i + 1]
            if end - start > MAX_CHUNK_BYTES:
                return False
            chunk = text[start:end]
            if chunk not in done:  # a new chunk twice in one text: encoded once
                done.add(chunk)
                self._add(data[start:end],
                          np.array(self._encode_chunk(chunk), dtype=np.uint32))
        return True

    def _add(self, key: np.ndarray[Any, Any], ids: np.ndarray[Any, Any]) -> None:
        with self._lock:
            if self._count >= self._max:
                self._restart()
            if 2 * (self._count + 1) > len(self._arrays.slots):
                self._rehash()
            words = 1 + (len(key) + 3) // 4 + len(ids)
            if self._used + words > len(self._arrays.arena):
                self._grow(self._used + words)
            arrays = self._arrays
            used = self._k.insert(key, ids, arrays.slots, arrays.arena, arrays.arena8,
                                  self._seed, self._used)
            if used < 0:  # cannot be: room was made, and the key is one chunk
                raise AssertionError(f"chunk table insert failed ({used})")
            if used != self._used:
                self._count += 1
                self._used = used

    def _grow(self, need: int) -> None:
        """Room for ``need`` words: a larger copy of the arena (and of the slots, so a reader
        that holds the old arrays never sees a record past their end), or a new start."""
        old = self._arrays
        size = len(old.arena)
        while size < need:
            size *= 2
        if size > ARENA_MAX_WORDS:
            self._restart()
            return
        arena = np.zeros(size, dtype=np.uint32)
        arena[:self._used] = old.arena[:self._used]
        self._arrays = _Arrays(old.slots.copy(), arena, arena.view(np.uint8))

    def _rehash(self) -> None:
        """Twice the slots, every record put in again (new arrays: a reader holding the old
        ones still finds what they held)."""
        old = self._arrays
        slots = np.zeros(min(2 * len(old.slots), self._capacity), dtype=np.uint64)
        count = self._k.rehash(slots, old.arena, old.arena8, self._seed, self._used)
        if count != self._count:  # cannot be: every record was added once
            raise AssertionError(f"chunk table rehash found {count} of {self._count} records")
        self._arrays = _Arrays(slots, old.arena, old.arena8)

    def clear(self) -> None:
        """Start again empty."""
        with self._lock:
            self._restart()

    def _restart(self) -> None:
        self._arrays = self._empty(min(_SLOTS_START, self._capacity), _ARENA_START)
        self._used = 0
        self._count = 0
