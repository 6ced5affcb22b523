"""Every command stops on real signals as documented (``kvpool --help``, exit status): within its
time, with its exit status, without a traceback and without leaving a process behind.

Each command runs as a user runs it: a subprocess in its own session (its own process group,
which a terminal's Ctrl-C signals as a whole), signalled with ``os.killpg`` (Ctrl-C) or
``os.kill`` (``kill``, ``timeout``, a supervisor). Processes are found through ``/proc`` via
psutil: the command's children while it runs, and whatever is left in its process group
afterwards.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvpool.commands import _signals

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="signals, process groups and /proc: Linux")

SRC = str(Path(__file__).resolve().parents[2] / "src")
STOP_S = 2.0  # replay and router: from the signal to the process's exit


class Command:
    """A ``kvpool`` subprocess in a new session, its output read by threads."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )
        self.pgid = self.proc.pid
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=_read, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def wait_for(self, lines: list[str], prefix: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                if line.startswith(prefix):
                    return line
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.stderr}"
            time.sleep(0.02)
        raise AssertionError(f"no line {prefix!r} in {timeout} s: {lines} {self.stderr}")

    def workers(self, n: int, timeout: float = 180) -> list[psutil.Process]:
        """Once the command has ``n`` spawned worker processes: its children."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.stderr}"
            kids = _children(self.proc.pid)
            if sum("spawn_main" in " ".join(_cmdline(k)) for k in kids) >= n:
                return kids
            time.sleep(0.05)
        raise AssertionError(f"no {n} workers in {timeout} s: {self.stderr}")

    def signal(self, sig: int, *, group: bool) -> float:
        """Send ``sig`` to the process group (a terminal's Ctrl-C) or the command only;
        returns when (monotonic)."""
        (os.killpg if group else os.kill)(self.pgid, sig)
        return time.monotonic()

    def exit_after(self, since: float, timeout: float = 60) -> tuple[int, float]:
        code = self.proc.wait(timeout)
        took = time.monotonic() - since
        for t in self._readers:
            t.join(5)
        return code, took

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with_group = [p for p in _group(self.pgid) if p.pid != self.proc.pid]
        for p in with_group:
            p.kill()


def _read(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and _alive(p):
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def assert_nothing_left(cmd: Command, seen: list[psutil.Process], within: float = 3.0) -> None:
    """No process of the command's group and none of the children seen while it ran is
    alive within ``within`` seconds (the workers die with the parent, multiprocessing's
    resource tracker once every pipe to it is closed)."""
    deadline = time.monotonic() + within
    while True:
        left = [p for p in seen if _alive(p)] + _group(cmd.pgid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, [(p.pid, _cmdline(p)) for p in left]


def assert_clean(cmd: Command) -> None:
    text = cmd.stderr
    assert "Traceback" not in text, text
    assert "CancelledError" not in text and "KeyboardInterrupt" not in text, text
    assert "leaked" not in text, text  # multiprocessing's resource tracker: leaked semaphores


def semaphores(procs: list[psutil.Process]) -> list[str]:
    """POSIX semaphores (``/dev/shm/sem.*``) mapped by any of ``procs``."""
    found = []
    for p in procs:
        try:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            continue
        found += [line for line in maps.splitlines() if "/dev/shm/sem." in line]
    return found


# ------------------------------------------------------------------------ the mechanism


def test_first_signal_interrupts_and_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in _signals.STOP_SIGNALS}
    with pytest.raises(_signals.Interrupted) as info, _signals.on_stop_signals("kvpool t"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert info.value.signum == signal.SIGTERM and info.value.exit_code == 143
    assert isinstance(info.value, KeyboardInterrupt)  # every Ctrl-C cleanup runs for it
    assert _signals.stop_signal_received()
    assert {sig: signal.getsignal(sig) for sig in _signals.STOP_SIGNALS} == before
    assert _signals.exit_code(signal.SIGINT) == 130


def test_a_service_hears_the_first_signal_then_the_second_then_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(_signals, "exit_now", lambda signum: calls.append(("exit", signum)))

    async def service() -> None:
        with _signals.stop_signals_async(lambda s: calls.append(("first", s)),
                                         lambda s: calls.append(("second", s))):
            for n, sig in enumerate((signal.SIGTERM, signal.SIGINT, signal.SIGINT)):
                os.kill(os.getpid(), sig)
                for _ in range(200):  # the loop runs the handler soon after
                    if len(calls) > n:
                        break
                    await asyncio.sleep(0.01)

    before = {sig: signal.getsignal(sig) for sig in _signals.STOP_SIGNALS}
    with _signals.on_stop_signals("kvpool t"):
        asyncio.run(service())
        inside = {sig: signal.getsignal(sig) for sig in _signals.STOP_SIGNALS}
    assert calls == [("first", signal.SIGTERM), ("second", signal.SIGINT),
                     ("exit", signal.SIGINT)]
    assert all(handler is not before[sig] for sig, handler in inside.items())  # ours again
    assert {sig: signal.getsignal(sig) for sig in _signals.STOP_SIGNALS} == before


# ---------------------------------------------------------------------------------- replay

# The built-in workload on its default two jobs: minutes of work, interrupted within seconds.
REPLAY = ("replay", "--jobs", "2", "--workers", "2")


@pytest.mark.parametrize(
    ("sig", "group", "second", "code"),
    [
        (signal.SIGINT, True, False, 130),   # Ctrl-C in a terminal
        (signal.SIGTERM, False, False, 143),  # kill, timeout
        (signal.SIGINT, True, True, 130),    # Ctrl-C twice: exits at once
        (signal.SIGKILL, False, False, -9),  # kill -9: nothing can clean up but the workers
    ],
    ids=["ctrl-c", "sigterm", "ctrl-c-twice", "sigkill"],
)
def test_replay_stops_with_its_workers(sig: int, group: bool, second: bool, code: int) -> None:
    cmd = Command(*REPLAY)
    try:
        kids = cmd.workers(2)
        time.sleep(0.3)  # the workers are replaying
        assert semaphores([psutil.Process(cmd.proc.pid), *kids]) == []
        sent = cmd.signal(sig, group=group)
        if second:
            time.sleep(0.05)
            cmd.signal(sig, group=group)
        rc, took = cmd.exit_after(sent)
        assert rc == code, cmd.stderr
        assert took < STOP_S, took
        assert_nothing_left(cmd, kids)
        assert_clean(cmd)
        if sig != signal.SIGKILL:
            name = signal.Signals(sig).name
            assert cmd.err[-1] in (f"kvpool replay: interrupted ({name})",
                                   f"kvpool replay: {name} again: exiting now"), cmd.err
    finally:
        cmd.kill()


def test_replay_interrupted_while_it_starts() -> None:
    """Ctrl-C while the replay computes its bounds and starts its workers: the same exit."""
    cmd = Command(*REPLAY)
    try:
        cmd.wait_for(cmd.err, "kvpool replay: ")  # the progress header: the replay begins
        rc, took = cmd.exit_after(cmd.signal(signal.SIGINT, group=True))
        assert rc == 130 and took < STOP_S, (rc, took, cmd.stderr)
        assert_nothing_left(cmd, [])
        assert_clean(cmd)
    finally:
        cmd.kill()


# ----------------------------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from engine_serve_fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-serve"), seed=1)


@pytest.fixture
def serve(tiny_model: Path) -> Iterator[Any]:
    started: list[Command] = []

    def start(*extra: str) -> tuple[Command, int]:
        cmd = Command("serve", "--model", str(tiny_model), "--port", "0",
                      "--tokens-per-block", "16", "--gpu-blocks", "600", *extra)
        started.append(cmd)
        line = cmd.wait_for(cmd.out, "kvpool serve listening on http://")
        return cmd, int(line.rsplit(":", 1)[1])

    yield start
    for cmd in started:
        cmd.kill()


class Stream(threading.Thread):
    """A streamed completion of ``max_tokens`` tokens, read chunk by chunk."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.max_tokens = max_tokens
        self.chunks: list[bytes] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        body = {"prompt": "stop me", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            for line in resp:
                if line.strip():
                    self.chunks.append(line.strip())
        except (OSError, http.client.HTTPException) as exc:
            self.error = exc
        finally:
            conn.close()

    def wait_started(self) -> None:
        deadline = time.monotonic() + 60
        while len(self.chunks) < 2 and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.chunks) >= 2, (self.chunks, self.error)

    @property
    def done(self) -> bool:
        return bool(self.chunks) and self.chunks[-1] == b"data: [DONE]"


def test_serve_sigterm_finishes_what_fits_in_the_grace_and_exits_0(serve: Any) -> None:
    grace = 1.0
    cmd, port = serve("--shutdown-grace", str(grace))
    # 4,000 tokens take seconds (one engine step per token); 20 take a fraction of the grace
    short, long = Stream(port, 20), Stream(port, 4000)
    short.wait_started()
    long.wait_started()
    sent = cmd.signal(signal.SIGTERM, group=False)
    cmd.wait_for(cmd.err, "kvpool serve: SIGTERM: stopped accepting", timeout=10)
    with pytest.raises(ConnectionRefusedError):  # stopped accepting
        http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
    rc, took = cmd.exit_after(sent)
    short.join(10)
    long.join(10)
    assert rc == 0, cmd.stderr
    assert took < grace + STOP_S, took
    assert short.done  # finished within the grace: every chunk and [DONE]
    assert not long.done and len(long.chunks) > 2  # aborted when the grace ran out
    assert_nothing_left(cmd, [])
    assert_clean(cmd)


def test_serve_second_ctrl_c_aborts_at_once(serve: Any) -> None:
    cmd, port = serve("--shutdown-grace", "60")
    stream = Stream(port, 4000)
    stream.wait_started()
    cmd.signal(signal.SIGINT, group=True)
    cmd.wait_for(cmd.err, "kvpool serve: SIGINT: stopped accepting", timeout=10)
    rc, took = cmd.exit_after(cmd.signal(signal.SIGINT, group=True))
    stream.join(10)
    assert rc == 130, cmd.stderr
    assert took < STOP_S, took
    assert not stream.done
    assert "kvpool serve: SIGINT again: aborted 1 request(s) in flight" in cmd.err
    assert_nothing_left(cmd, [])
    assert_clean(cmd)


# ---------------------------------------------------------------------------------- router


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigterm"])
def test_router_stops_on_a_signal_and_exits_0(sig: int, group: bool, tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "listen: {host: 127.0.0.1, port: 0}\n"
        "workers:\n"
        "  - {id: w0, kind: kvpool, zmq_endpoint: 'tcp://127.0.0.1:9', tokens_per_block: 16,"
        " hash_algo: v2_sha256_64}\n"
    )
    cmd = Command("router", "--config", str(config))
    try:
        cmd.wait_for(cmd.out, "kvpool router listening on http://")
        rc, took = cmd.exit_after(cmd.signal(sig, group=group))
        assert rc == 0, cmd.stderr
        assert took < STOP_S, took
        assert_nothing_left(cmd, [])
        assert_clean(cmd)
    finally:
        cmd.kill()
