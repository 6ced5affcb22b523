"""The router service's ``/metrics``: its counters as Prometheus metrics (``prometheus_client``).

Each service has its own :class:`~prometheus_client.CollectorRegistry` holding one collector
that reads the router's, index's and ingest's counters when scraped (they stay plain ints on
the hot paths; nothing is counted twice). Totals are counters (``_total``), per-worker values
are labelled by ``worker``; the decision latency is a histogram. The text is Prometheus's
exposition format 0.0.4, written by ``prometheus_client.generate_latest``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpool.router.index import TIERS, KvIndex
from kvpool.router.ingest import WORKER_STATES, Ingest
from kvpool.router.scoring import LATENCY_BUCKETS_S, Router

__all__ = ["CONTENT_TYPE", "DROP_REASONS", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOTALS: Final[tuple[tuple[str, str, str, str], ...]] = (
    # name after kvpool_router_, help, whose counters (router, index, ingest), attribute
    ("prompt_tokens", "Prompt tokens routed.", "router", "prompt_tokens"),
    ("matched_tokens", "Prompt tokens found cached on the chosen worker.", "router",
     "matched_tokens"),
    ("shared_hit_blocks", "Blocks credited from a shared remote tier (shared_tier).",
     "router", "shared_hit_blocks"),
    ("requests_finished", "Requests reported finished.", "router", "finished_total"),
    ("requests_expired", "Requests dropped after request_timeout_s without a finish.", "router",
     "expired_total"),
    ("events_applied", "KV events applied to the index.", "index", "events_applied"),
    ("events_malformed", "KV events or payloads that could not be applied (skipped).", "index",
     "events_malformed"),
    ("event_anomalies", "Events about blocks the index did not hold (late, reordered or lost).",
     "index", "anomalies"),
    ("blocks_stored", "Blocks stored, all workers.", "index", "blocks_stored"),
    ("blocks_removed", "Blocks removed, all workers.", "index", "blocks_removed"),
    ("event_batches", "Event batches received.", "ingest", "batches"),
    ("decode_errors", "Payloads that could not be decoded (skipped).", "ingest", "decode_errors"),
    ("sequence_gaps", "Sequence gaps seen on ZMQ streams.", "ingest", "gaps"),
    ("replayed_batches", "Batches recovered through replay sockets.", "ingest", "replayed"),
    ("missed_batches", "Batches lost (not replayable).", "ingest", "missed"),
    ("snapshots", "Workers bootstrapped from a snapshot.", "ingest", "snapshots"),
    ("publisher_restarts", "Publisher or engine restarts detected (the worker was reset).",
     "ingest", "restarts"),
    ("poll_errors", "Failed TensorRT-LLM event polls.", "ingest", "poll_errors"),
    ("probe_failures", "Failed liveness probes.", "ingest", "probe_failures"),
    ("transport_restarts", "Event readers or pollers restarted after an unexpected failure.",
     "ingest", "transport_restarts"),
    ("malformed_frames", "ZMQ messages dropped: frames not [topic, 8-byte seq, payload].",
     "ingest", "malformed_frames"),
    ("absurd_seqs", "ZMQ messages held as suspect for an absurd sequence number.", "ingest",
     "absurd_seqs"),
    ("stale_batches", "ZMQ batches dropped: seq went back without a restart (duplicate, late).",
     "ingest", "stale_batches"),
    ("block_size_refused", "Batches refused for a stored chain of another block size.",
     "ingest", "block_size_refused"),
)
"""The plain totals after ``routes`` and ``hit_blocks``, in exposition order."""

_WORKER_GAUGES: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    ("healthy", "1 while the worker may be routed to.", ("worker",)),
    ("state", "1 for the worker's health state (unknown, healthy, degraded, unhealthy).",
     ("worker", "state")),
    ("blocks", "Blocks the index holds per worker, tier.", ("worker", "tier")),
    ("active_requests", "Routed, unfinished requests.", ("worker",)),
)
"""The per-worker gauges (name after kvpool_router_worker_, help, labels), in order."""

DROP_REASONS: Final = (
    ("undecodable", "decode_errors"),
    ("malformed_frame", "malformed_frames"),
    ("absurd_seq", "absurd_seqs"),
    ("stale_seq", "stale_batches"),
    ("block_size", "block_size_refused"),
)
"""``kvpool_router_worker_dropped``'s reasons and the :class:`TransportStatus` counter of each."""


class RouterMetrics(Collector):
    """The metrics of one router service, in a registry of their own."""

    def __init__(self, router: Router, index: KvIndex, ingest: Ingest) -> None:
        self.router = router
        self.index = index
        self.ingest = ingest
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def text(self) -> bytes:
        """The exposition of every metric, as ``GET /metrics`` returns it."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        st = self.router.stats
        yield CounterMetricFamily(
            "kvpool_router_routes", "Routing decisions made.", value=st.routes_total
        )
        hits = CounterMetricFamily(
            "kvpool_router_hit_blocks",
            "Prefix blocks matched on the chosen worker, by tier (0 GPU, 1 host, 2 disk).",
            labels=["tier"],
        )
        for t in range(TIERS):
            hits.add_metric([str(t)], st.hit_blocks[t])
        yield hits
        sources = {"router": st, "index": self.index.counters, "ingest": self.ingest.counters}
        for name, help_, source, attr in _TOTALS:
            value = getattr(sources[source], attr)
            yield CounterMetricFamily(f"kvpool_router_{name}", help_, value=value)
        yield self._latency()
        yield from self._per_worker()

    def _latency(self) -> HistogramMetricFamily:
        st = self.router.stats
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS_S, st.latency_buckets, strict=False):
            cumulative += count
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", sum(st.latency_buckets)))
        return HistogramMetricFamily(
            "kvpool_router_decision_latency_seconds", "Time to make one routing decision.",
            buckets=buckets, sum_value=st.latency_sum_s,
        )

    def _per_worker(self) -> Iterator[Metric]:
        infos = self.index.workers()
        routable, state, blocks, active = (
            GaugeMetricFamily(f"kvpool_router_worker_{name}", help_, labels=labels)
            for name, help_, labels in _WORKER_GAUGES
        )
        errors = CounterMetricFamily(
            "kvpool_router_worker_decode_errors",
            "Payloads of the worker that could not be decoded (skipped).", labels=["worker"])
        dropped = CounterMetricFamily(
            "kvpool_router_worker_dropped",
            "Messages or batches of the worker dropped, by reason (undecodable, "
            "malformed_frame, absurd_seq, stale_seq, block_size).", labels=["worker", "reason"])
        for info in infos:
            wid = info.worker_id
            status = self.ingest.status(wid)
            routable.add_metric([wid], int(info.healthy))
            for name in WORKER_STATES:
                state.add_metric([wid, name], int(status.state == name))
            for t in range(TIERS):
                blocks.add_metric([wid, str(t)], info.blocks_per_tier[t])
            active.add_metric([wid], self.router.active_requests(wid))
            errors.add_metric([wid], status.decode_errors)
            for reason, attr in DROP_REASONS:
                dropped.add_metric([wid, reason], getattr(status, attr))
        yield from (routable, state, blocks, active, errors, dropped)
