"""The value stored under a remote key: a 48-byte header, then the block's raw bytes.

A shared store can lose, truncate or overwrite any value at any time (its own eviction,
another engine, an operator), so every read is verified and anything doubtful is a miss:

=======  =====  ==============================================================
offset   size   field (little-endian)
=======  =====  ==============================================================
0        4      magic ``b"KVPB"``
4        2      format version (1)
6        2      header size (48)
8        16     namespace digest (:attr:`ScopeNamespace.digest`)
24       8      xxh3_64 of the remote key the value was written under
32       8      payload length in bytes
40       8      xxh3_64 of the payload
48       n      payload: the block's bytes of one layer group
=======  =====  ==============================================================

:meth:`ValueCodec.decode` returns the payload (a zero-copy view) or None, never bytes that
fail a check, and counts why it refused in :attr:`ValueCodec.rejected`: ``missing`` (no
value), ``short`` (shorter than its header or its length), ``magic``, ``version``,
``namespace`` (another namespace's value), ``key`` (a value copied under another key),
``length`` (bytes after the payload), ``checksum``.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Final

import xxhash

from kvpool.errors import InvalidArgumentError

__all__ = ["HEADER", "MAGIC", "REJECT_REASONS", "VERSION", "ValueCodec"]

MAGIC: Final = b"KVPB"
VERSION: Final = 1
HEADER: Final = struct.Struct("<4sHH16sQQQ")
REJECT_REASONS: Final = (
    "missing", "short", "magic", "version", "namespace", "key", "length", "checksum",
)
_NS_SIZE: Final = 16

_xxh3 = xxhash.xxh3_64_intdigest


class ValueCodec:
    """Encodes payloads into remote values and verifies them on the way back."""

    __slots__ = ("rejected",)

    def __init__(self) -> None:
        self.rejected: Counter[str] = Counter()
        """Values refused by :meth:`decode`, by reason (module docstring)."""

    @staticmethod
    def encode(namespace: bytes, remote_key: bytes, payload: bytes | memoryview) -> bytes:
        """The value to store under ``remote_key`` for ``payload`` (one copy of the payload)."""
        if len(namespace) != _NS_SIZE:
            raise InvalidArgumentError(f"a namespace digest is 16 bytes, got {namespace!r}")
        view = memoryview(payload).cast("B")
        header = HEADER.pack(MAGIC, VERSION, HEADER.size, namespace, _xxh3(remote_key),
                             view.nbytes, _xxh3(view))
        return header + view

    def decode(
        self, value: bytes | bytearray | None, namespace: bytes, remote_key: bytes
    ) -> memoryview | None:
        """The payload of ``value`` read under ``remote_key`` in ``namespace``, or None (the
        reason counted) when the value is missing or fails any check."""
        reason = self._check(value, namespace, remote_key)
        if reason is None:
            assert value is not None
            return memoryview(value)[HEADER.size:]
        self.rejected[reason] += 1
        return None

    @staticmethod
    def _check(
        value: bytes | bytearray | None, namespace: bytes, remote_key: bytes
    ) -> str | None:
        if value is None:
            return "missing"
        if len(value) < HEADER.size:
            return "short"
        magic, version, header_size, ns, key_hash, length, checksum = HEADER.unpack_from(value)
        if magic != MAGIC:
            return "magic"
        if version != VERSION or header_size != HEADER.size:
            return "version"
        if ns != namespace:
            return "namespace"
        if key_hash != _xxh3(remote_key):
            return "key"
        stored = len(value) - HEADER.size
        if stored < length:
            return "short"
        if stored > length:
            return "length"
        if _xxh3(memoryview(value)[HEADER.size:]) != checksum:
            return "checksum"
        return None
