"""The data plane: where KV bytes live, per tier and layer group, and the batched copy engine.

The block manager decides which slot of which tier and layer group holds each block; a
:class:`Storage` only moves bytes between slots when asked. Two implementations:

* :class:`MetadataStorage` holds no data. It validates and counts copies exactly like the real
  one, for simulation, routing and tests. It never imports torch.
* :class:`TorchStorage` holds one tensor per (tier, layer group), shaped
  ``[slots, num_layers, 2 (K, V), tokens_per_block, kv_heads, head_dim]``: tier 0 on the
  compute device, tier 1 in host memory (pinned when tier 0 is a CUDA device), tier 2 in one
  file per layer group, read and written with ``pread``/``pwrite`` (:mod:`kvpool.diskfile`:
  never memory-mapped, so a truncated file is an error, not SIGBUS). torch is imported only
  when one is built.

Copy contract (:meth:`Storage.copy_blocks`), shared by both:

* The caller passes every copy of one public call, ordered so that running the *groups* of
  copies in order of first appearance of their key ``(src_tier, dst_tier, layer_group)`` is
  correct (e.g. host→disk before GPU→host before host→GPU before GPU→GPU).
* Each key runs as ONE batched operation, never one call per block.
* Within one key no destination slot is also a source slot (an internal invariant of the
  caller, asserted) and no destination slot appears twice (a :class:`BlockCopyError`).
* Everything is validated before anything moves, the disk files included (closed, removed or
  truncated: :meth:`Storage.check`): a call that raises that way copies nothing.
* Bytes survive any round trip bit for bit (copies never convert or compute; NaN payloads stay).
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Self, runtime_checkable

from kvpool.diskfile import DiskPool, close_pools, create_pools
from kvpool.errors import BlockCopyError, GeometryError, StorageError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class Tier(IntEnum):
    """A level of memory; lower is hotter."""

    GPU = 0
    HOST = 1
    DISK = 2


NUM_TIERS = len(Tier)

#: Bytes per element of each supported KV dtype (names as torch spells them).
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType(
    {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: object) -> str:
    """A value for an error message: ints (IntEnum members too) as plain numbers."""
    return str(int(value)) if _is_int(value) else repr(value)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """The KV geometry of one layer group: every layer of the group has the same shape.

    Raises :class:`GeometryError` on a non-positive size or an unknown dtype.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise GeometryError(f"GroupGeometry.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_ITEMSIZE:
            raise GeometryError(
                f"GroupGeometry.dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return DTYPE_ITEMSIZE[self.dtype]

    def block_bytes(self, tokens_per_block: int) -> int:
        """Bytes of one block (all layers, K and V): layers·2·tpb·kv_heads·head_dim·itemsize."""
        _check_tokens_per_block(tokens_per_block)
        return (
            self.num_layers * 2 * tokens_per_block * self.kv_heads * self.head_dim * self.itemsize
        )

    def block_shape(self, tokens_per_block: int) -> tuple[int, int, int, int, int]:
        """Shape of one slot: ``(num_layers, 2, tokens_per_block, kv_heads, head_dim)``."""
        _check_tokens_per_block(tokens_per_block)
        return (self.num_layers, 2, tokens_per_block, self.kv_heads, self.head_dim)


class BlockCopy(NamedTuple):
    """Copy the block in ``src_slot`` of ``src_tier`` to ``dst_slot`` of ``dst_tier``, one group."""

    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    layer_group: int


@dataclass(frozen=True, slots=True)
class StorageStats:
    """What a storage has moved since it was built (a snapshot; later copies don't change it).

    ``blocks_moved`` and ``bytes_moved`` are keyed by ``(src_tier, dst_tier)``; ``batched_ops``
    counts the batched operations issued (one per key of each :meth:`Storage.copy_blocks`).
    """

    blocks_moved: Mapping[tuple[int, int], int]
    bytes_moved: Mapping[tuple[int, int], int]
    batched_ops: int

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_moved.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_moved.values())


@runtime_checkable
class Storage(Protocol):
    """What the block manager needs from the data plane."""

    tokens_per_block: int

    def block_bytes(self, layer_group: int) -> int:
        """Bytes of one block of ``layer_group`` (0 where the storage does not know)."""
        ...

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run all copies of one public call; see the module docstring for the contract."""
        ...

    def stats(self) -> StorageStats:
        """Blocks and bytes moved per (src_tier, dst_tier), and batched operations issued."""
        ...

    def check(self) -> None:
        """Raise :class:`StorageError` if a copy could not run now (closed, a disk file removed
        or truncated). The manager calls it before changing anything in a call that may copy."""
        ...

    def close(self) -> None:
        """Release memory and files. Idempotent; later copies raise :class:`StorageError`."""
        ...


CopyKey = tuple[int, int, int]  # (src_tier, dst_tier, layer_group)
CopyPlan = dict[CopyKey, tuple[list[int], list[int]]]  # key -> (src slots, dst slots), ordered


def _check_tokens_per_block(tokens_per_block: int) -> None:
    if not _is_int(tokens_per_block) or tokens_per_block <= 0:
        raise GeometryError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")


class _CopyEngine:
    """Validation, grouping, accounting and life cycle shared by both storages.

    Subclasses say how many tiers, groups and slots exist and how one key's batch is run.
    """

    def __init__(self, tokens_per_block: int) -> None:
        _check_tokens_per_block(tokens_per_block)
        self.tokens_per_block = tokens_per_block
        self._blocks_moved: dict[tuple[int, int], int] = {}
        self._bytes_moved: dict[tuple[int, int], int] = {}
        self._batched_ops = 0
        self._closed = False

    # -- what subclasses define

    def _num_groups(self) -> int | None:
        """Number of layer groups; None when unknown (any non-negative group is accepted)."""
        raise NotImplementedError

    def _num_tiers(self) -> int:
        raise NotImplementedError

    def _slot_count(self, tier: int, layer_group: int) -> int | None:
        """Slots of one pool; None when unknown (any non-negative slot is accepted)."""
        raise NotImplementedError

    def _run(self, key: CopyKey, src: list[int], dst: list[int]) -> None:
        """Issue one batched operation moving ``src[i]`` to ``dst[i]`` for every i."""
        raise NotImplementedError

    def block_bytes(self, layer_group: int) -> int:
        raise NotImplementedError

    # -- the shared contract

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run ``copies``: one batched operation per (src_tier, dst_tier, layer_group), keys in
        order of first appearance. Validates everything first; a call that raises moves nothing.

        Raises :class:`BlockCopyError` for a tier, group or slot that does not exist or a
        destination written twice under one key; :class:`StorageError` once closed.
        """
        self._check_open()
        plan = self.plan(copies)
        self._check_plan(plan)
        for key, (src, dst) in plan.items():
            self._run(key, src, dst)
            tiers, blocks = (key[0], key[1]), len(src)
            nbytes = blocks * self.block_bytes(key[2])
            self._blocks_moved[tiers] = self._blocks_moved.get(tiers, 0) + blocks
            self._bytes_moved[tiers] = self._bytes_moved.get(tiers, 0) + nbytes
            self._batched_ops += 1

    def plan(self, copies: Sequence[BlockCopy]) -> CopyPlan:
        """Group and validate ``copies`` without moving anything (what :meth:`copy_blocks` runs).

        The returned dict is ordered by first appearance of each key; for each key it holds the
        source and destination slots, copy i moving ``src[i]`` to ``dst[i]``.
        """
        plan: CopyPlan = {}
        try:
            for copy in copies:
                src_tier, src_slot, dst_tier, dst_slot, group = copy
                key = (src_tier, dst_tier, group)
                entry = plan.get(key)
                if entry is None:
                    self._check_key(key)
                    entry = plan[key] = ([], [])
                entry[0].append(src_slot)
                entry[1].append(dst_slot)
        except (TypeError, ValueError) as exc:  # not a 5-tuple, or an unhashable field
            raise BlockCopyError(f"copies must be BlockCopy tuples of ints: {exc}") from exc
        for (src_tier, dst_tier, group), (src, dst) in plan.items():
            self._check_slots(src_tier, group, src, "source")
            self._check_slots(dst_tier, group, dst, "destination")
            if len(set(dst)) != len(dst):
                twice = sorted(s for s, n in Counter(dst).items() if n > 1)
                raise BlockCopyError(
                    f"destination slots {twice} of tier {dst_tier} group {group} are written "
                    "more than once in one copy_blocks call"
                )
            # A same-tier batch reads and writes one pool; overlapping slots would make the
            # result depend on the copy order inside the batched op. The manager never does it.
            assert src_tier != dst_tier or set(src).isdisjoint(dst), (
                f"tier {src_tier} group {group}: slots {sorted(set(src) & set(dst))} are both "
                "a source and a destination of one batched copy"
            )
        return plan

    def check(self) -> None:
        """Raise :class:`StorageError` once closed."""
        self._check_open()

    def _check_plan(self, plan: CopyPlan) -> None:
        """Raise :class:`StorageError` if a pool the plan touches cannot be used now."""

    def stats(self) -> StorageStats:
        return StorageStats(
            blocks_moved=dict(self._blocks_moved),
            bytes_moved=dict(self._bytes_moved),
            batched_ops=self._batched_ops,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- validation helpers

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{type(self).__name__} is closed")

    def _check_tier(self, tier: object) -> int:
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < self._num_tiers():
            raise BlockCopyError(f"tier {_show(tier)} is not one of 0..{self._num_tiers() - 1}")
        return tier

    def _check_group(self, group: object) -> int:
        groups = self._num_groups()
        if (
            isinstance(group, bool)
            or not isinstance(group, int)
            or group < 0
            or (groups is not None and group >= groups)
        ):
            known = "a non-negative int" if groups is None else f"one of 0..{groups - 1}"
            raise BlockCopyError(f"layer group {_show(group)} is not {known}")
        return group

    def _check_key(self, key: tuple[object, object, object]) -> None:
        self._check_tier(key[0])
        self._check_tier(key[1])
        self._check_group(key[2])

    def _check_slots(self, tier: int, group: int, slots: list[int], role: str) -> None:
        # Exact ints are the common case and are checked in bulk; other values one by one.
        if not all(type(s) is int for s in slots):
            for s in slots:
                if not _is_int(s):
                    raise BlockCopyError(
                        f"{role} slot {s!r} (tier {tier}, group {group}) is not an int"
                    )
        limit = self._slot_count(tier, group)
        low, high = min(slots), max(slots)
        if low < 0 or (limit is not None and high >= limit):
            bad = low if low < 0 else high
            bounds = "non-negative" if limit is None else f"in 0..{limit - 1}"
            raise BlockCopyError(f"{role} slot {bad} of tier {tier} group {group} is not {bounds}")


class MetadataStorage(_CopyEngine):
    """A storage without data: validates and counts copies like :class:`TorchStorage`.

    ``block_bytes_per_group[g]`` gives the bytes one block of group g would take. When it is
    empty the number of groups is unknown: any non-negative group is accepted and counts 0
    bytes. Slots are only checked to be non-negative ints (pool sizes are the manager's).
    """

    def __init__(self, tokens_per_block: int, block_bytes_per_group: Sequence[int] = ()) -> None:
        super().__init__(tokens_per_block)
        if isinstance(block_bytes_per_group, str | bytes) or not isinstance(
            block_bytes_per_group, Iterable
        ):
            raise GeometryError(
                f"block_bytes_per_group must be a sequence of ints, got {block_bytes_per_group!r}"
            )
        sizes = tuple(block_bytes_per_group)
        for g, size in enumerate(sizes):
            if not _is_int(size) or size < 0:
                raise GeometryError(
                    f"block_bytes_per_group[{g}] must be a non-negative int, got {size!r}"
                )
        self._block_bytes = sizes

    def block_bytes(self, layer_group: int) -> int:
        group = self._check_group(layer_group)
        return self._block_bytes[group] if self._block_bytes else 0

    def _num_groups(self) -> int | None:
        return len(self._block_bytes) or None

    def _num_tiers(self) -> int:
        return NUM_TIERS

    def _slot_count(self, tier: int, layer_group: int) -> int | None:
        return None

    def _run(self, key: CopyKey, src: list[int], dst: list[int]) -> None:
        return None


class TorchStorage(_CopyEngine):
    """KV pools as torch tensors, one per (tier, layer group), and the batched copy engine.

    ``slots[tier][group]`` is the slot count of each pool; ``len(slots)`` tiers (1 to 3) exist.
    Tier 0 lives on ``device`` (default: ``"cuda"`` if available, else ``"cpu"``); tier 1 in
    host memory, pinned when tier 0 is a CUDA device; tier 2 in one file per layer group under
    ``disk_path`` (:mod:`kvpool.diskfile`: created, sized and locked here, removed by
    :meth:`close`, on SIGTERM and by the next storage built there after a crash). Every pool
    starts zeroed, so unused slots never feed NaNs to a kernel.

    Copies: each key is one ``torch._foreach_copy_`` over per-slot views, one pass over the
    bytes (measured on CPU to beat ``index_select`` + ``index_copy_``, which reads and writes
    everything twice and scatters slowly). A large CPU key is split across one worker thread
    per intra-op thread, each copying whole blocks single-threaded: one parallel region per
    key instead of one per block, whose barriers collapse throughput on a busy CPU. On CUDA,
    host↔device keys run ``non_blocking`` on a side stream that first waits for the current
    stream and that the current stream then waits for, so kernels on either side of a
    ``copy_blocks`` see a consistent pool. CPU-side reads of host or disk pools (a host↔disk
    key, :meth:`tensors` for tier ≥ 1, :meth:`synchronize`) wait for those copies to finish.
    Device→device keys stay on the current stream. A disk key is one ``pread``/``pwrite`` per
    block between the file and host memory (split over the same workers when large), after an
    ``fstat`` of the file: a removed or truncated file raises :class:`StorageError` before
    anything moves.

    Raises :class:`GeometryError` for a bad layout and :class:`StorageError` for a device or
    disk that cannot hold the pools (missing, unwritable, too small).
    """

    def __init__(
        self,
        tokens_per_block: int,
        geometries: Sequence[GroupGeometry],
        slots: Sequence[Sequence[int]],
        *,
        device: str | torch.device | None = None,
        disk_path: str | os.PathLike[str] | None = None,
    ) -> None:
        import torch

        super().__init__(tokens_per_block)
        self._geometries: tuple[GroupGeometry, ...] = _sequence("geometries", geometries)
        self._slots = _check_layout(self._geometries, slots)
        if disk_path is not None and not isinstance(disk_path, str | os.PathLike):
            raise StorageError(f"disk_path must be a path, got {disk_path!r}")
        self._device = _resolve_device(device)
        self._cuda = self._device.type == "cuda"
        self._block_bytes = tuple(g.block_bytes(tokens_per_block) for g in self._geometries)
        layout = (
            {g: (n, self._block_bytes[g]) for g, n in enumerate(self._slots[Tier.DISK]) if n}
            if len(self._slots) > Tier.DISK
            else {}
        )
        self._disk: dict[int, DiskPool] = create_pools(disk_path, layout) if layout else {}
        self._finalizer = weakref.finalize(self, close_pools, list(self._disk.values()))
        try:
            self._pools = [
                [self._allocate(tier, g) for g in range(len(self._geometries))]
                for tier in range(min(len(self._slots), Tier.DISK))
            ]
        except (RuntimeError, MemoryError) as exc:
            self._finalizer()
            raise StorageError(f"cannot allocate the KV pools {self._slots}: {exc}") from exc
        self._raws: dict[tuple[int, int], memoryview] = {}
        self._views: list[list[tuple[torch.Tensor, ...] | None]] = [
            [None] * len(self._geometries) for _ in self._slots
        ]
        self._side_stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
            if self._cuda
            else None
        )
        self._host_pending: torch.cuda.Event | None = None
        self._workers: ThreadPoolExecutor | None = None
        self._num_workers = torch.get_num_threads() if _thread_local_torch_threads() else 0

    def _allocate(self, tier: int, group: int) -> torch.Tensor:
        import torch

        geometry = self._geometries[group]
        dtype = getattr(torch, geometry.dtype)
        shape = (self._slots[tier][group], *geometry.block_shape(self.tokens_per_block))
        if tier == Tier.GPU:
            return torch.zeros(shape, dtype=dtype, device=self._device)
        return torch.zeros(shape, dtype=dtype, pin_memory=self._cuda)

    # -- the public surface

    @property
    def geometries(self) -> tuple[GroupGeometry, ...]:
        return self._geometries

    @property
    def slots(self) -> tuple[tuple[int, ...], ...]:
        """Slot counts, ``slots[tier][group]``."""
        return self._slots

    @property
    def device(self) -> torch.device:
        """Where tier 0 lives."""
        return self._device

    @property
    def disk_files(self) -> tuple[str, ...]:
        """Paths of the disk-tier files (empty once closed)."""
        return tuple(p.path for p in self._disk.values() if not p.closed)

    def block_bytes(self, layer_group: int) -> int:
        return self._block_bytes[self._check_group(layer_group)]

    def tensors(self, layer_group: int, tier: int = Tier.GPU) -> torch.Tensor:
        """The pool of one (tier, layer group): ``[slots, layers, 2, tpb, kv_heads, head_dim]``.

        Slot i of the pool is the block the manager calls slot i. For tier ≥ 1 this first waits
        for pending host↔device copies, so the returned tensor can be read or written from the
        CPU; a tensor kept across later :meth:`copy_blocks` calls needs :meth:`synchronize`.
        The disk tier (2) has no tensor: its pool comes back as a copy of the file, in host
        memory (writing to it does not change the file).
        """
        self._check_open()
        tier = self._check_tier(tier)
        group = self._check_group(layer_group)
        if tier != Tier.GPU:
            self.synchronize()
        if tier == Tier.DISK:
            return self._read_disk(group)
        return self._pools[tier][group]

    def check(self) -> None:
        """Raise :class:`StorageError` if closed, or if a disk-tier file was removed or
        truncated under the running storage (one ``fstat`` per file)."""
        self._check_open()
        for pool in self._disk.values():
            pool.check()

    def synchronize(self) -> None:
        """Wait until every host↔device copy issued so far has finished (no-op without CUDA)."""
        if self._host_pending is not None:
            self._host_pending.synchronize()
            self._host_pending = None

    def close(self) -> None:
        """Wait for pending copies, drop the pools and remove the disk files. Idempotent."""
        if self._closed:
            return
        self.synchronize()
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None
        self._pools = []
        self._views = []
        self._raws = {}
        self._finalizer()
        super().close()

    # -- the copy engine

    def _num_groups(self) -> int | None:
        return len(self._geometries)

    def _num_tiers(self) -> int:
        return len(self._slots)

    def _slot_count(self, tier: int, layer_group: int) -> int | None:
        return self._slots[tier][layer_group]

    def _slot_views(self, tier: int, group: int) -> tuple[torch.Tensor, ...]:
        views = self._views[tier][group]
        if views is None:
            # Views are cheap to keep and ~1 µs each to make: build them once per pool.
            views = self._views[tier][group] = self._pools[tier][group].unbind(0)
        return views

    def _run(self, key: CopyKey, src: list[int], dst: list[int]) -> None:
        import torch

        src_tier, dst_tier, group = key
        if Tier.DISK in (src_tier, dst_tier):
            self._run_disk(key, src, dst)
            return
        src_views, dst_views = self._slot_views(src_tier, group), self._slot_views(dst_tier, group)
        sources = [src_views[s] for s in src]
        targets = [dst_views[d] for d in dst]
        on_device = (self._cuda and src_tier == Tier.GPU, self._cuda and dst_tier == Tier.GPU)
        if on_device[0] != on_device[1]:
            self._copy_across(sources, targets)
            return
        if on_device[0]:
            torch._foreach_copy_(targets, sources)
            return
        # CPU memcpy into or out of host memory a DMA may still be reading or writing.
        self.synchronize()
        self._split(torch._foreach_copy_, targets, sources, self._block_bytes[group])

    def _split(self, fn: Callable[[Any, Any], object], a: list[Any], b: list[Any],
               block_bytes: int) -> None:
        """``fn(a, b)``, a large batch split in chunks over the copy workers."""
        workers = self._num_workers
        if workers < 2 or len(a) < 2 or len(a) * block_bytes < _SPLIT_BYTES:
            fn(a, b)
            return
        if self._workers is None:
            self._workers = ThreadPoolExecutor(
                workers, thread_name_prefix="kvpool-copy", initializer=_serial_torch_thread
            )
        # A few chunks per worker: a worker the OS preempts leaves its share to the others.
        step = -(-len(a) // (workers * _CHUNKS_PER_WORKER))
        futures = [
            self._workers.submit(fn, a[i : i + step], b[i : i + step])
            for i in range(0, len(a), step)
        ]
        wait(futures)  # all of them, even if one failed: none may still write after we return
        for future in futures:
            future.result()

    def _check_plan(self, plan: CopyPlan) -> None:
        for src_tier, dst_tier, group in plan:
            if Tier.DISK in (src_tier, dst_tier):
                self._disk[group].check()

    def _raw(self, tier: int, group: int) -> memoryview:
        """The bytes of a host-memory pool (tier 1, or tier 0 on the CPU), writable."""
        import torch

        raw = self._raws.get((tier, group))
        if raw is None:
            flat = self._pools[tier][group].view(torch.uint8).reshape(-1)
            raw = self._raws[tier, group] = flat.numpy().data
        return raw

    def _run_disk(self, key: CopyKey, src: list[int], dst: list[int]) -> None:
        """One key to or from the disk tier: ``pread``/``pwrite`` straight between the file
        and host memory; a CUDA tier 0 goes through a pinned staging buffer."""
        import torch

        src_tier, dst_tier, group = key
        size = self._block_bytes[group]
        self.synchronize()  # host memory a DMA may still be reading or writing
        if src_tier == dst_tier:  # disk to disk, through memory
            buffer = memoryview(bytearray(len(src) * size))
            chunks = [buffer[i * size : (i + 1) * size] for i in range(len(src))]
            self._disk[group].read(src, chunks)
            self._disk[group].write(dst, chunks)
            return
        to_disk = dst_tier == Tier.DISK
        pool = self._disk[group]
        mem_tier, mem_slots, disk_slots = (src_tier, src, dst) if to_disk else (dst_tier, dst, src)
        if not (self._cuda and mem_tier == Tier.GPU):
            raw = self._raw(mem_tier, group)
            chunks = [raw[s * size : (s + 1) * size] for s in mem_slots]
            self._split(pool.write if to_disk else pool.read, disk_slots, chunks, size)
            return
        stage = torch.empty((len(mem_slots), size), dtype=torch.uint8, pin_memory=True)
        staged = list(stage.unbind(0))
        views = self._slot_views(Tier.GPU, group)
        device = [views[s].view(torch.uint8).reshape(-1) for s in mem_slots]
        flat = stage.numpy().data
        chunks = [flat[i * size : (i + 1) * size] for i in range(len(mem_slots))]
        if to_disk:
            torch._foreach_copy_(staged, device)  # synchronous: the host waits for the bytes
            self._split(pool.write, disk_slots, chunks, size)
        else:
            self._split(pool.read, disk_slots, chunks, size)
            torch._foreach_copy_(device, staged)

    def _read_disk(self, group: int) -> torch.Tensor:
        import torch

        geometry = self._geometries[group]
        shape = (self._slots[Tier.DISK][group], *geometry.block_shape(self.tokens_per_block))
        out = torch.zeros(shape, dtype=getattr(torch, geometry.dtype))
        pool = self._disk.get(group)
        if pool is not None:
            pool.check()
            size = pool.block_bytes
            flat = out.view(torch.uint8).reshape(-1).numpy().data
            pool.read(range(pool.slots), [flat[i * size : (i + 1) * size]
                                          for i in range(pool.slots)])
        return out

    def _copy_across(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        import torch

        assert self._side_stream is not None
        current = torch.cuda.current_stream(self._device)
        # Reading device slots must wait for the kernels that wrote them; writing device slots
        # must wait for the kernels still reading the old contents.
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            torch._foreach_copy_(targets, sources, non_blocking=True)  # host memory is pinned
        # Later kernels on the current stream see onboarded blocks and don't overwrite
        # offloaded sources before the DMA has read them.
        current.wait_stream(self._side_stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._side_stream)
        self._host_pending = event


# Below this many bytes per key, handing work to threads costs more than it saves.
_SPLIT_BYTES = 4 << 20
_CHUNKS_PER_WORKER = 4


@cache
def _thread_local_torch_threads() -> bool:
    """Whether ``torch.set_num_threads`` in one thread leaves the others alone (OpenMP only):
    without it, copy workers could not run single-threaded, so none are used."""
    import torch

    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _serial_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)  # thread-local under OpenMP: the caller's threads are untouched


def _check_layout(
    geometries: tuple[GroupGeometry, ...], slots: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], ...]:
    if not geometries:
        raise GeometryError("TorchStorage needs at least one layer group geometry")
    for g, geometry in enumerate(geometries):
        if not isinstance(geometry, GroupGeometry):
            raise GeometryError(f"geometries[{g}] must be a GroupGeometry, got {geometry!r}")
    table = tuple(_sequence(f"slots[{tier}]", row) for tier, row in
                  enumerate(_sequence("slots", slots)))
    if not 1 <= len(table) <= NUM_TIERS:
        raise GeometryError(f"slots must list 1 to {NUM_TIERS} tiers, got {len(table)}")
    for tier, row in enumerate(table):
        if len(row) != len(geometries):
            raise GeometryError(
                f"slots[{tier}] has {len(row)} entries for {len(geometries)} layer groups"
            )
        for g, count in enumerate(row):
            if not _is_int(count) or count < 0:
                raise GeometryError(f"slots[{tier}][{g}] must be a non-negative int, got {count!r}")
    return table


def _sequence(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise GeometryError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


def _resolve_device(device: object) -> torch.device:
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise StorageError(f"device {device!r} is not a torch device: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise StorageError(f"device {device!r} asks for CUDA, which is not available")
        if resolved.index is None:  # streams and events need a concrete device
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise StorageError(f"device {device!r} is not supported (use 'cpu' or 'cuda[:N]')")
    return resolved
