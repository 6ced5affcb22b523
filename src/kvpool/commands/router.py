"""``kvpool router``: run the KV-aware router service.

Reads a YAML configuration (see :mod:`kvpool.router.config`), ingests every worker's KV events
and serves ``/route``, ``/finished``, ``/workers``, ``/metrics`` and ``/health`` until
interrupted (SIGINT or SIGTERM). Once listening it prints
``kvpool router listening on http://HOST:PORT`` on stdout.

Stopping: the first SIGINT or SIGTERM stops listening, ends the requests in flight and the
event ingestion, and exits 0; a second one exits at once with 130 (SIGINT) or 143 (SIGTERM).

The event loop is uvloop's when it is installed (the ``fast`` extra: about a third less CPU
per HTTP request), else asyncio's; ``--event-loop`` chooses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import sys
from collections.abc import Callable
from typing import Any

from msgspec.structs import replace

from kvpool.commands._args import HelpFormatter, add_log_level, port, start_logging
from kvpool.commands._signals import stop_signals_async
from kvpool.router.config import ServiceConfig, load_config
from kvpool.router.service import serve

EVENT_LOOPS = ("auto", "asyncio", "uvloop")
EXIT_STATUS = """exit status:
  0    stopped by SIGINT or SIGTERM
  2    a bad option or configuration, an address in use
  130  a second SIGINT while stopping (exits at once), or one while starting
  143  a second SIGTERM while stopping (exits at once), or one while starting"""

#: The cyclic collector's thresholds once the router listens (Python's are 700, 10, 10). A
#: route leaves container objects alive for a while (its keys in the predictions until their
#: TTL, the load ledger's entries), so at 700 net allocations the young generation is
#: collected every few hundred routes and what it holds promoted. Measured on the router
#: under bench_router_service (20,000 routes, from the freeze on): 88-109 young and 7-9
#: middle passes, 68-99 ms, at Python's; 10-11 young passes and no middle one, 26-39 ms, at
#: these (a young pass ~3 ms instead of ~0.5). Full passes keep Python's ratio.
GC_THRESHOLDS = (7000, 20, 10)


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for ``--event-loop`` (None: asyncio's default loop). Raises
    :class:`ImportError` for ``uvloop`` when it is not installed."""
    if choice == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def register(subparsers: Any) -> None:
    """Add the ``router`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "router",
        help="run the KV-aware router service",
        description=(
            "Route requests to the engine that holds most of their prefix: ingest KV cache "
            "events from vLLM (ZMQ), TensorRT-LLM (HTTP polling) and kvpool workers, and "
            "answer POST /route with the chosen worker and every candidate's score."
        ),
        epilog=EXIT_STATUS,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--config", required=True, metavar="PATH",
        help="router configuration, YAML: listen, router, ingest, proxy and workers "
        "(reference: docs/router.md; examples: examples/router-*.yaml)",
    )
    p.add_argument("--host", help="listen on this address (overrides listen.host)")
    p.add_argument("--port", type=port, metavar="PORT",
                   help="listen on this port, 0 for any free one (overrides listen.port)")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="auto (uvloop when installed, else asyncio; the default), asyncio or "
                   "uvloop")
    add_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start_logging(args.log_level)
    config = load_config(args.config)
    listen = config.listen
    if args.host is not None:
        listen = replace(listen, host=args.host)
    if args.port is not None:
        listen = replace(listen, port=args.port)
    config = replace(config, listen=listen)
    try:
        factory = loop_factory(args.event_loop)
    except ImportError:
        print("kvpool router: --event-loop uvloop needs uvloop (pip install 'kvpool[fast]')",
              file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_main(config))
    return 0


def settle_gc() -> None:
    """Once the router listens: what exists now (modules, config, the index as bootstrapped)
    lives as long as the process, so it is frozen out of the cyclic collector, whose full
    passes then walk only what requests create (measured: GC time per route 12 -> 4 us while
    the router fills up); and the collector runs on :data:`GC_THRESHOLDS`."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _main(config: ServiceConfig) -> None:
    """Serve until the first SIGINT or SIGTERM, which cancels the service (it stops
    listening, lets requests in flight end and stops ingesting); a second one exits at
    once."""
    task = asyncio.current_task()
    assert task is not None

    def ready(port: int) -> None:
        settle_gc()
        print(f"kvpool router listening on http://{config.host}:{port}", flush=True)

    with stop_signals_async(lambda signum: task.cancel()), \
            contextlib.suppress(asyncio.CancelledError):
        await serve(config, ready)
