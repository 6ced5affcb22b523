"""The disk tier's files: one per layer group under ``disk_path``, read and written with
``pread``/``pwrite`` (never memory-mapped), locked by their owner, removed at close and on
SIGTERM, and reclaimed from dead owners when a storage starts.

Why no memory map: a mapped file truncated under a running process turns the next access into
SIGBUS, which kills the process, and the GPU and host KV with it. Through ``pread``/``pwrite``
a truncated file is a short read or write, and :meth:`DiskPool.check` (one ``fstat`` before
every batch) sees a truncated or removed file before anything moves: both are a
:class:`StorageError`. The blocks are reserved at creation (``posix_fallocate``), so a disk
that fills up later cannot fail a write: a full disk is refused when the files are created.

Ownership: several processes may share one ``disk_path``. Each file is named after its owner
(``kvpool-<pid>-g<group>-<random>.kv``) and holds an exclusive ``flock`` for as long as its
owner keeps it open; the kernel drops the lock when the process dies, SIGKILL included.
Files are created under an exclusive lock of ``disk_path/.kvpool.lock`` (removed again when
released); under the same lock every ``kvpool-*.kv`` whose lock can be taken, whose owner is
therefore gone, is removed first.

SIGTERM: the first disk file of a process installs (from the main thread, when SIGTERM still
has its default action or a Python handler) a handler that removes every disk file of the
process and then does what the previous handler did (by default: the process dies of SIGTERM).
The files stay readable and writable through their descriptors until closed, so a previous
handler that shuts down gracefully still works with them. A forked child inherits the pools
but never removes their files (only the creating process does, at close or on SIGTERM).

Persistent files (:func:`open_persistent_pools`, a disk tier that outlives its process) are
named after their layer group only (``kvpool-persistent-g<group>.kvp``), so the next process
on the same ``disk_path`` opens the same files: they are never removed (not at close, not on
SIGTERM, not by :func:`reclaim`, which only knows ``kvpool-*.kv``), but they carry the same
exclusive ``flock`` while open, so two live processes can never share one. A pool of a
persistent tier records the xxh3_64 of every block it writes (:attr:`DiskPool.checksums`).

File safety: ``disk_path`` must be a directory no other user can write (:func:`check_directory`:
not world-writable, not group-writable unless it is ours, owned by us or root), and every file
kvpool opens there is opened relative to the directory, never through a symbolic link
(``O_NOFOLLOW``; a file it creates new with ``O_EXCL``), and only if it is a regular file of
this user, mode 0600 (:func:`open_private`). Anything else is an
:class:`~kvpool.errors.UnsafePathError` naming the path: a link planted at a name kvpool uses
never makes it write elsewhere.

A failed write (the disk full, the file size limit, an I/O error) does not stop the batch:
every slot is tried, and the slots that failed are named in the :class:`DiskWriteError` raised
after the others are written, their checksums reset to 0 (their bytes are unknown).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import signal
import stat
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import xxhash

from kvpool.errors import StorageError, UnsafePathError

LOCK_NAME = ".kvpool.lock"
PREFIX = "kvpool-"
SUFFIX = ".kv"
PERSISTENT_PREFIX = "kvpool-persistent-g"
PERSISTENT_SUFFIX = ".kvp"
_READ_BATCH = 4 << 20  # bytes read at once when hashing slots (one buffer, reused)
_xxh3 = xxhash.xxh3_64_intdigest


class DiskWriteError(StorageError):
    """Some slots of one :meth:`DiskPool.write` were not written (``slots``); the others were."""

    def __init__(self, message: str, slots: list[int]) -> None:
        super().__init__(message)
        self.slots = slots


class DiskPool:
    """The disk-tier slots of one layer group: ``slots`` blocks of ``block_bytes`` in one file,
    slot i at offset ``i * block_bytes``."""

    __slots__ = ("_fd", "_removed", "block_bytes", "checksums", "owner", "path", "persistent",
                 "size", "slots")

    def __init__(self, fd: int, path: str, slots: int, block_bytes: int, *,
                 persistent: bool = False) -> None:
        self._fd = fd
        self.path = path
        self.slots = slots
        self.block_bytes = block_bytes
        self.size = slots * block_bytes
        self.owner = os.getpid()  # a forked child inherits the pool but never removes the file
        self._removed = False  # the path was removed on purpose (close, SIGTERM)
        self.persistent = persistent  # never removed: the next process reopens it
        # xxh3_64 of the bytes last written to each slot (persistent pools; 0 = none written)
        self.checksums: array[int] | None = array("Q", bytes(8 * slots)) if persistent else None

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def check(self) -> None:
        """Raise :class:`StorageError` if the file was closed, removed or truncated."""
        if self._fd < 0:
            raise StorageError(f"disk-tier file {self.path!r} is closed")
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            raise StorageError(f"disk-tier file {self.path!r} cannot be read: {exc}") from exc
        if st.st_nlink == 0 and not self._removed:
            raise StorageError(
                f"disk-tier file {self.path!r} was removed while in use; the disk tier is "
                "lost (close the storage and build a new one)"
            )
        if st.st_size < self.size:
            raise StorageError(
                f"disk-tier file {self.path!r} was truncated to {st.st_size} bytes while in use "
                f"(the tier needs {self.size}); close the storage and build a new one"
            )

    def read(self, slots: Sequence[int], buffers: Sequence[memoryview]) -> None:
        """Read slot ``slots[i]`` into ``buffers[i]`` (each ``block_bytes`` long)."""
        fd, size = self._fd, self.block_bytes
        try:
            for slot, buf in zip(slots, buffers, strict=True):
                got = os.preadv(fd, [buf], slot * size)
                if got != size:
                    raise StorageError(
                        f"disk-tier file {self.path!r} ends inside slot {slot} (read {got} of "
                        f"{size} bytes): it was truncated while in use"
                    )
        except OSError as exc:
            raise StorageError(f"cannot read the disk tier {self.path!r}: {exc}") from exc

    def write(self, slots: Sequence[int], buffers: Sequence[memoryview]) -> None:
        """Write ``buffers[i]`` (each ``block_bytes`` long) to slot ``slots[i]``. Every slot is
        tried; those that fail are named in the :class:`DiskWriteError` raised at the end, and
        a persistent pool's checksum of each is reset to 0 (its bytes are unknown)."""
        fd, size, sums = self._fd, self.block_bytes, self.checksums
        failed: list[int] = []
        first = ""
        for slot, buf in zip(slots, buffers, strict=True):
            try:
                done = os.pwrite(fd, buf, slot * size)
                why = f"wrote {done} of {size} bytes (file size limit or disk full)"
            except OSError as exc:
                done, why = -1, str(exc)
            if done == size:
                if sums is not None:
                    sums[slot] = _xxh3(buf)
                continue
            if sums is not None:
                sums[slot] = 0
            failed.append(slot)
            first = first or why
        if failed:
            raise DiskWriteError(
                f"cannot write {len(failed)} of {len(slots)} slots of the disk tier "
                f"{self.path!r} (slot {failed[0]}: {first})", failed)

    def hash_slots(self, slots: Sequence[int]) -> list[int]:
        """The xxh3_64 of the bytes each slot of ``slots`` holds now, read from the file."""
        size = self.block_bytes
        per_read = max(1, _READ_BATCH // max(size, 1))
        buffer = memoryview(bytearray(min(per_read, max(len(slots), 1)) * size))
        out: list[int] = []
        for start in range(0, len(slots), per_read):
            batch = slots[start:start + per_read]
            chunks = [buffer[i * size:(i + 1) * size] for i in range(len(batch))]
            self.read(batch, chunks)
            out += [_xxh3(chunk) for chunk in chunks]
        return out

    def sync(self) -> None:
        """fsync the file: what was written survives a machine crash."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise StorageError(f"cannot fsync the disk tier {self.path!r}: {exc}") from exc

    def remove(self) -> None:
        """Remove the file's name (idempotent; only in the process that created it); the open
        descriptor keeps the data usable."""
        if not self._removed and not self.persistent and os.getpid() == self.owner:
            self._removed = True
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def close(self) -> None:
        """Remove the file (unless persistent) and close it. Idempotent."""
        self.remove()
        _LIVE.pop(id(self), None)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def close_pools(pools: list[DiskPool]) -> None:
    """Close and remove every pool of the list, and empty it (a storage's finalizer)."""
    for pool in pools:
        pool.close()
    pools.clear()


def create_pools(
    path: str | os.PathLike[str] | None, layout: dict[int, tuple[int, int]]
) -> dict[int, DiskPool]:
    """One file per layer group of ``layout`` (group -> (slots, block bytes)), sized and
    locked, after removing the files of dead owners; all or none are left."""
    pools = _pools_in(path, layout, "create the disk tier", _create_file, check_free=True)
    for pool in pools.values():
        _LIVE[id(pool)] = pool
    _install_sigterm_cleanup()
    return pools


def _check_directory(path: str | os.PathLike[str] | None, total: int) -> str:
    if path is None:
        raise StorageError(f"the disk tier has {total} bytes of slots but disk_path is None")
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise StorageError(f"disk_path {directory!r} {what}")
    check_directory(directory)
    return directory


def check_directory(directory: str) -> None:
    """Raise :class:`UnsafePathError` if a user other than this process's (or root) could
    write in ``directory``: owned by another user, writable by every user, or writable by
    its group when it is not ours. Such a user could plant links or files at the names kvpool
    uses, or swap the files a later process trusts."""
    st = os.stat(directory)
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    others = bool(mode & stat.S_IWOTH) or (bool(mode & stat.S_IWGRP) and st.st_uid != me)
    if st.st_uid not in (me, 0) or others:
        raise UnsafePathError(
            f"disk_path {directory!r} can be written by other users (mode {mode:o}, owner uid "
            f"{st.st_uid}, this process uid {me}); kvpool keeps KV bytes and token ids there. "
            f"Use a directory only you can write (mkdir -m 700 DIR), or run "
            f"chmod go-w {directory!r} if you own it"
        )


def open_private(dir_fd: int, name: str, flags: int, path: str) -> int:
    """Open ``name`` in the directory ``dir_fd`` (``path`` names it in errors) for kvpool's
    own use: never through a symbolic link, only a regular file of this process's user, mode
    0600 (an older file's wider mode is narrowed). ``O_CREAT`` creates it 0600; add
    ``O_EXCL`` for a file that must be new. Raises :class:`UnsafePathError`; other
    :class:`OSError` pass through."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path!r} is a symbolic link; kvpool never follows a link in its disk "
                "directory (it could make kvpool write elsewhere): remove it"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path!r} is not a regular file; remove it")
        if st.st_uid != os.geteuid():
            raise UnsafePathError(
                f"{path!r} belongs to uid {st.st_uid}, not to this process's uid "
                f"{os.geteuid()}; kvpool only uses its own files there: remove it"
            )
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_persistent_pools(
    path: str | os.PathLike[str] | None, layout: dict[int, tuple[int, int]]
) -> dict[int, DiskPool]:
    """The persistent files of ``layout`` (group -> (slots, block bytes)) in ``path``: opened
    when they exist (their bytes kept, resized to the layout), created otherwise, each locked
    for as long as it is open; all or none are left open. A file another live process holds
    is a :class:`StorageError`."""
    return _pools_in(path, layout, "open the persistent disk tier", _open_persistent,
                     check_free=False)


def _pools_in(
    path: str | os.PathLike[str] | None, layout: dict[int, tuple[int, int]], what: str,
    open_one: Callable[[str, int, int, int, int], DiskPool], *, check_free: bool,
) -> dict[int, DiskPool]:
    """``open_one(directory, dir_fd, group, slots, block bytes)`` for each group of
    ``layout`` in the checked directory, under its lock, after removing the files of dead
    owners (and, with ``check_free``, after checking the disk holds them all); all or none
    are left open."""
    total = sum(slots * size for slots, size in layout.values())
    directory = _check_directory(path, total)
    pools: dict[int, DiskPool] = {}
    with _all_or_none(
        pools, f"cannot {what} ({total} bytes) under {directory!r}"
    ), _directory_lock(directory) as dir_fd:
        reclaim(directory, dir_fd)
        if check_free and (free := shutil.disk_usage(directory).free) < total:
            raise StorageError(
                f"disk_path {directory!r} has {free} bytes free; the disk tier needs {total}"
            )
        for group, (slots, size) in layout.items():
            pools[group] = open_one(directory, dir_fd, group, slots, size)
    return pools


@contextlib.contextmanager
def _all_or_none(pools: dict[int, DiskPool], what: str) -> Iterator[None]:
    """Closes the pools opened so far when the block fails; an OSError becomes a
    :class:`StorageError` that starts with ``what``."""
    try:
        yield
    except OSError as exc:
        close_pools(list(pools.values()))
        raise StorageError(f"{what}: {exc}") from exc
    except BaseException:
        close_pools(list(pools.values()))
        raise


def persistent_name(group: int) -> str:
    """The file name of layer group ``group``'s persistent disk-tier file."""
    return f"{PERSISTENT_PREFIX}{group}{PERSISTENT_SUFFIX}"


def _open_persistent(directory: str, dir_fd: int, group: int, slots: int,
                     size: int) -> DiskPool:
    name = persistent_name(group)
    path = os.path.join(directory, name)
    fd = open_private(dir_fd, name, os.O_RDWR | os.O_CREAT, path)
    pool = DiskPool(fd, path, slots, size, persistent=True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(
                f"the persistent disk-tier file {path!r} is in use by another live manager; "
                "two managers cannot share one persistent disk tier (give each its own "
                "disk_path)"
            ) from None
        have = os.fstat(fd).st_size
        if have > slots * size:
            os.ftruncate(fd, slots * size)  # fewer slots than last time: the rest is gone
        elif have < slots * size:
            free = shutil.disk_usage(directory).free
            if free < slots * size - have:
                raise StorageError(
                    f"disk_path {directory!r} has {free} bytes free; the persistent disk tier "
                    f"needs {slots * size - have} more"
                )
            _reserve(fd, slots * size)
    except BaseException:
        pool.close()
        raise
    return pool


def _reserve(fd: int, size: int) -> None:
    """Reserve the blocks now: a sparse file could hit a full disk on a later write."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # pragma: no cover - macOS: sparse, so a full disk fails a later write instead
        os.ftruncate(fd, size)


def _create_file(directory: str, dir_fd: int, group: int, slots: int, size: int) -> DiskPool:
    name = f"{PREFIX}{os.getpid()}-g{group}-{secrets.token_hex(4)}{SUFFIX}"
    path = os.path.join(directory, name)
    fd = open_private(dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, path)
    pool = DiskPool(fd, path, slots, size)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _reserve(fd, slots * size)
    except BaseException:
        pool.close()
        raise
    return pool


def reclaim(directory: str, dir_fd: int | None = None) -> list[str]:
    """Remove the disk-tier files in ``directory`` (open as ``dir_fd`` when given) whose owner
    is gone (their lock is free); returns their paths. Call with the directory lock held."""
    removed: list[str] = []
    with _dir_fd(directory, dir_fd) as dfd:
        for name in sorted(os.listdir(dfd)):
            if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                             dir_fd=dfd)
            except OSError:
                continue  # gone meanwhile, or not a file we can open: not ours to judge
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner holds it
            finally:
                os.close(fd)  # also drops the lock if we got it
            with contextlib.suppress(FileNotFoundError):
                os.remove(name, dir_fd=dfd)
                removed.append(os.path.join(directory, name))
    return removed


@contextlib.contextmanager
def _dir_fd(directory: str, dir_fd: int | None) -> Iterator[int]:
    """``dir_fd``, or ``directory`` opened for the block."""
    if dir_fd is not None:
        yield dir_fd
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _directory_lock(directory: str) -> Iterator[int]:
    """Hold ``directory/.kvpool.lock`` exclusively (never through a link: an
    :class:`UnsafePathError`); yields the directory's descriptor, through which the caller
    opens its files. The lock file is removed on release (a waiter that locked a removed file
    sees it and takes the new one)."""
    path = os.path.join(directory, LOCK_NAME)
    with _dir_fd(directory, None) as dfd:
        while True:
            fd = open_private(dfd, LOCK_NAME, os.O_RDWR | os.O_CREAT, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                mine = os.fstat(fd)
                current = os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if (mine.st_dev, mine.st_ino) == (current.st_dev, current.st_ino):
                break
            os.close(fd)
        try:
            yield dfd
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(LOCK_NAME, dir_fd=dfd)
            os.close(fd)


# -- SIGTERM: every open pool of this process, and the handler that removes their files

_LIVE: dict[int, DiskPool] = {}
_handler_lock = threading.Lock()
_previous: Any = None
_installed = False


def _install_sigterm_cleanup() -> None:
    global _previous, _installed
    with _handler_lock:
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is not signal.SIG_DFL and not callable(previous):
            return  # ignored, or a handler set outside Python (which we could not chain to)
        try:
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            return
        _previous, _installed = previous, True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    for pool in list(_LIVE.values()):
        pool.remove()
    previous = _previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action: die of it
    os.kill(os.getpid(), signum)
