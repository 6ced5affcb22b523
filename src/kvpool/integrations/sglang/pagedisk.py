"""SGLang's pages on kvpool's persistent disk tier: a fixed-size file of slots, a crash-safe
manifest of which page each slot holds, an eviction policy over the slots, and a checksum per
page checked on every read and at every restart.

The pieces are kvpool's own: the file is a persistent :class:`~kvpool.tiers.diskfile.DiskPool`
(``pread``/``pwrite``, its space reserved when it is opened, an exclusive ``flock`` while open),
the manifest a :class:`~kvpool.tiers.manifest.Manifest` (append-only, every record checksummed,
header naming the namespace), the policy one of :mod:`kvpool.eviction`'s.

A page is ``segments`` equal runs of bytes in SGLang's host pool (two for an MHA page in the
``page_first`` layout: its K and its V); each run is one slot of the file, so a page moves
between the file and the host pool with one ``preadv``/``pwrite`` per run and no copy in
between. Page ``p`` owns file slots ``p * segments`` to ``p * segments + segments - 1``.

Checksums: the file records the xxh3_64 of each run it writes; a page's checksum is the
xxh3_64 of its runs' checksums. The manifest's ``put`` record carries it. A read recomputes
it from the bytes it read (into the host pool) and reports a miss when it differs, and
forgets the page (a damaged page is never served, and a later write replaces it). A restart
re-hashes every recorded page's bytes from the file and keeps the pages whose checksum
matches: a write torn by a crash, a ``drop`` lost with the process, a damaged file are misses.

Keeping the manifest in step: a victim's ``drop`` is written before its slot is rewritten,
the new page's ``put`` after its bytes; a ``put`` that cannot be written (a full disk) fails
that page's store and frees its slot. The file and the manifest are fsynced every
``sync_interval_s`` of writes and at :meth:`PageDisk.close`.

Not thread-safe: :class:`~kvpool.integrations.sglang.storage.KvpoolHiCacheStorage` calls it
under its lock.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import xxhash

from kvpool.config import DEFAULT_PRIORITY
from kvpool.errors import InvalidArgumentError, ManifestError, StorageError
from kvpool.eviction import EvictionPolicy, make_policy
from kvpool.tiers.diskfile import DiskPool, open_persistent_pools
from kvpool.tiers.manifest import Manifest, ManifestEntry, OnDamage
from kvpool.tiers.remote.namespace import RemoteNamespace

__all__ = ["MANIFEST_NAME", "DiskCounters", "PageDisk", "page_checksum"]

MANIFEST_NAME = "kvpool-sglang.manifest"
_ON_DAMAGE: dict[str, OnDamage] = {
    "refuse": "raise", "keep_prefix": "keep_prefix", "discard": "discard",
}
_xxh3 = xxhash.xxh3_64_intdigest
Segments = Sequence[memoryview]


def page_checksum(run_sums: Sequence[int]) -> int:
    """A page's checksum: the xxh3_64 of its runs' xxh3_64 (little-endian u64 each)."""
    return _xxh3(b"".join(s.to_bytes(8, "little") for s in run_sums))


@dataclass(slots=True)
class DiskCounters:
    """What the disk tier did since it opened (:meth:`PageDisk.stats`)."""

    restored: int = 0
    stale: int = 0
    invalid: int = 0
    hits: int = 0
    misses: int = 0
    damaged: int = 0
    writes: int = 0
    evictions: int = 0
    write_failures: int = 0
    read_failures: int = 0


class PageDisk:
    """``pages`` pages of ``segments`` runs of ``run_bytes`` in ``directory`` (module doc)."""

    def __init__(self, directory: str, namespace: RemoteNamespace, *, pages: int,
                 segments: int, run_bytes: int, policy: str = "2q",
                 sync_interval_s: float = 5.0, on_damage: str = "keep_prefix",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if pages < 1 or segments < 1 or run_bytes < 1:
            raise InvalidArgumentError(
                f"the disk tier needs pages, segments and run bytes >= 1, got {pages}, "
                f"{segments}, {run_bytes}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.pages, self.segments, self.run_bytes = pages, segments, run_bytes
        self._clock = clock
        self._interval = sync_interval_s
        self._pool: DiskPool = open_persistent_pools(
            directory, {0: (pages * segments, run_bytes)})[0]
        try:
            self.manifest = Manifest(os.path.join(directory, MANIFEST_NAME), namespace,
                                     on_damage=_ON_DAMAGE[on_damage])
        except BaseException as exc:
            self._pool.close()
            if isinstance(exc, ManifestError):
                raise ManifestError(
                    f"the kvpool disk tier in {directory!r} cannot start: {exc}; set "
                    "disk_manifest_damaged to 'discard' to start it empty") from exc
            raise
        self._policy = cast(EvictionPolicy, make_policy(policy, clock, capacity=pages))
        self._policy_name = policy
        self._slot_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * pages
        self._sum_of = [0] * pages
        self._free: list[int] = []
        self._last_sync = clock()
        self.counters = DiskCounters()
        self._restore()

    # ------------------------------------------------------------------ restart

    def _restore(self) -> None:
        """Index the recorded pages whose bytes still match their checksum; rewrite the
        manifest to exactly them."""
        entries = [e for e in self.manifest.entries.values()]
        usable = [e for e in entries
                  if e.group == 0 and e.slot < self.pages and isinstance(e.key, bytes)]
        self.counters.invalid = len(entries) - len(usable)
        runs = [e.slot * self.segments + j for e in usable for j in range(self.segments)]
        sums = self._pool.hash_slots(runs) if runs else []
        kept: list[ManifestEntry] = []
        for i, e in enumerate(usable):
            mine = sums[i * self.segments:(i + 1) * self.segments]
            key = cast(bytes, e.key)
            if page_checksum(mine) != e.data_checksum or key in self._slot_of:
                self.counters.stale += 1
                continue
            self._index(key, e.slot, e.data_checksum)
            kept.append(e)
        entries_now = self.manifest.entries
        entries_now.clear()
        entries_now.update(((0, e.slot), e) for e in kept)
        self.manifest.paths.clear()
        self.manifest.compact()
        self.counters.restored = len(kept)
        used = set(self._slot_of.values())
        self._free = [s for s in range(self.pages - 1, -1, -1) if s not in used]

    def _index(self, key: bytes, slot: int, checksum: int) -> None:
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._sum_of[slot] = checksum
        self._policy.push(slot, DEFAULT_PRIORITY, key=key)

    # ------------------------------------------------------------------ lookups

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        slot_of = self._slot_of
        for i, key in enumerate(keys):
            if key not in slot_of:
                return i
        return len(keys)

    # ------------------------------------------------------------------ reads

    def read(self, key: bytes, runs: Segments) -> bool:
        """Read page ``key`` into ``runs`` (``segments`` views of ``run_bytes``); False (and
        the page forgotten when its bytes are damaged) when it cannot be served."""
        slot = self._slot_of.get(key)
        if slot is None:
            self.counters.misses += 1
            return False
        first = slot * self.segments
        try:
            self._pool.read(range(first, first + self.segments), runs)
        except StorageError:
            self.counters.read_failures += 1
            return False
        if page_checksum([_xxh3(r) for r in runs]) != self._sum_of[slot]:
            self.counters.damaged += 1
            self._forget([slot])
            return False
        self.counters.hits += 1
        self._policy.remove(slot)  # a hit: released again, most recent (and more frequent)
        self._policy.push(slot, DEFAULT_PRIORITY, key=key)
        return True

    # ------------------------------------------------------------------ writes

    def write_many(self, items: Sequence[tuple[bytes, Segments]]) -> list[bool]:
        """Store each ``(key, runs)`` (a page already held counts as stored); whether each
        page is stored. A victim of the policy makes room when no slot is free."""
        done = [key in self._slot_of for key, _ in items]
        todo: list[int] = []
        seen: set[bytes] = set()
        for i, ok in enumerate(done):  # a key listed twice is stored once, as first listed
            if not ok and items[i][0] not in seen:
                seen.add(items[i][0])
                todo.append(i)
        slots = self._claim(len(todo))
        self.counters.write_failures += len(todo) - len(slots)  # no room could be recorded
        puts: list[ManifestEntry] = []
        written: list[tuple[int, int, bytes]] = []
        for i, slot in zip(todo, slots, strict=False):
            key, runs = items[i]
            first = slot * self.segments
            try:
                self._pool.write(range(first, first + self.segments), runs)
            except StorageError:
                self.counters.write_failures += 1
                self._free.append(slot)
                continue
            sums = self._pool.checksums
            assert sums is not None  # a persistent pool records them
            checksum = page_checksum(sums[first:first + self.segments])
            puts.append(ManifestEntry(0, slot, key, (), None, checksum))
            written.append((i, slot, key))
        try:
            self.manifest.append_many(puts=puts)
        except StorageError:
            self.counters.write_failures += len(written)
            self._free += [slot for _, slot, _ in written]
            written = []
        for (i, slot, key), e in zip(written, puts, strict=True):
            self._index(key, slot, e.data_checksum)
            done[i] = True
        self.counters.writes += len(written)
        for i, ok in enumerate(done):
            if not ok and items[i][0] in self._slot_of:
                done[i] = True  # the same key stored by an earlier item of this call
        self._maybe_sync()
        return done

    def _claim(self, n: int) -> list[int]:
        """``n`` slots (fewer when the drop of a victim cannot be recorded): free ones first,
        then victims, whose drops are recorded before their slots are rewritten."""
        take = min(n, len(self._free))
        slots = [self._free.pop() for _ in range(take)]
        need = min(n - take, len(self._policy))
        if need:
            victims = self._policy.pop_slots(need)
            try:
                self.manifest.append_many(drops=[(0, s) for s in victims])
            except StorageError:
                for s in victims:  # back in the queue: their pages are still recorded
                    key = self._key_of[s]
                    assert key is not None
                    self._policy.push(s, DEFAULT_PRIORITY, key=key)
                return slots
            for s in victims:
                key = self._key_of[s]
                assert key is not None
                del self._slot_of[key]
                self._key_of[s] = None
            self.counters.evictions += len(victims)
            slots += victims
        return slots

    def _forget(self, slots: Sequence[int]) -> None:
        """Drop the pages of ``slots`` (damaged): unindexed even when the drop record cannot
        be written (a restart re-checks their bytes anyway)."""
        for s in slots:
            key = self._key_of[s]
            if key is None:
                continue
            del self._slot_of[key]
            self._key_of[s] = None
            if s in self._policy:
                self._policy.remove(s)
            self._free.append(s)
        with contextlib.suppress(StorageError):
            self.manifest.append_many(drops=[(0, s) for s in slots])

    # ------------------------------------------------------------------ upkeep

    def _maybe_sync(self) -> None:
        if self._clock() - self._last_sync >= self._interval:
            self.sync()
        elif self.manifest.needs_compaction():
            self.manifest.compact()

    def sync(self) -> None:
        """fsync the file, then the manifest (compacted when mostly dead records)."""
        self._pool.sync()
        self.manifest.sync()
        if self.manifest.needs_compaction():
            self.manifest.compact()
        self._last_sync = self._clock()

    def clear(self) -> None:
        """Forget every page (the manifest becomes empty)."""
        self.manifest.clear()
        self._slot_of.clear()
        self._key_of = [None] * self.pages
        self._free = list(range(self.pages - 1, -1, -1))
        self._policy = cast(EvictionPolicy,
                            make_policy(self._policy_name, self._clock, capacity=self.pages))

    def stats(self) -> dict[str, int | str]:
        """Counters and occupancy, for monitoring."""
        c = self.counters
        return {
            "path": self.directory, "pages": len(self._slot_of), "capacity_pages": self.pages,
            "page_bytes": self.segments * self.run_bytes, "restored": c.restored,
            "stale_at_restart": c.stale, "invalid_at_restart": c.invalid, "hits": c.hits,
            "misses": c.misses, "damaged": c.damaged, "writes": c.writes,
            "evictions": c.evictions, "write_failures": c.write_failures,
            "read_failures": c.read_failures,
        }

    def close(self) -> None:
        """Sync and close the manifest and the file. Idempotent."""
        if self._pool.closed:
            return
        try:
            self.sync()
        finally:
            self.manifest.close()
            self._pool.close()
