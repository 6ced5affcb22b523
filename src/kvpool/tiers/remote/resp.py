"""Reading an ``MGET`` reply straight off the socket, each value into its own buffer.

redis-py's pure-Python reply parser reads a large value in 64 KiB ``recv`` calls appended to a
``BytesIO``, then copies it out: on loopback it delivered 2 MiB values at a fraction of what
the socket gives. An ``MGET`` reply is simple (``*<n>\\r\\n`` then, per key,
``$<len>\\r\\n<bytes>\\r\\n`` or a null: ``$-1\\r\\n`` in RESP2, ``_\\r\\n`` in RESP3, which
redis-py 8 speaks by default), so :func:`read_mget_reply` parses it here: each
value's bytes go from the kernel into a ``bytearray`` of exactly its size with ``recv_into``
(as many bytes per call as the socket has), and only headers pass through a small line buffer.

The connection (connect, AUTH, SELECT, timeouts, TLS) stays redis-py's; the caller sends the
command with redis-py and hands over the connection's socket. Errors are redis-py's own types:
an error reply raises ``ResponseError``, a closed socket or a malformed reply
``ConnectionError`` (after which the connection must be dropped: its stream position is lost).
"""

from __future__ import annotations

import socket
from typing import Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = ["read_mget_reply"]

_CHUNK: Final = 1 << 18


class _Reader:
    """A reply's bytes: headers through one fixed line buffer (filled with ``recv_into``, so
    no chunk is allocated or copied on the way in), values each into a buffer of its own."""

    __slots__ = ("buf", "end", "pos", "sock", "view")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_CHUNK)
        self.view = memoryview(self.buf)
        self.pos = 0  # unread bytes are buf[pos:end]
        self.end = 0

    def _fill(self) -> None:
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):  # no room behind: the unread bytes move to the front
            if self.pos == 0:
                raise RedisConnectionError("malformed reply: a header fills the line buffer")
            n = self.end - self.pos
            self.view[:n] = self.view[self.pos:self.end]
            self.pos, self.end = 0, n
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise RedisConnectionError("the server closed the connection in a reply")
        self.end += got

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos, self.end)) < 0:
            self._fill()
        line = bytes(self.view[self.pos:end])
        self.pos = end + 2
        return line

    def exactly(self, n: int) -> bytearray:
        """The next ``n`` bytes, in a new buffer of their own."""
        out = bytearray(n)
        have = min(self.end - self.pos, n)
        out[:have] = self.view[self.pos:self.pos + have]
        self.pos += have
        if have < n:
            view = memoryview(out)
            recv_into = self.sock.recv_into
            while have < n:
                got = recv_into(view[have:])
                if not got:
                    raise RedisConnectionError("the server closed the connection in a value")
                have += got
            view.release()
        return out

    def crlf(self) -> None:
        while self.end - self.pos < 2:
            self._fill()
        if self.buf[self.pos:self.pos + 2] != b"\r\n":
            raise RedisConnectionError("malformed reply: a value is not followed by CRLF")
        self.pos += 2

    def unread(self) -> int:
        return self.end - self.pos

    def close(self) -> None:
        self.view.release()


def _int(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise RedisConnectionError(f"malformed reply header {line[:40]!r}") from None


def read_mget_reply(sock: socket.socket, count: int) -> list[bytearray | None]:
    """The values of the ``MGET`` of ``count`` keys whose reply comes next on ``sock``."""
    reader = _Reader(sock)
    try:
        return _values(reader, count)
    finally:
        reader.close()


def _values(reader: _Reader, count: int) -> list[bytearray | None]:
    head = reader.line()
    if head[:1] == b"-":
        raise ResponseError(head[1:].decode(errors="replace"))
    if head[:1] != b"*" or _int(head) != count:
        raise RedisConnectionError(f"unexpected reply to MGET of {count} keys: {head[:40]!r}")
    values: list[bytearray | None] = []
    for _ in range(count):
        header = reader.line()
        if header == b"_":  # RESP3's null
            values.append(None)
            continue
        if header[:1] != b"$":
            raise RedisConnectionError(f"unexpected value header {header[:40]!r}")
        n = _int(header)
        if n < 0:
            values.append(None)
            continue
        values.append(reader.exactly(n))
        reader.crlf()
    if reader.unread():
        raise RedisConnectionError("bytes after the MGET reply")
    return values
