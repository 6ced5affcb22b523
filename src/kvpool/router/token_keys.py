"""The index's own token chain, and a token-matched worker's engine hash -> token key maps.

Workers whose hashes the router cannot reproduce (``match_by_tokens``) are matched by their
tokens: the index keys every stored block itself, ``key_i = xxh3_64(block_i as u32 LE,
seed=key_{i-1})`` (:func:`token_chain_keys`), and maps the engine's hashes onto those keys,
for held blocks (``WorkerState.chain``) and recently removed ones (two generations,
``chain_recent`` and ``chain_older``: a removed block is often re-announced on another tier
by hash alone, or named as a late child's parent).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Final, cast

import xxhash

from kvpool.events.keyed import cut_blocks
from kvpool.router.ledger import MAX_LEDGER
from kvpool.router.worker import Skipped, WorkerState

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
    return _chain_blocks(cut_blocks(raw, tokens_per_block), key)


def _chain_blocks(blocks: Iterable[bytes], key: int) -> list[int]:
    """The chained keys of ``blocks`` (each a block's u32 LE token ids), after the key ``key``."""
    out: list[int] = []
    append = out.append
    for block in blocks:
        key = _XXH3(block, key)
        append(key)
    return out


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


def chain_start(w: WorkerState, parent: int | None, lora_id: int | None) -> int:
    """The key a stored chain's first block is hashed after: its reuse scope's root, or the
    index's key of its parent (the engine's normalized hash ``parent``)."""
    if parent is None:
        return token_chain_root(lora_id, None)
    found = chain_get(w, parent)
    if found is None:
        raise Skipped("stored chain under a parent the index never saw")
    return found


def record_chain_keys(
    w: WorkerState, key: int, engine: list[int], tokens: tuple[bytes, ...]
) -> list[int]:
    """The index's keys of a stored record's blocks (engine hashes ``engine``, each block's
    token ids in ``tokens``, as :class:`~kvpool.events.keyed.KeyedEvent` holds them) after the
    key ``key``; the worker's held mappings take them. Raises :class:`Skipped` (a block
    announced by its hash alone that the worker never mapped) before any change."""
    if not tokens:  # every block announced by its hash alone
        out = [_mapped(w, h) for h in engine]
    elif b"" not in tokens:  # the usual
        out = _chain_blocks(tokens, key)
    else:
        out = []
        for block, h in zip(tokens, engine, strict=True):
            # a block without tokens: re-announced by its hash (vLLM's offloading connector,
            # kvpool's tier moves)
            key = _XXH3(block, key) if block else _mapped(w, h)
            out.append(key)
    w.chain.update(zip(engine, out, strict=True))
    return out


def _mapped(w: WorkerState, h: int) -> int:
    """The key of a block announced by its hash alone: one the worker keyed already."""
    key = chain_get(w, h)
    if key is None:
        raise Skipped("stored block without tokens the index cannot map")
    return key
