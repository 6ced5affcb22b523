"""The planner's result: :class:`PoolPlan` (slots per tier and layer group, the constraints
behind them) and its :class:`GroupPlan` per layer group, with their words and JSON forms.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Final

from kvpool.planner.constraints import BatchConstraint
from kvpool.planner.model_spec import group_label
from kvpool.planner.sizes import format_size

__all__ = ["TIER_NAMES", "GroupPlan", "PoolPlan"]

TIER_NAMES: Final[tuple[str, str, str]] = ("gpu", "host", "disk")
"""Tier index → name (0 = GPU, 1 = host, 2 = disk), as in ARCHITECTURE §1."""


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
        return group_label(self.window, self.sink_tokens)

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
