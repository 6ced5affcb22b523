"""Offload / onboard throughput of TorchStorage.copy_blocks against one contiguous copy_.

4,096 blocks of 256 KiB (1 GiB) move between tiers through ``copy_blocks`` with random,
non-contiguous slot indices on both sides; the baseline is a single contiguous ``copy_`` of the
same bytes between the same pools. The ratio (batched / contiguous throughput) is the figure
of merit: 1.0 means scattered blocks cost nothing over one big memcpy.

Rows also show the alternatives considered for the batched op (plain torch, offload direction):
``index_select`` into a preallocated staging tensor then ``index_copy_``, advanced-indexing
assignment ``dst[idx] = src[idx]``, and one ``_foreach_copy_`` without the worker-thread split
(each block then runs its own intra-op parallel region). Where CUDA is present the
host↔device (pinned) and device→device paths are measured too, through the Triton kernel
(:mod:`kvpool.tiers.copy_kernels`) and through torch's per-block copies; ``--no-cpu`` skips the
CPU paths.

Run: ``.venv/bin/python benchmarks/bench_copy.py`` (``--quick`` for 1,024 blocks and fewer repeats).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.tiers.storage import BlockCopy, GroupGeometry, Tier
from kvpool.tiers.torch_storage import TorchStorage

TPB = 16
GEOMETRY = GroupGeometry(num_layers=4, kv_heads=8, head_dim=128, dtype="float16")  # 256 KiB
TIER_NAMES = {Tier.GPU: "tier0", Tier.HOST: "host", Tier.DISK: "disk"}


def timed(
    fns: Sequence[Callable[[], object]], repeats: int, sync: Callable[[], None]
) -> list[list[float]]:
    """Seconds per call of each of ``fns``, after one warm-up call each (which also faults
    pages in). Calls alternate, so on a busy machine every candidate sees the same load."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
        sync()
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return times


def row(
    device: str, path: str, nbytes: int, blocks: int, batched: list[float], contiguous: list[float]
) -> dict[str, Any]:
    best_b, best_c = min(batched), min(contiguous)
    return {
        "device": device,
        "path": path,
        "blocks": blocks,
        "MiB": nbytes // 2**20,
        "batched GB/s": nbytes / best_b / 1e9,
        "batched median GB/s": nbytes / statistics.median(batched) / 1e9,
        "contiguous GB/s": nbytes / best_c / 1e9,
        "ratio": best_c / best_b,
    }


def random_copies(
    src_tier: int, dst_tier: int, blocks: int, gen: torch.Generator
) -> list[BlockCopy]:
    """``blocks`` copies with random slots on both sides. Within one pool (a key may not read
    a slot it writes) sources come from the first half and destinations from the second."""
    if src_tier == dst_tier:
        src = torch.randperm(blocks, generator=gen).tolist()
        dst = (torch.randperm(blocks, generator=gen) + blocks).tolist()
    else:
        src = torch.randperm(blocks, generator=gen).tolist()
        dst = torch.randperm(blocks, generator=gen).tolist()
    return [BlockCopy(src_tier, s, dst_tier, d, 0) for s, d in zip(src, dst, strict=True)]


def contiguous_copy(
    storage: TorchStorage, src_tier: int, dst_tier: int, moved: int
) -> Callable[[], object]:
    """One contiguous copy of ``moved`` blocks between the two pools: a ``copy_`` in memory,
    one ``pwrite``/``preadv`` of the whole range for the disk tier (the disk pool is a file)."""
    if Tier.DISK not in (src_tier, dst_tier):
        src = storage.tensors(0, src_tier)[:moved].view(-1)
        dst = storage.tensors(0, dst_tier)[-moved:].view(-1)
        return lambda: dst.copy_(src, non_blocking=True)
    mem_tier = dst_tier if src_tier == Tier.DISK else src_tier
    memory = storage.tensors(0, mem_tier)[:moved].view(torch.uint8).reshape(-1).numpy()
    fd = os.open(storage.disk_files[0], os.O_RDWR)
    weakref.finalize(storage, os.close, fd)
    if dst_tier == Tier.DISK:
        return lambda: os.pwrite(fd, memory, 0)
    return lambda: os.preadv(fd, [memory], 0)


def bench_storage(
    storage: TorchStorage,
    paths: Sequence[tuple[int, int, str]],
    blocks: int,
    repeats: int,
    sync: Callable[[], None],
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    device = str(storage.device)
    rows = []
    for src_tier, dst_tier, label in paths:
        moved = blocks // 2 if src_tier == dst_tier else blocks
        nbytes = moved * storage.block_bytes(0)
        copies = random_copies(src_tier, dst_tier, moved, gen)

        def batched(copies: list[BlockCopy] = copies) -> None:
            storage.copy_blocks(copies)
            storage.synchronize()

        contiguous = contiguous_copy(storage, src_tier, dst_tier, moved)

        rows.append(
            row(
                device,
                f"{TIER_NAMES[Tier(src_tier)]}→{TIER_NAMES[Tier(dst_tier)]} ({label})",
                nbytes,
                moved,
                *timed([batched, contiguous], repeats, sync),
            )
        )
    return rows


def bench_alternatives(storage: TorchStorage, blocks: int, repeats: int) -> list[dict[str, Any]]:
    """The batched ops not chosen, on the offload path, for the record."""
    gen = torch.Generator().manual_seed(1)
    src = storage.tensors(0, Tier.GPU)
    dst = storage.tensors(0, Tier.HOST)
    src_idx = torch.randperm(blocks, generator=gen)
    dst_idx = torch.randperm(blocks, generator=gen)
    staging = torch.empty_like(src)
    nbytes = blocks * storage.block_bytes(0)

    def staged() -> None:
        dst.index_copy_(0, dst_idx, torch.index_select(src, 0, src_idx, out=staging))

    def advanced() -> None:
        dst[dst_idx] = src[src_idx]

    src_list, dst_list = src_idx.tolist(), dst_idx.tolist()
    src_views, dst_views = src.unbind(0), dst.unbind(0)

    def one_foreach() -> None:
        torch._foreach_copy_([dst_views[i] for i in dst_list], [src_views[i] for i in src_list])

    def contiguous() -> None:
        dst.copy_(src)

    candidates = [
        ("index_select + index_copy_", staged),
        ("advanced-indexing assignment", advanced),
        ("one _foreach_copy_, no thread split", one_foreach),
    ]
    *measured, base = timed([fn for _, fn in candidates] + [contiguous], repeats, lambda: None)
    return [
        row("cpu", f"tier0→host via {name}", nbytes, blocks, times, base)
        for (name, _), times in zip(candidates, measured, strict=True)
    ]


def cpu_rows(args: argparse.Namespace, blocks: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as disk:
        disk_slots = 0 if args.no_disk else blocks
        with TorchStorage(
            TPB, [GEOMETRY], [[blocks], [blocks], [disk_slots]], device="cpu", disk_path=disk
        ) as cpu:
            cpu.tensors(0).view(torch.uint8).random_(0, 256, generator=torch.Generator())
            paths = [
                (Tier.GPU, Tier.HOST, "offload"),
                (Tier.HOST, Tier.GPU, "onboard"),
                (Tier.GPU, Tier.GPU, "same tier"),
            ]
            if disk_slots:
                paths += [(Tier.HOST, Tier.DISK, "offload"), (Tier.DISK, Tier.HOST, "onboard")]
            rows += bench_storage(cpu, paths, blocks, repeats, lambda: None)
            if not args.no_alternatives:
                rows += bench_alternatives(cpu, blocks, repeats)
    return rows


def cuda_rows(blocks: int, repeats: int) -> list[dict[str, Any]]:
    """Host↔device (pinned) and device copies, through the Triton kernel (the default with
    Triton) and through torch's per-block copies (``kernel=False``)."""
    from kvpool.tiers.copy_kernels import available

    rows: list[dict[str, Any]] = []
    kernels = [True, False] if available(torch.device("cuda")) else [False]
    for kernel in kernels:
        how = "Triton kernel" if kernel else "torch _foreach_copy_"
        with TorchStorage(TPB, [GEOMETRY], [[blocks], [blocks]], device="cuda",
                          kernel=kernel) as gpu:
            gpu.tensors(0).view(torch.uint8).random_(0, 256)
            paths = [
                (Tier.GPU, Tier.HOST, f"offload, pinned, {how}"),
                (Tier.HOST, Tier.GPU, f"onboard, pinned, {how}"),
                (Tier.GPU, Tier.GPU, f"device copy, {how}"),
            ]
            rows += bench_storage(gpu, paths, blocks, repeats, torch.cuda.synchronize)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1,024 blocks, 3 repeats")
    parser.add_argument("--no-disk", action="store_true", help="skip the disk tier")
    parser.add_argument("--no-alternatives", action="store_true", help="skip the op comparison")
    parser.add_argument("--no-cpu", action="store_true", help="the CUDA paths only")
    parser.add_argument("--out", help="the JSON file (default results/copy.json)")
    args = parser.parse_args()
    blocks, repeats = (1024, 3) if args.quick else (args.blocks, args.repeats)
    block_bytes = GEOMETRY.block_bytes(TPB)
    rows = [] if args.no_cpu else cpu_rows(args, blocks, repeats)
    if torch.cuda.is_available():
        rows += cuda_rows(blocks, repeats)

    report(
        "copy",
        rows,
        out=args.out,
        title=f"copy_blocks vs one contiguous copy_: {blocks} blocks of {block_bytes // 1024} KiB",
        extra={
            "block_bytes": block_bytes,
            "geometry": {
                "num_layers": GEOMETRY.num_layers,
                "kv_heads": GEOMETRY.kv_heads,
                "head_dim": GEOMETRY.head_dim,
                "dtype": GEOMETRY.dtype,
                "tokens_per_block": TPB,
            },
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
