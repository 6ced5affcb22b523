"""Mooncake-format traces as replay workloads: :func:`load_mooncake`, the token blocks it
synthesises per hash id (:func:`hash_id_block`: equal hash ids give equal token blocks) and the
traces shipped with kvpool (:data:`BUILTIN_TRACES`).
"""

from __future__ import annotations

import gzip
import math
import os
from array import array
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvpool.errors import InvalidArgumentError, TraceFormatError
from kvpool.hashing.keys import M64, MAX_TOKEN_ID
from kvpool.replay.requests import DEFAULT_VOCAB_SIZE, Request, Workload
from kvpool.validation import check_int

__all__ = [
    "BUILTIN_TRACES",
    "DEFAULT_TOKENS_PER_HASH_ID",
    "builtin_trace",
    "hash_id_block",
    "load_mooncake",
]

DEFAULT_TOKENS_PER_HASH_ID: Final = 512
"""Tokens one Mooncake hash id stands for (the published traces use 512)."""

_GOLDEN: Final = 0x9E3779B97F4A7C15
_SM_A: Final = 0xBF58476D1CE4E5B9
_SM_B: Final = 0x94D049BB133111EB


def _splitmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser, elementwise (uint64 arithmetic wraps, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_SM_A)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_SM_B)
    out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def _seed_mix(seed: int) -> int:
    return int(_splitmix64(np.array([(seed + _GOLDEN) & M64], dtype=np.uint64))[0])


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
    check_int("hash_id", hash_id, 0, (1 << 63) - 1)
    check_int("seed", seed, 0, M64)
    check_int("tokens_per_hash_id", tokens_per_hash_id, 1)
    check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID + 1)
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
    check_int("tokens_per_hash_id", tokens_per_hash_id, 1)
    if limit is not None:
        check_int("limit", limit, 1)
    check_int("seed", seed, 0, M64)
    check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID + 1)
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
