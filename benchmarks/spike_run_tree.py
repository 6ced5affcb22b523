"""Spike for issue 3: would a run-compressed prefix tree meet W1's targets in pure Python?

Not library code. The block manager keeps one tree node per cached block, and each block costs
a few microseconds of interpreter work spread over matching, allocation, commit, release and
eviction. This spike replaces that core, for W1's configuration only, by a tree whose node is a
*run* of blocks (one node per stretch of blocks that no request has branched from, as SGLang's
radix cache compresses tokens): matching compares a whole run's token bytes at once, a
sequence holds a reference per run, a commit adds one run, an eviction drops a whole
unreferenced leaf run (tail first, least recently released first). Keys are computed as the
manager computes them (``BlockHasher``, v2_sha256, only for the blocks that enter the tree).

What it leaves out (a real core must add them; most cost per run, not per block): layer
groups and sliding windows, partial matches, priorities and the segmented policies (it
evicts whole runs in release order), colder tiers, events, beams, the two-phase batch plan.

W1 exactly as ``bench_admission.py`` (same requests): each request converted and validated
(``SequenceRequest``), added, stored and removed alone, 20,000 blocks of 32 tokens. Rows: the
spike and ``KVCacheManager`` (default policy, and LRU), interleaved over ``--rounds``, medians
of CPU time; the block hit rate must match.

    .venv/bin/python benchmarks/spike_run_tree.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_admission import TPB, w1_requests
from common import report
from kvpool.config import CacheConfig, SequenceRequest
from kvpool.hashing import BlockHasher, BlockKey
from kvpool.manager import KVCacheManager

GPU_BLOCKS = 20_000
ALGO = "v2_sha256"


class Run:
    """A stretch of cached blocks: their tokens (u32 bytes), keys and slots."""

    __slots__ = ("children", "keys", "parent", "ref", "slots", "tkey")

    def __init__(self, tkey: bytes, keys: list[BlockKey], slots: list[int],
                 parent: Run | None) -> None:
        self.tkey = tkey
        self.keys = keys
        self.slots = slots
        self.parent = parent
        self.children: dict[bytes, Run] = {}  # first block's bytes -> run
        self.ref = 0  # sequences holding the run (a held run is held whole)


class RunTree:
    """The spike's core: add (match, claim, allocate), remove (commit, release)."""

    def __init__(self, tpb: int, slots: int) -> None:
        self.tpb = tpb
        self.step = 4 * tpb
        self.free = list(range(slots - 1, -1, -1))
        self.root_key = BlockHasher.root_key(ALGO)
        self.root = Run(b"", [], [], None)
        self.evictable: OrderedDict[int, Run] = OrderedDict()  # unreferenced leaves, oldest first
        self.seqs: dict[int, tuple[SequenceRequest, list[Run], list[int]]] = {}
        self.reused_blocks = 0

    def add(self, r: SequenceRequest) -> list[int]:
        raw = bytes(r.tokens)
        step = self.step
        body = (len(r.tokens) - 1) // self.tpb * step
        node, off, path = self.root, 0, []
        while off < body:
            child = node.children.get(raw[off:off + step])
            if child is None:
                break
            n = len(child.tkey)
            if off + n <= body and raw[off:off + n] == child.tkey:
                path.append(child)
                off += n
                node = child
                continue
            nb = 1  # blocks shared with the run: split it there
            while ((nb + 1) * step <= min(n, body - off)
                   and raw[off + nb * step:off + (nb + 1) * step]
                   == child.tkey[nb * step:(nb + 1) * step]):
                nb += 1
            self._split(child, nb)
            path.append(child)
            break
        table: list[int] = []
        for run in path:
            if not run.ref:
                self.evictable.pop(id(run), None)
            run.ref += 1
            table += run.slots
        self.reused_blocks += len(table)
        table += self._alloc(-(-len(r.tokens) // self.tpb) - len(table))
        self.seqs[r.seq_id] = (r, path, table)
        return table

    def remove(self, seq_id: int) -> None:
        r, path, table = self.seqs.pop(seq_id)
        step = self.step
        done = sum(len(run.slots) for run in path)  # blocks matched in the tree
        full = (len(r.tokens) - 1) // self.tpb
        parent = path[-1] if path else self.root
        if full > done:
            raw = bytes(r.tokens)
            h = BlockHasher(ALGO, self.tpb, root=self.root_key)
            h.resume([parent.keys[-1]] if parent.keys else [])
            keys = h.extend(r.tokens[done * self.tpb:full * self.tpb])
            run = Run(raw[done * step:full * step], keys, table[done:full], parent)
            parent.children[run.tkey[:step]] = run
            self.evictable[id(run)] = run
        self.free += table[full:]  # the last, partial block
        for run in reversed(path):
            run.ref -= 1
            if not run.ref and not run.children:
                self.evictable[id(run)] = run

    def _split(self, run: Run, nb: int) -> None:
        """Cut ``run`` after ``nb`` blocks; the tail becomes its only child."""
        step = self.step
        tail = Run(run.tkey[nb * step:], run.keys[nb:], run.slots[nb:], run)
        tail.children, tail.ref = run.children, run.ref
        for c in tail.children.values():
            c.parent = tail
        run.tkey = run.tkey[:nb * step]
        del run.keys[nb:], run.slots[nb:]
        run.children = {tail.tkey[:step]: tail}
        if self.evictable.pop(id(run), None) is not None:
            self.evictable[id(tail)] = tail

    def _alloc(self, n: int) -> list[int]:
        free, ev = self.free, self.evictable
        while len(free) < n:
            _, run = ev.popitem(last=False)
            free += reversed(run.slots)  # the whole leaf run goes
            parent = run.parent
            assert parent is not None
            del parent.children[run.tkey[:self.step]]
            if not parent.children and not parent.ref and parent.parent is not None:
                ev[id(parent)] = parent
                ev.move_to_end(id(parent), last=False)  # next in line: its child just went
        out = free[len(free) - n:]
        del free[len(free) - n:]
        return out


def _cpu(admit: Callable[[SequenceRequest], object], remove: Callable[[int], object],
         reqs: list[list[int]]) -> float:
    """CPU seconds of W1's loop (garbage collector off, as in bench_admission)."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for i, tokens in enumerate(reqs):
            admit(SequenceRequest(i, tokens))
            remove(i)
        return time.process_time() - t0
    finally:
        gc.enable()


def run_spike(reqs: list[list[int]]) -> tuple[float, float]:
    tree = RunTree(TPB, GPU_BLOCKS)
    cpu = _cpu(tree.add, tree.remove, reqs)
    return cpu, tree.reused_blocks / (len(reqs) * 2048 // TPB)


def run_manager(reqs: list[list[int]], policy: str | None) -> tuple[float, float]:
    cfg = (CacheConfig(tokens_per_block=TPB, gpu_blocks=GPU_BLOCKS) if policy is None
           else CacheConfig(tokens_per_block=TPB, gpu_blocks=GPU_BLOCKS, eviction_policy=policy))
    m = KVCacheManager(cfg)
    cpu = _cpu(m.add_sequence, m.remove_sequence, reqs)
    s = m.stats()
    return cpu, s.reused_tokens / s.prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    reqs = w1_requests(2000)
    default = CacheConfig.__dataclass_fields__["eviction_policy"].default
    impls = {
        f"KVCacheManager ({default})": lambda: run_manager(reqs, None),
        "KVCacheManager (lru)": lambda: run_manager(reqs, "lru"),
        "spike: run tree": lambda: run_spike(reqs),
    }
    times: dict[str, list[float]] = {k: [] for k in impls}
    hits: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            cpu, hit = fn()
            times[name].append(cpu)
            hits[name] = hit
    # the spike must reuse exactly what the manager reuses on W1, or its time means nothing
    assert len({round(h, 6) for h in hits.values()}) == 1, hits
    blocks = len(reqs) * 2048 // TPB
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({
            "core": name,
            "W1 cpu s (median)": round(med, 3),
            "us/request": round(med / len(reqs) * 1e6, 1),
            "us/block incl. hashing": round(med / blocks * 1e6, 2),
            "hit rate": round(hits[name], 3),
            "target": "0.35 s",
        })
    report("spike_run_tree", rows, title=f"W1, {args.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
