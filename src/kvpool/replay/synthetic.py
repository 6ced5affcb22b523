"""The built-in synthetic workload: a deterministic stream of multi-turn chat and agent
conversations (:class:`SyntheticParams` documents every knob).
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass
from typing import Final

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import M64, MAX_TOKEN_ID
from kvpool.replay.requests import (
    DEFAULT_VOCAB_SIZE,
    Request,
    Workload,
)
from kvpool.validation import check_int, check_number

__all__ = ["SyntheticParams", "generate_synthetic", "synthetic_workload"]


@dataclass(frozen=True, slots=True)
class SyntheticParams:
    """Knobs of the built-in synthetic workload; the defaults replay in seconds per engine.

    The workload is a Poisson stream of *conversations*. A chat conversation starts from one of
    ``num_system_prompts`` shared system prompts; an agent conversation (a fraction
    ``agent_fraction``) starts from one of ``num_agent_prefixes`` long shared tool-definition
    prefixes. Every turn's prompt is the previous turn's prompt + the previous turn's output +
    new tokens (a user message, or a tool result for agents), so successive turns share a
    growing prefix. A conversation ends after its drawn number of turns, or before a prompt
    would exceed ``max_prompt_tokens``. Lengths called "mean" are drawn uniformly from
    [mean/2, 3*mean/2]; turn counts uniformly from [1, 2*mean-1].

    With the defaults: 2,000 requests from about 460 conversations arriving over about 200 s,
    prompts of 1.1-8.2k tokens, 6.7 M prompt tokens in all, of which an unlimited cache could
    reuse 86 %.
    """

    seed: int = 0
    """Seed of the generator; equal params give equal workloads."""
    num_requests: int = 2000
    """Requests emitted in all (the last conversation may be cut short)."""
    num_system_prompts: int = 8
    """Distinct chat system prompts, shared by all chat conversations."""
    system_prompt_tokens: int = 1024
    """Length of each system prompt."""
    turns_per_conversation: int = 4
    """Mean turns of a chat conversation."""
    user_tokens: int = 256
    """Mean tokens of a user message (the new tokens of a chat turn and of an agent's task)."""
    output_tokens: int = 192
    """Mean output tokens of a turn (its answer, part of the next turn's prompt)."""
    agent_fraction: float = 0.25
    """Fraction of conversations that are agent sessions, in [0, 1]."""
    num_agent_prefixes: int = 2
    """Distinct agent prefixes (tool definitions), shared by all agent sessions."""
    agent_prefix_tokens: int = 4096
    """Length of each agent prefix."""
    agent_turns_per_conversation: int = 6
    """Mean turns (tool-call steps) of an agent session."""
    tool_output_tokens: int = 384
    """Mean tokens of a tool result appended at each agent step after the first."""
    arrival_rate_per_s: float = 4.0
    """Poisson rate of new conversations, per second."""
    think_time_s: float = 8.0
    """Mean exponential gap between a chat turn's arrival and the next turn's, beyond the
    minimum; it covers the generation of the previous answer and the user's think time."""
    agent_think_time_s: float = 1.0
    """Mean exponential gap between agent steps, beyond the minimum (tools are fast)."""
    min_think_time_s: float = 2.0
    """Minimum gap between consecutive turns of one conversation."""
    max_prompt_tokens: int = 8192
    """No prompt is longer: a conversation stops before it would grow past this."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0, M64)
        check_int("vocab_size", self.vocab_size, 1, MAX_TOKEN_ID + 1)
        for name in (
            "num_requests", "num_system_prompts", "system_prompt_tokens",
            "turns_per_conversation", "user_tokens", "output_tokens", "num_agent_prefixes",
            "agent_prefix_tokens", "agent_turns_per_conversation", "tool_output_tokens",
            "max_prompt_tokens",
        ):
            check_int(name, getattr(self, name), 1)
        for name in ("think_time_s", "agent_think_time_s", "min_think_time_s"):
            check_number(name, getattr(self, name), 0.0)
        check_number("agent_fraction", self.agent_fraction, 0.0, 1.0)
        check_number("arrival_rate_per_s", self.arrival_rate_per_s, 0.0)
        if self.arrival_rate_per_s <= 0:
            raise InvalidArgumentError(
                f"arrival_rate_per_s must be > 0, got {self.arrival_rate_per_s}"
            )
        shortest = min(self.system_prompt_tokens, self.agent_prefix_tokens) + (
            self.user_tokens - self.user_tokens // 2
        )
        if shortest > self.max_prompt_tokens:
            raise InvalidArgumentError(
                f"max_prompt_tokens {self.max_prompt_tokens} is shorter than the shortest "
                f"first turn ({shortest} tokens)"
            )


_DEFAULT: Final = SyntheticParams()


def _spread(rng: np.random.Generator, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2], at least 1."""
    lo = max(mean // 2, 1)
    return int(rng.integers(lo, max(mean + mean // 2, lo) + 1))


def generate_synthetic(params: SyntheticParams) -> Workload:
    """The synthetic workload of ``params`` (see :class:`SyntheticParams`).

    Request ids are ``"c<conversation>-t<turn>"``, ``session_id`` is ``"c<conversation>"``;
    ``output_token_ids`` carry each turn's answer. Deterministic: one PCG64 generator seeded
    with ``params.seed`` draws everything in a fixed order.
    """
    p = params
    rng = np.random.Generator(np.random.PCG64(p.seed))
    vocab = p.vocab_size

    def draw(n: int) -> array[int]:
        out = array("I")
        out.frombytes(rng.integers(0, vocab, size=n, dtype=np.uint32).tobytes())
        return out

    system_prompts = [draw(p.system_prompt_tokens) for _ in range(p.num_system_prompts)]
    agent_prefixes = [draw(p.agent_prefix_tokens) for _ in range(p.num_agent_prefixes)]

    requests: list[Request] = []
    start = 0.0
    conv = 0
    while len(requests) < p.num_requests:
        start += float(rng.exponential(1.0 / p.arrival_rate_per_s))
        agent = bool(rng.random() < p.agent_fraction)
        if agent:
            history = agent_prefixes[int(rng.integers(p.num_agent_prefixes))]
            turns = int(rng.integers(1, 2 * p.agent_turns_per_conversation))
            think = p.agent_think_time_s
        else:
            history = system_prompts[int(rng.integers(p.num_system_prompts))]
            turns = int(rng.integers(1, 2 * p.turns_per_conversation))
            think = p.think_time_s
        arrival = start
        session = f"c{conv}"
        for turn in range(turns):
            if len(requests) >= p.num_requests:
                break
            new_len = _spread(rng, p.tool_output_tokens if agent and turn else p.user_tokens)
            if len(history) + new_len > p.max_prompt_tokens:
                break
            prompt = history + draw(new_len)
            out_len = _spread(rng, p.output_tokens)
            answer = draw(out_len)
            requests.append(
                Request(
                    request_id=f"{session}-t{turn}",
                    arrival_s=arrival,
                    tokens=prompt,
                    output_length=out_len,
                    session_id=session,
                    output_token_ids=answer,
                )
            )
            history = prompt + answer
            arrival += p.min_think_time_s + float(rng.exponential(think))
        conv += 1
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        name=f"synthetic-seed{p.seed}",
        requests=tuple(requests),
        metadata={
            "source": "synthetic",
            "parameters": dataclasses.asdict(p),
            "conversations": conv,
            "tokens_per_hash_id": None,
        },
    )


def synthetic_workload(
    *,
    seed: int = _DEFAULT.seed,
    num_requests: int = _DEFAULT.num_requests,
    num_system_prompts: int = _DEFAULT.num_system_prompts,
    system_prompt_tokens: int = _DEFAULT.system_prompt_tokens,
    turns_per_conversation: int = _DEFAULT.turns_per_conversation,
    user_tokens: int = _DEFAULT.user_tokens,
    output_tokens: int = _DEFAULT.output_tokens,
    agent_fraction: float = _DEFAULT.agent_fraction,
    num_agent_prefixes: int = _DEFAULT.num_agent_prefixes,
    agent_prefix_tokens: int = _DEFAULT.agent_prefix_tokens,
    agent_turns_per_conversation: int = _DEFAULT.agent_turns_per_conversation,
    tool_output_tokens: int = _DEFAULT.tool_output_tokens,
    arrival_rate_per_s: float = _DEFAULT.arrival_rate_per_s,
    think_time_s: float = _DEFAULT.think_time_s,
    agent_think_time_s: float = _DEFAULT.agent_think_time_s,
    min_think_time_s: float = _DEFAULT.min_think_time_s,
    max_prompt_tokens: int = _DEFAULT.max_prompt_tokens,
    vocab_size: int = _DEFAULT.vocab_size,
) -> Workload:
    """The built-in synthetic workload; keywords are the fields of :class:`SyntheticParams`."""
    return generate_synthetic(
        SyntheticParams(
            seed=seed,
            num_requests=num_requests,
            num_system_prompts=num_system_prompts,
            system_prompt_tokens=system_prompt_tokens,
            turns_per_conversation=turns_per_conversation,
            user_tokens=user_tokens,
            output_tokens=output_tokens,
            agent_fraction=agent_fraction,
            num_agent_prefixes=num_agent_prefixes,
            agent_prefix_tokens=agent_prefix_tokens,
            agent_turns_per_conversation=agent_turns_per_conversation,
            tool_output_tokens=tool_output_tokens,
            arrival_rate_per_s=arrival_rate_per_s,
            think_time_s=think_time_s,
            agent_think_time_s=agent_think_time_s,
            min_think_time_s=min_think_time_s,
            max_prompt_tokens=max_prompt_tokens,
            vocab_size=vocab_size,
        )
    )
