"""What a ``KvpoolTier`` reports to vLLM's metrics (Prometheus ``/metrics`` and the stats log).

vLLM asks each tier for its metric definitions once (``build_metric_definitions``) and for its
observations every step (``get_stats``); the counters below count since the previous call.

==================================  =======  ==========  =======================================
name                                kind     label       what
==================================  =======  ==========  =======================================
kvpool:vllm_tier_lookups            counter  result      lookups answered hit / miss / retry
kvpool:vllm_tier_stored_chunks      counter  backend     chunks written to disk / remote
kvpool:vllm_tier_loaded_chunks      counter              chunks loaded into vLLM's CPU pool
kvpool:vllm_tier_failed_chunks      counter  reason      chunks a job could not store or load
                                                         (:mod:`~kvpool.integrations.vllm.jobs`)
kvpool:vllm_tier_evicted_chunks     counter              disk chunks evicted to make room
kvpool:vllm_tier_disk_usage_perc    gauge                share of the disk tier's slots in use
==================================  =======  ==========  =======================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["DISK_USAGE", "EVICTED", "FAILED", "LOADED", "LOOKUPS", "STORED", "TierCounters",
           "metric_definitions"]

LOOKUPS: Final = "kvpool:vllm_tier_lookups"
STORED: Final = "kvpool:vllm_tier_stored_chunks"
LOADED: Final = "kvpool:vllm_tier_loaded_chunks"
FAILED: Final = "kvpool:vllm_tier_failed_chunks"
EVICTED: Final = "kvpool:vllm_tier_evicted_chunks"
DISK_USAGE: Final = "kvpool:vllm_tier_disk_usage_perc"


def metric_definitions() -> dict[str, Any]:
    """vLLM's metadata of every metric above (needs vLLM)."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    return {
        LOOKUPS: OffloadingCounterMetadata("KvpoolTier lookups by result (hit, miss, retry)",
                                           ("result",)),
        STORED: OffloadingCounterMetadata("Chunks KvpoolTier wrote, by backend (disk, remote)",
                                          ("backend",)),
        LOADED: OffloadingCounterMetadata("Chunks KvpoolTier loaded into the CPU pool"),
        FAILED: OffloadingCounterMetadata(
            "Chunks a KvpoolTier job could not store or load, by reason", ("reason",)),
        EVICTED: OffloadingCounterMetadata("Disk chunks KvpoolTier evicted to make room"),
        DISK_USAGE: OffloadingGaugeMetadata("Share of KvpoolTier's disk slots in use"),
    }


@dataclass(slots=True)
class TierCounters:
    """Counts since the last :meth:`take` (scheduler thread only)."""

    lookups: Counter[str] = field(default_factory=Counter)
    stored: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    loaded: int = 0
    evicted: int = 0

    def take(self, disk_usage: float | None) -> Any:
        """An ``OffloadingConnectorStats`` of the counts (then reset to zero)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, counts in ((LOOKUPS, self.lookups), (STORED, self.stored),
                             (FAILED, self.failures)):
            for label, n in counts.items():
                stats.increase_counter(name, n, (label,))
        if self.loaded:
            stats.increase_counter(LOADED, self.loaded)
        if self.evicted:
            stats.increase_counter(EVICTED, self.evicted)
        if disk_usage is not None:
            stats.set_gauge(DISK_USAGE, disk_usage)
        self.lookups.clear()
        self.stored.clear()
        self.failures.clear()
        self.loaded = self.evicted = 0
        return stats
