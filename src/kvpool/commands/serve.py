"""``kvpool serve``: serve a model on kvpool's KV cache over an OpenAI-compatible HTTP API.

Loads the model (``--model smollm2``, a checkpoint directory or a GGUF file; see
:mod:`kvpool.engine.models`), sizes the KV pools (``--gpu-blocks`` or, through the planner,
``--gpu-mem``; ``--host-mem`` / ``--disk-mem`` + ``--disk-path`` for offload tiers) and serves
:mod:`kvpool.engine.server` until interrupted (SIGINT or SIGTERM). With
``--kv-events-endpoint`` it publishes the manager's KV events over ZeroMQ in vLLM's msgpack
format, block hashes in ``v2_sha256_64``, so ``kvpool router`` can route to it (worker
``kind: kvpool``, ``hash_algo: v2_sha256_64``). Its replay socket (missed batches, snapshots
of the whole cache: every cached prompt's token ids) binds ``ipc://*`` by default, a socket of
mode 0600 in a new 0700 directory, which only this user can reach; an ``ipc://`` path in a
directory only this user can enter, or ``none``, may be given instead. ``tcp://`` is refused
for it: ZeroMQ's tcp has no authentication here (CURVE is not set up), and the socket would
serve the cache's prompts to whoever can connect to the port. With ``--nats URL`` it
publishes the events onto NATS JetStream instead (worker id ``--nats-worker``), for routers
with ``bus: nats``. With ``--remote-url URL`` (``--remote-write evict|store``) the engine
shares a remote tier on a Redis- or Valkey-compatible server with every other engine of the
same model (the same served model name and geometry): it writes blocks (and a hybrid model's
checkpoints) there and, before admitting a request the first time, fetches the request's
continuation from there (docs/tiers.md, "In the engine and kvpool serve").

The listen address is bound (and let go again) before the model loads, so a port in use is
refused at once: one line, exit status 2. Once listening it prints ``kvpool serve listening
on http://HOST:PORT`` on stdout (after the ``kvpool serve publishing KV events on ...`` line
when events are on).

Stopping: on SIGINT (Ctrl-C) or SIGTERM it stops accepting connections, lets the requests in
flight finish for up to ``--shutdown-grace`` seconds (then aborts the rest), stops the engine
and exits 0. A second SIGINT or SIGTERM aborts the requests in flight at once and exits 130
(SIGINT) or 143 (SIGTERM) once the engine's current step has ended; a third exits at once.

HTTP options, the same as ``kvpool router``'s ``listen`` keys: ``--auth-token-env NAME`` (the
name of an environment variable holding the bearer token every endpoint but ``/health``
requires), ``--max-body-bytes``, ``--max-connections``, ``--keepalive-timeout-s``,
``--body-timeout-s`` (see :class:`kvpool.httpserve.HttpLimits`). ``/v1/models`` lists
``--served-model-name``, by default the model's name: the built-in name, or the checkpoint
directory's or GGUF file's name, never its path. A request's ``model`` may be left out, or be
the served name or that default name (an alias when ``--served-model-name`` renames it);
any other is OpenAI's 404 ``model_not_found``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from kvpool.commands._args import (
    HelpFormatter,
    add_log_level,
    nonneg_float,
    port,
    positive,
    positive_float,
    size,
    start_logging,
)
from kvpool.commands._signals import exit_code, stop_signals_async
from kvpool.config import EVICTION_POLICIES, EvictionConfig
from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.events.zmq_sockets import PRIVATE_IPC
from kvpool.httpserve import bearer_token
from kvpool.httpserve.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    HttpLimits,
)
from kvpool.tiers.remote.store import split_url
from kvpool.tiers.remote.writer import REMOTE_WRITE_MODES

EVENT_HASH_ALGO = "v2_sha256_64"
# kvpool.engine.server's default, without importing aiohttp and torch to build the parser
DEFAULT_SHUTDOWN_GRACE_S = 20.0
# kvpool.engine.layout's and kvpool.config.CacheConfig's defaults (tests check they agree)
DEFAULT_TOKENS_PER_BLOCK = 16
DEFAULT_EVICTION_POLICY = EvictionConfig().policy
# serve runs the model on the CPU, its device tier in host memory: half the engine's 1 GiB
# (smollm2 needs 360 MiB for one full-length sequence); 1.0 GB peak RSS for smollm2, not 1.6
DEFAULT_GPU_MEM = "512MiB"
EXIT_STATUS = """exit status:
  0    stopped by SIGINT or SIGTERM: requests in flight finished, or were
       aborted after --shutdown-grace
  2    a bad option, a model that cannot be loaded, an address in use
  130  a second SIGINT (aborts the requests in flight at once), or one while
       loading the model
  143  as 130, for SIGTERM"""
_EVENT_BUFFER = 100_000
_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> None:
    """Add the ``serve`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve a model on kvpool's KV cache (OpenAI-compatible HTTP)",
        description=(
            "Run a transformers model with its KV cache in kvpool's block pools and serve "
            "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."
        ),
        epilog=EXIT_STATUS,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="'smollm2' (built in), a checkpoint directory or a .gguf file "
                   "(default smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, metavar="PORT",
                   help="listen port, checked before the model loads (default 8000; 0: any)")
    p.add_argument("--dtype", choices=_DTYPES, default="float32",
                   help="the dtype the weights are loaded in (default float32)")
    _add_pool_flags(p.add_argument_group("KV cache"))
    _add_remote_flags(p.add_argument_group("shared remote tier (a Redis/Valkey server)"))
    sched = p.add_argument_group("scheduler")
    sched.add_argument("--max-batch-size", type=positive, default=8, metavar="N",
                       help="concurrent sequences per step (default 8)")
    sched.add_argument("--max-num-tokens", type=positive, default=2048, metavar="N",
                       help="tokens per step, prefill chunks included (default 2048)")
    _add_event_flags(p.add_argument_group("KV events"))
    p.add_argument("--shutdown-grace", type=nonneg_float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   metavar="SECONDS",
                   help="on SIGINT or SIGTERM, how long requests in flight may go on before "
                   f"they are aborted (default {DEFAULT_SHUTDOWN_GRACE_S:g}; a second signal "
                   "aborts them at once)")
    add_log_level(p)
    _add_http_flags(p.add_argument_group("HTTP (as kvpool router's listen keys)"))
    p.set_defaults(func=run)


def _add_pool_flags(pools: Any) -> None:
    pools.add_argument("--tokens-per-block", type=positive, default=DEFAULT_TOKENS_PER_BLOCK,
                       metavar="N", help="tokens per KV block "
                       f"(default {DEFAULT_TOKENS_PER_BLOCK})")
    pools.add_argument("--gpu-blocks", type=positive, metavar="N",
                       help="device-tier blocks per layer group (default: what --gpu-mem "
                       "holds)")
    pools.add_argument("--gpu-mem", type=size, metavar="SIZE",
                       help="device-tier budget for the planner, e.g. 512MiB (default: "
                       f"{DEFAULT_GPU_MEM} unless --gpu-blocks is given)")
    pools.add_argument("--host-blocks", type=positive, metavar="N",
                       help="host-tier blocks per layer group (default: what --host-mem "
                       "holds)")
    pools.add_argument("--host-mem", type=size, metavar="SIZE",
                       help="host-tier budget (default: no host tier)")
    pools.add_argument("--disk-mem", type=size, metavar="SIZE",
                       help="disk-tier budget (default: no disk tier)")
    pools.add_argument("--disk-path", metavar="PATH",
                       help="directory of the disk tier (default: none; --disk-mem needs it)")
    pools.add_argument("--eviction-policy", choices=EVICTION_POLICIES,
                       default=DEFAULT_EVICTION_POLICY,
                       help=f"which cached block is evicted first (default "
                       f"{DEFAULT_EVICTION_POLICY})")


def _add_remote_flags(remote: Any) -> None:
    remote.add_argument("--remote-url", metavar="URL",
                        help="a Redis- or Valkey-compatible server every engine of the model "
                        "shares, e.g. redis://127.0.0.1:6379/0 (also rediss://, unix://, "
                        "valkey://, redis+cluster://): blocks and checkpoints are written "
                        "there and fetched from there before admission (default: none)")
    remote.add_argument("--remote-write", choices=REMOTE_WRITE_MODES,
                        help="'evict': write what leaves the last local tier; 'store': every "
                        "block as it is computed (default evict; needs --remote-url)")


def _add_event_flags(events: Any) -> None:
    events.add_argument("--kv-events-endpoint", metavar="ENDPOINT",
                        help="publish KV events here, e.g. tcp://127.0.0.1:5557 (port 0: any; "
                        "default: none, no events)")
    events.add_argument("--kv-events-replay-endpoint", metavar="ENDPOINT",
                        help="serve missed event batches and snapshots here: an ipc:// path "
                        "in a directory only you can enter, or 'none' (default ipc://*, a "
                        "socket of mode 0600 only this user can reach, when "
                        "--kv-events-endpoint is set; tcp:// is refused: it would serve "
                        "every cached prompt's token ids to whoever can connect)")
    events.add_argument("--nats", metavar="URL",
                        help="publish KV events onto this NATS server's JetStream stream "
                        "instead, e.g. nats://127.0.0.1:4222 (routers with bus: nats; "
                        "default: none)")
    events.add_argument("--nats-worker", metavar="ID", default="kvpool-serve",
                        help="the worker id the events carry on NATS, as the routers' config "
                        "names it (default kvpool-serve)")


def _add_http_flags(http: Any) -> None:
    http.add_argument("--served-model-name", metavar="NAME",
                      help="the model's name in /v1/models and answers (default: the built-in "
                      "name, or the checkpoint directory's or GGUF file's name)")
    http.add_argument("--auth-token-env", metavar="VAR",
                      help="name of an environment variable holding the bearer token every "
                      "endpoint but /health requires (default: no auth)")
    http.add_argument("--max-body-bytes", type=size, default=DEFAULT_MAX_BODY_BYTES,
                      metavar="SIZE", help="largest request body accepted, 413 past it "
                      "(default 10MiB)")
    http.add_argument("--max-connections", type=positive, metavar="N",
                      help="open client connections at most, a JSON 503 past it (default and "
                      "most: 3/4 of the open-file limit)")
    http.add_argument("--keepalive-timeout-s", type=positive_float,
                      default=DEFAULT_KEEPALIVE_TIMEOUT_S, metavar="S",
                      help="close a connection idle, or still sending its request head, this long"
                      f" (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})")
    http.add_argument("--body-timeout-s", type=positive_float, default=DEFAULT_BODY_TIMEOUT_S,
                      metavar="S", help="a body must be all in this long after its head, 408 "
                      f"otherwise (default {DEFAULT_BODY_TIMEOUT_S:g})")


def served_model_name(model: str) -> str:
    """The name ``/v1/models`` shows for ``--model``: a built-in name as is, a checkpoint
    directory's or GGUF file's own name (without ``.gguf``), never the path to it."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return path.stem
    return path.resolve().name if path.exists() else (path.name or model)


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineServer`` keywords of the HTTP flags: name, limits, bearer token."""
    if args.max_body_bytes < 1:
        raise InvalidArgumentError("--max-body-bytes must be at least 1 byte")
    default_name = served_model_name(args.model)
    return {
        "model_name": args.served_model_name or default_name,
        "model_aliases": (default_name,),
        "limits": HttpLimits(args.max_body_bytes, args.max_connections,
                             args.keepalive_timeout_s, args.body_timeout_s),
        "auth_token": bearer_token(args.auth_token_env, option="--auth-token-env"),
    }


def replay_endpoint(args: argparse.Namespace) -> str | None:
    """Where the replay socket binds: ``ipc://*`` unless a flag says otherwise (``none``: no
    replay socket); nothing without ``--kv-events-endpoint``."""
    if args.kv_events_endpoint is None or args.kv_events_replay_endpoint == "none":
        return None
    return args.kv_events_replay_endpoint or PRIVATE_IPC


def cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Engine(cache=...)`` fields the command line sets."""
    if args.gpu_blocks is not None and args.gpu_mem is not None:
        raise InvalidArgumentError("give --gpu-blocks or --gpu-mem, not both")
    if args.host_blocks is not None and args.host_mem is not None:
        raise InvalidArgumentError("give --host-blocks or --host-mem, not both")
    if args.disk_mem is not None and args.disk_path is None:
        raise InvalidArgumentError("--disk-mem needs --disk-path")
    if args.kv_events_replay_endpoint is not None and args.kv_events_endpoint is None:
        raise InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if (args.kv_events_replay_endpoint or "").startswith("tcp://"):
        raise InvalidArgumentError(
            "--kv-events-replay-endpoint: tcp:// is refused (the replay socket serves every "
            "cached prompt's token ids, and a tcp port to whoever can connect); use an ipc:// "
            "path (the default ipc://* is one only this user can reach) or 'none'")
    if args.nats is not None and args.kv_events_endpoint is not None:
        raise InvalidArgumentError("give --nats or --kv-events-endpoint, not both")
    cache: dict[str, Any] = {}
    for name in ("tokens_per_block", "gpu_blocks", "gpu_mem", "host_blocks", "host_mem",
                 "disk_mem"):
        value = getattr(args, name)
        if value is not None:
            cache[name] = value
    if args.gpu_blocks is None and args.gpu_mem is None:
        cache["gpu_mem"] = DEFAULT_GPU_MEM
    if args.disk_path is not None:
        cache["disk"] = {"path": args.disk_path}
    if args.eviction_policy is not None:
        cache["eviction"] = {"policy": args.eviction_policy}
    if args.kv_events_endpoint is not None or args.nats is not None:
        cache["events"] = {"buffer_max_size": _EVENT_BUFFER, "hash_algo": EVENT_HASH_ALGO}
    cache.update(remote_options(args))
    return cache


def remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """The shared remote tier's ``Engine(cache=...)`` fields: its server and write mode, and
    ``model_id``, the served model name (engines share blocks under equal names only)."""
    if args.remote_url is None:
        if args.remote_write is not None:
            raise InvalidArgumentError("--remote-write needs --remote-url")
        return {}
    split_url(args.remote_url, "--remote-url")
    return {"remote": {"url": args.remote_url, "write": args.remote_write or "evict"},
            "model_id": args.served_model_name or served_model_name(args.model)}


def run(args: argparse.Namespace) -> int:
    start_logging(args.log_level)
    cache = cache_options(args)
    http = http_options(args)
    held = hold_address(args.host, args.port)  # a busy port is refused before the model loads
    try:
        server = _load(args, cache, http)
    finally:
        held.close()  # the server binds it again (SO_REUSEADDR) once the model is loaded
    return asyncio.run(_main(server))


def hold_address(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, so that a port in use, or a host that is not this
    machine's, is refused before anything is loaded, and no other process takes the port while
    the model loads (a client connecting meanwhile is reset when it is let go).

    Raises:
        KVPoolError: the address cannot be bound, in the words :func:`kvpool.httpserve.listen`
            uses.
    """
    sock: socket.socket | None = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise KVPoolError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _load(args: argparse.Namespace, cache: dict[str, Any], http: dict[str, Any]) -> Any:
    """The model loaded and the ``EngineServer`` over it (not started)."""
    import torch

    from kvpool.engine.engine import Engine
    from kvpool.engine.models import load_model
    from kvpool.engine.server import EngineServer

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    engine = Engine(model, tokenizer, cache=cache, max_batch_size=args.max_batch_size,
                    max_num_tokens=args.max_num_tokens)
    return EngineServer(
        engine, host=args.host, port=args.port,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=replay_endpoint(args),
        nats_url=args.nats, nats_worker=args.nats_worker,
        shutdown_grace_s=args.shutdown_grace, **http,
    )


async def _main(server: Any) -> int:
    """Serve until a stop signal; the exit status (see the module docstring)."""
    received: list[int] = []
    stopping = asyncio.Event()

    def first(signum: int) -> None:
        received.append(signum)
        stopping.set()

    def second(signum: int) -> None:
        received.append(signum)
        aborted = server.abort_in_flight()
        print(f"kvpool serve: {signal.Signals(signum).name} again: aborted {aborted} "
              "request(s) in flight", file=sys.stderr, flush=True)

    with stop_signals_async(first, second):
        port = await server.start()
        try:
            pub = server.publisher
            if pub is not None:
                replay = f", replay {pub.replay_endpoint}" if pub.replay_endpoint else ""
                print(f"kvpool serve publishing KV events on {pub.endpoint}{replay} "
                      f"(hash_algo {EVENT_HASH_ALGO}, tokens_per_block "
                      f"{server.engine.manager.config.tokens_per_block})", flush=True)
            print(f"kvpool serve listening on http://{server.host}:{port}", flush=True)
            await stopping.wait()
            name = signal.Signals(received[0]).name
            print(f"kvpool serve: {name}: stopped accepting; {server.in_flight} request(s) in "
                  f"flight get up to {server.shutdown_grace_s:g} s ({name} again aborts them)",
                  file=sys.stderr, flush=True)
        finally:
            await server.stop()
    return exit_code(received[1]) if len(received) > 1 else 0
