"""The worker threads of a ``KvpoolTier``: a fixed set of daemon threads taking tasks from one
queue, and a count of the tasks not finished yet (``wait_idle``: vLLM's ``drain_jobs``).

Cheaper than a ``ThreadPoolExecutor`` on the scheduler thread (no future per task, no thread
bookkeeping per submit): a submit is a deque append and, when a thread is idle, one lock
release that wakes it. Idle threads wait on a stack: a submit wakes the one that went idle
last, so a light load keeps running on one busy thread, and the scheduler thread is not
preempted by a thread that slept long (the OS favours such a thread at its wake-up). Tasks
must not raise (the tier's tasks catch everything; a task that raises anyway is counted done,
so ``wait_idle`` never hangs).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Workers"]

_Task = tuple[Callable[..., None], tuple[Any, ...]] | None


class Workers:
    """``threads`` daemon threads running submitted tasks in submission order."""

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sleeping: list[threading.Lock] = []  # the idle threads' wake locks, a stack
        self._pending = 0
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _put(self, task: _Task) -> None:
        with self._lock:
            self._tasks.append(task)
            wake = self._sleeping.pop() if self._sleeping else None
        if wake is not None:
            wake.release()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            self._pending += 1
        self._put((fn, args))

    def _next(self, wake: threading.Lock) -> _Task:
        while True:
            with self._lock:
                if self._tasks:
                    return self._tasks.popleft()
                self._sleeping.append(wake)
            wake.acquire()  # released by a _put that popped it

    def _run(self) -> None:
        wake = threading.Lock()
        wake.acquire()
        while True:
            task = self._next(wake)
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            finally:
                with self._idle:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()

    def wait_idle(self) -> None:
        """Block until every task submitted so far has finished."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def close(self) -> None:
        """Finish the tasks submitted, then stop the threads (idempotent)."""
        self.wait_idle()
        for _ in self._threads:
            self._put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
