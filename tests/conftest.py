"""Shared test settings: a bounded hypothesis profile so the suite fits CI's time; a cache
directory of the suite's own, so that no test writes into ``~/.cache/kvpool``; a real
redis-server for the remote tier's tests.

The tests sit in folders that mirror ``src/kvpool``'s packages (``tests/core``,
``tests/router``, ...). They import the helper modules of this folder (``redis_server``,
``http_raw``, ...) and a few import each other across folders by module name, so every test
folder is put on ``sys.path`` here, before any of them is collected."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_TESTS = Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.insert(1, str(_folder))

from redis_server import RedisServer  # noqa: E402

# Where kvpool keeps what it stores (the converted model, kvpool.engine.models.cache_dir):
# a temporary directory for the session, removed at its end, inherited by every process a test
# starts. KVPOOL_TEST_CACHE_DIR names a directory to keep between runs instead (the model's
# conversion then happens once).
_kept = os.environ.get("KVPOOL_TEST_CACHE_DIR")
if _kept:
    os.environ["KVPOOL_CACHE_DIR"] = _kept
else:
    _session_cache = tempfile.mkdtemp(prefix="kvpool-test-cache-")
    os.environ["KVPOOL_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("KVPOOL_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped after the test."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
