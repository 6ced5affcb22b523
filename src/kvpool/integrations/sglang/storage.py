""":class:`KvpoolHiCacheStorage`: an SGLang HiCache L3 storage backend on kvpool's persistent
disk tier (:mod:`~kvpool.integrations.sglang.pagedisk`) and shared remote tier
(:mod:`~kvpool.integrations.sglang.pageremote`), either or both (disk in front of remote).

SGLang builds it through its dynamic backend loader (``--hicache-storage-backend dynamic`` and
``"module_path": "kvpool.integrations.sglang", "class_name": "KvpoolHiCacheStorage"`` in
``--hicache-storage-backend-extra-config``) as ``KvpoolHiCacheStorage(storage_config,
kwargs)``; the options are checked there (:class:`~kvpool.integrations.sglang.options.
StorageOptions`). The tiers open when SGLang registers its host pool
(``register_mem_pool_host``): their page geometry and namespace come from the pool.

What SGLang's ``HiCacheController`` calls, and what it gets:

- ``batch_exists(keys)``: how many of ``keys``, from the first, the tiers hold (the disk
  index, then one ``EXISTS`` round trip for the rest);
- ``batch_get_v1(keys, host_indices)`` / ``batch_set_v1`` (``"interface_v1": 1``): pages read
  into and written from the host pool's memory directly, a flag per page; disk first, the
  remote tier for the pages the disk does not hold (copied into the disk tier when
  ``promote_remote_hits``); a store succeeds when one tier took the page;
- without ``interface_v1``: ``batch_get(keys, flat_pages)`` / ``batch_set(keys, flat_pages)``
  on SGLang's flat page tensors, same bytes;
- ``get``/``set``/``exists``, ``clear`` (the disk tier; a shared remote tier is left to its
  other users), ``get_stats`` (SGLang's ``StorageMetrics`` when storage metrics are on);
  :meth:`KvpoolHiCacheStorage.stats` has kvpool's own counters.

Failures never raise into SGLang's I/O threads: a page that cannot be read (missing, damaged,
server down) is a ``False``, one that cannot be stored is a ``False``, and the storage keeps
serving what it can.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import ConfigError, StorageError
from kvpool.integrations.sglang.hostpages import HostPages, page_keys, page_namespace
from kvpool.integrations.sglang.options import SGLangUnavailableError, StorageOptions
from kvpool.integrations.sglang.pagedisk import PageDisk
from kvpool.integrations.sglang.pageremote import PageRemote

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as exc:  # pragma: no cover - exercised in a process without sglang
    raise SGLangUnavailableError(
        "kvpool.integrations.sglang needs SGLang (pip install sglang==0.5.23); "
        f"importing it failed: {exc}") from exc

__all__ = ["KvpoolHiCacheStorage"]

logger = logging.getLogger(__name__)
Runs = list[memoryview]


class _Metrics:
    """Per-call samples for SGLang's ``StorageMetrics`` (pages and GB/s of each batch)."""

    def __init__(self, page_bytes: int) -> None:
        self.page_gb = page_bytes / 1e9
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def add(self, pages: list[int], bandwidth: list[float], n: int, start: float) -> None:
        pages.append(n)
        bandwidth.append(n * self.page_gb / max(time.perf_counter() - start, 1e-9))


class KvpoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` on kvpool's tiers (module docstring)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.options = StorageOptions.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self._lock = threading.Lock()
        self.pages: HostPages | None = None
        self.disk: PageDisk | None = None
        self.remote: PageRemote | None = None
        self.namespace_description = ""
        self._metrics: _Metrics | None = None
        host = (kwargs or {}).get("mem_pool_host")
        if host is not None:
            self.register_mem_pool_host(host)

    # ------------------------------------------------------------------ setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tiers for ``mem_pool_host``'s pages (closing those of a previous pool)."""
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            self._close_tiers()
            self._open(HostPages(mem_pool_host))

    def _open(self, pages: HostPages) -> None:
        opts, cfg = self.options, self.storage_config
        ns = page_namespace(cfg, pages, model=cfg.model_name or "", extra=opts.namespace)
        disk = remote = None
        try:
            if opts.disk_path is not None and opts.disk_bytes is not None:
                n = opts.disk_bytes // pages.page_bytes
                if n < 1:
                    raise ConfigError(f"disk_bytes={opts.disk_bytes} holds no page of "
                                      f"{pages.page_bytes} bytes")
                name = (f"sglang-{ns.digest.hex()}-dp{getattr(cfg, 'dp_rank', 0)}"
                        f"-tp{cfg.tp_rank}")
                disk = PageDisk(os.path.join(opts.disk_path, name), ns, pages=n,
                                segments=pages.segments, run_bytes=pages.run_bytes,
                                policy=opts.eviction_policy,
                                sync_interval_s=opts.disk_sync_interval_s,
                                on_damage=opts.disk_manifest_damaged)
            if opts.remote_url is not None:
                remote = PageRemote(opts.remote_url, ns.scope(), page_bytes=pages.page_bytes,
                                    timeout_s=opts.remote_timeout_s,
                                    backoff_s=opts.remote_backoff_s)
        except BaseException:
            if disk is not None:
                disk.close()
            raise
        self.pages, self.disk, self.remote = pages, disk, remote
        self.namespace_description = ns.description.decode()
        self._metrics = _Metrics(pages.page_bytes)
        logger.info("kvpool HiCache storage: %d-byte pages, disk %s, remote %s",
                    pages.page_bytes, disk.directory if disk else None,
                    remote.store.url if remote else None)

    def _close_tiers(self) -> None:
        disk, remote = self.disk, self.remote
        self.disk = self.remote = None
        if disk is not None:
            disk.close()
        if remote is not None:
            remote.close()

    def close(self) -> None:
        """Flush and close both tiers (a later ``register_mem_pool_host`` opens them again)."""
        with self._lock:
            self._close_tiers()

    # ------------------------------------------------------------------ core

    def _lookup(self, keys: Sequence[str]) -> int:
        ks = page_keys(keys)
        with self._lock:
            n = self.disk.prefix(ks) if self.disk is not None else 0
        remote = self.remote
        if n < len(ks) and remote is not None:
            n += remote.prefix(ks[n:])
        return n

    def _read(self, keys: Sequence[str], runs: Sequence[Runs]) -> list[bool]:
        ks = page_keys(keys)
        ok = [False] * len(ks)
        with self._lock:
            disk = self.disk
            if disk is not None:
                ok = [disk.read(k, r) for k, r in zip(ks, runs, strict=True)]
        remote = self.remote
        missing = [i for i, hit in enumerate(ok) if not hit]
        if missing and remote is not None:
            got = remote.read_many([ks[i] for i in missing], [runs[i] for i in missing])
            fetched = [i for i, hit in zip(missing, got, strict=True) if hit]
            for i in fetched:
                ok[i] = True
            if fetched and self.options.promote_remote_hits:
                with self._lock:
                    if self.disk is not None:
                        self.disk.write_many([(ks[i], runs[i]) for i in fetched])
        return ok

    def _write(self, keys: Sequence[str], runs: Sequence[Runs]) -> list[bool]:
        items = list(zip(page_keys(keys), runs, strict=True))
        ok = [False] * len(items)
        with self._lock:
            if self.disk is not None:
                ok = self.disk.write_many(items)
        remote = self.remote
        if remote is not None:
            ok = [a or b for a, b in zip(ok, remote.write_many(items), strict=True)]
        return ok

    def _host_runs(self, keys: Sequence[str], host_indices: Any) -> list[Runs] | None:
        pages = self.pages
        if pages is None:
            logger.warning("kvpool HiCache storage: no host pool registered yet")
            return None
        try:
            return pages.runs(host_indices, len(keys))
        except StorageError as exc:
            logger.error("kvpool HiCache storage: %s", exc)
            return None

    # ------------------------------------------------------------------ SGLang's calls

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the tiers hold."""
        return self._lookup(keys) if keys and self.pages is not None else 0

    def exists(self, key: str) -> bool:
        """Whether the tiers hold page ``key``."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Read the pages into the host pool at ``host_indices`` (``page_size`` per key)."""
        return self._zero_copy(keys, host_indices, self._read, "prefetch")

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Store the pages the host pool holds at ``host_indices``."""
        return self._zero_copy(keys, host_indices, self._write, "backup")

    def _zero_copy(self, keys: list[str], host_indices: Any,
                   op: Callable[[Sequence[str], Sequence[Runs]], list[bool]],
                   kind: str) -> list[bool]:
        """``op`` on the host pool's pages at ``host_indices``, sampled for SGLang's
        ``StorageMetrics`` as ``kind`` (prefetch or backup)."""
        start = time.perf_counter()
        runs = self._host_runs(keys, host_indices)
        if runs is None:
            return [False] * len(keys)
        ok = op(keys, runs)
        m = self._metrics
        if m is not None and self.storage_config.enable_storage_metrics:
            m.add(getattr(m, f"{kind}_pgs"), getattr(m, f"{kind}_bandwidth"), sum(ok), start)
        return ok

    def _flat_runs(self, values: Sequence[Any]) -> list[Runs] | None:
        pages = self.pages
        if pages is None:
            return None
        try:
            return [pages.split(v) for v in values]
        except StorageError as exc:
            logger.error("kvpool HiCache storage: %s", exc)
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read each page into its flat page tensor; the tensor, or None for a miss."""
        pages = self.pages
        if pages is None or not keys:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else \
            [pages.pool.get_dummy_flat_data_page() for _ in keys]
        runs = self._flat_runs(targets)
        if runs is None:
            return [None] * len(keys)
        ok = self._read(keys, runs)
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Page ``key`` read into ``target_location`` (a flat page tensor), or None."""
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page tensor of ``values``; whether all were stored."""
        if not keys:
            return True
        runs = self._flat_runs(list(values or []))
        if runs is None or len(runs) != len(keys):
            return False
        return all(self._write(keys, runs))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one flat page tensor."""
        return self.batch_set([key], [value])

    def clear(self) -> bool:
        """Forget every page of the disk tier (a shared remote tier keeps its pages)."""
        with self._lock:
            if self.disk is not None:
                self.disk.clear()
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last one (None when storage
        metrics are off)."""
        m = self._metrics
        if m is None or not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            samples = getattr(m, name)
            getattr(out, name).extend(samples)
            samples.clear()
        return out

    def stats(self) -> dict[str, Any]:
        """kvpool's counters: per tier, hits, misses, damaged or rejected pages, writes,
        evictions, failures, and what a restart found."""
        with self._lock:
            disk = self.disk.stats() if self.disk is not None else None
        remote = self.remote.stats() if self.remote is not None else None
        return {"namespace": self.namespace_description, "disk": disk, "remote": remote}
