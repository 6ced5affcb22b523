"""Tests of kvpool.hashing.keys: golden vectors, an independent reference, properties, errors.

The reference below is written from the pseudo-code of COMPATIBILITY.md §1 with plain loops,
``struct`` and ``hashlib``; its CBOR is encoded by hand (RFC 8949 heads), so nothing here calls
the implementation to compute an expected value.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import subprocess
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import cbor2
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvpool.errors import (
    InvalidArgumentError,
    InvalidTokenError,
    KVPoolError,
    UnknownHashAlgorithmError,
)
from kvpool.hashing import jit
from kvpool.hashing.keys import (
    BlockHasher,
    HashAlgo,
    cache_salt_id,
    event_hash,
    request_block_hashes,
    tokens_to_u32,
    v1_block_key,
    v1_block_keys,
    v2_block_key,
    v2_root_key,
    validate_tokens,
    vllm_event_int,
    vllm_none_hash,
    vllm_sha256_cbor_block_hash,
)

# Every test of this module runs on both v1 backends: numba's kernel (when the jit extra is
# installed) and the pure-Python chain, each against the reference below.
BACKENDS = ["jit", "python"] if jit.backend() != "python" else ["python"]


@pytest.fixture(autouse=True, scope="module", params=BACKENDS)
def v1_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    jit.set_enabled(request.param == "jit")
    try:
        yield request.param
    finally:
        jit.set_enabled(True)


# ---------------------------------------------------------------------------------------------
# the reference (COMPATIBILITY.md §1, transcribed)

M64 = (1 << 64) - 1
C32, C64A, C64B, K = 0x045D9F3B, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B9
TRT_ALGOS = (HashAlgo.V1_BLOCK_KEY, HashAlgo.V2_SHA256, HashAlgo.V2_SHA256_64)


def ref_mix32(v: int, seed: int) -> int:
    v = (((v >> 16) ^ v) * C32) & 0xFFFFFFFF
    v = (((v >> 16) ^ v) * C32) & 0xFFFFFFFF
    v = ((v >> 16) ^ v) & 0xFFFFFFFF
    v = (v + K) & 0xFFFFFFFF
    return seed ^ ((v + (seed << 6) + (seed >> 2)) & M64)


def ref_mix64(v: int, seed: int) -> int:
    v = ((v ^ (v >> 30)) * C64A) & M64
    v = ((v ^ (v >> 27)) * C64B) & M64
    v = v ^ (v >> 31)
    return seed ^ ((v + K + (seed << 6) + (seed >> 2)) & M64)


def ref_v1(tokens: list[int], parent: int = 0, lora: int | None = None,
           salt: int | None = None) -> int:
    seed = len(tokens) ^ ((parent * C64A) & M64)
    if parent == 0 and salt is not None:
        seed = ref_mix64(salt, seed)
    for t in tokens:
        seed = ref_mix32(t, seed)
    if lora is not None:
        seed = ref_mix64(lora, seed)
    return seed


def ref_salt_id(salt: str) -> int:
    return int.from_bytes(hashlib.sha256(salt.encode("utf-8")).digest()[:8], "little")


def ref_scope_bytes(lora: int | None, salt: int | None) -> bytes:
    mask = (1 if lora is not None else 0) | (2 if salt is not None else 0)
    out = bytes([mask])
    if lora is not None:
        out += struct.pack("<Q", lora)
    if salt is not None:
        out += struct.pack("<Q", salt)
    return out


def ref_v2_root(lora: int | None = None, salt: int | None = None) -> bytes:
    return hashlib.sha256(ref_scope_bytes(lora, salt)).digest()


def ref_v2_block(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def cbor_head(major: int, n: int) -> bytes:
    """An RFC 8949 head in its shortest form (the canonical one)."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 1 << 8:
        return bytes([major << 5 | 24, n])
    if n < 1 << 16:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes([major << 5 | 26]) + struct.pack(">I", n)
    return bytes([major << 5 | 27]) + struct.pack(">Q", n)


def cbor(obj: object) -> bytes:
    if obj is None:
        return b"\xf6"
    if isinstance(obj, int) and obj >= 0:
        return cbor_head(0, obj)
    if isinstance(obj, bytes):
        return cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return cbor_head(3, len(raw)) + raw
    if isinstance(obj, list | tuple):
        return cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(obj)


REF_NONE_HASH = hashlib.sha256(cbor("vllm-none-hash")).digest()


def ref_vllm_block(parent: bytes | None, tokens: list[int], extra: tuple[str, ...] | None) -> bytes:
    return hashlib.sha256(cbor([parent or REF_NONE_HASH, tokens, extra])).digest()


def ref_vllm_extra(index: int, lora: int | None, salt: str | None) -> tuple[str, ...] | None:
    """vLLM's order: the LoRA (adapter name; kvpool: the id in decimal), then the salt on
    block 0 only; no keys at all is null."""
    keys: list[str] = []
    if lora is not None:
        keys.append(str(lora))
    if salt is not None and index == 0:
        keys.append(salt)
    return tuple(keys) or None


def ref_chain(algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None = None,
              lora: int | None = None, partial: bool = True) -> list[int | bytes]:
    """Tree keys of ``tokens`` cut into chunks of tpb (a trailing partial chunk if ``partial``)."""
    chunks = [tokens[i:i + tpb] for i in range(0, len(tokens), tpb)]
    if chunks and len(chunks[-1]) < tpb and not partial:
        chunks.pop()
    salt_id = ref_salt_id(salt) if salt is not None else None
    keys: list[int | bytes] = []
    if algo is HashAlgo.V1_BLOCK_KEY:
        p = 0
        for c in chunks:
            p = ref_v1(c, p, lora, salt_id)
            keys.append(p)
    elif algo is HashAlgo.VLLM_SHA256_CBOR:
        pb: bytes | None = None
        for i, c in enumerate(chunks):
            pb = ref_vllm_block(pb, c, ref_vllm_extra(i, lora, salt))
            keys.append(pb)
    else:
        pb2 = ref_v2_root(lora, salt_id)
        for c in chunks:
            pb2 = ref_v2_block(pb2, c)
            keys.append(pb2)
    return keys


def ref_event(algo: HashAlgo, key: int | bytes) -> int | str:
    if isinstance(key, int):
        return key
    if algo is HashAlgo.V2_SHA256:
        return key.hex()
    if algo is HashAlgo.V2_SHA256_64:
        return struct.unpack(">Q", key[:8])[0]  # type: ignore[no-any-return]
    return struct.unpack(">Q", key[24:])[0]  # type: ignore[no-any-return]


def ref_request(algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None = None,
                lora: int | None = None) -> list[int | str]:
    body = tokens[:-1]
    keys = ref_chain(algo, body, tpb, salt, lora, partial=algo is not HashAlgo.VLLM_SHA256_CBOR)
    return [ref_event(algo, k) for k in keys]


# ---------------------------------------------------------------------------------------------
# golden vectors (COMPATIBILITY.md §1)

V1_FIRST = 924206229973855
V1_SECOND = 6875034662206558884
V2_ROOT = "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
V2_BLOCK = "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073"
VLLM_NONE = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_BLOCK0 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"


def test_v1_vectors() -> None:
    assert v1_block_key([1, 2, 3, 4]) == V1_FIRST
    assert v1_block_key([5, 6], parent_hash=V1_FIRST) == V1_SECOND
    assert v1_block_keys([1, 2, 3, 4, 5, 6], 4) == [V1_FIRST, V1_SECOND]
    hasher = BlockHasher(HashAlgo.V1_BLOCK_KEY, 4)
    assert hasher.extend([1, 2, 3, 4, 5, 6]) == [V1_FIRST]
    assert hasher.partial_key() == V1_SECOND
    # the router view of the prompt [1..6, x]: a full block and a trailing partial one
    assert request_block_hashes([1, 2, 3, 4, 5, 6, 99], 4, "v1_block_key") == [V1_FIRST, V1_SECOND]


def test_v2_vectors() -> None:
    root = v2_root_key()
    assert root.hex() == V2_ROOT
    assert v2_block_key(root, [1, 2, 3, 4]).hex() == V2_BLOCK
    assert BlockHasher.root_key(HashAlgo.V2_SHA256) == root
    assert BlockHasher(HashAlgo.V2_SHA256, 4).extend([1, 2, 3, 4]) == [bytes.fromhex(V2_BLOCK)]
    assert request_block_hashes([1, 2, 3, 4, 5], 4, "v2_sha256") == [V2_BLOCK]
    assert request_block_hashes([1, 2, 3, 4, 5], 4, "v2_sha256_64") == [int(V2_BLOCK[:16], 16)]


def test_vllm_vectors() -> None:
    assert vllm_none_hash().hex() == VLLM_NONE
    block0 = vllm_sha256_cbor_block_hash(None, list(range(16)))
    assert block0.hex() == VLLM_BLOCK0
    assert vllm_sha256_cbor_block_hash(bytes.fromhex(VLLM_NONE), range(16)) == block0
    assert vllm_event_int(block0) == int(VLLM_BLOCK0[-16:], 16)
    assert BlockHasher("vllm_sha256_cbor", 16).extend(list(range(16))) == [block0]
    # 17 tokens: one full block of the prompt minus its last token
    assert request_block_hashes(list(range(17)), 16, "vllm_sha256_cbor") == [
        int(VLLM_BLOCK0[-16:], 16)
    ]
    # 16 tokens: 15 hashed, no full block
    assert request_block_hashes(list(range(16)), 16, "vllm_sha256_cbor") == []


@pytest.mark.parametrize("salt", ["", "tenant-a", "ünïcødé ✓", "x" * 1000])
def test_salt_id_definition(salt: str) -> None:
    expected = int.from_bytes(hashlib.sha256(salt.encode("utf-8")).digest()[:8], "little")
    assert cache_salt_id(salt) == expected
    assert 0 <= expected <= M64


def test_reference_reproduces_vectors() -> None:
    """The reference itself is checked against the vectors, so agreement with it means
    agreement with the engines."""
    assert ref_v1([1, 2, 3, 4]) == V1_FIRST
    assert ref_v1([5, 6], V1_FIRST) == V1_SECOND
    assert ref_v2_root().hex() == V2_ROOT
    assert ref_v2_block(ref_v2_root(), [1, 2, 3, 4]).hex() == V2_BLOCK
    assert REF_NONE_HASH.hex() == VLLM_NONE
    assert ref_vllm_block(None, list(range(16)), None).hex() == VLLM_BLOCK0


# ---------------------------------------------------------------------------------------------
# chained, salted and LoRA cases against the reference

tokens_st = st.lists(
    st.one_of(st.integers(0, 300), st.integers(0, 2**31 - 1)), min_size=0, max_size=80
)
tpb_st = st.sampled_from([1, 2, 3, 4, 5, 8, 16])
salt_st = st.one_of(st.none(), st.text(max_size=12))
lora_st = st.one_of(st.none(), st.integers(0, M64))
algo_st = st.sampled_from(list(HashAlgo))


def extend_in_pieces(hasher: BlockHasher, tokens: list[int], data: st.DataObject, *,
                     max_cuts: int) -> list[Any]:
    """``hasher.extend`` over ``tokens`` cut at up to ``max_cuts`` drawn places; the keys the
    calls returned, in order."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=max_cuts)))
    returned: list[Any] = []
    for start, stop in zip([0, *cuts], [*cuts, len(tokens)], strict=True):
        returned += hasher.extend(tokens[start:stop])
    return returned


@pytest.mark.parametrize(
    ("salt", "lora"), [(None, None), ("s", None), (None, 7), ("tenant", 2**64 - 1), ("", 0)]
)
@pytest.mark.parametrize("algo", list(HashAlgo))
def test_scoped_chains_match_reference(algo: HashAlgo, salt: str | None, lora: int | None) -> None:
    tokens = [(i * 7919) % 2**31 for i in range(1, 42)] + [2**31 - 1, 0, 128_000]
    tpb = 8
    expected = ref_chain(algo, tokens, tpb, salt, lora)
    hasher = BlockHasher(algo, tpb, lora_id=lora, cache_salt=salt)
    assert hasher.extend(tokens) == expected[:-1]
    assert hasher.keys == expected[:-1]
    assert hasher.partial_key() == expected[-1]
    assert request_block_hashes(tokens, tpb, algo, cache_salt=salt, lora_id=lora) == ref_request(
        algo, tokens, tpb, salt, lora
    )
    salt_id = ref_salt_id(salt) if salt is not None else None
    if algo is HashAlgo.V1_BLOCK_KEY:
        assert v1_block_keys(tokens, tpb, lora_id=lora, salt_id=salt_id) == expected
        assert v1_block_key(tokens[:tpb], lora_id=lora, salt_id=salt_id) == expected[0]
        assert v1_block_key(tokens[tpb:2 * tpb], expected[0], lora_id=lora,
                            salt_id=salt_id) == expected[1]
    elif algo is HashAlgo.VLLM_SHA256_CBOR:
        assert vllm_sha256_cbor_block_hash(
            None, tokens[:tpb], ref_vllm_extra(0, lora, salt)
        ) == expected[0]
        parent = expected[0]
        assert isinstance(parent, bytes)
        assert vllm_sha256_cbor_block_hash(
            parent, tokens[tpb:2 * tpb], ref_vllm_extra(1, lora, salt)
        ) == expected[1]
    else:
        root = v2_root_key(lora_id=lora, salt_id=salt_id)
        assert root == ref_v2_root(lora, salt_id)
        assert v2_block_key(root, tokens[:tpb]) == expected[0]


@given(algo=algo_st, tokens=tokens_st, tpb=tpb_st, salt=salt_st, lora=lora_st)
def test_request_block_hashes_match_reference(
    algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None, lora: int | None
) -> None:
    got = request_block_hashes(tokens, tpb, algo, cache_salt=salt, lora_id=lora)
    assert got == ref_request(algo, tokens, tpb, salt, lora)


@given(algo=algo_st, tokens=tokens_st, tpb=tpb_st, salt=salt_st, lora=lora_st)
def test_block_hasher_matches_reference(
    algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None, lora: int | None
) -> None:
    hasher = BlockHasher(algo, tpb, lora_id=lora, cache_salt=salt)
    keys = hasher.extend(tokens)
    expected = ref_chain(algo, tokens, tpb, salt, lora)
    n_full = len(tokens) // tpb
    assert keys == expected[:n_full] == hasher.keys
    assert hasher.partial_key() == (expected[n_full] if len(tokens) % tpb else None)
    assert [event_hash(algo, k) for k in keys] == [ref_event(algo, k) for k in expected[:n_full]]


@given(algo=algo_st, tokens=tokens_st, tpb=tpb_st, salt=salt_st, lora=lora_st)
def test_block_hasher_given_its_root_key_chains_the_same(
    algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None, lora: int | None
) -> None:
    salt_id = cache_salt_id(salt) if salt is not None else None
    root = BlockHasher.root_key(algo, lora_id=lora, salt_id=salt_id)
    given_root = BlockHasher(algo, tpb, lora_id=lora, cache_salt=salt, root=root)
    expected = ref_chain(algo, tokens, tpb, salt, lora)[:len(tokens) // tpb]
    assert given_root.extend(tokens) == expected
    other: int | bytes = 1 if algo is HashAlgo.V1_BLOCK_KEY else b"\x01" * 32
    elsewhere = BlockHasher(algo, tpb, lora_id=lora, cache_salt=salt, root=other)
    assert not expected or elsewhere.extend(tokens)[0] != expected[0], "the root was ignored"


def test_vllm_extra_keys_encode_as_canonical_cbor() -> None:
    extra = ("adapter", "salt ✓", 5, None, b"\x00\x01")
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1]
    expected = hashlib.sha256(cbor([REF_NONE_HASH, tokens, extra])).digest()
    assert vllm_sha256_cbor_block_hash(None, tokens, list(extra)) == expected
    # vLLM passes None when there are no extra keys; an empty sequence means the same
    assert vllm_sha256_cbor_block_hash(None, tokens, []) == ref_vllm_block(None, tokens, None)


# Token ids at the edges of CBOR's width classes (1, 2, 3 and 5 bytes: below 24, 2**8, 2**16,
# 2**32), of kvpool's range and of the v1 premix table (2**18).
CBOR_EDGES = [0, 1, 22, 23, 24, 25, 254, 255, 256, 257, 65_534, 65_535, 65_536, 65_537,
              2**18 - 1, 2**18, 2**24, 2**31 - 2, 2**31 - 1]
edge_tokens_st = st.lists(
    st.one_of(st.sampled_from(CBOR_EDGES), st.integers(0, 2**31 - 1)), max_size=120
)


def test_reference_cbor_matches_cbor2_at_width_boundaries() -> None:
    """The hand-written reference CBOR agrees with cbor2 (what vLLM uses) where widths change:
    token ids, and array heads (block sizes)."""
    for n in [*CBOR_EDGES, 2**32 - 1]:
        assert cbor(n) == cbor2.dumps(n, canonical=True), n
    for size in [0, 1, 23, 24, 255, 256, 65_535, 65_536]:
        items = [size % 300] * size
        assert cbor(items) == cbor2.dumps(items, canonical=True), size


@pytest.mark.parametrize("tpb", [1, 5, 23, 24, 32, 255, 256, 300])
@pytest.mark.parametrize(("salt", "lora"), [(None, None), ("tenant", None), ("s", 3)])
def test_vllm_every_id_near_the_width_boundaries(
    tpb: int, salt: str | None, lora: int | None
) -> None:
    """Every id within 150 of a width boundary, at every position of a block, chained over
    many blocks (block sizes include the array-head boundaries 24 and 256)."""
    tokens = [*range(0, 300), *range(65_386, 65_686), *range(2**31 - 300, 2**31)]
    tokens += tokens[::-1][: tpb // 2 + 1]  # a partial last block
    algo = HashAlgo.VLLM_SHA256_CBOR
    expected = ref_chain(algo, tokens, tpb, salt, lora)
    hasher = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    n_full = len(tokens) // tpb
    assert hasher.extend(tokens) == expected[:n_full]
    assert hasher.partial_key() == (expected[n_full] if len(tokens) % tpb else None)
    assert request_block_hashes(tokens, tpb, algo, cache_salt=salt, lora_id=lora) == ref_request(
        algo, tokens, tpb, salt, lora
    )


@given(algo=algo_st, tokens=edge_tokens_st, tpb=st.sampled_from([1, 2, 3, 23, 24, 25, 32]),
       salt=salt_st, lora=lora_st, data=st.data())
def test_width_boundary_tokens_match_reference(
    algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None, lora: int | None,
    data: st.DataObject,
) -> None:
    """Chained over several blocks, fed in pieces, with and without salt and LoRA."""
    hasher = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    returned = extend_in_pieces(hasher, tokens, data, max_cuts=4)
    expected = ref_chain(algo, tokens, tpb, salt, lora)
    n_full = len(tokens) // tpb
    assert returned == expected[:n_full]
    assert hasher.partial_key() == (expected[n_full] if len(tokens) % tpb else None)
    got = request_block_hashes(tokens, tpb, algo, cache_salt=salt, lora_id=lora)
    assert got == ref_request(algo, tokens, tpb, salt, lora)


@given(tokens=edge_tokens_st, tpb=st.sampled_from([1, 4, 24, 32]), salt=salt_st, lora=lora_st)
def test_vllm_chain_matches_cbor2_block_by_block(
    tokens: list[int], tpb: int, salt: str | None, lora: int | None
) -> None:
    """A second oracle: each block hashed on its own, encoded whole by cbor2."""
    hasher = BlockHasher(HashAlgo.VLLM_SHA256_CBOR, tpb, cache_salt=salt, lora_id=lora)
    keys = hasher.extend(tokens)
    parent: bytes | None = None
    for i, key in enumerate(keys):
        block = tokens[i * tpb:(i + 1) * tpb]
        extra = ref_vllm_extra(i, lora, salt)
        payload = [parent or REF_NONE_HASH, block, extra]
        assert key == hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        assert key == vllm_sha256_cbor_block_hash(parent, block, extra)
        parent = key


@pytest.mark.parametrize("lora", [None, 0, 2**64 - 1])
def test_v1_premix_table_and_computed_paths_agree(lora: int | None) -> None:
    """Ids below 2**18 are premixed from a table, a call with a larger id computes them all;
    both agree with the reference, including 64-bit wrap-around of parents and LoRA ids."""
    small = [(i * 40_503) % 2**18 for i in range(200)] + [0, 23, 24, 2**18 - 1]
    large = [*small, 2**31 - 1]
    tpb = 17
    salt = ref_salt_id("tenant")
    a = v1_block_keys(small, tpb, lora_id=lora, salt_id=salt)
    b = v1_block_keys(large, tpb, lora_id=lora, salt_id=salt)
    n_full = len(small) // tpb
    assert a[:n_full] == b[:n_full] == ref_chain(
        HashAlgo.V1_BLOCK_KEY, small, tpb, "tenant", lora
    )[:n_full]
    assert b == ref_chain(HashAlgo.V1_BLOCK_KEY, large, tpb, "tenant", lora)
    parent = M64  # the largest parent: parent * C64a wraps
    assert v1_block_key(large[:tpb], parent, lora_id=lora) == ref_v1(large[:tpb], parent, lora)
    assert v1_block_key(small[:tpb], parent, lora_id=lora) == ref_v1(small[:tpb], parent, lora)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_other_token_containers_hash_like_lists(algo: HashAlgo) -> None:
    tokens = [5, 0, 2**31 - 1, 300_000, 17, 9, 4]
    expected = request_block_hashes(tokens, 2, algo)
    assert expected == ref_request(algo, tokens, 2)
    for other in (tuple(tokens), array("I", tokens), array("q", tokens),
                  np.array(tokens, dtype=np.int64), np.array(tokens, dtype=">u4"),
                  iter(tokens), range(0)):
        want = expected if not isinstance(other, range) else []
        assert request_block_hashes(other, 2, algo) == want  # type: ignore[arg-type]


@given(n_blocks=st.integers(0, 9), tail=st.integers(0, 4), tpb=st.sampled_from([1, 5, 32]),
       data=st.data())
def test_v2_chain_cut_in_c_or_sliced_matches_reference(
    n_blocks: int, tail: int, tpb: int, data: st.DataObject
) -> None:
    """From a few whole blocks on, v2 cuts them with struct.iter_unpack instead of slicing;
    both sides of that threshold, with and without a partial block, equal the reference."""
    tail %= tpb
    tokens = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n_blocks * tpb + tail,
                                max_size=n_blocks * tpb + tail))
    expected = ref_chain(HashAlgo.V2_SHA256, tokens, tpb)
    hasher = BlockHasher(HashAlgo.V2_SHA256, tpb)
    assert hasher.extend(tokens) == expected[:n_blocks]
    assert hasher.partial_key() == (expected[-1] if tail else None)
    for algo in (HashAlgo.V2_SHA256, HashAlgo.V2_SHA256_64):
        assert request_block_hashes([*tokens, 7], tpb, algo) == ref_request(
            algo, [*tokens, 7], tpb
        )


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_long_inputs_are_checked_like_short_ones(algo: HashAlgo) -> None:
    """Inputs of more than 4,096 tokens are range-checked by numpy instead of a byte scan."""
    tokens = [(i * 40_503) % 2**31 for i in range(5_000)]
    tokens[4_321] = 2**31 - 1
    assert request_block_hashes(tokens, 16, algo) == ref_request(algo, tokens, 16)
    for bad in (2**31, 2**32 - 1):
        tokens[4_321] = bad
        with pytest.raises(InvalidTokenError, match=rf"position 4321 is {bad}\b"):
            request_block_hashes(tokens, 16, algo)
        with pytest.raises(InvalidTokenError, match=rf"position 4321 is {bad}\b"):
            BlockHasher(algo, 16).extend(tokens)


# ---------------------------------------------------------------------------------------------
# properties


@st.composite
def chained_case(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    tpb = draw(st.sampled_from([1, 2, 4, 5, 16]))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6 * tpb))
    pos = draw(st.integers(0, len(tokens) - 1))
    new = draw(st.integers(0, 2**31 - 1).filter(lambda t: t != tokens[pos]))
    return tokens, tpb, pos, new


@given(algo=algo_st, case=chained_case(), salt=salt_st)
def test_changing_a_token_changes_its_block_and_every_later_one(
    algo: HashAlgo, case: tuple[list[int], int, int, int], salt: str | None
) -> None:
    tokens, tpb, pos, new = case
    changed = [*tokens[:pos], new, *tokens[pos + 1:]]
    a = BlockHasher(algo, tpb, cache_salt=salt)
    b = BlockHasher(algo, tpb, cache_salt=salt)
    ka = [*a.extend(tokens), a.partial_key()]
    kb = [*b.extend(changed), b.partial_key()]
    first = pos // tpb
    assert ka[:first] == kb[:first]
    assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True) if x is not None)


scope_st = st.tuples(salt_st, lora_st)


@given(algo=algo_st, tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
       tpb=tpb_st, s1=scope_st, s2=scope_st)
@example(algo=HashAlgo.VLLM_SHA256_CBOR, tokens=[1, 2, 3], tpb=2, s1=("5", None), s2=(None, 5))
def test_scopes_are_isolated(
    algo: HashAlgo, tokens: list[int], tpb: int,
    s1: tuple[str | None, int | None], s2: tuple[str | None, int | None],
) -> None:
    if s1 == s2:
        return
    a = BlockHasher(algo, tpb, cache_salt=s1[0], lora_id=s1[1])
    b = BlockHasher(algo, tpb, cache_salt=s2[0], lora_id=s2[1])
    ka = [*a.extend(tokens), a.partial_key()]
    kb = [*b.extend(tokens), b.partial_key()]
    first = 0
    if algo is HashAlgo.VLLM_SHA256_CBOR and (
        ref_vllm_extra(0, s1[1], s1[0]) == ref_vllm_extra(0, s2[1], s2[0])
    ):
        # vLLM's own blind spot, reproduced bit for bit: salt "5" without LoRA and LoRA "5"
        # without salt give block 0 the same extra keys; the LoRA still separates later blocks.
        assert ka[0] == kb[0]
        first = 1
    assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True) if x is not None)
    if s1[1] is None and s2[1] is None:  # the router's view (no LoRA) is isolated by salt too
        ra = request_block_hashes([*tokens, 1], tpb, algo, cache_salt=s1[0])
        rb = request_block_hashes([*tokens, 1], tpb, algo, cache_salt=s2[0])
        assert all(x != y for x, y in zip(ra, rb, strict=True))


@given(algo=algo_st, tokens=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=16),
       data=st.data())
def test_partial_block_differs_from_full_block(
    algo: HashAlgo, tokens: list[int], data: st.DataObject
) -> None:
    tpb = len(tokens)
    k = data.draw(st.integers(1, tpb - 1))
    hasher = BlockHasher(algo, tpb)
    assert hasher.extend(tokens[:k]) == []
    partial = hasher.partial_key()
    assert partial == hasher.key_of_prefix_block(tokens[:k])
    (full,) = hasher.extend(tokens[k:])
    assert partial != full
    assert hasher.partial_key() is None


@given(algo=algo_st, tokens=tokens_st, tpb=tpb_st, salt=salt_st, lora=lora_st, data=st.data())
def test_incremental_equals_one_shot(
    algo: HashAlgo, tokens: list[int], tpb: int, salt: str | None, lora: int | None,
    data: st.DataObject,
) -> None:
    one_shot = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    one_shot.extend(tokens)
    inc = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    returned = extend_in_pieces(inc, tokens, data, max_cuts=8)
    assert returned == inc.keys == one_shot.keys
    assert inc.partial_key() == one_shot.partial_key()
    assert inc.pending_tokens == len(tokens) % tpb


class Resume(NamedTuple):
    """A hasher fed ``tokens`` whole, the block ``k`` a resumed hasher starts after, and a
    prototype with the same settings fed any prefix of the tokens, or nothing."""

    tokens: list[int]
    tpb: int
    full: BlockHasher
    k: int
    proto: BlockHasher


@st.composite
def resumes(draw: st.DrawFn) -> Resume:
    algo, tokens, tpb = draw(algo_st), draw(tokens_st), draw(tpb_st)
    salt, lora = draw(salt_st), draw(lora_st)
    full = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    full.extend(tokens)
    k = draw(st.integers(0, len(full.keys)))
    proto = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
    if draw(st.booleans()):
        proto.extend(tokens[: draw(st.integers(0, len(tokens)))])
    return Resume(tokens, tpb, full, k, proto)


@given(case=resumes())
def test_resumed_continues_like_resume(case: Resume) -> None:
    # a forked hasher (the manager's per-commit hasher) chains exactly like a fresh hasher
    # resumed after the same keys, from a prototype whatever was fed to it before
    tokens, tpb, full, k, proto = case
    forked = proto.resumed(full.keys[:k])
    assert forked.extend(tokens[k * tpb:]) == full.keys[k:]
    assert forked.keys == full.keys
    assert forked.partial_key() == full.partial_key()


@given(case=resumes(), data=st.data())
def test_keys_after_chains_like_a_resumed_hasher(case: Resume, data: st.DataObject) -> None:
    # keys_after (the manager's commit: raw token bytes, no hasher per call) gives the keys a
    # resumed hasher's extend gives, whatever was fed to the prototype before
    tokens, tpb, full, k, proto = case
    upto = data.draw(st.integers(k, len(full.keys)))
    raw = array("I", tokens[k * tpb:upto * tpb]).tobytes()
    assert proto.keys_after(full.keys[:k], raw) == full.keys[k:upto]
    if raw:
        with pytest.raises(InvalidArgumentError):
            proto.keys_after(full.keys[:k], raw[:-1])


@given(algo=algo_st, n=st.integers(0, 70), tpb=tpb_st)
def test_request_block_hashes_structure(algo: HashAlgo, n: int, tpb: int) -> None:
    tokens = [(i * 31 + 7) % 50_000 for i in range(n)]
    hashes = request_block_hashes(tokens, tpb, algo)
    body = max(n - 1, 0)
    if algo is HashAlgo.VLLM_SHA256_CBOR:
        assert len(hashes) == body // tpb
    else:
        assert len(hashes) == math.ceil(body / tpb)
    for h in hashes:
        if algo is HashAlgo.V2_SHA256:
            assert isinstance(h, str)
            assert re.fullmatch("[0-9a-f]{64}", h)
        else:
            assert isinstance(h, int)
            assert not isinstance(h, bool)
            assert 0 <= h <= M64
    if algo is HashAlgo.V2_SHA256:
        as64 = request_block_hashes(tokens, tpb, HashAlgo.V2_SHA256_64)
        assert as64 == [int(str(h)[:16], 16) for h in hashes]
    # the last token of the prompt is never hashed
    if tokens:
        assert request_block_hashes([*tokens[:-1], tokens[-1] + 1], tpb, algo) == hashes


class BlockHasherMachine(RuleBasedStateMachine):
    """A hasher fed arbitrary pieces (and rejected bad ones) always equals the reference over
    everything it accepted."""

    def __init__(self) -> None:
        super().__init__()
        self.fed: list[int] = []

    @initialize(algo=algo_st, tpb=tpb_st, salt=salt_st, lora=lora_st)
    def start(self, algo: HashAlgo, tpb: int, salt: str | None, lora: int | None) -> None:
        self.args = (algo, tpb, salt, lora)
        self.hasher = BlockHasher(algo, tpb, cache_salt=salt, lora_id=lora)
        self.returned: list[int | bytes] = []

    @rule(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=12))
    def extend(self, tokens: list[int]) -> None:
        self.returned += self.hasher.extend(tokens)
        self.fed += tokens

    @rule(good=st.lists(st.integers(0, 100), max_size=5),
          bad=st.sampled_from([-1, 2**31, 2**32, 1.5, "3", None]))
    def extend_bad(self, good: list[int], bad: object) -> None:
        with pytest.raises(InvalidTokenError):
            self.hasher.extend([*good, bad])  # type: ignore[list-item]

    @invariant()
    def matches_reference(self) -> None:
        algo, tpb, salt, lora = self.args
        expected = ref_chain(algo, self.fed, tpb, salt, lora)
        n_full = len(self.fed) // tpb
        assert self.hasher.keys == self.returned == expected[:n_full]
        assert self.hasher.pending_tokens == len(self.fed) - n_full * tpb
        assert self.hasher.partial_key() == (expected[-1] if len(self.fed) % tpb else None)


def test_block_hasher_machine(v1_backend: str) -> None:
    """Run as a function (not the machine's unittest TestCase) so that it takes the backend
    fixture. Each step re-derives every key from scratch with the (slow) reference; 20 steps
    are plenty."""
    run_state_machine_as_test(BlockHasherMachine, settings=settings(stateful_step_count=20))


# ---------------------------------------------------------------------------------------------
# errors

BAD_TOKENS = [-1, 2**31, 2**32, 2**70, 1.5, 2.0, "7", None, np.float64(3.0), b"x", [1]]

TokenPath = Callable[[Any], object]


def _request_path(algo: HashAlgo) -> TokenPath:
    return lambda t: request_block_hashes(t, 4, algo)


def _extend_path(algo: HashAlgo) -> TokenPath:
    return lambda t: BlockHasher(algo, 4).extend(t)


TOKEN_PATHS: dict[str, TokenPath] = {
    "tokens_to_u32": lambda t: tokens_to_u32(t),
    "validate_tokens": lambda t: validate_tokens(t),
    "v1_block_key": lambda t: v1_block_key(t),
    "v1_block_keys": lambda t: v1_block_keys(t, 4),
    "v2_block_key": lambda t: v2_block_key(v2_root_key(), t),
    "vllm_sha256_cbor_block_hash": lambda t: vllm_sha256_cbor_block_hash(None, t),
    **{f"request_block_hashes[{a}]": _request_path(a) for a in HashAlgo},
    **{f"BlockHasher.extend[{a}]": _extend_path(a) for a in HashAlgo},
    "BlockHasher.key_of_prefix_block": lambda t: BlockHasher("v2_sha256", 8).key_of_prefix_block(
        t
    ),
}


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("path", list(TOKEN_PATHS))
def test_bad_tokens_are_rejected_with_the_value_named(path: str, bad: object) -> None:
    tokens = [3, 1, 4, 1, 5, 9, bad, 2]
    with pytest.raises(InvalidTokenError) as info:
        TOKEN_PATHS[path](tokens)
    assert isinstance(info.value, KVPoolError)
    assert isinstance(info.value, ValueError)
    shown = str(bad) if isinstance(bad, int) else repr(bad)
    assert shown in str(info.value)
    assert "position 6" in str(info.value)


@pytest.mark.parametrize("bad", ["1 2 3", b"\x01\x00\x00\x00", 7, None, np.array([1.5, 2.0]),
                                 np.array([[1, 2]])], ids=repr)
def test_non_sequences_of_tokens_are_rejected(bad: object) -> None:
    for path in TOKEN_PATHS.values():
        if isinstance(bad, str | bytes | int) or bad is None:
            with pytest.raises(InvalidTokenError, match=re.escape(repr(bad))):
                path(bad)
        else:
            with pytest.raises(InvalidTokenError, match="integer dtype"):
                path(bad)


def test_numpy_tokens_out_of_range_are_named() -> None:
    with pytest.raises(InvalidTokenError, match=r"position 1 is 2147483648"):
        tokens_to_u32(np.array([1, 2**31], dtype=np.int64))
    with pytest.raises(InvalidTokenError, match=r"position 2 is -4"):
        BlockHasher("v1_block_key", 2).extend(np.array([1, 2, -4], dtype=np.int32))


@pytest.mark.parametrize("bad", [0, -3, 2.0, "32", None, True], ids=repr)
def test_bad_tokens_per_block(bad: object) -> None:
    calls: list[Callable[[], object]] = [
        lambda: BlockHasher("v1_block_key", bad),  # type: ignore[arg-type]
        lambda: request_block_hashes([1, 2, 3], bad, "v2_sha256"),  # type: ignore[arg-type]
        lambda: v1_block_keys([1, 2, 3], bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            call()


@pytest.mark.parametrize("bad", ["sha1", "V1_BLOCK_KEY", "", "vllm_sha256", 3])
def test_unknown_algorithm(bad: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: BlockHasher(bad, 16),
        lambda: request_block_hashes([1, 2, 3], 16, bad),
        lambda: BlockHasher.root_key(bad),
        lambda: event_hash(bad, 5),
    ]
    for call in calls:
        with pytest.raises(UnknownHashAlgorithmError, match=re.escape(repr(bad))) as info:
            call()
        assert isinstance(info.value, KVPoolError)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.0, "5", True], ids=repr)
def test_bad_scope_ids(bad: object) -> None:
    calls: list[Callable[[], object]] = [
        lambda: v1_block_key([1], lora_id=bad),  # type: ignore[arg-type]
        lambda: v1_block_key([1], salt_id=bad),  # type: ignore[arg-type]
        lambda: v1_block_key([1], parent_hash=bad),  # type: ignore[arg-type]
        lambda: v2_root_key(lora_id=bad),  # type: ignore[arg-type]
        lambda: v2_root_key(salt_id=bad),  # type: ignore[arg-type]
        lambda: BlockHasher("v2_sha256", 4, lora_id=bad),  # type: ignore[arg-type]
        lambda: request_block_hashes([1, 2], 4, "v1_block_key", lora_id=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            call()


@pytest.mark.parametrize("bad", [7, b"salt", None], ids=repr)
def test_bad_cache_salt(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
        cache_salt_id(bad)  # type: ignore[arg-type]
    if bad is not None:  # None means "no salt" for the hasher
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            BlockHasher("v1_block_key", 4, cache_salt=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            request_block_hashes([1, 2], 4, "v2_sha256", cache_salt=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33, "00" * 32, 5], ids=repr)
def test_bad_digests(bad: object) -> None:
    calls: list[Callable[[], object]] = [
        lambda: v2_block_key(bad, [1]),  # type: ignore[arg-type]
        lambda: vllm_sha256_cbor_block_hash(bad, [1]),  # type: ignore[arg-type]
        lambda: vllm_event_int(bad),  # type: ignore[arg-type]
        lambda: event_hash(HashAlgo.V2_SHA256, bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            call()
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(-1))):
        event_hash(HashAlgo.V1_BLOCK_KEY, -1)


def test_bad_extra_keys() -> None:
    bad = object()
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
        vllm_sha256_cbor_block_hash(None, [1, 2], [bad])
    with pytest.raises(InvalidArgumentError, match="'lora-name'"):
        vllm_sha256_cbor_block_hash(None, [1, 2], "lora-name")


def test_failed_calls_leave_the_hasher_unchanged() -> None:
    hasher = BlockHasher("v1_block_key", 4)
    keys = hasher.extend([1, 2, 3, 4, 5, 6])
    with pytest.raises(InvalidTokenError):
        hasher.extend([7, 8, -1])
    with pytest.raises(InvalidArgumentError, match=r"1\.\.4 tokens, got 5"):
        hasher.key_of_prefix_block([1, 2, 3, 4, 5])
    assert hasher.keys == keys
    assert hasher.pending_tokens == 2
    assert hasher.partial_key() == ref_v1([5, 6], keys[-1])  # type: ignore[arg-type]
    assert hasher.extend([7, 8]) == [ref_v1([5, 6, 7, 8], keys[-1])]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# the compiled v1 kernel


def test_v1_backend_is_the_one_in_use(v1_backend: str) -> None:
    """The fixture really switches: under "jit" the kernel computes the keys, and under
    "python" it is never called."""
    tokens = array("I", range(64))
    if v1_backend == "jit":
        assert jit.backend().startswith("numba")
        assert jit.v1_chain(tokens, 32, 0, None, None) == v1_block_keys(tokens, 32)
    else:
        assert jit.v1_chain(tokens, 32, 0, None, None) is None
        assert jit.backend() == "python"


@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=120),
       tpb=st.integers(1, 40), parent=st.one_of(st.just(0), st.integers(0, M64)),
       salt=st.one_of(st.none(), st.integers(0, M64)),
       lora=st.one_of(st.none(), st.integers(0, M64)))
def test_v1_chains_with_any_parent_and_scope_match_the_reference(
    tokens: list[int], tpb: int, parent: int, salt: int | None, lora: int | None
) -> None:
    """Chains under a nonzero parent too (a salt then applies only where a parent is 0), on
    both sides of jit.V1_MIN_TOKENS, with ids beyond the premix table."""
    expected = []
    p = parent
    for i in range(0, len(tokens), tpb):
        p = ref_v1(tokens[i:i + tpb], p, lora, salt)
        expected.append(p)
    assert v1_block_keys(tokens, tpb, parent_hash=parent, lora_id=lora, salt_id=salt) == expected
    if tokens:
        assert v1_block_key(tokens, parent, lora_id=lora, salt_id=salt) == ref_v1(
            tokens, parent, lora, salt)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_kvpool_jit_environment_variable(setting: str) -> None:
    """KVPOOL_JIT=0 keeps numba out of the process; the default loads it when installed."""
    code = ("import sys; from kvpool.hashing import jit, keys as hashing; "
            "hashing.v1_block_keys(list(range(64)), 32); "
            "print(jit.backend(), 'numba' in sys.modules)")
    env = {**os.environ, "KVPOOL_JIT": setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    if setting == "0":
        assert out == ["python", "False"]
    elif "jit" in BACKENDS:
        assert out[0] == "numba" and out[-1] == "True"
    else:
        assert out[0] == "python"
