"""Admission throughput of the block manager on two workloads.

Requests enter through ``add_sequence_batch([request])``, the entry point engines call (with
``--entry add_sequence`` through ``add_sequence``, which older releases served by a separate
fast path).

W1: 8 system prompts of 1,024 tokens; 2,000 requests, request i = prompt (i % 8) + 1,024
    unique tokens; tpb 32, 20,000 GPU blocks; each request added, stored and removed alone.
    Token ids are random in [0, 128,256) (a Llama 3 vocabulary), as an engine passes them.
W2: the first 4,000 requests of the Mooncake conversation trace (tokens synthesised per hash
    id, 512 tokens per id); tpb 32, 20,000 GPU blocks; each request admitted in trace order and
    held while the next 31 are admitted; a request that does not fit releases the oldest held
    request early and retries (counted).

"Hashing excluded" subtracts the time the manager itself spent computing block keys, timed
around every BlockHasher.extend/keys_after/key call it made during the run (the manager hashes
only the blocks that enter its tree; matched blocks are found by their tokens and never
rehashed).

The garbage collector stays on in the timed loops, as in an engine (--no-gc turns it off there,
to see what the collector costs).

``--compare-policies lru,2q,arc,s3fifo [--rounds 8]`` runs W1 only, once per policy per round,
the policies interleaved within each round, and reports each policy's median CPU time per block
and its extra cost over the first policy listed (the machine's run-to-run noise hits every
policy alike, and the median keeps one disturbed round from deciding). Written to
``results/bench_admission_policies.json``.

``--baseline SRC`` measures another checkout's code (SRC is its ``src`` folder, e.g. a git
worktree of the previous release) in the same run: this code through ``add_sequence_batch``,
the baseline through ``add_sequence_batch`` and through ``add_sequence``, each in its own
process, interleaved for ``--rounds`` rounds; each row keeps its minimum CPU time (the machine's
noise only ever adds) and its ratio to the baseline's rows. Written to
``results/bench_admission_baseline.json``.

Usage: .venv/bin/python benchmarks/bench_admission.py [--quick] [--skip-w2] [--policy NAME]
       [--no-gc] [--trace PATH] [--entry add_sequence_batch|add_sequence]
       [--compare-policies NAMES [--rounds N]] [--baseline SRC [--rounds N]]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report
from kvpool import (
    BlockHasher,
    CacheConfig,
    HashAlgo,
    KVCacheManager,
    OutOfBlocksError,
    SequenceRequest,
)

# the public API only, so that --baseline can run a checkout with another module layout
from kvpool.config import EvictionConfig
from kvpool.replay.workloads import builtin_trace

TPB = 32
DEFAULT_POLICY = EvictionConfig().policy
VOCAB = 128_256  # Llama 3's vocabulary size: W1's token ids are in [0, VOCAB)
WITH_GC = True  # --no-gc: turn the garbage collector off in the timed loops
TRACE = builtin_trace("conversation")  # shipped in kvpool/data
ENTRIES = ("add_sequence_batch", "add_sequence")
ENTRY = ENTRIES[0]  # --entry: how requests enter the manager


def admit(m: KVCacheManager, request: SequenceRequest) -> None:
    """Admit one request through the entry point chosen by ``--entry``."""
    if ENTRY == "add_sequence":
        m.add_sequence(request)
    else:
        m.add_sequence_batch([request])


@functools.cache  # the requests are only read: build them once per size
def w1_requests(n: int) -> list[list[int]]:
    """Token ids drawn from a real vocabulary's range (VOCAB): a random 32-token block repeats
    with negligible probability, so the unique halves never match anything."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(1024)] for _ in range(8)]
    return [prompts[i % 8] + [rng.randrange(VOCAB) for _ in range(1024)] for i in range(n)]


class HashTimer:
    """Accumulates the wall time of every BlockHasher hashing call while active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = (BlockHasher.extend, BlockHasher.key_of_prefix_block)
        # a checkout from before keys_after (a baseline) commits through extend only
        self._orig_after = getattr(BlockHasher, "keys_after", None)

    def __enter__(self) -> HashTimer:
        orig_extend, orig_key = self._orig
        orig_after = self._orig_after
        timer = self

        def after(h: BlockHasher, keys: object, raw: object) -> object:
            t0 = time.perf_counter()
            try:
                return orig_after(h, keys, raw)  # type: ignore[misc,arg-type]
            finally:
                timer.seconds += time.perf_counter() - t0

        def extend(h: BlockHasher, tokens: object) -> object:
            t0 = time.perf_counter()
            try:
                return orig_extend(h, tokens)  # type: ignore[arg-type]
            finally:
                timer.seconds += time.perf_counter() - t0

        def key(h: BlockHasher, tokens: object) -> object:
            t0 = time.perf_counter()
            try:
                return orig_key(h, tokens)  # type: ignore[arg-type]
            finally:
                timer.seconds += time.perf_counter() - t0

        BlockHasher.extend = extend  # type: ignore[method-assign,assignment]
        BlockHasher.key_of_prefix_block = key  # type: ignore[method-assign,assignment]
        if orig_after is not None:
            BlockHasher.keys_after = after  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        BlockHasher.extend, BlockHasher.key_of_prefix_block = self._orig  # type: ignore[method-assign]
        if self._orig_after is not None:
            BlockHasher.keys_after = self._orig_after  # type: ignore[method-assign]


def run_w1(n: int, algo: HashAlgo, host_blocks: int, policy: str = "lru") -> dict[str, object]:
    reqs = w1_requests(n)
    m = KVCacheManager(CacheConfig(
        tokens_per_block=TPB, gpu_blocks=20_000, hash_algo=algo, host_blocks=host_blocks,
        eviction=EvictionConfig(policy=policy)))
    gc.collect()
    if not WITH_GC:
        gc.disable()
    with HashTimer() as ht:
        t0 = time.perf_counter()
        c0 = time.process_time()
        for i, toks in enumerate(reqs):
            admit(m, SequenceRequest(i, toks))
            m.store_context_blocks(i, len(toks))
            m.remove_sequence(i)
        total = time.perf_counter() - t0
        cpu = time.process_time() - c0
    gc.enable()
    hashing = ht.seconds
    blocks = sum(-(-len(t) // TPB) for t in reqs)
    st = m.stats()
    return {
        "workload": "W1", "algo": algo.value, "policy": policy, "requests": n,
        "prompt_blocks": blocks,
        "total_s": total, "cpu_s": cpu, "hashing_s": hashing, "manager_s": total - hashing,
        "us_per_request": total / n * 1e6,
        "us_per_block_incl_hash": total / blocks * 1e6,
        "us_per_block_excl_hash": (total - hashing) / blocks * 1e6,
        "block_hit_rate": st.hit_rate, "token_hit_rate": st.token_hit_rate,
        "early_releases": 0, "gc": WITH_GC,
    }


def run_w2(path: Path, n: int, algo: HashAlgo, host_blocks: int,
           policy: str = "lru") -> dict[str, object]:
    from kvpool.replay.workloads import load_mooncake

    wl = load_mooncake(path, limit=n)
    reqs = [list(r.tokens) for r in wl.requests]
    m = KVCacheManager(CacheConfig(
        tokens_per_block=TPB, gpu_blocks=20_000, hash_algo=algo, host_blocks=host_blocks,
        eviction=EvictionConfig(policy=policy)))
    held: collections.deque[int] = collections.deque()
    early = 0
    gc.collect()
    if not WITH_GC:
        gc.disable()
    ht = HashTimer().__enter__()
    t0 = time.perf_counter()
    c0 = time.process_time()
    for i, toks in enumerate(reqs):
        while True:
            try:
                admit(m, SequenceRequest(i, toks))
                break
            except OutOfBlocksError:
                if not held:
                    raise
                j = held.popleft()
                m.remove_sequence(j)
                early += 1
        m.store_context_blocks(i, len(toks))
        held.append(i)
        if len(held) > 31:
            m.remove_sequence(held.popleft())
    while held:
        m.remove_sequence(held.popleft())
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    ht.__exit__()
    gc.enable()
    hashing = ht.seconds
    blocks = sum(-(-len(t) // TPB) for t in reqs)
    st = m.stats()
    tiers = st.tier_hits
    return {
        "workload": "W2" + (f"+host{host_blocks}" if host_blocks else ""), "algo": algo.value,
        "policy": policy,
        "requests": n, "prompt_blocks": blocks,
        "total_s": total, "cpu_s": cpu, "hashing_s": hashing, "manager_s": total - hashing,
        "us_per_request": total / n * 1e6,
        "us_per_block_incl_hash": total / blocks * 1e6,
        "us_per_block_excl_hash": (total - hashing) / blocks * 1e6,
        "block_hit_rate": st.hit_rate, "token_hit_rate": st.token_hit_rate,
        "gpu_tier_hits": tiers[0], "host_tier_hits": tiers[1],
        "early_releases": early, "gc": WITH_GC,
    }


def compare_policies(policies: list[str], rounds: int, n: int) -> None:
    """W1 once per policy per round, interleaved; medians and extra cost over policies[0]."""
    cpu: dict[str, list[float]] = {p: [] for p in policies}
    hit: dict[str, float] = {}
    for r in range(rounds):
        for p in policies:
            row = run_w1(n, HashAlgo.V2_SHA256, 0, p)
            cpu[p].append(float(row["cpu_s"]))  # type: ignore[arg-type]
            hit[p] = float(row["block_hit_rate"])  # type: ignore[arg-type]
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{p} {cpu[p][-1]:.3f} s" for p in policies),
              flush=True)
    blocks = n * 64
    base = statistics.median(cpu[policies[0]])
    rows = [{
        "policy": p, "rounds": rounds, "median_cpu_s": statistics.median(cpu[p]),
        "us_per_block": statistics.median(cpu[p]) / blocks * 1e6,
        "extra_vs_" + policies[0]: f"{statistics.median(cpu[p]) / base - 1:+.1%}",
        "min_cpu_s": min(cpu[p]), "max_cpu_s": max(cpu[p]), "block_hit_rate": hit[p],
    } for p in policies]
    report("bench_admission_policies", rows,
           title=f"W1 per eviction policy: median of {rounds} interleaved rounds (CPU time)",
           extra={"cpu_s": cpu})


def compare_with(baseline: Path, rounds: int, child_args: list[str]) -> None:
    """This code and ``baseline``'s, each run in its own process, interleaved (docstring)."""
    variants = [("this", None, ENTRIES[0]), ("baseline", baseline, ENTRIES[0]),
                ("baseline", baseline, ENTRIES[1])]
    best: dict[tuple[str, str, str], dict[str, object]] = {}
    for r in range(rounds):
        for code, src, entry in variants:
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = str(src)
            out = subprocess.run(
                [sys.executable, __file__, "--rows-json", "--entry", entry, *child_args],
                env=env, check=True, capture_output=True, text=True).stdout
            for row in json.loads(out.splitlines()[-1]):
                key = (str(row["workload"]), code, entry)
                if key not in best or float(row["cpu_s"]) < float(best[key]["cpu_s"]):  # type: ignore[arg-type]
                    best[key] = row
        print(f"round {r + 1}/{rounds} done", flush=True)
    rows = []
    for (workload, code, entry), row in best.items():
        base = {e: float(best[workload, "baseline", e]["cpu_s"]) for e in ENTRIES}  # type: ignore[arg-type]
        cpu = float(row["cpu_s"])  # type: ignore[arg-type]
        rows.append({
            "workload": workload, "code": code, "entry": entry, "min_cpu_s": cpu,
            "vs_base_batch": f"{cpu / base[ENTRIES[0]]:.2f}x",
            "vs_base_add_seq": f"{cpu / base[ENTRIES[1]]:.2f}x",
            "block_hit_rate": row["block_hit_rate"],
        })
    report("bench_admission_baseline", rows,
           title=f"this code vs {baseline} (min CPU time of {rounds} interleaved rounds)",
           extra={"baseline": str(baseline), "rows": [dict(r) for r in best.values()]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs while developing")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--algo", default="v2_sha256", choices=[a.value for a in HashAlgo])
    ap.add_argument("--skip-w2", action="store_true")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help=f"CacheConfig.eviction.policy (default: the library's, {DEFAULT_POLICY})")
    ap.add_argument("--no-gc", action="store_true",
                    help="turn Python's garbage collector off in the timed loops (default: on)")
    ap.add_argument("--compare-policies", metavar="NAMES",
                    help="W1 only: comma-separated policies, interleaved (see the docstring)")
    ap.add_argument("--rounds", type=int, default=8,
                    help="rounds of --compare-policies or --baseline")
    ap.add_argument("--entry", default=ENTRIES[0], choices=ENTRIES,
                    help="how requests enter the manager (default: add_sequence_batch)")
    ap.add_argument("--baseline", type=Path, metavar="SRC",
                    help="another checkout's src folder, measured in the same run")
    ap.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global WITH_GC, ENTRY
    WITH_GC = not args.no_gc
    ENTRY = args.entry
    if args.baseline is not None:
        child = ["--algo", args.algo, "--policy", args.policy, "--trace", str(args.trace)]
        child += ["--quick"] * args.quick + ["--skip-w2"] * args.skip_w2
        child += ["--no-gc"] * args.no_gc
        compare_with(args.baseline, args.rounds, child)
        return
    if args.compare_policies:
        compare_policies(args.compare_policies.split(","), args.rounds,
                         400 if args.quick else 2000)
        return
    algo = HashAlgo(args.algo)
    rows = [run_w1(400 if args.quick else 2000, algo, 0, args.policy)]
    if not args.skip_w2:
        n = 800 if args.quick else 4000
        rows.append(run_w2(args.trace, n, algo, 0, args.policy))
        rows.append(run_w2(args.trace, n, algo, 80_000, args.policy))
    if args.rows_json:  # a --baseline child: the rows for the parent, nothing written
        print(json.dumps(rows))
        return
    report("bench_admission", rows,
           title=f"kvpool admission through {ENTRY} (tpb 32, 20,000 GPU blocks)")


if __name__ == "__main__":
    main()
