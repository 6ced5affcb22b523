"""Offline hit-rate bounds: block keys of a workload, the unlimited cache and Belady's OPT."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgumentError
from kvpool.replay.bounds import (
    BlockStream,
    belady_hit_rate,
    request_block_keys,
    unlimited_hit_rate,
)
from kvpool.replay.workloads import Request, Workload, load_mooncake

# --------------------------------------------------------------------------------------------
# reference models, written independently of the implementation


def lru_hits(stream: list[list[int]], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for req in stream:
        for k in req:
            if k in cache:
                hits += 1
                cache.move_to_end(k)
                continue
            if capacity == 0:
                continue
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[k] = None
    return hits


def brute_force_hits(stream: list[list[int]], capacity: int, bypass: bool) -> int:
    """Most hits over every eviction choice (and, with bypass, every admission choice)."""
    flat = tuple(k for req in stream for k in req)

    @cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(flat):
            return 0
        x = flat[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)] if bypass or capacity == 0 else []
        if capacity > 0:
            if len(cache) < capacity:
                options.append(best(i + 1, cache | {x}))
            else:
                options.extend(best(i + 1, (cache - {y}) | {x}) for y in cache)
        return max(options)

    return best(0, frozenset())


def distinct(stream: list[list[int]]) -> int:
    return len({k for req in stream for k in req})


tiny_streams = st.lists(st.lists(st.integers(0, 4), max_size=4), max_size=4).filter(
    lambda s: sum(map(len, s)) <= 12
)
small_streams = st.lists(st.lists(st.integers(0, 30), max_size=12), max_size=25)


# --------------------------------------------------------------------------------------------
# Belady against the references


def test_textbook_reference_string() -> None:
    # Silberschatz et al., Operating System Concepts: 3 frames, OPT 9 faults, LRU 12 faults.
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    assert belady_hit_rate([refs], 3).hits == 20 - 9
    assert lru_hits([refs], 3) == 20 - 12
    assert unlimited_hit_rate([refs]).hits == 20 - 6  # six distinct pages


@given(tiny_streams, st.integers(0, 4))
def test_belady_equals_brute_force_optimum(stream: list[list[int]], capacity: int) -> None:
    assert belady_hit_rate(stream, capacity).hits == brute_force_hits(stream, capacity, False)
    assert belady_hit_rate(stream, capacity, bypass=True).hits == brute_force_hits(
        stream, capacity, True
    )


@given(small_streams, st.integers(0, 40))
def test_lru_le_belady_le_bypass_le_unlimited(stream: list[list[int]], capacity: int) -> None:
    opt = belady_hit_rate(stream, capacity)
    opt_bypass = belady_hit_rate(stream, capacity, bypass=True)
    unlimited = unlimited_hit_rate(stream)
    assert lru_hits(stream, capacity) <= opt.hits <= opt_bypass.hits <= unlimited.hits
    assert opt.accesses == opt_bypass.accesses == unlimited.accesses == sum(map(len, stream))


@given(small_streams, st.booleans())
def test_belady_is_monotone_in_capacity_and_reaches_unlimited(
    stream: list[list[int]], bypass: bool
) -> None:
    d = distinct(stream)
    hits = [belady_hit_rate(stream, c, bypass=bypass).hits for c in range(d + 2)]
    assert hits == sorted(hits)
    assert hits[0] == 0
    unlimited = unlimited_hit_rate(stream).hits
    assert hits[d] == hits[d + 1] == unlimited
    # unlimited: every access but the first of each key
    assert unlimited == sum(map(len, stream)) - d


def test_token_rates_count_hit_blocks_times_block_size() -> None:
    s = BlockStream.from_requests([[1, 2], [1, 2, 3], [4]], tokens_per_block=4,
                                  prompt_tokens=[9, 13, 6])
    u = unlimited_hit_rate(s)
    assert (u.hits, u.accesses, u.hit_tokens, u.prompt_tokens) == (2, 6, 8, 28)
    assert u.block_hit_rate == pytest.approx(2 / 6)
    assert u.token_hit_rate == pytest.approx(8 / 28)
    b = belady_hit_rate(s, 1)
    assert (b.hits, b.hit_tokens) == (0, 0)  # 1 slot: 1,2,1,2,3,4 never repeats back to back
    b2 = belady_hit_rate(s, 2)
    assert (b2.hits, b2.capacity_blocks, b2.policy) == (2, 2, "belady")
    assert b2.as_dict()["token_hit_rate"] == pytest.approx(8 / 28)


def test_empty_stream_has_zero_rates() -> None:
    for bound in (unlimited_hit_rate([]), belady_hit_rate([[], []], 3)):
        assert (bound.hits, bound.accesses) == (0, 0)
        assert bound.block_hit_rate == 0.0 and bound.token_hit_rate == 0.0


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        belady_hit_rate([[1]], -1)
    with pytest.raises(InvalidArgumentError, match="tokens_per_block"):
        BlockStream.from_requests([[1]], tokens_per_block=0)
    with pytest.raises(InvalidArgumentError, match="2\\*\\*64"):
        BlockStream.from_requests([[-1]])
    with pytest.raises(InvalidArgumentError, match="prompt_tokens"):
        BlockStream.from_requests([[1], [2]], prompt_tokens=[1])
    with pytest.raises(InvalidArgumentError, match="request 0"):
        BlockStream.from_requests([[1, 2]], tokens_per_block=4, prompt_tokens=[7])
    w = Workload("w", (Request("a", 0.0, array("I", [1, 2]), 1),))
    with pytest.raises(InvalidArgumentError, match="tokens_per_block"):
        request_block_keys(w, 0)


# --------------------------------------------------------------------------------------------
# block keys of a workload


def workload_of(*prompts: list[int], salts: list[str | None] | None = None) -> Workload:
    salts = salts or [None] * len(prompts)
    return Workload(
        "w",
        tuple(
            Request(f"r{i}", float(i), array("I", p), 1, cache_salt=s)
            for i, (p, s) in enumerate(zip(prompts, salts, strict=True))
        ),
    )


def test_keys_cover_full_blocks_of_the_prompt_minus_its_last_token() -> None:
    w = workload_of(list(range(33)), list(range(32)), [5], list(range(17)))
    s = request_block_keys(w, 16)
    assert [len(s.request(i)) for i in range(len(s))] == [2, 1, 0, 1]
    assert s.prompt_tokens.tolist() == [33, 32, 1, 17]
    assert s.tokens_per_block == 16
    # same leading tokens -> same leading keys
    assert s.request(1) == s.request(0)[:1] == s.request(3)


def test_keys_chain_on_the_prefix_and_the_salt() -> None:
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    w = workload_of(a + c + [0], b + c + [0], a + c + [0], a + c + [0], a + c + [0],
                    salts=[None, None, None, "tenant", "tenant"])
    s = request_block_keys(w, 8)
    k = [s.request(i) for i in range(5)]
    assert k[0][1] != k[1][1]  # same block tokens behind a different prefix
    assert k[0] == k[2]
    assert k[3] == k[4]
    assert not set(k[0]) & set(k[3])  # a salt is a reuse scope of its own


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(1, 6),
)
def test_leading_equal_keys_match_leading_equal_blocks(
    a: list[int], b: list[int], tpb: int
) -> None:
    s = request_block_keys(workload_of(a, b), tpb)
    ka, kb = s.request(0), s.request(1)
    assert len(ka) == (len(a) - 1) // tpb and len(kb) == (len(b) - 1) // tpb
    same_blocks = 0
    while (
        same_blocks < min(len(ka), len(kb))
        and a[: (same_blocks + 1) * tpb] == b[: (same_blocks + 1) * tpb]
    ):
        same_blocks += 1
    same_keys = 0
    while same_keys < min(len(ka), len(kb)) and ka[same_keys] == kb[same_keys]:
        same_keys += 1
    assert same_keys == same_blocks
    assert not set(ka[same_keys:]) & set(kb[same_keys:])


def test_bounds_of_a_mooncake_trace_follow_its_hash_ids(tmp_path: Path) -> None:
    # tokens_per_block == tokens_per_hash_id: block j of a request is keyed by its id prefix
    lines = [([0, 1, 2], 12), ([0, 1, 3], 11), ([0, 1, 2, 4], 13), ([5, 1], 8), ([0, 1], 5)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(
        f'{{"timestamp": {i}, "input_length": {n}, "output_length": 1, "hash_ids": {ids}}}\n'
        for i, (ids, n) in enumerate(lines)
    ))
    s = request_block_keys(load_mooncake(path, tokens_per_hash_id=4), 4)
    prefixes = [tuple(ids[: j + 1]) for ids, n in lines for j in range((n - 1) // 4)]
    assert s.accesses == len(prefixes)
    u = unlimited_hit_rate(s)
    assert u.hits == len(prefixes) - len(set(prefixes))
    assert u.prompt_tokens == sum(n for _, n in lines)
    assert belady_hit_rate(s, len(set(prefixes))).hits == u.hits
    # the same stream with the prefixes as keys gives the same bounds at every capacity
    by_prefix = {p: i for i, p in enumerate(dict.fromkeys(prefixes))}
    lists = [[by_prefix[tuple(ids[: j + 1])] for j in range((n - 1) // 4)] for ids, n in lines]
    for cap in range(len(by_prefix) + 1):
        assert belady_hit_rate(s, cap).hits == belady_hit_rate(lists, cap).hits
