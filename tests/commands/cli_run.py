"""``kvpool`` as a user runs it, for the command tests: a subprocess with its output captured,
and the check of a refusal."""

from __future__ import annotations

import os
import subprocess
import sys


def kvpool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "240"}  # wide enough that rich never wraps a row
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def assert_refused(res: subprocess.CompletedProcess[str], *words: str) -> None:
    """The command exited 2 with each of ``words`` on stderr, and no traceback."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    for word in words:
        assert word in res.stderr, res.stderr
