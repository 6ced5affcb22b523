"""kvpool.integrations.vllm without vLLM: its settings, and that nothing imports vLLM early."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.errors import ConfigError
from kvpool.integrations import IntegrationUnavailableError, require
from kvpool.integrations.vllm import KvpoolTierConfig
from kvpool.integrations.vllm.config import parse_bytes


def test_import_kvpool_and_the_integration_never_import_vllm() -> None:
    code = ("import sys, kvpool, kvpool.integrations, kvpool.integrations.vllm as v; "
            "v.KvpoolTierConfig(remote_url='redis://x'); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_engine_is_a_typed_import_error() -> None:
    with pytest.raises(IntegrationUnavailableError,
                       match=r"pip install 'no-such-engine==1\.2\.\*'"):
        require("no-such-engine", "no_such_engine", ("1.2",), "kvpool.integrations.x")
    with pytest.raises(ImportError):  # what vLLM's factories expect of a failed import
        require("no-such-engine", "no_such_engine", ("1.2",), "kvpool.integrations.x")


def test_an_engine_of_another_version_is_refused() -> None:
    with pytest.raises(IntegrationUnavailableError, match=r"written for pytest 0\.1"):
        require("pytest", "pytest", ("0.1",), "kvpool.integrations.x")
    assert require("pytest", "pytest", (pytest.__version__.rsplit(".", 1)[0],), "x")


@pytest.mark.parametrize(("value", "expected"), [
    (4096, 4096), ("4096", 4096), ("2GiB", 2 << 30), ("1.5 GB", 1_500_000_000),
    ("64 mib", 64 << 20), ("1T", 10**12),
])
def test_byte_counts(value: object, expected: int) -> None:
    assert parse_bytes("disk_bytes", value) == expected


@pytest.mark.parametrize("value", [0, -1, True, "12 parsecs", "GiB", 1.5, None, "0"])
def test_bad_byte_counts(value: object) -> None:
    with pytest.raises(ConfigError, match="disk_bytes"):
        parse_bytes("disk_bytes", value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "needs disk_path"),
    ({"disk_path": "/tmp/x"}, "disk_path needs disk_bytes"),
    ({"disk_bytes": 10, "remote_url": "redis://h"}, "disk_bytes is set but disk_path"),
    ({"remote_url": "http://h"}, "scheme 'http'"),
    ({"remote_url": "redis://h", "eviction_policy": "mru"}, "eviction_policy"),
    ({"remote_url": "redis://h", "io_threads": 0}, "io_threads"),
    ({"remote_url": "redis://h", "remote_timeout_s": -1}, "remote_timeout_s"),
    ({"remote_url": "redis://h", "disk_manifest_damaged": "ignore"}, "disk_manifest_damaged"),
    ({"remote_url": "redis://h", "locality": "MARS"}, "locality"),
    ({"remote_url": "redis://h", "enable_kv_events": "yes"}, "enable_kv_events"),
    ({"remote_url": "redis://h", "namespace": 3}, "namespace"),
])
def test_bad_settings_name_the_key(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KvpoolTierConfig.from_mapping(kwargs)


def test_unknown_keys_are_listed_with_the_known_ones() -> None:
    with pytest.raises(ConfigError,
                       match=r"does not know the key\(s\) \['disk_size'\].*disk_bytes"):
        KvpoolTierConfig.from_mapping({"disk_path": "/x", "disk_size": 5})


def test_good_settings() -> None:
    c = KvpoolTierConfig.from_mapping({"disk_path": "/x", "disk_bytes": "1GiB",
                                       "remote_url": "redis+cluster://h:7000",
                                       "eviction_policy": "arc", "locality": "LOCAL"})
    assert c.disk_bytes == 1 << 30 and c.eviction_policy == "arc"
