"""What every subcommand's options share: a parser whose errors are one line, argument types
that say what they expected, and the check that an output file can be written before any work.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from kvpool.errors import InvalidArgumentError
from kvpool.planner.capacity import parse_size

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that an ``exit status:`` epilog keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit status:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class CommandParser(argparse.ArgumentParser):
    """An argument parser that reports a bad option as one line on stderr and exits 2:
    ``kvpool replay: error: argument --workers: expected an integer >= 1, got '0' (see
    kvpool replay --help)``. A value that starts with a minus and a digit (``-5GiB``,
    ``-1``) is read as a value, so its own type can say what is wrong with it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._negative_number_matcher = re.compile(r"^-\.?\d.*$")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def size(text: str) -> int:
    """A byte size (``40GiB``, ``512MB``, a plain number); never negative."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    try:
        return parse_size(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def integer(text: str, lo: int, hi: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
    return value


def positive(text: str) -> int:
    return integer(text, 1)


def nonneg(text: str) -> int:
    return integer(text, 0)


def port(text: str) -> int:
    """A TCP port; 0 asks for any free one."""
    return integer(text, 0, 65535)


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a duration that cannot be zero)."""
    value = nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}; expected one of {', '.join(LOG_LEVELS)}"
        )
    return level


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """The ``--log-level`` option of a command that runs a service."""
    parser.add_argument("--log-level", type=log_level, default="WARNING", metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS)} (default WARNING)")


def start_logging(level: str) -> None:
    """Log records at ``level`` and above to stderr, each with its time and logger."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def check_writable(path: Path | None, flag: str) -> None:
    """Raise :class:`InvalidArgumentError` now if ``path`` could not be written later: its
    folder is missing or read-only, or it is a folder itself. ``-`` (stdout) always passes."""
    if path is None or str(path) == "-":
        return
    parent = path.parent
    if path.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: is a directory, expected a file name")
    if not parent.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidArgumentError(f"{flag} {path}: not writable")


def warn(command: str, message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"kvpool {command}: warning: {message}", file=sys.stderr, flush=True)


def note(command: str, message: str) -> None:
    print(f"kvpool {command}: note: {message}", file=sys.stderr, flush=True)
