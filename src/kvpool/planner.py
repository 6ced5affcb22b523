"""Capacity planning: how many slots each layer group gets in each memory tier (seed 004).

A model's layers fall into *layer groups*, one per distinct memory life cycle (full attention,
or a sliding window of W tokens with S sink tokens), numbered in layer order of first
appearance. Every group has its own pool per tier, and a block of a group costs

    bytes_per_block = Σ over the group's layers of 2 (K, V) × tpb × kv_heads × head_dim × itemsize

:func:`plan_pools` turns a memory budget per tier into slots per (tier, group):

1. **Floors.** A *constraint* is a batch (a list of :class:`KVCacheDesc`) that must always fit
   on the GPU. Its need per group is the sum of :func:`blocks_needed` over its sequences; a
   group's floor (``min_slots``) is the largest need over all constraints. Three constraints
   are always present, and the caller may add more:

   - ``concurrent_decode``: ``max_batch_size`` sequences, each one block long with history
     ``tpb − 1``. Each needs one slot in *every* group, so no group is ever smaller than the
     batch. Without it a small sliding window sizes its pool from long-history requests alone
     (one or two slots) and the scheduler deadlocks as soon as more sequences decode at once.
   - ``longest_sequence``: one sequence at ``max_seq_len`` computing its last prefill chunk of
     ``min(max_num_tokens, max_seq_len)`` tokens (the largest step a single sequence can take).
   - ``largest_chunk``: one fresh sequence whose first chunk is
     ``min(max_num_tokens, max_seq_len)`` tokens.

2. **Split.** The *typical step* (a batch) decides how the GPU bytes above the floors are shared:
   every group gets bytes in proportion to ``typical need × bytes_per_block``, i.e. the same
   number of slots per block of typical need. A group whose proportional share falls below its
   floor gets its floor instead and the others share the rest the same way (water-filling), so
   floors always win and, when no floor binds, the slot ratio is the typical step's need ratio
   to within one slot of rounding. The default typical step is one prefill chunk of
   ``min(max_num_tokens, max_seq_len)`` tokens plus ``max_batch_size − 1`` decodes at half the
   maximum sequence length.

3. **Colder tiers.** Host and disk bytes are split by the same typical-step rule, without
   floors: they only hold cached copies, and no running sequence ever needs its blocks there.

Invariant of every plan: for each tier, Σ slots × bytes_per_block ≤ that tier's budget, and on
the GPU every group has at least ``min_slots ≥ max_batch_size`` slots. A budget that cannot
hold the floors raises :class:`~kvpool.errors.CapacityError` with the smallest budget that works.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Final

from kvpool.errors import CapacityError, InvalidArgumentError

__all__ = [
    "DTYPE_BYTES",
    "TIER_NAMES",
    "BatchConstraint",
    "GroupPlan",
    "KVCacheDesc",
    "LayerGroupSpec",
    "LayerSpec",
    "ModelSpec",
    "PoolPlan",
    "batch_need",
    "blocks_needed",
    "default_typical_step",
    "format_size",
    "parse_size",
    "plan_pools",
    "presets",
    "split_budget",
]

DTYPE_BYTES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "float32": 4,
        "fp32": 4,
        "float16": 2,
        "fp16": 2,
        "half": 2,
        "bfloat16": 2,
        "bf16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "fp8": 1,
        "int8": 1,
    }
)
"""Bytes per element of the KV dtypes the planner knows."""

TIER_NAMES: Final[tuple[str, str, str]] = ("gpu", "host", "disk")
"""Tier index → name (0 = GPU, 1 = host, 2 = disk), as in ARCHITECTURE §1."""


def _label(window: int | None, sink_tokens: int) -> str:
    if window is None:
        return "full"
    return f"window {window}" + (f" + {sink_tokens} sink" if sink_tokens else "")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tuple(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


MAX_BATCH_SIZE: Final = 1 << 20
"""The largest ``max_batch_size`` the planner takes (its constraints list every sequence)."""


# --------------------------------------------------------------------------- model geometry


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's KV geometry.

    ``window`` is the sliding window in tokens (``None`` = full attention); ``sink_tokens`` are
    the leading tokens a windowed layer keeps forever (only meaningful with a window).
    """

    window: int | None
    _: KW_ONLY
    kv_heads: int
    head_dim: int
    sink_tokens: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise InvalidArgumentError(f"window must be None or an int >= 1, got {self.window!r}")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise InvalidArgumentError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if self.window is None and self.sink_tokens:
            raise InvalidArgumentError(
                f"sink_tokens={self.sink_tokens} needs a sliding window (full attention keeps "
                "every token already)"
            )
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(
                f"unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """Layers that share one memory life cycle: the same ``(window, sink_tokens)``."""

    index: int
    window: int | None
    sink_tokens: int
    layers: tuple[int, ...]
    bytes_per_token: int

    def bytes_per_block(self, tokens_per_block: int) -> int:
        """Bytes of one slot of this group's pool (all its layers, K and V)."""
        return self.bytes_per_token * tokens_per_block

    @property
    def label(self) -> str:
        """``full`` or ``window W`` (``+ S sink``), for tables and messages."""
        return _label(self.window, self.sink_tokens)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's attention layers, in order, and the longest sequence it serves."""

    name: str
    layers: tuple[LayerSpec, ...]
    max_seq_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _as_tuple(f"model {self.name!r}: layers", self.layers))
        if not self.layers:
            raise InvalidArgumentError(f"model {self.name!r} has no layers")
        if not all(isinstance(layer, LayerSpec) for layer in self.layers):
            raise InvalidArgumentError(f"model {self.name!r}: layers must be LayerSpec objects")
        if not _is_int(self.max_seq_len) or self.max_seq_len < 1:
            raise InvalidArgumentError(f"max_seq_len must be an int >= 1, got {self.max_seq_len!r}")

    @staticmethod
    def preset(name: str) -> ModelSpec:
        """The preset called ``name`` (see :func:`presets`); unknown names list the valid ones."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown model preset {name!r}; valid presets: {', '.join(_PRESETS)}"
            ) from None

    def layer_groups(self) -> tuple[LayerGroupSpec, ...]:
        """Groups of layers with the same ``(window, sink_tokens)``, numbered by first layer."""
        order: dict[tuple[int | None, int], list[int]] = {}
        for i, layer in enumerate(self.layers):
            order.setdefault((layer.window, layer.sink_tokens), []).append(i)
        return tuple(
            LayerGroupSpec(
                index=g,
                window=window,
                sink_tokens=sink,
                layers=tuple(members),
                bytes_per_token=sum(self.layers[i].bytes_per_token for i in members),
            )
            for g, ((window, sink), members) in enumerate(order.items())
        )


def _uniform(
    name: str, n: int, *, kv_heads: int, head_dim: int, max_seq_len: int, window: int | None
) -> ModelSpec:
    layer = LayerSpec(window, kv_heads=kv_heads, head_dim=head_dim)
    return ModelSpec(name, (layer,) * n, max_seq_len)


def _interleaved(
    name: str,
    n: int,
    *,
    kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    window: int,
    global_every: int,
    dtype: str = "bfloat16",
) -> ModelSpec:
    """Every ``global_every``-th layer (1-based) is full attention, the others are windowed."""
    local = LayerSpec(window, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    full = LayerSpec(None, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    layers = tuple(full if (i + 1) % global_every == 0 else local for i in range(n))
    return ModelSpec(name, layers, max_seq_len)


# Public geometries (layer counts, KV heads, head dims, windows) of well-known checkpoints; the
# planner needs nothing else from a model.
_PRESETS: Final[Mapping[str, ModelSpec]] = MappingProxyType(
    {
        "llama-3-8b": _uniform(
            "llama-3-8b", 32, kv_heads=8, head_dim=128, max_seq_len=8192, window=None
        ),
        "mistral-7b": _uniform(
            "mistral-7b", 32, kv_heads=8, head_dim=128, max_seq_len=32768, window=4096
        ),
        # Gemma 2 alternates local (even layers) and global (odd layers) attention.
        "gemma-2-9b": _interleaved(
            "gemma-2-9b",
            42,
            kv_heads=8,
            head_dim=256,
            max_seq_len=8192,
            window=4096,
            global_every=2,
        ),
        # Gemma 3: five local layers, then one global layer.
        "gemma-3-12b": _interleaved(
            "gemma-3-12b",
            48,
            kv_heads=8,
            head_dim=256,
            max_seq_len=131072,
            window=1024,
            global_every=6,
        ),
        "tiny": _interleaved(
            "tiny",
            4,
            kv_heads=2,
            head_dim=16,
            max_seq_len=2048,
            window=64,
            global_every=2,
            dtype="float16",
        ),
    }
)


def presets() -> Mapping[str, ModelSpec]:
    """The built-in model geometries by name (read-only)."""
    return _PRESETS


# --------------------------------------------------------------------------- block needs


@dataclass(frozen=True, slots=True)
class KVCacheDesc:
    """One sequence in a batch: ``capacity`` tokens, of which the first ``history_length`` were
    computed in earlier steps (the rest are computed in this step)."""

    capacity: int
    history_length: int

    def __post_init__(self) -> None:
        if not _is_int(self.capacity) or self.capacity < 0:
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {self.capacity!r}")
        if not _is_int(self.history_length) or not 0 <= self.history_length <= self.capacity:
            raise InvalidArgumentError(
                f"history_length must be an int in [0, capacity={self.capacity}], "
                f"got {self.history_length!r}"
            )


def blocks_needed(
    desc: KVCacheDesc, tokens_per_block: int, window: int | None, sink_tokens: int = 0
) -> int:
    """Blocks of one sequence that a step must hold in one layer group (its non-stale blocks).

    With ``h = history_length``, ``c = capacity``, ``W = window`` and ``S = sink_tokens``::

        position  0 ... S-1 | ...  stale  ... | h-W-1 ...  h-1 | h ... c-1
                  [  sinks  ]                 [ last W+1 of    ][ new this ]
                                                the history       step

    A block is needed when it holds a sink token or a position in ``[max(0, h − W − 1), c)``
    (blocks are ``[k·tpb, (k+1)·tpb)``). Full attention (``window=None``) needs every block up
    to the capacity, ``ceil(c / tpb)``. A block holding both a sink and a window position is
    counted once.
    """
    if not _is_int(tokens_per_block) or tokens_per_block < 1:
        raise InvalidArgumentError(f"tokens_per_block must be an int >= 1, got {tokens_per_block}")
    tpb, cap = tokens_per_block, desc.capacity
    if cap == 0:
        return 0
    last = (cap - 1) // tpb  # the block holding the last position
    if window is None:
        return last + 1
    first = max(0, desc.history_length - window - 1) // tpb
    sinks = min(sink_tokens, cap)
    sink_blocks = -(-sinks // tpb)  # blocks 0 .. sink_blocks-1
    # The window blocks are first..last; the sink blocks 0..sink_blocks-1 overlap them when
    # they reach block `first`.
    return (last - first + 1) + min(sink_blocks, first)


def batch_need(
    batch: Iterable[KVCacheDesc], groups: Sequence[LayerGroupSpec], tokens_per_block: int
) -> tuple[int, ...]:
    """Slots per layer group that ``batch`` needs at once (Σ :func:`blocks_needed`)."""
    needs = [0] * len(groups)
    # Batches repeat one shape many times (max_batch_size decodes): evaluate each shape once.
    for desc, count in Counter(batch).items():
        for g, group in enumerate(groups):
            needs[g] += count * blocks_needed(
                desc, tokens_per_block, group.window, group.sink_tokens
            )
    return tuple(needs)


def default_typical_step(
    *, max_batch_size: int, max_num_tokens: int, max_seq_len: int
) -> tuple[KVCacheDesc, ...]:
    """One prefill chunk of ``min(max_num_tokens, max_seq_len)`` fresh tokens plus
    ``max_batch_size − 1`` decodes at half the maximum sequence length."""
    chunk = min(max_num_tokens, max_seq_len)
    avg = max(1, max_seq_len // 2)
    return (KVCacheDesc(chunk, 0),) + (KVCacheDesc(avg, avg - 1),) * (max_batch_size - 1)


# --------------------------------------------------------------------------- splitting


def split_budget(
    budget_bytes: int,
    bytes_per_block: Sequence[int],
    weights: Sequence[int],
    floors: Sequence[int],
) -> tuple[int, ...]:
    """Slots per group: floors first, the rest in proportion to ``weights`` (water-filling).

    Find the largest ``k`` such that ``slots_g = max(floor_g, k · weight_g)`` fits the budget;
    a group whose ``k · weight_g`` is below its floor takes the floor and is *clamped*. Each
    unclamped group gets ``⌊k · weight_g⌋`` slots, then one more, by largest remainder, while the
    bytes left allow it — so ``|slots_g − k · weight_g| < 1`` for every unclamped group. Groups
    of weight 0 get their floor. Raises :class:`CapacityError` when the floors do not fit.
    """
    n = len(bytes_per_block)
    if not len(weights) == len(floors) == n:
        raise InvalidArgumentError(
            f"bytes_per_block, weights and floors differ in length: {n}, {len(weights)}, "
            f"{len(floors)}"
        )
    if budget_bytes < 0:
        raise InvalidArgumentError(f"budget must be >= 0 bytes, got {budget_bytes}")
    for name, values, low in (
        ("bytes_per_block", bytes_per_block, 1),
        ("weights", weights, 0),
        ("floors", floors, 0),
    ):
        if any(v < low for v in values):
            raise InvalidArgumentError(f"{name} must all be >= {low}, got {list(values)}")
    min_budget = sum(f * b for f, b in zip(floors, bytes_per_block, strict=True))
    if min_budget > budget_bytes:
        deficit = _deficit(budget_bytes, floors, min_budget)
        raise CapacityError(
            f"a budget of {format_size(budget_bytes)} cannot hold the minimum pools "
            f"({format_size(min_budget)}); missing slots per group: {deficit}",
            deficit=deficit,
            min_budget_bytes=min_budget,
        )
    clamped = [w == 0 for w in weights]
    k = Fraction(0)
    while not all(clamped):
        fixed = sum(floors[g] * bytes_per_block[g] for g in range(n) if clamped[g])
        denom = sum(weights[g] * bytes_per_block[g] for g in range(n) if not clamped[g])
        k = Fraction(budget_bytes - fixed, denom)
        newly = [g for g in range(n) if not clamped[g] and k * weights[g] < floors[g]]
        if not newly:
            break
        for g in newly:
            clamped[g] = True
    slots = [floors[g] if clamped[g] else math.floor(k * weights[g]) for g in range(n)]
    left = budget_bytes - sum(s * b for s, b in zip(slots, bytes_per_block, strict=True))
    by_remainder = sorted(
        (g for g in range(n) if not clamped[g] and k * weights[g] > slots[g]),
        key=lambda g: (-(k * weights[g] - slots[g]), g),
    )
    for g in by_remainder:
        if bytes_per_block[g] <= left:
            slots[g] += 1
            left -= bytes_per_block[g]
    return tuple(slots)


def _deficit(budget_bytes: int, floors: Sequence[int], min_budget: int) -> dict[int, int]:
    """Missing slots per group if ``budget_bytes`` were shared in proportion to the floors."""
    out: dict[int, int] = {}
    for g, floor in enumerate(floors):
        short = floor - (floor * budget_bytes) // min_budget
        if short > 0:
            out[g] = short
    return out


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class BatchConstraint:
    """A named batch that must always fit on the GPU, and its need per layer group."""

    name: str
    description: str
    batch: tuple[KVCacheDesc, ...]
    needs: tuple[int, ...]

    def batch_runs(self) -> list[dict[str, int]]:
        """The batch as runs of equal sequences: ``[{capacity, history_length, count}, ...]``."""
        runs: list[dict[str, int]] = []
        for desc in self.batch:
            last = runs[-1] if runs else None
            if last and (last["capacity"], last["history_length"]) == (
                desc.capacity,
                desc.history_length,
            ):
                last["count"] += 1
            else:
                runs.append(
                    {"capacity": desc.capacity, "history_length": desc.history_length, "count": 1}
                )
        return runs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "description": self.description,
            "batch": self.batch_runs(),
            "needs": list(self.needs),
        }


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The pools of one layer group.

    ``min_slots`` is the GPU floor and ``floor_reason`` the name of the constraint that set it
    (the first one, in plan order, whose need equals the floor); ``floor_text`` says it in words.
    ``typical_need`` is the group's need in the typical step (the weight of the byte split).
    ``slots_per_tier`` is (GPU, host, disk).
    """

    index: int
    window: int | None
    sink_tokens: int
    layers: tuple[int, ...]
    bytes_per_block: int
    min_slots: int
    floor_reason: str
    floor_text: str
    typical_need: int
    slots_per_tier: tuple[int, int, int]

    @property
    def label(self) -> str:
        """``full`` or ``window W`` (``+ S sink``)."""
        return _label(self.window, self.sink_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "group": self.index,
            "window": self.window,
            "sink_tokens": self.sink_tokens,
            "layers": list(self.layers),
            "bytes_per_block": self.bytes_per_block,
            "min_slots": self.min_slots,
            "floor_reason": self.floor_reason,
            "floor_text": self.floor_text,
            "typical_need": self.typical_need,
            "slots": dict(zip(TIER_NAMES, self.slots_per_tier, strict=True)),
            "bytes": {
                t: s * self.bytes_per_block
                for t, s in zip(TIER_NAMES, self.slots_per_tier, strict=True)
            },
        }


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Slots per tier and layer group for one model, budget and set of limits.

    Invariants: every group has ``slots_per_tier[0] >= min_slots >= max_batch_size``, and per
    tier Σ slots × bytes_per_block ≤ ``budget_bytes[tier]``.
    """

    model: str
    tokens_per_block: int
    budget_bytes: tuple[int, int, int]
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    groups: tuple[GroupPlan, ...]
    constraints: tuple[BatchConstraint, ...]
    typical_step: BatchConstraint
    _: KW_ONLY
    notes: tuple[str, ...] = field(default=())

    def blocks(self, tier: int) -> dict[int, int]:
        """Layer group → slots in ``tier`` (0 GPU, 1 host, 2 disk)."""
        return {g.index: g.slots_per_tier[tier] for g in self.groups}

    @property
    def gpu_blocks(self) -> dict[int, int]:
        """Layer group → GPU slots."""
        return self.blocks(0)

    @property
    def host_blocks(self) -> dict[int, int]:
        """Layer group → host slots."""
        return self.blocks(1)

    @property
    def disk_blocks(self) -> dict[int, int]:
        """Layer group → disk slots."""
        return self.blocks(2)

    def used_bytes(self, tier: int) -> int:
        """Bytes the pools of ``tier`` take (≤ its budget)."""
        return sum(g.slots_per_tier[tier] * g.bytes_per_block for g in self.groups)

    def cache_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`kvpool.config.CacheConfig` for these pools.

        Slot counts are mappings layer group → slots; ``window_sizes`` and ``sink_tokens`` are
        lists with one entry per group (``None`` / 0 for full attention).
        """
        return {
            "tokens_per_block": self.tokens_per_block,
            "gpu_blocks": self.gpu_blocks,
            "host_blocks": self.host_blocks,
            "disk_blocks": self.disk_blocks,
            "window_sizes": [g.window for g in self.groups],
            "sink_tokens": [g.sink_tokens for g in self.groups],
            "max_seq_len": self.max_seq_len,
        }

    def explain(self) -> str:
        """The reasoning in words: each group's floor and what set it, then the split."""
        lines = [
            f"{self.model}: {len(self.groups)} layer group(s), {self.tokens_per_block} tokens "
            "per block"
        ]
        for g in self.groups:
            lines.append(
                f"  group {g.index} ({g.label}, {len(g.layers)} layers, "
                f"{format_size(g.bytes_per_block)}/block): floor {g.min_slots} slots, set by "
                f"{g.floor_reason} ({g.floor_text}); GPU {g.slots_per_tier[0]}, "
                f"host {g.slots_per_tier[1]}, disk {g.slots_per_tier[2]} slots"
            )
        lines.append(
            f"  bytes above the floors split by the typical step ({self.typical_step.description})"
            f", needs per group {list(self.typical_step.needs)}"
        )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tier names as keys, groups in order)."""
        return {
            "model": self.model,
            "tokens_per_block": self.tokens_per_block,
            "budget_bytes": dict(zip(TIER_NAMES, self.budget_bytes, strict=True)),
            "used_bytes": {t: self.used_bytes(i) for i, t in enumerate(TIER_NAMES)},
            "limits": {
                "max_batch_size": self.max_batch_size,
                "max_num_tokens": self.max_num_tokens,
                "max_seq_len": self.max_seq_len,
            },
            "groups": [g.to_dict() for g in self.groups],
            "constraints": [c.to_dict() for c in self.constraints],
            "typical_step": self.typical_step.to_dict(),
            "notes": list(self.notes),
        }


def plan_pools(
    model: ModelSpec,
    tokens_per_block: int,
    gpu_bytes: int,
    host_bytes: int = 0,
    disk_bytes: int = 0,
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    constraints: Sequence[Sequence[KVCacheDesc]] = (),
    typical_step: Sequence[KVCacheDesc] | None = None,
) -> PoolPlan:
    """Size every (tier, layer group) pool of ``model`` (see the module docstring for the rules).

    ``constraints`` are extra batches that must always fit on the GPU (named ``constraint[i]``);
    ``typical_step`` (default :func:`default_typical_step`) must be non-empty with every
    capacity ≥ 1, so that every group has a positive weight. Raises
    :class:`InvalidArgumentError` on a bad argument and :class:`CapacityError` (deficit per
    group, ``min_budget_bytes`` = Σ floors × bytes per block) when ``gpu_bytes`` is too small.
    """
    for name, value, low in (
        ("tokens_per_block", tokens_per_block, 1),
        ("gpu_bytes", gpu_bytes, 0),
        ("host_bytes", host_bytes, 0),
        ("disk_bytes", disk_bytes, 0),
        ("max_batch_size", max_batch_size, 1),
        ("max_num_tokens", max_num_tokens, 1),
        ("max_seq_len", max_seq_len, 1),
    ):
        if not _is_int(value) or value < low:
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    if max_batch_size > MAX_BATCH_SIZE:
        raise InvalidArgumentError(
            f"max_batch_size must be <= {MAX_BATCH_SIZE:,}, got {max_batch_size:,}"
        )
    if not isinstance(model, ModelSpec):
        raise InvalidArgumentError(f"model must be a ModelSpec, got {model!r:.80}")
    tpb = tokens_per_block
    groups = model.layer_groups()
    bpb = [g.bytes_per_block(tpb) for g in groups]
    chunk = min(max_num_tokens, max_seq_len)

    def named(name: str, description: str, batch: Iterable[KVCacheDesc]) -> BatchConstraint:
        items = _as_tuple(name, batch)
        for desc in items:
            if not isinstance(desc, KVCacheDesc):
                raise InvalidArgumentError(f"{name}: expected KVCacheDesc items, got {desc!r}")
        return BatchConstraint(name, description, items, batch_need(items, groups, tpb))

    all_constraints = [
        named(
            "concurrent_decode",
            f"{max_batch_size} concurrent decodes, each one block (capacity {tpb}, "
            f"history {tpb - 1})",
            (KVCacheDesc(tpb, tpb - 1),) * max_batch_size,
        ),
        named(
            "longest_sequence",
            f"one sequence at max_seq_len {max_seq_len} computing its last chunk of {chunk} tokens",
            (KVCacheDesc(max_seq_len, max_seq_len - chunk),),
        ),
        named(
            "largest_chunk",
            f"one fresh sequence prefilling a chunk of {chunk} tokens",
            (KVCacheDesc(chunk, 0),),
        ),
    ]
    for i, batch in enumerate(_as_tuple(f"constraints[{i}]", b)
                              for i, b in enumerate(_as_tuple("constraints", constraints))):
        all_constraints.append(
            named(f"constraint[{i}]", f"caller constraint {i} ({len(batch)} sequences)", batch)
        )
    if typical_step is None:
        typical = named(
            "typical_step",
            f"one prefill chunk of {chunk} tokens + {max_batch_size - 1} decodes at "
            f"{max(1, max_seq_len // 2)} tokens",
            default_typical_step(
                max_batch_size=max_batch_size,
                max_num_tokens=max_num_tokens,
                max_seq_len=max_seq_len,
            ),
        )
    else:
        steps = _as_tuple("typical_step", typical_step)
        typical = named("typical_step", f"caller typical step ({len(steps)} sequences)", steps)
        if not typical.batch or any(d.capacity < 1 for d in typical.batch):
            raise InvalidArgumentError(
                "typical_step must hold at least one sequence and every capacity must be >= 1"
            )

    floors: list[int] = []
    reasons: list[BatchConstraint] = []
    for g in range(len(groups)):
        best = max(all_constraints, key=lambda c: c.needs[g])  # first of equal needs wins
        floors.append(best.needs[g])
        reasons.append(best)

    min_budget = sum(f * b for f, b in zip(floors, bpb, strict=True))
    if min_budget > gpu_bytes:
        raise _gpu_capacity_error(model, groups, bpb, floors, reasons, gpu_bytes, min_budget)
    budgets = (gpu_bytes, host_bytes, disk_bytes)
    zero = [0] * len(groups)
    per_tier = [
        split_budget(gpu_bytes, bpb, typical.needs, floors),
        split_budget(host_bytes, bpb, typical.needs, zero),
        split_budget(disk_bytes, bpb, typical.needs, zero),
    ]
    notes: list[str] = []
    if host_bytes > 0 and any(s == 0 for s in per_tier[1]):
        notes.append("the host budget is too small to give every group a slot")
    if disk_bytes > 0 and any(s == 0 for s in per_tier[2]):
        notes.append("the disk budget is too small to give every group a slot")
    plans = tuple(
        GroupPlan(
            index=group.index,
            window=group.window,
            sink_tokens=group.sink_tokens,
            layers=group.layers,
            bytes_per_block=bpb[g],
            min_slots=floors[g],
            floor_reason=reasons[g].name,
            floor_text=reasons[g].description,
            typical_need=typical.needs[g],
            slots_per_tier=(per_tier[0][g], per_tier[1][g], per_tier[2][g]),
        )
        for g, group in enumerate(groups)
    )
    return PoolPlan(
        model=model.name,
        tokens_per_block=tpb,
        budget_bytes=budgets,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        groups=plans,
        constraints=tuple(all_constraints),
        typical_step=typical,
        notes=tuple(notes),
    )


def _gpu_capacity_error(
    model: ModelSpec,
    groups: Sequence[LayerGroupSpec],
    bpb: Sequence[int],
    floors: Sequence[int],
    reasons: Sequence[BatchConstraint],
    gpu_bytes: int,
    min_budget: int,
) -> CapacityError:
    deficit = _deficit(gpu_bytes, floors, min_budget)
    parts = [
        f"group {g.index} ({g.label}) needs {floors[i]} slots × {format_size(bpb[i])} "
        f"for {reasons[i].name}" + (f", short by {deficit[i]} slots" if i in deficit else "")
        for i, g in enumerate(groups)
    ]
    return CapacityError(
        f"GPU budget {format_size(gpu_bytes)} is too small for {model.name}: "
        + "; ".join(parts)
        + f". The smallest GPU budget that works is {format_size(min_budget)} "
        f"({min_budget} bytes).",
        deficit=deficit,
        min_budget_bytes=min_budget,
    )


# --------------------------------------------------------------------------- sizes

_UNITS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
)
_SIZE_RE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a plain int (bytes) or a number with a unit — B, KB/MB/GB/TB (powers
    of 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive. Fractions round down."""
    match = _SIZE_RE.fullmatch(text)
    scale = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or scale is None:
        raise InvalidArgumentError(
            f"bad size {text!r}: expected e.g. 40GiB, 40GB, 512MiB or a plain number of bytes"
        )
    return math.floor(Fraction(match.group(1)) * scale)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number ≥ 1 (``1.50 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
