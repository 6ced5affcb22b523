"""Example tests of the manager's rules: two-phase admission (seeds 001/002), partial claims,
beams, sliding windows, retention, errors."""

from __future__ import annotations

import pytest

from kvpool.config import (
    CacheConfig,
    DiskConfig,
    RetentionConfig,
    SequenceRequest,
    TokenRangeRetention,
)
from kvpool.core.manager import KVCacheManager
from kvpool.core.plan import PartialMode
from kvpool.core.radix import NO_SLOT
from kvpool.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokenError,
    OutOfBlocksError,
    RewindError,
    UnknownSequenceError,
)
from kvpool.hashing.keys import HashAlgo


def cached(m: KVCacheManager, seq_id: int, tokens: list[int], **kw: object) -> None:
    """Admit, compute and release a sequence so its blocks stay cached."""
    m.add_sequence(SequenceRequest(seq_id, tokens, **kw))  # type: ignore[arg-type]
    m.remove_sequence(seq_id)


P1 = [11, 12, 13, 14, 15, 16, 17, 18]
P2 = [21, 22, 23, 24, 25, 26, 27, 28]


def seed_setup() -> KVCacheManager:
    """A full GPU pool of cached blocks: P2 (oldest), P1, then 6 filler blocks (newest)."""
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=10, enable_partial_reuse=False))
    cached(m, 0, [*P2, 99])
    cached(m, 1, [*P1, 98])
    cached(m, 2, list(range(100, 124)))
    assert m.slot_usage()["evictable"] == 10
    return m


def test_one_at_a_time_admission_loses_promised_reuse() -> None:
    m = seed_setup()
    x = SequenceRequest("x", [*P1, 1, 2, 3, 4, 5])
    y = SequenceRequest("y", [*P2, 6, 7, 8, 9, 10])
    promised = {"x": m.count_reusable_tokens(x.tokens), "y": m.count_reusable_tokens(y.tokens)}
    assert promised == {"x": 8, "y": 8}
    got_x = m.add_sequence(x).reused_tokens
    got_y = m.add_sequence(y).reused_tokens  # x's fresh blocks evicted y's (oldest) prefix
    assert got_x == 8
    assert got_y < promised["y"]


def test_batch_admission_keeps_every_promised_reuse() -> None:
    m = seed_setup()
    x = SequenceRequest("x", [*P1, 1, 2, 3, 4, 5])
    y = SequenceRequest("y", [*P2, 6, 7, 8, 9, 10])
    plan = m.plan_batch([x, y])
    results = m.add_sequence_batch([x, y])
    assert [r.reused_tokens for r in results] == [8, 8]
    assert plan.reused_tokens == {"x": 8, "y": 8}
    # the two fresh blocks of each came from the filler sequence's blocks
    assert [r.new_blocks for r in results] == [{0: 2}, {0: 2}]
    m.check_invariants()


def test_out_of_blocks_names_deficit_and_changes_nothing() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=4))
    m.add_sequence(SequenceRequest(0, list(range(9))))  # 3 blocks
    before = m.debug_state()
    with pytest.raises(OutOfBlocksError) as info:
        m.add_sequence_batch([SequenceRequest(1, list(range(50, 59)))])
    assert info.value.deficit == {(0, 0): 2}
    assert "group 0: need 3, have 1" in str(info.value)
    assert m.debug_state() == before


# ---------------------------------------------------------------------------------- partial


def partial_setup() -> KVCacheManager:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=16))
    cached(m, 0, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks [1-4] [5-8] stored, [5-8] a leaf
    return m


def test_partial_match_takes_unreferenced_leaf_over_in_place() -> None:
    m = partial_setup()
    (plan,) = m.plan_batch([SequenceRequest("a", [1, 2, 3, 4, 5, 6, 0, 0])]).requests
    assert plan.partial_mode is PartialMode.TAKEOVER
    assert plan.reused_tokens == 6 and plan.new_blocks == {0: 0}
    src = plan.partial_source(0)
    assert src is not None and src[0] == 0  # on the GPU
    src_slot = src[1]
    res = m.add_sequence(SequenceRequest("a", [1, 2, 3, 4, 5, 6, 0, 0]))
    assert res.block_ids[0][0][1] == src_slot  # the leaf's slot, no copy
    assert m.storage.stats().total_blocks == 0
    # the taken-over block left the tree: nobody else can match [5, 6, 7, 8] any more
    assert m.count_reusable_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4


def test_partial_copiers_copy_and_first_takes_over() -> None:
    m = partial_setup()
    reqs = [SequenceRequest("a", [1, 2, 3, 4, 5, 6, 0, 0]),
            SequenceRequest("b", [1, 2, 3, 4, 5, 6, 7, 1, 1])]
    plan = m.plan_batch(reqs)
    assert [p.partial_mode for p in plan.requests] == [PartialMode.TAKEOVER, PartialMode.COPY]
    res = m.add_sequence_batch(reqs)
    assert [r.reused_tokens for r in res] == [6, 7]
    stats = m.storage.stats()
    assert stats.blocks_moved == {(0, 0): 1}  # b copied from the block a took over
    assert res[0].block_ids[0][0][1] != res[1].block_ids[0][0][1]
    m.check_invariants()


def test_last_copier_releases_a_source_it_could_not_take() -> None:
    m = partial_setup()
    cached(m, 1, [1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34])  # [5-8] is no longer a leaf
    evictable = m.slot_usage()["evictable"]
    reqs = [SequenceRequest("a", [1, 2, 3, 4, 5, 6, 0, 0]),
            SequenceRequest("b", [1, 2, 3, 4, 5, 1, 1])]
    plan = m.plan_batch(reqs)
    assert [p.partial_mode for p in plan.requests] == [PartialMode.COPY, PartialMode.COPY]
    m.add_sequence_batch(reqs)
    assert m.storage.stats().blocks_moved == {(0, 0): 2}
    # the source went back to the queue: still cached and matchable
    assert m.count_reusable_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    usage = m.slot_usage()
    assert usage["evictable"] == evictable - 1  # only the claimed [1-4] block left the queue
    m.check_invariants()


def test_full_match_of_the_same_block_cancels_takeover_and_release() -> None:
    m = partial_setup()
    reqs = [SequenceRequest("a", [1, 2, 3, 4, 5, 6, 0, 0]),
            SequenceRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])]
    plan = m.plan_batch(reqs)
    assert plan.requests[0].partial_mode is PartialMode.COPY
    assert plan.requests[1].reused_tokens == 8
    res = m.add_sequence_batch(reqs)
    src = res[1].block_ids[0][0][1]
    assert m.debug_state()["ref"][0][src] == 1  # b holds it; a's copy did not release it
    assert res[0].block_ids[0][0][1] != src
    m.check_invariants()


# ---------------------------------------------------------------------------------- beams


def test_last_context_block_per_beam_unless_prompt_fills_it() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=32, max_beam_width=3))
    r = m.add_sequence(SequenceRequest("b", list(range(10)), beam_width=3))
    tables = r.block_ids[0]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full context blocks shared
    assert len({t[2] for t in tables}) == 3  # the partial last block is per beam
    assert r.new_blocks == {0: 5}
    r2 = m.add_sequence(SequenceRequest("c", list(range(50, 58)), beam_width=3))
    assert all(t == r2.block_ids[0][0] for t in r2.block_ids[0])  # fills exactly: all shared
    m.add_tokens("c", [1])
    grown = [m.block_ids("c", 0, b) for b in range(3)]
    assert len({t[2] for t in grown}) == 3  # generated blocks are per beam
    m.check_invariants()


# ---------------------------------------------------------------------------------- windows


def test_sliding_window_releases_blocks_that_left_it_keeping_sinks() -> None:
    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=[32, 32], window_sizes=[None, 6],
                      sink_tokens=[0, 4])
    m = KVCacheManager(cfg)
    m.add_sequence(SequenceRequest("s", list(range(8))))
    assert m.num_free_blocks(1) == 30
    # 12 speculative tokens: their first attends back from position 8, nothing is stale yet
    m.add_tokens("s", list(range(100, 112)))
    assert NO_SLOT not in m.block_ids("s", 1)
    assert m.num_free_blocks(1) == 27
    m.add_tokens("s", [7])  # at 21 tokens the window needs positions [14, 21) + the sink
    table = m.block_ids("s", 1)
    assert table[0] != NO_SLOT  # the sink block stays
    assert table[1] == NO_SLOT and table[2] == NO_SLOT  # left the window
    assert all(s != NO_SLOT for s in table[3:])
    assert all(s != NO_SLOT for s in m.block_ids("s", 0))  # full attention keeps everything
    assert m.num_free_blocks(1) == 27 - 1 + 2
    with pytest.raises(RewindError, match="released block 1"):
        m.rewind_tokens("s", 8)  # the window at 13 tokens needs block 1 back
    m.check_invariants()


def test_window_group_reuses_with_only_in_window_blocks() -> None:
    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=[64], window_sizes=[4])
    m = KVCacheManager(cfg)
    cached(m, 0, list(range(24)))
    r = m.add_sequence(SequenceRequest(1, [*range(24), 7]))
    assert r.reused_tokens == 24
    table = r.block_ids[0][0]
    # at length 24 a window of 4 needs the blocks meeting positions [19, 24): blocks 4 and 5
    assert table[:4] == [NO_SLOT] * 4 and NO_SLOT not in table[4:]
    assert r.stats.full_reused == 2


# ---------------------------------------------------------------------------------- retention


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_low_priority_blocks_are_evicted_first_then_lru() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8, enable_partial_reuse=False))
    keep = RetentionConfig(ranges=[TokenRangeRetention(0, None, 80)])
    drop = RetentionConfig(ranges=[TokenRangeRetention(0, None, 10)])
    cached(m, 0, [*range(8), 99], retention=drop)  # older, low priority
    cached(m, 1, [*range(20, 28), 99], retention=keep)
    cached(m, 2, [*range(40, 48), 99])  # newest, default priority 35
    m.add_sequence(SequenceRequest(3, list(range(60, 68))))  # 2 free slots: no eviction
    assert m.count_reusable_tokens([*range(8), 1]) == 8
    m.add_sequence(SequenceRequest(4, list(range(70, 78))))
    assert m.count_reusable_tokens([*range(8), 1]) == 0  # priority 10 went first
    assert m.count_reusable_tokens([*range(20, 28), 1]) == 8
    m.add_sequence(SequenceRequest(5, list(range(80, 88))))
    assert m.count_reusable_tokens([*range(40, 48), 1]) == 0  # then 35, before 80
    assert m.count_reusable_tokens([*range(20, 28), 1]) == 8


def test_retention_duration_falls_back_to_default() -> None:
    clock = FakeClock()
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=6, enable_partial_reuse=False,
                                   clock=clock))
    brief = RetentionConfig(ranges=[TokenRangeRetention(0, None, 90, duration_s=10)])
    cached(m, 0, [*range(8), 99], retention=brief)
    cached(m, 1, [*range(20, 28), 99], retention=RetentionConfig(
        ranges=[TokenRangeRetention(0, None, 50)]))
    clock.now = 11.0  # priority 90 expired to 35 < 50
    m.add_sequence(SequenceRequest(2, list(range(60, 76))))  # 2 free + 2 evicted
    assert m.count_reusable_tokens([*range(8), 1]) == 0
    assert m.count_reusable_tokens([*range(20, 28), 1]) == 8


# ---------------------------------------------------------------------------------- errors


def test_typed_errors_for_bad_calls() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8))
    with pytest.raises(UnknownSequenceError, match="nope"):
        m.add_tokens("nope", [1])
    m.add_sequence(SequenceRequest(1, [1, 2, 3]))
    with pytest.raises(DuplicateSequenceError, match="already in use"):
        m.add_sequence(SequenceRequest(1, [1, 2, 3]))
    with pytest.raises(DuplicateSequenceError, match="twice in this batch"):
        m.add_sequence_batch([SequenceRequest(5, [1, 2]), SequenceRequest(5, [3, 4])])
    assert 5 not in m.sequences
    with pytest.raises(RewindError, match="committed"):
        m.rewind_tokens(1, 1)
    with pytest.raises(InvalidArgumentError, match="tokens_per_block"):
        CacheConfig(tokens_per_block=0, gpu_blocks=8)
    with pytest.raises(InvalidArgumentError, match="window_sizes"):
        CacheConfig(tokens_per_block=4, gpu_blocks=8, window_sizes=[0])
    cross = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8,
                                       window_sizes=[None, None], cross_attention_groups=[1]))
    with pytest.raises(InvalidArgumentError, match="encoder_tokens"):
        cross.add_sequence(SequenceRequest(2, [1, 2, 3]))
    r = cross.add_sequence(SequenceRequest(2, [1, 2, 3], encoder_tokens=list(range(9))))
    assert len(r.block_ids[1][0]) == 3


BAD_CONFIGS = [
    ({"window_sizes": None}, "window_sizes .*must be a sequence, got None"),
    ({"window_sizes": 5}, "window_sizes .*must be a sequence, got 5"),
    ({"cross_attention_groups": None}, "cross_attention_groups must be a sequence"),
    ({"layer_geometry": 3}, "layer_geometry must be a sequence"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_CONFIGS)
def test_config_fields_that_are_not_sequences_are_typed_errors(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        CacheConfig(tokens_per_block=4, gpu_blocks=8, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[True], [5, False, 6], [7] * 70 + [True] + [0] * 10])
def test_bool_token_ids_are_refused_everywhere(tokens: list[int]) -> None:
    with pytest.raises(InvalidTokenError, match="bool"):
        SequenceRequest(1, tokens)
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=32))
    m.add_sequence(SequenceRequest(1, [1, 2, 3]))
    state = m.debug_state()
    with pytest.raises(InvalidTokenError, match="bool"):
        m.add_tokens(1, tokens)
    with pytest.raises(InvalidTokenError, match="bool"):
        m.count_reusable_tokens(tokens)
    assert m.debug_state() == state
    # the ids themselves are fine as ints (a long list with 0 and 1 among them too)
    m.add_tokens(1, [int(t) for t in tokens])


@pytest.mark.parametrize("batch", [None, 5, "abc", SequenceRequest(1, [1])])
def test_a_batch_that_is_not_a_sequence_of_requests_is_a_typed_error(batch: object) -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8))
    with pytest.raises(InvalidArgumentError, match="sequence of SequenceRequest"):
        m.add_sequence_batch(batch)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="sequence of SequenceRequest"):
        m.plan_batch(batch)  # type: ignore[arg-type]
    assert m.debug_state()["seqs"] == {}


@pytest.mark.parametrize("bad", [0.0, True, "0", None, -1, 2])
def test_pool_and_table_queries_refuse_what_is_not_an_index(bad: object) -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8, host_blocks=2))
    m.add_sequence(SequenceRequest(1, [1, 2, 3]))
    for query in (lambda: m.block_ids(1, bad), lambda: m.block_ids(1, 0, bad),  # type: ignore[arg-type]
                  lambda: m.num_free_blocks(bad), lambda: m.slot_usage(bad),  # type: ignore[arg-type]
                  lambda: m.slot_usage(0, bad)):  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            query()


@pytest.mark.parametrize("algo", [a.value for a in HashAlgo])
def test_reuse_scopes_never_share_blocks_whatever_the_hash_algorithm(algo: str) -> None:
    # v1 and vLLM keys mix the scope into the first block, so their root keys are equal
    # across scopes: the tree must still keep one root per (LoRA id, cache salt)
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=64, hash_algo=algo))
    toks = list(range(1, 18))
    m.add_sequence(SequenceRequest(1, toks, cache_salt="a", lora_id=2))
    m.remove_sequence(1)
    assert m.count_reusable_tokens(toks, cache_salt="a", lora_id=2) == 16
    for salt, lora in [(None, None), ("b", 2), ("a", None), ("a", 3), (None, 2)]:
        assert m.count_reusable_tokens(toks, cache_salt=salt, lora_id=lora) == 0, (salt, lora)
    m.check_invariants()


def test_bad_constructor_arguments_are_typed_errors() -> None:
    from kvpool.errors import GeometryError, StorageError
    from kvpool.tiers.storage import GroupGeometry, MetadataStorage
    from kvpool.tiers.torch_storage import TorchStorage

    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=8)
    with pytest.raises(InvalidArgumentError, match=r"events .* lacks on_all_cleared"):
        KVCacheManager(cfg, events=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"storage .* lacks block_bytes"):
        KVCacheManager(cfg, storage="disk")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"RetentionConfig\.ranges must be a sequence"):
        RetentionConfig(ranges=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.disk\.path must be a path"):
        DiskConfig(path=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="clock must be a callable"):
        CacheConfig(tokens_per_block=4, gpu_blocks=8, clock=5)  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="block_bytes_per_group must be a sequence"):
        MetadataStorage(4, None)  # type: ignore[arg-type]
    geometry = GroupGeometry(1, 1, 1)
    for geometries, slots, match in [(None, [[1]], "geometries must be a sequence"),
                                     ([geometry], None, "slots must be a sequence"),
                                     ([geometry], [None], r"slots\[0\] must be a sequence")]:
        with pytest.raises(GeometryError, match=match):
            TorchStorage(4, geometries, slots, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="disk_path must be a path"):
        TorchStorage(4, [geometry], [[1], [1], [1]], device="cpu", disk_path=5)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="device"):
        TorchStorage(4, [geometry], [[1]], device=2**70)  # type: ignore[arg-type]


def test_commit_after_a_split_finds_the_sequence_path_again() -> None:
    # a's committed blocks end inside the run that b's admission splits: a's next commit finds
    # its path again by tokens and extends it where it ends, not a block early
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=32))
    a = list(range(1, 13))
    m.add_sequence(SequenceRequest("a", a))
    m.store_context_blocks("a", 8)  # blocks 0-3 in one run
    m.add_sequence(SequenceRequest("b", [1, 2, 3, 4, 50, 51, 52]))
    m.store_context_blocks("b", 6)  # splits a's run after block 1
    m.store_context_blocks("a", 12)  # blocks 4-5 follow block 3
    m.check_invariants()
    assert m.count_reusable_tokens([*a, 99]) == 12
    assert m.count_reusable_tokens([1, 2, 3, 4, 50, 51, 99]) == 6
