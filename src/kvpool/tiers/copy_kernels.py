"""Block copies as one Triton kernel per call: a gather/scatter over flat pool views.

``copy_blocks(src_pool, dst_pool, index)`` copies block ``index[0][i]`` of ``src_pool`` to
block ``index[1][i]`` of ``dst_pool`` for every i in one launch: program (i, c) moves chunk c
of block i. Pools are ``[slots, ...]`` tensors of the same dtype and block shape; the kernel
reads and writes them as flat arrays of the widest integer word that divides a block, so any
dtype copies bit for bit. ``index`` is one int64 ``[2, blocks]`` tensor on the kernel's
device, built once per call (:func:`block_index`).

Host↔GPU copies pass pinned host memory straight to the kernel: with CUDA's unified
addressing a pinned allocation is mapped into the GPU's address space under the same
pointer, so the GPU reads and writes it over the link with no staging copy and no per-block
``cudaMemcpyAsync`` (the approach of vLLM's ``swap_blocks_triton``).

Triton is imported on first use only (``import kvpool`` never needs it). On a machine without
a GPU the kernel runs in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before the
first call, which is how the tests check it against torch on the CPU.
"""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["available", "block_index", "copy_blocks", "reference_copy"]

CHUNK_BYTES = 16 << 10
"""Bytes one program moves (a block of 256 KiB is 16 programs)."""


def available(device: torch.device) -> bool:
    """Whether the kernel can run for pools on ``device``: Triton imports and the device is
    CUDA, or Triton's interpreter is on (any device)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or _interpreted()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _kernel(interpreted: bool) -> Any:
    """The jitted kernel (one per mode: the interpreter decides at decoration)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def gather_scatter(src: Any, dst: Any, index: Any, blocks: Any, words: Any,
                       chunk: tl.constexpr) -> None:
        i = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.load(index + i).to(tl.int64)
        d = tl.load(index + blocks + i).to(tl.int64)
        offs = c * chunk + tl.arange(0, chunk)
        inside = offs < words
        values = tl.load(src + s * words + offs, mask=inside)
        tl.store(dst + d * words + offs, values, mask=inside)

    return gather_scatter


def _words(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as ``[slots, words]`` of the widest integer type dividing a block."""
    import torch

    slots = pool.shape[0]
    flat = pool.reshape(slots, -1).view(torch.uint8)
    nbytes = flat.shape[1]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return flat.view(dtype)
    return flat


def block_index(src: list[int], dst: list[int], device: torch.device) -> torch.Tensor:
    """``[2, blocks]`` int64 (sources, then destinations) on ``device``: built on the host,
    copied from pinned memory without waiting on CUDA."""
    import torch

    host = torch.tensor([src, dst], dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, index: torch.Tensor) -> None:
    """``dst_pool[index[1][i]] = src_pool[index[0][i]]`` for every i, in one launch on the
    current stream. Pools must be contiguous, of the same dtype and block shape."""
    import triton

    if src_pool.dtype != dst_pool.dtype or src_pool.shape[1:] != dst_pool.shape[1:]:
        raise ValueError(f"pools differ: {src_pool.dtype}{tuple(src_pool.shape)} and "
                         f"{dst_pool.dtype}{tuple(dst_pool.shape)}")
    blocks = index.shape[1]
    if blocks == 0:
        return
    src, dst = _words(src_pool), _words(dst_pool)
    words = src.shape[1]
    chunk = max(16, min(triton.next_power_of_2(words),
                        CHUNK_BYTES // src.element_size()))
    grid = (blocks, triton.cdiv(words, chunk))
    _kernel(_interpreted())[grid](src, dst, index, blocks, words, chunk=chunk)


def reference_copy(src_pool: torch.Tensor, dst_pool: torch.Tensor, src: list[int],
                   dst: list[int]) -> None:
    """The same copy in plain torch (what the kernel is tested against)."""
    import torch

    if src:
        torch._foreach_copy_([dst_pool[d] for d in dst], [src_pool[s] for s in src])
