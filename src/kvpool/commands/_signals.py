"""How a command stops on SIGINT (Ctrl-C) and SIGTERM (``kill``, ``timeout``, a supervisor).

The first signal asks the command to stop: a batch command (``replay``, ``plan``) is
interrupted where it is (:class:`Interrupted`, raised in the main thread), cleans up what it
started and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM) with one line on
stderr; a service (``serve``, ``router``) stops through its own callback and exits 0 once
stopped. A second signal exits at once (``os._exit``, after flushing stdout and stderr) with
``128 + signal``: no traceback, no waiting for anything; worker processes die with their parent
(:mod:`kvpool.replay.parallel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

__all__ = ["STOP_SIGNALS", "Interrupted", "StopState", "end_process", "exit_code", "exit_now",
           "on_stop_signals", "stop_signal_received", "stop_signals_async"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 130 for SIGINT, 143 for
    SIGTERM."""
    return 128 + signum


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the main thread of a batch command (a :class:`KeyboardInterrupt`,
    so every ``finally`` and ``except KeyboardInterrupt`` cleans up as for Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopState:
    """The signals received since the command started (process-wide: one command runs) and
    the command's name for the lines it prints."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.command = "kvpool"


_state = StopState()


def stop_signal_received() -> bool:
    """Whether a stop signal came since the command started."""
    return bool(_state.received)


def end_process(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process now with ``code`` (``os._exit``: no
    interpreter teardown, during which Python has given SIGINT and SIGTERM back to the
    system, so another signal could no longer be answered with a status of ours)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_now(signum: int) -> NoReturn:
    """One line on stderr, then :func:`end_process` with :func:`exit_code`."""
    with contextlib.suppress(Exception):
        print(f"{_state.command}: {signal.Signals(signum).name} again: exiting now",
              file=sys.stderr)
    end_process(exit_code(signum))


def _raise_first(signum: int, frame: FrameType | None) -> None:
    if _state.received:
        exit_now(signum)
    _state.received.append(signum)
    raise Interrupted(signum)


@contextlib.contextmanager
def on_stop_signals(command: str) -> Iterator[StopState]:
    """While inside: the first SIGINT or SIGTERM raises :class:`Interrupted` in the main
    thread, a second one calls :func:`exit_now`. The previous handlers are set again on the
    way out (the program then ends at once, :func:`end_process`, if a signal came). Outside
    the main thread (where Python cannot set handlers) it only records the command's name."""
    _state.received = []
    _state.command = command
    if threading.current_thread() is not threading.main_thread():
        yield _state
        return
    previous = {sig: signal.signal(sig, _raise_first) for sig in STOP_SIGNALS}
    try:
        yield _state
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_signals_async(
    first: Callable[[int], Any], second: Callable[[int], Any] | None = None
) -> Iterator[None]:
    """For a service's main coroutine: the first SIGINT or SIGTERM calls ``first(signum)``
    on the event loop, the second ``second(signum)`` (by default :func:`exit_now`), any later
    one :func:`exit_now`. The handlers that were set before (:func:`on_stop_signals`'s) are
    set again on the way out, so a signal while the service finishes stopping still counts.
    A no-op where the loop has no signal handlers."""
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    seen = len(_state.received)

    def handle(signum: int) -> None:
        _state.received.append(signum)
        count = len(_state.received) - seen
        if count == 1:
            first(signum)
        elif count == 2 and second is not None:
            second(signum)
        else:
            exit_now(signum)

    installed = []
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handle, int(sig))
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
            handler = previous[sig]
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)
