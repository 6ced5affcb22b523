"""The torch data plane: KV pools as tensors per (tier, layer group) and their batched copies.

Tier 0 lives on the compute device, tier 1 in host memory (pinned when tier 0 is a CUDA
device), tier 2 in one file per layer group read and written with ``pread``/``pwrite``
(:mod:`kvpool.tiers.diskfile`). The copy contract is :mod:`~.storage`'s; torch is imported
only when a storage is built.

A persistent disk tier (``persistent=True``) keeps its files under stable names in
``disk_path`` across processes (:func:`kvpool.tiers.diskfile.open_persistent_pools`) and records the
xxh3_64 of every block it writes there (:meth:`TorchStorage.disk_checksums`), which the warm
restart (:mod:`kvpool.core.persist`) checks the bytes against before it serves them again.

Failures while copying: a disk write that fails (the disk full, past the file size limit, an
I/O error) fails only its own blocks; the rest of the call's copies run, and
:class:`~kvpool.errors.CopyFailedError` names the copies that did not complete. Disk reads a
call will need can be done before the call changes anything (:meth:`TorchStorage.read_ahead`),
so that a read error refuses the call instead of failing it half done.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from kvpool.errors import CopyFailedError, GeometryError, StorageError
from kvpool.tiers.diskfile import (
    DiskPool,
    DiskWriteError,
    close_pools,
    create_pools,
    open_persistent_pools,
)
from kvpool.tiers.storage import (
    NUM_TIERS,
    BlockCopy,
    CopyKey,
    CopyPlan,
    GroupGeometry,
    LayerGeometry,
    StateGeometry,
    Tier,
    _CopyEngine,
)
from kvpool.tiers.torch_device import (
    resolve_device,
    serial_torch_thread,
    thread_local_torch_threads,
)
from kvpool.validation import check_bool, is_int

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = ["TorchStorage"]


class TorchStorage(_CopyEngine):
    """KV pools as torch tensors, one per (tier, layer group), and the batched copy engine.

    ``slots[tier][group]`` is the slot count of each pool; ``len(slots)`` tiers (1 to 3) exist.
    Tier 0 lives on ``device`` (default: ``"cuda"`` if available, else ``"cpu"``); tier 1 in
    host memory, pinned when tier 0 is a CUDA device; tier 2 in one file per layer group under
    ``disk_path`` (:mod:`kvpool.tiers.diskfile`: created, sized and locked here, removed by
    :meth:`close`, on SIGTERM and by the next storage built there after a crash; with
    ``persistent=True`` opened again under stable names and never removed). Every memory pool
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
    Device→device keys stay on the current stream. On CUDA with Triton (``kernel``: None =
    whenever both are there), every key with a device side is instead one Triton gather /
    scatter (:mod:`kvpool.tiers.copy_kernels`) reading or writing the pinned host pool directly,
    on the same streams with the same events; ``kernel=True`` on the CPU runs it in Triton's
    interpreter (``TRITON_INTERPRET=1``, for tests). A disk key is one ``pread``/``pwrite`` per
    block between the file and host memory (split over the same workers when large), after an
    ``fstat`` of the file: a removed or truncated file raises :class:`StorageError` before
    anything moves.

    Raises :class:`GeometryError` for a bad layout and :class:`StorageError` for a device or
    disk that cannot hold the pools (missing, unwritable, too small).
    """

    def __init__(
        self,
        tokens_per_block: int,
        geometries: Sequence[LayerGeometry],
        slots: Sequence[Sequence[int]],
        *,
        device: str | torch.device | None = None,
        disk_path: str | os.PathLike[str] | None = None,
        persistent: bool = False,
        kernel: bool | None = None,
    ) -> None:
        import torch

        from kvpool.tiers import copy_kernels

        super().__init__(tokens_per_block)
        self._geometries: tuple[LayerGeometry, ...] = _sequence("geometries", geometries)
        self._slots = _check_layout(self._geometries, slots)
        if disk_path is not None and not isinstance(disk_path, str | os.PathLike):
            raise StorageError(f"disk_path must be a path, got {disk_path!r}")
        self._device = resolve_device(device)
        self._cuda = self._device.type == "cuda"
        if kernel is None:
            kernel = self._cuda and copy_kernels.available(self._device)
        elif kernel and not copy_kernels.available(self._device):
            raise StorageError(f"kernel=True needs Triton (and CUDA or TRITON_INTERPRET=1) "
                               f"for pools on {self._device}")
        self._kernel = bool(kernel)
        self._block_bytes = tuple(g.block_bytes(tokens_per_block) for g in self._geometries)
        layout = (
            {g: (n, self._block_bytes[g]) for g, n in enumerate(self._slots[Tier.DISK]) if n}
            if len(self._slots) > Tier.DISK
            else {}
        )
        check_bool("persistent", persistent, error=StorageError)
        self._persistent = persistent and bool(layout)
        opener = open_persistent_pools if persistent else create_pools
        self._disk: dict[int, DiskPool] = opener(disk_path, layout) if layout else {}
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
        self._num_workers = torch.get_num_threads() if thread_local_torch_threads() else 0
        # disk slots read ahead of the copies that need them: (group, slot) -> bytes, kept
        # until the end of the next copy_blocks (read_ahead)
        self._staged: dict[tuple[int, int], memoryview] = {}

    def _allocate(self, tier: int, group: int) -> torch.Tensor:
        import torch

        geometry = self._geometries[group]
        # a state pool is bytes; tensors() gives typed views of each part of a slot
        dtype = (torch.uint8 if isinstance(geometry, StateGeometry)
                 else getattr(torch, geometry.dtype))
        shape = (self._slots[tier][group], *geometry.block_shape(self.tokens_per_block))
        if tier == Tier.GPU:
            return torch.zeros(shape, dtype=dtype, device=self._device)
        return torch.zeros(shape, dtype=dtype, pin_memory=self._cuda)

    # -- the public surface

    @property
    def geometries(self) -> tuple[LayerGeometry, ...]:
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

    @property
    def persistent(self) -> bool:
        """Whether the disk tier outlives this storage (module docstring)."""
        return self._persistent

    def block_bytes(self, layer_group: int) -> int:
        return self._block_bytes[self._check_group(layer_group)]

    def disk_checksums(self, layer_group: int, slots: Sequence[int]) -> list[int]:
        """The xxh3_64 of the bytes this storage last wrote to each disk slot of ``slots``
        (persistent disk tier only; 0 for a slot it never wrote)."""
        sums = self._persistent_pool(layer_group).checksums
        assert sums is not None
        return [sums[s] for s in slots]

    def read_disk_checksums(self, layer_group: int, slots: Sequence[int]) -> list[int]:
        """The xxh3_64 of the bytes each disk slot of ``slots`` holds now, read from the file
        (persistent disk tier only)."""
        pool = self._persistent_pool(layer_group)
        pool.check()
        return pool.hash_slots(slots)

    def sync_disk(self) -> None:
        """fsync the disk tier's files (what was written survives a machine crash)."""
        self._check_open()
        for pool in self._disk.values():
            pool.sync()

    def _persistent_pool(self, layer_group: int) -> DiskPool:
        self._check_open()
        pool = self._disk.get(self._check_group(layer_group))
        if pool is None or not pool.persistent:
            raise StorageError(f"layer group {layer_group} has no persistent disk tier")
        return pool

    def tensors(self, layer_group: int, tier: int = Tier.GPU) -> Any:
        """The pool of one (tier, layer group): ``[slots, layers, 2, tpb, kv_heads, head_dim]``;
        for a state group (:class:`StateGeometry`) a tuple of typed views of the state pool,
        one per shape, ``[slots, layers, *shape]`` (writing them writes the pool).

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
        pool = self._read_disk(group) if tier == Tier.DISK else self._pools[tier][group]
        geometry = self._geometries[group]
        if isinstance(geometry, StateGeometry):
            return state_views(pool, geometry)
        return pool

    def zero_slots(self, layer_group: int, slots: Sequence[int]) -> None:
        """Zero GPU slots of a layer group (a cold sequence's recurrent state starts at 0)."""
        import torch

        self._check_open()
        group = self._check_group(layer_group)
        if slots:
            self._pools[Tier.GPU][group][torch.tensor(list(slots), dtype=torch.long,
                                                      device=self._device)] = 0

    def read_ahead(self, reads: dict[int, list[int]]) -> None:
        """Read the disk slots ``reads`` (layer group -> slots) into host memory now: the next
        :meth:`copy_blocks` takes its reads of them from there, and cannot fail on them. A
        manager calls it before it changes anything in a call that will read those slots, so
        that a read error (:class:`StorageError`) refuses the call. The bytes are dropped at
        the end of the next :meth:`copy_blocks` (and by the next ``read_ahead``)."""
        self._check_open()
        self._staged = {}
        staged: dict[tuple[int, int], memoryview] = {}
        for group, slots in reads.items():
            pool = self._disk.get(self._check_group(group))
            if pool is None or not slots:
                continue
            self._check_slots(Tier.DISK, group, list(slots), "source")
            pool.check()
            size = pool.block_bytes
            buffer = memoryview(bytearray(len(slots) * size))
            chunks = [buffer[i * size:(i + 1) * size] for i in range(len(slots))]
            pool.read(slots, chunks)
            staged.update(((group, s), c) for s, c in zip(slots, chunks, strict=True))
        self._staged = staged

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """See :meth:`kvpool.tiers.storage.Storage.copy_blocks`; the bytes :meth:`read_ahead` kept
        are dropped at the end."""
        try:
            super().copy_blocks(copies)
        finally:
            self._staged = {}

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
        """Wait for pending copies, drop the pools and remove the disk files (a persistent
        tier's are fsynced and kept). Idempotent."""
        if self._closed:
            return
        self.synchronize()
        if self._persistent:
            for pool in self._disk.values():
                with contextlib.suppress(StorageError):  # the checksums catch unsynced bytes
                    pool.sync()
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
        if self._kernel and (any(on_device) or not self._cuda):
            self._run_kernel(key, src, dst, on_device[0] != on_device[1])
            return
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
                workers, thread_name_prefix="kvpool-copy", initializer=serial_torch_thread
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
        failed: list[int] = []
        io = self._writer(pool, group, failed) if to_disk else self._reader(pool, group)
        if not (self._cuda and mem_tier == Tier.GPU):
            raw = self._raw(mem_tier, group)
            chunks = [raw[s * size : (s + 1) * size] for s in mem_slots]
            self._split(io, disk_slots, chunks, size)
        else:
            stage = torch.empty((len(mem_slots), size), dtype=torch.uint8, pin_memory=True)
            staged = list(stage.unbind(0))
            views = self._slot_views(Tier.GPU, group)
            device = [views[s].view(torch.uint8).reshape(-1) for s in mem_slots]
            flat = stage.numpy().data
            chunks = [flat[i * size : (i + 1) * size] for i in range(len(mem_slots))]
            if to_disk:
                torch._foreach_copy_(staged, device)  # synchronous: the host waits for the bytes
                self._split(io, disk_slots, chunks, size)
            else:
                self._split(io, disk_slots, chunks, size)
                torch._foreach_copy_(device, staged)
        if failed:
            lost = set(failed)
            raise CopyFailedError(
                f"cannot write {len(lost)} of {len(dst)} blocks to the disk tier {pool.path!r} "
                f"(file size limit, disk full or I/O error)",
                tuple(BlockCopy(src_tier, s, dst_tier, d, group)
                      for s, d in zip(src, dst, strict=True) if d in lost))

    def _writer(self, pool: DiskPool, group: int,
                failed: list[int]) -> Callable[[Any, Any], None]:
        """``pool.write`` that adds the slots it could not write to ``failed`` (and forgets
        any bytes read ahead for the slots it writes)."""
        staged = self._staged

        def write(slots: list[int], chunks: list[memoryview]) -> None:
            for s in slots:
                staged.pop((group, s), None)
            try:
                pool.write(slots, chunks)
            except DiskWriteError as exc:
                failed.extend(exc.slots)  # list.extend is atomic: workers may share it

        return write

    def _reader(self, pool: DiskPool, group: int) -> Callable[[Any, Any], None]:
        """``pool.read``, taking the slots :meth:`read_ahead` kept from memory."""
        staged = self._staged
        if not staged:
            return pool.read

        def read(slots: list[int], chunks: list[memoryview]) -> None:
            rest: list[int] = []
            into: list[memoryview] = []
            for s, chunk in zip(slots, chunks, strict=True):
                kept = staged.get((group, s))
                if kept is None:
                    rest.append(s)
                    into.append(chunk)
                else:
                    chunk[:] = kept
            if rest:
                pool.read(rest, into)

        return read

    def _read_disk(self, group: int) -> torch.Tensor:
        import torch

        geometry = self._geometries[group]
        shape = (self._slots[Tier.DISK][group], *geometry.block_shape(self.tokens_per_block))
        dtype = (torch.uint8 if isinstance(geometry, StateGeometry)
                 else getattr(torch, geometry.dtype))
        out = torch.zeros(shape, dtype=dtype)
        pool = self._disk.get(group)
        if pool is not None:
            pool.check()
            size = pool.block_bytes
            flat = out.view(torch.uint8).reshape(-1).numpy().data
            pool.read(range(pool.slots), [flat[i * size : (i + 1) * size]
                                          for i in range(pool.slots)])
        return out

    def _run_kernel(self, key: CopyKey, src: list[int], dst: list[int], across: bool) -> None:
        """One key as one Triton launch (:mod:`kvpool.tiers.copy_kernels`); host↔device on the side
        stream like :meth:`_copy_across` (the kernel reads or writes mapped pinned memory)."""
        import torch

        from kvpool.tiers.copy_kernels import block_index, copy_blocks

        src_tier, dst_tier, group = key
        pools = (self._pools[src_tier][group], self._pools[dst_tier][group])
        if not self._cuda:  # Triton's interpreter (tests)
            self.synchronize()
            copy_blocks(*pools, block_index(src, dst, self._device))
            return
        if not across:
            copy_blocks(*pools, block_index(src, dst, self._device))
            return
        assert self._side_stream is not None
        current = torch.cuda.current_stream(self._device)
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            copy_blocks(*pools, block_index(src, dst, self._device))
        current.wait_stream(self._side_stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._side_stream)
        self._host_pending = event

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


def _check_layout(
    geometries: tuple[LayerGeometry, ...], slots: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], ...]:
    if not geometries:
        raise GeometryError("TorchStorage needs at least one layer group geometry")
    for g, geometry in enumerate(geometries):
        if not isinstance(geometry, GroupGeometry | StateGeometry):
            raise GeometryError(f"geometries[{g}] must be a GroupGeometry or StateGeometry, "
                                f"got {geometry!r}")
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
            if not is_int(count) or count < 0:
                raise GeometryError(f"slots[{tier}][{g}] must be a non-negative int, got {count!r}")
    return table


def _sequence(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise GeometryError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


def state_views(pool: torch.Tensor, geometry: StateGeometry) -> tuple[torch.Tensor, ...]:
    """Typed views ``[slots, layers, *shape]`` of a byte state pool ``[slots, bytes]``, one per
    part of :meth:`StateGeometry.parts` (no copy: each part is 16-byte aligned)."""
    import torch

    out = []
    for off, n, shape, dt in geometry.parts():
        part = pool[:, off:off + n].view(getattr(torch, dt))
        out.append(part.view(pool.shape[0], *shape))
    return tuple(out)
