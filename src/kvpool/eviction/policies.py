"""The scan-resistant policies (2Q, S3-FIFO, ARC), the registry and the factories."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.errors import InvalidArgumentError
from kvpool.eviction.history import KeyHistory
from kvpool.eviction.lru import PrioritizedLRU
from kvpool.eviction.protocol import EvictionPolicy
from kvpool.eviction.queue import LevelQueue
from kvpool.eviction.segmented import SegmentedPolicy


class TwoQueue(SegmentedPolicy):
    """2Q: a FIFO for blocks released once (a quarter of the level), the rest LRU.

    First-time blocks wait in the recent FIFO; while it holds more than 25% of the level it
    gives the victims, so one-off traffic cycles through it without flushing the blocks that
    were reused. A block released again (after a hit, or recomputed while the history held
    its key: 2Q's A1out) joins the frequent LRU.
    """

    __slots__ = ()
    RECENT_SHARE = 0.25


class S3FIFO(SegmentedPolicy):
    """S3-FIFO: a small FIFO (10% of the level) for new blocks and a main FIFO with laps.

    New blocks enter the small FIFO and mostly leave it quickly (one-hit wonders); reused
    blocks enter the main FIFO with ``min(count - 2, 3)`` credits: at the head of the queue a
    block with credits goes back to the tail (lazy promotion) and loses one, so blocks reused
    often outlive blocks reused once. A parent's count is at least its child's, so it never
    gets fewer laps than a child released with it.
    """

    __slots__ = ()
    RECENT_SHARE = 0.10
    MAX_LAPS = 3


class ARC(SegmentedPolicy):
    """ARC: the recent/frequent split adapts to ghost hits.

    ``target`` (in [0, 1], start 0) is the share of a level the recent segment keeps. A
    block recomputed into the GPU pool whose ghost is at most ``capacity`` evictions old (a
    bigger pool would have kept it: ARC's B1 and B2 hold at most one cache of ghosts) moves
    it: evicted with count 1, the recent segment was too small, the target grows by
    ``max(1, B2/B1) / capacity``; evicted with a higher count, it shrinks by
    ``max(1, B1/B2) / capacity`` (B1, B2: ghosts of each kind in the history). The tiers of a
    layer group share the target. On traffic whose blocks come back once, soon, the target
    grows until ARC hits about as often as LRU, where the fixed splits of 2Q and S3-FIFO
    evict the blocks before their second use.
    """

    __slots__ = ()
    RECENT_SHARE = 0.0
    COUNT_GHOSTS = True

    @property
    def target(self) -> float:
        """The recent segment's current share of a level."""
        return self._history.share

    def _ghosts_back(self, found: Sequence[int]) -> None:
        # each ghost found moves the target, in order (the ghost counts B1, B2 change on the way)
        history = self._history
        ghosts = history.ghosts
        size = self._capacity if self._tier0 else 0
        share = history.share
        for v in found:
            if v <= 0:
                continue
            count = v & 255
            ghosts[count > 1] -= 1
            if not size or history.seq - (v >> 8) > size:  # older than the pool: no move
                continue
            b1, b2 = ghosts
            b1 = b1 if b1 > 1 else 1
            b2 = b2 if b2 > 1 else 1
            # max(1.0, b2 / b1) and the clamps to [0, 1], written out (builtin max is slow)
            if count == 1:
                r = b2 / b1
                share += (r if r > 1.0 else 1.0) / size
                share = share if share < 1.0 else 1.0
            else:
                r = b1 / b2
                share -= (r if r > 1.0 else 1.0) / size
                share = share if share > 0.0 else 0.0
        history.share = share


EVICTION_POLICIES: tuple[str, ...] = ("lru", "2q", "s3fifo", "arc")
"""``CacheConfig.eviction.policy`` values (:data:`POLICIES` maps each to its class)."""

POLICIES: dict[str, type[PrioritizedLRU] | type[SegmentedPolicy]] = dict(
    zip(EVICTION_POLICIES, (PrioritizedLRU, TwoQueue, S3FIFO, ARC), strict=True)
)
"""Eviction policies by ``CacheConfig.eviction.policy`` name (:data:`EVICTION_POLICIES`)."""


def _factory(name: str) -> type[PrioritizedLRU] | type[SegmentedPolicy]:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None


def make_policy(name: str, clock: Callable[[], float], *, capacity: int | None = None,
                offload_gate: str = "all") -> LevelQueue:
    """Build the policy registered under ``name`` for one pool of ``capacity`` slots.

    ``capacity`` sizes the history of the policies that keep one (None: learnt from the slots
    pushed). ``offload_gate`` is ``"all"`` or ``"reused"`` (only victims released more than
    once may go down a tier; LRU keeps no history and ignores it).
    """
    return _factory(name)(clock, capacity=capacity, offload_gate=offload_gate)


def make_policies(name: str, slots: Sequence[Sequence[int]], clock: Callable[[], float], *,
                  offload_gate: str = "all", history_multiple: float = 4.0,
                  ) -> list[list[EvictionPolicy]]:
    """A manager's free queues, ``[tier][layer group]``, one per pool of ``slots[tier][group]``.

    The policy is ``name`` with ``offload_gate``. The tiers of one layer group share one
    :class:`KeyHistory`, bounded to ``history_multiple x`` the group's slots on all tiers, so
    counts follow blocks between tiers.
    """
    factory = _factory(name)
    gate = offload_gate
    if not issubclass(factory, SegmentedPolicy):
        return [[factory(clock, capacity=n, offload_gate=gate) for n in tier] for tier in slots]
    multiple = history_multiple
    histories = [
        KeyHistory(int(multiple * sum(tier[g] for tier in slots)), factory.RECENT_SHARE,
                   count_ghosts=factory.COUNT_GHOSTS)
        for g in range(len(slots[0]))
    ]
    return [
        [factory(clock, capacity=n, offload_gate=gate, ghost_multiple=multiple, tier=t,
                 history=histories[g])
         for g, n in enumerate(tier)]
        for t, tier in enumerate(slots)
    ]
