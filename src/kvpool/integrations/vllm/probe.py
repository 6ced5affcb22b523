"""Remote lookups off the scheduler thread: keys asked about go to one prober thread, which asks
the store about all keys queued meanwhile in one pipelined round trip and posts the answers.

``lookup`` on the scheduler thread only queues a key (a deque append and a condition notify)
and answers RETRY; vLLM's scheduler keeps scanning a request's keys on RETRY and asks again
next step, when the answer has usually arrived. A server that is down or in its backoff answers
"absent" for the whole batch (``ok=False``), so a request falls back to recomputing instead of
waiting.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvpool.errors import RemoteTierError

__all__ = ["ProbeDone", "Prober"]

_MAX_BATCH: Final = 4096


@dataclass(slots=True)
class ProbeDone:
    """The answer to a batch of remote lookups: whether each key holds a value (all False when
    the server could not be asked: ``ok`` False)."""

    keys: list[bytes]
    present: list[bool]
    ok: bool


class Prober:
    """One daemon thread answering ``exists`` for queued keys in batches (module doc)."""

    def __init__(self, exists: Callable[[Sequence[bytes]], list[bool]],
                 post: Callable[[object], None], name: str = "kvpool-vllm-probe") -> None:
        self._exists = exists
        self._post = post
        self._queue: deque[bytes] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.in_flight = 0  # keys queued or being asked about (read on the scheduler thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: bytes) -> None:
        with self._wake:
            self._queue.append(key)
            self.in_flight += 1
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                n = min(len(self._queue), _MAX_BATCH)
                keys = [self._queue.popleft() for _ in range(n)]
            try:
                done = ProbeDone(keys, self._exists(keys), True)
            except RemoteTierError:
                done = ProbeDone(keys, [False] * len(keys), False)
            except Exception:  # never let the thread die with keys unanswered
                done = ProbeDone(keys, [False] * len(keys), False)
            self._post(done)
            with self._wake:
                self.in_flight -= len(keys)

    def close(self) -> None:
        """Stop the thread (keys still queued stay unanswered); idempotent."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)
