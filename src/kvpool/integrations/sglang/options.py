"""The settings of :class:`~kvpool.integrations.sglang.KvpoolHiCacheStorage`, read from
SGLang's ``--hicache-storage-backend-extra-config`` JSON and checked before anything opens.

SGLang passes that JSON object to the backend as ``HiCacheStorageConfig.extra_config``. Its
own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``tp_lcm_size``, ``prefetch_threshold``, ``prefetch_timeout_base``) are left to SGLang; the
others are kvpool's (:data:`KEYS`), and a key that is neither is refused, so a misspelt
option fails at start instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.integrations import IntegrationUnavailableError
from kvpool.planner.sizes import parse_size
from kvpool.tiers.remote.store import split_url
from kvpool.validation import check_bool, check_number, is_int

__all__ = ["KEYS", "SGLANG_KEYS", "SGLangUnavailableError", "StorageOptions"]

SGLANG_KEYS: Final = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base",
})
KEYS: Final = {
    "disk_path": "directory of the persistent disk tier (created if missing)",
    "disk_bytes": "bytes of pages the disk tier holds (int, or a string such as '64GiB')",
    "remote_url": "redis://, rediss://, unix://, valkey:// or redis+cluster:// URL",
    "namespace": "a name of your own mixed into the namespace (e.g. a model revision)",
    "eviction_policy": f"the disk tier's policy: one of {', '.join(EVICTION_POLICIES)}",
    "disk_sync_interval_s": "seconds between fsyncs of the disk tier and its manifest",
    "disk_manifest_damaged": "'keep_prefix', 'discard' or 'refuse' (a damaged manifest)",
    "promote_remote_hits": "copy pages read from the remote tier into the disk tier",
    "remote_timeout_s": "seconds before a remote call fails",
    "remote_backoff_s": "first wait before reconnecting after a remote failure",
}
_DAMAGED: Final = ("keep_prefix", "discard", "refuse")


class SGLangUnavailableError(IntegrationUnavailableError):
    """SGLang (the ``sglang`` package) cannot be imported: the SGLang integration needs it,
    the rest of kvpool does not."""


def _size(value: object) -> int:
    """``disk_bytes``: an int, or a size as people write it (``'64GiB'``, kvpool's sizes)."""
    if not (is_int(value) or isinstance(value, str)):
        raise ConfigError(f"disk_bytes must be a size in bytes, got {value!r}")
    try:
        n = value if isinstance(value, int) else parse_size(value.strip())
    except InvalidArgumentError:
        raise ConfigError(f"disk_bytes must be a size such as 68719476736 or '64GiB', "
                          f"got {value!r}") from None
    if n <= 0:
        raise ConfigError(f"disk_bytes must be > 0, got {value!r}")
    return n


def _seconds(name: str, value: object, *, zero: bool = False) -> float:
    return check_number(name, value, 0, above=not zero, error=ConfigError)


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """kvpool's settings of one storage backend (module docstring; :data:`KEYS`)."""

    disk_path: str | None = None
    disk_bytes: int | None = None
    remote_url: str | None = None
    namespace: str = ""
    eviction_policy: str = "2q"
    disk_sync_interval_s: float = 5.0
    disk_manifest_damaged: str = "keep_prefix"
    promote_remote_hits: bool = True
    remote_timeout_s: float = 2.0
    remote_backoff_s: float = 0.5

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageOptions:
        """The options of SGLang's extra config; :class:`ConfigError` naming the bad key."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in KEYS and k not in SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"unknown kvpool storage option(s) {unknown}; kvpool reads "
                              f"{sorted(KEYS)} (SGLang reads {sorted(SGLANG_KEYS)})")
        get = extra.get
        disk_path = get("disk_path")
        disk_bytes = get("disk_bytes")
        remote_url = get("remote_url")
        if disk_path is None and remote_url is None:
            raise ConfigError("kvpool storage needs disk_path (with disk_bytes), remote_url, "
                              "or both in --hicache-storage-backend-extra-config")
        if (disk_path is None) != (disk_bytes is None):
            raise ConfigError("disk_path and disk_bytes go together (the disk tier's "
                              f"directory and size), got disk_path={disk_path!r}, "
                              f"disk_bytes={disk_bytes!r}")
        policy = get("eviction_policy", "2q")
        if policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction_policy must be one of {list(EVICTION_POLICIES)}, "
                              f"got {policy!r}")
        damaged = get("disk_manifest_damaged", "keep_prefix")
        if damaged not in _DAMAGED:
            raise ConfigError(f"disk_manifest_damaged must be one of {list(_DAMAGED)}, "
                              f"got {damaged!r}")
        promote = get("promote_remote_hits", True)
        check_bool("promote_remote_hits", promote, error=ConfigError)
        if remote_url is not None:
            split_url(_text("remote_url", remote_url))  # InvalidArgumentError for a bad URL
        namespace = get("namespace", "")
        if not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a string, got {namespace!r}")
        return cls(
            disk_path=None if disk_path is None else _text("disk_path", disk_path),
            disk_bytes=None if disk_bytes is None else _size(disk_bytes),
            remote_url=None if remote_url is None else _text("remote_url", remote_url),
            namespace=namespace,
            eviction_policy=policy,
            disk_sync_interval_s=_seconds("disk_sync_interval_s",
                                          get("disk_sync_interval_s", 5.0), zero=True),
            disk_manifest_damaged=damaged,
            promote_remote_hits=promote,
            remote_timeout_s=_seconds("remote_timeout_s", get("remote_timeout_s", 2.0)),
            remote_backoff_s=_seconds("remote_backoff_s", get("remote_backoff_s", 0.5)),
        )
