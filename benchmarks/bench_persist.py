"""The persistent disk tier's costs: manifest upkeep per offloaded block, warm restart, spill.

A manager with real torch storage on the CPU (GPU, host and disk tiers) serves distinct prompts
that push every block through host to disk, once with ``disk_persistent=False`` and once with
``True`` (alternating, same workload): the difference per block written to disk is what keeping
the manifest costs the scheduler thread (the hash of each block written, the drop / put / path
records, one ``write`` per call). Then a manager is started on the filled ``disk_path`` (the
warm restart: manifest replay, every recorded slot read back and hashed, the tree rebuilt) and
closed again after serving the workload once more (the spill of the GPU and host tiers).

Run: ``.venv/bin/python benchmarks/bench_persist.py`` (``--quick`` for a smaller disk tier).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool import CacheConfig, KVCacheManager, SequenceRequest
from kvpool.config import DiskConfig, EvictionConfig
from kvpool.tiers.storage import GroupGeometry

TPB = 16
GEOMETRY = GroupGeometry(num_layers=2, kv_heads=8, head_dim=64, dtype="float16")  # 64 KiB
BLOCKS_PER_PROMPT = 4


def config(path: str, disk_blocks: int, persistent: bool) -> CacheConfig:
    return CacheConfig(tokens_per_block=TPB, gpu_blocks=64, host_blocks=64,
                       disk_blocks=disk_blocks, layer_geometry=[GEOMETRY], device="cpu",
                       model_id="bench",
                       disk=DiskConfig(path=path, persistent=persistent, sync_interval_s=None),
                       eviction=EvictionConfig(offload_min_priority=0))


def serve(m: KVCacheManager, prompts: list[list[int]], tag: str) -> float:
    """Seconds to admit, store and release every prompt (the engine writes nothing)."""
    start = time.perf_counter()
    for k, tokens in enumerate(prompts):
        m.add_sequence(SequenceRequest(f"{tag}{k}", tokens))
        m.store_context_blocks(f"{tag}{k}", len(tokens))
        m.remove_sequence(f"{tag}{k}")
    return time.perf_counter() - start


def upkeep(prompts: list[list[int]], disk_blocks: int, repeats: int) -> list[dict[str, Any]]:
    """Serving time with and without a persistent tier, per block offloaded to disk."""
    times: dict[bool, list[float]] = {False: [], True: []}
    offloaded: dict[bool, int] = {}
    for _ in range(repeats):
        for persistent in (False, True):
            with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as path:
                m = KVCacheManager(config(path, disk_blocks, persistent))
                m.tensors(0, 0).view(torch.uint8).random_(0, 256)
                times[persistent].append(serve(m, prompts, "p"))
                stats = m.stats()
                offloaded[persistent] = stats.offload_blocks
                m.close()
    # every block passes through the GPU (64 slots) and host (64) tiers on its way to disk
    to_disk = len(prompts) * BLOCKS_PER_PROMPT - 2 * 64
    rows = []
    for persistent in (False, True):
        best = min(times[persistent])
        rows.append({
            "disk tier": "persistent" if persistent else "plain",
            "prompts": len(prompts),
            "offloads": offloaded[persistent],
            "to disk": to_disk,
            "best s": round(best, 4),
            "median s": round(statistics.median(times[persistent]), 4),
            "µs per disk block over plain": (
                round((best - min(times[False])) / max(to_disk, 1) * 1e6, 1)
                if persistent else 0.0),
        })
    return rows


def restart(prompts: list[list[int]], disk_blocks: int) -> list[dict[str, Any]]:
    """Warm restart on a full disk tier, then a graceful close that spills."""
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as path:
        m = KVCacheManager(config(path, disk_blocks, True))
        m.tensors(0, 0).view(torch.uint8).random_(0, 256)
        serve(m, prompts, "fill")
        m.close()
        start = time.perf_counter()
        m = KVCacheManager(config(path, disk_blocks, True))
        restart_s = time.perf_counter() - start
        disk = m.persistent_disk
        assert disk is not None
        restored = disk.restored.slots
        serve(m, prompts[: len(prompts) // 4], "again")
        start = time.perf_counter()
        m.close()
        close_s = time.perf_counter() - start
        nbytes = restored * GEOMETRY.block_bytes(TPB)
        return [{
            "restored slots": restored,
            "restart s": round(restart_s, 4),
            "restart GB/s read": round(nbytes / restart_s / 1e9, 2),
            "µs per restored block": round(restart_s / max(restored, 1) * 1e6, 1),
            "close (spill) s": round(close_s, 4),
        }]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1,024 disk blocks, 2 repeats")
    args = parser.parse_args()
    disk_blocks, repeats = (1024, 2) if args.quick else (args.disk_blocks, args.repeats)
    n = disk_blocks // BLOCKS_PER_PROMPT + 64  # enough to fill the disk tier and wrap around
    prompts = [[(k * BLOCKS_PER_PROMPT * TPB + j) % 1_000_000 + 1
                for j in range(BLOCKS_PER_PROMPT * TPB)] for k in range(n)]
    rows = upkeep(prompts, disk_blocks, repeats) + restart(prompts, disk_blocks)
    block_bytes = GEOMETRY.block_bytes(TPB)
    report(
        "persist",
        rows,
        title=f"persistent disk tier: {disk_blocks} disk blocks of {block_bytes // 1024} KiB",
        extra={"block_bytes": block_bytes, "disk_blocks": disk_blocks, "tokens_per_block": TPB,
               "torch": torch.__version__},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
