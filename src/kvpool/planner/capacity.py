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

The pieces: :mod:`~kvpool.planner.model_spec` (layers, groups, presets), :mod:`~.constraints`
(sequences, block needs, the named batches), :mod:`kvpool.planner.pool_plan` (the result) and
:mod:`kvpool.planner.sizes`; this module sizes the pools and re-exports their public names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Final

from kvpool.errors import CapacityError, InvalidArgumentError
from kvpool.planner.constraints import (
    BatchConstraint,
    KVCacheDesc,
    batch_need,
    blocks_needed,
    default_typical_step,
    gpu_constraints,
    typical_constraint,
)
from kvpool.planner.model_spec import (
    DTYPE_BYTES,
    LayerGroupSpec,
    LayerSpec,
    ModelSpec,
    presets,
)
from kvpool.planner.pool_plan import TIER_NAMES, GroupPlan, PoolPlan
from kvpool.planner.sizes import format_size, parse_size
from kvpool.validation import is_int

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

MAX_BATCH_SIZE: Final = 1 << 20
"""The largest ``max_batch_size`` the planner takes (its constraints list every sequence)."""


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
    limits = {
        "max_batch_size": max_batch_size,
        "max_num_tokens": max_num_tokens,
        "max_seq_len": max_seq_len,
    }
    _check_limits(model, tokens_per_block=tokens_per_block, gpu_bytes=gpu_bytes,
                  host_bytes=host_bytes, disk_bytes=disk_bytes, **limits)
    tpb = tokens_per_block
    groups = model.layer_groups()
    bpb = [g.bytes_per_block(tpb) for g in groups]
    all_constraints = gpu_constraints(groups, tpb, extra=constraints, **limits)
    typical = typical_constraint(groups, tpb, typical_step, **limits)
    floors, reasons = _floors(len(groups), all_constraints)
    min_budget = sum(f * b for f, b in zip(floors, bpb, strict=True))
    if min_budget > gpu_bytes:
        raise _gpu_capacity_error(model, groups, bpb, floors, reasons, gpu_bytes, min_budget)
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
        budget_bytes=(gpu_bytes, host_bytes, disk_bytes),
        groups=plans,
        constraints=tuple(all_constraints),
        typical_step=typical,
        notes=tuple(notes),
        **limits,
    )


def _check_limits(model: object, **limits: object) -> None:
    """Every limit an int >= its least value (``tokens_per_block`` and ``max_*`` >= 1, the
    byte budgets >= 0), ``max_batch_size`` <= :data:`MAX_BATCH_SIZE`, ``model`` a
    :class:`ModelSpec`: checked in that order."""
    for name, value in limits.items():
        low = 0 if name.endswith("_bytes") else 1
        if not is_int(value) or value < low:
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    max_batch_size = limits["max_batch_size"]
    if is_int(max_batch_size) and max_batch_size > MAX_BATCH_SIZE:
        raise InvalidArgumentError(
            f"max_batch_size must be <= {MAX_BATCH_SIZE:,}, got {max_batch_size:,}"
        )
    if not isinstance(model, ModelSpec):
        raise InvalidArgumentError(f"model must be a ModelSpec, got {model!r:.80}")


def _floors(
    n_groups: int, constraints: Sequence[BatchConstraint]
) -> tuple[list[int], list[BatchConstraint]]:
    """Each group's GPU floor, the largest need of any constraint, and the constraint that set
    it (the first of equal needs)."""
    floors: list[int] = []
    reasons: list[BatchConstraint] = []
    for g in range(n_groups):
        best = max(constraints, key=lambda c: c.needs[g])  # first of equal needs wins
        floors.append(best.needs[g])
        reasons.append(best)
    return floors, reasons


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
