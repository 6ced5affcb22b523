"""SGLang's pages on kvpool's shared remote tier: one verified value per page in a Redis- or
Valkey-compatible server (:class:`~kvpool.tiers.remote.store.RemoteStore`), under the page's
remote key in the storage's namespace (:class:`~kvpool.tiers.remote.namespace.ScopeNamespace`).

Every value carries kvpool's header (:mod:`kvpool.tiers.remote.codec`: namespace digest, hash of the
key it was written under, payload length and xxh3_64), so a value of another namespace,
copied under another key, truncated or damaged is a miss, counted by reason in
:attr:`PageRemote.codec`'s ``rejected``, and never reaches the host pool. A server that is
down or slow fails the call (:class:`~kvpool.errors.RemoteTierError`, counted): the pages are
misses or unstored, and the store fails fast until its reconnection backoff expires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvpool.errors import RemoteTierError
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.namespace import ScopeNamespace
from kvpool.tiers.remote.store import RemoteStore

__all__ = ["PageRemote", "RemoteCounters"]

Segments = Sequence[memoryview]


@dataclass(slots=True)
class RemoteCounters:
    """What the remote tier did since it opened (:meth:`PageRemote.stats`)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    writes: int = 0
    errors: int = 0


class PageRemote:
    """Pages of ``page_bytes`` in the store at ``url`` under namespace ``scope``."""

    def __init__(self, url: str, scope: ScopeNamespace, *, page_bytes: int,
                 timeout_s: float = 2.0, backoff_s: float = 0.5) -> None:
        self.store = RemoteStore(url, timeout_s=timeout_s, backoff_s=backoff_s)
        self.scope = scope
        self.page_bytes = page_bytes
        self.codec = ValueCodec()
        self.counters = RemoteCounters()

    def remote_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The remote key of each page key."""
        return self.scope.remote_keys(keys, 0)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have a value in the store (0 when the store
        cannot be asked). A value found here may still fail its checks when read."""
        try:
            found = self.store.exists_many(self.remote_keys(keys))
        except RemoteTierError:
            self.counters.errors += 1
            return 0
        return found.index(False) if False in found else len(found)

    def read_many(self, keys: Sequence[bytes], dests: Sequence[Segments]) -> list[bool]:
        """Read each page into its runs ``dests[i]``; whether each was found and verified."""
        if not keys:
            return []
        rkeys = self.remote_keys(keys)
        try:
            values = self.store.get_many(rkeys)
        except RemoteTierError:
            self.counters.errors += 1
            return [False] * len(keys)
        digest = self.scope.digest
        out: list[bool] = []
        for rkey, value, runs in zip(rkeys, values, dests, strict=True):
            payload = self.codec.decode(value, digest, rkey)
            if payload is None or payload.nbytes != self.page_bytes:
                if value is None:
                    self.counters.misses += 1
                else:
                    self.counters.rejected += 1
                    if payload is not None:
                        self.codec.rejected["length"] += 1
                out.append(False)
                continue
            off = 0
            for run in runs:
                run[:] = payload[off:off + run.nbytes]
                off += run.nbytes
            self.counters.hits += 1
            out.append(True)
        return out

    def write_many(self, items: Sequence[tuple[bytes, Segments]]) -> list[bool]:
        """Store each ``(key, runs)``; whether each was stored (all or none: one call)."""
        if not items:
            return []
        keys = [k for k, _ in items]
        rkeys = self.remote_keys(keys)
        digest = self.scope.digest
        values = [(rkey, ValueCodec.encode(digest, rkey, b"".join(runs)))
                  for rkey, (_, runs) in zip(rkeys, items, strict=True)]
        try:
            self.store.put_many(values)
        except RemoteTierError:
            self.counters.errors += 1
            return [False] * len(items)
        self.counters.writes += len(items)
        return [True] * len(items)

    def stats(self) -> dict[str, object]:
        """Counters, the codec's rejections by reason and the store's own counters."""
        out: dict[str, object] = {"url": self.store.url, **asdict(self.counters)}
        out["rejected_by_reason"] = dict(self.codec.rejected)
        out["store"] = asdict(self.store.stats)
        return out

    def close(self) -> None:
        """Close the connections."""
        self.store.close()
