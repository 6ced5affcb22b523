"""The KV-aware router (ARCHITECTURE §5): which worker caches what, and where to send a request.

* :class:`KvIndex` (``index``): per-worker, per-tier, reference-counted block hashes, fed with
  :class:`~kvpool.events.model.KVCacheEvent` objects.
* :class:`Router` (``scoring``): hashes a request once per hashing group, walks the index and
  chooses a worker (``cost`` or ``trtllm`` mode); returns a :class:`RouteDecision`.
* :class:`Ingest` (``ingest``): ZMQ readers (vLLM format, ``zmq_reader``; snapshots for kvpool
  workers), TensorRT-LLM HTTP pollers and in-process feeds; worker health states.
* :class:`RouterService` (``service``): the HTTP API, configured by :func:`load_config`, with
  its Prometheus metrics (``metrics``).
"""

from kvpool.router.config import ServiceConfig, WorkerConfig, load_config, parse_config
from kvpool.router.index import KvIndex, WorkerInfo, normalize_hash
from kvpool.router.ingest import Ingest
from kvpool.router.scoring import CandidateScore, RouteDecision, RouteMode, Router
from kvpool.router.service import RouterService, serve

__all__ = [
    "CandidateScore",
    "Ingest",
    "KvIndex",
    "RouteDecision",
    "RouteMode",
    "Router",
    "RouterService",
    "ServiceConfig",
    "WorkerConfig",
    "WorkerInfo",
    "load_config",
    "normalize_hash",
    "parse_config",
    "serve",
]
