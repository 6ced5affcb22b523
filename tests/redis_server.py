"""A real redis-server (or valkey-server) for tests: a free 127.0.0.1 port, a temporary
directory, no persistence. Tests skip when no server binary exists, unless ``CI`` is set: there
a missing server is a failure (``.ci/run`` installs one)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARIES = ("redis-server", "valkey-server")


def server_binary() -> str:
    """The server binary's path; skips (or fails, in CI) the calling test when there is none."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    message = (
        "no redis-server or valkey-server on PATH (Debian: apt-get install redis-server); "
        "remote-tier tests need a real server"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port; with ``cluster_bus`` also port + 10000 (a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus or (port + 10000 < 65536 and _bindable(port + 10000)):
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


class RedisServer:
    """One server process; :meth:`kill` and :meth:`start` again keep the port."""

    def __init__(self, directory: Path, *, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.binary = server_binary()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster_bus="--cluster-enabled" in extra)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} on port {self.port} did not answer PING in 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies without a word to its clients."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
