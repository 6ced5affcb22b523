"""kvpool's eviction policies as vLLM 0.33 ``CachePolicy`` classes for its CPU offloading tier.

``KvpoolS3FIFO``, ``KvpoolTwoQ``, ``KvpoolARC`` and ``KvpoolLRU`` run kvpool's own queues
(:mod:`kvpool.eviction`: S3-FIFO, 2Q, ARC, LRU with a key history) over vLLM's CPU chunk ids,
loaded with ``"eviction_policy": "KvpoolS3FIFO", "cache_policy_module_path":
"kvpool.integrations.vllm"`` in ``kv_connector_extra_config``.

How vLLM's calls map onto kvpool's queue (one slot per CPU chunk id):

- A chunk joins the queue when it becomes readable (``insert`` of a ready chunk, or the first
  ``mark_evictable``: its store finished); it stays queued while pinned. A pin (a transfer
  reading it) is not a use: vLLM's LRU keeps recency apart from pinning too.
- A use is a request reusing a ready chunk (``on_request_finished``'s ``reused_keys``, tail
  first so a prefix's head is the most recent) or ``touch``: kvpool claims the slot and pushes
  it back, which counts one more use (2Q and S3-FIFO move it to their frequent segment, ARC
  learns from it). A chunk that left and comes back while the history holds its key (a ghost)
  is counted as reused too.
- ``evict(n, protected)``: atomic. It first counts the queued chunks that may go (ready, not
  pinned, not protected) and returns None, changing nothing, when fewer than ``n``; otherwise
  it pops victims in kvpool's order, skipping pinned and protected chunks, which go back to
  the queue's most recent end (protected chunks are the ones the current request offers: they
  are in use).
- ``remove`` (a failed store) and ``clear`` forget chunks without a trace in the history.

Retention priority (``KvpoolPriorityS3FIFO``; vLLM 0.33's ``ReqContext`` carries no priority
of its own, but every ``CachePolicy`` call that adds or uses a chunk receives the request's
``ReqContext``, whose ``kv_transfer_params`` is the request's own JSON): a request sending
``"kv_transfer_params": {"kvpool_priority": P}`` (an int in ``[0, 100]``, default 35, as
kvpool's own retention priorities) queues the chunks it stores at priority P, and a reuse by a
request of a higher priority raises a chunk's. A victim comes from the lowest priority level
with an evictable chunk, in S3-FIFO order within it. A value that is not such an int counts in
``invalid_priorities`` and the request gets the default: a client's bad field never stops
vLLM's scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from kvpool.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from kvpool.integrations.vllm._vllm import import_failed
from kvpool.integrations.vllm.queues import SlotQueue, new_queue

try:
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
except ImportError as exc:  # vLLM there (checked above) but incomplete
    raise import_failed(exc) from exc

__all__ = ["PRIORITY_PARAM", "KvpoolARC", "KvpoolCachePolicy", "KvpoolLRU",
           "KvpoolPriorityS3FIFO", "KvpoolS3FIFO", "KvpoolTwoQ"]

PRIORITY_PARAM = "kvpool_priority"
"""The key of a request's ``kv_transfer_params`` that ``KvpoolPriorityS3FIFO`` reads."""


class KvpoolCachePolicy(CachePolicy):  # type: ignore[misc]
    """A vLLM ``CachePolicy`` on the kvpool policy named by ``POLICY`` (module doc)."""

    POLICY: ClassVar[str] = "s3fifo"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._pinned: set[OffloadKey] = set()  # queued chunks with ref_cnt > 0
        self._reset()

    def _reset(self) -> None:
        self.queue: SlotQueue = new_queue(self.POLICY, self.cache_capacity)
        self._slot_key: list[OffloadKey | None] = [None] * self.cache_capacity
        self._slot_priority: list[int] = [DEFAULT_PRIORITY] * self.cache_capacity

    def _priority(self, req_context: ReqContext) -> int:
        """The retention priority of a request's chunks (priority-aware subclasses)."""
        return DEFAULT_PRIORITY

    def _push(self, slots: list[int], keys: Sequence[OffloadKey]) -> None:
        """Queue the slots (most recent last) at their chunks' priorities."""
        prio = self._slot_priority
        levels = {prio[s] for s in slots}
        if len(levels) == 1:
            self.queue.push_many(slots, levels.pop(), keys)
            return
        for level in sorted(levels):
            picked = [i for i, s in enumerate(slots) if prio[s] == level]
            self.queue.push_many([slots[i] for i in picked], level, [keys[i] for i in picked])

    def _slot(self, chunk: ChunkStatus) -> int:
        slot = int(chunk.chunk_id)
        if slot >= len(self._slot_key):  # vLLM's chunk ids stay below the capacity; be safe
            self._slot_key.extend([None] * (slot + 1 - len(self._slot_key)))
            self._slot_priority.extend([DEFAULT_PRIORITY] * (slot + 1 - len(self._slot_priority)))
        return slot

    def _enqueue(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        slot = self._slot(chunk)
        if slot not in self.queue:
            self._slot_key[slot] = key
            self.queue.push(slot, self._slot_priority[slot], key=key)

    # ------------------------------------------------------------------ CachePolicy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        self._slot_priority[self._slot(chunk)] = self._priority(req_context)
        if chunk.ref_cnt >= 0:
            self._enqueue(key, chunk)

    def remove(self, key: OffloadKey) -> None:
        chunk = self.chunks.pop(key)
        self._pinned.discard(key)
        slot = self._slot(chunk)
        if slot in self.queue and self._slot_key[slot] == key:
            self.queue.remove(slot)
        if self._slot_key[slot] == key:
            self._slot_key[slot] = None

    def mark_evictable(self, key: OffloadKey) -> None:
        self._pinned.discard(key)
        chunk = self.chunks.get(key)
        if chunk is not None:
            self._enqueue(key, chunk)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._pinned.add(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._reuse(list(keys), self._priority(req_context))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        order = order_request_keys(key_groups, req_context)
        self._reuse([k for k in order if k in reused_keys], self._priority(req_context))

    def _reuse(self, keys: list[OffloadKey], priority: int) -> None:
        """One more use of each queued chunk of ``keys`` (head-to-tail order), tail first, by
        a request of ``priority`` (a chunk's priority rises to it)."""
        slots: list[int] = []
        used: list[OffloadKey] = []
        seen: set[int] = set()
        queue = self.queue
        for key in reversed(keys):
            chunk = self.chunks.get(key)
            if chunk is None:
                continue
            slot = self._slot(chunk)
            if slot in queue and slot not in seen:
                seen.add(slot)
                slots.append(slot)
                used.append(key)
        if slots:
            queue.remove_many(slots)
            prio = self._slot_priority
            for slot in slots:
                prio[slot] = max(prio[slot], priority)
            self._push(slots, used)

    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        queue, chunks, slot_key = self.queue, self.chunks, self._slot_key
        held = {k for k in self._pinned | protected
                if k in chunks and self._slot(chunks[k]) in queue}
        if len(queue) - len(held) < n:
            return None
        victims: list[int] = []
        skipped: list[int] = []
        while len(victims) < n:
            for slot in queue.pop_slots(n - len(victims)):
                (skipped if slot_key[slot] in held else victims).append(slot)
        if skipped:
            self._push(skipped, [slot_key[s] or b"" for s in skipped])
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for slot in victims:
            key = slot_key[slot]
            assert key is not None
            slot_key[slot] = None
            out.append((key, chunks.pop(key)))
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._pinned.clear()
        self._reset()


class KvpoolS3FIFO(KvpoolCachePolicy):
    """S3-FIFO (Yang et al. 2023): a small FIFO for new chunks, a main FIFO with extra laps for
    reused ones (:class:`kvpool.eviction.S3FIFO`)."""

    POLICY = "s3fifo"


class KvpoolTwoQ(KvpoolCachePolicy):
    """2Q (Johnson & Shasha 1994): new chunks in a FIFO of a quarter of the cache, reused ones
    in an LRU (:class:`kvpool.eviction.TwoQueue`)."""

    POLICY = "2q"


class KvpoolARC(KvpoolCachePolicy):
    """ARC (Megiddo & Modha 2003): the recent/frequent split adapts to ghost hits
    (:class:`kvpool.eviction.ARC`)."""

    POLICY = "arc"


class KvpoolLRU(KvpoolCachePolicy):
    """Least recently used first (:class:`kvpool.eviction.PrioritizedLRU`)."""

    POLICY = "lru"


class KvpoolPriorityS3FIFO(KvpoolS3FIFO):
    """S3-FIFO within retention priority levels set per request (``kv_transfer_params``'
    ``kvpool_priority``, module doc): lower priorities are evicted first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.invalid_priorities = 0

    def _priority(self, req_context: ReqContext) -> int:
        params = req_context.kv_transfer_params
        if not params or PRIORITY_PARAM not in params:
            return DEFAULT_PRIORITY
        value = params[PRIORITY_PARAM]
        if (isinstance(value, int) and not isinstance(value, bool)
                and MIN_PRIORITY <= value <= MAX_PRIORITY):
            return value
        self.invalid_priorities += 1
        return DEFAULT_PRIORITY
