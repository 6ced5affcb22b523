"""Snapshots of a published event stream: what a consumer of every event so far holds.

A consumer that joins late, lost batches no replay can give back, or sees its publisher
restart under a live cache, needs the publisher's state rather than its history.
:class:`PublishedState` follows the events a publisher sends (every stored, removed, updated
and all-cleared event, in order) and writes that state back as events: an
:class:`~kvpool.events.model.AllCleared` first, then every held block as stored events, one per
run of blocks that chain on each other in one layer group and tier (in the order they were
announced, so chains stay chains and a block's tokens and parent are what its stored event
said). Applied to any consumer, the snapshot leaves it holding exactly the blocks held after
the last event applied here.

Keep it current in the same step as publishing: :meth:`ZmqEventPublisher.publish
<kvpool.events.zmq.ZmqEventPublisher.publish>` takes an ``update`` callable that runs under the
lock its snapshot requests take, so a snapshot is always tagged with the sequence number it is
current at::

    state = PublishedState()
    pub = ZmqEventPublisher(..., snapshot=lambda: encode_vllm_batch(
        state.events(), block_size=tpb, partial_blocks=True))
    ...
    events = manager.get_latest_events()
    pub.publish(encode_vllm_batch(events, block_size=tpb), update=lambda: state.apply(events))

A snapshot holds every cached prompt's token ids: leave the publisher's replay endpoint at its
default, ``ipc://*`` (a socket only this user can reach), unless a consumer on another host
needs it over ``tcp://`` (:mod:`kvpool.events.zmq_sockets`).

(``partial_blocks=True`` for the snapshot: seeded blocks carry no tokens, and the whole-block
filter would take them for partial ones. A manager that caches partial blocks then names them in
snapshots though its stream leaves them out; a consumer matches them like any other block.)

A publisher restarted under a live cache starts from :meth:`PublishedState.seed` with the
blocks the event manager announced (:meth:`kvpool.events.manager.EventManager.announced_blocks`);
seeded blocks carry neither tokens nor parents, which consumers keyed by block hashes (the
router's default) do not read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec

from kvpool.events.model import (
    AllCleared,
    BlockHash,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.hashing.keys import HashAlgo

__all__ = ["PublishedState"]

_Key = tuple[int, BlockHash]  # (layer group, hash)


class PublishedState:
    """The blocks held after every event applied so far, per layer group and tier.

    Thread-safe: :meth:`apply`, :meth:`seed` and :meth:`events` may come from different threads.
    """

    def __init__(self, hash_algo: HashAlgo | str = HashAlgo.V2_SHA256) -> None:
        self.hash_algo = str(getattr(hash_algo, "value", hash_algo))
        # (group, hash) -> (parent hash, block): insertion order is announcement order
        self._blocks: dict[_Key, tuple[BlockHash | None, StoredBlock]] = {}
        self._windows: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        """Follow ``events`` (as published, in order). Created events change nothing."""
        with self._lock:
            blocks = self._blocks
            for event in events:
                data, group = event.data, event.layer_group_id
                kind = type(data)
                if kind is Stored:
                    self._windows[group] = event.window_size
                    parent = data.parent_hash  # type: ignore[union-attr]
                    for block in data.blocks:  # type: ignore[union-attr]
                        blocks[(group, block.block_hash)] = (parent, block)
                        parent = block.block_hash
                elif kind is Removed:
                    for h in data.block_hashes:  # type: ignore[union-attr]
                        blocks.pop((group, h), None)
                elif kind is Updated:
                    diff = data.cache_level  # type: ignore[union-attr]
                    held = blocks.get((group, data.block_hash))  # type: ignore[union-attr]
                    if diff is not None and held is not None:
                        moved = msgspec.structs.replace(held[1], cache_level=diff.new_value)
                        blocks[(group, data.block_hash)] = (held[0], moved)  # type: ignore[union-attr]
                elif kind is AllCleared:
                    blocks.clear()

    def seed(
        self, announced: Iterable[tuple[BlockHash, int, int]], windows: dict[int, int] | None = None
    ) -> None:
        """Start from ``announced`` (hash, layer group, tier) blocks, replacing what was held;
        ``windows`` gives each layer group's window size (0 when absent)."""
        with self._lock:
            self._blocks = {
                (group, h): (None, StoredBlock(h, (), tier)) for h, group, tier in announced
            }
            self._windows = dict(windows or {})

    def events(self) -> list[KVCacheEvent]:
        """The state as events: all-cleared, then the held blocks as stored chains."""
        with self._lock:
            out = [KVCacheEvent(0, AllCleared(), 0, 0, self.hash_algo)]
            run: list[StoredBlock] = []
            run_key: tuple[int, int] = (0, 0)  # (group, tier)
            run_parent: BlockHash | None = None
            for (group, _), (parent, block) in self._blocks.items():
                key = (group, block.cache_level)
                if not run or key != run_key or parent != run[-1].block_hash:
                    if run:
                        out.append(self._stored(len(out), run_key[0], run_parent, run))
                    run, run_key, run_parent = [], key, parent
                run.append(block)
            if run:
                out.append(self._stored(len(out), run_key[0], run_parent, run))
            return out

    def _stored(
        self, event_id: int, group: int, parent: BlockHash | None, run: list[StoredBlock]
    ) -> KVCacheEvent:
        return KVCacheEvent(event_id, Stored(parent, tuple(run)), self._windows.get(group, 0),
                            group, self.hash_algo)
