"""``FlopAware``: Marconi's eviction score for recurrent-state checkpoints (arXiv 2411.19379).

A hybrid model's checkpoint (:mod:`kvpool.core.checkpoints`) is one fixed-size state slot, but
the compute a hit on it saves grows with the prefix it ends: recomputing ``L`` tokens costs
their linear work (projections, MLP, recurrent scan: ``~L``) plus attention's quadratic part
(``~L^2``). Marconi (section 4.2) evicts the cache entry with the lowest utility

    S = recency + alpha * flop_efficiency

where ``flop_efficiency`` is the FLOPs a hit saves per byte the entry holds and both terms are
min-max normalised over the eviction candidates. Every checkpoint of a state group holds the
same bytes, so here ``flop_efficiency`` is :func:`prefix_flops` of the checkpoint's depth
(``L + L^2 / crossover``, ``crossover`` the prefix length at which attention's quadratic FLOPs
equal the linear ones: about 61,000 tokens for Qwen3-Next-80B-A3B, 2 x 3 B active parameters
per token against 12 attention layers x 16 heads x 256 dims x 4 per token pair; see
:data:`CROSSOVER_TOKENS`). ``recency`` is the order of the last release (a logical clock:
each push is one tick). ``alpha = 0`` is LRU; a larger ``alpha`` keeps deep checkpoints longer
than recently used shallow ones.

Rules kept (the :class:`~kvpool.eviction.protocol.EvictionPolicy` contract): a victim comes from
the lowest non-empty retention priority level and the score orders slots only within it; a
priority pushed with an expiry falls back to the default once that time has passed (pushed
again at the most recent end); a claimed slot (``remove``) is never a victim; ``pop`` of an
empty queue raises :class:`IndexError`, ``push`` of a queued slot
:class:`~kvpool.errors.InvalidArgumentError`, ``remove`` of a slot not queued :class:`KeyError`,
each before anything changes. Ties of the score go to the least recently pushed slot.

Cost: ``push`` / ``remove`` are O(1) array stores; ``pop`` is one numpy pass over the pool's
slots (a state pool holds hundreds to a few thousand checkpoints, each tens of MiB).
``depth_of`` (bound by the manager, :meth:`FlopAware.bind`) names the prefix length of the block
a slot holds; a slot it cannot place counts as depth 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvpool.errors import InvalidArgumentError
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey
from kvpool.validation import check_int, check_number

__all__ = ["CROSSOVER_TOKENS", "DEFAULT_ALPHA", "FlopAware", "prefix_flops"]

DEFAULT_ALPHA: Final = 2.0
"""``EvictionConfig.checkpoint_alpha`` by default: the best of 0.5 / 1 / 2 / 4 in
benchmarks/bench_hybrid.py's replays (docs/hybrid.md: short prompts 49.1 % with LRU, 61.8 /
77.7 / 77.8 / 77.8 %; conversation 1,000 requests 3.82 % with LRU, 3.82 / 3.95 / 3.95 /
3.95 %)."""

CROSSOVER_TOKENS: Final = 65_536
"""Prefix length at which attention's quadratic FLOPs equal the linear ones (module docstring:
about 61,000 for Qwen3-Next-80B-A3B; hybrid models with fewer attention layers per parameter
are higher, so this is the order of magnitude, not one model's figure)."""


def prefix_flops(tokens: npt.NDArray[np.float64] | float,
                 crossover: int = CROSSOVER_TOKENS) -> npt.NDArray[np.float64] | float:
    """Relative FLOPs of computing a prefix of ``tokens`` tokens: ``L + L^2 / crossover``."""
    return tokens + tokens * tokens / crossover


def _no_span(slot: int) -> tuple[int, int]:
    return 0, 0


class FlopAware:
    """Evict the queued checkpoint of lowest ``recency + alpha * flops`` (module docstring)."""

    __slots__ = (
        "_alpha",
        "_clock",
        "_crossover",
        "_expires",
        "_len",
        "_prio",
        "_queued",
        "_saves",
        "_span_of",
        "_tick",
        "_when",
    )

    uses_keys = False

    def __init__(self, clock: Callable[[], float], *, capacity: int | None = None,
                 alpha: float = DEFAULT_ALPHA, crossover: int = CROSSOVER_TOKENS,
                 span_of: Callable[[int], tuple[int, int]] = _no_span) -> None:
        self._alpha = check_number("alpha", alpha)
        check_int("crossover", crossover, 1)
        self._clock = clock
        self._crossover = crossover
        self._span_of = span_of
        n = capacity or 0
        self._queued = np.zeros(n, dtype=bool)
        self._prio = np.zeros(n, dtype=np.int64)
        self._when = np.zeros(n, dtype=np.float64)  # logical time of the last push
        self._saves = np.zeros(n, dtype=np.float64)  # FLOPs a hit saves beyond its parent
        self._expires: dict[int, float] = {}  # slot -> when its pushed priority lapses
        self._tick = 0
        self._len = 0

    def bind(self, span_of: Callable[[int], tuple[int, int]]) -> None:
        """``span_of(slot)``: the prefix length (tokens) the slot's checkpoint ends and that of
        the nearest checkpoint above it (0: none); read at each push."""
        self._span_of = span_of

    @property
    def alpha(self) -> float:
        return self._alpha

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: object) -> bool:
        return (isinstance(slot, int) and not isinstance(slot, bool)
                and 0 <= slot < len(self._queued) and bool(self._queued[slot]))

    # ---------------------------------------------------------------- pushes and claims

    def _grow(self, slot: int) -> None:
        n = max(slot + 1, 2 * len(self._queued))
        extra = n - len(self._queued)
        self._queued = np.concatenate([self._queued, np.zeros(extra, dtype=bool)])
        self._prio = np.concatenate([self._prio, np.zeros(extra, dtype=np.int64)])
        self._when = np.concatenate([self._when, np.zeros(extra)])
        self._saves = np.concatenate([self._saves, np.zeros(extra)])

    def push(self, slot: int, priority: int, expires_at: float | None = None,
             key: BlockKey | None = None) -> None:
        check_int("slot", slot, 0)
        if slot in self:
            raise InvalidArgumentError(f"slot {slot} is already queued")
        if slot >= len(self._queued):
            self._grow(slot)
        self._tick += 1
        self._queued[slot] = True
        self._prio[slot] = priority
        self._when[slot] = self._tick
        end, start = self._span_of(slot)
        self._saves[slot] = (prefix_flops(float(end), self._crossover)
                             - prefix_flops(float(start), self._crossover))
        self._len += 1
        if expires_at is not None and priority != DEFAULT_PRIORITY:
            self._expires[slot] = expires_at
        else:
            self._expires.pop(slot, None)

    def push_many(self, slots: Sequence[int], priority: int,
                  keys: Sequence[BlockKey] | None = None) -> None:
        for s in slots:
            self.push(s, priority)

    def remove(self, slot: int) -> None:
        if slot not in self:
            raise KeyError(slot)
        self._queued[slot] = False
        self._expires.pop(slot, None)
        self._len -= 1

    def remove_many(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.remove(s)

    # ---------------------------------------------------------------- victims

    def _expire(self) -> None:
        now = self._clock()
        for s in [s for s, t in self._expires.items() if t <= now]:
            del self._expires[s]
            self._tick += 1
            self._prio[s] = DEFAULT_PRIORITY
            self._when[s] = self._tick

    def scores(self, slots: npt.NDArray[np.intp]) -> npt.NDArray[np.float64]:
        """``recency + alpha * flops`` of ``slots`` (one priority level), each term min-max
        normalised over them."""
        return _normalised(self._when[slots]) + self._alpha * _normalised(self._saves[slots])

    def _victim(self, queued: npt.NDArray[np.bool_]) -> int:
        cand = np.flatnonzero(queued)
        prio = self._prio[cand]
        cand = cand[prio == prio.min()]
        score = self.scores(cand)
        best = np.flatnonzero(score == score.min())
        if len(best) > 1:  # ties: the least recently pushed
            return int(cand[best[np.argmin(self._when[cand[best]])]])
        return int(cand[best[0]])

    def pop(self) -> tuple[int, int]:
        if not self._len:
            raise IndexError("pop from an empty eviction queue")
        if self._expires:
            self._expire()
        slot = self._victim(self._queued)
        self._queued[slot] = False
        self._len -= 1
        return slot, int(self._prio[slot])

    def pop_many(self, n: int) -> list[tuple[int, int]]:
        if n > self._len:
            raise IndexError(f"pop of {n} from an eviction queue of {self._len}")
        return [self.pop() for _ in range(n)]

    def pop_slots(self, n: int) -> list[int]:
        return [s for s, _ in self.pop_many(n)]

    def should_offload(self, slot: int) -> bool:
        return True

    def priority_of(self, slot: int) -> int:
        """The queued slot's current priority (introspection)."""
        if slot not in self:
            raise KeyError(slot)
        return int(self._prio[slot])

    def peek_order(self) -> list[int]:
        """Every queued slot in the order successive ``pop`` calls would give them (expiry
        not applied); O(n^2) numpy work, for checks."""
        queued = self._queued.copy()
        out: list[int] = []
        for _ in range(self._len):
            s = self._victim(queued)
            queued[s] = False
            out.append(s)
        return out


def _normalised(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    lo = x.min()
    span = x.max() - lo
    return (x - lo) / span if span > 0 else np.zeros_like(x)
