"""What a ``KvpoolTier``'s worker threads do for one job, and what they report back.

A job's task never raises: every failure (a disk error, a server down, bytes that fail their
check) becomes keys reported as not stored or not loaded, counted by reason, and the report
(:class:`StoreDone`, :class:`LoadDone`) goes to the tier's queue, which the scheduler thread
drains in ``get_finished_jobs``. The scheduler thread only checks a job and queues it (a load
also pins its disk keys); the tasks do the rest: the disk tier's slot reservation and
eviction, the byte copies from and into the primary pool's chunks (vLLM keeps them valid for
the job's life: ``TransferJob.chunk_ids`` are pinned until the job is reported finished), the
hashing, the I/O, and the index updates after it (``finish_store``, ``finish_load``).

Failure reasons (``failures``): ``disk_error`` (the disk file could not be read or written),
``checksum`` (disk bytes that differ from the hash recorded with them), ``remote_error`` (the
server failed or is in its backoff), ``remote_missing`` (no intact value under the key: never
stored, evicted, flushed, damaged), ``no_space`` (a store found no unpinned block to evict),
``missing`` (a load of a key the tier does not hold), ``internal`` (a bug: the job fails).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.errors import RemoteTierError, StorageError
from kvpool.integrations.vllm.disk import DiskChunks
from kvpool.integrations.vllm.remote import RemoteChunks

__all__ = ["LoadDone", "LoadItem", "StoreDone", "run_load", "run_store"]


@dataclass(slots=True)
class StoreDone:
    """A store job's outcome: disk slots written (key, slot, checksum) or given back
    (key, slot), keys evicted from disk to make room, keys written to the remote store, and
    the failed keys by reason."""

    job_id: int
    keys: list[bytes]
    evicted: list[bytes] = field(default_factory=list)
    written: list[tuple[bytes, int, int]] = field(default_factory=list)
    aborted: list[tuple[bytes, int]] = field(default_factory=list)
    remote_stored: list[bytes] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    nbytes: int = 0


@dataclass(slots=True)
class LoadItem:
    """One key of a load: the primary pool's chunk to fill, its pinned disk copy (slot,
    checksum) if any, whether the remote store may have it."""

    key: bytes
    chunk: int
    disk: tuple[int, int] | None
    remote: bool


@dataclass(slots=True)
class LoadDone:
    """A load job's outcome: the keys loaded (their chunks hold the stored bytes), the disk
    keys pinned for it, those whose disk bytes failed their check (``forgotten``: the keys the
    disk tier dropped because of that), those the remote store lacked."""

    job_id: int
    keys: list[bytes]
    loaded: list[bytes] = field(default_factory=list)
    pinned: list[bytes] = field(default_factory=list)
    damaged: list[bytes] = field(default_factory=list)
    forgotten: list[bytes] = field(default_factory=list)
    remote_missing: list[bytes] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    nbytes: int = 0


def run_store(done: StoreDone, disk: DiskChunks | None, chunk_ids: Sequence[int],
              remote: RemoteChunks | None, remote_keys: Sequence[bytes],
              view_of: Callable[[int], memoryview], post: Callable[[object], None]) -> None:
    """Reserve disk slots for the job's keys (evicting as needed), write them to disk and
    ``remote_keys`` to the remote store, record what was written, then ``post(done)``; never
    raises."""
    start = time.perf_counter()
    chunk_of = dict(zip(done.keys, chunk_ids, strict=True))
    placed: list[tuple[bytes, int]] = []
    try:
        if disk is not None:
            placed, done.evicted, unplaced = disk.reserve(done.keys)
            if unplaced:
                done.failures["no_space"] += unplaced
            if placed:
                _write_disk(done, disk, placed, [view_of(chunk_of[k]) for k, _ in placed])
        if remote is not None and remote_keys:
            views = [view_of(chunk_of[k]) for k in remote_keys]
            try:
                remote.put(remote_keys, views)
            except RemoteTierError:
                done.failures["remote_error"] += len(remote_keys)
            else:
                done.remote_stored.extend(remote_keys)
                done.nbytes += sum(v.nbytes for v in views)
    except Exception:  # a bug must fail the job, not lose it
        written = {k for k, _, _ in done.written}
        done.aborted.extend((k, s) for k, s in placed if k not in written)
        done.failures["internal"] += 1
    finally:
        try:
            if disk is not None and (done.written or done.aborted):
                disk.finish_store(done.written, done.aborted)
        finally:
            done.seconds = time.perf_counter() - start
            post(done)


def _write_disk(done: StoreDone, disk: DiskChunks, placed: Sequence[tuple[bytes, int]],
                views: Sequence[memoryview]) -> None:
    try:
        sums = disk.write(placed, views)
    except StorageError:
        done.aborted.extend(placed)
        done.failures["disk_error"] += len(placed)
    else:
        done.written.extend((k, s, c) for (k, s), c in zip(placed, sums, strict=True))
        done.nbytes += disk.chunk_bytes * len(placed)


def run_load(done: LoadDone, chunk_ids: Sequence[int], on_disk: Sequence[tuple[int, int] | None],
             view_of: Callable[[int], memoryview], disk: DiskChunks | None,
             remote: RemoteChunks | None, post: Callable[[object], None]) -> None:
    """Fill each key's chunk from its pinned disk copy (``on_disk``: slot, checksum; verified)
    or else the remote store (verified), unpin the disk copies, then ``post(done)``; never
    raises. A chunk whose key failed holds bytes nobody may use: the job reports that key as
    not loaded."""
    start = time.perf_counter()
    loaded = done.loaded
    try:
        items = [LoadItem(k, c, d, remote is not None)
                 for k, c, d in zip(done.keys, chunk_ids, on_disk, strict=True)]
        wanted: list[tuple[LoadItem, memoryview]] = []
        for item in items:
            view = view_of(item.chunk)
            if (item.disk is not None and disk is not None
                    and _read_disk(disk, item, view, done)):
                loaded.append(item.key)
                done.nbytes += view.nbytes
                continue
            if item.remote:
                wanted.append((item, view))
            elif item.disk is None:
                done.failures["missing"] += 1
        if wanted and remote is not None:
            try:
                found = remote.get_into([i.key for i, _ in wanted], [v for _, v in wanted])
            except RemoteTierError:
                done.failures["remote_error"] += len(wanted)
            else:
                for (item, view), ok in zip(wanted, found, strict=True):
                    if ok:
                        loaded.append(item.key)
                        done.nbytes += view.nbytes
                    else:
                        done.remote_missing.append(item.key)
                        done.failures["remote_missing"] += 1
    except Exception:  # a bug must fail the job, not lose it; no key of it counts as loaded
        loaded.clear()
        done.failures["internal"] += 1
    finally:
        try:
            if disk is not None and done.pinned:
                done.forgotten = disk.finish_load(done.pinned, done.damaged)
        finally:
            done.seconds = time.perf_counter() - start
            post(done)


def _read_disk(disk: DiskChunks, item: LoadItem, view: memoryview, done: LoadDone) -> bool:
    assert item.disk is not None
    slot, checksum = item.disk
    try:
        if disk.read(slot, view, checksum):
            return True
    except StorageError:
        done.failures["disk_error"] += 1
        return False
    done.damaged.append(item.key)
    done.failures["checksum"] += 1
    return False
