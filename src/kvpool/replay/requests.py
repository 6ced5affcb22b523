"""What a replay feeds its engines: :class:`Request` (one inference request, its tokens in
``array('I')``) and :class:`Workload` (requests in arrival order, with where they came from),
and the argument checks the workload sources share.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Final

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import MAX_TOKEN_ID, tokens_to_u32
from kvpool.validation import check_int, check_number

__all__ = ["DEFAULT_VOCAB_SIZE", "Request", "Workload"]

DEFAULT_VOCAB_SIZE: Final = 32_000
"""Synthesised token ids lie in [0, DEFAULT_VOCAB_SIZE) (a Llama-2-sized vocabulary)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request of a workload.

    Invariants (checked at construction, :class:`InvalidArgumentError` otherwise):
    ``request_id`` is a non-empty str; ``arrival_s`` is finite and >= 0 (seconds from the
    workload's time origin); ``tokens`` holds at least one token id in [0, 2**31) (a sequence
    of ints is converted to ``array('I')``); ``output_length`` >= 1 (prefill always yields the
    first output token). ``output_token_ids``, when set, has exactly ``output_length`` ids: the
    tokens the request's answer consists of, so that a simulator emitting them lets the next
    turn of the conversation (whose prompt contains them) reuse the generated blocks.

    ``hash_ids`` are the trace's prefix block ids (Mooncake), or None; ``session_id`` names the
    conversation a turn belongs to; ``cache_salt`` puts the request in its own reuse scope.
    """

    request_id: str
    arrival_s: float
    tokens: array[int]
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    output_token_ids: array[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        rid = self.request_id
        arrival = self.arrival_s
        object.__setattr__(self, "arrival_s", check_number(f"request {rid}: arrival_s", arrival))
        object.__setattr__(self, "tokens", _as_token_array(self.tokens, rid, "tokens"))
        if not self.tokens:
            raise InvalidArgumentError(f"request {rid}: tokens must not be empty")
        out = self.output_length
        check_int(f"request {rid}: output_length", out, 1)
        if self.output_token_ids is not None:
            ids = _as_token_array(self.output_token_ids, rid, "output_token_ids")
            if len(ids) != out:
                raise InvalidArgumentError(
                    f"request {rid}: output_token_ids has {len(ids)} tokens, "
                    f"output_length is {out}"
                )
            object.__setattr__(self, "output_token_ids", ids)
        if self.hash_ids is not None and not isinstance(self.hash_ids, tuple):
            object.__setattr__(self, "hash_ids", tuple(self.hash_ids))

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens."""
        return len(self.tokens)


def _as_token_array(tokens: object, rid: str, what: str) -> array[int]:
    if isinstance(tokens, array) and tokens.typecode == "I":
        if tokens and int(np.frombuffer(tokens, dtype=np.uint32).max()) > MAX_TOKEN_ID:
            raise InvalidArgumentError(f"request {rid}: {what} holds a token id >= 2**31")
        return tokens
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence | np.ndarray):
        raise InvalidArgumentError(
            f"request {rid}: {what} must be a sequence of token ids, got {type(tokens).__name__}"
        )
    return tokens_to_u32(tokens)


@dataclass(frozen=True, slots=True)
class Workload:
    """A named sequence of requests in arrival order, with where it came from.

    ``requests`` is sorted by ``arrival_s`` (ties keep their source order) and request ids are
    unique. ``metadata`` is JSON-able: ``source`` ("mooncake" or "synthetic"), ``parameters``
    (the arguments that rebuild it) and ``tokens_per_hash_id`` (None when requests carry no
    hash ids).
    """

    name: str
    requests: tuple[Request, ...]
    metadata: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reqs = tuple(self.requests)
        object.__setattr__(self, "requests", reqs)
        for prev, cur in pairwise(reqs):
            if cur.arrival_s < prev.arrival_s:
                raise InvalidArgumentError(
                    f"workload {self.name!r}: request {cur.request_id} arrives at "
                    f"{cur.arrival_s} s, before {prev.request_id} at {prev.arrival_s} s; "
                    "requests must be sorted by arrival"
                )
        if len({r.request_id for r in reqs}) != len(reqs):
            raise InvalidArgumentError(f"workload {self.name!r}: request ids are not unique")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def prompt_tokens(self) -> int:
        """Total prompt tokens over all requests."""
        return sum(len(r.tokens) for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Time from the first arrival to the last (0 for fewer than two requests)."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s
