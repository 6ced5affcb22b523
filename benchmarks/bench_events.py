"""Block events per second: EventManager -> encode_vllm_batch -> ZMQ PUB -> SUB -> decode.

Each scheduler step, a *hook source* calls the EventManager's hooks (stored chains and removed
blocks), then the step is flushed, read, encoded as one vLLM msgpack batch and published; a
subscriber in another process (as a router would be) receives, repairs gaps and decodes. A
"block event" is one stored block or one removed hash.

Rows: each stage alone in this process (hooks+flush, encode, decode) and the full path
(hooks -> encode -> PUB -> SUB -> decode) across two processes on loopback, timed from the first
hook call until the subscriber decoded the last block event.

The hook source is one function (``HookSource``): ``--source manager`` (the default) drives a
real ``KVCacheManager`` wired to the EventManager — each step admits, commits and releases new
requests, and evictions from its bounded pool emit the removed events — while
``--source synthetic`` calls the hooks directly (the EventManager alone).

    .venv/bin/python benchmarks/bench_events.py            # ~1M block events
    .venv/bin/python benchmarks/bench_events.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from common import report
from kvpool.config import CacheConfig, SequenceRequest
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
from kvpool.manager import KVCacheManager

HookSource = Callable[[EventManager], int]
"""One scheduler step of hook calls into the EventManager; returns the block events it caused."""

M64 = (1 << 64) - 1


def synthetic_source(
    *,
    steps: int,
    tpb: int,
    blocks_per_chain: int,
    chains_per_step: int,
    live_chains: int,
    seed: int = 0,
) -> HookSource:
    """Each step stores ``chains_per_step`` new chains and removes the oldest beyond
    ``live_chains`` (so in steady state as many blocks leave as enter). Blocks are built up
    front, so the timed work is the hook calls themselves."""
    rng = random.Random(seed)
    token_pool = [tuple(rng.randrange(1 << 17) for _ in range(tpb)) for _ in range(64)]
    chains: list[list[StoredBlock]] = []
    counter = 0
    for _ in range(steps * chains_per_step):
        chain = []
        for _ in range(blocks_per_chain):
            counter += 1
            # Spread like real 64-bit hashes (most encode in 9 bytes).
            h = (counter * 0x9E3779B97F4A7C15) & M64
            chain.append(StoredBlock(h, token_pool[counter % len(token_pool)]))
        chains.append(chain)
    hashes = [[b.block_hash for b in chain] for chain in chains]
    state = {"next": 0}

    def step(em: EventManager) -> int:
        start = state["next"]
        stop = start + chains_per_step
        state["next"] = stop
        events = 0
        for c in range(start, stop):
            chain = chains[c]
            em.on_stored(0, 4096, None, chain)
            events += len(chain)
            old = c - live_chains
            if old >= 0:
                em.on_removed(0, 4096, hashes[old])
                events += len(hashes[old])
        return events

    return step


def manager_source(
    *,
    steps: int,
    tpb: int,
    blocks_per_chain: int,
    chains_per_step: int,
    live_chains: int,
    seed: int = 0,
) -> HookSource:
    """Each step admits ``chains_per_step`` requests of ``blocks_per_chain`` new blocks each,
    commits and releases them; the GPU pool holds about ``live_chains`` of them, so in steady
    state every commit evicts as many cached blocks (stored + removed block events)."""
    rng = np.random.default_rng(seed)
    n_tok = blocks_per_chain * tpb + 1
    prompts = [
        array("I", rng.integers(0, 1 << 17, n_tok, dtype=np.uint32).tobytes())
        for _ in range(steps * chains_per_step)
    ]
    state: dict[str, Any] = {"m": None, "next": 0}

    def step(em: EventManager) -> int:
        m = state["m"]
        if m is None:
            cfg = CacheConfig(tokens_per_block=tpb, hash_algo="v2_sha256_64",
                              gpu_blocks=live_chains * (blocks_per_chain + 1),
                              enable_partial_reuse=False)
            m = state["m"] = KVCacheManager(cfg, events=em)
        dropped = m.stats().dropped_blocks
        start = state["next"]
        state["next"] = start + chains_per_step
        for i in range(start, start + chains_per_step):
            m.add_sequence(SequenceRequest(i, prompts[i]))
            m.remove_sequence(i)
        return chains_per_step * blocks_per_chain + m.stats().dropped_blocks - dropped

    return step


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
    endpoint: str, replay: str, expected: int, ready: Any, result: Any, timeout_s: float
) -> None:
    sub = ZmqEventSubscriber(endpoint, replay, start_seq=0)
    ready.set()
    seen = 0
    batches = 0
    next_id = 0
    deadline = time.monotonic() + timeout_s
    while seen < expected and time.monotonic() < deadline:
        for batch in sub.recv(0.5):
            decoded = decode_vllm_batch(
                batch.payload, hash_algo="v1_block_key", first_event_id=next_id
            )
            next_id += len(decoded.events)
            seen += block_events(decoded.events)
            batches += 1
    result.put(
        {
            "end": time.monotonic(),
            "block_events": seen,
            "batches": batches,
            "replayed": sub.replayed,
            "missed": sub.missed,
        }
    )
    sub.close()


# ------------------------------------------------------------------------------------ runs


def make_source(args: argparse.Namespace) -> HookSource:
    factory = manager_source if args.source == "manager" else synthetic_source
    return factory(
        steps=args.steps,
        tpb=args.tpb,
        blocks_per_chain=args.blocks_per_chain,
        chains_per_step=args.chains_per_step,
        live_chains=args.live_chains,
    )


def run_stages(args: argparse.Namespace) -> list[dict[str, Any]]:
    source = make_source(args)
    em = EventManager(1 << 22, hash_algo=args.algo)
    steps: list[list[KVCacheEvent]] = []
    total = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        total += source(em)
        em.flush_iteration_events()
        steps.append(em.get_latest_events(0))
    t_hooks = time.perf_counter() - t0

    t0 = time.perf_counter()
    payloads = [encode_vllm_batch(events) for events in steps]
    t_encode = time.perf_counter() - t0

    t0 = time.perf_counter()
    decoded = sum(
        block_events(decode_vllm_batch(p, hash_algo=args.algo).events) for p in payloads
    )
    t_decode = time.perf_counter() - t0
    assert decoded == total, (decoded, total)
    mb = sum(len(p) for p in payloads) / 1e6

    def row(stage: str, seconds: float) -> dict[str, Any]:
        return {
            "stage": stage,
            "block_events": total,
            "seconds": seconds,
            "block_events_per_s": total / seconds,
            "ns_per_block_event": seconds / total * 1e9,
            "payload_MB": mb,
        }

    return [
        row("EventManager hooks+flush", t_hooks),
        row("encode_vllm_batch", t_encode),
        row("decode_vllm_batch", t_decode),
    ]


def run_full_path(args: argparse.Namespace) -> dict[str, Any]:
    # a dry run counts the block events the subscriber must see (the sources are deterministic)
    dry = make_source(args)
    dry_em = EventManager(1 << 22, hash_algo=args.algo)
    expected = 0
    for _ in range(args.steps):
        expected += dry(dry_em)
        dry_em.flush_iteration_events()
        dry_em.get_latest_events(0)
    del dry, dry_em
    source = make_source(args)
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    assert pub.replay_endpoint is not None
    ctx = mp.get_context("spawn")
    ready, result = ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=_subscriber,
        args=(pub.endpoint, pub.replay_endpoint, expected, ready, result, args.timeout),
    )
    proc.start()
    try:
        ready.wait(60)
        time.sleep(0.5)  # let the SUB socket join; anything it misses comes back by replay
        em = EventManager(1 << 22, hash_algo=args.algo)
        produced = 0
        t0 = time.monotonic()
        for _ in range(args.steps):
            produced += source(em)
            em.flush_iteration_events()
            pub.publish(encode_vllm_batch(em.get_latest_events(0)))
        t_produced = time.monotonic() - t0
        out = result.get(timeout=args.timeout + 30)
    finally:
        proc.join(30)
        pub.close()
    assert produced == expected, (produced, expected)
    seconds = out["end"] - t0
    return {
        "stage": "full path (2 processes)",
        "block_events": out["block_events"],
        "seconds": seconds,
        "block_events_per_s": out["block_events"] / seconds,
        "ns_per_block_event": seconds / max(out["block_events"], 1) * 1e9,
        "producer_seconds": t_produced,
        "replayed_batches": out["replayed"],
        "missed_batches": out["missed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tpb", type=int, default=32, help="tokens per block")
    parser.add_argument("--blocks-per-chain", type=int, default=16)
    parser.add_argument("--chains-per-step", type=int, default=32)
    parser.add_argument("--live-chains", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--source", choices=["manager", "synthetic"], default="manager",
                        help="what calls the EventManager's hooks")
    args = parser.parse_args()
    # the manager keys its tree with this algorithm; events carry int hashes
    args.algo = "v2_sha256_64" if args.source == "manager" else "v1_block_key"
    if args.quick:
        args.steps = 100
    rows = run_stages(args)
    rows.append(run_full_path(args))
    report(
        "bench_events",
        rows,
        title="KV events: block events per second (stored + removed)",
        extra={"params": {k: v for k, v in vars(args).items() if k != "timeout"}},
    )


if __name__ == "__main__":
    main()
