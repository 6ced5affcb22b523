"""Every source of events, converted once at ingest into the one record the index applies,
gives the index (and the shared tier) what the events mean: a brute-force model of the event
semantics, applied to the events as each wire format carries them.

Sources: a kvpool manager's events fed in process (:meth:`Ingest.feed`), the same events as vLLM
msgpack batches (:meth:`Ingest.feed_vllm`) and as TensorRT-LLM JSON (:meth:`Ingest.feed_trtllm`);
each for a worker keyed by its hashes and one matched by its tokens, reading a shared tier."""

from __future__ import annotations

import struct
from collections import Counter
from itertools import pairwise
from typing import Any

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.events.model import (
    REMOTE_CACHE_LEVEL,
    AllCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.events.trtllm_json import to_trtllm_json
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.router.config import WorkerConfig, WorkerKind
from kvpool.router.index import TIERS, KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.shared_tier import SharedTiers

TPB = 4
ALGO = "v1_block_key"
HASH = st.integers(0, 11)
LEVEL = st.sampled_from([0, 0, 1, 2, REMOTE_CACHE_LEVEL])


def block_tokens(h: int, partial: bool) -> tuple[int, ...]:
    return tuple((7 * h + j) % 50 for j in range(TPB - 1 if partial else TPB))


@st.composite
def streams(draw: st.DrawFn) -> list[KVCacheEvent]:
    """A worker's events, in order: its pools coming up (sometimes), then stored chains (one
    tier each, the last block sometimes partial), removals on tiers (a manager's) or on every
    tier, tier moves (the remote level too), priority-only updates and all-cleared events, in
    two layer groups. (A second created event, an engine restart, starts a new id stream whose
    ledger the model does not follow: test_router_index covers it.)"""
    out: list[KVCacheEvent] = []
    if draw(st.booleans()):
        out.append(KVCacheEvent(0, Created((100, 50)), 0, 0, ALGO))
    for eid in range(len(out), draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "move",
                                     "priority", "cleared"]))
        group = draw(st.sampled_from([0, 0, 1]))
        data: Any
        if kind == "store":
            hashes = draw(st.lists(HASH, min_size=1, max_size=3))
            level = draw(LEVEL)
            partial = draw(st.booleans())
            data = Stored(None, tuple(
                StoredBlock(h, block_tokens(h, partial and i == len(hashes) - 1), level)
                for i, h in enumerate(hashes)))
        elif kind == "remove":
            hashes = draw(st.lists(HASH, min_size=1, max_size=3))
            tiers = None if draw(st.booleans()) else tuple(draw(LEVEL) for _ in hashes)
            data = Removed(tuple(hashes), tiers)
        elif kind == "move":
            data = Updated(draw(HASH), EventDiff(draw(LEVEL), draw(LEVEL)))
        elif kind == "priority":
            data = Updated(draw(HASH), None, EventDiff(35, 50))
        else:
            data = AllCleared()
        out.append(KVCacheEvent(eid, data, 0, group, ALGO))
    return out


def as_sent(events: list[KVCacheEvent], source: str) -> list[KVCacheEvent]:
    """The events as a format carries them (its documented mapping): vLLM writes a tier move as
    a removal from the old medium and a placeholder store (the hash only) on the new one, and
    neither priority-only updates nor created events; TensorRT-LLM's JSON has no removal tiers
    (every tier)."""
    if source == "feed":
        return events
    out = []
    for e in events:
        data = e.data
        if source == "trtllm":
            if isinstance(data, Removed):
                e = KVCacheEvent(e.event_id, Removed(data.block_hashes), 0, e.layer_group_id, ALGO)
            out.append(e)
        elif isinstance(data, Updated):
            diff = data.cache_level
            if diff is not None and diff.old_value != diff.new_value:
                g = e.layer_group_id
                out.append(KVCacheEvent(0, Removed((data.block_hash,), (diff.old_value,)), 0, g))
                out.append(KVCacheEvent(0, Stored(None, (
                    StoredBlock(data.block_hash, (), diff.new_value),)), 0, g))
        elif not isinstance(data, Created):
            out.append(e)
    return out


class Model:
    """What the events mean, block by block, for a worker keyed by its hashes or by its tokens
    (the index's own chain of each stored chain's token ids; engine hashes map onto it and keep
    their mapping until the worker's blocks are all dropped)."""

    def __init__(self, by_tokens: bool) -> None:
        self.by_tokens = by_tokens
        self.counts: Counter[tuple[int, int, int]] = Counter()  # (group, key, tier)
        self.mapping: dict[int, int] = {}  # engine hash -> key (by tokens)
        self.shared: set[int] = set()  # engine hashes in the shared tier

    def key(self, h: int) -> int | None:
        return self.mapping.get(h) if self.by_tokens else h

    def store(self, g: int, blocks: tuple[StoredBlock, ...]) -> None:
        level = blocks[0].cache_level
        if level == REMOTE_CACHE_LEVEL:
            self.shared.update(b.block_hash for b in blocks)  # type: ignore[misc]
            return
        keys: list[int | None] = []
        chain = 0
        for b in blocks:
            if not self.by_tokens:
                keys.append(b.block_hash)  # type: ignore[arg-type]
            elif b.tokens:
                chain = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(b.tokens)}I", *b.tokens),
                                                 chain)
                keys.append(chain)
            else:  # announced by its hash alone
                keys.append(self.mapping.get(b.block_hash))  # type: ignore[arg-type]
        if None in keys:
            return  # a block the worker never keyed: the whole chain is an anomaly
        for b, k in zip(blocks, keys, strict=True):
            assert k is not None
            self.counts[(g, k, level)] += 1
            if self.by_tokens:
                self.mapping[b.block_hash] = k  # type: ignore[index]

    def release(self, g: int, key: int, tiers: range | tuple[int, ...]) -> None:
        for t in tiers:
            if self.counts[(g, key, t)] > 0:
                self.counts[(g, key, t)] -= 1

    def apply(self, e: KVCacheEvent) -> None:
        g, data = e.layer_group_id, e.data
        if isinstance(data, Stored):
            self.store(g, data.blocks)
        elif isinstance(data, Removed):
            levels = data.cache_levels or (None,) * len(data.block_hashes)
            for h, t in zip(data.block_hashes, levels, strict=True):
                if t == REMOTE_CACHE_LEVEL:
                    self.shared.discard(h)
                elif (key := self.key(h)) is not None:  # type: ignore[arg-type]
                    self.release(g, key, range(TIERS) if t is None else (t,))
        elif isinstance(data, Updated) and data.cache_level is not None:
            self.move(g, data.block_hash, data.cache_level)  # type: ignore[arg-type]
        elif isinstance(data, AllCleared):
            self.counts.clear()
            self.mapping.clear()

    def move(self, g: int, h: int, diff: EventDiff) -> None:
        old, new, remote = diff.old_value, diff.new_value, REMOTE_CACHE_LEVEL
        if remote in (old, new):
            self.shared.add(h)  # the store has it either way
            if old == remote and new != remote:  # prefetched: stored locally, by its hash
                self.store(g, (StoredBlock(h, (), new),))
            elif new == remote and old != remote and (key := self.key(h)) is not None:
                self.release(g, key, (old,))  # written out: removed locally
            return
        key = self.key(h)
        if key is None or old == new:
            return
        self.release(g, key, (old,))
        self.counts[(g, key, new)] += 1

    def masks(self, slot: int, stride: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for (_, key, t), c in self.counts.items():
            if c > 0:
                out[key] = out.get(key, 0) | (1 << (t * stride + slot))
        return out


def ingest_all(events: list[KVCacheEvent], source: str, by_tokens: bool,
               cuts: list[int]) -> tuple[KvIndex, SharedTiers]:
    index = KvIndex()
    index.add_worker("w", hash_algo=ALGO, tokens_per_block=TPB, match_by_tokens=by_tokens)
    shared = SharedTiers()
    shared.join("w", index.slot_of("w"), "pool")
    ingest = Ingest(index, shared=shared)
    ingest.add(WorkerConfig("w", WorkerKind.KVPOOL, hash_algo=ALGO, tokens_per_block=TPB,
                            match_by_tokens=by_tokens))
    bounds = [0, *sorted(cuts), len(events)]
    for lo, hi in pairwise(bounds):
        batch = events[lo:hi]
        if source == "feed":
            ingest.feed("w", batch)
        elif source == "vllm":
            ingest.feed_vllm("w", encode_vllm_batch(batch, 0.0, block_size=TPB,
                                                    partial_blocks=True))
        else:
            ingest.feed_trtllm("w", to_trtllm_json(batch))
    return index, shared


@settings(max_examples=60, deadline=None)
@given(streams(), st.lists(st.integers(0, 25), max_size=3))
def test_every_source_converted_at_ingest_gives_the_index_the_events_mean(
    events: list[KVCacheEvent], cuts: list[int]
) -> None:
    cuts = [c for c in cuts if c <= len(events)]
    for source in ("feed", "vllm", "trtllm"):
        for by_tokens in (False, True):
            index, shared = ingest_all(events, source, by_tokens, cuts)
            model = Model(by_tokens)
            for e in as_sent(events, source):
                model.apply(e)
            where = f"{source}, by tokens: {by_tokens}"
            assert index.masks == model.masks(index.slot_of("w"), index.stride), where
            assert shared.masks == {h: 1 << index.slot_of("w") for h in model.shared}, where
            assert index.counters.events_malformed == 0, where
            assert index.worker_info("w").blocks_per_tier == tuple(
                sum(1 for m in index.masks.values() if (m >> (t * index.stride)) & 1)
                for t in range(TIERS)), where
