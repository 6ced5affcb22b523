"""The remote half of a ``KvpoolTier``: chunks in a Redis/Valkey store shared by every vLLM that
names it, under keys of the tier's namespace, in kvpool's verified value format.

A chunk's remote key is ``kvp:<scope digest hex>:<offload key hex>``
(:class:`~kvpool.tiers.remote.namespace.ScopeNamespace` of the tier's namespace: model, KV layout,
chunk size), so engines whose bytes mean different things never read each other's values. A
value is :mod:`kvpool.tiers.remote.codec`'s: a header with the namespace, a hash of the key and an
xxh3_64 of the payload; a value that is missing, truncated, of another namespace or damaged is
a miss, never bytes in vLLM's pool.

Which keys are there: the store may lose any value at any time (its own eviction, FLUSHALL,
another engine), so what this side knows is a hint. ``known`` remembers the keys stored or
probed present (bounded, oldest forgotten first); a load that finds a key gone fails that key
and forgets it, and a failed call to the server forgets every key (a restarted server is
empty). The network calls (:meth:`put`, :meth:`get_into`, :meth:`exists`) run on the
tier's worker threads; a server that is down makes them raise
:class:`~kvpool.errors.RemoteTierError` at once while the store's backoff runs
(:class:`~kvpool.tiers.remote.store.RemoteStore`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.namespace import RemoteNamespace
from kvpool.tiers.remote.store import BlockStore

__all__ = ["RemoteChunks"]


class RemoteChunks:
    """Chunks of one namespace in a :class:`~kvpool.tiers.remote.store.BlockStore` (module doc)."""

    def __init__(self, store: BlockStore, namespace: RemoteNamespace, *,
                 known_max: int = 1 << 20) -> None:
        self.store = store
        scope = namespace.scope()
        self._digest = scope.digest
        self._prefix = scope.prefix
        self.codec = ValueCodec()
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._known_max = known_max

    def remote_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    # ------------------------------------------------------------ scheduler thread: hints

    def is_known(self, key: bytes) -> bool:
        return key in self._known

    def remember(self, keys: Sequence[bytes]) -> None:
        """The keys are in the store (just written, or probed present)."""
        known = self._known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > self._known_max:
            known.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        """The keys were not found in the store after all."""
        for key in keys:
            self._known.pop(key, None)

    def forget_all(self) -> None:
        """The server failed: it may come back empty (a restart), so no key is known any more."""
        self._known.clear()

    # ------------------------------------------------------------ worker threads: the network

    def put(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        """Store each chunk under its key (raises RemoteTierError)."""
        items = []
        for key, view in zip(keys, views, strict=True):
            rkey = self.remote_key(key)
            items.append((rkey, ValueCodec.encode(self._digest, rkey, view)))
        self.store.put_many(items)

    def get_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool]:
        """Copy each key's verified payload into its view; whether it was found and intact
        (a view whose key failed is left untouched). Raises RemoteTierError."""
        rkeys = [self.remote_key(k) for k in keys]
        found: list[bool] = []
        for rkey, value, view in zip(rkeys, self.store.get_many(rkeys), views, strict=True):
            payload = self.codec.decode(value, self._digest, rkey)
            if payload is None or payload.nbytes != view.nbytes:
                if payload is not None:
                    self.codec.rejected["length"] += 1
                found.append(False)
                continue
            view[:] = payload
            found.append(True)
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a value now (raises RemoteTierError)."""
        return self.store.exists_many([self.remote_key(k) for k in keys])

    def close(self) -> None:
        self.store.close()
