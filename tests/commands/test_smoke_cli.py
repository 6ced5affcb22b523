"""The console script answers --version and --help as installed."""

from __future__ import annotations

import subprocess
import sys

import kvpool


def test_version_matches_package() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "--version"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == f"kvpool {kvpool.__version__}"


def test_help_lists_usage() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("usage: kvpool")
