"""The ``kvpool`` command: a thin dispatcher over the subcommand modules in ``kvpool.commands``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning the exit code). Exit codes: 0 done (for
``serve`` and ``router``: also stopped by SIGINT or SIGTERM), 1 the work could not be done as
asked (the command says why), 2 a bad option or input (one line on stderr, no traceback),
130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (see :mod:`kvpool.commands._signals`).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.commands._args import CommandParser, HelpFormatter
from kvpool.commands._signals import (
    Interrupted,
    StopState,
    end_process,
    exit_code,
    on_stop_signals,
    stop_signal_received,
)
from kvpool.errors import KVPoolError

# Subcommand modules under kvpool.commands, in the order --help lists them.
SUBCOMMANDS: tuple[str, ...] = ("plan", "router", "bridge", "replay", "serve", "cache")

EXIT_STATUS = """exit status:
  0    done; serve and router: also stopped by SIGINT or SIGTERM
  1    the work could not be done as asked (the command says why)
  2    a bad option or input (one line on stderr)
  130  interrupted by SIGINT (Ctrl-C); serve and router: by a second one
  143  interrupted by SIGTERM; serve and router: by a second one"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvpool",
        description="KV cache block manager, events, router and workload replay for LLM engines.",
        epilog=EXIT_STATUS,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvpool.commands.{name}").register(sub)
    parser.set_defaults(command_parsers=sub.choices)  # to report a stray option as its command's
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``) and return its exit status. Run
    as the program (no ``argv``), a command stopped by a signal ends the process itself once
    it has cleaned up (:func:`~kvpool.commands._signals.end_process`)."""
    code = _run(argv)
    if argv is None and stop_signal_received():
        end_process(code)
    return code


def _run(argv: Sequence[str] | None) -> int:
    with on_stop_signals("kvpool") as stop:  # before the parser imports every command
        try:
            return _dispatch(argv, stop)
        except KeyboardInterrupt as exc:  # Interrupted: SIGINT or SIGTERM; else Ctrl-C
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            print(f"{stop.command}: interrupted ({signal.Signals(signum).name})",
                  file=sys.stderr)
            return exit_code(signum)


def _dispatch(argv: Sequence[str] | None, stop: StopState) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        target = args.command_parsers.get(args.command, parser)
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_usage(sys.stderr)
        print("kvpool: error: a command is required (see kvpool --help)", file=sys.stderr)
        return 2
    stop.command = f"kvpool {args.command}"
    try:
        code: int = func(args)
    except KVPoolError as exc:
        print(f"{stop.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
