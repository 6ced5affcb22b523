"""The remote tier inside a manager: what ``CacheConfig.remote`` adds to its calls.

A :class:`ManagerRemote` belongs to one manager's :class:`~kvpool.core.state.CacheState`
(``state.remote``) and runs under the manager's lock. The manager's modules call it at three
points of its calls (each a marked line: :mod:`kvpool.core.allocator`, :mod:`kvpool.core.commit`,
:mod:`kvpool.core.state`):

- :meth:`ManagerRemote.dropped`: a block leaves its last local slot (an eviction that found no
  colder local slot, or that tier is the last one). With ``remote.write="evict"`` it is noted
  for writing; in either mode it is noted for an event saying it is now held remotely.
- :meth:`ManagerRemote.stored`: a sequence committed blocks; with ``remote.write="store"``
  they are noted for writing (write-through).
- :meth:`ManagerRemote.before_copies`: the call's bookkeeping is done and its copies are
  about to run. The noted blocks' bytes are still in their slots (a slot freed or reused
  during a call is only overwritten by the call's copies, or by the engine after the call):
  they are read once (a snapshot, the one copy on the scheduler thread), handed to the
  write-behind queue (:class:`~kvpool.tiers.remote.writer.RemoteWriter`: the network is never
  waited on), and the events are emitted.

A block whose slot a copy of the same call was still filling (moved down a tier and evicted
again in one call) is read where that copy reads it (copies are forwarded, so their sources
hold the bytes the call began with until the copies run).

Events: a block handed to the remote tier is announced as stored on
:data:`~kvpool.events.model.REMOTE_CACHE_LEVEL` (vLLM medium
:data:`~kvpool.events.model.REMOTE_MEDIUM`) after its local removal. The store may drop it
later without any event (its own LRU, another engine); prefetching it back announces it on
its local tier again.

Reads (``prefetch``) are :mod:`kvpool.core.remote_prefetch`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.core.radix import NO_SLOT, Run
from kvpool.errors import RemoteTierError
from kvpool.events.model import REMOTE_CACHE_LEVEL, StoredBlock, TokenIds
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.remote.namespace import RemoteNamespace, ScopeNamespace
from kvpool.tiers.remote.store import BlockStore
from kvpool.tiers.remote.tier import RemoteTier
from kvpool.tiers.remote.writer import RemoteWriter

if TYPE_CHECKING:
    from kvpool.core.emit import EventSink
    from kvpool.core.sequence import Sequence as Seq
    from kvpool.core.state import CacheState
    from kvpool.core.views import Scope

__all__ = ["ManagerRemote", "RemoteStats", "read_block", "write_block"]


@dataclass(slots=True)
class RemoteStats:
    """What a manager's remote tier did (``KVCacheManager.remote_stats``)."""

    offloaded_blocks: int = 0
    """Blocks (per layer group) handed to the write-behind queue."""
    offloaded_bytes: int = 0
    prefetch_calls: int = 0
    prefetched_blocks: int = 0
    """Blocks (per layer group) brought into local slots by ``prefetch``."""
    prefetched_bytes: int = 0
    prefetched_tokens: int = 0
    rejected_values: int = 0
    """Remote values refused on read (missing between lookup and read, damaged, foreign)."""
    errors: int = 0
    """:class:`RemoteTierError` s caught (a server down or slow); the manager went on locally."""
    last_error: str | None = None
    written: int = 0
    """Blocks the writer wrote (from its counters)."""
    write_failed: int = 0
    write_dropped: int = 0
    pending: int = 0
    write_refused: int = 0
    """Of ``write_failed``, the blocks a server that was up refused (full under
    ``noeviction``, a read-only replica): reads and ``prefetch`` went on."""


def read_block(storage: Any, tier: int, g: int, slot: int) -> bytes:
    """A snapshot of one slot's bytes (empty for metadata-only storage)."""
    tensors = getattr(storage, "tensors", None)
    if tensors is None:
        return b""
    if tier == 2:
        pool = getattr(storage, "_disk", {}).get(g)
        if pool is not None:
            buf = bytearray(pool.block_bytes)
            pool.read([slot], [memoryview(buf)])
            return bytes(buf)
    t = tensors(g, tier)[slot]
    import torch

    flat = t.contiguous().view(torch.uint8).reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return bytes(flat.numpy().data)


def write_block(storage: Any, tier: int, g: int, slot: int, payload: memoryview) -> None:
    """Copy ``payload`` into one slot of a GPU or host pool (nothing for metadata storage)."""
    tensors = getattr(storage, "tensors", None)
    if tensors is None:
        return
    import numpy as np
    import torch

    dst = tensors(g, tier)[slot].view(torch.uint8).reshape(-1)
    src = np.frombuffer(payload, dtype=np.uint8)
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        dst.copy_(torch.from_numpy(src.copy()))


@dataclass(slots=True)
class _Noted:
    scope: ScopeNamespace
    key: BlockKey
    tier: int
    group: int
    slot: int
    write: bool
    event: tuple[int | str | None, int | str, bytes, int, int | None] | None
    """(parent hash, hash, tokens, priority, LoRA id) of the remote stored event to emit."""


class ManagerRemote:
    """One manager's remote tier (module docstring)."""

    def __init__(self, state: CacheState, events: EventSink | None) -> None:
        from kvpool.tiers.remote.store import RemoteStore

        config = state.config
        self.state = state
        self.events = events
        self.owns_store = config.remote.store is None
        store: BlockStore
        if config.remote.store is not None:
            store = config.remote.store
        else:
            assert config.remote.url is not None
            store = RemoteStore(config.remote.url, timeout_s=config.remote.timeout_s)
        self.mode = config.remote.write
        self.writer = RemoteWriter(store, mode=self.mode,
                                   max_pending_bytes=config.remote.max_pending_bytes)
        self.tier = RemoteTier(store, RemoteNamespace.from_config(config,
                                                                  model=config.model_id),
                               writer=self.writer)
        self.stats = RemoteStats()
        self._noted: list[_Noted] = []
        self._scopes: dict[int, Scope] = {}  # id(root run) -> its reuse scope

    # ------------------------------------------------------------------ bookkeeping

    def scope_of(self, run: Run) -> Scope:
        """The reuse scope (LoRA id, cache salt) of the tree ``run`` belongs to."""
        root = run
        while root.parent is not None:
            root = root.parent
        scope = self._scopes.get(id(root))
        if scope is None:
            self._scopes = {id(r): s for s, r in self.state.roots.items()}
            scope = self._scopes[id(root)]
        return scope

    def dropped(self, t: int, g: int, slot: int, run: Run, i: int) -> None:
        """Block i of ``run`` leaves slot ``slot`` of tier t, its last local copy in group g.
        Blocks below ``eviction.offload_min_priority`` stay out of the remote tier too."""
        state = self.state
        write = self.mode == "evict"
        if run.priority(i) < state.config.eviction.offload_min_priority or (
                not write and self.events is None):
            return
        copy = state.copies.filling(t, g, slot)
        if copy is not None:  # a copy of this call was bringing it: read its source
            t, slot = copy.src_tier, copy.src_slot
        lora, salt = self.scope_of(run)
        key = run.keys[i]
        event = None
        if self.events is not None:
            emit = state.emit
            parent = emit.parent_key(run, i)
            hashes = emit.hashes([key] if parent is None else [parent, key])
            event = (None if parent is None else hashes[0], hashes[-1],
                     run.block_tokens(i, state.layout.step), run.priority(i), lora)
        self._noted.append(_Noted(self.tier.scope(lora, salt), key, t, g, slot, write, event))

    def stored(self, seq: Seq, start: int, upto: int) -> None:
        """The sequence committed its blocks [start, upto) (its own GPU slots, beam 0)."""
        if self.mode != "store" or upto <= start:
            return
        scope = self.tier.scope(seq.lora_id, seq.cache_salt)
        for g in self.state.layout.self_groups:
            table = seq.tables[g][0]
            for b in range(start, min(upto, len(table))):
                s = table[b]
                if s != NO_SLOT:
                    self._noted.append(_Noted(scope, seq.keys[b], 0, g, s, True, None))

    def before_copies(self) -> None:
        """Snapshot and queue the noted blocks, emit their events (module docstring)."""
        if not self._noted:
            return
        noted, self._noted = self._noted, []
        state = self.state
        stats = self.stats
        sink = self.events
        # every snapshot first, then the queue: the writer thread wakes once they are taken
        # (it would contend for the interpreter with the copies still to make)
        payloads = [read_block(state.storage, n.tier, n.group, n.slot) if n.write else b""
                    for n in noted]
        for n, payload in zip(noted, payloads, strict=True):
            if n.write:
                self.tier.offload(n.scope, n.key, n.group, payload)
                stats.offloaded_blocks += 1
                stats.offloaded_bytes += len(payload)
            if n.event is not None and sink is not None:
                parent, h, tokens, prio, lora = n.event
                block = StoredBlock(h, TokenIds("I", tokens), REMOTE_CACHE_LEVEL, prio, lora)
                sink.on_stored(n.group, state.config.window_size(n.group), parent, [block])
        state.stats.remote_offloaded(stats.offloaded_blocks)

    def failed(self, error: RemoteTierError) -> None:
        """A remote call failed: counted; the manager carries on with its local tiers."""
        self.stats.errors += 1
        self.stats.last_error = str(error)
        self.state.stats.remote(errors=1)

    def snapshot(self) -> RemoteStats:
        """The counters, the writer's included."""
        w = self.writer.stats
        s = self.stats
        return RemoteStats(
            s.offloaded_blocks, s.offloaded_bytes, s.prefetch_calls,
            s.prefetched_blocks, s.prefetched_bytes, s.prefetched_tokens,
            sum(self.tier.codec.rejected.values()) - self.tier.codec.rejected["missing"],
            s.errors, s.last_error, w.written, w.failed, w.dropped, self.writer.pending,
            w.refused,
        )

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the write-behind queue (see :meth:`RemoteWriter.flush`)."""
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued, stop the writer, close a store this manager opened."""
        self.writer.close()
        if self.owns_store:
            with contextlib.suppress(Exception):
                self.tier.store.close()
