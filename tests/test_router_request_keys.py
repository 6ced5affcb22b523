"""The router's v2 request keys: the memoized chain gives the keys of the plain one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.hashing import HashAlgo, request_block_hashes, tokens_to_u32
from kvpool.router.request_keys import ChainMemo, request_keys, v2_request_keys

_prefixes = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    prefixes=st.lists(_prefixes, min_size=1, max_size=3),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2**31 - 1), max_size=20),
                  st.sampled_from([None, "", "salt"])),
        min_size=1, max_size=12,
    ),
    tpb=st.sampled_from([1, 3, 4, 16]),
    steps=st.integers(1, 40),
    learn=st.integers(0, 5),
)
def test_memoized_keys_equal_the_published_hashes(
    prefixes: list[list[int]], requests: list[tuple[int, list[int], str | None]], tpb: int,
    steps: int, learn: int,
) -> None:
    """Requests sharing prefixes (some salted) through one small memo (generations rotate
    often): every request's keys equal request_block_hashes', and the memo stays bounded."""
    memo = ChainMemo(steps, learn)
    for which, tail, salt in requests:
        tokens = prefixes[which % len(prefixes)] + tail
        if not tokens:
            continue
        expected = request_block_hashes(tokens, tpb, HashAlgo.V2_SHA256_64, cache_salt=salt)
        toks = tokens_to_u32(tokens)
        assert v2_request_keys(toks, tpb, salt, memo) == expected
        assert v2_request_keys(toks, tpb, salt) == expected
        assert request_keys("v2", tpb, toks, salt, memo) == expected
        assert len(memo.young) < steps + max(learn, 1) + len(tokens) // tpb + 1
        assert len(memo.old) < steps + max(learn, 1) + 64


def test_a_shared_prefix_is_learned_a_few_steps_per_request() -> None:
    """A request remembers ``learn`` steps past its known prefix: the 8-block prefix of
    repeated prompts is known after two of them, an unshared tail adds at most ``learn``."""
    memo = ChainMemo(1000, learn=4)
    prefix = list(range(8 * 4))
    for tail, size in (([100], 4), ([200], 8), ([300], 9)):  # 8 shared blocks, a partial one
        toks = tokens_to_u32(prefix + tail + [7])  # the last token is not hashed
        v2_request_keys(toks, 4, None, memo)
        assert len(memo) == size
    keys = set(memo.young)
    v2_request_keys(tokens_to_u32([*prefix, 999, 7]), 4, None, memo)
    assert set(memo.young) - keys and len(memo.young) == len(keys) + 1


def test_generations_rotate_and_bound_the_memo() -> None:
    memo = ChainMemo(steps=5, learn=3)
    for i in range(20):
        v2_request_keys(tokens_to_u32([i] * 17), 4, None, memo)  # 4 blocks, 3 remembered
        assert len(memo.young) < 5 + 3 and len(memo.old) < 5 + 3
    with pytest.raises(ValueError):
        ChainMemo(0)
    with pytest.raises(ValueError):
        ChainMemo(4, learn=-1)
