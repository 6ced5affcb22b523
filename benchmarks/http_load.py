"""An HTTP load for the router benchmarks: concurrent keep-alive clients that POST pre-encoded
requests as fast as answers come back, watched so a stuck router fails the run, and the
``/proc`` readings (CPU time, resident memory) of the processes measured.

Kept lean so that on a 2-core machine the router, not the load, is what is measured: each
client holds one HTTP/1.1 connection (an asyncio protocol that writes a request with its headers
and reads the response by its ``Content-Length``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, cast

import msgspec

STALL_S = 10.0
"""A load fails when no answer came back for this long (the clients' own timeout), or when the
routers used no CPU for this long while clients waited."""


def cpu_s(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of a client: it sends a whole request and waits for
    the whole response, parsed from its status line and ``Content-Length`` (the router sends
    no chunked bodies; a response without a length is an error)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.head_end = -1
        self.need = -1
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = -1
            for line in self.buf[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and value.strip().isdigit():
                    length = int(value)
            if length < 0:
                self._fail(ConnectionError("response without Content-Length"))
                return
            self.head_end, self.need = end + 4, end + 4 + length
        if len(self.buf) >= self.need:
            head, body = self.buf[:self.head_end], self.buf[self.head_end:self.need]
            self.buf, self.need = self.buf[self.need:], -1
            if self.waiter is not None and not self.waiter.done():
                status = int(head[9:12]) if head[:9] == b"HTTP/1.1 " and head[9:12].isdigit() else 0
                self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    async def request(self, raw: bytes, timeout_s: float) -> tuple[int, bytes]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        self.transport.write(raw)
        timer = loop.call_later(timeout_s, self._fail, TimeoutError("no answer in time"))
        try:
            return await waiter
        finally:
            timer.cancel()


async def load(
    base: str, bodies: list[bytes], clients: int, worker_ids: set[str]
) -> tuple[list[float], int, float]:
    """``clients`` clients, each on its own keep-alive connection, send the ``bodies`` as
    ``POST /route`` requests (pre-encoded with their headers) as fast as answers come back.
    An answer counts only as a 200 whose JSON names one of ``worker_ids``; a timeout, a
    connection error or anything else is an error (the client then opens a new connection)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /route HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: ")
    requests = [f"{head}{len(b)}\r\n\r\n".encode() + b for b in bodies]
    latencies: list[float] = []
    errors = 0
    next_request = iter(range(len(requests)))
    loop = asyncio.get_running_loop()
    decode = msgspec.json.Decoder(Answer).decode

    async def connect() -> Connection:
        _, conn = await asyncio.wait_for(loop.create_connection(Connection, host, int(port)),
                                         STALL_S)
        return conn

    async def client() -> None:
        nonlocal errors
        conn = await connect()
        for i in next_request:
            t0 = time.perf_counter()
            try:
                status, answer = await conn.request(requests[i], 10.0)
                ok = status == 200 and decode(answer).worker_id in worker_ids
            except (OSError, msgspec.DecodeError):
                ok = False
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors += 1
                assert conn.transport is not None
                conn.transport.abort()
                conn = await connect()
        assert conn.transport is not None
        conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, errors, time.perf_counter() - t0


class Answer(msgspec.Struct):
    worker_id: str


async def watched(load: Any, procs: list[Any], label: str) -> Any:
    """``load`` (the clients' gather); fails with the routers' CPU seconds when none of them
    used CPU for :data:`STALL_S` while it ran (a router stuck, not a slow machine), and when a
    router exited meanwhile."""
    task = asyncio.ensure_future(load)
    cpu = [cpu_s(p.pid) for p in procs]
    idle_since = time.monotonic()
    while not task.done():
        await asyncio.wait([task], timeout=1.0)
        if task.done():
            break
        dead = [p.pid for p in procs if p.returncode is not None]
        now = [cpu_s(p.pid) for p in procs if p.returncode is None]
        if dead:
            task.cancel()
            raise SystemExit(f"{label}: router process(es) {dead} exited during the load")
        if now != cpu:
            cpu, idle_since = now, time.monotonic()
        elif time.monotonic() - idle_since > STALL_S:
            task.cancel()
            raise SystemExit(f"{label}: stalled, the routers used no CPU for {STALL_S:.0f} s "
                             "while clients waited")
    return task.result()


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
