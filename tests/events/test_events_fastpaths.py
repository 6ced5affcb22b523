"""The event machinery's fast paths against plain references.

* ``encode_vllm_batch`` (one pass per stored event, hash sequences passed through) against an
  encoder written from COMPATIBILITY §3 with plain dicts and lists, encoded by msgspec's
  generic encoder: byte for byte, and the same rejections.
* ``decode_vllm_batch`` (blocks built by ``map`` over cached slices) against a decoder written
  from the module's contract over msgspec's generic decoding.
* The EventManager's chain-at-once hooks (registry updated in C, removals popped in C)
  against the same hooks called one block and one hash at a time, which must mean the same.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgumentError
from kvpool.events import (
    AllCleared,
    Created,
    EventDiff,
    EventIndex,
    EventManager,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
    decode_vllm_batch,
    encode_vllm_batch,
)

M64 = (1 << 64) - 1
MEDIUM = ("GPU", "CPU", "STORAGE", "REMOTE")
TIER = {"GPU": 0, "CPU": 1, "STORAGE": 2, "CPU_PINNED": 1, "DISK": 2, "REMOTE": 3}

# ============================================================================ encode


def _wire(h: Any) -> Any:
    if type(h) is int and 0 <= h <= M64:
        return h
    if type(h) is str:
        try:
            return bytes.fromhex(h)
        except ValueError:
            pass
    raise InvalidArgumentError(f"bad hash {h!r}")


def _medium(tier: int) -> str:
    if tier in (0, 1, 2, 3):
        return MEDIUM[tier]
    raise InvalidArgumentError(f"bad tier {tier}")


def reference_encode(
    events: list[KVCacheEvent],
    ts: float,
    rank: int | None,
    block_size: int | None,
    sliding: set[int],
) -> bytes:
    """COMPATIBILITY §3 written out with plain objects (dict key order is the wire order)."""
    out: list[dict[str, Any]] = []
    for event in events:
        data, group = event.data, event.layer_group_id or None
        if isinstance(data, Stored):
            if not data.blocks:
                continue
            size = block_size
            if size is None:
                size = max(len(b.tokens) for b in data.blocks)
            parent = None if data.parent_hash is None else _wire(data.parent_hash)
            runs = itertools.groupby(data.blocks, key=lambda b: (b.cache_level, b.lora_id))
            for (level, lora), run_blocks in runs:
                run = list(run_blocks)
                wire: dict[str, Any] = {
                    "type": "BlockStored",
                    "block_hashes": [_wire(b.block_hash) for b in run],
                    "parent_block_hash": parent,
                    "token_ids": [t for b in run for t in b.tokens],
                    "block_size": size,
                    "lora_id": lora,
                    "medium": _medium(level),
                    "lora_name": None,
                }
                if group is not None:
                    wire["group_idx"] = group
                if event.layer_group_id in sliding:
                    wire["kv_cache_spec_kind"] = "sliding_window"
                    wire["kv_cache_spec_sliding_window"] = event.window_size
                out.append(wire)
                parent = wire["block_hashes"][-1]
        elif isinstance(data, Removed):
            if not data.block_hashes:
                continue
            by_medium: dict[str | None, list[Any]] = {}
            if data.cache_levels is None:
                by_medium[None] = [_wire(h) for h in data.block_hashes]
            else:
                if len(data.cache_levels) != len(data.block_hashes):
                    raise InvalidArgumentError("levels and hashes differ in length")
                for h, level in zip(data.block_hashes, data.cache_levels, strict=True):
                    by_medium.setdefault(_medium(level), []).append(_wire(h))
            for medium, hashes in by_medium.items():
                removed: dict[str, Any] = {
                    "type": "BlockRemoved", "block_hashes": hashes, "medium": medium
                }
                if group is not None:
                    removed["group_idx"] = group
                out.append(removed)
        elif isinstance(data, Updated):
            diff = data.cache_level
            if diff is None or diff.old_value == diff.new_value:
                continue
            h = _wire(data.block_hash)
            old: dict[str, Any] = {
                "type": "BlockRemoved", "block_hashes": [h], "medium": _medium(diff.old_value)
            }
            new: dict[str, Any] = {
                "type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                "token_ids": [], "block_size": 0, "lora_id": None,
                "medium": _medium(diff.new_value), "lora_name": None,
            }
            if group is not None:
                old["group_idx"] = new["group_idx"] = group
            out += [old, new]
        elif isinstance(data, AllCleared):
            out.append({"type": "AllBlocksCleared"})
    return msgspec.msgpack.encode([float(ts), out, rank])


INT_HASHES = st.integers(0, M64) | st.sampled_from([0, 1, 2**63, M64])
HEX_HASHES = st.binary(min_size=32, max_size=32).map(bytes.hex)
TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=5).map(tuple)


@st.composite
def wire_events(draw: st.DrawFn, *, valid: bool = True) -> list[KVCacheEvent]:
    """Events as an engine or a test would hand them to the encoder: mixed tiers and LoRA ids
    inside chains, partial blocks, int and hex hashes (mixed too), every event type. With
    ``valid=False`` an occasional tier or hash the format cannot carry."""
    hash_kind = draw(st.sampled_from(["int", "hex", "mixed"]))
    hashes = {"int": INT_HASHES, "hex": HEX_HASHES, "mixed": INT_HASHES | HEX_HASHES}[hash_kind]
    tiers = st.integers(0, 2)
    if not valid:
        hashes = hashes | st.sampled_from([-1, M64 + 1, "not hex"])
        tiers = st.integers(0, 2) | st.just(3)
    # ids past the small-int cache too: equal ids need not be the same object
    lora = st.none() | st.integers(0, 3) | st.integers(1000, 1001)
    events: list[KVCacheEvent] = []
    for i in range(draw(st.integers(0, 8))):
        kind = draw(
            st.sampled_from(["stored", "stored", "removed", "updated", "cleared", "created"])
        )
        data: Any
        if kind == "stored":
            # runs of equal (tier, LoRA) are usually long: draw a value per run
            blocks = []
            for _ in range(draw(st.integers(0, 3))):
                tier, run_lora = draw(tiers), draw(lora)
                for _ in range(draw(st.integers(1, 4))):
                    block_lora = None if run_lora is None else int(str(run_lora))  # a new int
                    blocks.append(StoredBlock(draw(hashes), draw(TOKENS), tier,
                                              draw(st.integers(0, 100)), block_lora))
            data = Stored(draw(st.none() | hashes), tuple(blocks))
        elif kind == "removed":
            block_hashes = tuple(draw(st.lists(hashes, max_size=5)))
            levels: tuple[int, ...] | None = None
            if draw(st.booleans()):
                if draw(st.booleans()):
                    levels = (draw(tiers),) * len(block_hashes)
                else:
                    levels = tuple(draw(tiers) for _ in block_hashes)
            data = Removed(block_hashes, levels)
        elif kind == "updated":
            diff = st.none() | st.builds(EventDiff, tiers, tiers)
            data = Updated(draw(hashes), draw(diff), draw(diff))
        elif kind == "created":
            data = Created((draw(st.integers(0, 100)),))
        else:
            data = AllCleared()
        group, window = draw(st.integers(0, 2)), draw(st.integers(0, 4096))
        events.append(KVCacheEvent(i, data, window, group, "v1_block_key"))
    return events


ENCODE_OPTIONS = (
    st.floats(0, 2e9),
    st.none() | st.integers(0, 7),
    st.none() | st.integers(1, 6),
    st.sets(st.integers(0, 2)),
)


@given(wire_events(), *ENCODE_OPTIONS)
def test_encode_matches_the_plain_reference_byte_for_byte(
    events: list[KVCacheEvent], ts: float, rank: int | None, size: int | None, sliding: set[int]
) -> None:
    payload = encode_vllm_batch(
        events, ts=ts, data_parallel_rank=rank, block_size=size, sliding_window_groups=sliding,
        partial_blocks=True,
    )
    assert payload == reference_encode(events, ts, rank, size, sliding)


@given(wire_events(valid=False), *ENCODE_OPTIONS)
def test_encode_rejects_what_the_reference_rejects(
    events: list[KVCacheEvent], ts: float, rank: int | None, size: int | None, sliding: set[int]
) -> None:
    try:
        expected = reference_encode(events, ts, rank, size, sliding)
    except InvalidArgumentError:
        with pytest.raises(InvalidArgumentError):
            encode_vllm_batch(events, ts=ts, data_parallel_rank=rank, block_size=size,
                              sliding_window_groups=sliding, partial_blocks=True)
    else:
        assert expected == encode_vllm_batch(
            events, ts=ts, data_parallel_rank=rank, block_size=size, sliding_window_groups=sliding,
            partial_blocks=True,
        )


# ============================================================================ decode


def _norm(h: Any, algo: str) -> Any:
    if type(h) is bytes:
        return h.hex() if algo == "v2_sha256" else int.from_bytes(h[-8:], "big")
    return h & M64 if h < 0 else h


def reference_decode(payload: bytes, algo: str, first_id: int) -> list[KVCacheEvent]:
    """decode_vllm_batch's contract over msgspec's generic decoding (current-shape batches)."""
    _, raw_events, rank = msgspec.msgpack.decode(payload)
    out: list[KVCacheEvent] = []

    def emit(data: Any, group: int, window: int) -> None:
        out.append(KVCacheEvent(first_id + len(out), data, window, group, algo, rank))

    for ev in raw_events:
        group = ev.get("group_idx") or 0
        if ev["type"] == "AllBlocksCleared":
            emit(AllCleared(), 0, 0)
            continue
        hashes = [_norm(h, algo) for h in ev["block_hashes"]]
        medium = ev.get("medium")
        tier = None if medium is None else TIER[medium]
        if not hashes:
            continue
        if ev["type"] == "BlockRemoved":
            emit(Removed(tuple(hashes), None if tier is None else (tier,) * len(hashes)), group, 0)
            continue
        parent = ev.get("parent_block_hash")
        tokens = tuple(ev.get("token_ids") or ())
        size, n = ev.get("block_size") or 0, len(hashes)
        if size and tokens:
            if n == 1 and len(tokens) <= size:
                chunks = [tokens]
            else:  # aligned to the last block
                base = max(0, -(-len(tokens) // size) - n) * size
                chunks = [tokens[base + i * size : base + (i + 1) * size] for i in range(n)]
        else:
            chunks = [()] * n
        blocks = tuple(
            StoredBlock(h, c, tier or 0, 35, ev.get("lora_id"))
            for h, c in zip(hashes, chunks, strict=True)
        )
        parent = None if parent is None else _norm(parent, algo)
        emit(Stored(parent, blocks), group, ev.get("kv_cache_spec_sliding_window") or 0)
    return out


WIRE_HASHES = (
    st.integers(0, M64)
    | st.integers(-(2**63), -1)
    | st.binary(min_size=8, max_size=8)
    | st.binary(min_size=32, max_size=32)
)


@st.composite
def vllm_batches(draw: st.DrawFn) -> bytes:
    """Current-shape vLLM batches: token counts that do and do not match the hashes, missing
    optional fields, unknown keys, every medium name."""
    events: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(
            st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"])
        )
        ev: dict[str, Any] = {"type": kind}
        if kind != "AllBlocksCleared":
            ev["block_hashes"] = draw(st.lists(WIRE_HASHES, max_size=5))
            if draw(st.booleans()):
                ev["medium"] = draw(st.sampled_from([None, *TIER]))
            if draw(st.booleans()):
                ev["group_idx"] = draw(st.none() | st.integers(0, 3))
        if kind == "BlockStored":
            ev["parent_block_hash"] = draw(st.none() | WIRE_HASHES)
            ev["token_ids"] = draw(st.lists(st.integers(0, 2**32 - 1), max_size=20))
            ev["block_size"] = draw(st.integers(0, 6))
            if draw(st.booleans()):
                ev["lora_id"] = draw(st.none() | st.integers(0, 5))
            if draw(st.booleans()):
                ev["kv_cache_spec_kind"] = "sliding_window"
                ev["kv_cache_spec_sliding_window"] = draw(st.integers(0, 4096))
        if draw(st.booleans()):
            ev["some_future_field"] = [1, "x"]
        events.append(ev)
    ts = draw(st.floats(0, 2e9))
    return msgspec.msgpack.encode([ts, events, draw(st.none() | st.integers(0, 3))])


@given(vllm_batches(), st.sampled_from(["v1_block_key", "v2_sha256", "vllm_sha256_cbor"]),
       st.integers(0, 100))
def test_decode_matches_the_plain_reference(payload: bytes, algo: str, first_id: int) -> None:
    batch = decode_vllm_batch(payload, hash_algo=algo, first_event_id=first_id)
    assert batch.events == reference_decode(payload, algo, first_id)


def test_decode_cuts_many_chain_shapes_like_the_reference() -> None:
    """Chain lengths and block sizes far past the slice cache's first entries."""
    for n in range(1, 40, 3):
        for size in (1, 16, 32):
            for n_tokens in (n * size, n * size - 1, (n + 2) * size + 1):
                ev = {
                    "type": "BlockStored", "block_hashes": list(range(n)),
                    "parent_block_hash": None, "token_ids": list(range(n_tokens)),
                    "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None,
                }
                payload = msgspec.msgpack.encode([0.0, [ev], None])
                assert decode_vllm_batch(payload).events == reference_decode(
                    payload, "vllm_sha256_cbor", 0
                )


# ===================================================================== EventManager


def _one_at_a_time(em: EventManager, op: tuple[Any, ...]) -> None:
    """The same hook call split into one call per block (chained) or per hash: the chain's
    fast paths (all blocks new, all hashes announced) never run with more than one."""
    kind = op[0]
    if kind == "store":
        _, group, parent, blocks = op
        for block in blocks:
            em.on_stored(group, 64 * (group + 1), parent, [block])
            parent = block.block_hash
    elif kind == "remove":
        _, group, hashes = op
        for h in hashes:
            em.on_removed(group, 64 * (group + 1), [h])
    else:
        _apply(em, op)


def _apply(em: EventManager, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "store":
        _, group, parent, blocks = op
        em.on_stored(group, 64 * (group + 1), parent, blocks)
    elif kind == "remove":
        _, group, hashes = op
        em.on_removed(group, 64 * (group + 1), hashes)
    elif kind == "update":
        _, group, h, tier = op
        em.on_updated(group, 64 * (group + 1), h, cache_level=EventDiff(0, tier))
    elif kind == "clear":
        em.on_all_cleared()
    else:
        em.flush_iteration_events()


POOL = st.integers(1, 12)  # few hashes: chains repeat blocks, within a chain and across calls
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.integers(0, 1),
            st.none() | POOL,
            st.lists(st.builds(lambda h, t: StoredBlock(h, (h,), t), POOL, st.integers(0, 2)),
                     min_size=1, max_size=6),
        ),
        st.tuples(st.just("remove"), st.integers(0, 1), st.lists(POOL, max_size=6)),
        st.tuples(st.just("update"), st.integers(0, 1), POOL, st.integers(0, 2)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("flush")),
    ),
    max_size=30,
)


@given(OPS)
def test_chain_hooks_mean_the_same_as_one_block_at_a_time(ops: list[tuple[Any, ...]]) -> None:
    chained = EventManager(10_000, hash_algo="v1_block_key")
    single = EventManager(10_000, hash_algo="v1_block_key")
    for op in ops:
        _apply(chained, op)
        _one_at_a_time(single, op)
        assert chained.announced_blocks() == single.announced_blocks()
    chained.flush_iteration_events()
    single.flush_iteration_events()
    events = chained.get_latest_events(0)
    assert events == single.get_latest_events(0)
    index = EventIndex(strict=True)  # raises on a removal or update of an unannounced block
    index.apply_all(events)
    assert index.cached == chained.announced_blocks()


TOKEN_ID = st.one_of(st.integers(0, 2**32 - 1),
                     st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]))


@given(st.lists(st.tuples(st.lists(TOKEN_ID, min_size=1, max_size=80), st.integers(0, 2),
                          st.sampled_from([None, 3])), min_size=1, max_size=8),
       st.sampled_from([None, 4]), st.booleans())
def test_token_ids_encode_as_the_tuples_of_the_same_ids(
    blocks: list[tuple[list[int], int, int | None]], block_size: int | None, kernel: bool
) -> None:
    """A stored chain whose blocks carry TokenIds (as the manager's do) encodes byte for byte
    as the same chain with tuples, with the msgpack kernel or without it, runs long enough
    for the kernel and shorter ones; runs of several tiers and LoRA ids included."""
    from array import array

    from kvpool.events import TokenIds
    from kvpool.hashing import jit

    def batch(make: Any) -> bytes:
        chain = tuple(StoredBlock(i + 1, make(t), level, 35, lora)
                      for i, (t, level, lora) in enumerate(blocks))
        return encode_vllm_batch([KVCacheEvent(0, Stored(None, chain), 0)], ts=1.0,
                                 block_size=block_size, partial_blocks=True)

    expected = batch(tuple)
    was = jit.enabled()
    jit.set_enabled(kernel)
    try:
        got = batch(lambda t: TokenIds("I", array("I", t).tobytes()))
    finally:
        jit.set_enabled(was)
    assert got == expected


@given(st.lists(TOKEN_ID, max_size=40), st.lists(TOKEN_ID, max_size=3))
def test_token_ids_behave_as_the_tuple_of_their_ids(ids: list[int], other: list[int]) -> None:
    import pickle
    from array import array

    from kvpool.events import TokenIds

    t = TokenIds("I", array("I", ids).tobytes())
    assert t == tuple(ids) and tuple(ids) == t
    assert (t != tuple(ids)) is False  # __ne__ is not the inherited array one
    assert (t == tuple(other)) == (ids == other) and (t != tuple(other)) == (ids != other)
    assert hash(t) == hash(tuple(ids)) and len(t) == len(ids) and list(t) == ids
    assert t != ids  # a tuple never equals a list either
    block = StoredBlock(7, t)
    assert block == StoredBlock(7, tuple(ids)) and hash(block) == hash(StoredBlock(7, tuple(ids)))
    back = pickle.loads(pickle.dumps(block))
    assert back == block and type(back.tokens) is TokenIds
    assert repr(t) == f"TokenIds({tuple(ids)!r})"


@given(st.one_of(st.lists(TOKEN_ID, max_size=300),
                 st.one_of(st.sampled_from([15, 16, 65_535, 65_536]), st.integers(0, 70_000))
                 .map(lambda n: [i * 65_537 % 2**32 for i in range(n)])))
def test_msgpack_token_kernel_writes_what_msgspec_writes(ids: list[int]) -> None:
    """The kernel behind TokenIds' encoding writes every id in its shortest form and the
    array header for any length (fixarray, array 16, array 32) as msgspec does."""
    from array import array

    from kvpool.hashing import jit

    if jit.backend() == "python":
        pytest.skip("the jit extra is not installed")
    assert jit.msgpack_token_array(array("I", ids).tobytes()) == msgspec.msgpack.encode(ids)
