"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds).

``SamplingParams`` is validated at construction (``InvalidArgumentError`` naming the field).
``sample`` picks one token per row of a step's logits with one batched softmax; a request
with a seed draws from its own ``torch.Generator``, so its tokens do not depend on which other
requests share its steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import InvalidArgumentError
from kvpool.validation import check_bool, is_int, is_number


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    ``temperature == 0`` is greedy (top-p/top-k ignored); ``top_k == 0`` and ``top_p == 1``
    switch those filters off. ``stop`` strings need the engine's tokenizer; the text ends
    before the stop string. ``stop_token_ids`` end generation like EOS (the token is kept
    in ``token_ids``). ``return_logits`` gives every generated position's logits (fp32).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    return_logits: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise InvalidArgumentError(
                f"temperature must be a number in [0, 100], got {self.temperature!r}"
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(
                f"top_k must be an int >= 0 (0 = no top-k), got {self.top_k!r}"
            )
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidArgumentError(
                f"seed must be None or an int in [0, 2**63), got {self.seed!r}"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(
            is_int(t) and 0 <= t < 2**31 for t in ids
        ):
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids (ints in [0, 2**31)), got {ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "return_logits"):
            check_bool(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]`` (fp32), row i by ``params[i]``."""
    greedy_ids = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return [int(t) for t in greedy_ids.tolist()]
    out: list[int] = [int(t) for t in greedy_ids.tolist()]
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_row, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_row, dim=-1).cumsum(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = cum - torch.softmax(sorted_row, dim=-1) >= p.top_p
            row = row.scatter(0, order, sorted_row.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
