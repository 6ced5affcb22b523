"""The router's v2 request keys: with a memo of known chains they are the keys of the plain
chain, whatever the memo holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.hashing.keys import HashAlgo, request_block_hashes, tokens_to_u32
from kvpool.router.request_keys import ChainMemo, request_keys, v2_request_keys

_ids = st.integers(0, 2**31 - 1)


@settings(max_examples=80, deadline=None)
@given(
    prefixes=st.lists(st.lists(_ids, max_size=40), min_size=1, max_size=3),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.lists(_ids, max_size=20),
                  st.sampled_from([None, "", "salt"]), st.sampled_from([1, 3, 4, 8, 16])),
        min_size=1, max_size=12,
    ),
    chains=st.integers(1, 4),
    blocks=st.integers(1, 12),
    max_bytes=st.integers(1, 200),
)
def test_memoized_keys_equal_the_published_hashes(
    prefixes: list[list[int]], requests: list[tuple[int, list[int], str | None, int]],
    chains: int, blocks: int, max_bytes: int,
) -> None:
    """Requests sharing prefixes (salted or not, of several block sizes) through one small
    memo (generations rotate, chains are cut short): every request's keys equal
    request_block_hashes', and the memo keeps its bounds."""
    memo = ChainMemo(chains, blocks, max_bytes)
    for which, tail, salt, tpb in requests:
        tokens = prefixes[which % len(prefixes)] + tail
        if not tokens:
            continue
        expected = request_block_hashes(tokens, tpb, HashAlgo.V2_SHA256_64, cache_salt=salt)
        toks = tokens_to_u32(tokens)
        assert v2_request_keys(toks, tpb, salt, memo) == expected
        assert v2_request_keys(toks, tpb, salt) == expected
        assert request_keys("v2", tpb, toks, salt, memo) == expected
        assert len(memo.young) < chains and len(memo.old) <= chains
        for (step, _), (raw, digests, keys) in [*memo.young.items(), *memo.old.items()]:
            assert len(digests) <= min(blocks, max(max_bytes // step, 1))
            assert len(raw) <= len(digests) * step
            assert keys == [int.from_bytes(d[:8], "big") for d in digests]


def test_a_request_takes_the_blocks_it_shares_with_the_last_chain_of_its_first_block() -> None:
    memo = ChainMemo()
    prefix = list(range(40))  # 10 blocks of 4
    v2_request_keys(tokens_to_u32([*prefix, 1, 2, 3, 4, 5, 9]), 4, None, memo)
    (first, (_, digests, keys)), = memo.young.items()
    assert len(digests) == 12  # 11 whole blocks and a partial one
    raw = tokens_to_u32([*prefix, 1, 2, 3, 7, 8]).tobytes()
    assert memo.known(first, raw, 12) == (digests[:10], keys[:10])  # block 11 differs
    assert memo.known(first, raw[:12], 1) == ([], [])  # a partial first block is another block
    assert memo.known(first, raw[:16], 1) == (digests[:1], keys[:1])
    assert memo.known((first[0] * 2, first[1]), raw, 12) == ([], [])  # another block size
    again = v2_request_keys(tokens_to_u32([*prefix, 1, 2, 3, 7, 8]), 4, None, memo)
    assert len(memo.young) == 1 and len(memo.young[first][1]) == 11  # the newest chain
    assert all(a is b for a, b in zip(again[:10], keys, strict=False))  # the same int objects


def test_generations_rotate_and_bound_the_memo() -> None:
    memo = ChainMemo(chains=3, blocks=2, max_bytes=1000)
    for i in range(10):
        v2_request_keys(tokens_to_u32([i] * 17), 4, None, memo)  # 4 blocks, 2 kept
        assert len(memo.young) < 3 and len(memo.old) <= 3
        assert all(len(d) == 2 == len(k) and len(r) == 32 for r, d, k in memo.young.values())
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            ChainMemo(*bad)


def test_long_requests_past_the_cached_structs() -> None:
    """Over 256 blocks the blocks are cut and read in a loop; the memo keeps 256 of them."""
    memo = ChainMemo()
    tokens = list(range(1000, 1600))
    expected = request_block_hashes(tokens, 1, HashAlgo.V2_SHA256_64)
    assert len(expected) == 599
    for _ in range(2):
        assert v2_request_keys(tokens_to_u32(tokens), 1, None, memo) == expected
    assert [(len(d), len(k)) for _, d, k in memo.young.values()] == [(256, 256)]
