"""kvpool inside vLLM 0.33: a secondary offloading tier and CPU-tier eviction policies.

``KvpoolTier`` (:mod:`~kvpool.integrations.vllm.tier`) is a vLLM ``SecondaryTierManager`` on
kvpool's persistent disk tier and/or a shared Redis/Valkey store; vLLM builds it from a
``secondary_tiers`` entry of ``kv_connector_extra_config``::

    {"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm",
     "disk_path": "/var/cache/kvpool", "disk_bytes": "200GiB",
     "remote_url": "redis://cache:6379/0"}

``KvpoolS3FIFO``, ``KvpoolTwoQ``, ``KvpoolARC``, ``KvpoolLRU`` and ``KvpoolPriorityS3FIFO``
(per-request retention priority from ``kv_transfer_params``)
(:mod:`~kvpool.integrations.vllm.policies`) are vLLM ``CachePolicy`` classes for its CPU tier
(``"eviction_policy": "KvpoolS3FIFO", "cache_policy_module_path":
"kvpool.integrations.vllm"``).

Importing this package does not import vLLM: the classes above are loaded on first access
(vLLM's factories do ``getattr(module, name)``), and raise
:class:`~kvpool.integrations.IntegrationUnavailableError` when vLLM 0.33 is not installed.
:class:`KvpoolTierConfig` (the tier's settings) needs no vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpool.integrations.vllm.config import KvpoolTierConfig

__all__ = ["KvpoolARC", "KvpoolLRU", "KvpoolPriorityS3FIFO", "KvpoolS3FIFO", "KvpoolTier",
           "KvpoolTierConfig", "KvpoolTwoQ"]

_LAZY = {
    "KvpoolTier": "tier",
    "KvpoolARC": "policies",
    "KvpoolLRU": "policies",
    "KvpoolPriorityS3FIFO": "policies",
    "KvpoolS3FIFO": "policies",
    "KvpoolTwoQ": "policies",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
