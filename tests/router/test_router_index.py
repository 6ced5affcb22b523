"""KvIndex: the router's per-worker, per-tier, reference-counted view of the workers' caches."""

from __future__ import annotations

import contextlib
import random
import struct
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.errors import DuplicateWorkerError, UnknownHashAlgorithmError, UnknownWorkerError
from kvpool.events.index import EventIndex
from kvpool.events.keyed import REMOVED, STORED, KeyedEvent, token_bytes
from kvpool.events.model import (
    AllCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.hashing.keys import (
    BlockHasher,
    HashAlgo,
    event_hash,
    request_block_hashes,
    tokens_to_u32,
    v2_block_key,
    v2_root_key,
)
from kvpool.router import counts as counts_module
from kvpool.router import token_keys as token_keys_module
from kvpool.router.index import (
    HOLE_WINDOW,
    TIERS,
    KvIndex,
    normalize_hash,
    token_chain_keys,
    token_chain_root,
)
from kvpool.router.scoring import request_keys

V2_ROOT = "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
V2_BLOCK = "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073"


def ev(eid: int, data: object, group: int = 0, algo: str = "v1_block_key") -> KVCacheEvent:
    return KVCacheEvent(eid, data, 4096, group, algo)  # type: ignore[arg-type]


def stored(*hashes: int | str, tier: int = 0, parent: int | str | None = None,
           tokens: tuple[int, ...] = (1, 2, 3, 4)) -> Stored:
    return Stored(parent, tuple(StoredBlock(h, tokens, tier) for h in hashes))


def move(h: int | str, old: int, new: int) -> Updated:
    return Updated(h, EventDiff(old, new))


def present(index: KvIndex, worker: str) -> set[tuple[int, int]]:
    """(hash, tier) pairs the index holds for ``worker``."""
    return {(h, t) for t, hs in index.snapshot(worker).items() for h in hs}


# ------------------------------------------------------------------------------ normalization


def test_v2_hex_normalizes_to_the_v2_sha256_64_encoding_of_the_same_block() -> None:
    key = v2_block_key(v2_root_key(), [1, 2, 3, 4])
    assert key.hex() == V2_BLOCK  # the COMPATIBILITY §1.2 vector
    as_64 = event_hash(HashAlgo.V2_SHA256_64, key)
    assert normalize_hash(V2_BLOCK) == as_64 == int(V2_BLOCK[:16], 16)


def test_normalize_hash_forms() -> None:
    assert normalize_hash(5) == 5
    assert normalize_hash(-1) == (1 << 64) - 1  # Python's signed hash() values map consistently
    assert normalize_hash(bytes(24) + (7).to_bytes(8, "big")) == 7  # raw digest: last 8 bytes
    for bad in ("", "xyz", "0" * 65, 1.5, None, b""):
        with pytest.raises(ValueError):
            normalize_hash(bad)


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=70),
    tpb=st.sampled_from([1, 4, 16]),
    salt=st.one_of(st.none(), st.text(max_size=5)),
)
def test_request_keys_equal_the_normalized_event_hashes(
    tokens: list[int], tpb: int, salt: str | None
) -> None:
    """What the router looks up is what workers publish for the same blocks (every algorithm)."""
    toks = tokens_to_u32(tokens)
    for algo, scheme in [
        (HashAlgo.V1_BLOCK_KEY, "v1"),
        (HashAlgo.V2_SHA256, "v2"),
        (HashAlgo.V2_SHA256_64, "v2"),
        (HashAlgo.VLLM_SHA256_CBOR, "vllm"),
    ]:
        published = request_block_hashes(tokens, tpb, algo, cache_salt=salt)
        assert request_keys(scheme, tpb, toks, salt) == [normalize_hash(h) for h in published]


def test_token_chain_keys_chain_and_scope() -> None:
    keys = token_chain_keys([1, 2, 3, 4, 5, 6], 4)
    assert len(keys) == 2  # one full block, one partial
    assert token_chain_keys([1, 2, 3, 4], 4) == keys[:1]  # a prefix keys the same
    assert token_chain_keys([9, 2, 3, 4, 5, 6], 4)[1] != keys[1]  # the chain carries the prefix
    assert token_chain_keys([1, 2, 3, 4], 4, token_chain_root(salt_id=1)) != keys[:1]


# --------------------------------------------------------------------------------- workers


def test_worker_registration_errors() -> None:
    index = KvIndex()
    index.add_worker("a")
    with pytest.raises(DuplicateWorkerError, match="'a'"):
        index.add_worker("a")
    with pytest.raises(UnknownHashAlgorithmError):
        index.add_worker("b", hash_algo="md5")
    with pytest.raises(UnknownWorkerError, match="'zz'"):
        index.apply("zz", ev(0, stored(1)))
    assert index.worker_ids == ["a"]


def test_algorithm_and_block_size_are_learned_from_events() -> None:
    index = KvIndex()
    index.add_worker("w")
    assert index.group_of("w") is None
    index.apply("w", ev(0, stored("ab" * 32, tokens=(1,) * 32), algo="v2_sha256"))
    assert index.hash_algo_of("w") is HashAlgo.V2_SHA256
    assert index.group_of("w") == ("v2", 32)
    # a partial block never shrinks the learned size
    index.apply("w", ev(1, stored("cd" * 32, tokens=(1,) * 5), algo="v2_sha256"))
    assert index.tokens_per_block_of("w") == 32


def test_configured_algorithm_wins_over_the_events_field() -> None:
    index = KvIndex()
    index.add_worker("w", hash_algo="vllm_sha256_cbor", tokens_per_block=16)
    index.apply("w", ev(0, stored(5), algo="v1_block_key"))
    assert index.group_of("w") == ("vllm", 16)


# ------------------------------------------------------------------------------ semantics


def test_duplicates_are_reference_counted() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(0, stored(7)))
    index.apply("w", ev(1, stored(7)))
    index.apply("w", ev(2, Removed((7,), (0,))))
    assert index.tiers_of("w", 7) == (0,)
    index.apply("w", ev(3, Removed((7,), (0,))))
    assert index.tiers_of("w", 7) == ()
    assert index.masks == {}
    assert index.counters.anomalies == 0


def test_removal_without_tiers_releases_every_tier_and_with_tiers_only_that_one() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(0, stored(1, 2, tier=0)))
    index.apply("w", ev(1, stored(1, 2, tier=1)))
    index.apply("w", ev(2, Removed((1,), (1,))))
    assert index.tiers_of("w", 1) == (0,)
    index.apply("w", ev(3, Removed((2,))))
    assert index.tiers_of("w", 2) == ()
    assert present(index, "w") == {(1, 0)}


def test_blocks_of_two_layer_groups_count_while_either_holds_them() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(0, stored(1), group=0))
    index.apply("w", ev(1, stored(1), group=1))
    index.apply("w", ev(2, Removed((1,)), group=1))
    assert index.tiers_of("w", 1) == (0,)
    index.apply("w", ev(3, Removed((1,)), group=0))
    assert index.tiers_of("w", 1) == ()
    assert index.worker_info("w").blocks_per_tier == (0, 0, 0)


def test_counts_survive_a_second_layer_group_and_a_reset_starts_over() -> None:
    """One layer group keeps its counts in the presence masks (compact); a second group moves
    them to per-group counts; a reset drops them and the next group is the only one again."""
    index = KvIndex()
    index.add_worker("w")
    index.add_worker("other")
    index.apply("other", ev(0, stored(1, 2)))
    index.apply("w", ev(0, stored(1, 1, 2, tier=1), group=3))  # 1 held twice
    assert index.worker_info("w").layer_groups == (3,)
    index.apply("w", ev(1, stored(1), group=4))  # a second group
    assert index.worker_info("w").layer_groups == (3, 4)
    index.apply("w", ev(2, Removed((1,), (1,)), group=3))
    assert index.tiers_of("w", 1) == (0, 1)  # group 3 still holds its second reference
    index.apply("w", ev(3, Removed((1,), (1,)), group=3))
    assert index.tiers_of("w", 1) == (0,)
    assert present(index, "w") == {(1, 0), (2, 1)}
    index.reset_worker("w")
    assert present(index, "w") == set() and index.worker_info("w").layer_groups == ()
    assert present(index, "other") == {(1, 0), (2, 0)}
    index.apply("w", ev(0, stored(2), group=4))
    assert index.worker_info("w").layer_groups == (4,) and index.tiers_of("w", 2) == (0,)
    assert index.counters.anomalies == 0


def test_tier_move_arriving_before_its_store_gives_the_in_order_result() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(5, move(9, 0, 1)))  # the offload overtook the store (event 4)
    assert index.counters.anomalies == 1
    index.apply("w", ev(4, stored(9)))
    assert index.tiers_of("w", 9) == (1,)


def test_late_joining_router_does_not_lose_blocks_to_history_it_never_saw() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(5000, move(9, 0, 1)))  # stored long before we joined
    index.apply("w", ev(5001, Removed((9,))))
    index.apply("w", ev(5002, stored(9)))  # a new store: it counts
    assert index.tiers_of("w", 9) == (0,)
    assert index.counters.anomalies == 1


def test_missing_ids_that_never_arrive_are_given_up_after_the_window() -> None:
    """Joined at event 10: ids 0-9 might be late, so the move waits; once they are too old to
    be late, the move is history and the later store counts."""
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(10, move(9, 0, 1)))
    index.apply("w", ev(11, Removed((9,))))
    index.apply("w", ev(12, stored(9)))
    assert index.tiers_of("w", 9) == ()  # still possibly the store the move referred to
    for eid in range(13, 13 + HOLE_WINDOW):
        index.apply("w", ev(eid, stored(1000 + eid)))
    assert index.tiers_of("w", 9) == (0,)


def test_events_for_unknown_blocks_are_anomalies_not_errors() -> None:
    index = KvIndex()
    index.add_worker("w")
    assert index.apply("w", ev(0, Removed((3,))))
    assert index.apply("w", ev(1, Removed((4,), (2,))))
    assert index.counters.anomalies == 2
    assert index.masks == {}


@pytest.mark.parametrize(
    "bad",
    [
        ev(9, stored("not-hex")),
        ev(9, stored(1, tier=3)),
        ev(9, stored(2), algo="md5"),
        ev(9, Removed((1, 2), (0,))),
        ev(9, Removed((1,), (5,))),
        ev(9, Updated(1, EventDiff(0, 4))),
        ev(9, stored(3), group=-1),
        ev(9, Created((-1,))),
        "not an event",
    ],
)
def test_malformed_events_are_counted_and_change_nothing(bad: object) -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(0, stored(1, 2)))
    before_masks = dict(index.masks)
    before = present(index, "w")
    assert index.apply("w", bad) is False  # type: ignore[arg-type]
    assert index.counters.events_malformed == 1
    assert index.worker_info("w").events_malformed == 1
    assert index.masks == before_masks
    assert present(index, "w") == before
    assert index.hash_algo_of("w") is HashAlgo.V1_BLOCK_KEY


def test_all_cleared_reset_and_removal_drop_the_workers_blocks_only() -> None:
    index = KvIndex()
    index.add_worker("a")
    index.add_worker("b")
    index.apply("a", ev(0, stored(1, 2)))
    index.apply("b", ev(0, stored(1, 3)))
    index.apply("a", ev(1, AllCleared()))
    assert present(index, "a") == set()
    assert index.tiers_of("b", 1) == (0,)
    index.apply("a", ev(2, stored(4)))
    index.reset_worker("a")
    assert present(index, "a") == set()
    assert index.worker_info("a").resets == 1
    index.remove_worker("b")
    assert index.masks == {}
    index.add_worker("c")  # reuses b's slot, starts empty
    assert present(index, "c") == set()


def test_created_twice_means_the_engine_restarted() -> None:
    index = KvIndex()
    index.add_worker("w")
    index.apply("w", ev(0, Created((100, 400))))
    index.apply("w", ev(1, Created((100, 400)), group=1))  # another group: not a restart
    index.apply("w", ev(2, stored(1)))
    assert index.worker_info("w").capacity_per_tier == (200, 800)
    index.apply("w", ev(0, Created((100, 400))))
    assert present(index, "w") == set()
    assert index.worker_info("w").resets == 1


def test_reset_listeners_hear_resets_clears_and_removals() -> None:
    index = KvIndex()
    heard: list[tuple[str, int, bool]] = []
    index.add_reset_listener(lambda w, s, removed: heard.append((w, s, removed)))
    index.add_worker("a")
    index.add_worker("b")
    index.reset_worker("b")
    index.apply("a", ev(0, AllCleared()))
    index.remove_worker("a")
    assert heard == [("b", 1, False), ("a", 0, False), ("a", 0, True)]


def test_more_workers_than_one_mask_word() -> None:
    index = KvIndex()
    for i in range(70):
        index.add_worker(f"w{i}")
    index.apply("w69", ev(0, stored(5, tier=2)))
    index.apply("w0", ev(0, stored(5, tier=1)))
    index.apply("w64", ev(0, stored(5, tier=0)))
    assert index.stride >= 70
    assert index.tiers_of("w69", 5) == (2,)
    assert index.tiers_of("w0", 5) == (1,)
    assert index.tiers_of("w64", 5) == (0,)
    assert index.tiers_of("w1", 5) == ()


def test_match_by_tokens_maps_engine_hashes_onto_the_token_chain() -> None:
    """vLLM workers whose hashes the router cannot reproduce are keyed by their tokens."""
    index = KvIndex()
    index.add_worker("w", match_by_tokens=True, tokens_per_block=4)
    toks = list(range(40, 52))
    blocks = tuple(StoredBlock(1000 + i, tuple(toks[4 * i:4 * i + 4])) for i in range(2))
    index.apply("w", ev(0, Stored(None, blocks), algo="vllm_sha256_cbor"))
    index.apply("w", ev(1, Stored(1001, (StoredBlock(1002, tuple(toks[8:12])),))))
    chain = token_chain_keys(toks, 4)
    assert present(index, "w") == {(k, 0) for k in chain}
    # a tier move encoded as removal + a token-less re-announcement (kvpool's vLLM encoding)
    index.apply("w", ev(2, Removed((1002,), (0,))))
    index.apply("w", ev(3, Stored(None, (StoredBlock(1002, (), 1),))))
    assert present(index, "w") == {(chain[0], 0), (chain[1], 0), (chain[2], 1)}
    # a chain under a parent never seen is skipped and counted
    index.apply("w", ev(4, Stored(77, (StoredBlock(1003, (1, 2, 3, 4)),))))
    assert index.counters.anomalies == 1
    assert index.apply("w", ev(5, Removed((1000,), (0,))))
    assert (chain[0], 0) not in present(index, "w")


# --------------------------------------------------------------- the event-implied set (model)


class IndexMachine(RuleBasedStateMachine):
    """Any interleaving of events and worker changes: the index equals a plain model.

    Model semantics (in-order streams): stored +1 at its tier; removed with tiers -1 there (a
    no-op when not held); removed without tiers -1 at every tier held; a tier move -1 at the old
    tier when held and +1 at the new one.
    """

    HASHES = st.integers(0, 11)
    TIER = st.integers(0, TIERS - 1)
    GROUP = st.integers(0, 1)

    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex()
        self.model: dict[str, Counter[tuple[int, int, int]]] = {}
        self.eids: dict[str, int] = {}  # each worker's stream is in order, from id 0
        self.next_name = 0

    def _eid(self, name: str) -> int:
        self.eids[name] += 1
        return self.eids[name]

    @initialize()
    def start(self) -> None:
        for _ in range(2):
            self.add()

    @rule()
    def add(self) -> None:
        name = f"w{self.next_name}"
        self.next_name += 1
        self.index.add_worker(name)
        self.model[name] = Counter()
        self.eids[name] = -1

    @precondition(lambda self: len(self.model) > 1)
    @rule(data=st.data())
    def remove_worker(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.remove_worker(name)
        del self.model[name]

    @rule(data=st.data(), hashes=st.lists(HASHES, min_size=1, max_size=4), tier=TIER, g=GROUP)
    def store(self, data: st.DataObject, hashes: list[int], tier: int, g: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.apply(name, ev(self._eid(name), stored(*hashes, tier=tier), group=g))
        for h in hashes:
            self.model[name][(g, h, tier)] += 1

    @rule(data=st.data(), hashes=st.lists(HASHES, min_size=1, max_size=3), g=GROUP,
          tiers=st.one_of(st.none(), st.lists(TIER, min_size=3, max_size=3)))
    def remove(self, data: st.DataObject, hashes: list[int], g: int,
               tiers: list[int] | None) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        levels = None if tiers is None else tuple(tiers[: len(hashes)])
        if levels is not None and len(levels) < len(hashes):
            hashes = hashes[: len(levels)]
        self.index.apply(name, ev(self._eid(name), Removed(tuple(hashes), levels), group=g))
        m = self.model[name]
        for i, h in enumerate(hashes):
            held = [levels[i]] if levels is not None else list(range(TIERS))
            for t in held:
                if m[(g, h, t)] > 0:
                    m[(g, h, t)] -= 1

    @rule(data=st.data(), h=HASHES, old=TIER, new=TIER, g=GROUP)
    def update(self, data: st.DataObject, h: int, old: int, new: int, g: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.index.apply(name, ev(self._eid(name), move(h, old, new), group=g))
        if old == new:
            return
        m = self.model[name]
        if m[(g, h, old)] > 0:
            m[(g, h, old)] -= 1
        m[(g, h, new)] += 1

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        if data.draw(st.booleans()):
            self.index.apply(name, ev(self._eid(name), AllCleared()))
        else:
            self.index.reset_worker(name)  # a restarted publisher counts from 0 again
            self.eids[name] = -1
        self.model[name].clear()

    @invariant()
    def index_equals_model(self) -> None:
        expected_masks: dict[int, int] = {}
        stride = self.index.stride
        for name, m in self.model.items():
            held = {(h, t) for (_, h, t), c in m.items() if c > 0}
            assert present(self.index, name) == held
            info = self.index.worker_info(name)
            assert info.blocks_per_tier == tuple(
                sum(1 for _, t in held if t == tier) for tier in range(TIERS)
            )
            slot = self.index.slot_of(name)
            for h, t in held:
                expected_masks[h] = expected_masks.get(h, 0) | (1 << (t * stride + slot))
        assert self.index.masks == expected_masks


TestIndexMachine = IndexMachine.TestCase


# ------------------------------------------------------- out-of-order tier moves (property)


def _simulate(
    rng: random.Random, steps: int
) -> tuple[list[KVCacheEvent], Counter[tuple[int, int]]]:
    """A worker's cache evolving in time (duplicates allowed, vLLM style) and its event log."""
    held: Counter[tuple[int, int]] = Counter()  # (hash, tier) -> copies
    events: list[KVCacheEvent] = []
    for eid in range(steps):
        owned = sorted(k for k, c in held.items() if c > 0)
        op = rng.random()
        if op < 0.45 or not owned:
            h, t = rng.randrange(8), rng.randrange(TIERS)
            held[(h, t)] += 1
            events.append(ev(eid, stored(h, tier=t)))
        elif op < 0.8:
            h, t = rng.choice(owned)
            new = rng.choice([x for x in range(TIERS) if x != t])
            held[(h, t)] -= 1
            held[(h, new)] += 1
            events.append(ev(eid, move(h, t, new)))
        else:
            h, t = rng.choice(owned)
            held[(h, t)] -= 1
            events.append(ev(eid, Removed((h,), (t,))))
    return events, +held


def _perturb(rng: random.Random, events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Move some tier moves and tiered removals earlier, past the stores and moves they follow
    (anything else: tiered steps on one (hash, tier) commute except across a zero count)."""
    out = list(events)
    for _ in range(len(out) // 3):
        i = rng.randrange(len(out))
        e = out[i]
        if type(e.data) not in (Updated, Removed):
            continue
        j = i
        while j > 0 and rng.random() < 0.7:
            j -= 1
        out.insert(j, out.pop(i))
    return out


@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120))
def test_out_of_order_tier_moves_and_duplicates_give_the_cache_the_events_describe(
    seed: int, steps: int
) -> None:
    rng = random.Random(seed)
    events, truth = _simulate(rng, steps)
    # In order, the index agrees with the events package's reference consumer ...
    in_order = KvIndex()
    in_order.add_worker("w")
    in_order.apply_many("w", events)
    reference = EventIndex()
    reference.apply_all(events)
    assert present(in_order, "w") == {(h, t) for h, _, t in reference.cached}
    assert present(in_order, "w") == set(truth)
    # ... and with the moves overtaking the events they follow, the result is the same.
    shuffled = KvIndex()
    shuffled.add_worker("w")
    assert shuffled.apply_many("w", _perturb(rng, events)) == len(events)
    assert present(shuffled, "w") == set(truth)
    assert shuffled.masks == in_order.masks


def test_request_keys_match_a_hasher_driven_by_hand() -> None:
    """v1 keys chain through every full block, then the partial tail (COMPATIBILITY §1.5)."""
    tokens = list(range(1, 11))  # body = 9 tokens: two blocks of 4, one partial of 1
    h = BlockHasher(HashAlgo.V1_BLOCK_KEY, 4)
    full = h.extend(tokens[:8])
    tail = h.key_of_prefix_block(tokens_to_u32(tokens[8:9]))
    assert request_keys("v1", 4, tokens_to_u32(tokens), None) == [*full, tail]


# --------------------------------------------------------- token matching: the index's own chain


def _reference_chain(start: int, blocks: list[tuple[int, ...]]) -> list[int]:
    """``key_i = xxh3_64(block_i as u32 LE, seed=key_{i-1})``, block by block."""
    out = []
    for toks in blocks:
        start = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(toks)}I", *toks), start)
        out.append(start)
    return out


@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 40), tpb=st.integers(1, 5))
def test_a_token_matched_worker_holds_what_a_worker_publishing_the_chain_keys_holds(
    seed: int, steps: int, tpb: int
) -> None:
    """Token matching maps the engine's hashes onto the index's chain: the index then holds,
    block for block, what it holds for a worker publishing the chain keys themselves. Stored
    chains come as events (any block sizes, token-less re-announcements, mixed tiers) or as
    records with tokens; removals as events or records, with duplicates, engine
    hashes sharing a key, hashes never stored and every kind of tier."""
    rng = random.Random(seed)
    mapped: dict[int, int] = {}  # engine hash -> chain key, as the token-matched worker maps it
    tokens = KvIndex()
    tokens.add_worker("w", match_by_tokens=True, tokens_per_block=tpb)
    keyed = KvIndex()
    keyed.add_worker("w", tokens_per_block=tpb)
    for eid in range(steps):
        if rng.random() < 0.6 or not mapped:
            parent = rng.choice([None, *mapped]) if rng.random() < 0.7 else None
            lora = rng.choice([None, None, 3])
            key = token_chain_root(lora) if parent is None else mapped[parent]
            engine = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
            blocks, chain, sizes = [], [], []
            for i, h in enumerate(engine):
                last = i == len(engine) - 1
                size = rng.choice([tpb, tpb, rng.randint(1, tpb) if last else tpb])
                if h in mapped and rng.random() < 0.2:
                    size = 0  # re-announced by hash alone
                elif rng.random() < 0.1:
                    size = rng.randint(1, tpb + 1)  # irregular sizes: block by block
                toks = tuple(rng.randrange(2**32) if rng.random() < 0.05 else rng.randrange(50)
                             for _ in range(size))
                key = mapped[h] if size == 0 else _reference_chain(key, [toks])[0]
                blocks.append(toks)
                chain.append(key)
                sizes.append(size)
            tiers = [rng.randrange(TIERS)] * len(engine)
            if rng.random() < 0.2:
                tiers = [rng.randrange(TIERS) for _ in engine]
            if len(set(tiers)) == 1 and rng.random() < 0.5:
                record = KeyedEvent(
                    eid, STORED, list(engine), tiers[0],
                    tokens=tuple(struct.pack(f"<{len(t)}I", *t) for t in blocks),
                    parent=parent, lora_id=lora)
                assert tokens.apply("w", record)
            else:
                assert tokens.apply("w", ev(eid, Stored(parent, tuple(
                    StoredBlock(h, t, tier, lora_id=lora)
                    for h, t, tier in zip(engine, blocks, tiers, strict=True)))))
            keyed.apply("w", ev(eid, Stored(None, tuple(
                StoredBlock(k, (), tier) for k, tier in zip(chain, tiers, strict=True)))))
            mapped.update(zip(engine, chain, strict=True))
        else:
            engine = [rng.choice([*mapped, 99]) for _ in range(rng.randint(1, 5))]
            # a hash never stored (99): an anomaly for both (key 0: no block has it)
            keys = [mapped.get(h, 0) for h in engine]
            shape = rng.randrange(4)
            levels: tuple[int, ...] | None = None
            if shape == 1:
                levels = (rng.randrange(TIERS),) * len(engine)
            elif shape == 2:
                levels = tuple(rng.randrange(TIERS) for _ in engine)
            if shape == 3 or (levels is not None and len(set(levels)) == 1 and rng.random() < .5):
                level = None if levels is None else levels[0]
                assert tokens.apply("w", KeyedEvent(eid, REMOVED, engine, level))
            else:
                assert tokens.apply("w", ev(eid, Removed(tuple(engine), levels)))
            keyed.apply("w", ev(eid, Removed(tuple(keys), levels)))
        assert tokens.masks == keyed.masks
        assert tokens.counters == keyed.counters
    assert tokens.counters.events_malformed == keyed.counters.events_malformed == 0


def test_stored_chains_with_bad_token_ids_are_malformed_whole() -> None:
    index = KvIndex()
    index.add_worker("w", match_by_tokens=True, tokens_per_block=2)
    for bad in ((1, -1), (1, 2**32), (1, 1.5), (1, "x")):
        blocks = (StoredBlock(1, (5, 6)), StoredBlock(2, bad))  # type: ignore[arg-type]
        assert not index.apply("w", ev(0, Stored(None, blocks)))
    assert index.counters.events_malformed == 4 and not index.masks
    assert token_bytes([0, 2**32 - 1]) == b"\x00" * 4 + b"\xff" * 4
    with pytest.raises(ValueError):
        token_bytes([2**32])


def _token_matched_stream(
    rng: random.Random, steps: int
) -> list[KeyedEvent | KVCacheEvent]:
    """Stored chains (records and events, on any tier, engine hashes stored again) and removals
    (on one tier, every tier, mixed tiers; records and events) of a token-matched worker."""
    out: list[KeyedEvent | KVCacheEvent] = []
    stored_hashes: list[int] = []
    for eid in range(steps):
        if rng.random() < 0.55 or not stored_hashes:
            engine = [rng.randrange(24) for _ in range(rng.randint(1, 5))]
            toks = [tuple(rng.randrange(9) for _ in range(2)) for _ in engine]
            tier = rng.choice([0, 0, 0, 1, 2])
            if rng.random() < 0.5:
                out.append(KeyedEvent(eid, STORED, engine, tier,
                                      tokens=tuple(map(token_bytes, toks))))
            else:
                out.append(ev(eid, Stored(None, tuple(
                    StoredBlock(h, t, tier) for h, t in zip(engine, toks, strict=True)))))
            stored_hashes += engine
        else:
            engine = rng.sample(stored_hashes, min(len(stored_hashes), rng.randint(1, 6)))
            shape = rng.randrange(4)
            if shape == 0:
                out.append(KeyedEvent(eid, REMOVED, engine, rng.randrange(TIERS)))
            elif shape == 1:
                out.append(KeyedEvent(eid, REMOVED, engine, None))
            else:
                levels = tuple(rng.randrange(TIERS) for _ in engine)
                out.append(ev(eid, Removed(tuple(engine), levels if shape == 2 else None)))
    return out


@contextlib.contextmanager
def max_ledger(n: int) -> Iterator[None]:
    """MAX_LEDGER patched where it is read: the ledger's bound (counts) and the generations of
    recently removed mappings (token_keys)."""
    with (mock.patch.object(counts_module, "MAX_LEDGER", n),
          mock.patch.object(token_keys_module, "MAX_LEDGER", n)):
        yield


@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 60), keep=st.integers(1, 6))
def test_removals_that_leave_nothing_held_forget_as_the_block_by_block_check_does(
    seed: int, steps: int, keep: int
) -> None:
    """A token-matched worker's bulk removal skips looking up each block when none can stay
    held (_none_left): the mappings it keeps, forgets and remembers as recently removed equal
    those of the block-by-block check, event by event (few remembered, so generations turn)."""
    events = _token_matched_stream(random.Random(seed), steps)
    fast, slow = KvIndex(), KvIndex()
    for index in (fast, slow):
        index.add_worker("w", match_by_tokens=True, tokens_per_block=2)
    wf, ws = fast._workers["w"], slow._workers["w"]
    with max_ledger(keep):
        for event in events:
            fast.apply("w", event)
            with mock.patch.object(counts_module, "none_left", lambda *_: False):
                slow.apply("w", event)
            assert (wf.chain, wf.chain_recent, wf.chain_older) == (
                ws.chain, ws.chain_recent, ws.chain_older)
            assert fast.masks == slow.masks and fast.counters == slow.counters


def test_recently_removed_mappings_are_remembered_for_at_least_max_ledger_removals() -> None:
    index = KvIndex()
    index.add_worker("w", match_by_tokens=True, tokens_per_block=1)
    with max_ledger(4):
        index.apply("w", KeyedEvent(0, STORED, list(range(10)),
                                    tokens=tuple(token_bytes([t]) for t in range(10))))
        for eid, h in enumerate(range(10), start=1):
            index.apply("w", KeyedEvent(eid, REMOVED, [h], 0))
        # The last 4 (to 8) removed can still be named as parents; the first ones are gone.
        for eid, parent in enumerate((9, 8, 7, 6, 0), start=11):
            index.apply("w", KeyedEvent(eid, STORED, [100 + eid], tokens=(token_bytes([1]),),
                                        parent=parent))
    assert index.counters.anomalies == 1
