"""One class per layer-group kind: which blocks of a sequence the group needs and can release.

- :class:`FullAttention`: every block, for as long as the sequence lives;
- :class:`SlidingWindow`: the blocks intersecting the last W + 1 positions (W = window in
  tokens), plus its sink blocks; the others are stale and released as the sequence grows;
- :class:`CrossAttention`: the encoder's blocks, allocated at admission, never matched in the
  tree nor grown;
- :class:`~kvpool.core.state_groups.StateGroup`: a recurrent state, one running slot per
  sequence, checkpoints in the tree.

``group_kinds(config)`` gives each layer group its kind. Admission asks them which matched
blocks a group claims and whether a matched prefix is usable; the manager asks them which
blocks went stale.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.config import CacheConfig
from kvpool.core.radix import NO_SLOT
from kvpool.core.state_groups import StateGroup


class FullAttention:
    """A full-attention layer group."""

    __slots__ = ("tpb",)
    cross = False
    windowed = False
    state = False  # a recurrent-state group (kvpool.core.state_groups)

    def __init__(self, tpb: int) -> None:
        self.tpb = tpb

    def required(self, i: int, length: int) -> bool:
        """Is block i needed at sequence length ``length``?"""
        return True

    def stale_limit(self, length: int) -> int:
        """Blocks [first_kept, limit) are stale at ``length`` tokens (none here)."""
        return 0

    first_kept = 0

    def claimed(self, d: int, length: int) -> Sequence[int]:
        """Indices of the first ``d`` matched blocks the group claims for ``length`` tokens."""
        return range(d)

    def reusable(self, slots: Sequence[int], length: int) -> bool:
        """Can the group reuse ``length`` tokens whose blocks hold ``slots``?"""
        return NO_SLOT not in slots


class SlidingWindow(FullAttention):
    """A sliding-window layer group of ``window`` tokens with ``sink_blocks`` sink blocks."""

    __slots__ = ("first_kept", "window")
    windowed = True

    def __init__(self, tpb: int, window: int, sink_blocks: int) -> None:
        super().__init__(tpb)
        self.window = window
        self.first_kept = sink_blocks  # sink blocks are never stale

    def required(self, i: int, length: int) -> bool:
        # the window needs the blocks intersecting [length - W - 1, length) and its sinks
        return i < self.first_kept or (i + 1) * self.tpb > length - self.window - 1

    def stale_limit(self, length: int) -> int:
        return max(0, (length - self.window - 1) // self.tpb)

    def claimed(self, d: int, length: int) -> Sequence[int]:
        return [i for i in range(d) if self.required(i, length)]

    def reusable(self, slots: Sequence[int], length: int) -> bool:
        return all(s != NO_SLOT for i, s in enumerate(slots) if self.required(i, length))


class CrossAttention(FullAttention):
    """A cross-attention layer group: the encoder's blocks."""

    __slots__ = ()
    cross = True

    def blocks(self, encoder_tokens: int) -> int:
        """Blocks an encoder output of ``encoder_tokens`` tokens takes (per beam table)."""
        return -(-encoder_tokens // self.tpb)


GroupKind = FullAttention | SlidingWindow | CrossAttention | StateGroup


def group_kinds(config: CacheConfig) -> tuple[GroupKind, ...]:
    """The kind of each layer group of ``config``, in group order."""
    tpb = config.tokens_per_block
    out: list[GroupKind] = []
    for g in range(config.num_groups):
        w = config.window_sizes[g]
        if g in config.cross_attention_groups:
            out.append(CrossAttention(tpb))
        elif g in config.state_groups:
            out.append(StateGroup(tpb))
        elif w is None:
            out.append(FullAttention(tpb))
        else:
            out.append(SlidingWindow(tpb, w, -(-config.sinks[g] // tpb)))
    return tuple(out)
