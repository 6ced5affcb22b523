"""kvpool.tiers.storage: geometry, validation, byte accounting and bit-exact tier round trips."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.errors import (
    BlockCopyError,
    GeometryError,
    InvalidArgumentError,
    StorageError,
)
from kvpool.tiers.storage import (
    DTYPE_ITEMSIZE,
    BlockCopy,
    GroupGeometry,
    MetadataStorage,
    Storage,
    StorageStats,
    Tier,
)
from kvpool.tiers.torch_storage import TorchStorage

GPU, HOST, DISK = Tier.GPU, Tier.HOST, Tier.DISK
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

TPB = 2
# One group per supported dtype, each with its own shape, so a copy into the wrong group or
# with the wrong element size shows up as a byte mismatch.
GEOMETRIES = [
    GroupGeometry(2, 2, 4, "float16"),
    GroupGeometry(1, 3, 2, "bfloat16"),
    GroupGeometry(1, 1, 4, "float32"),
    GroupGeometry(3, 1, 8, "float8_e4m3fn"),
    GroupGeometry(1, 2, 3, "int8"),
]
SLOTS = [[4, 3, 4, 3, 4], [5, 4, 3, 4, 5], [3, 3, 2, 3, 3]]

# Bit patterns of NaNs with payloads (quiet, signalling, negative) for each float dtype.
NAN_PATTERNS: dict[str, list[int]] = {
    "float16": [0x7C01, 0x7E00, 0xFC01, 0x7FFF, 0xFD55],
    "bfloat16": [0x7F81, 0x7FC0, 0xFF81, 0x7FFF, 0xFFAA],
    "float32": [0x7F800001, 0x7FC00000, 0xFF800001, 0x7FFFFFFF, 0xFFA5A5A5],
    "float8_e4m3fn": [0x7F, 0xFF],
}


def raw(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor, whatever its dtype (NaNs compare by bit pattern)."""
    return bytes(tensor.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes())


def disk_file(storage: TorchStorage, group: int) -> str:
    (path,) = [f for f in storage.disk_files if f"-g{group}-" in os.path.basename(f)]
    return path


def write(storage: TorchStorage, tier: int, group: int, slot: int, payload: bytes) -> None:
    if tier == DISK:  # the disk pool has no tensor: write the file at the slot's offset
        with open(disk_file(storage, group), "r+b") as fh:
            fh.seek(slot * storage.block_bytes(group))
            fh.write(payload)
        return
    target = storage.tensors(group, tier)[slot].view(torch.uint8).reshape(-1)
    target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def nan_payload(dtype: str, nbytes: int) -> bytes:
    size = DTYPE_ITEMSIZE[dtype]
    patterns = NAN_PATTERNS[dtype]
    words = [patterns[i % len(patterns)] for i in range(nbytes // size)]
    return b"".join(w.to_bytes(size, "little") for w in words)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvpool-test-disk-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_storage(disk_dir: Path, **kwargs: Any) -> TorchStorage:
    kwargs.setdefault("device", "cpu")
    return TorchStorage(TPB, GEOMETRIES, SLOTS, disk_path=disk_dir, **kwargs)


# ---------------------------------------------------------------------------- geometry


def test_block_bytes_of_a_256_kib_geometry() -> None:
    # 4 layers * K,V * 16 tokens * 8 heads * 128 dims * 2 bytes, computed by hand
    assert GroupGeometry(4, 8, 128, "float16").block_bytes(16) == 256 * 1024
    assert GroupGeometry(4, 8, 128, "float32").block_bytes(16) == 512 * 1024
    assert GroupGeometry(4, 8, 128, "int8").block_bytes(16) == 128 * 1024


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_block_bytes_is_the_size_of_one_slot(dtype: str) -> None:
    geometry = GroupGeometry(3, 2, 5, dtype)
    with TorchStorage(4, [geometry], [[2]], device="cpu") as s:
        pool = s.tensors(0)
        assert pool.dtype == getattr(torch, dtype)
        assert pool.element_size() == DTYPE_ITEMSIZE[dtype]
        assert tuple(pool.shape) == (2, 3, 2, 4, 2, 5)
        assert pool[1].nbytes == s.block_bytes(0) == geometry.block_bytes(4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "kv_heads": 1, "head_dim": 1},
        {"num_layers": 1, "kv_heads": -2, "head_dim": 1},
        {"num_layers": 1, "kv_heads": 1, "head_dim": 2.0},
        {"num_layers": True, "kv_heads": 1, "head_dim": 1},
        {"num_layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "float64"},
        {"num_layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "fp16"},
        {"num_layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": torch.float16},
    ],
)
def test_bad_geometry_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(GeometryError) as info:
        GroupGeometry(**kwargs)
    assert isinstance(info.value, StorageError)
    assert isinstance(info.value, InvalidArgumentError)


@pytest.mark.parametrize("tpb", [0, -16, 1.5, True])
def test_bad_tokens_per_block_is_rejected(tpb: Any) -> None:
    with pytest.raises(GeometryError, match="tokens_per_block"):
        GroupGeometry(1, 1, 1).block_bytes(tpb)
    with pytest.raises(GeometryError, match="tokens_per_block"):
        MetadataStorage(tpb)
    with pytest.raises(GeometryError, match="tokens_per_block"):
        TorchStorage(tpb, [GroupGeometry(1, 1, 1)], [[1]], device="cpu")


@pytest.mark.parametrize(
    ("geometries", "slots", "match"),
    [
        ([], [[]], "at least one"),
        ([GroupGeometry(1, 1, 1)], [], "1 to 3 tiers"),
        ([GroupGeometry(1, 1, 1)], [[1], [1], [1], [1]], "1 to 3 tiers"),
        ([GroupGeometry(1, 1, 1)], [[1, 1]], r"slots\[0\] has 2 entries"),
        ([GroupGeometry(1, 1, 1)] * 2, [[1, 1], [1]], r"slots\[1\] has 1 entries"),
        ([GroupGeometry(1, 1, 1)], [[-1]], r"slots\[0\]\[0\]"),
        ([GroupGeometry(1, 1, 1)], [[2], [1.0]], r"slots\[1\]\[0\]"),
        ([(1, 1, 1)], [[1]], "must be a GroupGeometry"),
    ],
)
def test_bad_layout_is_rejected(geometries: Any, slots: Any, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        TorchStorage(4, geometries, slots, device="cpu")


@pytest.mark.parametrize("device", ["meta", "not-a-device", 3.5])
def test_unsupported_device_is_rejected(device: Any) -> None:
    with pytest.raises(StorageError, match="device"):
        TorchStorage(4, [GroupGeometry(1, 1, 1)], [[1]], device=device)


@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is missing")
def test_cuda_device_without_cuda_is_rejected() -> None:
    with pytest.raises(StorageError, match="CUDA"):
        TorchStorage(4, [GroupGeometry(1, 1, 1)], [[1]], device="cuda")


# ---------------------------------------------------------------------------- pools


def test_pools_have_the_documented_layout_and_start_zeroed(disk_dir: Path) -> None:
    with make_storage(disk_dir) as s:
        assert s.device == torch.device("cpu")
        assert s.slots == tuple(tuple(row) for row in SLOTS)
        for tier in (GPU, HOST, DISK):
            for g, geometry in enumerate(GEOMETRIES):
                pool = s.tensors(g, tier)
                assert tuple(pool.shape) == (
                    SLOTS[tier][g],
                    geometry.num_layers,
                    2,
                    TPB,
                    geometry.kv_heads,
                    geometry.head_dim,
                )
                assert pool.device.type == "cpu"
                assert raw(pool) == bytes(pool.nbytes)
        # pinning only pays off for DMA to a CUDA device
        assert not s.tensors(0, HOST).is_pinned()


@pytest.mark.parametrize(("group", "tier"), [(5, 0), (-1, 0), (0, 3), (0, -1), (True, 0)])
def test_tensors_rejects_unknown_pools(disk_dir: Path, group: Any, tier: Any) -> None:
    with make_storage(disk_dir) as s, pytest.raises(BlockCopyError):
        s.tensors(group, tier)


def test_tensors_of_a_single_tier_storage_has_no_host_tier() -> None:
    with TorchStorage(4, [GroupGeometry(1, 1, 1)], [[2]], device="cpu") as s:
        with pytest.raises(BlockCopyError, match="tier 1"):
            s.tensors(0, HOST)
        with pytest.raises(BlockCopyError, match="tier 1"):
            s.copy_blocks([BlockCopy(0, 0, 1, 0, 0)])


# ---------------------------------------------------------------------------- disk tier


def test_disk_files_are_sized_written_at_slot_offsets_and_removed_on_close(
    disk_dir: Path,
) -> None:
    s = make_storage(disk_dir)
    files = s.disk_files
    assert len(files) == len(GEOMETRIES)
    assert sorted(os.listdir(disk_dir)) == sorted(os.path.basename(f) for f in files)
    sizes = sorted(os.path.getsize(f) for f in files)
    assert sizes == sorted(n * s.block_bytes(g) for g, n in enumerate(SLOTS[DISK]))
    # a block offloaded to disk lands in the file itself, at slot * block_bytes
    payload = os.urandom(s.block_bytes(0))
    write(s, GPU, 0, 2, payload)
    s.copy_blocks([BlockCopy(GPU, 2, DISK, 1, 0)])
    path = disk_file(s, 0)
    assert os.path.basename(path).startswith(f"kvpool-{os.getpid()}-g0-")
    with open(path, "rb") as fh:
        fh.seek(s.block_bytes(0))
        assert fh.read(s.block_bytes(0)) == payload
    s.close()
    assert os.listdir(disk_dir) == []
    assert s.disk_files == ()
    s.close()  # idempotent


def test_context_manager_and_garbage_collection_remove_disk_files(disk_dir: Path) -> None:
    with make_storage(disk_dir) as s:
        assert len(os.listdir(disk_dir)) == len(GEOMETRIES)
    assert os.listdir(disk_dir) == []
    assert s.closed
    s2 = make_storage(disk_dir)
    assert os.listdir(disk_dir) != []
    del s2
    gc.collect()
    assert os.listdir(disk_dir) == []


def test_closed_storage_refuses_work(disk_dir: Path) -> None:
    s = make_storage(disk_dir)
    s.close()
    with pytest.raises(StorageError, match="closed"):
        s.copy_blocks([BlockCopy(GPU, 0, HOST, 0, 0)])
    with pytest.raises(StorageError, match="closed"):
        s.tensors(0)


def test_groups_without_disk_slots_get_no_file(disk_dir: Path) -> None:
    geometries = [GroupGeometry(1, 1, 4), GroupGeometry(1, 1, 4)]
    with TorchStorage(
        4, geometries, [[1, 1], [1, 1], [0, 2]], device="cpu", disk_path=disk_dir
    ) as s:
        assert len(os.listdir(disk_dir)) == 1
        assert tuple(s.tensors(0, DISK).shape) == (0, 1, 2, 4, 1, 4)
    # and a storage without disk slots needs no disk_path at all
    with TorchStorage(4, geometries, [[1, 1], [1, 1], [0, 0]], device="cpu") as s:
        assert s.disk_files == ()


def test_disk_slots_without_a_path_are_rejected() -> None:
    with pytest.raises(StorageError, match="disk_path is None"):
        TorchStorage(4, [GroupGeometry(1, 1, 1)], [[1], [1], [1]], device="cpu")


def test_missing_disk_path_is_rejected(disk_dir: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        TorchStorage(
            4,
            [GroupGeometry(1, 1, 1)],
            [[1], [1], [1]],
            device="cpu",
            disk_path=disk_dir / "missing",
        )


def test_disk_path_under_a_file_is_rejected(disk_dir: Path) -> None:
    a_file = disk_dir / "plain"
    a_file.write_bytes(b"x")
    for path in (a_file, a_file / "sub"):
        with pytest.raises(StorageError, match="disk_path"):
            TorchStorage(4, [GroupGeometry(1, 1, 1)], [[1], [1], [1]], device="cpu", disk_path=path)
    assert os.listdir(disk_dir) == ["plain"]


@pytest.fixture
def unwritable_dir(disk_dir: Path) -> Iterator[Path]:
    """A directory this process cannot create files in."""
    if os.geteuid() != 0:
        locked = disk_dir / "locked"
        locked.mkdir(mode=0o500)
        yield locked
        locked.chmod(0o700)
    else:  # permission bits don't bind root; procfs refuses new files to everyone
        yield Path("/proc")


def test_unwritable_disk_path_is_rejected(
    unwritable_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = type(shutil.disk_usage(os.getcwd()))
    # plenty of room (procfs reports none), so only the permission can fail
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    before = set(os.listdir(unwritable_dir))
    with pytest.raises(StorageError, match="cannot create the disk tier"):
        TorchStorage(
            4, [GroupGeometry(1, 1, 1)], [[1], [1], [1]], device="cpu", disk_path=unwritable_dir
        )
    assert set(os.listdir(unwritable_dir)) == before


def test_disk_without_room_is_rejected_before_creating_files(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    geometry = GroupGeometry(2, 2, 8)
    need = 10 * geometry.block_bytes(4)
    usage = type(shutil.disk_usage(disk_dir))
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage(10**12, 10**12 - need + 1, need - 1)
    )
    with pytest.raises(StorageError, match=f"{need - 1} bytes free.*needs {need}"):
        TorchStorage(4, [geometry], [[1], [1], [10]], device="cpu", disk_path=disk_dir)
    assert os.listdir(disk_dir) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - need, need))
    with TorchStorage(4, [geometry], [[1], [1], [10]], device="cpu", disk_path=disk_dir):
        assert len(os.listdir(disk_dir)) == 1


def test_failing_reservation_leaves_no_file(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) == 2:  # the second group's file finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        os.ftruncate(fd, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate, raising=False)
    with pytest.raises(StorageError, match="No space left"):
        TorchStorage(
            4,
            [GroupGeometry(1, 1, 4)] * 2,
            [[1, 1], [1, 1], [2, 2]],
            device="cpu",
            disk_path=disk_dir,
        )
    assert len(calls) == 2
    assert os.listdir(disk_dir) == []


# ---------------------------------------------------------------------------- copies


def test_one_batched_op_per_key_and_bytes_per_tier_pair(disk_dir: Path) -> None:
    with make_storage(disk_dir) as s:
        copies = []
        for i in range(3):  # three keys, interleaved
            copies.append(BlockCopy(GPU, i, HOST, i + 1, 0))
            copies.append(BlockCopy(HOST, i, DISK, i, 3))
            copies.append(BlockCopy(GPU, i, HOST, i, 4))
        s.copy_blocks(copies)
        stats = s.stats()
        assert stats.batched_ops == 3
        assert stats.blocks_moved == {(GPU, HOST): 6, (HOST, DISK): 3}
        assert stats.bytes_moved == {
            (GPU, HOST): 3 * (s.block_bytes(0) + s.block_bytes(4)),
            (HOST, DISK): 3 * s.block_bytes(3),
        }
        assert stats.total_blocks == 9
        assert stats.total_bytes == sum(stats.bytes_moved.values())
        s.copy_blocks([BlockCopy(DISK, 0, GPU, 0, 3)])
        s.copy_blocks([])
        assert s.stats().batched_ops == 4
        assert stats.batched_ops == 3  # a snapshot


def test_keys_run_in_order_of_first_appearance(disk_dir: Path) -> None:
    old, new = (
        os.urandom(GEOMETRIES[0].block_bytes(TPB)),
        os.urandom(GEOMETRIES[0].block_bytes(TPB)),
    )
    with make_storage(disk_dir) as s:
        write(s, HOST, 0, 4, old)
        write(s, GPU, 0, 1, new)
        # offload host slot 4 to disk first, then refill it from the GPU
        s.copy_blocks([BlockCopy(HOST, 4, DISK, 0, 0), BlockCopy(GPU, 1, HOST, 4, 0)])
        assert raw(s.tensors(0, DISK)[0]) == old
        assert raw(s.tensors(0, HOST)[4]) == new
        # the reverse order moves the new block down instead
        s.copy_blocks([BlockCopy(GPU, 1, HOST, 3, 0), BlockCopy(HOST, 3, DISK, 1, 0)])
        assert raw(s.tensors(0, DISK)[1]) == new


BAD_COPIES = [
    (BlockCopy(3, 0, 0, 0, 0), "tier 3"),
    (BlockCopy(0, 0, -1, 0, 0), "tier -1"),
    (BlockCopy(0, 0, 1, 0, 5), "layer group 5"),
    (BlockCopy(0, 0, 1, 0, True), "layer group True"),
    (BlockCopy(0, -1, 1, 0, 0), "source slot -1"),
    (BlockCopy(0, 4, 1, 0, 0), "source slot 4 of tier 0 group 0"),
    (BlockCopy(0, 0, 1, 5, 0), "destination slot 5 of tier 1 group 0"),
    (BlockCopy(0, 0, 2, 2, 2), "destination slot 2 of tier 2 group 2"),
    (BlockCopy(0, 1.0, 1, 0, 0), "source slot 1.0"),  # type: ignore[arg-type]
    (BlockCopy(0, 0, 1, False, 0), "destination slot False"),
    ((0, 0, 1, 0), "BlockCopy"),
    (BlockCopy(0, 3, 1, 1, 0), r"destination slots \[1\].*more than once"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_COPIES)
def test_invalid_copies_move_nothing(disk_dir: Path, bad: Any, match: str) -> None:
    with make_storage(disk_dir) as s:
        payload = os.urandom(s.block_bytes(0))
        write(s, GPU, 0, 2, payload)
        valid = [BlockCopy(GPU, 2, HOST, 1, 0), BlockCopy(GPU, 2, DISK, 0, 0)]
        with pytest.raises(BlockCopyError, match=match):
            s.copy_blocks([*valid, bad])
        assert raw(s.tensors(0, HOST)) == bytes(s.tensors(0, HOST).nbytes)
        assert raw(s.tensors(0, DISK)) == bytes(s.tensors(0, DISK).nbytes)
        assert s.stats() == StorageStats({}, {}, 0)


def test_a_slot_both_read_and_written_by_one_batch_is_an_internal_error(disk_dir: Path) -> None:
    with make_storage(disk_dir) as s, pytest.raises(AssertionError, match=r"slots \[1\]"):
        s.copy_blocks([BlockCopy(GPU, 0, GPU, 1, 0), BlockCopy(GPU, 1, GPU, 2, 0)])
    # the same slots in different keys are fine: the keys run one after the other
    with make_storage(disk_dir) as s:
        payload = os.urandom(s.block_bytes(0))
        write(s, GPU, 0, 0, payload)
        s.copy_blocks([BlockCopy(GPU, 0, GPU, 1, 0), BlockCopy(GPU, 1, HOST, 2, 0)])
        assert raw(s.tensors(0, HOST)[2]) == payload


@pytest.mark.parametrize("dtype", sorted(NAN_PATTERNS))
def test_nan_payloads_survive_every_tier_bit_for_bit(disk_dir: Path, dtype: str) -> None:
    g = next(i for i, geometry in enumerate(GEOMETRIES) if geometry.dtype == dtype)
    with make_storage(disk_dir) as s:
        payload = nan_payload(dtype, s.block_bytes(g))
        write(s, GPU, g, 0, payload)
        assert torch.isnan(s.tensors(g)[0].float()).all()  # the test data really is NaN
        s.copy_blocks([BlockCopy(GPU, 0, HOST, 2, g)])
        s.copy_blocks([BlockCopy(HOST, 2, DISK, 1, g)])
        s.copy_blocks([BlockCopy(DISK, 1, GPU, 2, g)])
        s.copy_blocks([BlockCopy(GPU, 2, GPU, 1, g)])
        for tier, slot in [(HOST, 2), (DISK, 1), (GPU, 2), (GPU, 1)]:
            assert raw(s.tensors(g, tier)[slot]) == payload


@pytest.mark.parametrize("blocks", [33, 64])
def test_large_batches_split_across_threads_stay_bit_exact(disk_dir: Path, blocks: int) -> None:
    # 256 KiB blocks: a batch this large is split between worker threads on a multi-core CPU
    geometry = GroupGeometry(4, 8, 128, "bfloat16")
    gen = torch.Generator().manual_seed(blocks)
    with TorchStorage(
        16, [geometry], [[blocks], [blocks], [blocks]], device="cpu", disk_path=disk_dir
    ) as s:
        s.tensors(0).view(torch.uint8).random_(0, 256, generator=gen)
        original = [raw(block) for block in s.tensors(0)]
        perms = [torch.randperm(blocks, generator=gen).tolist() for _ in range(4)]

        def moves(src_tier: int, dst_tier: int, hop: int) -> list[BlockCopy]:
            pairs = zip(perms[hop], perms[hop + 1], strict=True)
            return [BlockCopy(src_tier, a, dst_tier, b, 0) for a, b in pairs]

        s.copy_blocks(moves(GPU, HOST, 0))
        s.copy_blocks(moves(HOST, DISK, 1))
        s.tensors(0).zero_()
        s.copy_blocks(moves(DISK, GPU, 2))
        # block perms[0][i] went to host perms[1][i], disk perms[2][i], back to perms[3][i]
        for i in range(blocks):
            assert raw(s.tensors(0)[perms[3][i]]) == original[perms[0][i]], i
        assert s.stats().batched_ops == 3


def copies_strategy(slots: list[list[int]], groups: int) -> st.SearchStrategy[list[BlockCopy]]:
    """Random copy batches that respect the caller's side of the contract."""

    @st.composite
    def one_copy(draw: st.DrawFn) -> BlockCopy:
        g = draw(st.integers(0, groups - 1))
        src_tier = draw(st.integers(0, len(slots) - 1))
        dst_tier = draw(st.integers(0, len(slots) - 1))
        return BlockCopy(
            src_tier,
            draw(st.integers(0, slots[src_tier][g] - 1)),
            dst_tier,
            draw(st.integers(0, slots[dst_tier][g] - 1)),
            g,
        )

    def legal(candidates: list[BlockCopy]) -> list[BlockCopy]:
        reads: dict[tuple[int, int, int], set[int]] = {}
        writes: dict[tuple[int, int, int], set[int]] = {}
        batch = []
        for c in candidates:
            key = (c.src_tier, c.dst_tier, c.layer_group)
            r, w = reads.setdefault(key, set()), writes.setdefault(key, set())
            if c.dst_slot in w:
                continue
            if c.src_tier == c.dst_tier and (
                c.dst_slot in r or c.src_slot in w or c.src_slot == c.dst_slot
            ):
                continue
            r.add(c.src_slot)
            w.add(c.dst_slot)
            batch.append(c)
        return batch

    return st.lists(one_copy(), min_size=1, max_size=16).map(legal)


def apply_to_model(model: dict[tuple[int, int, int], bytes], copies: list[BlockCopy]) -> None:
    """The contract, executed naively: keys in first-appearance order, reads before writes."""
    keys: dict[tuple[int, int, int], list[BlockCopy]] = {}
    for c in copies:
        keys.setdefault((c.src_tier, c.dst_tier, c.layer_group), []).append(c)
    for batch in keys.values():
        values = [model[(c.src_tier, c.layer_group, c.src_slot)] for c in batch]
        for c, value in zip(batch, values, strict=True):
            model[(c.dst_tier, c.layer_group, c.dst_slot)] = value


def payload_strategy(dtype: str, nbytes: int) -> st.SearchStrategy[bytes]:
    random_bytes = st.binary(min_size=nbytes, max_size=nbytes)
    if dtype not in NAN_PATTERNS:
        return random_bytes
    return st.one_of(random_bytes, st.just(nan_payload(dtype, nbytes)))


class RoundTrips(RuleBasedStateMachine):
    """Blocks written through tensors() and moved between tiers in random batches read back
    bit for bit; the metadata storage counts the same traffic as the torch one."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvpool-test-rt-")
        self.storage = TorchStorage(TPB, GEOMETRIES, SLOTS, device="cpu", disk_path=self.dir)
        self.meta = MetadataStorage(TPB, [g.block_bytes(TPB) for g in GEOMETRIES])
        self.model = {
            (tier, g, slot): bytes(self.storage.block_bytes(g))
            for tier, row in enumerate(SLOTS)
            for g, n in enumerate(row)
            for slot in range(n)
        }
        self.blocks: dict[tuple[int, int], int] = {}
        self.ops = 0

    @rule(data=st.data())
    def write_block(self, data: st.DataObject) -> None:
        tier = data.draw(st.integers(0, len(SLOTS) - 1))
        g = data.draw(st.integers(0, len(GEOMETRIES) - 1))
        slot = data.draw(st.integers(0, SLOTS[tier][g] - 1))
        payload = data.draw(payload_strategy(GEOMETRIES[g].dtype, self.storage.block_bytes(g)))
        write(self.storage, tier, g, slot, payload)
        self.model[(tier, g, slot)] = payload

    @rule(copies=copies_strategy(SLOTS, len(GEOMETRIES)))
    def copy(self, copies: list[BlockCopy]) -> None:
        self.storage.copy_blocks(copies)
        self.meta.copy_blocks(copies)
        apply_to_model(self.model, copies)
        for c in copies:
            self.blocks[(c.src_tier, c.dst_tier)] = self.blocks.get((c.src_tier, c.dst_tier), 0) + 1
        self.ops += len({(c.src_tier, c.dst_tier, c.layer_group) for c in copies})

    @invariant()
    def bytes_match_the_model(self) -> None:
        for tier, row in enumerate(SLOTS):
            for g, n in enumerate(row):
                expected = b"".join(self.model[(tier, g, slot)] for slot in range(n))
                assert raw(self.storage.tensors(g, tier)) == expected, (tier, g)

    @invariant()
    def stats_count_every_block(self) -> None:
        stats = self.storage.stats()
        assert stats.blocks_moved == self.blocks
        assert stats.batched_ops == self.ops
        assert self.meta.stats() == stats

    def teardown(self) -> None:
        self.storage.close()
        assert os.listdir(self.dir) == []
        os.rmdir(self.dir)


RoundTrips.TestCase.settings = settings(stateful_step_count=20)
TestRoundTrips = RoundTrips.TestCase


# ---------------------------------------------------------------------------- metadata


def test_metadata_storage_counts_bytes_per_group() -> None:
    m = MetadataStorage(16, [100, 7])
    assert isinstance(m, Storage)
    m.copy_blocks([BlockCopy(0, 5, 1, 9, 0), BlockCopy(0, 6, 1, 8, 1), BlockCopy(0, 7, 1, 10, 0)])
    m.copy_blocks([BlockCopy(1, 9, 0, 1000, 0)])
    stats = m.stats()
    assert stats.blocks_moved == {(0, 1): 3, (1, 0): 1}
    assert stats.bytes_moved == {(0, 1): 207, (1, 0): 100}
    assert stats.batched_ops == 3
    assert m.block_bytes(1) == 7
    with pytest.raises(BlockCopyError, match="layer group 2"):
        m.block_bytes(2)


def test_metadata_storage_without_sizes_accepts_any_group_and_counts_no_bytes() -> None:
    with MetadataStorage(16) as m:
        m.copy_blocks([BlockCopy(0, 1, 2, 3, 7), BlockCopy(2, 3, 0, 1, 7)])
        assert m.block_bytes(41) == 0
        assert m.stats() == StorageStats({(0, 2): 1, (2, 0): 1}, {(0, 2): 0, (2, 0): 0}, 2)
    with pytest.raises(StorageError, match="closed"):
        m.copy_blocks([BlockCopy(0, 1, 2, 3, 7)])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (BlockCopy(0, 0, 3, 0, 0), "tier 3"),
        (BlockCopy(0, -1, 1, 0, 0), "source slot -1"),
        (BlockCopy(0, 0, 1, 0, -1), "layer group -1"),
        (BlockCopy(0, 0, 1, "0", 0), "destination slot '0'"),  # type: ignore[arg-type]
        (BlockCopy(0, 2, 1, 1, 0), "more than once"),
    ],
)
def test_metadata_storage_validates_like_the_real_one(bad: BlockCopy, match: str) -> None:
    m = MetadataStorage(16)
    with pytest.raises(BlockCopyError, match=match):
        m.copy_blocks([BlockCopy(0, 1, 1, 1, 0), bad])
    assert m.stats().batched_ops == 0


@pytest.mark.parametrize("sizes", [[-1], [1, 2.5], [True]])
def test_metadata_storage_rejects_bad_block_sizes(sizes: list[Any]) -> None:
    with pytest.raises(GeometryError, match="block_bytes_per_group"):
        MetadataStorage(16, sizes)


@given(copies=copies_strategy(SLOTS, len(GEOMETRIES)))
def test_metadata_storage_counts_what_torch_storage_moves(copies: list[BlockCopy]) -> None:
    meta = MetadataStorage(TPB, [g.block_bytes(TPB) for g in GEOMETRIES])
    with TorchStorage(TPB, GEOMETRIES, [*SLOTS[:2], [0] * len(GEOMETRIES)], device="cpu") as s:
        copies = [c for c in copies if DISK not in (c.src_tier, c.dst_tier)]
        s.copy_blocks(copies)
        meta.copy_blocks(copies)
        assert meta.stats() == s.stats()
        assert s.stats().total_blocks == len(copies)


def test_importing_storage_does_not_need_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvpool.tiers.storage import MetadataStorage, BlockCopy, GroupGeometry\n"
        "from kvpool.tiers.torch_storage import TorchStorage\n"
        "m = MetadataStorage(16, [GroupGeometry(4, 8, 128).block_bytes(16)])\n"
        "m.copy_blocks([BlockCopy(0, 1, 1, 2, 0)])\n"
        "print(m.stats().total_bytes)\n"
        "try:\n"
        "    TorchStorage(16, [GroupGeometry(1, 1, 1)], [[1]])\n"
        "except ImportError:\n"
        "    print('torch needed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(256 * 1024), "torch", "needed"]


# ---------------------------------------------------------------------------- CUDA


@needs_cuda
def test_cuda_default_device_and_pinned_host(disk_dir: Path) -> None:
    with TorchStorage(TPB, GEOMETRIES, SLOTS, disk_path=disk_dir) as s:
        assert s.device.type == "cuda"
        assert s.tensors(0).device == s.device
        assert all(s.tensors(g, HOST).is_pinned() for g in range(len(GEOMETRIES)))
        assert s.tensors(0, DISK).device.type == "cpu"


@needs_cuda
@settings(max_examples=20)
@given(data=st.data())
def test_cuda_round_trips_are_bit_exact(data: st.DataObject) -> None:
    with (
        tempfile.TemporaryDirectory() as d,
        TorchStorage(TPB, GEOMETRIES, SLOTS, device="cuda", disk_path=d) as s,
    ):
        model = {
            (tier, g, slot): bytes(s.block_bytes(g))
            for tier, row in enumerate(SLOTS)
            for g, n in enumerate(row)
            for slot in range(n)
        }
        for g, geometry in enumerate(GEOMETRIES):
            for slot in range(SLOTS[GPU][g]):
                payload = data.draw(payload_strategy(geometry.dtype, s.block_bytes(g)))
                s.tensors(g)[slot].view(torch.uint8).reshape(-1).copy_(
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8).cuda()
                )
                model[(GPU, g, slot)] = payload
        for _ in range(4):
            copies = data.draw(copies_strategy(SLOTS, len(GEOMETRIES)))
            s.copy_blocks(copies)
            apply_to_model(model, copies)
        for (tier, g, slot), payload in model.items():
            assert raw(s.tensors(g, tier)[slot]) == payload


@needs_cuda
def test_cuda_copies_are_ordered_with_the_current_stream() -> None:
    geometry = GroupGeometry(4, 8, 128, "float16")
    with TorchStorage(16, [geometry], [[8], [8]], device="cuda") as s:
        pool = s.tensors(0)
        # queue a long kernel, then the write the offload must wait for
        torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
        pool[3].fill_(1.5)
        s.copy_blocks([BlockCopy(GPU, 3, HOST, 5, 0)])
        assert bool((s.tensors(0, HOST)[5] == 1.5).all())
        # onboard, then read on the current stream at once: it must see the new data
        s.tensors(0, HOST)[6].fill_(-2.0)
        s.copy_blocks([BlockCopy(HOST, 6, GPU, 0, 0)])
        assert bool((pool[0] == -2.0).all())
        # a device->device copy after an onboard of its source
        s.copy_blocks([BlockCopy(HOST, 5, GPU, 1, 0), BlockCopy(GPU, 1, GPU, 2, 0)])
        assert bool((pool[2] == 1.5).all())
        assert s.stats().blocks_moved == {(GPU, HOST): 1, (HOST, GPU): 2, (GPU, GPU): 1}
