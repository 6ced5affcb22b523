"""The remote tier as a manager sees it: blocks in, the longest resident continuation out.

:class:`RemoteTier` ties a namespace, a store and (optionally) a write-behind writer together
in the two operations a manager needs:

- :meth:`RemoteTier.offload`: hand one layer group's bytes of a block to the writer (the
  scheduler thread's whole cost: a key formatted and a queue append);
- :meth:`RemoteTier.fetch_continuation`: given the chain of block keys that follows a
  request's local match, the verified bytes of its longest prefix that the store holds for
  every requested layer group. One round trip asks which blocks exist (``EXISTS``, no value
  moves), a second reads the resident prefix's values; a value lost or damaged between the two
  (the store is shared: any key may go at any time) ends the continuation there, so the result
  is always a gapless prefix of verified blocks.

Failures of the store propagate as :class:`~kvpool.errors.RemoteTierError`, for the manager to
count and carry on with its local tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.namespace import RemoteNamespace, ScopeNamespace
from kvpool.tiers.remote.store import BlockStore
from kvpool.tiers.remote.writer import RemoteWriter

__all__ = ["RemoteTier"]


class RemoteTier:
    """A namespace's blocks in a shared store (module docstring)."""

    def __init__(self, store: BlockStore, namespace: RemoteNamespace, *,
                 writer: RemoteWriter | None = None) -> None:
        if writer is not None and writer.store is not store:
            raise InvalidArgumentError("the writer must write to the tier's store")
        self.store = store
        self.namespace = namespace
        self.writer = writer
        self.codec = ValueCodec()
        self._scopes: dict[tuple[int | None, str | None], ScopeNamespace] = {}

    def scope(self, lora_id: int | None = None, cache_salt: str | None = None) -> ScopeNamespace:
        """The namespace of a reuse scope (cached)."""
        scope = self._scopes.get((lora_id, cache_salt))
        if scope is None:
            scope = self._scopes[lora_id, cache_salt] = self.namespace.scope(lora_id, cache_salt)
        return scope

    def offload(self, scope: ScopeNamespace, key: BlockKey, layer_group: int,
                payload: bytes | memoryview) -> None:
        """Queue one layer group's bytes of a block for writing (never waits on the network).

        ``payload`` must not change afterwards (see :class:`RemoteWriter`)."""
        if self.writer is None:
            raise InvalidArgumentError("this RemoteTier has no writer (it only reads)")
        self.writer.put(scope.digest, scope.remote_key(key, layer_group), payload)

    def fetch_continuation(self, scope: ScopeNamespace, keys: Sequence[BlockKey],
                           layer_groups: Sequence[int]) -> list[list[memoryview]]:
        """The verified bytes of the longest prefix of ``keys`` held for every one of
        ``layer_groups``: one list per block, one payload per group (in ``layer_groups``
        order). Empty when the first block is missing."""
        groups = list(layer_groups)
        if not keys or not groups:
            return []
        per_group = [scope.remote_keys(keys, g) for g in groups]
        remote = [per_group[i][b] for b in range(len(keys)) for i in range(len(groups))]
        exists = self.store.exists_many(remote)
        n = len(groups)
        resident = 0
        while resident < len(keys) and all(exists[resident * n:(resident + 1) * n]):
            resident += 1
        if not resident:
            return []
        wanted = remote[:resident * n]
        values = self.store.get_many(wanted)
        blocks: list[list[memoryview]] = []
        decode = self.codec.decode
        for b in range(resident):
            payloads = []
            for i in range(n):
                j = b * n + i
                payload = decode(values[j], scope.digest, wanted[j])
                if payload is None:
                    return blocks
                payloads.append(payload)
            blocks.append(payloads)
        return blocks

    def fetch_first(self, scope: ScopeNamespace, keys: Sequence[BlockKey],
                    layer_groups: Sequence[int]) -> tuple[int, list[memoryview]] | None:
        """The first of ``keys`` whose values in every one of ``layer_groups`` are held and
        verified: (its index in ``keys``, one payload per group), or None. A hybrid model's
        checkpoints: ``keys`` deepest first, ``layer_groups`` its state groups. One existence
        round trip, then one read per candidate until one verifies."""
        groups = list(layer_groups)
        if not keys or not groups:
            return None
        n = len(groups)
        per_group = [scope.remote_keys(keys, g) for g in groups]
        remote = [per_group[i][b] for b in range(len(keys)) for i in range(n)]
        exists = self.store.exists_many(remote)
        decode = self.codec.decode
        for b in range(len(keys)):
            if not all(exists[b * n:(b + 1) * n]):
                continue
            wanted = remote[b * n:(b + 1) * n]
            values = self.store.get_many(wanted)
            payloads = [decode(v, scope.digest, k) for v, k in zip(values, wanted, strict=True)]
            if all(p is not None for p in payloads):
                return b, [p for p in payloads if p is not None]
        return None
