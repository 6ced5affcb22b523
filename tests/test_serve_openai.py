"""``kvpool serve``'s command line as users of other OpenAI servers expect it: every flag
with help and its default, and a busy port refused at once, before the model loads."""

from __future__ import annotations

import argparse
import re

import pytest

from kvpool.cli import build_parser
from kvpool.commands import serve

_DEFAULT = re.compile(r"\(default ([^;)\s]+)[;)]")


def _serve_parser() -> argparse.ArgumentParser:
    parsers: dict[str, argparse.ArgumentParser] = build_parser().parse_args(
        ["serve"]).command_parsers
    return parsers["serve"]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_help_shows_every_option_with_help_and_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "2000")  # one line per option: its help is found whole
    parser = _serve_parser()
    shown = parser.format_help()
    options = _options(parser)
    assert len(options) >= 20
    for action in options:
        flag = action.option_strings[-1]
        assert action.help, f"{flag} has no help"
        assert action.help in shown, flag
        assert re.search(r"\bdefault\b", action.help), f"{flag}'s help does not say its default"
        if action.default is None:
            continue
        match = _DEFAULT.search(action.help)
        assert match, f"{flag}'s help does not show its default {action.default!r}"
        value = match.group(1)
        read = action.type(value) if callable(action.type) else value
        assert read == action.default, (flag, value, action.default)


def test_help_defaults_are_the_engines() -> None:
    from kvpool.config import CacheConfig
    from kvpool.planner.capacity import parse_size

    torch = pytest.importorskip("torch")
    del torch
    from kvpool.engine import layout

    fields = CacheConfig.__dataclass_fields__
    assert fields["eviction_policy"].default == serve.DEFAULT_EVICTION_POLICY
    assert parse_size(serve.DEFAULT_GPU_MEM) == layout.DEFAULT_GPU_MEM
    assert serve.DEFAULT_SHUTDOWN_GRACE_S == pytest.importorskip(
        "kvpool.engine.server").DEFAULT_SHUTDOWN_GRACE_S
