"""A Redis- or Valkey-compatible server as a block store: batched reads and writes of raw values.

:class:`RemoteStore` speaks to one server or a cluster through redis-py (the ``remote`` extra):

- ``get_many`` / ``put_many`` / ``exists_many`` / ``delete_many`` take many keys per call and
  send them in pipelined round trips of about ``batch_bytes`` each (64 MiB by default), so a
  call costs a few round trips whatever its size, and neither side buffers gigabytes. Reads use
  ``MGET`` per round trip (one command, one reply) on a single server, and redis-py's per-node
  pipelines on a cluster. Values larger than redis-py's 6,000-byte cutoff are sent as they are
  (no copy into a command buffer).
- A cluster is used when the URL's scheme says so (``redis+cluster://``, ``rediss+cluster://``)
  or the server reports ``cluster_enabled:1``; keys (:mod:`kvpool.tiers.remote.namespace`) carry no
  hash tags, so they spread over every slot.
- A server that is down, slow (``timeout_s``) or answering errors raises
  :class:`RemoteTierError`, counted in :attr:`RemoteStore.stats`. After a failure the client
  is dropped and every call fails fast, without touching the network, until a backoff expires
  (``backoff_s`` doubling to ``backoff_max_s``); the next call then reconnects, and a success
  resets the backoff. redis-py's own retries are off: one policy, this one, decides when to
  try again.
- A server that is up but refuses *writes* (``OOM`` under ``maxmemory`` with
  ``noeviction``, ``READONLY`` on a replica, ``NOPERM``, ``MISCONF``, ``NOREPLICAS``: see
  :data:`WRITE_REFUSALS`) is not down: ``put_many`` raises :class:`RemoteWriteRefusedError`
  (counted in ``write_refusals``, the values it refused in ``values_refused``), the client and
  its connections are kept, and reads go on as before. Only writes pause: for the same
  doubling backoff, ``put_many`` is skipped without a try (``writes_skipped``), so a full
  server is not sent every batch; a write the server takes again resets the pause.

The store holds bytes, it does not judge them: values are encoded and verified by
:mod:`kvpool.tiers.remote.codec`. redis-py is imported only when a store connects, so that the rest
of kvpool (and :class:`~kvpool.tiers.remote.memory.MemoryStore`) works without the ``remote`` extra;
without it, building a :class:`RemoteStore` raises :class:`StorageError` saying what to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from kvpool.errors import (
    InvalidArgumentError,
    RemoteTierError,
    RemoteWriteRefusedError,
    StorageError,
)
from kvpool.validation import check_int, check_number

__all__ = ["DEFAULT_BATCH_BYTES", "WRITE_REFUSALS", "BlockStore", "RemoteStore",
           "RemoteStoreStats", "is_write_refusal"]

DEFAULT_BATCH_BYTES: Final = 64 << 20
_CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_READ_SIZE_GUESS: Final = 4 << 20  # bytes per value before any was read (a small first round)
_MAX_KEYS_PER_ROUND: Final = 4096
WRITE_REFUSALS: Final = ("OOM", "READONLY", "NOPERM", "MISCONF", "NOREPLICAS")
"""The error codes of a server that is up but refuses a write (redis-py turns the first three
into ``OutOfMemoryError``, ``ReadOnlyError`` and ``NoPermissionError`` and drops the code from
the message; the others stay ``ResponseError`` s whose message starts with the code)."""

T = TypeVar("T")
Item = tuple[bytes, bytes | memoryview]
Value = bytes | bytearray
"""A value read back: ``bytes``, or a ``bytearray`` the reply was read into (no copy)."""


class BlockStore(Protocol):
    """What the remote tier needs of a store (:class:`RemoteStore`, or the in-process
    :class:`kvpool.tiers.remote.memory.MemoryStore`)."""

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]: ...
    def put_many(self, items: Sequence[Item]) -> None: ...
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]: ...
    def delete_many(self, keys: Sequence[bytes]) -> int: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class RemoteStoreStats:
    """Counters of a :class:`RemoteStore` since it was built."""

    round_trips: int = 0
    values_read: int = 0
    values_missing: int = 0
    bytes_read: int = 0
    values_written: int = 0
    bytes_written: int = 0
    errors: int = 0
    """Calls that failed on the network or the server (each raised :class:`RemoteTierError`)."""
    fast_failures: int = 0
    """Calls refused without a try while the backoff after an error ran."""
    connects: int = 0
    write_refusals: int = 0
    """``put_many`` calls the server refused (:data:`WRITE_REFUSALS`) while it was up; each
    raised :class:`RemoteWriteRefusedError`, and reads went on."""
    values_refused: int = 0
    """Values those calls did not store (the others in their round trips were stored)."""
    writes_skipped: int = 0
    """``put_many`` calls skipped without a try while writes paused after a refusal."""


def is_write_refusal(error: BaseException) -> bool:
    """Whether ``error`` is a server's refusal of a write (:data:`WRITE_REFUSALS`)."""
    from redis.exceptions import (
        NoPermissionError,
        OutOfMemoryError,
        ReadOnlyError,
        ResponseError,
    )

    if isinstance(error, OutOfMemoryError | ReadOnlyError | NoPermissionError):
        return True
    return isinstance(error, ResponseError) and str(error).startswith(WRITE_REFUSALS[3:])


class _Refused(Exception):
    """Raised inside a put when the server refused some of its values (caught in ``_call``)."""

    def __init__(self, error: BaseException, refused: int) -> None:
        super().__init__(error)
        self.error = error
        self.refused = refused


def split_url(url: str, name: str = "remote_url") -> tuple[str, bool]:
    """(the URL redis-py connects to, whether it names a cluster); InvalidArgumentError (naming
    the setting ``name``) for anything but a redis/rediss/unix/valkey URL or a ``+cluster`` one."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(f"{name} must be a redis:// URL, got {url!r}")
    scheme, rest = url.split("://", 1)
    if scheme in _CLUSTER_SCHEMES:
        return f"{_CLUSTER_SCHEMES[scheme]}://{rest}", True
    if scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
        raise InvalidArgumentError(
            f"{name} scheme {scheme!r} is not redis://, rediss://, unix://, "
            f"redis+cluster:// or rediss+cluster://"
        )
    if scheme.startswith("valkey"):
        return f"redis{scheme[6:]}://{rest}", False
    return url, False


def _mget(client: Any, keys: list[bytes]) -> list[bytearray | None]:
    """``MGET`` on one server: sent by redis-py, its reply read by :mod:`kvpool.tiers.remote.resp`
    into one buffer per value. A connection that fails mid-reply is dropped, never reused."""
    from kvpool.tiers.remote.resp import read_mget_reply

    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_command("MGET", *keys))
        return read_mget_reply(conn._sock, len(keys))
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _pipelined_gets(client: Any, keys: list[bytes]) -> list[Value | None]:
    """GETs in one pipeline (a cluster's: one per node); a key holding another type than a
    string (a ``WRONGTYPE`` reply) reads as missing, as it does in ``MGET``."""
    from redis.exceptions import ResponseError

    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    values: list[Value | None] = []
    for v in pipe.execute(raise_on_error=False):
        if isinstance(v, ResponseError):
            values.append(None)
        elif isinstance(v, BaseException):
            raise v
        else:
            values.append(v)
    return values


class RemoteStore:
    """Batched block reads and writes on a Redis- or Valkey-compatible server (module doc).

    Thread-safe: redis-py's connection pool serves concurrent calls; the backoff state is
    guarded by a lock. Nothing is connected until the first call.
    """

    def __init__(
        self,
        url: str,
        *,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        timeout_s: float = 2.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url, self._cluster_url = split_url(url)
        if importlib.util.find_spec("redis") is None:
            raise StorageError(
                "the remote tier needs redis-py: install kvpool with the 'remote' extra "
                "(pip install 'kvpool[remote]')"
            )
        self.batch_bytes = check_int("batch_bytes", batch_bytes, 1)
        self.timeout_s = check_number("timeout_s", timeout_s, 0, above=True)
        self.backoff_s = check_number("backoff_s", backoff_s, 0, above=True)
        self.backoff_max_s = max(check_number("backoff_max_s", backoff_max_s, 0, above=True),
                                 self.backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._cluster = False
        self._down_until = 0.0
        self._next_backoff = self.backoff_s
        self._writes_until = 0.0  # writes are skipped until then (after a refusal)
        self._next_write_pause = self.backoff_s
        self._value_size = _READ_SIZE_GUESS
        self.stats = RemoteStoreStats()

    # ----------------------------------------------------------------------------------------
    # connection and failure policy

    @property
    def is_cluster(self) -> bool:
        """Whether the connected server is a cluster (known after the first successful call)."""
        return self._cluster

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        opts: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if not self._cluster_url:
            client = redis.Redis.from_url(self.url, **opts)
            if client.info("cluster").get("cluster_enabled") != 1:
                return client
            client.close()
        return RedisCluster.from_url(self.url, **opts)

    def _call(self, what: str, op: Callable[[Any], T], *, write: bool = False) -> T:
        """Run ``op(client)``: fail fast during a backoff, map every failure to
        :class:`RemoteTierError`, drop the client and start a backoff after one. A ``write``
        the server refused (``op`` raised :class:`_Refused`) keeps the client and pauses
        writes only."""
        import redis

        with self._lock:
            now = self._clock()
            if now < self._down_until:
                self.stats.fast_failures += 1
                wait = self._down_until - now
                raise RemoteTierError(
                    f"remote tier {self.url} is unavailable; retrying in {wait:.1f} s", wait
                )
            if write and now < self._writes_until:
                self.stats.writes_skipped += 1
                wait = self._writes_until - now
                raise RemoteWriteRefusedError(
                    f"remote tier {self.url} refused writes; skipping them for {wait:.1f} s "
                    "(reads go on)", wait
                )
            client = self._client
        try:
            if client is None:
                fresh = self._connect()
                with self._lock:
                    client = self._client
                    if client is None:  # else another thread connected first: use its client
                        client = self._client = fresh
                        self._cluster = not isinstance(client, redis.Redis)
                        self.stats.connects += 1
                if client is not fresh:
                    fresh.close()
            result = op(client)
        except _Refused as r:
            raise self._refused(what, r) from r.error
        except (redis.RedisError, OSError) as e:
            raise self._failed(what, e) from e
        with self._lock:
            self._next_backoff = self.backoff_s
            if write:
                self._next_write_pause = self.backoff_s
        return result

    def _refused(self, what: str, refused: _Refused) -> RemoteWriteRefusedError:
        """The server is up and refused a write: counted, writes pause, the client stays."""
        with self._lock:
            self.stats.write_refusals += 1
            self.stats.values_refused += refused.refused
            self._next_backoff = self.backoff_s  # it answered: it is not down
            wait = self._next_write_pause
            self._writes_until = self._clock() + wait
            self._next_write_pause = min(wait * 2, self.backoff_max_s)
        error = refused.error
        return RemoteWriteRefusedError(
            f"remote tier {self.url}: the server refused a {what} of {refused.refused} "
            f"value(s) ({type(error).__name__}: {error}); reads go on, writes are skipped "
            f"for {wait:.1f} s", wait
        )

    def _failed(self, what: str, error: BaseException) -> RemoteTierError:
        with self._lock:
            self.stats.errors += 1
            wait = self._next_backoff
            self._down_until = self._clock() + wait
            self._next_backoff = min(wait * 2, self.backoff_max_s)
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a broken client may fail to close
                client.close()
        return RemoteTierError(
            f"remote tier {self.url}: {what} failed ({type(error).__name__}: {error}); "
            f"calls fail fast for {wait:.1f} s, then reconnect", wait
        )

    def close(self) -> None:
        """Close the connections (a later call connects again)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------
    # batched operations

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        """The value of each key, None where it has none; a few round trips of ``batch_bytes``."""
        keys = list(keys)
        if not keys:
            return []
        return self._call("get", lambda client: self._get(client, keys))

    def _get(self, client: Any, keys: list[bytes]) -> list[Value | None]:
        out: list[Value | None] = []
        stats = self.stats
        start = 0
        while start < len(keys):
            n = max(1, min(_MAX_KEYS_PER_ROUND, self.batch_bytes // self._value_size))
            chunk = keys[start:start + n]
            start += n
            if self._cluster:
                values: list[Value | None] = _pipelined_gets(client, chunk)
            else:
                values = list(_mget(client, chunk))
            stats.round_trips += 1
            found = [len(v) for v in values if v is not None]
            if found:
                self._value_size = max(1, sum(found) // len(found))
                stats.bytes_read += sum(found)
            stats.values_read += len(found)
            stats.values_missing += len(values) - len(found)
            out.extend(values)
        return out

    def _rounds(self, items: Sequence[Item]) -> Iterator[Sequence[Item]]:
        """``items`` cut into runs of about ``batch_bytes`` (at least one item each)."""
        start, size = 0, 0
        for i, (_, value) in enumerate(items):
            size += len(value)
            if size >= self.batch_bytes:
                yield items[start:i + 1]
                start, size = i + 1, 0
        if start < len(items):
            yield items[start:]

    def put_many(self, items: Sequence[Item]) -> None:
        """Store each ``(key, value)``; pipelined ``SET`` round trips of about ``batch_bytes``.
        :class:`RemoteWriteRefusedError` when the server refused some (module docstring): the
        round trip's other values are stored, the later round trips are not sent."""
        if not items:
            return

        def put(client: Any) -> None:
            stats = self.stats
            stored = 0
            for run in self._rounds(items):
                pipe = client.pipeline(transaction=False)
                for key, value in run:
                    pipe.set(key, value)
                replies = pipe.execute(raise_on_error=False)
                stats.round_trips += 1
                refusal: BaseException | None = None
                for (_, value), reply in zip(run, replies, strict=True):
                    if not isinstance(reply, BaseException):
                        stored += 1
                        stats.values_written += 1
                        stats.bytes_written += len(value)
                    elif is_write_refusal(reply):
                        refusal = reply
                    else:
                        raise reply
                if refusal is not None:
                    raise _Refused(refusal, len(items) - stored)

        self._call("put", put, write=True)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a value now (another engine or the server may change it)."""
        keys = list(keys)
        if not keys:
            return []

        def exists(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            self.stats.round_trips += 1
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", exists)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete the keys; return how many held a value."""
        keys = list(keys)
        if not keys:
            return 0

        def delete(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(k)
            self.stats.round_trips += 1
            return sum(int(n) for n in pipe.execute())

        return self._call("delete", delete)
