"""``kvpool bridge``: republish an engine's KV events (vLLM ZMQ, TensorRT-LLM HTTP/JSON,
kvpool) onto NATS JetStream.

One bridge per worker. It reads the engine's events where the engine publishes them and sends
each batch unchanged onto the event stream (:mod:`kvpool.events.nats_publisher`), where router
replicas with ``bus: nats`` read it:

* ``--zmq ENDPOINT [--replay-endpoint ENDPOINT] [--topic TOPIC]``: a vLLM (or ``kvpool serve
  --kv-events-endpoint``) publisher, read in order with gap repair through the replay socket
  (:class:`~kvpool.events.zmq.ZmqEventSubscriber`). A kvpool publisher's snapshot is
  published first, so the stream starts from the worker's whole cache. A publisher restart
  starts a new epoch: the routers drop what they knew of the worker.
* ``--trtllm URL``: a TensorRT-LLM server, whose queued events ``POST
  URL/kv_cache_events`` drains every ``--poll-interval-s``; event ids that go back start a
  new epoch.

Every batch is checked with the decoder the router uses (:mod:`kvpool.events.vllm_msgpack`,
:mod:`kvpool.events.trtllm_json`); one that does not decode is counted, logged and not
published. Once running it prints ``kvpool bridge: worker ID from SOURCE to NATS URL`` on
stdout. The first SIGINT or SIGTERM sends what is queued and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import aiohttp

from kvpool.commands._args import LOG_LEVELS, HelpFormatter, log_level, positive_float
from kvpool.commands._signals import stop_signals_async
from kvpool.errors import EventFormatError, InvalidArgumentError
from kvpool.events.nats_publisher import (
    DEFAULT_STREAM,
    DEFAULT_SUBJECT_PREFIX,
    NatsEventPublisher,
)
from kvpool.events.trtllm_json import parse_trtllm_json
from kvpool.events.vllm_msgpack import decode_vllm_batch
from kvpool.events.zmq import ZmqEventSubscriber

logger = logging.getLogger("kvpool.bridge")


def register(subparsers: Any) -> None:
    """Add the ``bridge`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bridge",
        help="republish an engine's KV events onto NATS JetStream",
        description=(
            "Read one worker's KV events (vLLM or kvpool over ZeroMQ, TensorRT-LLM over HTTP) "
            "and publish each batch onto a NATS JetStream stream, where router replicas with "
            "bus: nats read them."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--nats", required=True, metavar="URL", help="NATS server, nats://host:port")
    p.add_argument("--worker", required=True, metavar="ID",
                   help="the worker id, as the routers' config names it")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--zmq", metavar="ENDPOINT",
                     help="a vLLM or kvpool event publisher, e.g. tcp://127.0.0.1:5557")
    src.add_argument("--trtllm", metavar="URL",
                     help="a TensorRT-LLM server's base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--replay-endpoint", metavar="ENDPOINT",
                   help="the ZMQ publisher's replay socket (default: none, no gap repair)")
    p.add_argument("--topic", default="", help="ZMQ topic (default: all)")
    p.add_argument("--poll-interval-s", type=positive_float, default=0.5, metavar="S",
                   help="TensorRT-LLM event polling (default 0.5)")
    p.add_argument("--stream", default=DEFAULT_STREAM,
                   help=f"JetStream stream (default {DEFAULT_STREAM})")
    p.add_argument("--subject-prefix", default=DEFAULT_SUBJECT_PREFIX,
                   help=f"events go to PREFIX.WORKER (default {DEFAULT_SUBJECT_PREFIX})")
    p.add_argument("--log-level", type=log_level, default="WARNING", metavar="LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (default WARNING)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replay_endpoint is not None and args.zmq is None:
        raise InvalidArgumentError("--replay-endpoint needs --zmq")
    asyncio.run(_main(args))
    return 0


class Bridge:
    """One worker's events from its engine to the stream (a new publisher per epoch)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.fmt = "vllm" if args.zmq is not None else "trtllm"
        self.publisher = self._publisher()
        self.batches = 0
        self.malformed = 0

    def _publisher(self) -> NatsEventPublisher:
        a = self.args
        return NatsEventPublisher(a.nats, a.worker, fmt=self.fmt, stream=a.stream,
                                  subject_prefix=a.subject_prefix)

    def restart(self) -> None:
        """The engine restarted: a new epoch."""
        old, self.publisher = self.publisher, self._publisher()
        old.close()

    def forward(self, payload: bytes) -> bool:
        """Publish one batch if it decodes; False (counted) if not."""
        try:
            if self.fmt == "vllm":
                decode_vllm_batch(payload)
            else:
                parse_trtllm_json(payload, tokens=False)
        except EventFormatError as exc:
            self.malformed += 1
            logger.warning("worker %s: a batch that does not decode, not published: %s",
                           self.args.worker, exc)
            return False
        self.publisher.publish(payload)
        self.batches += 1
        return True

    def close(self) -> None:
        self.publisher.close()


async def _main(args: argparse.Namespace) -> None:
    task = asyncio.current_task()
    assert task is not None
    bridge = await asyncio.to_thread(Bridge, args)
    source = args.zmq or args.trtllm
    print(f"kvpool bridge: worker {args.worker} from {source} to NATS {args.nats}", flush=True)
    try:
        with stop_signals_async(lambda signum: task.cancel()), \
                contextlib.suppress(asyncio.CancelledError):
            if args.zmq is not None:
                await _from_zmq(bridge, args)
            else:
                await _from_trtllm(bridge, args)
    finally:
        await asyncio.to_thread(bridge.close)


async def _from_zmq(bridge: Bridge, args: argparse.Namespace) -> None:
    sub = ZmqEventSubscriber(args.zmq, args.replay_endpoint, args.topic, start_seq=None)
    try:
        snap = await asyncio.to_thread(sub.snapshot)
        if snap is not None:
            bridge.forward(snap.payload)
        for batch in await asyncio.to_thread(sub.catch_up):
            bridge.forward(batch.payload)
        while True:
            for batch in await asyncio.to_thread(sub.recv, 0.2):
                if batch.restart:
                    await asyncio.to_thread(bridge.restart)
                bridge.forward(batch.payload)
    finally:
        sub.close()


async def _from_trtllm(bridge: Bridge, args: argparse.Namespace) -> None:
    base = args.trtllm.rstrip("/")
    last_id: int | None = None
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                async with session.post(f"{base}/kv_cache_events") as resp:
                    body = await resp.read() if resp.status == 200 else None
                    if body is None:
                        logger.warning("POST /kv_cache_events answered %d", resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("POST /kv_cache_events failed: %s", exc or type(exc).__name__)
                body = None
            if body is not None:
                try:
                    events = parse_trtllm_json(body, tokens=False)
                except EventFormatError:
                    events = None
                if events:
                    first = events[0].event_id
                    if last_id is not None and (first == 0 < last_id or first < last_id - 1024):
                        await asyncio.to_thread(bridge.restart)
                    last_id = max(e.event_id for e in events)
                if events is None or events:
                    bridge.forward(body)
            await asyncio.sleep(args.poll_interval_s)
