"""kvpool as SGLang's HiCache L3 storage: :class:`KvpoolHiCacheStorage`, an SGLang
``HiCacheStorage`` on kvpool's persistent disk tier and shared Redis/Valkey tier.

SGLang loads it by module path (``docs/integrations.md`` has the flags)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KvpoolHiCacheStorage",
        "interface_v1": 1, "disk_path": "/var/cache/kvpool", "disk_bytes": "64GiB"}'

SGLang is not a kvpool dependency: ``import kvpool`` never imports it, and neither does this
package until :class:`KvpoolHiCacheStorage` is looked up; without SGLang that lookup raises
:class:`SGLangUnavailableError` (an ``ImportError``, which SGLang's loader reports).

Modules: :mod:`~kvpool.integrations.sglang.options` (the settings),
:mod:`~kvpool.integrations.sglang.hostpages` (zero-copy page views of SGLang's host pool, the
namespace), :mod:`~kvpool.integrations.sglang.pagedisk` (the disk tier),
:mod:`~kvpool.integrations.sglang.pageremote` (the remote tier),
:mod:`~kvpool.integrations.sglang.storage` (the SGLang class, which imports SGLang).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.integrations.sglang.options import KEYS, SGLangUnavailableError, StorageOptions

if TYPE_CHECKING:
    from kvpool.integrations.sglang.storage import KvpoolHiCacheStorage

__all__ = ["KEYS", "KvpoolHiCacheStorage", "SGLangUnavailableError", "StorageOptions"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolHiCacheStorage":
        from kvpool.integrations.sglang.storage import KvpoolHiCacheStorage

        return KvpoolHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
