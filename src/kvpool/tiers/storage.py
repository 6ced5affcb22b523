"""The data plane: where KV bytes live, per tier and layer group, and the batched copy engine.

The block manager decides which slot of which tier and layer group holds each block; a
:class:`Storage` only moves bytes between slots when asked. Two implementations:

* :class:`MetadataStorage` holds no data. It validates and counts copies exactly like the real
  one, for simulation, routing and tests. It never imports torch.
* :class:`~kvpool.tiers.torch_storage.TorchStorage` (:mod:`~kvpool.tiers.torch_storage`)
  holds one tensor per (tier, layer group), shaped
  ``[slots, num_layers, 2 (K, V), tokens_per_block, kv_heads, head_dim]``: tier 0 on the
  compute device, tier 1 in host memory (pinned when tier 0 is a CUDA device), tier 2 in one
  file per layer group, read and written with ``pread``/``pwrite`` (:mod:`kvpool.tiers.diskfile`:
  never memory-mapped, so a truncated file is an error, not SIGBUS). torch is imported only
  when one is built.

This module holds what both share: tiers, geometries, the copy tuple, the stats, the
:class:`Storage` protocol and the validating copy engine.

Copy contract (:meth:`Storage.copy_blocks`), shared by both:

* The caller passes every copy of one public call, ordered so that running the *groups* of
  copies in order of first appearance of their key ``(src_tier, dst_tier, layer_group)`` is
  correct (e.g. host→disk before GPU→host before host→GPU before GPU→GPU).
* Each key runs as ONE batched operation, never one call per block.
* Within one key no destination slot is also a source slot (an internal invariant of the
  caller, asserted) and no destination slot appears twice (a :class:`BlockCopyError`).
* Everything is validated before anything moves, the disk files included (closed, removed or
  truncated: :meth:`Storage.check`): a call that raises that way copies nothing.
* A copy that fails while running (a disk write past a full disk or the file size limit, an
  I/O error) fails alone: the call runs every other key and copy, then raises
  :class:`~kvpool.errors.CopyFailedError` naming the copies that did not complete (a key that
  raised anything else counts whole). The manager drops the blocks those copies were moving
  to a colder tier and refuses further copies only when one was bringing a block a sequence
  uses (:meth:`kvpool.core.state.CacheState.finish_call`).
* Bytes survive any round trip bit for bit (copies never convert or compute; NaN payloads stay).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType, TracebackType
from typing import NamedTuple, Protocol, Self, runtime_checkable

from kvpool.errors import BlockCopyError, CopyFailedError, GeometryError, StorageError
from kvpool.validation import is_int


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


def _show(value: object) -> str:
    """A value for an error message: ints (IntEnum members too) as plain numbers."""
    return str(int(value)) if is_int(value) else repr(value)


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
            if not is_int(value) or value <= 0:
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


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """The recurrent state of one state layer group (Mamba, gated delta net, short conv).

    One slot holds one sequence's whole state for the group's ``num_layers`` layers: per layer
    one array per entry of ``shapes`` (e.g. the conv state ``(channels, kernel - 1)`` and the
    SSM / recurrent state ``(heads, head_dim, state_dim)``), each of ``dtype`` (or of
    ``dtypes[k]`` when given). A slot is a fixed number of bytes whatever the sequence's
    length, so ``block_bytes`` ignores the block size. The storage keeps a state pool as
    bytes (``[slots, block_bytes]``) and hands out typed views of it, one per shape
    (:meth:`~kvpool.tiers.torch_storage.TorchStorage.tensors`).

    Raises :class:`GeometryError` on a non-positive size or an unknown dtype.
    """

    num_layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float16"
    dtypes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not is_int(self.num_layers) or self.num_layers <= 0:
            raise GeometryError(
                f"StateGeometry.num_layers must be a positive int, got {self.num_layers!r}")
        if isinstance(self.shapes, str | bytes) or not isinstance(self.shapes, Iterable):
            raise GeometryError(f"StateGeometry.shapes must be a sequence of shapes, "
                                f"got {self.shapes!r}")
        shapes = tuple(tuple(s) if isinstance(s, Iterable) else s for s in self.shapes)
        if not shapes or not all(isinstance(s, tuple) and s and all(
                is_int(d) and d > 0 for d in s) for s in shapes):
            raise GeometryError(f"StateGeometry.shapes must hold shapes of positive ints, "
                                f"got {self.shapes!r}")
        object.__setattr__(self, "shapes", shapes)
        dtypes = (self.dtype,) * len(shapes) if self.dtypes is None else tuple(self.dtypes)
        if len(dtypes) != len(shapes) or not all(
                isinstance(d, str) and d in DTYPE_ITEMSIZE for d in dtypes):
            raise GeometryError(f"StateGeometry dtypes {dtypes!r} must name one of "
                                f"{sorted(DTYPE_ITEMSIZE)} per shape")
        object.__setattr__(self, "dtypes", dtypes)

    def parts(self) -> tuple[tuple[int, int, tuple[int, ...], str], ...]:
        """Per shape: (byte offset in a slot, bytes, ``(num_layers, *shape)``, dtype). Each
        part starts 16-byte aligned, so its typed view needs no copy."""
        out = []
        off = 0
        assert self.dtypes is not None
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            n = self.num_layers * DTYPE_ITEMSIZE[dt]
            for d in shape:
                n *= d
            out.append((off, n, (self.num_layers, *shape), dt))
            off += -(-n // 16) * 16
        return tuple(out)

    def block_bytes(self, tokens_per_block: int = 1) -> int:
        """Bytes of one state slot (every part, 16-byte aligned; the block size is ignored)."""
        off, n, _, _ = self.parts()[-1]
        return off + -(-n // 16) * 16

    def block_shape(self, tokens_per_block: int = 1) -> tuple[int]:
        """Shape of one slot in the byte pool: ``(block_bytes,)``."""
        return (self.block_bytes(),)


LayerGeometry = GroupGeometry | StateGeometry
"""What ``CacheConfig.layer_geometry`` holds per layer group: KV blocks or recurrent state."""


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
    if not is_int(tokens_per_block) or tokens_per_block <= 0:
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
        order of first appearance. Validates everything first; a call that raises that way
        moves nothing.

        Raises :class:`BlockCopyError` for a tier, group or slot that does not exist or a
        destination written twice under one key; :class:`StorageError` once closed;
        :class:`CopyFailedError` after running every key when some copies failed while
        running (the others completed).
        """
        self._check_open()
        plan = self.plan(copies)
        self._check_plan(plan)
        failed: list[BlockCopy] = []
        first: Exception | None = None
        for key, (src, dst) in plan.items():
            try:
                self._run(key, src, dst)
                lost = 0
            except CopyFailedError as exc:
                failed += [BlockCopy(*c) for c in exc.failed]
                first, lost = first or exc, len(exc.failed)
            except Exception as exc:  # whatever it was, the key's copies failed
                failed += [BlockCopy(key[0], s, key[1], d, key[2])
                           for s, d in zip(src, dst, strict=True)]
                first, lost = first or exc, len(src)
            tiers, blocks = (key[0], key[1]), len(src) - lost
            nbytes = blocks * self.block_bytes(key[2])
            self._blocks_moved[tiers] = self._blocks_moved.get(tiers, 0) + blocks
            self._bytes_moved[tiers] = self._bytes_moved.get(tiers, 0) + nbytes
            self._batched_ops += 1
        if failed:
            raise CopyFailedError(
                f"{len(failed)} of {len(copies)} block copies failed: {first}", tuple(failed)
            ) from first

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
        if not is_int(tier) or not 0 <= tier < self._num_tiers():
            raise BlockCopyError(f"tier {_show(tier)} is not one of 0..{self._num_tiers() - 1}")
        return tier

    def _check_group(self, group: object) -> int:
        groups = self._num_groups()
        if (
            not is_int(group)
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
                if not is_int(s):
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
            if not is_int(size) or size < 0:
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

