"""What a step needs of the GPU pools: sequences (:class:`KVCacheDesc`), the blocks each one
needs in a layer group (:func:`blocks_needed`), whole batches, and the named batches that must
always fit (:class:`BatchConstraint`: the planner's floors and its typical step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidArgumentError
from kvpool.planner.model_spec import LayerGroupSpec, as_tuple
from kvpool.validation import is_int

__all__ = [
    "BatchConstraint",
    "KVCacheDesc",
    "batch_need",
    "blocks_needed",
    "default_typical_step",
    "gpu_constraints",
    "named_constraint",
    "typical_constraint",
]

@dataclass(frozen=True, slots=True)
class KVCacheDesc:
    """One sequence in a batch: ``capacity`` tokens, of which the first ``history_length`` were
    computed in earlier steps (the rest are computed in this step)."""

    capacity: int
    history_length: int

    def __post_init__(self) -> None:
        if not is_int(self.capacity) or self.capacity < 0:
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {self.capacity!r}")
        if not is_int(self.history_length) or not 0 <= self.history_length <= self.capacity:
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
    if not is_int(tokens_per_block) or tokens_per_block < 1:
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


def named_constraint(
    name: str,
    description: str,
    batch: Iterable[KVCacheDesc],
    groups: Sequence[LayerGroupSpec],
    tokens_per_block: int,
) -> BatchConstraint:
    """``batch`` (checked to hold :class:`KVCacheDesc` items) with its need per group."""
    items = as_tuple(name, batch)
    for desc in items:
        if not isinstance(desc, KVCacheDesc):
            raise InvalidArgumentError(f"{name}: expected KVCacheDesc items, got {desc!r}")
    return BatchConstraint(name, description, items, batch_need(items, groups, tokens_per_block))


def gpu_constraints(
    groups: Sequence[LayerGroupSpec],
    tokens_per_block: int,
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    extra: Sequence[Sequence[KVCacheDesc]],
) -> list[BatchConstraint]:
    """The batches that must always fit on the GPU: the three built-in ones
    (``concurrent_decode``, ``longest_sequence``, ``largest_chunk``, see :mod:`~.capacity`),
    then the caller's ``extra`` ones, named ``constraint[i]``."""
    tpb = tokens_per_block
    chunk = min(max_num_tokens, max_seq_len)
    out = [
        named_constraint(
            "concurrent_decode",
            f"{max_batch_size} concurrent decodes, each one block (capacity {tpb}, "
            f"history {tpb - 1})",
            (KVCacheDesc(tpb, tpb - 1),) * max_batch_size,
            groups, tpb,
        ),
        named_constraint(
            "longest_sequence",
            f"one sequence at max_seq_len {max_seq_len} computing its last chunk of {chunk} tokens",
            (KVCacheDesc(max_seq_len, max_seq_len - chunk),),
            groups, tpb,
        ),
        named_constraint(
            "largest_chunk",
            f"one fresh sequence prefilling a chunk of {chunk} tokens",
            (KVCacheDesc(chunk, 0),),
            groups, tpb,
        ),
    ]
    for i, batch in enumerate(as_tuple(f"constraints[{i}]", b)
                              for i, b in enumerate(as_tuple("constraints", extra))):
        out.append(named_constraint(
            f"constraint[{i}]", f"caller constraint {i} ({len(batch)} sequences)", batch,
            groups, tpb,
        ))
    return out


def typical_constraint(
    groups: Sequence[LayerGroupSpec],
    tokens_per_block: int,
    typical_step: Sequence[KVCacheDesc] | None,
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
) -> BatchConstraint:
    """The typical step (the caller's, else :func:`default_typical_step`) with its needs: the
    weights of the planner's byte split. A caller's must hold at least one sequence, each of
    capacity >= 1, so that every group has a positive weight."""
    if typical_step is None:
        chunk = min(max_num_tokens, max_seq_len)
        return named_constraint(
            "typical_step",
            f"one prefill chunk of {chunk} tokens + {max_batch_size - 1} decodes at "
            f"{max(1, max_seq_len // 2)} tokens",
            default_typical_step(
                max_batch_size=max_batch_size,
                max_num_tokens=max_num_tokens,
                max_seq_len=max_seq_len,
            ),
            groups, tokens_per_block,
        )
    steps = as_tuple("typical_step", typical_step)
    typical = named_constraint(
        "typical_step", f"caller typical step ({len(steps)} sequences)", steps,
        groups, tokens_per_block,
    )
    if not typical.batch or any(d.capacity < 1 for d in typical.batch):
        raise InvalidArgumentError(
            "typical_step must hold at least one sequence and every capacity must be >= 1"
        )
    return typical
