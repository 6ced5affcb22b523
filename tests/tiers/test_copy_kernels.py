"""kvpool.tiers.copy_kernels: the Triton gather/scatter equals torch's copy bit for bit.

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set here before
the kernel is first built); with CUDA the same checks run compiled, host↔device included.
Pools are filled with random bits (NaN payloads and all), so a copy through a float would
show."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpool.errors import StorageError  # noqa: E402
from kvpool.tiers.copy_kernels import available, block_index, copy_blocks, reference_copy  # noqa: E402
from kvpool.tiers.storage import BlockCopy, GroupGeometry, Tier  # noqa: E402
from kvpool.tiers.torch_storage import TorchStorage  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
# block shapes whose byte counts divide by 8, 4, 2 and 1: every word width of the kernel
SHAPES = [(2, 4), (3, 2), (5,), (1, 3)]


def random_bits(slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (slots, *shape[:-1], shape[-1] * size), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).contiguous()


@st.composite
def block_sets(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    """(source slots, destination slots, sources, distinct destinations)."""
    src_slots = draw(st.integers(1, 9))
    dst_slots = draw(st.integers(1, 9))
    n = draw(st.integers(0, dst_slots))
    dst = draw(st.permutations(range(dst_slots)))[:n]
    src = draw(st.lists(st.integers(0, src_slots - 1), min_size=n, max_size=n))
    return src_slots, dst_slots, src, dst


def test_available_here() -> None:
    assert available(DEVICE)


@settings(max_examples=25, deadline=None)
@given(block_sets(), st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.integers(0, 2**16))
def test_kernel_equals_torch(blocks: tuple[int, int, list[int], list[int]],
                             dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> None:
    src_slots, dst_slots, src, dst = blocks
    source = random_bits(src_slots, shape, dtype, seed).to(DEVICE)
    before = random_bits(dst_slots, shape, dtype, seed + 1).to(DEVICE)
    expected, got = before.clone(), before.clone()
    reference_copy(source, expected, src, dst)
    copy_blocks(source, got, block_index(src, dst, DEVICE))
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_large_block_spans_several_programs() -> None:
    """A block bigger than one program's chunk (16 KiB): every chunk lands."""
    source = random_bits(3, (4, 2304), torch.float16, 7).to(DEVICE)  # 18 KiB blocks
    got = torch.zeros_like(source)
    copy_blocks(source, got, block_index([2, 0], [0, 1], DEVICE))
    assert torch.equal(got[0].view(torch.uint8), source[2].view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), source[0].view(torch.uint8))
    assert not got[2].any()


def test_mismatched_pools_refused() -> None:
    with pytest.raises(ValueError, match="pools differ"):
        copy_blocks(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float16),
                    block_index([0], [1], torch.device("cpu")))


GEOMETRY = [GroupGeometry(2, 2, 4, "bfloat16"), GroupGeometry(1, 1, 4, "float32")]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(0, 1), (1, 0), (0, 0), (1, 1)]), st.integers(0, 1),
                          st.integers(0, 4), st.integers(0, 4)), max_size=8),
       st.integers(0, 2**16))
def test_storage_kernel_path_equals_torch_path(
        moves: list[tuple[tuple[int, int], int, int, int]], seed: int) -> None:
    """TorchStorage with ``kernel=True`` moves the same bytes as the torch path (one copy
    per call: a call's keys may not read what another writes)."""
    slots = [[5, 5], [5, 5]]
    stores = [TorchStorage(2, GEOMETRY, slots, device=DEVICE, kernel=k) for k in (False, True)]
    try:
        for store in stores:
            for tier in (Tier.GPU, Tier.HOST):
                for g in range(2):
                    pool = store.tensors(g, tier)
                    pool.copy_(random_bits(5, tuple(pool.shape[1:]), pool.dtype, seed + tier))
        for (a, b), g, s, d in moves:
            if (a, s) == (b, d):
                continue
            for store in stores:
                store.copy_blocks([BlockCopy(a, s, b, d, g)])
        for tier in (Tier.GPU, Tier.HOST):
            for g in range(2):
                want = stores[0].tensors(g, tier).view(torch.uint8)
                assert torch.equal(stores[1].tensors(g, tier).view(torch.uint8), want)
    finally:
        for store in stores:
            store.close()


@pytest.mark.skipif(CUDA, reason="the interpreter check is for machines without CUDA")
def test_kernel_refused_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(StorageError, match="kernel=True needs Triton"):
        TorchStorage(2, GEOMETRY, [[1, 1]], device="cpu", kernel=True)
