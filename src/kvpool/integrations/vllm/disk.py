"""The disk half of a ``KvpoolTier``: fixed-size chunks in kvpool's persistent disk-tier file,
indexed by vLLM offload key, recorded in kvpool's crash-safe manifest.

Storage: one persistent file (:func:`kvpool.tiers.diskfile.open_persistent_pools`: reserved with
``fallocate`` at start, so a disk that fills up later cannot fail a chunk write; ``flock``-ed,
so two live processes never share it; ``pread``/``pwrite``, never mapped) of ``slots`` chunks,
and a :class:`~kvpool.tiers.manifest.Manifest` beside it whose header is the tier's
namespace (model, KV layout: another layout's manifest is refused or discarded, never read as
ours).

Manifest records: a ``put`` per written slot, with group 0, the slot, the sha256 of the offload
key as its key, the offload key itself (hex) in the salt field, and the xxh3_64 of the bytes
written; a ``drop`` before a recorded slot is written again. So at any moment, crash or not,
a record names either the bytes its slot holds or bytes whose hash differs from the record.

The rule that keeps wrong bytes out: every load hashes the bytes it read and compares them
with the hash recorded at the write; a mismatch (a torn write before a crash, a damaged or
truncated file, a slot rewritten behind the record's back) fails that key and forgets the
block. A restart therefore reads nothing but the manifest: the blocks it names are indexed at
once and verified when loaded.

Threads: the index (which key is in which slot, pins, the eviction queue) is guarded by one
lock, held only for index work, never across I/O. vLLM's scheduler thread reads it without the
lock (``in``: one dict lookup, atomic under the GIL) and takes the lock only to :meth:`pin` a
load's keys (a counter each); the eviction work (:meth:`reserve`, :meth:`finish_store`,
:meth:`finish_load`, :meth:`touch`) runs on the tier's worker threads, as does the I/O
(:meth:`write`, :meth:`read`). A slot being written or read is reserved or pinned, so no two
threads ever touch one slot; the manifest has its own lock.

Pins: a pinned block is never evicted. :meth:`pin` only counts (cheap on the scheduler
thread); the eviction queue learns of it when a :meth:`reserve` needs room (pinned blocks
leave the queue first) and when the last :meth:`unpin` ends the load (one use).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

from kvpool.config import DEFAULT_PRIORITY
from kvpool.errors import ConfigError, ManifestError, StorageError
from kvpool.integrations.vllm.queues import new_queue
from kvpool.tiers.diskfile import DiskPool, open_persistent_pools, persistent_name
from kvpool.tiers.manifest import Manifest, ManifestEntry, OnDamage
from kvpool.tiers.remote.namespace import RemoteNamespace

__all__ = ["MANIFEST_NAME", "DiskChunks", "DiskRestore"]

MANIFEST_NAME: Final = "kvpool-vllm-tier.manifest"
_ON_DAMAGE: Final[dict[str, OnDamage]] = {
    "refuse": "raise", "keep_prefix": "keep_prefix", "discard": "discard",
}
_xxh3 = xxhash.xxh3_64_intdigest


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _check_space(directory: str, size: int) -> None:
    """A disk tier the file system cannot hold is refused before anything is allocated."""
    try:
        have = os.stat(os.path.join(directory, persistent_name(0))).st_size
    except FileNotFoundError:
        have = 0
    free = shutil.disk_usage(directory).free
    if free < size - have:
        raise StorageError(f"disk_path {directory!r} has {free} bytes free; the disk tier "
                           f"needs {size - have} more (disk_bytes)")


@dataclass(slots=True)
class DiskRestore:
    """What a start found in the manifest: blocks indexed, records refused (``invalid``: a
    slot beyond the file, a key that does not match its digest, a slot named twice)."""

    blocks: int = 0
    invalid: int = 0
    ignored_manifest_bytes: int = 0


class DiskChunks:
    """A bounded, persistent store of ``chunk_bytes`` chunks keyed by offload key (module doc)."""

    def __init__(self, directory: str, capacity_bytes: int, chunk_bytes: int,
                 namespace: RemoteNamespace, *, eviction_policy: str = "s3fifo",
                 on_damage: str = "keep_prefix", sync_interval_s: float | None = 1.0) -> None:
        slots = capacity_bytes // chunk_bytes
        if slots < 1:
            raise ConfigError(f"disk_bytes={capacity_bytes} holds no chunk of {chunk_bytes} "
                              "bytes; give the disk tier at least one chunk")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create disk_path {directory!r}: {e}") from e
        _check_space(directory, slots * chunk_bytes)
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        self._file: DiskPool = open_persistent_pools(directory, {0: (slots, chunk_bytes)})[0]
        try:
            self._manifest = Manifest(os.path.join(directory, MANIFEST_NAME), namespace,
                                      on_damage=_ON_DAMAGE[on_damage])
        except (ManifestError, OSError) as e:
            self._file.close()
            raise ManifestError(
                f"the kvpool disk tier in {directory!r} cannot start: {e}. With "
                "disk_manifest_damaged='discard' it starts empty instead"
            ) from e
        self._lock = threading.Lock()  # the index (module doc)
        self._manifest_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._sync_interval = sync_interval_s
        self._last_sync = time.monotonic()
        self._policy = new_queue(eviction_policy, slots)
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (slot, checksum): readable
        self._slot_key: list[bytes | None] = [None] * slots
        self._pending: dict[bytes, int] = {}  # key -> slot being written
        self._pins: dict[bytes, int] = {}  # key -> loads in flight
        self._doomed: set[bytes] = set()  # damaged, forgotten once unpinned
        self.restored = self._restore()
        used = {slot for slot, _ in self._index.values()}
        self._free = [s for s in range(slots - 1, -1, -1) if s not in used]
        self.closed = False

    def _restore(self) -> DiskRestore:
        stats = DiskRestore(ignored_manifest_bytes=self._manifest.ignored_bytes)
        for (group, slot), e in list(self._manifest.entries.items()):
            key = bytes.fromhex(e.cache_salt) if e.cache_salt is not None else None
            if (group != 0 or slot >= self.slots or key is None or e.key != _digest(key)
                    or key in self._index):
                stats.invalid += 1
                continue
            self._index[key] = (slot, e.data_checksum)
            self._slot_key[slot] = key
            self._policy.push(slot, DEFAULT_PRIORITY, key=key)
            stats.blocks += 1
        return stats

    # ------------------------------------------------------------ scheduler thread: the index

    def __contains__(self, key: object) -> bool:
        return key in self._index and key not in self._doomed

    def __len__(self) -> int:
        return len(self._index)

    def is_pending(self, key: bytes) -> bool:
        """Whether a store of ``key`` is in flight."""
        return key in self._pending

    @property
    def used_slots(self) -> int:
        return self.slots - len(self._free)

    def reserve(self, keys: Sequence[bytes]
                ) -> tuple[list[tuple[bytes, int]], list[bytes], int]:
        """Slots for the keys not stored or being stored yet, evicting unpinned blocks as
        needed: (the (key, slot) pairs to write, the keys evicted, how many keys got no slot:
        more than the unpinned blocks make room for)."""
        with self._lock:
            return self._reserve(keys)

    def _reserve(self, keys: Sequence[bytes]
                 ) -> tuple[list[tuple[bytes, int]], list[bytes], int]:
        offered = list(dict.fromkeys(keys))
        index, pending, queue = self._index, self._pending, self._policy
        new = [k for k in offered if k not in index and k not in pending]
        evicted: list[bytes] = []
        short = len(new) - len(self._free)
        if short > 0:
            for pinned in self._pins:  # pinned: out of the queue until their last unpin
                slot = index[pinned][0]
                if slot in queue:
                    queue.remove(slot)
            # the offered blocks already here are in use: out of the queue while victims go,
            # then back at its most recent end (one more use)
            kept = [(k, index[k][0]) for k in offered if k in index and k not in self._pins]
            if kept:
                queue.remove_many([slot for _, slot in kept])
            for slot in queue.pop_slots(min(short, len(queue))):
                victim = self._slot_key[slot]
                assert victim is not None and victim not in self._pins
                del index[victim]
                self._slot_key[slot] = None
                self._free.append(slot)
                evicted.append(victim)
            if kept:
                queue.push_many([slot for _, slot in kept], DEFAULT_PRIORITY,
                                [k for k, _ in kept])
        placed = [(key, self._free.pop()) for key in new[:len(self._free)]]
        for key, slot in placed:
            pending[key] = slot
        return placed, evicted, len(new) - len(placed)

    def commit(self, key: bytes, slot: int, checksum: int) -> None:
        """The write of ``key`` into ``slot`` finished: the block is readable."""
        self.finish_store([(key, slot, checksum)], ())

    def abort(self, key: bytes, slot: int) -> None:
        """The write of ``key`` failed: its slot is free again."""
        self.finish_store((), [(key, slot)])

    def finish_store(self, written: Sequence[tuple[bytes, int, int]],
                     aborted: Sequence[tuple[bytes, int]]) -> None:
        """:meth:`commit` each of ``written`` (key, slot, checksum), :meth:`abort` each of
        ``aborted`` (key, slot)."""
        with self._lock:
            pending, index, slot_key, policy = (self._pending, self._index, self._slot_key,
                                                self._policy)
            for key, slot, checksum in written:
                del pending[key]
                index[key] = (slot, checksum)
                slot_key[slot] = key
            if written:
                policy.push_many([s for _, s, _ in written], DEFAULT_PRIORITY,
                                 [k for k, _, _ in written])
            for key, slot in aborted:
                del pending[key]
                self._free.append(slot)

    def pin(self, key: bytes) -> tuple[int, int] | None:
        """(slot, checksum) of a readable block, kept from eviction until :meth:`unpin`; None
        if the key is not stored."""
        return self.pin_many([key])[0]

    def pin_many(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """:meth:`pin` of each key (one lock, a counter per key: the scheduler thread's
        part of a load)."""
        out: list[tuple[int, int] | None] = []
        with self._lock:
            index, doomed, pins = self._index, self._doomed, self._pins
            for key in keys:
                found = index.get(key)
                if found is None or key in doomed:
                    out.append(None)
                    continue
                pins[key] = pins.get(key, 0) + 1
                out.append(found)
        return out

    def unpin(self, key: bytes) -> list[bytes]:
        """End one load of ``key``; the keys forgotten by it (``key`` if it was discarded)."""
        return self.finish_load([key], ())

    def finish_load(self, pinned: Sequence[bytes], damaged: Sequence[bytes]) -> list[bytes]:
        """A load ended: the keys of ``damaged`` (pinned, bytes that failed their check) are
        forgotten once unpinned, each of ``pinned`` is unpinned (a use of the block when its
        last load ends). The keys forgotten."""
        forgotten: list[bytes] = []
        with self._lock:
            pins, doomed, index, policy = self._pins, self._doomed, self._index, self._policy
            doomed.update(k for k in damaged if k in pins)
            for key in pinned:
                left = pins.pop(key) - 1
                if left:
                    pins[key] = left
                    continue
                slot, _ = index[key]
                if key in doomed:
                    doomed.discard(key)
                    del index[key]
                    self._slot_key[slot] = None
                    if slot in policy:
                        policy.remove(slot)
                    self._free.append(slot)
                    forgotten.append(key)
                    continue
                if slot in policy:
                    policy.remove(slot)
                policy.push(slot, DEFAULT_PRIORITY, key=key)
        return forgotten

    def discard(self, key: bytes) -> None:
        """Forget a pinned block whose bytes failed their check, once its last load ends."""
        with self._lock:
            if key in self._pins:
                self._doomed.add(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a use of each readable, unpinned block (a reuse in the eviction policy)."""
        with self._lock:
            policy = self._policy
            for key in keys:
                found = self._index.get(key)
                if found is not None and key not in self._pins and found[0] in policy:
                    policy.remove(found[0])
                    policy.push(found[0], DEFAULT_PRIORITY, key=key)

    # ------------------------------------------------------------ worker threads: the bytes

    def write(self, placed: Sequence[tuple[bytes, int]], views: Sequence[memoryview]) -> list[int]:
        """Write ``views[i]`` into the slot of ``placed[i]`` and record them; the xxh3_64 of
        each. Raises :class:`StorageError` (nothing recorded for the slots not written)."""
        slots = [slot for _, slot in placed]
        with self._manifest_lock:
            entries = self._manifest.entries
            self._manifest.append_many(drops=[(0, s) for s in slots if (0, s) in entries])
        self._file.check()
        self._file.write(slots, views)  # hashes each chunk as it writes it (persistent file)
        sums = self._file.checksums
        assert sums is not None
        checksums = [sums[s] for s in slots]
        puts = [ManifestEntry(0, slot, _digest(key), (), None, checksum, None, key.hex())
                for (key, slot), checksum in zip(placed, checksums, strict=True)]
        with self._manifest_lock:
            self._manifest.append_many(puts=puts)
            self._manifest.maybe_compact()
        if (self._sync_interval is not None
                and time.monotonic() - self._last_sync >= self._sync_interval
                and self._sync_lock.acquire(blocking=False)):  # one thread syncs, none waits
            try:
                self._last_sync = time.monotonic()
                self.sync()
            finally:
                self._sync_lock.release()
        return checksums

    def read(self, slot: int, view: memoryview, checksum: int) -> bool:
        """Read ``slot`` into ``view``; whether its bytes hash to ``checksum`` (else ``view``
        holds bytes that must not be used). Raises :class:`StorageError` when the file cannot
        be read."""
        self._file.check()
        self._file.read([slot], [view])
        return _xxh3(view) == checksum

    def sync(self) -> None:
        """fsync the file, then the manifest: what was written survives a machine crash. The
        file's fsync (the long part) holds no lock: other threads go on writing meanwhile (a
        record whose bytes missed this fsync is verified at load like any other)."""
        if self.closed:
            return
        self._file.sync()
        with self._manifest_lock:
            if not self.closed:
                self._manifest.sync()

    def close(self) -> None:
        """Sync and close (idempotent); the file and manifest stay for the next process."""
        with self._manifest_lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._file.sync()
                self._manifest.close()
            finally:
                self._file.close()
