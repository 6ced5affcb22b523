"""``KvpoolTier``: a vLLM 0.33 secondary offloading tier on kvpool's persistent disk tier
(:mod:`~kvpool.integrations.vllm.disk`) and/or a shared Redis/Valkey store
(:mod:`~kvpool.integrations.vllm.remote`).

vLLM builds it from a ``secondary_tiers`` entry (``"type": "KvpoolTier", "module_path":
"kvpool.integrations.vllm"`` plus :class:`~kvpool.integrations.vllm.config.KvpoolTierConfig`'s
keys) with ``SecondaryTierFactory.create_secondary_tier``; ``offloading_spec=None`` builds one
standalone (``model`` then names the namespace).

Contract with vLLM (``vllm/v1/kv_offload/tiering/base.py``), and how it is kept:

- Every method runs on the scheduler side under vLLM's manager lock and returns at once: it
  checks the job and queues it. ``io_threads`` worker threads do the rest (the disk tier's
  slot reservation and eviction, byte copies from and into the primary pool, hashing, disk
  and network I/O, the index updates after them: :mod:`~kvpool.integrations.vllm.jobs`), and
  remote lookups run on a prober thread (:mod:`~kvpool.integrations.vllm.probe`).
- ``lookup``: HIT when the disk index holds the key or the remote store is known to; otherwise,
  with a remote store, the key is probed in the background and the answer is RETRY until the
  probe returns (then HIT or MISS). A store in flight is a MISS (vLLM's primary tier still
  holds the chunk).
- ``submit_store`` copies the primary pool's chunks to disk (slots reserved by the job's
  worker, the eviction policy making room among unpinned blocks; a lookup between submit and
  reservation may still see a block the job then evicts: its load fails that key, and vLLM
  recomputes it) and to the remote store (keys it already holds are skipped);
  ``submit_load`` pins the keys' disk copies (a counter each) and copies verified bytes into
  the primary pool's chunks, disk first, the remote store for the rest.
  ``get_finished_jobs`` reports each job once; a load that got only some keys reports
  ``successful_keys``. A key whose bytes fail their check is never reported loaded, so vLLM
  never reads wrong bytes: it frees that chunk and recomputes.
- ``drain_jobs`` waits for every job; ``shutdown`` drains, then syncs the disk tier.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

from kvpool.integrations.vllm._vllm import import_failed
from kvpool.integrations.vllm.config import KvpoolTierConfig
from kvpool.integrations.vllm.disk import DiskChunks
from kvpool.integrations.vllm.jobs import LoadDone, StoreDone, run_load, run_store
from kvpool.integrations.vllm.metrics import TierCounters, metric_definitions
from kvpool.integrations.vllm.namespace import tier_namespace
from kvpool.integrations.vllm.probe import ProbeDone, Prober
from kvpool.integrations.vllm.remote import RemoteChunks
from kvpool.integrations.vllm.workers import Workers
from kvpool.tiers.remote.store import RemoteStore

try:
    from vllm.v1.kv_offload.base import (
        ConfigInfoMapping,
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as exc:  # vLLM there (checked above) but incomplete
    raise import_failed(exc) from exc

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvpoolTier"]

_CONFIG_INFO_KEYS: Final = ("kvpool_disk_bytes", "kvpool_remote", "kvpool_eviction_policy",
                            "kvpool_namespace")


@dataclass(slots=True)
class _Probe:
    """A remote lookup: its answer (None while in flight) and the requests that asked."""

    present: bool | None = None
    requests: set[str] = field(default_factory=set)


class KvpoolTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier on kvpool's disk tier and/or remote store (module doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str = "KvpoolTier",
                 backpressure_detector: BackpressureDetector | None = None,
                 **config: Any) -> None:
        settings = KvpoolTierConfig.from_mapping(config)  # a bad key stops vLLM here
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = settings
        chunk = self.block_size_bytes
        self._flat = primary_kv_view.cast("B")  # byte offsets, whatever vLLM's view's shape
        self._num_chunks = self._flat.nbytes // chunk
        self.namespace = tier_namespace(offloading_spec, settings, chunk)
        self.disk = self._open_disk(settings, chunk)
        try:
            self.remote = self._open_remote(settings)
        except BaseException:
            if self.disk is not None:
                self.disk.close()
            raise
        self.locality = Locality(settings.locality or ("LOCAL" if self.disk else "REMOTE"))
        events_on = settings.enable_kv_events and (
            offloading_spec is None or offloading_spec.kv_events_config.enable_kv_cache_events)
        self._events: list[OffloadingEvent] | None = [] if events_on else None
        self._done: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._io = Workers(settings.io_threads, "kvpool-vllm-tier")
        self._jobs: set[int] = set()  # submitted, result not taken yet
        self._finished: list[StoreDone | LoadDone] = []
        self._probes: dict[bytes, _Probe] = {}
        self._req_probes: dict[str, list[bytes]] = {}
        self._prober = (Prober(self.remote.exists, self._done.put)
                        if self.remote is not None else None)
        self.counters = TierCounters()
        self._closed = False

    def _open_disk(self, settings: KvpoolTierConfig, chunk: int) -> DiskChunks | None:
        if settings.disk_path is None:
            return None
        assert settings.disk_bytes is not None
        return DiskChunks(settings.disk_path, settings.disk_bytes, chunk, self.namespace,
                          eviction_policy=settings.eviction_policy,
                          on_damage=settings.disk_manifest_damaged,
                          sync_interval_s=settings.disk_sync_interval_s)

    def _open_remote(self, settings: KvpoolTierConfig) -> RemoteChunks | None:
        if settings.remote_url is None:
            return None
        store = RemoteStore(settings.remote_url, batch_bytes=settings.remote_batch_bytes,
                            timeout_s=settings.remote_timeout_s,
                            backoff_s=settings.remote_backoff_s,
                            backoff_max_s=settings.remote_backoff_max_s)
        return RemoteChunks(store, self.namespace, known_max=settings.remote_known_max)

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._prober is not None:
            self._take_done()
        counters = self.counters.lookups
        if self.disk is not None and key in self.disk:
            counters["hit"] += 1
            return LookupResult.HIT
        remote = self.remote
        if remote is None:
            counters["miss"] += 1
            return LookupResult.MISS
        if remote.is_known(key):
            counters["hit"] += 1
            return LookupResult.HIT
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = _Probe()
            assert self._prober is not None
            self._prober.submit(key)
        if req_context.req_id not in probe.requests:
            probe.requests.add(req_context.req_id)
            self._req_probes.setdefault(req_context.req_id, []).append(key)
        if probe.present is None:
            counters["retry"] += 1
            return LookupResult.RETRY
        counters["miss"] += 1
        return LookupResult.MISS

    def _take_done(self) -> None:
        """Apply the probe answers that arrived; keep finished jobs for get_finished_jobs."""
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return
            if isinstance(done, ProbeDone):
                self._apply_probe(done)
            else:
                assert isinstance(done, StoreDone | LoadDone)
                self._finished.append(done)

    def _apply_probe(self, done: ProbeDone) -> None:
        assert self.remote is not None
        if not done.ok:
            self.counters.failures["remote_error"] += len(done.keys)
            self.remote.forget_all()
        self.remote.remember([k for k, p in zip(done.keys, done.present, strict=True) if p])
        for key, present in zip(done.keys, done.present, strict=True):
            probe = self._probes.get(key)
            if probe is None:
                continue
            if present or not probe.requests:
                del self._probes[key]
            else:
                probe.present = False

    # ------------------------------------------------------------------ jobs

    def _chunk(self, chunk_id: int) -> memoryview:
        size = self._block_size_bytes
        return self._flat[chunk_id * size:(chunk_id + 1) * size]

    def _chunk_ids(self, job: TransferJob, done: StoreDone | LoadDone) -> list[int] | None:
        """The job's chunk ids; None (the job failed, its result posted) when they do not
        match its keys or the pool, which vLLM never sends."""
        ids: list[int] = job.chunk_ids.tolist()
        if len(ids) == len(job.keys) and (not ids or (
                min(ids) >= 0 and max(ids) < self._num_chunks)):
            return ids
        done.failures["internal"] += len(job.keys)
        self._jobs.add(done.job_id)
        self._done.put(done)
        return None

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        done = StoreDone(job_metadata.job_id, keys)
        ids = self._chunk_ids(job_metadata, done)
        if ids is None:
            return
        remote = self.remote
        remote_keys = ([k for k in dict.fromkeys(keys) if not remote.is_known(k)]
                       if remote is not None else [])
        self._submit(done.job_id, run_store, done, self.disk, ids, remote, remote_keys,
                     self._chunk, self._done.put)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        done = LoadDone(job_metadata.job_id, keys)
        ids = self._chunk_ids(job_metadata, done)
        if ids is None:
            return
        disk = self.disk
        if disk is not None:
            on_disk = disk.pin_many(keys)
            done.pinned = [k for k, found in zip(keys, on_disk, strict=True) if found is not None]
        else:
            on_disk = [None] * len(keys)
        self._submit(done.job_id, run_load, done, ids, on_disk, self._chunk, disk, self.remote,
                     self._done.put)

    def _submit(self, job_id: int, task: Any, *args: Any) -> None:
        self._jobs.add(job_id)
        self._io.submit(task, *args)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_done()
        finished, self._finished = self._finished, []
        results = []
        for done in finished:
            self._jobs.discard(done.job_id)
            if isinstance(done, StoreDone):
                results.append(self._finish_store(done))
            else:
                results.append(self._finish_load(done))
        return results

    def _finish_store(self, done: StoreDone) -> JobResult:
        disk, remote, counters = self.disk, self.remote, self.counters
        if done.evicted:
            counters.evicted += len(done.evicted)
            self._event(done.evicted, removed=True, locality=Locality.LOCAL)
        if disk is not None:
            counters.stored["disk"] += len(done.written)
            self._event([k for k, _, _ in done.written], removed=False,
                        locality=Locality.LOCAL)
        if remote is not None:
            if done.failures["remote_error"]:
                remote.forget_all()
            remote.remember(done.remote_stored)
            counters.stored["remote"] += len(done.remote_stored)
            self._event(done.remote_stored, removed=False, locality=Locality.REMOTE)
        counters.failures.update(done.failures)
        return JobResult(job_id=done.job_id, success=all(map(self._holds, done.keys)),
                         transfer_time=done.seconds, transfer_bytes=done.nbytes)

    def _holds(self, key: bytes) -> bool:
        """Whether the tier has ``key`` (or a store of it in flight) on disk or remotely."""
        disk, remote = self.disk, self.remote
        return ((disk is not None and (key in disk or disk.is_pending(key)))
                or (remote is not None and remote.is_known(key)))

    def _finish_load(self, done: LoadDone) -> JobResult:
        counters = self.counters
        self._event(done.forgotten, removed=True, locality=Locality.LOCAL)
        if self.remote is not None:
            if done.failures["remote_error"]:
                self.remote.forget_all()
            self.remote.forget(done.remote_missing)
        counters.loaded += len(done.loaded)
        counters.failures.update(done.failures)
        ok = len(done.loaded) == len(done.keys)
        partial = tuple(done.loaded) if not ok and done.loaded else None
        return JobResult(job_id=done.job_id, success=ok, successful_keys=partial,
                         transfer_time=done.seconds, transfer_bytes=done.nbytes)

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._prober is not None and self._prober.in_flight)

    def drain_jobs(self) -> None:
        self._io.wait_idle()

    # ------------------------------------------------------------------ requests, events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        for key in self._req_probes.pop(req_context.req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.requests.discard(req_context.req_id)
            if not probe.requests and probe.present is not None:
                del self._probes[key]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.disk is not None and keys:
            self._io.submit(self.disk.touch, list(keys))  # index work: off this thread

    def _event(self, keys: list[bytes], *, removed: bool, locality: Locality) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium,
                                                removed=removed, locality=locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ metrics, shutdown

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def get_stats(self) -> Any:
        disk = self.disk
        usage = disk.used_slots / disk.slots if disk is not None else None
        return self.counters.take(usage)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _CONFIG_INFO_KEYS

    def config_info(self) -> ConfigInfoMapping:
        s = self.settings
        return dict(zip(_CONFIG_INFO_KEYS, (s.disk_bytes or 0, s.remote_url is not None,
                                             s.eviction_policy, s.namespace), strict=True))

    def shutdown(self) -> None:
        """Wait for the jobs in flight, stop the threads, sync and close the disk tier and the
        remote connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._io.close()
        if self._prober is not None:
            self._prober.close()
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
        with contextlib.suppress(BufferError):  # vLLM may unmap its pool once tiers are shut
            self._flat.release()
