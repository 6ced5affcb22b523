"""The worker threads of a ``KvpoolTier``: a fixed set of daemon threads taking tasks from one
queue, and a count of the tasks not finished yet (``wait_idle``: vLLM's ``drain_jobs``).

Cheaper than a ``ThreadPoolExecutor`` on the scheduler thread (no future per task, no thread
bookkeeping per submit): a submit is a counter increment and one ``SimpleQueue.put``. Tasks
must not raise (the tier's tasks catch everything; a task that raises anyway is counted done,
so ``wait_idle`` never hangs).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Workers"]

_Task = tuple[Callable[..., None], tuple[Any, ...]] | None


class Workers:
    """``threads`` daemon threads running submitted tasks in submission order per thread."""

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._idle:
            self._pending += 1
        self._tasks.put((fn, args))

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
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
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
