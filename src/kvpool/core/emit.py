"""Emitter: how the manager's cache changes become calls of its event sink.

The manager reports blocks stored (a chain per call, with its tokens), removed (batched per
layer group until any other event, so the stream's order is exactly the call's) and moved
between tiers. The Emitter projects block keys to the event hashes of the configured
algorithm, one struct call per event, and builds the stored blocks without a Python int per
token. Without a sink every call is a no-op.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import Protocol

from kvpool.config import CacheConfig
from kvpool.core.radix import Run, Segment
from kvpool.events.model import EventDiff, KVCacheEvent, StoredBlock, TokenIds
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey, HashAlgo, hash_algo


class EventSink(Protocol):
    """The hooks the manager reports cache changes through (kvpool.events.EventManager)."""

    def on_created(self, layer_group: int, window_size: int,
                   num_blocks_per_cache_level: Sequence[int]) -> None: ...

    def on_stored(self, layer_group: int, window_size: int, parent_hash: int | str | None,
                  blocks: Sequence[StoredBlock]) -> None: ...

    def on_removed(self, layer_group: int, window_size: int,
                   block_hashes: Sequence[int | str]) -> None: ...

    def on_updated(self, layer_group: int, window_size: int, block_hash: int | str, *,
                   cache_level: EventDiff | None = None,
                   priority: EventDiff | None = None) -> None: ...

    def on_all_cleared(self) -> None: ...

    def flush_iteration_events(self) -> None: ...

    def get_latest_events(self, timeout_s: float | None = None) -> list[KVCacheEvent]: ...


def _projection(algo: HashAlgo) -> Callable[[list[BlockKey]], list[int | str]]:
    """``event_hash`` of a list of keys, specialised to one algorithm (the manager projects
    every event's keys; one comprehension per event)."""
    if algo is HashAlgo.V1_BLOCK_KEY:
        return list  # type: ignore[return-value]
    if algo is HashAlgo.V2_SHA256:
        return lambda keys: [k.hex() for k in keys]  # type: ignore[union-attr]
    # The 64-bit projections read every key's first (v2_sha256_64) or last (vLLM) 8 bytes,
    # big-endian, out of the keys joined: one struct call per event instead of a slice and an
    # int.from_bytes per key (6x fewer instructions for a long chain). Keys are 32-byte
    # digests; the struct's size check would reject any other length.
    return partial(_project_u64, "Q24x" if algo is HashAlgo.V2_SHA256_64 else "24xQ")


_PROJECT_STRUCTS: dict[tuple[str, int], struct.Struct] = {}


def _project_u64(field: str, keys: list[BlockKey]) -> list[int | str]:
    """One big-endian u64 out of each 32-byte key (``field`` places it in the digest)."""
    n = len(keys)
    packer = _PROJECT_STRUCTS.get((field, n))
    if packer is None:
        packer = struct.Struct(">" + field * n)
        if len(_PROJECT_STRUCTS) < 1024:  # chains of many lengths: keep the cache bounded
            _PROJECT_STRUCTS[field, n] = packer
    return list(packer.unpack(b"".join(keys)))  # type: ignore[arg-type]


_FIRST = itemgetter(0)



def event_algo(config: CacheConfig) -> HashAlgo:
    """The algorithm events carry: ``event_hash_algo``, else the cache's own."""
    algo = config.events.hash_algo
    return hash_algo(algo if algo is not None else config.hash_algo)


class Emitter:
    """The event calls of one manager (see the module docstring)."""

    __slots__ = ("_block_struct", "hashes", "pending", "sink", "step", "window_size")

    def __init__(self, config: CacheConfig, sink: EventSink | None, step: int) -> None:
        self.sink = sink
        self.hashes = _projection(event_algo(config))
        self.window_size = config.window_size
        self.step = step  # bytes per full block of tokens in the tree (Layout.step)
        self._block_struct = struct.Struct(f"{self.step}s")  # a block's token bytes
        self.pending: dict[int, list[int | str]] = {}  # removed hashes per group, not sent

    def removed(self, g: int, keys: list[BlockKey]) -> None:
        # Removals of one call are handed over together (one hook call per layer group),
        # flushed before any other event so the stream's order is exactly the call's.
        if self.sink is not None and keys:
            pending = self.pending.get(g)
            if pending is None:
                pending = self.pending[g] = []
            pending.extend(self.hashes(keys))

    def flush_removed(self) -> None:
        if self.pending and self.sink is not None:
            for g, hashes in self.pending.items():
                self.sink.on_removed(g, self.window_size(g), hashes)
            self.pending = {}

    def updated(self, g: int, key: BlockKey, old: int, new: int) -> None:
        if self.sink is not None:
            self.flush_removed()
            self.sink.on_updated(g, self.window_size(g), self.hashes([key])[0],
                                    cache_level=EventDiff(old, new))

    def parent_key(self, run: Run, i: int) -> BlockKey | None:
        """The key of the block before block i of ``run`` (None at a scope's root)."""
        if i:
            return run.keys[i - 1]
        parent = run.parent
        return None if parent is None or parent.parent is None else parent.keys[-1]

    def stored(self, g: int, chain: list[Segment], lora_id: int | None) -> None:
        """A stored event for a chain of blocks (each the child of the one before), given
        as run segments."""
        if self.sink is None or not chain:
            return
        self.flush_removed()
        parent = self.parent_key(chain[0][0], chain[0][1])
        parent_hash = None if parent is None else self.hashes([parent])[0]
        step = self.step
        blocks: list[StoredBlock] = []
        for r, a, b in chain:
            raw = r.tkey[a * step:b * step]
            # Each block's tokens are its bytes, as TokenIds (no Python int per token); a
            # partial block (a run of its own) is shorter than a block.
            toks: Iterable[TokenIds] = (
                map(TokenIds, repeat("I"), map(_FIRST, self._block_struct.iter_unpack(raw)))
                if len(raw) == (b - a) * step  # whole blocks, cut in C
                else [TokenIds("I", raw[i * step:(i + 1) * step]) for i in range(b - a)]
            )
            prio = r.prio
            # one constructor call per block through map: no bytecode runs per block
            blocks += map(StoredBlock, self.hashes(r.keys[a:b]), toks, r.tier[g][a:b],
                          repeat(DEFAULT_PRIORITY) if prio is None else prio[a:b],
                          repeat(lora_id))
        self.sink.on_stored(g, self.window_size(g), parent_hash, blocks)

