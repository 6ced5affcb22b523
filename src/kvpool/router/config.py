"""The router service's configuration (``kvpool router --config router.yaml``).

Shape (every key optional unless marked; ``docs/router.md`` is the reference, with examples
in ``examples/``)::

    listen:
      host: 127.0.0.1
      port: 8000                                  # 0: any free port
      max_body_bytes: 10485760                    # largest request body accepted (10 MiB)
      max_connections: null                       # default: 3/4 of the open-file limit
      keepalive_timeout_s: 30                     # idle, or request head not all in: closed
      body_timeout_s: 60                          # a body must be all in by then (408)
      auth_token_env: null                        # name of an env variable holding a token
    router:                                       # Router options (kvpool.router.scoring)
      mode: cost                                  # cost | trtllm | approx
      tier_weights: [1.0, 0.95, 0.5]
      load_weight: 0.02                           # per queued prefill token
      temperature: 0.0
      prediction_ttl_s: 2.0                       # default: 2.0 in cost mode, 0 in trtllm mode
      max_batch_size: 64
      request_timeout_s: 600
      shared_tier_weight: 0.3                     # per token only a shared remote tier holds
      shared_tier_blocks: 4194304                 # keys a shared tier is assumed to keep
      seed: 0
    ingest:
      poll_interval_s: 0.5                        # TensorRT-LLM event polling
      http_timeout_s: 2.0
      health_interval_s: 2.0                      # liveness probes of ZMQ workers
    proxy: false                                  # forward /v1/completions, /v1/chat/completions
    tokenizer: null                               # for text requests: HF name or directory
    bus: direct                                   # direct (each worker's own transport) | nats
    nats:                                         # with bus: nats (kvpool.router.nats_bus)
      url: nats://127.0.0.1:4222
      stream: KVPOOL_EVENTS                       # the JetStream stream of KV events
      subject_prefix: kvpool.events               # events on {subject_prefix}.{worker}
      replica_id: null                            # this replica's durable consumer; default random
      snapshot_bucket: kvpool-router              # object store bucket of index snapshots
      snapshot_interval_s: 30                     # 0: this replica writes none
      inflight_subject: kvpool.inflight           # core NATS subject of in-flight state
      check_interval_s: 0.5                       # tail gap checks against the stream
      catch_up_timeout_s: 30                      # start() waits this long to catch up
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
        shared_tier: null                         # name of the shared remote tier (Redis /
                                                  # Valkey store) the worker reads and writes
        tokenizer: null                           # its own; default: the top-level one, else
                                                  # a kvpool worker's GET /v1/tokenizer

``hash_algo`` defaults: ``vllm_sha256_cbor`` for vLLM workers (unless ``match_by_tokens``);
for TensorRT-LLM workers what ``/server_info`` advertises, else each event's field; kvpool
workers that publish over ZMQ must name it (msgspec events do not carry it), in-process ones
learn it from their events.

The sections are msgspec structures: types, ranges and unknown keys are checked by
``msgspec.convert``; what depends on several keys (a worker kind's required endpoints, unique
ids, URL and endpoint shapes, hash algorithm names) by :func:`parse_config` after it. Every
error is a :class:`~kvpool.errors.ConfigError` that starts with the offending key's path, e.g.
``workers[1].kind: invalid enum value 'sglang'``.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
import yaml

from kvpool.errors import ConfigError, UnknownHashAlgorithmError
from kvpool.events.nats_publisher import DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX
from kvpool.hashing.keys import hash_algo as parse_hash_algo
from kvpool.httpserve.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    MAX_PROMPT_TOKENS,
    HttpLimits,
)
from kvpool.router.scoring import DEFAULT_LOAD_WEIGHT, DEFAULT_TIER_WEIGHTS
from kvpool.router.shared_tier import DEFAULT_SHARED_TIER_BLOCKS, DEFAULT_SHARED_TIER_WEIGHT

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_PROMPT_TOKENS",
    "IngestOptions",
    "ListenOptions",
    "NatsOptions",
    "RouterOptions",
    "ServiceConfig",
    "WorkerConfig",
    "WorkerKind",
    "load_config",
    "parse_config",
]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[float, msgspec.Meta(ge=0)]
_Weight = Annotated[float, msgspec.Meta(ge=0, le=1)]
_Interval = Annotated[float, msgspec.Meta(gt=0)]
_EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class WorkerKind(StrEnum):
    VLLM = "vllm"
    TRTLLM = "trtllm"
    KVPOOL = "kvpool"


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine the router routes to and listens to."""

    id: Annotated[str, msgspec.Meta(min_length=1)]
    kind: WorkerKind
    zmq_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    http_base_url: str | None = None
    tokens_per_block: _Positive | None = None
    hash_algo: str | None = None
    match_by_tokens: bool = False
    approx_blocks: tuple[Annotated[int, msgspec.Meta(ge=0)], ...] | None = None
    """The worker publishes no KV events: the router predicts its cache from what it routed
    there, with this many blocks per tier (GPU[, host[, disk]]), see
    :meth:`kvpool.router.scoring.Router.predict_cache`."""
    shared_tier: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """The shared remote tier (a name; one per store) the worker reads and writes: blocks any
    worker of that tier announces on the remote cache level count for this one too, see
    :meth:`kvpool.router.scoring.Router.share_tier`. Needs the engine's block hashes (not
    ``match_by_tokens``)."""
    tokenizer: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """The worker's tokenizer for text requests (proxy mode, ``/route``, ``/query``): a
    Hugging Face name or a local directory; default: the top-level ``tokenizer``, else a
    ``kvpool`` worker's own (``GET /v1/tokenizer``), see :mod:`kvpool.router.tokenizer_source`."""


class RouterOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Keyword arguments of :class:`kvpool.router.scoring.Router`."""

    mode: Literal["cost", "trtllm", "approx"] = "cost"
    tier_weights: tuple[_Weight, _Weight, _Weight] = DEFAULT_TIER_WEIGHTS
    load_weight: _NonNegative = DEFAULT_LOAD_WEIGHT
    temperature: _NonNegative = 0.0
    prediction_ttl_s: _NonNegative | None = None
    max_batch_size: _Positive = 64
    request_timeout_s: _NonNegative = 600.0
    shared_tier_weight: _Weight = DEFAULT_SHARED_TIER_WEIGHT
    shared_tier_blocks: _Positive = DEFAULT_SHARED_TIER_BLOCKS
    agree_margin: _NonNegative | None = None
    """Cost tokens within which candidates count as tied and the request's rendezvous hash
    picks (:mod:`kvpool.router.agreement`); default 0 (off) with ``bus: direct``,
    ``DEFAULT_AGREE_MARGIN`` with ``bus: nats``, so replicas pick alike."""
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0


class IngestOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    poll_interval_s: _Interval = 0.5
    http_timeout_s: _Interval = 2.0
    health_interval_s: _Interval = 2.0


class ListenOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where and what the HTTP service accepts."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    max_body_bytes: _Positive = DEFAULT_MAX_BODY_BYTES
    max_connections: _Positive | None = None
    """Open client connections at most (None: three quarters of the open-file limit, which
    also caps a larger value); past it a connection gets a JSON 503 and is closed."""
    keepalive_timeout_s: _Interval = DEFAULT_KEEPALIVE_TIMEOUT_S
    body_timeout_s: _Interval = DEFAULT_BODY_TIMEOUT_S
    auth_token_env: _EnvName | None = None
    """The name of an environment variable holding the bearer token clients must send."""

    def limits(self) -> HttpLimits:
        return HttpLimits(self.max_body_bytes, self.max_connections, self.keepalive_timeout_s,
                          self.body_timeout_s)


_Subject = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")]
_Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")]


class NatsOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Events over NATS JetStream (``bus: nats``; :mod:`kvpool.router.nats_bus`)."""

    url: Annotated[str, msgspec.Meta(pattern=r"^(nats|tls)://")] = "nats://127.0.0.1:4222"
    stream: _Name = DEFAULT_STREAM
    subject_prefix: _Subject = DEFAULT_SUBJECT_PREFIX
    replica_id: _Name | None = None
    snapshot_bucket: _Name = "kvpool-router"
    snapshot_interval_s: _NonNegative = 30.0
    inflight_subject: _Subject = "kvpool.inflight"
    inflight_flush_s: _NonNegative = 0.01
    check_interval_s: _Interval = 0.5
    catch_up_timeout_s: _Interval = 30.0


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    workers: Annotated[tuple[WorkerConfig, ...], msgspec.Meta(min_length=1)]
    router: RouterOptions = msgspec.field(default_factory=RouterOptions)
    ingest: IngestOptions = msgspec.field(default_factory=IngestOptions)
    listen: ListenOptions = msgspec.field(default_factory=ListenOptions)
    proxy: bool = False
    tokenizer: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """The tokenizer of every worker without its own ``tokenizer`` key."""
    bus: Literal["direct", "nats"] = "direct"
    """``nats``: every worker's events come from the NATS stream (published by ``kvpool serve
    --nats`` or ``kvpool bridge``), not from the worker's own endpoints."""
    nats: NatsOptions = msgspec.field(default_factory=NatsOptions)

    @property
    def host(self) -> str:
        return self.listen.host

    @property
    def port(self) -> int:
        return self.listen.port


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
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
    return parse_config(obj)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where (line, column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def parse_config(obj: object) -> ServiceConfig:
    """Validate a configuration mapping (the parsed YAML)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"config: expected a mapping, got {type(obj).__name__}")
    try:
        config = msgspec.convert(obj, ServiceConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_located(str(exc), obj)) from None
    for section in ("router", "ingest", "listen", "nats"):
        options = getattr(config, section)
        for name in options.__struct_fields__:
            value = getattr(options, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{name}: expected a finite number, got {value}")
    seen: set[str] = set()
    workers = []
    for i, w in enumerate(config.workers):
        if w.id in seen:
            raise ConfigError(f"workers[{i}].id: {w.id!r} is used twice")
        seen.add(w.id)
        workers.append(_checked_worker(w, f"workers[{i}]", bus=config.bus == "nats"))
    return msgspec.structs.replace(config, workers=tuple(workers))


def _checked_worker(w: WorkerConfig, where: str, *, bus: bool = False) -> WorkerConfig:
    """What depends on the worker's kind, with the defaults it implies (``bus``: the events
    come over NATS, the worker needs no endpoint of its own)."""
    base = w.http_base_url
    if base is not None:
        if not base.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.http_base_url: {base!r} is not an http(s) URL")
        base = base.rstrip("/")
    algo = w.hash_algo
    if algo is not None:
        try:
            algo = parse_hash_algo(algo).value
        except UnknownHashAlgorithmError as exc:
            raise ConfigError(f"{where}.hash_algo: {exc}") from None
    for name, ep in (("zmq_endpoint", w.zmq_endpoint), ("replay_endpoint", w.replay_endpoint)):
        if ep is not None and "://" not in ep:
            raise ConfigError(f"{where}.{name}: {ep!r} is not a ZeroMQ endpoint (tcp://host:port)")
    if w.replay_endpoint is not None and w.zmq_endpoint is None:
        raise ConfigError(f"{where}.replay_endpoint: needs a zmq_endpoint")
    if w.shared_tier is not None and w.match_by_tokens:
        raise ConfigError(
            f"{where}.shared_tier: needs the engine's block hashes; match_by_tokens keys "
            "blocks by tokens, which remote-tier events do not map"
        )
    approx = w.approx_blocks
    if approx is not None and not (1 <= len(approx) <= 3 and approx[0] >= 1):
        raise ConfigError(
            f"{where}.approx_blocks: 1 to 3 block counts (GPU >= 1[, host[, disk]]), "
            f"got {list(approx)}"
        )
    if w.kind is WorkerKind.VLLM:
        if w.zmq_endpoint is None and w.approx_blocks is None and not bus:
            raise ConfigError(f"{where}.zmq_endpoint: required for a vllm worker")
        if algo is None and not w.match_by_tokens:
            algo = "vllm_sha256_cbor"
    elif w.kind is WorkerKind.TRTLLM:
        if base is None and not bus:
            raise ConfigError(f"{where}.http_base_url: required for a trtllm worker")
        if w.zmq_endpoint is not None:
            raise ConfigError(f"{where}.zmq_endpoint: trtllm workers are polled over HTTP")
    elif w.zmq_endpoint is not None and algo is None and not w.match_by_tokens:
        raise ConfigError(
            f"{where}.hash_algo: required for a kvpool worker publishing over ZMQ "
            "(msgpack events do not carry it)"
        )
    return msgspec.structs.replace(w, http_base_url=base, hash_algo=algo)


_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.S)
_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]+)`")


def _located(message: str, obj: object) -> str:
    """A msgspec validation message rewritten to start with the key path it is about, e.g.
    ``Expected `int` >= 1 - at `$.workers[0].tokens_per_block``` becomes
    ``workers[0].tokens_per_block: expected int >= 1, got 0``."""
    m = _AT.match(message)
    assert m is not None  # the pattern matches any string
    what, path = m["what"], (m["path"] or "").lstrip(".")
    field = _FIELD.match(what)
    if field is not None:
        if "missing" in what:
            what = "required"
        else:
            struct = _type_at(path)
            assert isinstance(struct, msgspec.inspect.StructType)
            keys = ", ".join(f.name for f in struct.fields)
            what = f"unknown key (expected one of {keys})"
        path = f"{path}.{field['name']}" if path else field["name"]
    elif m["key"]:
        what = f"keys must be strings ({what.lower()})"
    elif what.startswith("Invalid enum value"):
        kind = _type_at(path)
        assert isinstance(kind, msgspec.inspect.LiteralType | msgspec.inspect.EnumType)
        choices = (
            kind.values if isinstance(kind, msgspec.inspect.LiteralType)
            else [e.value for e in kind.cls]
        )
        what = f"{_value_at(obj, path)!r} is not one of {', '.join(map(str, choices))}"
    else:
        what = what[:1].lower() + what[1:]
        value = _value_at(obj, path)
        if value is not _MISSING and ", got" not in what:
            what += f", got {value!r}"
    return f"{path or 'config'}: {what.replace('`', '')}"


_MISSING: Final = object()


def _parts(path: str) -> list[str]:
    return re.findall(r"[^.\[\]]+|\[\d+\]", path)


def _value_at(obj: object, path: str) -> Any:
    for part in _parts(path):
        if part.startswith("[") and isinstance(obj, list) and int(part[1:-1]) < len(obj):
            obj = obj[int(part[1:-1])]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            return _MISSING
    return obj


def _type_at(path: str) -> msgspec.inspect.Type:
    """The declared type of the key at ``path`` (``None`` of an optional key left out)."""
    t: msgspec.inspect.Type = msgspec.inspect.type_info(ServiceConfig)
    for part in ["", *_parts(path)]:
        if isinstance(t, msgspec.inspect.UnionType):
            t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
        if not part:
            continue
        if isinstance(t, msgspec.inspect.StructType):
            t = next(f.type for f in t.fields if f.name == part)
        elif isinstance(t, msgspec.inspect.VarTupleType):
            t = t.item_type
        elif isinstance(t, msgspec.inspect.TupleType):
            t = t.item_types[int(part[1:-1])]
    if isinstance(t, msgspec.inspect.UnionType):
        t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
    return t
