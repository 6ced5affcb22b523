"""The manifest of a persistent disk tier: which block each disk slot holds, kept crash-safely
beside the disk files so that a manager started again on the same ``disk_path`` can re-index
them (warm restart).

The manifest is an append-only log: a header naming the namespace the bytes belong to
(:class:`~.remote.namespace.RemoteNamespace`: model, geometry, block size, hash algorithm),
then records, each with its own checksum. A ``put`` record says that slot ``slot`` of layer
group ``group`` holds the block with full chained key ``key``, its ``tokens``, its ``parent``
key (or, for the first block of a chain, its reuse scope) and the xxh3_64 of its bytes; a
``drop`` record empties a slot. A ``path`` record names a block without bytes (key, tokens,
parent or scope): an ancestor of recorded blocks that was not on disk, so that a warm restart
can rebuild the chain its recorded descendants hang from (:attr:`Manifest.paths`, by key; a
path is never dropped, only left out when the log is compacted). Replaying the records in
order gives the state. When the log
has grown well past its live entries, :meth:`Manifest.compact` writes the state as a fresh
log to a temporary file, fsyncs it and renames it over the old one (then fsyncs the directory),
so a crash at any moment leaves either the old or the new manifest, whole.

Layout (little-endian)::

    header:  b"KVPM" | version u16 | description length u32 | description | xxh3_64 of the above
    record:  body length u32 | kind u8 | body | xxh3_64 of length, kind and body
    put:     group u16 | slot u32 | data checksum u64 | flags u8 | token count u16 | key
             | parent key (flag 1) | LoRA id u64 (flag 2) | salt length u16, salt (flag 4)
             | tokens u32...
    drop:    group u16 | slot u32
    path:    as put, with group, slot and data checksum 0

Reading validates everything: a header of another namespace or a damaged header raises
:class:`ManifestError` (or, with ``on_damage="discard"``, starts an empty manifest). Records
are read up to the first one that fails its check (a torn tail after a crash, or damage): by
default that raises :class:`ManifestError`; with ``"keep_prefix"`` the records before it are
kept and the rest is cut off; with ``"discard"`` nothing is kept. A record that fails its
check is never applied, so a damaged manifest never yields an entry that was not written. What
the manifest cannot know is whether a slot's bytes were rewritten after its last record (a
crash between the write and its record): the data checksum in each entry lets the manager
verify a block's bytes before it trusts them.

Durability: :meth:`Manifest.append_put` and :meth:`Manifest.append_drop` write the record
(``write(2)``: it survives the process, SIGKILL included); :meth:`Manifest.sync` fsyncs it
(survives the machine). :mod:`kvpool.core.persist` keeps a manager's disk tier and its manifest
in step and re-indexes the blocks at a warm restart.

Failures: a record that cannot be written (the disk full, past the file size limit, an I/O
error) is a :class:`StorageError` that leaves the log as it was (the partial record is cut
off) and the state unchanged; if even the cut fails, the log is ``torn`` and takes no more
records until a compaction rewrites it whole. A compaction that fails leaves the old log,
open and whole.

Files: the manifest and its temporary snapshot are opened relative to their directory, never
through a symbolic link, only as regular files of this user, mode 0600
(:func:`kvpool.tiers.diskfile.open_private`; the snapshot is created with ``O_EXCL``); a link or
another kind of file at either name is an :class:`~kvpool.errors.UnsafePathError`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import xxhash

from kvpool.errors import InvalidArgumentError, ManifestError, StorageError, UnsafePathError
from kvpool.hashing.keys import MAX_TOKEN_ID, BlockKey, HashAlgo
from kvpool.tiers.diskfile import open_private
from kvpool.tiers.remote.namespace import RemoteNamespace, key_bytes
from kvpool.validation import is_int

__all__ = ["Manifest", "ManifestEntry", "OnDamage"]

MAGIC: Final = b"KVPM"
VERSION: Final = 1
_HEAD: Final = struct.Struct("<4sHI")
_REC: Final = struct.Struct("<IB")
_SUM: Final = struct.Struct("<Q")
_PUT: Final = struct.Struct("<HIQBH")
_DROP: Final = struct.Struct("<HI")
_PUT_KIND, _DROP_KIND, _PATH_KIND = 1, 2, 3
_HAS_PARENT, _HAS_LORA, _HAS_SALT = 1, 2, 4
_MAX_RECORD: Final = 1 << 24
_COMPACT_MIN_BYTES: Final = 1 << 20
OnDamage = Literal["raise", "keep_prefix", "discard"]

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One disk slot's block: where it is, what it is, and the xxh3_64 of its bytes.

    ``parent`` is the previous block's key, or None for the first block of a chain, whose reuse
    scope is then ``lora_id`` / ``cache_salt`` (a later block inherits its chain's scope).
    """

    group: int
    slot: int
    key: BlockKey
    tokens: tuple[int, ...]
    parent: BlockKey | None
    data_checksum: int
    lora_id: int | None = None
    cache_salt: str | None = None


def _u(name: str, value: object, bits: int) -> int:
    if not is_int(value) or not 0 <= value < 1 << bits:
        raise InvalidArgumentError(f"{name} must be an int in [0, 2**{bits}), got {value!r}")
    return value


def _encode_put(algo: HashAlgo, e: ManifestEntry) -> bytes:
    flags = 0
    tail = [key_bytes(algo, e.key)]
    if e.parent is not None:
        if e.lora_id is not None or e.cache_salt is not None:
            raise InvalidArgumentError("only the first block of a chain (parent None) has a scope")
        flags |= _HAS_PARENT
        tail.append(key_bytes(algo, e.parent))
    if e.lora_id is not None:
        flags |= _HAS_LORA
        tail.append(_u("lora_id", e.lora_id, 64).to_bytes(8, "little"))
    if e.cache_salt is not None:
        if not isinstance(e.cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str, got {e.cache_salt!r}")
        salt = e.cache_salt.encode()
        flags |= _HAS_SALT
        tail.append(_u("cache_salt length", len(salt), 16).to_bytes(2, "little") + salt)
    tokens = e.tokens
    try:  # struct checks each is an int in [0, 2**32); the bound is checked at C speed too
        tail.append(struct.pack(f"<{len(tokens)}I", *tokens))
        if tokens and max(tokens) > MAX_TOKEN_ID:
            raise struct.error("a token id is not below 2**31")
    except (struct.error, TypeError) as exc:
        raise InvalidArgumentError(
            f"tokens must be ints in [0, 2**31), got {tokens!r:.80}: {exc}") from None
    head = _PUT.pack(_u("group", e.group, 16), _u("slot", e.slot, 32),
                     _u("data_checksum", e.data_checksum, 64), flags,
                     _u("token count", len(tokens), 16))
    return head + b"".join(tail)


def _as_path(e: ManifestEntry) -> ManifestEntry:
    """A path entry: ``e`` with group, slot and data checksum 0."""
    return ManifestEntry(0, 0, e.key, e.tokens, e.parent, 0, e.lora_id, e.cache_salt)


def _decode_key(algo: HashAlgo, raw: bytes) -> BlockKey:
    return int.from_bytes(raw, "big") if algo is HashAlgo.V1_BLOCK_KEY else raw


def _decode_put(algo: HashAlgo, body: bytes) -> ManifestEntry:
    """The entry of a put record's body (its checksum already verified); ValueError if its
    fields do not add up."""
    group, slot, checksum, flags, ntok = _PUT.unpack_from(body)
    ksize = 8 if algo is HashAlgo.V1_BLOCK_KEY else 32
    off = _PUT.size
    key = _decode_key(algo, body[off:off + ksize])
    off += ksize
    parent: BlockKey | None = None
    lora: int | None = None
    salt: str | None = None
    if flags & _HAS_PARENT:
        parent = _decode_key(algo, body[off:off + ksize])
        off += ksize
    if flags & _HAS_LORA:
        lora = int.from_bytes(body[off:off + 8], "little")
        off += 8
    if flags & _HAS_SALT:
        n = int.from_bytes(body[off:off + 2], "little")
        salt = body[off + 2:off + 2 + n].decode()
        off += 2 + n
    if len(body) != off + 4 * ntok or flags & ~7:
        raise ValueError("put record fields do not add up")
    tokens = struct.unpack_from(f"<{ntok}I", body, off)
    return ManifestEntry(group, slot, key, tokens, parent, checksum, lora, salt)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _record(kind: int, body: bytes) -> bytes:
    head = _REC.pack(len(body), kind) + body
    return head + _SUM.pack(_xxh3(head))


def _header(namespace: RemoteNamespace) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, len(namespace.description)) + namespace.description
    return head + _SUM.pack(_xxh3(head))


def _read_header(data: bytes) -> tuple[bytes, int]:
    """(namespace description, header size); ValueError when damaged."""
    magic, version, n = _HEAD.unpack_from(data)
    end = _HEAD.size + n
    if magic != MAGIC or version != VERSION or len(data) < end + _SUM.size:
        raise ValueError("bad magic, version or length")
    if _SUM.unpack_from(data, end)[0] != _xxh3(data[:end]):
        raise ValueError("header checksum mismatch")
    return data[_HEAD.size:end], end + _SUM.size


def _records(data: bytes, start: int) -> Iterator[tuple[int, int, bytes]]:
    """(kind, end offset, body) of each intact record from ``start``; stops at the first that
    is short or fails its checksum."""
    off = start
    while off + _REC.size + _SUM.size <= len(data):
        n, kind = _REC.unpack_from(data, off)
        end = off + _REC.size + n
        if n > _MAX_RECORD or end + _SUM.size > len(data):
            return
        if _SUM.unpack_from(data, end)[0] != _xxh3(data[off:end]):
            return
        yield kind, end + _SUM.size, data[off + _REC.size:end]
        off = end + _SUM.size


class Manifest:
    """An open manifest: the current state, and an append handle on its log (module doc).

    ``entries`` maps (group, slot) to the :class:`ManifestEntry` the slot holds; ``paths``
    maps a key to the entry (group, slot, checksum 0) of a block recorded without bytes.
    ``ignored_bytes`` is how much of the file was cut off as damaged when it was opened.
    """

    def __init__(self, path: str | os.PathLike[str], namespace: RemoteNamespace, *,
                 on_damage: OnDamage = "raise") -> None:
        if on_damage not in ("raise", "keep_prefix", "discard"):
            raise InvalidArgumentError(
                f"on_damage must be 'raise', 'keep_prefix' or 'discard', got {on_damage!r}"
            )
        self.path = Path(path)
        self.namespace = namespace
        self.entries: dict[tuple[int, int], ManifestEntry] = {}
        self.paths: dict[BlockKey, ManifestEntry] = {}
        self.ignored_bytes = 0
        self.torn: str | None = None  # why the log takes no records until compacted
        self._log_records = 0
        self._fd = -1
        self._dir = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            data = self._read()
            valid = self._load(data, on_damage) if data is not None else 0
            if valid == 0:
                self.entries.clear()
                self.paths.clear()
                self._log_records = 0
                self._fd = self._rewrite()
            else:
                self._fd = self._open(os.O_WRONLY | os.O_APPEND)
                os.ftruncate(self._fd, valid)  # cut a damaged tail off before appending
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError):
                raise StorageError(f"cannot open manifest {self.path}: {exc}") from exc
            raise

    def _open(self, flags: int, name: str | None = None) -> int:
        """A file of the manifest's directory (the manifest itself by default), opened safely
        (:func:`kvpool.tiers.diskfile.open_private`)."""
        name = self.path.name if name is None else name
        return open_private(self._dir, name, flags, str(self.path.with_name(name)))

    def _read(self) -> bytes | None:
        """The manifest's bytes; None when there is none."""
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def _load(self, data: bytes, on_damage: OnDamage) -> int:
        """Apply ``data``'s intact records; the bytes to keep (0: start afresh)."""
        try:
            description, start = _read_header(data)
        except (ValueError, struct.error):
            if on_damage == "discard":
                self.ignored_bytes = len(data)
                return 0
            raise ManifestError(
                f"manifest {self.path} has a damaged header; remove it or open it with "
                "on_damage='discard' to start with an empty disk tier"
            ) from None
        if description != self.namespace.description:
            if on_damage == "discard":
                self.ignored_bytes = len(data)
                return 0
            raise ManifestError(
                f"manifest {self.path} was written for another namespace "
                f"({description.decode(errors='replace')!r:.200}), not "
                f"{self.namespace.description.decode()!r:.200}; its blocks cannot be reused "
                "(open it with on_damage='discard' to start afresh)"
            )
        end = start
        for kind, rec_end, body in _records(data, start):
            try:
                self._apply(kind, body)
            except (ValueError, struct.error, UnicodeDecodeError):
                break  # intact checksum, impossible fields: a record of another writer
            end = rec_end
        if end < len(data):
            if on_damage == "raise":
                raise ManifestError(
                    f"manifest {self.path} is damaged after byte {end} of {len(data)}; open it "
                    "with on_damage='keep_prefix' to keep the blocks recorded before that, or "
                    "'discard' to start afresh"
                )
            self.ignored_bytes = len(data) - end
            if on_damage == "discard":
                return 0
        return end

    def _apply(self, kind: int, body: bytes) -> None:
        if kind == _PUT_KIND:
            e = _decode_put(self.namespace.algo, body)
            self.entries[e.group, e.slot] = e
        elif kind == _DROP_KIND and len(body) == _DROP.size:
            self.entries.pop(_DROP.unpack(body), None)
        elif kind == _PATH_KIND:
            e = _decode_put(self.namespace.algo, body)
            if (e.group, e.slot, e.data_checksum) != (0, 0, 0):
                raise ValueError("a path record names a slot")
            self.paths[e.key] = e
        else:
            raise ValueError(f"unknown record kind {kind}")
        self._log_records += 1

    def append_put(self, entry: ManifestEntry) -> None:
        """Record that ``entry.slot`` of ``entry.group`` now holds ``entry`` (validated first:
        a bad entry raises :class:`InvalidArgumentError` and writes nothing)."""
        self._append(_record(_PUT_KIND, _encode_put(self.namespace.algo, entry)))
        self.entries[entry.group, entry.slot] = entry
        self._log_records += 1

    def append_drop(self, group: int, slot: int) -> None:
        """Record that a slot no longer holds a block."""
        self._append(_record(_DROP_KIND, _DROP.pack(_u("group", group, 16), _u("slot", slot, 32))))
        self.entries.pop((group, slot), None)
        self._log_records += 1

    def append_many(self, drops: Iterable[tuple[int, int]] = (),
                    puts: Iterable[ManifestEntry] = (),
                    paths: Iterable[ManifestEntry] = ()) -> None:
        """Record ``drops`` ((group, slot) pairs), ``paths`` (entries whose group, slot and
        checksum are ignored), then ``puts``, in one ``write``: all are validated first (a bad
        one raises :class:`InvalidArgumentError`, nothing written)."""
        drops, puts = list(drops), list(puts)
        paths = [_as_path(e) for e in paths]
        algo = self.namespace.algo
        records = [_record(_DROP_KIND, _DROP.pack(_u("group", g, 16), _u("slot", s, 32)))
                   for g, s in drops]
        records += [_record(_PATH_KIND, _encode_put(algo, e)) for e in paths]
        records += [_record(_PUT_KIND, _encode_put(algo, e)) for e in puts]
        if not records:
            return
        self._append(b"".join(records))
        for key in drops:
            self.entries.pop(key, None)
        for e in paths:
            self.paths[e.key] = e
        for e in puts:
            self.entries[e.group, e.slot] = e
        self._log_records += len(records)

    def clear(self) -> None:
        """Forget every entry and path: the log becomes an empty snapshot (temp file, fsync,
        rename)."""
        self.entries.clear()
        self.paths.clear()
        self.compact()

    def _append(self, record: bytes) -> None:
        """Write one record whole, or leave the log as it was and raise StorageError."""
        if self.torn is not None:
            raise StorageError(f"manifest {self.path} is torn ({self.torn}); it takes no record "
                               "until a compaction rewrites it")
        try:
            size = os.fstat(self._fd).st_size
            _write_all(self._fd, record)
        except OSError as e:
            try:
                os.ftruncate(self._fd, size)  # a torn record would hide every later one
            except OSError as cut:
                self.torn = f"a partial record could not be cut off: {cut}"
            raise StorageError(f"cannot append to manifest {self.path}: {e}") from e

    def sync(self) -> None:
        """fsync the log: what was appended survives a machine crash."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise StorageError(f"cannot fsync manifest {self.path}: {e}") from e

    def compact(self) -> None:
        """Replace the log by a snapshot of the live entries (temp file, fsync, rename). On a
        failure (:class:`StorageError`) the old log stays, open and whole."""
        fd = self._rewrite()
        old, self._fd = self._fd, fd
        if old >= 0:
            os.close(old)
        self.torn = None

    def maybe_compact(self) -> bool:
        """Compact when :meth:`needs_compaction`; whether it did."""
        if not self.needs_compaction():
            return False
        self.compact()
        return True

    def needs_compaction(self) -> bool:
        """Whether the log holds more than twice as many records as live entries and paths
        (and is at least 1 MiB)."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return False
        live = len(self.entries) + len(self.paths)
        return self.torn is not None or (
            size >= _COMPACT_MIN_BYTES and self._log_records > 2 * live)

    def _rewrite(self) -> int:
        """Write the state as a fresh log beside the manifest, fsync it and rename it over the
        manifest; returns its append descriptor. A failure removes the temporary file and
        raises :class:`StorageError` (the manifest untouched)."""
        tmp = self.path.name + ".tmp"
        tmp_path = str(self.path.with_name(tmp))
        algo = self.namespace.algo
        records = [_record(_PATH_KIND, _encode_put(algo, e)) for e in self.paths.values()]
        records += [_record(_PUT_KIND, _encode_put(algo, e)) for e in self.entries.values()]
        try:
            left = os.stat(tmp, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:  # a snapshot a crash left behind is removed; anything else is not ours
            if not stat.S_ISREG(left.st_mode) or left.st_uid != os.geteuid():
                raise UnsafePathError(
                    f"{tmp_path!r} is not a file kvpool left behind (a symbolic link, another "
                    "kind of file or another user's); kvpool will not write there: remove it")
            os.unlink(tmp, dir_fd=self._dir)
        try:
            fd = self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, tmp)
        except OSError as e:
            raise StorageError(f"cannot create {tmp_path!r}: {e}") from e
        try:
            _write_all(fd, _header(self.namespace) + b"".join(records))
            os.fsync(fd)
            os.replace(tmp, self.path.name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir)
            raise StorageError(f"cannot rewrite manifest {self.path}: {e}") from e
        with contextlib.suppress(OSError):  # the rename is made durable as far as it can be
            os.fsync(self._dir)
        self._log_records = len(records)
        return fd

    def close(self) -> None:
        """fsync and close the log (a failed fsync only loses durability: the records the
        machine loses are misses, see :mod:`kvpool.core.persist`). Idempotent."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        if self._dir >= 0:
            fd, self._dir = self._dir, -1
            os.close(fd)

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
