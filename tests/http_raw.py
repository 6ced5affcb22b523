"""Raw HTTP/1.1 over loopback sockets for the request-boundary tests: requests written byte
by byte as a client may send them (malformed ones included), responses parsed back, and an
event loop in a thread to run a service beside synchronous test code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

LOCAL = "127.0.0.1"
_T = TypeVar("_T")


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


def request_bytes(method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]]
                  | None = None, *, close: bool = True) -> bytes:
    head = [f"{method} {path} HTTP/1.1".encode("utf-8", "surrogateescape"), b"Host: x",
            b"Content-Length: %d" % len(body)]
    head += [name + b": " + value for name, value in headers or []]
    if close:
        head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def exchange(port: int, data: bytes, *, timeout: float = 30.0, idle: float | None = None,
             head: bool = False) -> list[Reply]:
    """Send ``data`` on a new connection and read until the server closes it (or, with
    ``idle``, until nothing came for that long); the responses read, 1xx left out."""
    received = bytearray()
    with socket.create_connection((LOCAL, port), timeout=timeout) as sock:
        # the server may answer and close before reading everything
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        if idle is not None:
            sock.settimeout(idle)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            if idle is None and not received:
                raise
    return parse_replies(bytes(received), head=head)


def parse_replies(data: bytes, *, head: bool = False) -> list[Reply]:
    replies: list[Reply] = []
    while data:
        top, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {data[:300]!r}"
        lines = top.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            data = rest
            continue
        if head and len(rest) != int(headers.get("content-length", -1)):
            body, data = b"", rest  # (a HEAD refused as malformed HTTP gets its body)
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body, data = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, data = _dechunk(rest)
        else:
            body, data = rest, b""
        replies.append(Reply(status, headers, body))
    return replies


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    out = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out), data.partition(b"\r\n")[2]
        out += data[:size]
        data = data[size + 2:]


class LoopThread:
    """An event loop running in a daemon thread; :meth:`call` runs a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, make: Callable[[], Awaitable[_T]], timeout: float = 60) -> _T:
        async def run() -> _T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
