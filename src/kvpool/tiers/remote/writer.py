"""Write-behind to the remote tier: the scheduler hands blocks over, one thread writes them.

The scheduler thread must never wait for the network. :meth:`RemoteWriter.put` appends
``(namespace digest, remote key, payload)`` to a bounded in-memory queue and returns (a lock,
a deque append and two counters; ``benchmarks/bench_remote.py`` measures it). One background
thread takes up to ``batch_bytes`` of queued blocks at a time, encodes them
(:mod:`kvpool.tiers.remote.codec`) and writes them with one pipelined
:meth:`~kvpool.tiers.remote.store.BlockStore.put_many`.

- **Full queue**: when the queued payloads exceed ``max_pending_bytes``, the *oldest* queued
  writes are dropped (the newest blocks are the likeliest to be asked for again) and counted
  in :attr:`WriterStats.dropped`; ``put`` never blocks.
- **Remote failures**: a batch whose write raises :class:`RemoteTierError` is dropped and
  counted (:attr:`WriterStats.failed`); the store's backoff makes the following batches fail
  fast, so a dead server drains the queue quickly instead of stalling it. A server that is up
  but refuses writes (:class:`RemoteWriteRefusedError`: full under ``noeviction``, a read-only
  replica) fails its batches the same way, counted apart in :attr:`WriterStats.refused`; the
  store pauses only its writes, so reads (``prefetch``) go on. The remote tier is a cache: a
  lost write is a later miss, never wrong data.
- :meth:`flush` waits until every block put before the call is settled (written, failed or
  dropped); :meth:`close` flushes, then stops the thread.

``payload`` must not change after ``put`` (a ``bytes`` snapshot of the block, or a view of
memory the caller will not reuse until :meth:`flush` returns). Which blocks are put is the
caller's choice, by :data:`REMOTE_WRITE_MODES`: ``"evict"`` (default) writes the blocks that
leave the last local tier, ``"store"`` every stored block (write-through).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Final

from kvpool.errors import InvalidArgumentError, RemoteWriteRefusedError
from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.store import BlockStore
from kvpool.validation import check_int

__all__ = ["REMOTE_WRITE_MODES", "RemoteWriter", "WriterStats"]

REMOTE_WRITE_MODES: Final = ("evict", "store")
DEFAULT_MAX_PENDING_BYTES: Final = 1 << 30
DEFAULT_WRITE_BATCH_BYTES: Final = 64 << 20


@dataclass(slots=True)
class WriterStats:
    """Blocks handed to a :class:`RemoteWriter` and what became of them."""

    submitted: int = 0
    written: int = 0
    written_bytes: int = 0
    dropped: int = 0
    """Oldest queued writes dropped because the queue was over ``max_pending_bytes``."""
    dropped_bytes: int = 0
    failed: int = 0
    """Blocks of batches whose write raised (:class:`RemoteTierError`, or a bad item such as
    a namespace digest that is not 16 bytes: the thread carries on either way)."""
    refused: int = 0
    """Of :attr:`failed`, the blocks of batches the server refused while up (or that the
    store skipped while its writes paused after such a refusal)."""
    batches: int = 0


class RemoteWriter:
    """A bounded write-behind queue and its writing thread (module docstring)."""

    def __init__(
        self,
        store: BlockStore,
        *,
        mode: str = "evict",
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        batch_bytes: int = DEFAULT_WRITE_BATCH_BYTES,
    ) -> None:
        if mode not in REMOTE_WRITE_MODES:
            raise InvalidArgumentError(
                f"remote_write must be one of {list(REMOTE_WRITE_MODES)}, got {mode!r}"
            )
        for name, value in (("max_pending_bytes", max_pending_bytes),
                            ("batch_bytes", batch_bytes)):
            check_int(name, value, 1)
        self.store = store
        self.mode = mode
        self.max_pending_bytes = max_pending_bytes
        self.batch_bytes = batch_bytes
        self.codec = ValueCodec()
        self._queue: deque[tuple[bytes, bytes, bytes | memoryview]] = deque()
        self._pending_bytes = 0
        self._settled = 0  # blocks written, failed or dropped
        self._stats = WriterStats()
        self._cond = threading.Condition(threading.Lock())
        self._idle = False
        self._closing = False
        self.last_error: Exception | None = None
        """The error of the last batch that failed (usually a :class:`RemoteTierError`)."""
        self._thread = threading.Thread(target=self._run, name="kvpool-remote-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def stats(self) -> WriterStats:
        """A snapshot of the counters."""
        with self._cond:
            return replace(self._stats)

    @property
    def pending(self) -> int:
        """Blocks queued, not yet taken by the writing thread."""
        return len(self._queue)

    def put(self, namespace: bytes, remote_key: bytes, payload: bytes | memoryview) -> None:
        """Queue one block for writing; never blocks (a full queue drops its oldest)."""
        n = len(payload)
        cond = self._cond
        with cond:
            if self._closing:
                raise InvalidArgumentError("RemoteWriter.put after close()")
            queue = self._queue
            queue.append((namespace, remote_key, payload))
            self._stats.submitted += 1
            self._pending_bytes += n
            if self._pending_bytes > self.max_pending_bytes:
                self._drop_oldest()
            if self._idle:
                self._idle = False
                cond.notify()

    def _drop_oldest(self) -> None:
        queue, stats = self._queue, self._stats
        while self._pending_bytes > self.max_pending_bytes and len(queue) > 1:
            n = len(queue.popleft()[2])
            self._pending_bytes -= n
            stats.dropped += 1
            stats.dropped_bytes += n
            self._settled += 1

    def _take(self) -> list[tuple[bytes, bytes, bytes | memoryview]] | None:
        """The next batch (None once closing with nothing queued); waits while idle."""
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._idle = True
                self._cond.wait()
            queue = self._queue
            batch = [queue.popleft()]
            size = len(batch[0][2])
            while queue and size < self.batch_bytes:
                item = queue.popleft()
                batch.append(item)
                size += len(item[2])
            self._pending_bytes -= size
            return batch

    def _run(self) -> None:
        encode = self.codec.encode
        while (batch := self._take()) is not None:
            error: Exception | None = None
            try:
                self.store.put_many([(key, encode(ns, key, payload)) for ns, key, payload in batch])
            except Exception as e:  # the thread must live on, or flush() would wait forever
                error = e
            with self._cond:
                stats = self._stats
                stats.batches += 1
                if error is None:
                    stats.written += len(batch)
                    stats.written_bytes += sum(len(p) for _, _, p in batch)
                else:
                    stats.failed += len(batch)
                    if isinstance(error, RemoteWriteRefusedError):
                        stats.refused += len(batch)
                    self.last_error = error
                self._settled += len(batch)
                self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every block put before this call is written, failed or dropped; False if
        ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._stats.submitted
            while self._settled < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._idle and self._queue:  # pragma: no cover - put always wakes it
                    self._idle = False
                    self._cond.notify()
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued, then stop the thread. False if ``timeout_s`` passed first
        (the thread then stops after its current batch; what is still queued is dropped)."""
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            if not flushed:
                while self._queue:
                    n = len(self._queue.popleft()[2])
                    self._stats.dropped += 1
                    self._stats.dropped_bytes += n
                    self._settled += 1
                self._pending_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return flushed

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
