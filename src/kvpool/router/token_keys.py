"""The index's own token chain, and a token-matched worker's engine hash -> token key maps.

Workers whose hashes the router cannot reproduce (``match_by_tokens``) are matched by their
tokens: the index keys every stored block itself, ``key_i = xxh3_64(block_i as u32 LE,
seed=key_{i-1})`` (:func:`token_chain_keys`), and maps the engine's hashes onto those keys,
for held blocks (``WorkerState.chain``) and recently removed ones (two generations,
``chain_recent`` and ``chain_older``: a removed block is often re-announced on another tier
by hash alone, or named as a late child's parent).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import repeat, starmap
from typing import Final, cast

import xxhash

from kvpool.events.keyed import normalize_hash, token_bytes
from kvpool.events.model import StoredBlock, TokenIds
from kvpool.router.ledger import MAX_LEDGER
from kvpool.router.worker import Malformed, Skipped, WorkerState

_M64: Final = (1 << 64) - 1
_XXH3: Final = xxhash.xxh3_64_intdigest
_LITTLE: Final = sys.byteorder == "little"


def _scope_bytes(lora_id: int | None, salt_id: int | None) -> bytes:
    mask = (lora_id is not None) | ((salt_id is not None) << 1)
    out = bytes([mask])
    if lora_id is not None:
        out += (lora_id & _M64).to_bytes(8, "little")
    if salt_id is not None:
        out += (salt_id & _M64).to_bytes(8, "little")
    return out


def token_chain_root(lora_id: int | None = None, salt_id: int | None = None) -> int:
    """Root of the index's token chain for a reuse scope (0 for the default scope)."""
    if lora_id is None and salt_id is None:
        return 0
    return _XXH3(_scope_bytes(lora_id, salt_id))


def _u32_bytes(tokens: Sequence[int] | array[int]) -> bytes:
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def token_chain_keys(
    tokens: Sequence[int] | array[int], tokens_per_block: int, root: int = 0
) -> list[int]:
    """The index's own chained block keys: ``key_i = xxh3_64(block_i as u32 LE, seed=key_{i-1})``.

    Every block of ``tokens`` is keyed, a trailing partial one included (its shorter byte
    string keys differently from any full block). Used for ``match_by_tokens`` workers.
    """
    return chain(_u32_bytes(tokens), tokens_per_block, root)


def chain(raw: bytes, tokens_per_block: int, key: int) -> list[int]:
    """The chained keys of ``raw`` (u32 LE token ids) cut into blocks, after the key ``key``."""
    step = 4 * tokens_per_block
    n, tail = divmod(len(raw), step)
    return _chain_blocks(_cutter(step, n, tail)(raw), key)


def _chain_blocks(blocks: Iterable[bytes], key: int) -> list[int]:
    """The chained keys of ``blocks`` (each a block's u32 LE token ids), after the key ``key``."""
    out: list[int] = []
    append = out.append
    for block in blocks:
        key = _XXH3(block, key)
        append(key)
    return out


@lru_cache(maxsize=1024)
def _cutter(step: int, n: int, tail: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Cuts ``n * step + tail`` bytes into ``n`` blocks of ``step`` bytes and a ``tail`` (when
    not 0), in one C call: no Python-level slice per block."""
    return struct.Struct(f"{step}s" * n + (f"{tail}s" if tail else "")).unpack


@lru_cache(maxsize=256)
def _packer(size: int) -> Callable[..., bytes]:
    """Packs ``size`` token ids as u32 LE (:class:`struct.error` unless all are in
    ``[0, 2**32)``)."""
    return struct.Struct(f"<{size}I").pack


def chain_get(w: WorkerState, h: int) -> int | None:
    """The token key of engine hash ``h``: held, or recently removed (None if neither)."""
    key = w.chain.get(h)
    return key if key is not None else recent_get(w, h)


def recent_get(w: WorkerState, h: int) -> int | None:
    """The chain key of a recently removed engine hash (None when not remembered)."""
    key = w.chain_recent.get(h)
    return key if key is not None else w.chain_older.get(h)


def forget(w: WorkerState, engine: Sequence[int]) -> None:
    """Held mappings of ``engine`` hashes (blocks the worker no longer holds) become recently
    removed ones, in bulk."""
    popped: list[int | None] = list(map(w.chain.pop, engine, repeat(None)))
    recent = w.chain_recent
    if None in popped:  # not held (a mapping already among the recent ones)
        recent.update([(h, k) for h, k in zip(engine, popped, strict=True) if k is not None])
    else:
        recent.update(zip(engine, cast(list[int], popped), strict=True))
    if len(recent) >= MAX_LEDGER:
        w.chain_older = recent
        w.chain_recent = {}


def chain_start(w: WorkerState, parent: object, lora_id: int | None) -> int:
    """The key a stored chain's first block is hashed after: its reuse scope's root, or the
    index's key of its parent."""
    if parent is None:
        return token_chain_root(lora_id, None)
    try:
        ph = normalize_hash(parent)
    except ValueError as exc:
        raise Malformed(str(exc)) from None
    found = chain_get(w, ph)
    if found is None:
        raise Skipped("stored chain under a parent the index never saw")
    return found


def block_chain_keys(
    w: WorkerState, key: int, blocks: Sequence[StoredBlock], engine: list[int]
) -> list[int]:
    """The index's keys of a stored chain's ``blocks`` (engine hashes ``engine``) after the key
    ``key``; the worker's held mappings take them. Raises :class:`Malformed` (bad tokens) or
    :class:`Skipped` (a block without tokens the worker never mapped) before any change."""
    try:
        tokens = [b.tokens for b in blocks]
        sizes = list(map(len, tokens))
    except (TypeError, AttributeError) as exc:
        raise Malformed(f"bad tokens in a stored block: {exc}") from None
    size, n = sizes[0], len(sizes)
    if _LITTLE and size and 0 not in sizes and set(map(type, tokens)) == {TokenIds}:
        # a kvpool manager's blocks (an in-process feed): their u32 bytes, as they are
        out = _chain_blocks(map(TokenIds.tobytes, tokens), key)  # type: ignore[arg-type]
    elif 0 < sizes[-1] <= size and sizes.count(size) == n - (sizes[-1] != size):
        # Full blocks, the last one maybe partial (the usual): each block packed in one C
        # call, and nothing is changed before every block has packed.
        try:
            if sizes[-1] == size:
                out = _chain_blocks(starmap(_packer(size), tokens), key)
            else:
                out = _chain_blocks(starmap(_packer(size), tokens[:-1]), key)
                out.append(_XXH3(_packer(sizes[-1])(*tokens[-1]), out[-1]))
        except struct.error as exc:
            raise Malformed(f"bad token ids in a stored block: {exc}") from None
    else:
        try:
            # One conversion for the whole chain; blocks are slices of it.
            flat: list[int] = []
            for t in tokens:
                flat += t
            raw = token_bytes(flat)
        except (TypeError, ValueError) as exc:
            raise Malformed(f"bad token ids in a stored block: {exc}") from None
        out = []
        off = 0
        for size, h in zip(sizes, engine, strict=True):
            if not size:
                # A block re-announced by hash alone (vLLM's offloading connector, and
                # kvpool's encoding of a tier move): it must be one we already keyed.
                known = chain_get(w, h)
                if known is None:
                    raise Skipped("stored block without tokens the index cannot map")
                key = known
            else:
                key = _XXH3(raw[4 * off:4 * (off + size)], key)
                off += size
            out.append(key)
    w.chain.update(zip(engine, out, strict=True))
    return out
