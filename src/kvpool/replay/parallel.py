"""Worker processes that never outlive the replay that started them.

:func:`run_tasks` runs ``fn(*shared, task, progress)`` for every task on up to ``jobs`` spawned
processes (no fork of a threaded parent) and returns the results in task order. Its guarantees:

* **No process left behind.** On any exception in the parent (Ctrl-C's
  :class:`KeyboardInterrupt`, SIGTERM turned into one, a failed task) every worker is
  terminated (SIGTERM, then SIGKILL after :data:`TERMINATE_WAIT_S`) before it propagates. A
  parent killed outright (SIGKILL, or a second Ctrl-C's ``os._exit``) takes its workers with
  it: each asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG`` on Linux;
  elsewhere a thread that watches the parent's pid), and exits at once if the parent is
  already gone.
* **Ctrl-C reaches the parent only.** A terminal sends SIGINT to the whole foreground process
  group; workers are started with SIGINT blocked (the mask is inherited across fork and exec),
  so they print no ``KeyboardInterrupt`` traceback and the parent decides when they stop.
* **No semaphore to leak.** Tasks, progress and results travel over one pipe per worker
  (``multiprocessing.Pipe``): no ``Queue``, lock or semaphore, so the resource tracker has
  nothing to report when a parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any, Final

from kvpool.errors import KVPoolError

__all__ = ["TERMINATE_WAIT_S", "WorkerDiedError", "run_tasks"]

TERMINATE_WAIT_S: Final = 1.0
"""How long a worker has to exit after SIGTERM before it gets SIGKILL."""

_PR_SET_PDEATHSIG: Final = 1
_PARENT_POLL_S: Final = 0.5
_PROGRESS_EVERY_S: Final = 0.1

Progress = Callable[[int], None]


class WorkerDiedError(KVPoolError):
    """A worker process ended without returning its task's result (killed, out of memory)."""


# ------------------------------------------------------------------------------ the worker


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when ``parent_pid`` ends (now, if it already has)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    else:  # pragma: no cover - no PR_SET_PDEATHSIG: watch the parent's pid instead

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(_PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="kvpool-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _worker(conn: Connection, parent_pid: int) -> None:
    """A worker's life: die with the parent, receive ``(fn, shared)``, then run tasks until
    told to stop (None) or the parent's end of the pipe closes."""
    if hasattr(signal, "pthread_sigmask"):  # inherited; again in case a library unblocked it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _die_with_parent(parent_pid)
    try:
        fn, shared = pickle.loads(conn.recv_bytes())
        while (message := conn.recv()) is not None:
            index, task = message
            sent = _Throttled(conn, index)
            try:
                result = fn(*shared, task, sent.add)
            except Exception as exc:  # the task's error goes to the parent, which raises it
                sent.flush()
                conn.send(("error", index, _picklable(exc)))
            else:
                sent.flush()
                conn.send(("done", index, result))
    except (EOFError, BrokenPipeError):  # the parent is gone or stopped reading
        return


class _Throttled:
    """A task's progress counts, sent to the parent at most every :data:`_PROGRESS_EVERY_S`."""

    def __init__(self, conn: Connection, index: int) -> None:
        self.conn = conn
        self.index = index
        self.pending = 0
        self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.pending += n
        now = time.monotonic()
        if now - self.last >= _PROGRESS_EVERY_S:
            self.flush()
            self.last = now

    def flush(self) -> None:
        if self.pending:
            self.conn.send(("progress", self.index, self.pending))
            self.pending = 0


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


# ------------------------------------------------------------------------------ the parent


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while a worker is started (it inherits the mask); a
    Ctrl-C meanwhile is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    # spawn starts multiprocessing's resource tracker with the first worker, and unblocks
    # SIGINT once it has: start it first, so that the block below holds for every worker
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Pool:
    """``jobs`` started workers, each with its end of a pipe and ``(fn, shared)`` sent."""

    def __init__(self, jobs: int, fn: Callable[..., Any], shared: tuple[Any, ...]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[tuple[Any, Connection]] = []
        try:
            for _ in range(jobs):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(theirs, os.getpid()),
                                   name="kvpool-replay-worker", daemon=True)
                self.workers.append((proc, ours))
                with _sigint_blocked():  # only a small pickle: start() does not wait
                    proc.start()
                theirs.close()
            payload = pickle.dumps((fn, shared), protocol=pickle.HIGHEST_PROTOCOL)
            for _, conn in self.workers:  # interruptible: SIGINT is not blocked here
                conn.send_bytes(payload)
        except BaseException:
            self.stop()
            raise

    def conn_of(self, proc: Any) -> Connection:
        return next(c for p, c in self.workers if p is proc)

    def finish(self) -> None:
        """Every worker is told to exit; they get :data:`TERMINATE_WAIT_S` to do so."""
        for _, conn in self.workers:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + TERMINATE_WAIT_S
        for proc, _ in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Every worker still alive is terminated, and killed if it has not exited within
        :data:`TERMINATE_WAIT_S`; then the pipes are closed."""
        started = [(p, c) for p, c in self.workers if p.pid is not None]
        for proc, _ in started:
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + TERMINATE_WAIT_S
        for proc, _ in started:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
            proc.close()
        for _, conn in self.workers:
            conn.close()


def run_tasks(
    fn: Callable[..., Any],
    shared: tuple[Any, ...],
    tasks: Sequence[Any],
    jobs: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """``[fn(*shared, task, progress_of_task) for task in tasks]`` on ``jobs`` worker
    processes (see the module docstring). ``fn`` and every argument must pickle (``fn`` by
    reference: a module-level function). ``progress(i, n)`` receives what task ``i``'s
    ``progress_of_task(n)`` calls send. A task's exception is raised here, after every
    worker is stopped; a worker that dies raises :class:`WorkerDiedError`."""
    if not tasks:
        return []
    pending = deque(enumerate(tasks))
    results: dict[int, Any] = {}
    pool = _Pool(min(jobs, len(tasks)), fn, shared)
    busy: set[Connection] = set()

    def assign(conn: Connection) -> None:
        if pending:
            conn.send(pending.popleft())
            busy.add(conn)
        else:
            busy.discard(conn)

    def receive(conn: Connection) -> None:
        kind, index, value = conn.recv()
        if kind == "progress":
            if progress is not None:
                progress(index, value)
        elif kind == "error":
            raise value
        else:
            results[index] = value
            assign(conn)

    try:
        for _, conn in pool.workers:
            assign(conn)
        sentinels = {proc.sentinel: proc for proc, _ in pool.workers}
        while len(results) < len(tasks):
            for ready in wait([*busy, *sentinels]):
                if isinstance(ready, Connection):
                    if ready in busy:
                        receive(ready)
                    continue
                proc = sentinels.pop(ready)  # a worker ended: read what it sent first
                conn = pool.conn_of(proc)
                while conn in busy and conn.poll():
                    receive(conn)
                if conn in busy:
                    proc.join()
                    raise WorkerDiedError(
                        f"a replay worker process (pid {proc.pid}) ended with exit code "
                        f"{proc.exitcode} before returning its result"
                    )
        pool.finish()
    except (EOFError, BrokenPipeError) as exc:
        raise WorkerDiedError(f"a replay worker process ended unexpectedly ({exc!r})") from None
    finally:
        pool.stop()
    return [results[i] for i in range(len(tasks))]
