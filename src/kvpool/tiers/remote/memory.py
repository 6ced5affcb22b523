"""An in-process block store that behaves like a Redis server with ``maxmemory`` and
``maxmemory-policy allkeys-lru``: the same interface as :class:`~.store.RemoteStore`,
for simulations (a replay's shared tier) and tests.

Every key counts ``len(key) + len(value)`` bytes against ``capacity_bytes``. A read or write
makes its key the most recently used; a write that would go over the capacity first evicts
least recently used keys until it fits. A value that cannot fit even in an empty store is not
stored (Redis answers such a write with an OOM error; here it is counted in
:attr:`MemoryStoreStats.rejected`) and the key's old value, if any, is deleted, so a reader
never sees a stale value for it. Redis samples its LRU; this one is exact.

``charge(key, value_length)``, when given, is what a key counts instead of ``len(key) +
len(value)``: a simulation whose values carry no payload (a replay's metadata-only managers
write empty blocks) charges each value the block size it stands for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.errors import InvalidArgumentError
from kvpool.tiers.remote.store import Item, Value
from kvpool.validation import check_int

__all__ = ["MemoryStore", "MemoryStoreStats"]


@dataclass(slots=True)
class MemoryStoreStats:
    """Counters of a :class:`MemoryStore` since it was built."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    rejected: int = 0


class MemoryStore:
    """A byte-bounded LRU map of keys to values (module docstring). Thread-safe."""

    def __init__(self, capacity_bytes: int, *,
                 charge: Callable[[bytes, int], int] | None = None) -> None:
        check_int("capacity_bytes", capacity_bytes, 1)
        if charge is not None and not callable(charge):
            raise InvalidArgumentError(f"charge must be callable, got {charge!r}")
        self.capacity_bytes = capacity_bytes
        self._charge = charge
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.stats = MemoryStoreStats()

    @property
    def used_bytes(self) -> int:
        """Bytes held: the sum of ``len(key) + len(value)`` (or the charge) over every key."""
        return self._used

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[bytes]:
        """Every key, least recently used first."""
        with self._lock:
            return list(self._values)

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        out: list[Value | None] = []
        with self._lock:
            values = self._values
            for k in keys:
                v = values.get(k)
                if v is None:
                    self.stats.misses += 1
                else:
                    values.move_to_end(k)
                    self.stats.hits += 1
                out.append(v)
        return out

    def put_many(self, items: Sequence[Item]) -> None:
        with self._lock:
            for key, value in items:
                self._put(bytes(key), bytes(value))

    def _put(self, key: bytes, value: bytes) -> None:
        values = self._values
        old = values.pop(key, None)
        if old is not None:
            self._used -= self._size(key, old)
        size = self._size(key, value)
        if size > self.capacity_bytes:
            self.stats.rejected += 1
            return
        while self._used + size > self.capacity_bytes:
            k, v = values.popitem(last=False)
            freed = self._size(k, v)
            self._used -= freed
            self.stats.evictions += 1
            self.stats.evicted_bytes += freed
        values[key] = value
        self._used += size
        self.stats.writes += 1

    def _size(self, key: bytes, value: bytes) -> int:
        charge = self._charge
        return len(key) + len(value) if charge is None else charge(key, len(value))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._values for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        deleted = 0
        with self._lock:
            for k in keys:
                v = self._values.pop(k, None)
                if v is not None:
                    self._used -= self._size(k, v)
                    deleted += 1
        return deleted

    def flush_all(self) -> None:
        """Drop every key (``FLUSHALL``)."""
        with self._lock:
            self._values.clear()
            self._used = 0

    def close(self) -> None:
        """Nothing to release; present for the :class:`BlockStore` interface."""
