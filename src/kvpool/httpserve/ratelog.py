"""A log that writes at most a few lines per window, and says how many it held back.

For what a client can cause as often as it likes (dropping its connection, malformed HTTP,
slowness): one line per event while they are rare, a bounded number when they are not.
"""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s`` seconds on ``logger``; the lines held back are
    counted and their number is added to the next line written."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0
                 ) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._window_start = float("-inf")
        self._written = 0
        self.held_back = 0
        """Lines not written since the last one that was."""

    def log(self, level: int, message: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            self._window_start = now
            self._written = 0
        if self._written >= self.burst:
            self.held_back += 1
            return
        self._written += 1
        if self.held_back:
            message += " (%d similar lines held back)"
            args = (*args, self.held_back)
            self.held_back = 0
        self.logger.log(level, message, *args)
