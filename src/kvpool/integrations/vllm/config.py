"""The settings of a :class:`~kvpool.integrations.vllm.tier.KvpoolTier`: the keys of its
``secondary_tiers`` entry in vLLM's ``kv_connector_extra_config``, checked when vLLM builds
the tier (a bad value stops vLLM at start with a :class:`~kvpool.errors.ConfigError` that names
the key), before any file or connection is opened.

Needs no vLLM: operators' tooling and tests can validate a configuration on its own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.tiers.remote.store import DEFAULT_BATCH_BYTES, split_url
from kvpool.validation import check_bool, check_int, check_number, is_int

__all__ = ["MANIFEST_ACTIONS", "KvpoolTierConfig", "parse_bytes"]

MANIFEST_ACTIONS: Final = ("refuse", "keep_prefix", "discard")
_UNITS: Final = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
                 "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10,
                 "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_LOCALITIES: Final = ("LOCAL", "REMOTE")


def parse_bytes(name: str, value: object) -> int:
    """A byte count from an int or a string such as ``"200GiB"``, ``"1.5 TB"``, ``"4096"``
    (decimal and binary units); :class:`ConfigError` naming ``name`` otherwise."""
    if is_int(value):
        number = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and (
            m.group(2).lower() in _UNITS):
        number = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(
            f"{name} must be a byte count (an int, or a string like '200GiB'), got {value!r}"
        )
    if number <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return number


def _positive(name: str, value: object, kind: type = float) -> Any:
    if kind is float:
        return check_number(name, value, 0, above=True, error=ConfigError)
    return check_int(name, value, 1, error=ConfigError)


@dataclass(frozen=True, slots=True)
class KvpoolTierConfig:
    """What a ``KvpoolTier`` stores where, and how it behaves (docs/integrations.md).

    At least one of ``disk_path`` (with ``disk_bytes``) and ``remote_url`` is set; with both,
    blocks are written to both and loaded from disk first.
    """

    disk_path: str | None = None
    """Directory of the persistent disk tier (created if missing). The next vLLM started on it
    with the same model and KV layout finds the blocks stored there; one live process at a
    time (its files are locked)."""
    disk_bytes: int | None = None
    """Size of the disk tier, reserved on disk at start (``fallocate``): an int or ``"200GiB"``."""
    remote_url: str | None = None
    """A Redis/Valkey server or cluster shared by every vLLM that names it:
    ``redis://host:6379/0``, ``rediss://``, ``unix://``, ``redis+cluster://``."""
    eviction_policy: str = "s3fifo"
    """Which disk block gives way to a new one: one of kvpool's ``lru``, ``2q``, ``s3fifo``,
    ``arc``."""
    namespace: str = ""
    """Extra text in the namespace (e.g. a model revision); engines share blocks only when their
    model, KV layout and namespace are equal."""
    model: str | None = None
    """Model name in the namespace; default: vLLM's model name (required without vLLM's spec)."""
    io_threads: int = 4
    """Threads doing the tier's disk and network I/O."""
    disk_sync_interval_s: float | None = 1.0
    """fsync the disk files and manifest at most this often (None: only at shutdown)."""
    disk_manifest_damaged: str = "keep_prefix"
    """A damaged manifest at start: ``keep_prefix`` (keep what was recorded before the damage),
    ``discard`` (start empty), ``refuse`` (stop vLLM)."""
    remote_timeout_s: float = 2.0
    remote_backoff_s: float = 0.5
    remote_backoff_max_s: float = 30.0
    remote_batch_bytes: int = DEFAULT_BATCH_BYTES
    remote_known_max: int = 1 << 20
    """Remote keys remembered as present (stored or probed) before the oldest are forgotten."""
    enable_kv_events: bool = False
    """Announce stored/removed blocks as vLLM KV events (when vLLM's events are on)."""
    locality: str | None = None
    """``LOCAL`` or ``REMOTE`` for vLLM's per-request tier filters (default: ``LOCAL`` with a
    disk tier, else ``REMOTE``)."""

    def __post_init__(self) -> None:
        if self.disk_path is None and self.remote_url is None:
            raise ConfigError("KvpoolTier needs disk_path (with disk_bytes), remote_url, or both")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path:
                raise ConfigError(f"disk_path must be a directory path, got {self.disk_path!r}")
            if self.disk_bytes is None:
                raise ConfigError("disk_path needs disk_bytes (the size of the disk tier)")
            object.__setattr__(self, "disk_bytes", parse_bytes("disk_bytes", self.disk_bytes))
        elif self.disk_bytes is not None:
            raise ConfigError("disk_bytes is set but disk_path is not")
        if self.remote_url is not None:
            try:
                split_url(self.remote_url)
            except InvalidArgumentError as e:
                raise ConfigError(str(e)) from None
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction_policy must be one of {list(EVICTION_POLICIES)}, "
                              f"got {self.eviction_policy!r}")
        for name in ("namespace",):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a str, got {self.model!r}")
        _positive("io_threads", self.io_threads, int)
        if self.disk_sync_interval_s is not None:
            _positive("disk_sync_interval_s", self.disk_sync_interval_s)
        if self.disk_manifest_damaged not in MANIFEST_ACTIONS:
            raise ConfigError(f"disk_manifest_damaged must be one of {list(MANIFEST_ACTIONS)}, "
                              f"got {self.disk_manifest_damaged!r}")
        for name in ("remote_timeout_s", "remote_backoff_s", "remote_backoff_max_s"):
            _positive(name, getattr(self, name))
        _positive("remote_batch_bytes", self.remote_batch_bytes, int)
        _positive("remote_known_max", self.remote_known_max, int)
        check_bool("enable_kv_events", self.enable_kv_events, error=ConfigError)
        if self.locality is not None and self.locality not in _LOCALITIES:
            raise ConfigError(f"locality must be one of {list(_LOCALITIES)}, "
                              f"got {self.locality!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> KvpoolTierConfig:
        """The configuration of a tier entry's keys (``type``/``module_path`` excluded);
        :class:`ConfigError` for a key it does not know, listing those it does."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"KvpoolTier does not know the key(s) {unknown}; "
                              f"it accepts {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]
