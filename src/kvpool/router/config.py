"""The router service's configuration (``kvpool router --config router.yaml``).

Shape (every key optional unless marked)::

    listen: {host: 127.0.0.1, port: 8000}          # port 0: any free port
    router:                                       # Router options (kvpool.router.scoring)
      mode: cost                                  # cost | trtllm | approx
      tier_weights: [1.0, 0.9, 0.4]
      load_weight: 0.25
      temperature: 0.0
      prediction_ttl_s: 2.0                       # default: 2.0 in cost mode, 0 in trtllm mode
      max_batch_size: 64
      request_timeout_s: 600
      seed: 0
    ingest:
      poll_interval_s: 0.5                        # TensorRT-LLM event polling
      http_timeout_s: 2.0
      health_interval_s: 2.0                      # liveness probes of ZMQ workers
    proxy: false                                  # forward /v1/completions, /v1/chat/completions
    workers:                                      # required, at least one
      - id: w0                                    # required, unique
        kind: vllm                                # required: vllm | trtllm | kvpool
        zmq_endpoint: tcp://127.0.0.1:5557        # vllm: required; kvpool: optional
        replay_endpoint: tcp://127.0.0.1:5558
        topic: ""
        http_base_url: http://127.0.0.1:8001      # trtllm: required; others: health + proxy
        tokens_per_block: 16                      # learned from events when left out
        hash_algo: vllm_sha256_cbor               # see below
        match_by_tokens: false                    # key blocks by their token ids instead
        approx_blocks: null                       # [gpu, host, disk] blocks: no events, the
                                                  # router predicts the cache (approx mode)

``hash_algo`` defaults: ``vllm_sha256_cbor`` for vLLM workers (unless ``match_by_tokens``);
for TensorRT-LLM workers what ``/server_info`` advertises, else each event's field; kvpool
workers that publish over ZMQ must name it (msgpack events do not carry it), in-process ones
learn it from their events.

Every error is a :class:`~kvpool.errors.ConfigError` naming the offending key, e.g.
``workers[1].kind``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from kvpool.errors import ConfigError, UnknownHashAlgorithmError
from kvpool.hashing import hash_algo as parse_hash_algo
from kvpool.router.scoring import DEFAULT_LOAD_WEIGHT, DEFAULT_TIER_WEIGHTS

__all__ = [
    "IngestOptions",
    "RouterOptions",
    "ServiceConfig",
    "WorkerConfig",
    "WorkerKind",
    "load_config",
    "parse_config",
]


class WorkerKind(StrEnum):
    VLLM = "vllm"
    TRTLLM = "trtllm"
    KVPOOL = "kvpool"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One engine the router routes to and listens to."""

    id: str
    kind: WorkerKind
    zmq_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    http_base_url: str | None = None
    tokens_per_block: int | None = None
    hash_algo: str | None = None
    match_by_tokens: bool = False
    approx_blocks: tuple[int, ...] | None = None
    """The worker publishes no KV events: the router predicts its cache from what it routed
    there, with this many blocks per tier (GPU[, host[, disk]]), see
    :meth:`kvpool.router.scoring.Router.predict_cache`."""


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """Keyword arguments of :class:`kvpool.router.scoring.Router`."""

    mode: str = "cost"
    tier_weights: tuple[float, float, float] = DEFAULT_TIER_WEIGHTS
    load_weight: float = DEFAULT_LOAD_WEIGHT
    temperature: float = 0.0
    prediction_ttl_s: float | None = None
    max_batch_size: int = 64
    request_timeout_s: float = 600.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class IngestOptions:
    poll_interval_s: float = 0.5
    http_timeout_s: float = 2.0
    health_interval_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    workers: tuple[WorkerConfig, ...]
    router: RouterOptions = field(default_factory=RouterOptions)
    ingest: IngestOptions = field(default_factory=IngestOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    proxy: bool = False


def load_config(path: str | Path) -> ServiceConfig:
    """Read and validate a YAML configuration file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read router config {str(p)!r}: {exc.strerror}") from None
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(obj)


def parse_config(obj: object) -> ServiceConfig:
    """Validate a configuration mapping (the parsed YAML)."""
    top = _mapping(obj, "config")
    _only(top, "config", {"listen", "router", "ingest", "proxy", "workers"})
    listen = _mapping(top.get("listen", {}), "listen")
    _only(listen, "listen", {"host", "port"})
    host = _str(listen.get("host", "127.0.0.1"), "listen.host")
    port = _int(listen.get("port", 8000), "listen.port", lo=0)
    if port > 65535:
        raise ConfigError(f"listen.port: {port} is not a TCP port")
    router = _router(_mapping(top.get("router", {}), "router"))
    ingest = _ingest(_mapping(top.get("ingest", {}), "ingest"))
    proxy = _bool(top.get("proxy", False), "proxy")
    raw_workers = top.get("workers")
    if not isinstance(raw_workers, list) or not raw_workers:
        raise ConfigError("workers: a non-empty list of workers is required")
    workers: list[WorkerConfig] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_workers):
        w = _worker(_mapping(raw, f"workers[{i}]"), f"workers[{i}]")
        if w.id in seen:
            raise ConfigError(f"workers[{i}].id: {w.id!r} is used twice")
        seen.add(w.id)
        workers.append(w)
    return ServiceConfig(tuple(workers), router, ingest, host, port, proxy)


# ------------------------------------------------------------------------------ sections


def _router(m: Mapping[str, Any]) -> RouterOptions:
    where = "router"
    _only(m, where, set(RouterOptions.__dataclass_fields__))
    d = RouterOptions()
    mode = _str(m.get("mode", d.mode), f"{where}.mode")
    if mode not in ("cost", "trtllm", "approx"):
        raise ConfigError(f"{where}.mode: {mode!r} is not 'cost', 'trtllm' or 'approx'")
    weights = m.get("tier_weights", list(d.tier_weights))
    if not isinstance(weights, list) or len(weights) != 3:
        raise ConfigError(f"{where}.tier_weights: expected a list of 3 numbers, got {weights!r}")
    tw = tuple(_num(w, f"{where}.tier_weights[{i}]", hi=1.0) for i, w in enumerate(weights))
    ttl = m.get("prediction_ttl_s")
    return RouterOptions(
        mode=mode,
        tier_weights=(tw[0], tw[1], tw[2]),
        load_weight=_num(m.get("load_weight", d.load_weight), f"{where}.load_weight"),
        temperature=_num(m.get("temperature", d.temperature), f"{where}.temperature"),
        prediction_ttl_s=None if ttl is None else _num(ttl, f"{where}.prediction_ttl_s"),
        max_batch_size=_int(m.get("max_batch_size", d.max_batch_size), f"{where}.max_batch_size",
                            lo=1),
        request_timeout_s=_num(m.get("request_timeout_s", d.request_timeout_s),
                               f"{where}.request_timeout_s"),
        seed=_int(m.get("seed", d.seed), f"{where}.seed", lo=0),
    )


def _ingest(m: Mapping[str, Any]) -> IngestOptions:
    where = "ingest"
    _only(m, where, set(IngestOptions.__dataclass_fields__))
    d = IngestOptions()
    out = IngestOptions(
        poll_interval_s=_num(m.get("poll_interval_s", d.poll_interval_s),
                             f"{where}.poll_interval_s"),
        http_timeout_s=_num(m.get("http_timeout_s", d.http_timeout_s), f"{where}.http_timeout_s"),
        health_interval_s=_num(m.get("health_interval_s", d.health_interval_s),
                               f"{where}.health_interval_s"),
    )
    for name in ("poll_interval_s", "http_timeout_s", "health_interval_s"):
        if getattr(out, name) <= 0:
            raise ConfigError(f"{where}.{name}: must be > 0")
    return out


def _worker(m: Mapping[str, Any], where: str) -> WorkerConfig:
    _only(m, where, set(WorkerConfig.__dataclass_fields__))
    if "id" not in m:
        raise ConfigError(f"{where}.id: required")
    wid = _str(m["id"], f"{where}.id")
    if not wid:
        raise ConfigError(f"{where}.id: must not be empty")
    kind_s = _str(m.get("kind"), f"{where}.kind") if "kind" in m else None
    if kind_s is None:
        raise ConfigError(f"{where}.kind: required (vllm, trtllm or kvpool)")
    try:
        kind = WorkerKind(kind_s)
    except ValueError:
        raise ConfigError(
            f"{where}.kind: {kind_s!r} is not one of vllm, trtllm, kvpool"
        ) from None
    zmq_ep = _opt_str(m.get("zmq_endpoint"), f"{where}.zmq_endpoint")
    replay = _opt_str(m.get("replay_endpoint"), f"{where}.replay_endpoint")
    base = _opt_str(m.get("http_base_url"), f"{where}.http_base_url")
    if base is not None:
        if not base.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.http_base_url: {base!r} is not an http(s) URL")
        base = base.rstrip("/")
    tpb = m.get("tokens_per_block")
    tpb_v = None if tpb is None else _int(tpb, f"{where}.tokens_per_block", lo=1)
    algo = _opt_str(m.get("hash_algo"), f"{where}.hash_algo")
    if algo is not None:
        try:
            algo = parse_hash_algo(algo).value
        except UnknownHashAlgorithmError as exc:
            raise ConfigError(f"{where}.hash_algo: {exc}") from None
    by_tokens = _bool(m.get("match_by_tokens", False), f"{where}.match_by_tokens")
    for name, ep in (("zmq_endpoint", zmq_ep), ("replay_endpoint", replay)):
        if ep is not None and "://" not in ep:
            raise ConfigError(f"{where}.{name}: {ep!r} is not a ZeroMQ endpoint (tcp://host:port)")
    if replay is not None and zmq_ep is None:
        raise ConfigError(f"{where}.replay_endpoint: needs a zmq_endpoint")
    approx = m.get("approx_blocks")
    if approx is not None:
        counts = approx if isinstance(approx, list) else [approx]
        if not 1 <= len(counts) <= 3:
            raise ConfigError(f"{where}.approx_blocks: 1 to 3 block counts, got {approx!r}")
        approx = tuple(_int(c, f"{where}.approx_blocks[{i}]", lo=1 if i == 0 else 0)
                       for i, c in enumerate(counts))
    if kind is WorkerKind.VLLM:
        if zmq_ep is None and approx is None:
            raise ConfigError(f"{where}.zmq_endpoint: required for a vllm worker")
        if algo is None and not by_tokens:
            algo = "vllm_sha256_cbor"
    elif kind is WorkerKind.TRTLLM:
        if base is None:
            raise ConfigError(f"{where}.http_base_url: required for a trtllm worker")
        if zmq_ep is not None:
            raise ConfigError(f"{where}.zmq_endpoint: trtllm workers are polled over HTTP")
    elif zmq_ep is not None and algo is None and not by_tokens:
        raise ConfigError(
            f"{where}.hash_algo: required for a kvpool worker publishing over ZMQ "
            "(msgpack events do not carry it)"
        )
    topic = _str(m.get("topic", ""), f"{where}.topic")
    return WorkerConfig(wid, kind, zmq_ep, replay, topic, base, tpb_v, algo, by_tokens, approx)


# ------------------------------------------------------------------------------ scalars


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: keys must be strings, got {k!r}")
    return value


def _only(m: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    for key in m:
        if key not in allowed:
            raise ConfigError(
                f"{where}.{key}: unknown key (expected one of {', '.join(sorted(allowed))})"
            )


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _opt_str(value: object, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _int(value: object, where: str, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {value!r}")
    return value


def _num(value: object, where: str, *, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (hi is not None and v > hi):
        bound = f"[0, {hi}]" if hi is not None else ">= 0"
        raise ConfigError(f"{where}: expected a finite number {bound}, got {value!r}")
    return v
