"""Layout: what a manager's configuration implies about its pools, computed once and frozen.

The geometry every core module reads (tokens per block, the bytes of a block's tokens in the
tree, tiers, layer groups and their kinds) is derived from :class:`~kvpool.config.CacheConfig`
here, once per manager; :class:`~kvpool.core.state.CacheState` and
:class:`~kvpool.core.views.PlanView` hold the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.config import CacheConfig
from kvpool.core.groups import GroupKind, group_kinds

TOKEN_BYTES = 4
"""A token id as the prefix tree stores it: one little-endian u32."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The derived layout of one manager (see the module docstring)."""

    tpb: int
    """Tokens per block."""
    step: int
    """Bytes of a full block of tokens in the tree (``TOKEN_BYTES * tpb``)."""
    tiers: int
    one_tier: bool
    """Is the GPU the only tier (every claim is on it)?"""
    num_groups: int
    groups: range
    """Every layer group."""
    self_groups: tuple[int, ...]
    """The self-attention layer groups (all but the cross-attention ones): those the tree
    matches."""
    kinds: tuple[GroupKind, ...]
    """Each layer group's kind (:mod:`kvpool.core.groups`)."""
    full_attention_only: bool
    """No sliding window: a sequence's self-attention tables all have the same length, and
    decode growth within its last block changes nothing but its tokens."""

    @classmethod
    def of(cls, config: CacheConfig) -> Layout:
        tpb = config.tokens_per_block
        self_groups = tuple(
            g for g in range(config.num_groups) if g not in config.cross_attention_groups
            and g not in config.state_groups)  # recurrent state: kvpool.core.state_groups
        return cls(
            tpb=tpb, step=TOKEN_BYTES * tpb, tiers=config.num_tiers,
            one_tier=config.num_tiers == 1, num_groups=config.num_groups,
            groups=range(config.num_groups), self_groups=self_groups,
            kinds=group_kinds(config),
            full_attention_only=all(config.window_sizes[g] is None for g in self_groups),
        )
