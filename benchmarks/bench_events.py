"""Block events per second: EventManager -> encode_vllm_batch -> ZMQ PUB -> SUB -> decode.

Each scheduler step, a *hook source* calls the EventManager's hooks (stored chains and removed
blocks), then the step is flushed, read, encoded as one vLLM msgpack batch and published; a
subscriber in another process (as a router would be) receives, repairs gaps and decodes. A
"block event" is one stored block or one removed hash.

Two hook sources, both run by default (``--sources`` picks):

* ``manager``: a real ``KVCacheManager`` wired to the EventManager. Each step admits, commits
  and releases new requests; evictions from its bounded pool emit the removed events. This is
  issue 5's end-to-end path.
* ``synthetic``: the hooks called directly with prebuilt blocks (the EventManager alone): the
  event machinery's own ceiling. Each step's blocks are built just before the step (untimed
  in the stage rows), their token tuples taken from a pool of two steps' worth unpacked from
  bytes as the manager unpacks them.

Rows, per source:

* ``hooks+flush`` (``manager+hooks+flush`` for the manager source): CPU time of the step's hook
  calls (for the manager source, all of the manager's work too), ``flush_iteration_events`` and
  ``get_latest_events``;
* ``encode_vllm_batch``: CPU time of encoding each step's events, right after the step (so
  they are as warm in the cache as in an engine), ``block_size`` given as an engine gives it;
* ``decode_vllm_batch``: CPU time of decoding each step's payload;
* ``full path (2 processes)``: wall time from the first hook call until the subscriber process
  decoded the last block event, through ZMQ on loopback; ``lag_p50_ms`` / ``lag_p99_ms``: how
  long after its encoding each batch reached the subscriber (how stale a router's view is).

The three stage rows run one step at a time in this process, and no step's events or payloads
are kept: keeping a million events alive (as an earlier version of this benchmark did, to
encode them all afterwards) made the cyclic garbage collector's full passes and cold memory
part of the figures, neither of which an engine pays. The collector stays on, as in an engine.

``--baseline SRC [--rounds N]`` measures another checkout's code (SRC is its ``src`` folder, e.g.
a git worktree of the previous release) in the same run: this code and the baseline each run
the benchmark in their own process (the baseline's ``kvpool`` first on the path), interleaved
for ``--rounds`` rounds (default 3); each (code, source, stage) row keeps its best round (the
machine's noise only ever slows a round) and its ratio to the baseline's. Written to
``results/bench_events_baseline.json``.

    .venv/bin/python benchmarks/bench_events.py            # ~1M block events per source
    .venv/bin/python benchmarks/bench_events.py --quick    # a few seconds
    .venv/bin/python benchmarks/bench_events.py --sources manager --baseline ../base/src
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import struct
import subprocess
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import report

# the public API only, so that --baseline can run a checkout with another module layout
from kvpool import CacheConfig, KVCacheManager, SequenceRequest
from kvpool.events import (
    EventManager,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    decode_vllm_batch,
    encode_vllm_batch,
)

M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Shape:
    """What a hook source generates: ``steps`` scheduler steps, each storing
    ``chains_per_step`` chains of ``blocks_per_chain`` blocks of ``tpb`` tokens, with about
    ``live_chains`` chains cached at once."""

    steps: int
    tpb: int
    blocks_per_chain: int
    chains_per_step: int
    live_chains: int
    seed: int = 0


@dataclass
class HookSource:
    """One scheduler step of hook calls into the EventManager at a time."""

    step: Callable[[EventManager], int]
    """Calls the hooks for one step; returns the block events it caused."""
    prepare: Callable[[], None]
    """Untimed work before each step (building the blocks the step will announce)."""
    algo: str
    """The hash algorithm of the hashes the hooks pass."""


def synthetic_source(shape: Shape) -> HookSource:
    """Each step stores ``chains_per_step`` new chains and removes the oldest beyond
    ``live_chains`` (so in steady state as many blocks leave as enter). ``prepare`` builds the
    next step's blocks (hashes and token tuples taken from a pool), so the timed work is the
    hook calls themselves."""
    tpb, blocks_per_chain = shape.tpb, shape.blocks_per_chain
    chains_per_step = shape.chains_per_step
    # Token tuples as the manager builds them (unpacked from bytes: one int object per token),
    # two steps' worth, so that a step's tokens are about as warm in the cache as fresh ones.
    pool_size = 2 * chains_per_step * blocks_per_chain
    ids = np.random.default_rng(shape.seed).integers(0, 1 << 17, pool_size * tpb, dtype=np.uint32)
    token_pool = list(struct.iter_unpack(f"={tpb}I", ids.tobytes()))
    live: deque[list[int]] = deque()  # the hashes of the chains still cached, oldest first
    state: dict[str, Any] = {"counter": 0, "calls": []}

    def prepare() -> None:
        calls: list[tuple[list[StoredBlock], list[int] | None]] = []
        counter = state["counter"]
        for _ in range(chains_per_step):
            chain = []
            for _ in range(blocks_per_chain):
                counter += 1
                # Spread like real 64-bit hashes (most encode in 9 bytes).
                h = (counter * 0x9E3779B97F4A7C15) & M64
                chain.append(StoredBlock(h, token_pool[counter % pool_size]))
            live.append([b.block_hash for b in chain])
            calls.append((chain, live.popleft() if len(live) > shape.live_chains else None))
        state["counter"] = counter
        state["calls"] = calls

    def step(em: EventManager) -> int:
        events = 0
        for chain, removed in state["calls"]:
            em.on_stored(0, 4096, None, chain)
            events += len(chain)
            if removed is not None:
                em.on_removed(0, 4096, removed)
                events += len(removed)
        return events

    return HookSource(step, prepare, "v1_block_key")


def manager_source(shape: Shape) -> HookSource:
    """Each step admits ``chains_per_step`` requests of ``blocks_per_chain`` new blocks each,
    commits and releases them; the GPU pool holds about ``live_chains`` of them, so in steady
    state every commit evicts as many cached blocks (stored + removed block events)."""
    tpb, blocks_per_chain = shape.tpb, shape.blocks_per_chain
    chains_per_step = shape.chains_per_step
    rng = np.random.default_rng(shape.seed)
    n_tok = blocks_per_chain * tpb + 1
    prompts = [
        array("I", rng.integers(0, 1 << 17, n_tok, dtype=np.uint32).tobytes())
        for _ in range(shape.steps * chains_per_step)
    ]
    state: dict[str, Any] = {"m": None, "next": 0}

    def step(em: EventManager) -> int:
        m = state["m"]
        if m is None:
            cfg = CacheConfig(tokens_per_block=tpb, hash_algo="v2_sha256_64",
                              gpu_blocks=shape.live_chains * (blocks_per_chain + 1),
                              enable_partial_reuse=False)
            m = state["m"] = KVCacheManager(cfg, events=em)
        dropped = m.stats().dropped_blocks
        start = state["next"]
        state["next"] = start + chains_per_step
        for i in range(start, start + chains_per_step):
            m.add_sequence(SequenceRequest(i, prompts[i]))
            m.remove_sequence(i)
        return chains_per_step * blocks_per_chain + m.stats().dropped_blocks - dropped

    # the manager keys its tree with this algorithm; events carry int hashes
    return HookSource(step, lambda: None, "v2_sha256_64")


SOURCES = {"manager": manager_source, "synthetic": synthetic_source}


def block_events(events: list[KVCacheEvent]) -> int:
    n = 0
    for event in events:
        data = event.data
        if isinstance(data, Stored):
            n += len(data.blocks)
        elif isinstance(data, Removed):
            n += len(data.block_hashes)
    return n


# ----------------------------------------------------------------------------- subscriber


def _subscriber(
    endpoint: str, replay: str, algo: str, total: Any, ready: Any, result: Any, timeout_s: float
) -> None:
    sub = ZmqEventSubscriber(endpoint, replay, start_seq=0)
    ready.set()
    expected: int | None = None  # the producer sends its count when it is done
    seen = batches = next_id = 0
    lags: list[float] = []  # per batch: received minus the batch's timestamp (its encoding)
    deadline = time.monotonic() + timeout_s
    decoded_at = time.monotonic()  # when the latest batch was decoded
    while (expected is None or seen < expected) and time.monotonic() < deadline:
        for batch in sub.recv(0.5):
            received = time.time()
            decoded = decode_vllm_batch(batch.payload, hash_algo=algo, first_event_id=next_id)
            decoded_at = time.monotonic()
            lags.append(received - decoded.ts)
            next_id += len(decoded.events)
            seen += block_events(decoded.events)
            batches += 1
        if expected is None:
            with contextlib.suppress(queue.Empty):
                expected = total.get_nowait()
    result.put(
        {
            # the last block event's decoding, not this loop's end: the loop learns the total
            # from the producer only after a receive that may wait out its timeout
            "end": decoded_at,
            "block_events": seen,
            "batches": batches,
            "replayed": sub.replayed,
            "missed": sub.missed,
            "lag_ms": [float(np.percentile(lags, q)) * 1e3 for q in (50, 99)] if lags else None,
        }
    )
    sub.close()


# ------------------------------------------------------------------------------------ runs


def make_source(name: str, args: argparse.Namespace) -> HookSource:
    return SOURCES[name](Shape(args.steps, args.tpb, args.blocks_per_chain,
                               args.chains_per_step, args.live_chains))


def run_stages(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    source = make_source(name, args)
    em = EventManager(1 << 22, hash_algo=source.algo)
    clock = time.process_time
    t_hooks = t_encode = t_decode = 0.0
    total = decoded = payload_bytes = next_id = 0
    for _ in range(args.steps):
        source.prepare()
        c0 = clock()
        total += source.step(em)
        em.flush_iteration_events()
        events = em.get_latest_events(0)
        c1 = clock()
        payload = encode_vllm_batch(events, block_size=args.tpb)
        c2 = clock()
        batch = decode_vllm_batch(payload, hash_algo=source.algo, first_event_id=next_id)
        c3 = clock()
        t_hooks += c1 - c0
        t_encode += c2 - c1
        t_decode += c3 - c2
        next_id += len(batch.events)
        decoded += block_events(batch.events)
        payload_bytes += len(payload)
    assert decoded == total, (decoded, total)

    def row(stage: str, seconds: float) -> dict[str, Any]:
        return {
            "source": name,
            "stage": stage,
            "block_events": total,
            "cpu_seconds": seconds,
            "block_events_per_s": total / seconds,
            "ns_per_block_event": seconds / total * 1e9,
            "payload_MB": payload_bytes / 1e6,
        }

    return [
        row("manager+hooks+flush" if name == "manager" else "hooks+flush", t_hooks),
        row("encode_vllm_batch", t_encode),
        row("decode_vllm_batch", t_decode),
    ]


def run_full_path(name: str, args: argparse.Namespace) -> dict[str, Any]:
    source = make_source(name, args)
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    assert pub.replay_endpoint is not None
    ctx = mp.get_context("spawn")
    ready, total, result = ctx.Event(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_subscriber,
        args=(pub.endpoint, pub.replay_endpoint, source.algo, total, ready, result,
              args.timeout),
    )
    proc.start()
    try:
        ready.wait(60)
        time.sleep(0.5)  # let the SUB socket join; anything it misses comes back by replay
        em = EventManager(1 << 22, hash_algo=source.algo)
        produced = 0
        t0 = time.monotonic()
        for _ in range(args.steps):
            source.prepare()  # a few percent of the synthetic source's time, left in
            produced += source.step(em)
            em.flush_iteration_events()
            pub.publish(encode_vllm_batch(em.get_latest_events(0), block_size=args.tpb))
        t_produced = time.monotonic() - t0
        total.put(produced)
        out = result.get(timeout=args.timeout + 30)
    finally:
        proc.join(30)
        pub.close()
    assert out["block_events"] == produced, (out["block_events"], produced)
    seconds = out["end"] - t0
    return {
        "source": name,
        "stage": "full path (2 processes)",
        "block_events": out["block_events"],
        "seconds": seconds,
        "block_events_per_s": out["block_events"] / seconds,
        "ns_per_block_event": seconds / max(out["block_events"], 1) * 1e9,
        "producer_seconds": t_produced,
        "replayed_batches": out["replayed"],
        "missed_batches": out["missed"],
        "lag_p50_ms": out["lag_ms"][0] if out["lag_ms"] else None,
        "lag_p99_ms": out["lag_ms"][1] if out["lag_ms"] else None,
    }


def compare_with(baseline: str, rounds: int, child_args: list[str]) -> None:
    """This code and ``baseline``'s, each run in its own process, interleaved (docstring)."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in range(rounds):
        for code, src in (("this", None), ("baseline", baseline)):
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = src
            out = subprocess.run([sys.executable, __file__, "--rows-json", *child_args],
                                 env=env, check=True, capture_output=True, text=True).stdout
            for row in json.loads(out.splitlines()[-1]):
                key = (code, str(row["source"]), str(row["stage"]))
                if key not in best or row["block_events_per_s"] > best[key]["block_events_per_s"]:
                    best[key] = row
        print(f"round {r + 1}/{rounds} done", flush=True)
    rows = []
    for (code, source, stage), row in best.items():
        base = best.get(("baseline", source, stage))
        rows.append({
            "code": code, "source": source, "stage": stage,
            "block_events_per_s": row["block_events_per_s"],
            "ns_per_block_event": row["ns_per_block_event"],
            "vs_baseline": (f"{row['block_events_per_s'] / base['block_events_per_s']:.2f}x"
                            if base else "-"),
        })
    rows.sort(key=lambda r: (r["source"], r["stage"], r["code"] != "this"))
    report("bench_events_baseline", rows,
           title=f"KV events: this code vs {baseline} (best of {rounds} interleaved rounds)",
           extra={"baseline": baseline, "rows": list(best.values())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tpb", type=int, default=32, help="tokens per block")
    parser.add_argument("--blocks-per-chain", type=int, default=16)
    parser.add_argument("--chains-per-step", type=int, default=32)
    parser.add_argument("--live-chains", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--sources", default="manager,synthetic",
                        help="comma-separated hook sources: manager, synthetic")
    parser.add_argument("--source", choices=sorted(SOURCES),
                        help="one hook source only (same as --sources NAME)")
    parser.add_argument("--baseline", metavar="SRC",
                        help="another checkout's src folder, measured in the same run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --baseline")
    parser.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sources = [args.source] if args.source else [s for s in args.sources.split(",") if s]
    unknown = set(sources) - set(SOURCES)
    if unknown:
        parser.error(f"unknown sources {sorted(unknown)}; choose from {sorted(SOURCES)}")
    if args.baseline is not None:
        child = ["--sources", ",".join(sources), "--steps", str(100 if args.quick else args.steps),
                 "--tpb", str(args.tpb), "--blocks-per-chain", str(args.blocks_per_chain),
                 "--chains-per-step", str(args.chains_per_step),
                 "--live-chains", str(args.live_chains), "--timeout", str(args.timeout)]
        compare_with(str(Path(args.baseline).resolve()), args.rounds, child)
        return
    if args.quick:
        args.steps = 100
    rows: list[dict[str, Any]] = []
    for name in sources:
        rows += run_stages(name, args)
    full = [run_full_path(name, args) for name in sources]
    if args.rows_json:  # a --baseline child: the rows for the parent, nothing written
        print(json.dumps(rows + full))
        return
    report(
        "bench_events",
        rows + full,
        title="KV events: block events per second (stored + removed)",
        extra={"params": {k: v for k, v in vars(args).items() if k != "timeout"}},
    )


if __name__ == "__main__":
    main()
