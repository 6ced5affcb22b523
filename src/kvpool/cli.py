"""The ``kvpool`` command: a thin dispatcher over the subcommand modules in ``kvpool.commands``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning the exit code). Exit codes: 0 done,
1 the work could not be done as asked (the command says why), 2 a bad option or input (one
line on stderr, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.commands._args import CommandParser
from kvpool.errors import KVPoolError

# Subcommand modules under kvpool.commands, in the order --help lists them.
SUBCOMMANDS: tuple[str, ...] = ("plan", "router", "replay", "serve", "cache")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvpool",
        description="KV cache block manager, events, router and workload replay for LLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvpool.commands.{name}").register(sub)
    parser.set_defaults(command_parsers=sub.choices)  # to report a stray option as its command's
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
    try:
        code: int = func(args)
    except KVPoolError as exc:
        print(f"kvpool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
