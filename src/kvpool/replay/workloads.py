"""Replay workloads: the requests a replay feeds to its simulated engines.

A :class:`Workload` is a name, a tuple of :class:`Request` sorted by arrival time, and a
JSON-able metadata dict saying where it came from. Two sources exist:

* :func:`load_mooncake` reads a Mooncake-format JSONL trace (one request per line with
  ``timestamp`` in ms, ``input_length``, ``output_length`` and ``hash_ids``) and synthesises
  token ids so that equal hash ids give equal token blocks;
* :func:`synthetic_workload` builds a deterministic multi-turn chat and agent workload
  (:class:`SyntheticParams` documents every knob).

Both are deterministic: the same inputs and seed give equal workloads (same tokens, same order).
Token ids are kept as ``array('I')`` (4 bytes a token): the conversation trace alone holds
145 M prompt tokens: 580 MB this way, several GB as lists of Python ints.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvpool.errors import InvalidArgumentError, TraceFormatError
from kvpool.hashing import MAX_TOKEN_ID, tokens_to_u32

__all__ = [
    "BUILTIN_TRACES",
    "DEFAULT_TOKENS_PER_HASH_ID",
    "DEFAULT_VOCAB_SIZE",
    "Request",
    "SyntheticParams",
    "Workload",
    "builtin_trace",
    "generate_synthetic",
    "hash_id_block",
    "load_mooncake",
    "synthetic_workload",
]

DEFAULT_VOCAB_SIZE: Final = 32_000
"""Synthesised token ids lie in [0, DEFAULT_VOCAB_SIZE) (a Llama-2-sized vocabulary)."""

DEFAULT_TOKENS_PER_HASH_ID: Final = 512
"""Tokens one Mooncake hash id stands for (the published traces use 512)."""

_M64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
_SM_A: Final = 0xBF58476D1CE4E5B9
_SM_B: Final = 0x94D049BB133111EB


# --------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")


# --------------------------------------------------------------------------------------------
# requests and workloads


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
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, int | float)
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise InvalidArgumentError(
                f"request {rid}: arrival_s must be a finite number >= 0, got {arrival!r}"
            )
        object.__setattr__(self, "arrival_s", float(arrival))
        object.__setattr__(self, "tokens", _as_token_array(self.tokens, rid, "tokens"))
        if not self.tokens:
            raise InvalidArgumentError(f"request {rid}: tokens must not be empty")
        out = self.output_length
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            raise InvalidArgumentError(
                f"request {rid}: output_length must be an int >= 1, got {out!r}"
            )
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


# --------------------------------------------------------------------------------------------
# Mooncake traces


def _splitmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser, elementwise (uint64 arithmetic wraps, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_SM_A)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_SM_B)
    out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def _seed_mix(seed: int) -> int:
    return int(_splitmix64(np.array([(seed + _GOLDEN) & _M64], dtype=np.uint64))[0])


def _hash_id_blocks(
    ids: Sequence[int], seed_mix: int, tokens_per_hash_id: int, vocab_size: int
) -> npt.NDArray[np.uint32]:
    """Token blocks of ``ids``, one row each: row ``r`` is a function of (seed, ids[r]) only.

    Token ``j`` of hash id ``h`` is ``splitmix64(splitmix64(h ^ mix(seed)) + (j+1)*golden)``
    reduced to [0, vocab_size) by a multiply-shift (bias below 1e-5 for any real vocabulary).
    """
    base = _splitmix64(np.array(ids, dtype=np.uint64) ^ np.uint64(seed_mix))
    steps = np.arange(1, tokens_per_hash_id + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    z = _splitmix64(base[:, None] + steps[None, :])
    tokens: npt.NDArray[np.uint32] = (
        ((z >> np.uint64(32)) * np.uint64(vocab_size)) >> np.uint64(32)
    ).astype(np.uint32)
    return tokens


def hash_id_block(
    hash_id: int,
    *,
    seed: int = 0,
    tokens_per_hash_id: int = DEFAULT_TOKENS_PER_HASH_ID,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> array[int]:
    """The full token block :func:`load_mooncake` synthesises for ``hash_id`` and ``seed``."""
    _check_int("hash_id", hash_id, 0, (1 << 63) - 1)
    _check_int("seed", seed, 0, _M64)
    _check_int("tokens_per_hash_id", tokens_per_hash_id, 1)
    _check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID + 1)
    block = _hash_id_blocks([hash_id], _seed_mix(seed), tokens_per_hash_id, vocab_size)[0]
    out = array("I")
    out.frombytes(block.tobytes())
    return out


class _MooncakeLine(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=1)]
    hash_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]], msgspec.Meta(min_length=1)
    ]


class _BlockCache:
    """Per-id token blocks (as raw u32 bytes), generated once and concatenated per request."""

    __slots__ = ("_blocks", "_mix", "_vocab", "tpi")

    def __init__(self, seed: int, tokens_per_hash_id: int, vocab_size: int) -> None:
        self._mix = _seed_mix(seed)
        self.tpi = tokens_per_hash_id
        self._vocab = vocab_size
        self._blocks: dict[int, bytes] = {}

    def tokens(self, hash_ids: list[int], input_length: int) -> array[int]:
        blocks = self._blocks
        new = [h for h in dict.fromkeys(hash_ids) if h not in blocks]
        if new:
            rows = _hash_id_blocks(new, self._mix, self.tpi, self._vocab)
            for h, row in zip(new, rows, strict=True):
                blocks[h] = row.tobytes()
        data = b"".join([blocks[h] for h in hash_ids])
        out = array("I")
        out.frombytes(memoryview(data)[: 4 * input_length])
        return out


BUILTIN_TRACES: Final = {"conversation": "conversation_trace.jsonl.gz"}
"""Traces shipped with kvpool (``kvpool/data``, see its README for source and licence): the
Mooncake FAST'25 conversation trace, 12,031 requests over about an hour."""


def builtin_trace(name: str) -> Path:
    """The path of the trace shipped with kvpool under ``name`` (a key of
    :data:`BUILTIN_TRACES`); :class:`InvalidArgumentError` for another name."""
    if name not in BUILTIN_TRACES:
        raise InvalidArgumentError(
            f"no built-in trace {name!r}; built-in: {', '.join(BUILTIN_TRACES)}"
        )
    return Path(str(files("kvpool") / "data" / BUILTIN_TRACES[name]))


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    tokens_per_hash_id: int = DEFAULT_TOKENS_PER_HASH_ID,
    limit: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Workload:
    """Load a Mooncake-format JSONL trace.

    Each non-blank line is a JSON object with ``timestamp`` (ms, number >= 0),
    ``input_length`` (int >= 1), ``output_length`` (int >= 1) and ``hash_ids`` (non-empty list
    of ints >= 0); other fields are ignored. Hash id ``i`` of a line stands for prompt tokens
    ``[i*tpi, (i+1)*tpi)`` (tpi = ``tokens_per_hash_id``); the last id may cover a partial
    block, so ``(len(hash_ids)-1)*tpi < input_length <= len(hash_ids)*tpi``.

    Tokens are synthesised so that **equal hash ids give equal token blocks**: the block of id
    ``h`` is a fixed pseudo-random sequence of ``tpi`` ids in [0, vocab_size) derived from
    (``seed``, ``h``) (see :func:`hash_id_block`), and a request's prompt is the concatenation
    of its ids' blocks truncated to ``input_length``. Hence two requests share their first k
    blocks iff their first k hash ids are equal, and a partial last block is a prefix of the
    full block of the same id. Different seeds give different tokens with the same sharing.

    ``limit`` keeps the first ``limit`` requests of the file (lines after them are not read).
    Requests are sorted by arrival (ties keep file order); ``arrival_s = timestamp / 1000``;
    ``request_id`` is ``"<file stem>:<line number>"``.

    Raises :class:`TraceFormatError` naming the file and 1-based line number for a malformed
    line, and for a missing or empty file; :class:`InvalidArgumentError` for bad arguments.
    """
    _check_int("tokens_per_hash_id", tokens_per_hash_id, 1)
    if limit is not None:
        _check_int("limit", limit, 1)
    _check_int("seed", seed, 0, _M64)
    _check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID + 1)
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"trace file not found: {p}")
    if not p.is_file():
        raise TraceFormatError(f"trace path is not a regular file: {p}")

    decoder = msgspec.json.Decoder(_MooncakeLine)
    cache = _BlockCache(seed, tokens_per_hash_id, vocab_size)
    tpi = tokens_per_hash_id
    stem = Path(p.name.removesuffix(".gz")).stem
    try:
        with gzip.open(p, "rb") if p.name.endswith(".gz") else p.open("rb") as f:
            requests = _read_mooncake(f, p, decoder, cache, stem, limit)
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise TraceFormatError(f"{p}: cannot read the trace ({exc})") from None
    if not requests:
        raise TraceFormatError(f"{p}: the trace holds no requests (empty file)")
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        name=stem,
        requests=tuple(requests),
        metadata={
            "source": "mooncake",
            "path": str(p),
            "parameters": {
                "tokens_per_hash_id": tpi,
                "limit": limit,
                "seed": seed,
                "vocab_size": vocab_size,
            },
            "tokens_per_hash_id": tpi,
        },
    )


def _read_mooncake(
    f: Iterable[bytes],
    p: Path,
    decoder: msgspec.json.Decoder[_MooncakeLine],
    cache: _BlockCache,
    stem: str,
    limit: int | None,
) -> list[Request]:
    tpi = cache.tpi
    requests: list[Request] = []
    for lineno, line in enumerate(f, 1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise TraceFormatError(f"{p}, line {lineno}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise TraceFormatError(f"{p}, line {lineno}: invalid JSON ({exc})") from None
        if not math.isfinite(rec.timestamp):
            raise TraceFormatError(
                f"{p}, line {lineno}: timestamp must be finite, got {rec.timestamp}"
            )
        n = len(rec.hash_ids)
        if not (n - 1) * tpi < rec.input_length <= n * tpi:
            raise TraceFormatError(
                f"{p}, line {lineno}: input_length {rec.input_length} does not match "
                f"{n} hash ids of {tpi} tokens (expected {(n - 1) * tpi + 1}..{n * tpi})"
            )
        requests.append(
            Request(
                request_id=f"{stem}:{lineno}",
                arrival_s=rec.timestamp / 1000.0,
                tokens=cache.tokens(rec.hash_ids, rec.input_length),
                output_length=rec.output_length,
                hash_ids=tuple(rec.hash_ids),
            )
        )
    return requests


# --------------------------------------------------------------------------------------------
# synthetic multi-turn workload


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
        _check_int("seed", self.seed, 0, _M64)
        _check_int("vocab_size", self.vocab_size, 1, MAX_TOKEN_ID + 1)
        for name in (
            "num_requests", "num_system_prompts", "system_prompt_tokens",
            "turns_per_conversation", "user_tokens", "output_tokens", "num_agent_prefixes",
            "agent_prefix_tokens", "agent_turns_per_conversation", "tool_output_tokens",
            "max_prompt_tokens",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in ("think_time_s", "agent_think_time_s", "min_think_time_s"):
            _check_float(name, getattr(self, name), 0.0)
        _check_float("agent_fraction", self.agent_fraction, 0.0, 1.0)
        _check_float("arrival_rate_per_s", self.arrival_rate_per_s, 0.0)
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
