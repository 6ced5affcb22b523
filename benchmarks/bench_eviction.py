"""Per-block cost of every eviction policy on the manager's W1 queue pattern.

The pattern (what ``KVCacheManager`` asks of a GPU pool's queue on W1, a 32-block system
prompt shared by every request, 32 new blocks each): per request ``remove_many`` of the 32
claimed system-prompt slots, ``pop_many`` of 32 victims once the free list is empty, and
``push_many`` of the 64 released slots tail first (system prompt slots last) with their keys.
Pool: 20,000 slots (``capacity`` given, as ``make_policies`` does).

Key patterns: ``repeated`` releases the same 64 keys every request (the history recalls
them: the scan-resistant policies see counts above 1); ``fresh`` gives all 64 blocks new keys
every request (every block is new to the history, which fills and trims); ``w1`` keeps the
system prompt's keys and gives the 32 new blocks new ones (what W1 does). New keys cost the
scan-resistant policies their history's dict work (hashing a key the first time, a lookup
per released block, an insert per victim, the trims), the same before and after a queue
change: that work bounds how cheap ``fresh`` and ``w1`` can get.

Each (policy, keys) case warms up until the free list is empty and victims are popped, then
runs ``--rounds`` rounds of ``--requests`` requests; a row gives the median CPU time
(``time.process_time``) per block released (64 per request), keys made beforehand.
``--baseline FILE`` loads another version of the policies from one file (say, the single-file
``kvpool/eviction.py`` of a release before the ``kvpool.eviction`` package: ``git worktree add
/tmp/base 7d96295`` then ``--baseline /tmp/base/src/kvpool/eviction.py``) and runs it
interleaved round by round with the current one, in the same process, so that both see the
same machine load.

Usage: .venv/bin/python benchmarks/bench_eviction.py [--requests N] [--rounds R] [--baseline FILE]
       [--policies lru,2q]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report
from kvpool import eviction

CAPACITY = 20_000
SYSTEM = 32  # shared system-prompt blocks per request
NEW = 32  # new blocks per request
PRIORITY = 35
PATTERNS = ("repeated", "fresh", "w1")


class Case:
    """One policy's queue driven through the W1 pattern, with its free list."""

    def __init__(self, module: ModuleType, policy: str, pattern: str, seed: int) -> None:
        self.q = module.make_policy(policy, time.monotonic, capacity=CAPACITY)
        self.rng = random.Random(seed)
        self.pattern = pattern
        self.free = list(range(CAPACITY))
        self.sys_slots = [self.free.pop() for _ in range(SYSTEM)]
        self.sys_keys = [self.rng.randbytes(32) for _ in range(SYSTEM)]
        self.new_keys = [self.rng.randbytes(32) for _ in range(NEW)]
        self.q.push_many(self.sys_slots[::-1], PRIORITY, keys=self.sys_keys[::-1])

    def keys(self, n: int) -> list[list[bytes]]:
        """The keys of the next ``n`` requests, tail first (made outside the timed loop)."""
        out = []
        for _ in range(n):
            if self.pattern == "repeated":
                k = self.sys_keys + self.new_keys
            elif self.pattern == "fresh":
                k = [self.rng.randbytes(32) for _ in range(SYSTEM + NEW)]
            else:
                k = self.sys_keys + [self.rng.randbytes(32) for _ in range(NEW)]
            out.append(k[::-1])
        return out

    def run(self, keys: list[list[bytes]]) -> float:
        """CPU seconds for one request per entry of ``keys``."""
        q, free, sys_slots = self.q, self.free, self.sys_slots
        gc.collect()
        gc.disable()
        t0 = time.process_time()
        for k in keys:
            q.remove_many(sys_slots)
            if len(free) >= NEW:
                new = free[-NEW:]
                del free[-NEW:]
            else:
                new = [s for s, _ in q.pop_many(NEW - len(free))] + free
                free.clear()
            q.push_many((sys_slots + new)[::-1], PRIORITY, keys=k)
        dt = time.process_time() - t0
        gc.enable()
        return dt

    def warm_up(self, requests: int) -> None:
        while self.free:
            self.run(self.keys(min(100, len(self.free) // NEW + 1)))
        self.run(self.keys(requests))


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpool_eviction_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(versions: dict[str, ModuleType], policy: str, pattern: str, requests: int,
            rounds: int) -> dict[str, float]:
    """Median µs per block of each version, rounds interleaved (alternating who goes first)."""
    cases = {v: Case(m, policy, pattern, seed=1) for v, m in versions.items()}
    for case in cases.values():
        case.warm_up(requests)
    times: dict[str, list[float]] = {v: [] for v in versions}
    order = list(cases)
    for r in range(rounds):
        for v in order if r % 2 == 0 else order[::-1]:
            case = cases[v]
            times[v].append(case.run(case.keys(requests)) / (requests * (SYSTEM + NEW)) * 1e6)
    return {v: statistics.median(t) for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline", type=Path, help="a one-file eviction module to compare with")
    ap.add_argument("--policies", default=",".join(eviction.POLICIES))
    args = ap.parse_args()
    versions = {"current": eviction}
    if args.baseline:
        versions = {"baseline": load(args.baseline), "current": eviction}
    rows: list[dict[str, Any]] = []
    for policy in args.policies.split(","):
        for pattern in PATTERNS:
            med = measure(versions, policy, pattern, args.requests, args.rounds)
            row: dict[str, Any] = {"policy": policy, "keys": pattern}
            if args.baseline:
                row["baseline_us_per_block"] = med["baseline"]
            row["us_per_block"] = med["current"]
            if args.baseline:
                row["speedup"] = med["baseline"] / med["current"]
            rows.append(row)
            print(f"  {policy:7} {pattern:9} " + "  ".join(
                f"{v} {t:.3f} us/block" for v, t in med.items()), flush=True)
    extra: dict[str, Any] = {
        "pattern": f"W1 queue pattern: remove_many {SYSTEM}, pop_many {NEW}, push_many "
                   f"{SYSTEM + NEW} per request; {CAPACITY} slots",
        "requests_per_round": args.requests, "rounds": args.rounds,
        "statistic": "median CPU us per released block",
    }
    if args.baseline:
        extra["baseline"] = str(args.baseline)
    report("bench_eviction", rows, title="kvpool eviction policies: W1 queue pattern, "
           "CPU µs per block (median)", extra=extra)


if __name__ == "__main__":
    main()
